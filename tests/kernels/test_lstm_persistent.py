"""The persistent LSTM loop kernel (``_lstm_loop_kernel``: the whole forward or backward time loop in
one launch) against float64 truths — ``nn.LSTM`` with autograd, the float64 reference loops — and
against the per-step loop it replaces. Through Triton's interpreter on CPU (one program per batch block)
and natively on CUDA (column programs synchronised across the grid): ragged batch blocks, hidden sizes
that are not a power of two, several column tiles and K chunks, strided operands, the opaque operators
a compiled LSTM calls, the fallback when a launch fails."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from helpers import assert_close, recurrent_truth, refuse_loop_launches
from torchloom.kernels import recurrent as K
from torchloom.layers.lstm import LSTM, lstm_backward, lstm_forward

pytestmark = pytest.mark.usefixtures("cuda_default_device")


def _inputs(B, T, I, H, bias=True, dtype=torch.float32, scale=0.8):
    x = torch.randn(B, T, I)
    w_ih, w_hh = torch.randn(4 * H, I) * scale, torch.randn(4 * H, H) * (2.0 / H**0.5)
    b = torch.randn(4 * H) * 0.5 if bias else None
    g = torch.randn(B, T, H)
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(x), cast(w_ih), cast(w_hh), cast(b), cast(g)


def _reference_loops(proj, w_hh, g):
    """The float64 per-step reference loops: ``(pre, cell, hidden, gPre)``."""
    pre = proj.double().clone()
    B, T, H4 = pre.shape
    cell, hidden = pre.new_empty(B, T, H4 // 4), pre.new_empty(B, T, H4 // 4)
    K.lstm_forward_loop_steps(pre, w_hh.double(), cell, hidden, "reference")
    g_pre = torch.empty_like(pre)
    K.lstm_backward_loop_steps(g.double(), pre, cell, w_hh.double(), g_pre, pre.new_empty(B, H4 // 4),
                               pre.new_empty(B, H4 // 4), "reference")
    return pre, cell, hidden, g_pre


def test_launches_with_several_column_tiles_and_k_chunks_on_strided_operands():
    """The launcher alone with explicit settings (two column tiles per program, K in chunks of 16, so
    the forward's H and the backward's 4H both take several chunks), on time-major views (row stride
    ≠ T·width), a transposed W_hh and a row-padded grad_out, against the float64 reference loops."""
    B, T, H = 18, 4, 21
    proj = torch.randn(T, B, 4 * H + 3)[..., : 4 * H].transpose(0, 1)  # [B, T, 4H], strides (4H+3, B(4H+3), 1)
    w_hh = (torch.randn(H, 4 * H) * 0.3).T  # [4H, H], strides (1, 4H)
    g = torch.randn(B, T, H + 5)[..., :H]
    pre64, cell64, hid64, gpre64 = _reference_loops(proj, w_hh, g)
    st = K.RNNLoopSettings(block_b=16, block_n=16, block_k=16, col_tiles=2, col_programs=1, num_warps=4)
    pre = proj.clone()
    cell, hidden = torch.empty(T, B, H).transpose(0, 1), torch.empty(B, T, H)
    K._launch_lstm_loop(pre, cell, w_hh, hidden=hidden, settings=st)
    assert_close(hidden, hid64, name="hidden", rtol=1e-4, atol=1e-5)
    assert_close(cell, cell64, name="cell", rtol=1e-4, atol=1e-5)
    assert_close(pre, pre64, name="pre", rtol=1e-4, atol=1e-5)
    g_pre = torch.empty(T, B, 4 * H).transpose(0, 1)
    K._launch_lstm_loop(pre, cell, w_hh, grad_out=g, g_pre=g_pre, settings=st)
    assert_close(g_pre, gpre64, name="gPre", rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"LSTM loop: hidden must be \[B, T, 21\] .* unit last stride"):
        K._launch_lstm_loop(pre, cell, w_hh, hidden=hidden.transpose(0, 1).contiguous().transpose(0, 1)[..., :20])


def test_equals_the_per_step_loop(monkeypatch):
    """The layer's functional forward and backward on the loop kernel equal the per-step fused kernels
    (the same roundings: stored pre-activations, cell states, carries and dh in the tensors' dtype)."""
    B, T, I, H = 20, 7, 3, 40
    x, w_ih, w_hh, b, g = _inputs(B, T, I, H)
    results = []
    for persistent in (True, False):
        monkeypatch.setattr(K, "USE_PERSISTENT_LSTM", persistent)
        assert K.lstm_loop_uses_triton(x, B, H, "triton") == persistent
        y, saved = lstm_forward(x, w_ih, w_hh, b, backend="triton")
        results.append((y, saved.pre, saved.cell, *lstm_backward(g, saved, backend="triton")[1], ))
    for name, a, r in zip(("hidden", "pre", "cell", "dW_ih", "dW_hh", "db"), *results):
        assert_close(a, r, name=name, rtol=1e-5, atol=1e-5)
    y_truth, truth = recurrent_truth(nn.LSTM, x, w_ih, w_hh, b, g)
    assert_close(results[0][0], y_truth, name="hidden vs nn.LSTM", rtol=1e-5, atol=1e-5)


def test_dispatch(monkeypatch):
    x = torch.randn(2, 3, 4)
    assert K.lstm_loop_uses_triton(x, 2, 4, "triton")
    assert not K.lstm_loop_uses_triton(x, 2, 4, "reference")
    assert not K.lstm_loop_uses_triton(x.double(), 2, 4)  # float64: the reference, exact
    assert K.lstm_loop_uses_triton(x, 2, 4) == x.is_cuda  # CPU: the reference unless forced
    monkeypatch.setattr(K, "USE_PERSISTENT_LSTM", False)
    assert not K.lstm_loop_uses_triton(x, 2, 4, "triton")  # the per-step fused kernels instead


def test_a_kernel_that_cannot_launch_falls_back_once_with_a_warning(monkeypatch):
    """A compile or launch failure runs the per-step loop, warns once per shape, and gives its numbers;
    from then on that shape dispatches to the per-step loop in both directions (``lstm_loop_uses_triton``
    false: CUDA-graphed where it can be), and other shapes still launch the kernel."""
    calls = refuse_loop_launches(monkeypatch, K, "_launch_lstm_loop")
    B, T, H = 5, 4, 16
    proj, w_hh = torch.randn(B, T, 4 * H), torch.randn(4 * H, H) * 0.2
    pre_ref, cell_ref, hid_ref = proj.clone(), torch.empty(B, T, H), torch.empty(B, T, H)
    K.lstm_forward_loop_steps(pre_ref, w_hh, cell_ref, hid_ref, "triton")
    pre, cell, hidden = proj.clone(), torch.empty(B, T, H), torch.empty(B, T, H)
    with pytest.warns(RuntimeWarning, match="LSTM: the persistent loop kernel could not run .* using the per-step loop"):
        K.lstm_forward_loop(pre, w_hh, cell, hidden, backend="triton")
    assert torch.equal(hidden, hid_ref) and torch.equal(cell, cell_ref) and torch.equal(pre, pre_ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: the shape is remembered
        K.lstm_forward_loop(proj.clone(), w_hh, torch.empty(B, T, H), torch.empty(B, T, H), backend="triton")
        g_pre = torch.empty(B, T, 4 * H)
        K.lstm_backward_loop(torch.randn(B, T, H), pre, cell, w_hh, g_pre, backend="triton")
    assert len(calls) == 1
    assert not K.lstm_loop_uses_triton(proj, B, H, "triton")
    # a hidden size of a quarter (the backward's g_pre has 4·H' = H columns) is a different shape
    assert K.lstm_loop_uses_triton(proj, B, H // 4, "triton")
    K.lstm_backward_loop(torch.randn(B, T, H // 4), pre[..., :H], cell[..., : H // 4], w_hh[:H, : H // 4],
                         torch.empty(B, T, H), backend="triton")
    assert len(calls) == 2


def test_lstm_loop_operators_under_opcheck():
    """``torchloom::lstm_loop`` / ``lstm_loop_backward`` (the loops as opaque operators, which a compiled
    LSTM calls where the loop kernel applies): ``torch.library.opcheck`` passes (schema, fake tensors,
    the declared mutation: the forward writes the pre-activations into ``proj``), and with
    ``backend="triton"`` (the loop kernel) the values are those of the float64 reference loops; a
    compiled functional LSTM hands its ``backend`` to them."""
    torch.manual_seed(0)
    B, T, H = 3, 4, 5
    proj, g = torch.randn(B, T, 4 * H), torch.randn(B, T, H)
    w_hh = torch.randn(4 * H, H) * 0.4
    pre64, cell64, hid64, gpre64 = _reference_loops(proj, w_hh, g)
    torch.library.opcheck(torch.ops.torchloom.lstm_loop.default, (proj.clone(), w_hh, "triton"))
    pre = proj.clone()
    cell, hidden = torch.ops.torchloom.lstm_loop(pre, w_hh, "triton")  # the kernel (on CPU: the interpreter); pre written
    for name, got, want in (("pre", pre, pre64), ("cell", cell, cell64), ("hidden", hidden, hid64)):
        assert_close(got, want.float(), name=name, rtol=1e-5, atol=1e-6)
    torch.library.opcheck(torch.ops.torchloom.lstm_loop_backward.default, (g, pre, cell, w_hh, "triton"))
    g_pre = torch.ops.torchloom.lstm_loop_backward(g, pre, cell, w_hh, "triton")
    assert_close(g_pre, gpre64.float(), name="gPre", rtol=1e-5, atol=1e-6)
    launches = []
    real = K._launch_lstm_loop

    def counting(*args, **kwargs):
        launches.append(kwargs.get("hidden") is None)
        return real(*args, **kwargs)

    x = torch.randn(B, T, 3)
    w_ih = torch.randn(4 * H, 3) * 0.5
    run = lambda x: lstm_forward(x, w_ih, w_hh, None, backend="triton")[0]  # noqa: E731
    torch._dynamo.reset()
    try:
        K._launch_lstm_loop = counting
        y = torch.compile(run, backend="aot_eager", fullgraph=True)(x)
    finally:
        K._launch_lstm_loop = real
        torch._dynamo.reset()
    assert launches == [False], "the compiled forward did not run the loop kernel it was asked for"
    assert_close(y, run(x), name="compiled hidden", rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------ GPU only
@pytest.mark.cuda
@pytest.mark.parametrize("B,T,H", [(64, 64, 256), (32, 128, 256), (64, 16, 512), (5, 9, 1000), (256, 6, 256)])
def test_cuda_kernel_matches_the_graphed_step_loop(B, T, H, monkeypatch):
    """At the benchmark's sizes (many column programs per batch block, so the grid-wide wait really
    synchronises; B = 256 takes 16 × 32 tiles): the default path is the loop kernel, equal to the graphed
    per-step loop (cuBLAS products, fused cell kernels) in fp32 and the same from run to run; with TF32
    allowed it stays within TF32's error; bfloat16 within bfloat16's."""
    layer = LSTM(H, H, device="cuda")
    x, g = torch.randn(B, T, H), torch.randn(B, T, H)
    assert K.lstm_loop_uses_triton(x, B, H)
    st = K._lstm_loop_settings(x, B, H)
    assert st.col_programs > 1 and -(-B // st.block_b) * st.col_programs <= K._sm_count(x.device.index or 0)
    params = tuple(p.detach() for p in (layer.weight_ih, layer.weight_hh, layer.bias))

    def run(x, g, params, persistent):
        monkeypatch.setattr(K, "USE_PERSISTENT_LSTM", persistent)
        y, saved = lstm_forward(x, *params)
        gx, grads = lstm_backward(g, saved)
        return (y, gx, *grads)

    tf32 = torch.backends.cudnn.allow_tf32
    try:
        for allow, tol in ((False, 2e-5), (True, 1e-2)):
            torch.backends.cudnn.allow_tf32 = allow  # PyTorch's RNN switch (the reference loop: cuBLAS, exact)
            ref = run(x, g, params, False)
            got = run(x, g, params, True)
            for n, a, r in zip(("hidden", "dx", "dW_ih", "dW_hh", "db"), got, ref):
                assert_close(a, r, name=f"{n} (tf32={allow})", rtol=tol, atol=tol * max(1.0, r.abs().max().item()))
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    bf = lambda t: t.bfloat16()  # noqa: E731
    ref = run(bf(x), bf(g), tuple(map(bf, params)), False)
    got = run(bf(x), bf(g), tuple(map(bf, params)), True)
    for n, a, r in zip(("hidden", "dx", "dW_ih", "dW_hh", "db"), got, ref):
        assert_close(a.float(), r.float(), name=f"{n} (bf16)", rtol=5e-2, atol=5e-2 * max(1.0, r.abs().max().item()))
    # a race between the programs would show as run-to-run differences
    monkeypatch.setattr(K, "USE_PERSISTENT_LSTM", True)
    y, saved = lstm_forward(x, *params)
    runs = [lstm_backward(g, saved)[1][1] for _ in range(10)] + [lstm_forward(x, *params)[0] for _ in range(10)]
    assert all(torch.equal(r, runs[0]) for r in runs[1:10]) and all(torch.equal(r, y) for r in runs[10:])
    assert not y.isnan().any() and not runs[0].isnan().any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_trained_inside_captured_steps_like_eager_steps():
    """train() captures the LSTM's loop kernel (and its sentinel fill) in its CUDA graphs: the same
    losses and weights as the eager device steps."""
    import torchloom
    from torchloom import Dense, LastStep, Network, TrainingConfig

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 6, 5, generator=g, device="cpu").cuda(), torch.randint(0, 3, (32,), generator=g, device="cpu").cuda())
            for _ in range(20)]
    runs = []
    for graph in (True, False):
        torch.manual_seed(0)
        net = Network(LSTM(5, 48), LastStep(), Dense(48, 3, "linear")).cuda()
        assert K.lstm_loop_uses_triton(data[0][0], 32, 48)
        cfg = TrainingConfig(epochs=3, learning_rate=0.05, loss_type="cross_entropy", verbose=0, cuda_graph=graph, device="cuda")
        result = torchloom.train(net, data, cfg)
        runs.append((result.loss_history, [p.detach().clone() for p in net.parameters()]))
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-5)
    for p, q in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _emulated_loops(proj, w_hh, g, dtype):
    """The loops in float64 with every stored value rounded to ``dtype`` where the kernel stores or
    carries it: the pre-activations after the product, ``c_t`` (``h_t`` from the unrounded ``c_t``),
    ``dh``, the carry ``κ`` and ``gPre``. Returns ``(pre, cell, hidden, gPre)`` as float64."""
    r = lambda t: t.to(dtype).double()  # noqa: E731
    proj, w, g = proj.double(), w_hh.double(), g.double()
    B, T, H4 = proj.shape
    H = H4 // 4
    pre, cell, hid = torch.empty_like(proj), proj.new_empty(B, T, H), proj.new_empty(B, T, H)
    for t in range(T):
        p = proj[:, t] if t == 0 else r(proj[:, t] + hid[:, t - 1] @ w.t())
        i, f, gg, o = torch.sigmoid(p[:, :H]), torch.sigmoid(p[:, H : 2 * H]), torch.tanh(p[:, 2 * H : 3 * H]), torch.sigmoid(p[:, 3 * H :])
        c = i * gg + (f * cell[:, t - 1] if t > 0 else 0)
        pre[:, t], cell[:, t], hid[:, t] = p, r(c), r(o * torch.tanh(c))
    g_pre, kappa = torch.empty_like(proj), None
    for t in range(T - 1, -1, -1):
        dh = g[:, t] if t == T - 1 else r(g[:, t] + g_pre[:, t + 1] @ w)
        p = pre[:, t]
        i, f, gg, o = torch.sigmoid(p[:, :H]), torch.sigmoid(p[:, H : 2 * H]), torch.tanh(p[:, 2 * H : 3 * H]), torch.sigmoid(p[:, 3 * H :])
        tc = torch.tanh(cell[:, t])
        dc = dh * o * (1 - tc * tc) + (kappa if kappa is not None else 0)
        cp = cell[:, t - 1] if t > 0 else torch.zeros_like(tc)
        g_pre[:, t] = r(torch.cat((dc * gg * i * (1 - i), dc * cp * f * (1 - f), dc * i * (1 - gg * gg), dh * tc * o * (1 - o)), 1))
        kappa = r(dc * f)
    return pre, cell, hid, g_pre


@pytest.mark.parametrize("dtype", [
    pytest.param(torch.bfloat16, marks=pytest.mark.cuda, id="bf16"),  # Triton's interpreter truncates to bfloat16
    pytest.param(torch.float16, id="fp16"),
])
def test_half_precision_rounds_where_the_per_step_loop_does(dtype):
    """In half precision the kernel stores and carries what the per-step loop stores (pre-activations
    after the product, cell states, ``dh``, ``κ``, ``gPre``), each rounded to the dtype: against a
    float64 emulation of exactly those roundings, almost every element is bit-equal (the fp32 sums
    and exp of the kernel flip a rounding only near a tie); leaving one of the roundings out makes a
    large share of the elements differ."""
    torch.manual_seed(0)
    B, T, H = 20, 4, 24
    proj = (torch.randn(B, T, 4 * H) * 1.5).to(dtype)
    w_hh, g = (torch.randn(4 * H, H) * 0.4).to(dtype), torch.randn(B, T, H).to(dtype)
    pre, cell, hidden = proj.clone(), torch.empty(B, T, H, dtype=dtype), torch.empty(B, T, H, dtype=dtype)
    K.lstm_forward_loop(pre, w_hh, cell, hidden, backend="triton")
    g_pre = torch.empty(B, T, 4 * H, dtype=dtype)
    K.lstm_backward_loop(g, pre, cell, w_hh, g_pre, backend="triton")
    want = _emulated_loops(proj, w_hh, g, dtype)
    for name, got, ref in zip(("pre", "cell", "hidden", "gPre"), (pre, cell, hidden, g_pre), want):
        same = (got.double() == ref).double().mean().item()
        assert same >= 0.97, f"{name}: only {same:.1%} of the elements equal the rounding emulation"
