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

from helpers import assert_close, recurrent_truth
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
    """A compile or launch failure runs the per-step loop, warns once per shape, and gives its numbers."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("Triton Error [CUDA]: too many blocks in cooperative launch")

    monkeypatch.setattr(K, "_launch_lstm_loop", refuse)
    monkeypatch.setattr(K, "_failed", set())
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
    assert len(calls) == 1


def test_lstm_loop_operators_under_opcheck():
    """``torchloom::lstm_loop`` / ``lstm_loop_backward`` (the loops as opaque operators, which a compiled
    LSTM calls where the loop kernel applies): ``torch.library.opcheck`` passes (schema, fake tensors,
    no mutation of the inputs), and the values are those of the float64 reference loops."""
    if not K._LOOP_OPS:
        pytest.skip("torch.library.custom_op is missing")
    torch.manual_seed(0)
    B, T, H = 3, 4, 5
    proj, g = torch.randn(B, T, 4 * H), torch.randn(B, T, H)
    w_hh = torch.randn(4 * H, H) * 0.4
    pre64, cell64, hid64, gpre64 = _reference_loops(proj, w_hh, g)
    torch.library.opcheck(torch.ops.torchloom.lstm_loop.default, (proj, w_hh))
    pre, cell, hidden = torch.ops.torchloom.lstm_loop(proj, w_hh)
    for name, got, want in (("pre", pre, pre64), ("cell", cell, cell64), ("hidden", hidden, hid64)):
        assert_close(got, want.float(), name=name, rtol=1e-5, atol=1e-6)
    torch.library.opcheck(torch.ops.torchloom.lstm_loop_backward.default, (g, pre, cell, w_hh))
    g_pre = torch.ops.torchloom.lstm_loop_backward(g, pre, cell, w_hh)
    assert_close(g_pre, gpre64.float(), name="gPre", rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------ GPU only
@pytest.mark.cuda
@pytest.mark.parametrize("B,T,H", [(64, 64, 256), (32, 128, 256), (64, 16, 512), (5, 9, 1000)])
def test_cuda_kernel_matches_the_graphed_step_loop(B, T, H, monkeypatch):
    """At the benchmark's sizes (many column programs per batch block, so the grid-wide wait really
    synchronises): the default path is the loop kernel, equal to the graphed per-step loop (cuBLAS
    products, fused cell kernels) in fp32 and the same from run to run; with TF32 allowed it stays
    within TF32's error; bfloat16 within bfloat16's."""
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

    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for allow, tol in ((False, 2e-5), (True, 1e-2)):
            torch.backends.cuda.matmul.allow_tf32 = allow
            ref = run(x, g, params, False)
            got = run(x, g, params, True)
            for n, a, r in zip(("hidden", "dx", "dW_ih", "dW_hh", "db"), got, ref):
                assert_close(a, r, name=f"{n} (tf32={allow})", rtol=tol, atol=tol * max(1.0, r.abs().max().item()))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
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
