"""The persistent Elman-RNN loop kernel (``_rnn_loop_kernel``: the whole forward or backward time loop
in one launch) against float64 truths: ``nn.RNN`` with autograd through the layer's functional
forward/backward, and the reference loops. Through Triton's interpreter on CPU (one program per batch
block) and natively on CUDA (column programs synchronised across the grid): ragged batch blocks,
hidden sizes that are not a power of two, one step, strided operands, half precision."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from helpers import assert_close, fresh_interpreter_output, recurrent_truth, refuse_loop_launches
from torchloom.kernels import recurrent as K
from torchloom.layers.rnn import RNN, rnn_backward, rnn_forward

pytestmark = pytest.mark.usefixtures("cuda_default_device")

# (B, T, I, H, bias): B below / above one batch block of 16, H ragged over 16-wide column and K tiles.
SHAPES = [(3, 5, 4, 37, True), (20, 1, 3, 16, True), (17, 5, 2, 40, False)]


def _ids(s):
    return f"B{s[0]}T{s[1]}I{s[2]}H{s[3]}-{'bias' if s[4] else 'nobias'}"


def _inputs(B, T, I, H, bias, dtype=torch.float32):
    x = torch.randn(B, T, I)
    w_ih, w_hh = torch.randn(H, I) * 0.5, torch.randn(H, H) * (1.5 / H**0.5)
    b = torch.randn(H) * 0.5 if bias else None
    g = torch.randn(B, T, H)
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(x), cast(w_ih), cast(w_hh), cast(b), cast(g)


def _truth(x, w_ih, w_hh, b, g):
    return recurrent_truth(nn.RNN, x, w_ih, w_hh, b, g)


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_layer_on_the_kernel_matches_nn_rnn(shape):
    x, w_ih, w_hh, b, g = _inputs(*shape)
    assert K.rnn_loop_uses_triton(x, shape[0], shape[3], "triton")
    y, saved = rnn_forward(x, w_ih, w_hh, b, backend="triton")
    y_truth, truth = _truth(x, w_ih, w_hh, b, g)
    assert_close(y, y_truth, name="hidden", rtol=1e-5, atol=1e-5)
    # saved.pre is the exact pre-activation x_t W_ihᵀ + b + h_{t−1} W_hhᵀ (the kernel writes it back)
    h_prev = torch.cat([torch.zeros_like(y_truth[:, :1]), y_truth[:, :-1]], 1)
    pre = x.double() @ w_ih.double().T + h_prev @ w_hh.double().T + (0 if b is None else b.double())
    assert_close(saved.pre, pre, name="pre", rtol=1e-5, atol=1e-5)
    gx, (gw_ih, gw_hh, gb) = rnn_backward(g, saved, backend="triton")
    for name, got, want in zip(("grad input", "grad weight_ih", "grad weight_hh", "grad bias"), (gx, gw_ih, gw_hh, gb), truth):
        assert_close(got, want, name=name, rtol=1e-4, atol=1e-4)
    if b is None:
        assert gb is None
    # the reference loop (on CUDA: the graphed cuBLAS loop) gives the same numbers
    y_ref, saved_ref = rnn_forward(x, w_ih, w_hh, b, backend="reference")
    assert_close(y, y_ref, name="hidden vs reference", rtol=1e-4, atol=1e-5)
    gx_ref, _ = rnn_backward(g, saved_ref, backend="reference")
    assert_close(gx, gx_ref, name="grad input vs reference", rtol=1e-4, atol=1e-5)


def test_loops_alone_on_strided_operands():
    """The launchers on time-major views (row stride ≠ T·H), a transposed W_hh and a row-padded
    grad_out."""
    B, T, H = 18, 4, 21
    pre = torch.randn(T, B, H + 3)[..., :H].transpose(0, 1)  # [B, T, H], strides (H+3, B(H+3), 1)
    w_hh = (torch.randn(H, H) * 0.4).T  # strides (1, H)
    hidden = torch.empty(T, B, H).transpose(0, 1)
    pre64, hid64 = pre.double(), torch.empty(B, T, H, dtype=torch.float64)
    K.rnn_forward_loop_ref(pre64, w_hh.double(), hid64)
    # two column tiles per program, two K chunks
    st = K.RNNLoopSettings(block_b=16, block_n=16, block_k=16, col_tiles=2, col_programs=1, num_warps=4)
    K._launch_rnn_loop(hidden, pre, pre, w_hh, backward=False, settings=st)
    assert_close(hidden, hid64, name="hidden", rtol=1e-4, atol=1e-5)
    assert_close(pre, pre64, name="pre", rtol=1e-4, atol=1e-5)

    g = torch.randn(B, T, H + 5)[..., :H]
    g_pre = torch.empty(B, T, H)
    K.rnn_backward_loop(g, w_hh, hidden, g_pre, backend="triton")
    g64 = 1.0 - hid64 * hid64
    K.rnn_backward_loop_ref(g.double(), w_hh.double(), g64, torch.empty(B, H, dtype=torch.float64))
    assert_close(g_pre, g64, name="gPre", rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="unit last stride"):
        K.rnn_forward_loop(pre.transpose(1, 2), w_hh, hidden.transpose(1, 2), backend="triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_within_dtype_tolerance(dtype):
    """Half inputs and weights: error against the float64 truth at most twice that of the reference
    loop run in the same dtype, plus a small floor."""
    shape = (19, 6, 5, 24, True)
    x, w_ih, w_hh, b, g = _inputs(*shape, dtype=dtype)
    y, saved = rnn_forward(x, w_ih, w_hh, b, backend="triton")
    gx, grads = rnn_backward(g, saved, backend="triton")
    y_low, saved_low = rnn_forward(x, w_ih, w_hh, b, backend="reference")
    gx_low, grads_low = rnn_backward(g, saved_low, backend="reference")
    y64, truth = _truth(x.double(), w_ih.double(), w_hh.double(), b.double(), g.double())
    for name, got, want, lo in zip(("hidden", "dx", "dW_ih", "dW_hh", "db"), (y, gx, *grads), (y64, *truth),
                                   (y_low, gx_low, *grads_low)):
        assert got.dtype == dtype, name
        err = (got.double() - want).abs().max().item()
        lo_err = (lo.double() - want).abs().max().item()
        floor = 2 * torch.finfo(dtype).eps * want.abs().max().item()
        assert err <= 2 * lo_err + floor, f"{name}: error {err:.3e} vs the reference loop's {lo_err:.3e}"


def test_dispatch():
    x = torch.randn(2, 3, 4)
    assert K.rnn_loop_uses_triton(x, 2, 4, "triton")
    assert not K.rnn_loop_uses_triton(x, 2, 4, "reference")
    assert not K.rnn_loop_uses_triton(x.double(), 2, 4)  # float64: the reference, exact
    assert K.rnn_loop_uses_triton(x, 2, 4) == x.is_cuda  # CPU: the reference unless forced


_SWITCH_CASES = r"""
import torch
from torchloom.kernels import recurrent as K
b = torch.backends
got = [K._rnn_allows_tf32()]  # PyTorch's default
b.cuda.matmul.allow_tf32 = True
b.cudnn.allow_tf32 = False  # the legacy switch sets every cuDNN op
got.append(K._rnn_allows_tf32())  # matmul's TF32 does not carry over
b.cuda.matmul.allow_tf32 = False
for rnn, cudnn, generic in CASES:  # the new API only from here on (PyTorch refuses some mixes)
    b.fp32_precision, b.cudnn.fp32_precision, b.cudnn.rnn.fp32_precision = generic, cudnn, rnn
    got.append(K._rnn_allows_tf32())
print(got)
"""


def test_fp32_products_follow_pytorchs_rnn_switch():
    """TF32 exactly where cuDNN's RNN would use it, after settings made through PyTorch's own API (the
    generic, then cuDNN's, then the RNN's ``fp32_precision``; PyTorch hands a parent's setting down to
    its ops, so an RNN set to "none" after them keeps what they gave it); the legacy ``allow_tf32``
    (which sets every cuDNN op) agrees; cuBLAS's matmul switch plays no part. The resolution chain
    itself: tests/kernels/test_fp32_matmul.py. In a fresh interpreter: the settings are process-wide,
    and PyTorch refuses to read some mixes of its two APIs afterwards."""
    if not hasattr(getattr(torch.backends.cudnn, "rnn", None), "fp32_precision"):
        pytest.skip("this torch has no fp32_precision settings")
    cases = [  # (rnn, cudnn, generic) → TF32?
        (("ieee", "none", "none"), False), (("tf32", "ieee", "ieee"), True), (("none", "tf32", "ieee"), True),
        (("none", "ieee", "tf32"), False), (("none", "none", "tf32"), True), (("none", "none", "none"), False),
    ]
    code = _SWITCH_CASES.replace("CASES", repr([c for c, _ in cases]))
    assert fresh_interpreter_output(code) == repr([True, False] + [want for _, want in cases])
    x = torch.randn(2, 3)
    assert K._dot_precision(x) == "ieee"  # the interpreter multiplies in numpy's fp32 whatever the switch


_TRACED_SWITCH_CASES = r"""
import itertools, torch
from torchloom.kernels._triton import cublas_allows_tf32, cudnn_rnn_allows_tf32
from torchloom.kernels.recurrent import allows_tf32_traced
compiles = []
def backend(gm, example_inputs):
    compiles.append(1)
    return gm
@torch.compile(backend=backend, fullgraph=True)
def answers(x):
    return x * (1 + int(allows_tf32_traced("rnn")) + 2 * int(allows_tf32_traced("matmul")))
b, x, wrong, cases = torch.backends, torch.ones(1), 0, 0
for rnn, cudnn, generic, mm in itertools.product(("none", "ieee", "tf32"), repeat=4):
    b.cudnn.rnn.fp32_precision, b.cudnn.fp32_precision, b.fp32_precision = rnn, cudnn, generic
    b.cuda.matmul.fp32_precision = mm
    want = 1 + int(cudnn_rnn_allows_tf32()) + 2 * int(cublas_allows_tf32())
    cases += 1
    wrong += int(answers(x).item() != want)
print(cases, wrong, 1 < len(compiles) <= 8)
"""


def test_the_switches_read_while_compiling_retrace_when_they_change():
    """``allows_tf32_traced``, which a compiled recurrent layer reads to choose how its products are
    traced: inside ``torch.compile(fullgraph=True)`` (no graph break) it answers as the getters the
    eager kernels use (``_allows_tf32``), for every one of the 81 settings of the RNN's, cuDNN's,
    the generic and cuBLAS's ``fp32_precision``, set one after another: each change that changes an
    answer retraced the graph (at most 8 traces, Dynamo's limit, for the 4 distinct answers)."""
    if not hasattr(getattr(torch.backends.cudnn, "rnn", None), "fp32_precision"):
        pytest.skip("this torch has no fp32_precision settings")
    assert fresh_interpreter_output(_TRACED_SWITCH_CASES) == "81 0 True"


def test_graphs_launch_the_kernels_only_where_the_eager_code_would(monkeypatch):
    """``compiled_plan`` hands a compiled layer's kernels to Inductor only where ``torch.compile`` can
    launch them and the eager code runs them (``_kernels_launchable_in_graphs``): not under Triton's
    interpreter, without Triton, on a torch without ``torch.library.triton_op`` or without the
    ``fp32_precision`` settings; the opaque operators then decide at run time. Off CUDA never."""
    _triton = pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert K._kernels_launchable_in_graphs() == hasattr(torch.library, "triton_op")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not K._kernels_launchable_in_graphs()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(K, "triton", None)
    assert not K._kernels_launchable_in_graphs()
    monkeypatch.setattr(K, "triton", _triton)
    monkeypatch.delattr(torch.library, "triton_op", raising=False)
    assert not K._kernels_launchable_in_graphs()
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delattr(torch._C, "_get_fp32_precision_getter", raising=False)
    assert not K._kernels_launchable_in_graphs()
    assert K.compiled_plan(torch.randn(2, 3, device="cpu")) is None


@pytest.mark.cuda
def test_cuda_fp32_precision_of_the_kernel_follows_the_switch():
    """On CUDA the kernel's fp32 product precision is the switch's (the test suite runs with cuDNN's
    TF32 off: tests/conftest.py), half inputs whatever it says."""
    x = torch.randn(2, 3, device="cuda")
    old = torch.backends.cudnn.allow_tf32
    try:
        for allow, want in ((True, "tf32"), (False, K._FP32_PRODUCT)):
            torch.backends.cudnn.allow_tf32 = allow
            assert K._dot_precision(x) == want
            assert K._dot_precision(x.bfloat16()) == "ieee"  # tensor cores anyway
    finally:
        torch.backends.cudnn.allow_tf32 = old


# ------------------------------------------------------------------------------------ GPU only
@pytest.mark.cuda
@pytest.mark.parametrize("B,T,H", [(64, 64, 256), (32, 128, 256), (64, 16, 512), (5, 9, 1000)])
def test_cuda_kernel_matches_graphed_loop(B, T, H):
    """At the benchmark's sizes (many column programs per batch block, so the grid-wide wait really
    synchronises): the default path is the kernel, equal to the graphed cuBLAS loop in fp32 and the
    same from run to run; with TF32 allowed it stays within TF32's error."""
    layer = RNN(H, H, device="cuda")
    x, g = torch.randn(B, T, H), torch.randn(B, T, H)
    assert K.rnn_loop_uses_triton(x, B, H)
    st = K._rnn_loop_settings(x, B, H)
    assert st.col_programs > 1 and -(-B // st.block_b) * st.col_programs <= K._sm_count(x.device.index or 0)
    params = (layer.weight_ih.detach(), layer.weight_hh.detach(), layer.bias.detach())
    y_ref, saved_ref = rnn_forward(x, *params, backend="reference")
    gx_ref, grads_ref = rnn_backward(g, saved_ref, backend="reference")
    tf32 = torch.backends.cudnn.allow_tf32
    try:
        for allow, tol in ((False, 2e-5), (True, 1e-2)):
            torch.backends.cudnn.allow_tf32 = allow  # PyTorch's RNN switch (the reference loop: cuBLAS, exact)
            y, saved = rnn_forward(x, *params)
            gx, grads = rnn_backward(g, saved)
            assert_close(y, y_ref, name=f"hidden (tf32={allow})", rtol=tol, atol=tol)
            assert_close(gx, gx_ref, name=f"grad input (tf32={allow})", rtol=tol, atol=tol)
            for n, a, r in zip(("dW_ih", "dW_hh", "db"), grads, grads_ref):
                assert_close(a, r, name=f"{n} (tf32={allow})", rtol=tol, atol=tol * max(1.0, r.abs().max().item()))
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    # a race between the programs would show as run-to-run differences
    runs = []
    for _ in range(20):
        hidden = torch.empty_like(saved.pre)
        K._launch_rnn_loop(hidden, saved.pre.clone(), saved.pre, layer.weight_hh.detach(), backward=False)
        runs.append(hidden)
    assert all(torch.equal(r, runs[0]) for r in runs[1:]) and not runs[0].isnan().any()


@pytest.mark.cuda
def test_cuda_fallbacks():
    x = torch.randn(2, 3, 4)
    assert not K.rnn_loop_uses_triton(x, 2, K._RNN_MAX_HIDDEN + 1)  # too wide: the graphed loop
    with pytest.raises(ValueError, match="no persistent-loop grid"):
        K.rnn_loop_uses_triton(x, 2, K._RNN_MAX_HIDDEN + 1, "triton")
    assert not K.rnn_loop_uses_triton(x, 4096, 1024)  # no grid of one program per SM
    previous, K.USE_PERSISTENT_RNN = K.USE_PERSISTENT_RNN, False
    try:
        assert not K.rnn_loop_uses_triton(x, 2, 4)
        assert K.rnn_loop_uses_triton(x, 2, 4, "triton")
    finally:
        K.USE_PERSISTENT_RNN = previous


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_trained_inside_captured_steps_like_eager_steps():
    """train() captures the RNN's kernel (and its sentinel fill) in its CUDA graphs: the same losses and
    weights as the eager device steps."""
    import torchloom
    from torchloom import Dense, LastStep, Network, TrainingConfig

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 6, 5, generator=g, device="cpu").cuda(), torch.randint(0, 3, (32,), generator=g, device="cpu").cuda()) for _ in range(20)]
    runs = []
    for graph in (True, False):
        torch.manual_seed(0)
        net = Network(RNN(5, 48), LastStep(), Dense(48, 3, "linear")).cuda()
        cfg = TrainingConfig(epochs=3, learning_rate=0.05, loss_type="cross_entropy", verbose=0, cuda_graph=graph, device="cuda")
        result = torchloom.train(net, data, cfg)
        runs.append((result.loss_history, [p.detach().clone() for p in net.parameters()]))
    assert K._cooperative[0]  # a cooperative launch: CUDA started it with every program resident
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-5)
    for p, q in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _check_both_loops(B: int, T: int, H: int, st) -> None:
    """The kernel's forward and backward loops at ``[B, T, H]`` with settings ``st`` against the float64
    reference loops."""
    pre, w_hh = torch.randn(B, T, H), torch.randn(H, H) * (1.5 / H**0.5)
    hidden = torch.empty(B, T, H)
    pre64, hid64 = pre.double(), torch.empty(B, T, H, dtype=torch.float64)
    K.rnn_forward_loop_ref(pre64, w_hh.double(), hid64)
    K._launch_rnn_loop(hidden, pre, pre, w_hh, backward=False, settings=st)
    assert_close(hidden, hid64, name="hidden", rtol=1e-4, atol=1e-5)
    g, g_pre = torch.randn(B, T, H), torch.empty(B, T, H)
    K._launch_rnn_loop(g_pre, g, hidden, w_hh, backward=True, settings=st)
    g64 = 1.0 - hid64 * hid64
    K.rnn_backward_loop_ref(g.double(), w_hh.double(), g64, torch.empty(B, H, dtype=torch.float64))
    assert_close(g_pre, g64, name="gPre", rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bb,bn,bk", [(32, 32, 64), (64, 64, 128), (64, 128, 256)])
def test_the_wider_tiles_of_large_grids(bb, bn, bk):
    """The tile shapes ``_rnn_loop_settings`` picks for large batches or hidden sizes (wider than the
    16 × 16 of the default shapes), forward and backward against the float64 reference loops."""
    B, T, H = 70, 3, 150
    st = K.RNNLoopSettings(block_b=bb, block_n=bn, block_k=bk, col_tiles=-(-H // bn), col_programs=1, num_warps=4)
    _check_both_loops(B, T, H, st)


@pytest.mark.parametrize("resident,in_place", [(True, True), (True, False), (False, True)],
                         ids=["held-in-place", "held-copy", "re-read"])
def test_w_held_across_the_loop_or_re_read(resident, in_place, monkeypatch):
    """One column tile and one K chunk covering H: the program's slice of W_hh is loaded once and held
    across the loop (``W_RESIDENT``; the forward's W_hhᵀ read in place, or from a row-major copy), or
    re-read every step; forward and backward against the float64 reference loops either way."""
    B, T, H = 20, 4, 24
    st = K.RNNLoopSettings(block_b=16, block_n=32, block_k=32, col_tiles=1, col_programs=1, num_warps=4)
    monkeypatch.setattr(K, "_RNN_W_RESIDENT", resident)
    monkeypatch.setattr(K, "_RNN_W_IN_PLACE", in_place)
    assert K._w_resident(st, H, torch.float32) is resident
    _check_both_loops(B, T, H, st)
    # a slice too large to hold in registers is re-read whatever the switch says
    wide = st._replace(block_b=32, block_n=256, block_k=256)
    assert not K._w_resident(wide, 150, torch.float32)


def test_tf32_rounding_keeps_nan_and_inf():
    """``_round_tf32``: finite values to the nearest TF32 (10 mantissa bits), NaN (any payload) and
    ±Inf unchanged — the bit trick alone turns the GPU's NaN 0x7FFFFFFF into −0."""
    from torchloom.kernels._tl import jit, tl

    @jit
    def round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        m = offs < n
        tl.store(y_ptr + offs, K._round_tf32(tl.load(x_ptr + offs, mask=m, other=0.0)), mask=m)

    bits = torch.tensor([0x7FFFFFFF, 0x7FC00000, 0x7F800000, -0x800000], dtype=torch.int32)  # NaN, NaN, +Inf, -Inf
    specials = bits.view(torch.float32)
    finite = torch.randn(60)
    x = torch.cat([specials, finite])
    y = torch.empty_like(x)
    round_kernel[(1,)](x, y, x.numel(), BLOCK=64)
    y = y.cpu()
    assert torch.isnan(y[:2]).all() and y[2] == float("inf") and y[3] == float("-inf")
    want = ((finite.cpu().view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)  # the tests' default device may be CUDA
    assert torch.equal(y[4:], want)


def test_a_kernel_that_cannot_launch_falls_back_once_with_a_warning(monkeypatch):
    """A compile or launch failure (e.g. CUDA refusing the cooperative grid) runs the reference loop,
    warns once per shape, and gives the reference's numbers."""
    calls = refuse_loop_launches(monkeypatch, K, "_launch_rnn_loop")
    B, T, H = 5, 4, 16
    pre, w_hh = torch.randn(B, T, H), torch.randn(H, H) * 0.2
    pre_ref, hid_ref = pre.clone(), torch.empty(B, T, H)
    K.rnn_forward_loop_ref(pre_ref, w_hh, hid_ref)
    hidden = torch.empty(B, T, H)
    with pytest.warns(RuntimeWarning, match="could not run .* using the per-step loop"):
        K.rnn_forward_loop(pre, w_hh, hidden, backend="triton")
    assert torch.equal(hidden, hid_ref) and torch.equal(pre, pre_ref)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: the shape is remembered
        K.rnn_forward_loop(pre_ref.clone(), w_hh, torch.empty(B, T, H), backend="triton")
    assert len(calls) == 1


@pytest.mark.parametrize("fused", [False, True], ids=["cublas-projection", "fp32_matmul-projection"])
def test_rnn_forward_operators_under_opcheck(fused, monkeypatch):
    """``torchloom::rnn_forward`` / ``rnn_loop_backward`` (the RNN's forward from its input, and its
    backward loop, as opaque operators, which a compiled RNN calls where the kernel applies and
    ``compiled_plan`` has no plan):
    ``torch.library.opcheck`` passes (schema, fake tensors, no input written), and the values are those
    of the float64 projection and reference loops. ``fused``: the projection is ``fp32_matmul``'s, which
    also writes the loop's sentinel flags (forced here; on CPU the interpreter runs both kernels)."""
    if fused:
        monkeypatch.setattr(K, "gemm_precision", lambda a, b, backend: "ieee")
    torch.manual_seed(0)
    B, T, I, H = 3, 4, 6, 5
    x2, w_ih_t, bias, g = torch.randn(B * T, I), torch.randn(I, H) * 0.4, torch.randn(H), torch.randn(B, T, H)
    w_hh = torch.randn(H, H) * 0.4
    for b in (bias, None):
        torch.library.opcheck(torch.ops.torchloom.rnn_forward.default, (x2, w_ih_t, b, w_hh, B, T, "triton"))
    pre_ref = (x2.double() @ w_ih_t.double() + bias.double()).view(B, T, H)
    hidden_ref = torch.empty(B, T, H, dtype=torch.float64, device=x2.device)
    K.rnn_forward_loop_ref(pre_ref, w_hh.double(), hidden_ref)
    strided = torch.empty(I, B * T, device=x2.device).t().copy_(x2)  # an input of another layout, as a user's may be
    for x_in in (x2, strided):
        before = [t.clone() for t in (x_in, w_ih_t, bias, w_hh)]
        pre, hidden = torch.ops.torchloom.rnn_forward(x_in, w_ih_t, bias, w_hh, B, T, "triton")
        assert all(torch.equal(t, u) for t, u in zip((x_in, w_ih_t, bias, w_hh), before))
        assert pre.shape == hidden.shape == (B, T, H) and pre.is_contiguous() and hidden.is_contiguous()
        assert_close(hidden, hidden_ref.float(), name="hidden", rtol=1e-5, atol=1e-6)
        assert_close(pre, pre_ref.float(), name="pre", rtol=1e-5, atol=1e-6)
    torch.library.opcheck(torch.ops.torchloom.rnn_loop_backward.default, (g, w_hh, hidden, "triton"))
    g_pre = torch.ops.torchloom.rnn_loop_backward(g, w_hh, hidden, "triton")
    g_ref = (1 - hidden.double() ** 2)
    K.rnn_backward_loop_ref(g.double(), w_hh.double(), g_ref, torch.empty(B, H, dtype=torch.float64, device=g.device))
    assert_close(g_pre, g_ref.float(), name="gPre", rtol=1e-5, atol=1e-6)


def _tf32(t: torch.Tensor) -> torch.Tensor:
    """float32 ``t`` rounded to the nearest TF32 value (11 significant bits, ties away from zero), as
    float64: from the binary exponent, not from the bit trick the kernels use."""
    mantissa, exponent = torch.frexp(t.double())  # |mantissa| in [0.5, 1)
    return torch.sign(mantissa) * torch.floor(mantissa.abs() * 2**11 + 0.5) * torch.exp2(exponent.double() - 11)


@pytest.mark.parametrize("products", [None, "ieee", "tf32"], ids=["cublas", "fp32_matmul-ieee", "fp32_matmul-tf32"])
def test_the_operators_a_compiled_graph_launches(products):
    """``torchloom::rnn_forward_launched`` / ``rnn_loop_backward_launched`` / ``recurrent_grads_launched``
    (``torch.library.triton_op``: a compiled RNN's graph holds their launches; called eagerly, as here,
    their bodies run: on CPU the interpreter runs the loop kernel, and ``fp32_matmul``'s products take
    its reference path): ``torch.library.opcheck`` passes, no
    input is written, and the values are those of the float64 projection, reference loops and
    products (``products``: cuBLAS's projection, or ``fp32_matmul``'s writing the loop's sentinel, in
    that precision: "tf32" rounds the operands, also on the interpreter). Batch 20: two batch blocks, so on the
    interpreter the loop's programs take tickets."""
    torch.manual_seed(0)
    B, T, I, H = 20, 4, 6, 24
    x2, w_ih_t, bias, g = torch.randn(B * T, I), torch.randn(I, H) * 0.4, torch.randn(H), torch.randn(B, T, H)
    w_hh = torch.randn(H, H) * 0.3
    ops = torch.ops.torchloom
    # Triton's interpreter runs a kernel even on fake tensors (it copies their storages): the fake and
    # compiled-dispatch checks run on CUDA only
    checks = {} if x2.is_cuda else dict(test_utils=("test_schema", "test_autograd_registration"))
    for b in (bias, None):
        torch.library.opcheck(ops.rnn_forward_launched.default, (x2, w_ih_t, b, w_hh, B, T, "ieee", products), **checks)
    before = [t.clone() for t in (x2, w_ih_t, bias, w_hh)]
    pre, hidden = ops.rnn_forward_launched(x2, w_ih_t, bias, w_hh, B, T, "ieee", products)
    assert all(torch.equal(t, u) for t, u in zip((x2, w_ih_t, bias, w_hh), before))
    # "tf32": the products' operands rounded to TF32 as the kernels round them (in float64 here), so
    # what is left to compare is float32 accumulation (an unrounded reference needs a tolerance that
    # scales with Σ|a·b|: one dW_hh element of 0.007 built from 60 terms of ~0.5 came out 0.0107 on an
    # H200, right for TF32)
    op = _tf32 if products == "tf32" else torch.Tensor.double
    pre_ref = (op(x2) @ op(w_ih_t) + bias.double()).view(B, T, H)
    hidden_ref = torch.empty(B, T, H, dtype=torch.float64, device=x2.device)
    K.rnn_forward_loop_ref(pre_ref, w_hh.double(), hidden_ref)
    tol = dict(rtol=1e-5, atol=1e-5)
    assert_close(hidden, hidden_ref, name="hidden", **tol)
    assert_close(pre, pre_ref, name="pre", **tol)
    torch.library.opcheck(ops.rnn_loop_backward_launched.default, (g, w_hh, hidden, "ieee"), **checks)
    g_pre = ops.rnn_loop_backward_launched(g, w_hh, hidden, "ieee")
    g_ref = 1 - hidden.double() ** 2
    K.rnn_backward_loop_ref(g.double(), w_hh.double(), g_ref, torch.empty(B, H, dtype=torch.float64, device=g.device))
    assert_close(g_pre, g_ref, name="gPre", rtol=1e-5, atol=1e-5)
    if products is None:
        return
    x3, hid, w_ih = x2.view(B, T, I), hidden, w_ih_t.t()
    for needs_input_grad in (True, False):
        args = (g_pre, x3, hid, w_ih, True, needs_input_grad, products)
        torch.library.opcheck(ops.recurrent_grads_launched.default, args, **checks)
        dx, dw_ih, dw_hh, db = ops.recurrent_grads_launched(*args)
        g64 = op(g_pre)
        assert_close(dw_ih, torch.einsum("bth,bti->hi", g64, op(x3)), name="dW_ih", **tol)
        assert_close(dw_hh, torch.einsum("bth,btk->hk", g64[:, 1:], op(hid)[:, :-1]), name="dW_hh", **tol)
        assert_close(db, g_pre.double().sum((0, 1)), name="db", **tol)
        if needs_input_grad:
            assert_close(dx, g64 @ op(w_ih), name="dx", **tol)
        else:
            assert dx.numel() == 0


@pytest.mark.parametrize("B,T,H,tickets", [(5, 4, 16, False), (37, 5, 40, True), (20, 3, 24, True)],
                         ids=["one-program", "three-programs", "two-programs"])
def test_a_plain_launch_agrees_on_residency_and_otherwise_takes_tickets(B, T, H, tickets):
    """The loop launched plainly (as Inductor launches it) with its handshake: the programs agree whether
    all of them run at once, and take (step, tile) tickets where they do not. Triton's interpreter runs
    programs one after another, so more than one program can never all be running: the tickets then
    carry the loop. The numbers equal the cooperative launch's bit for bit (the same products in the
    same order), forward and backward, and the float64 reference loops'."""
    if torch.cuda.is_available() and torch.get_default_device().type == "cuda":
        pytest.skip("the interpreter's sequential programs; the CUDA case is test_a_grid_too_large_to_be_resident...")
    pre, w_hh = torch.randn(B, T, H), torch.randn(H, H) * (1.5 / H**0.5)
    g = torch.randn(B, T, H)
    outputs = []
    for handshake in (False, True):
        p, hidden, g_pre = pre.clone(), torch.empty(B, T, H), torch.empty(B, T, H)
        flags = torch.zeros(3, dtype=torch.int32)
        K._launch_rnn_loop(hidden, p, p, w_hh, backward=False, handshake=handshake, flags=flags)
        if handshake:
            assert flags[1].item() == (2 if tickets else 1), "the programs' answer: 1 all running, 2 tickets"
            assert flags[0].item() == -(-B // 16)  # every program counted itself in
        K._launch_rnn_loop(g_pre, g, hidden, w_hh, backward=True, handshake=handshake)
        outputs.append((p, hidden, g_pre))
    for name, a, b in zip(("pre", "hidden", "gPre"), *outputs):
        assert torch.equal(a, b), f"{name}: the plain launch differs from the cooperative one"
    pre64, hid64 = pre.double(), torch.empty(B, T, H, dtype=torch.float64)
    K.rnn_forward_loop_ref(pre64, w_hh.double(), hid64)
    assert_close(outputs[1][1], hid64, name="hidden", rtol=1e-4, atol=1e-5)
    g64 = 1.0 - hid64 * hid64
    K.rnn_backward_loop_ref(g.double(), w_hh.double(), g64, torch.empty(B, H, dtype=torch.float64))
    assert_close(outputs[1][2], g64, name="gPre", rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_grid_too_large_to_be_resident_takes_tickets_on_cuda(dtype):
    """On CUDA, launched plainly: at the benchmark's shape (64 programs) every program runs at once and
    each keeps its tile; at B = H = 1,024 with 16 × 16 tiles (4,096 programs, more than a GPU holds at
    once) the programs that started take tickets and the loop ends, where a cooperative launch would be
    refused. Bit for bit the cooperative launch's numbers at the small shape; against the float64
    reference loops at both."""
    cases = [(64, 6, 256, None, 1), (1024, 3, 1024, K.RNNLoopSettings(16, 16, 256, 1, 64, 4), 2)]
    for B, T, H, st, want in cases:
        gen = torch.Generator(device="cpu").manual_seed(B)
        pre = torch.randn(B, T, H, generator=gen, device="cpu").cuda().to(dtype)
        w_hh = (torch.randn(H, H, generator=gen, device="cpu") * (1.5 / H**0.5)).cuda().to(dtype)
        g = torch.randn(B, T, H, generator=gen, device="cpu").cuda().to(dtype)
        p, hidden, g_pre = pre.clone(), torch.empty_like(pre), torch.empty_like(pre)
        flags = torch.zeros(3, dtype=torch.int32, device="cuda")
        K._launch_rnn_loop(hidden, p, p, w_hh, backward=False, settings=st, handshake=True, flags=flags)
        K._launch_rnn_loop(g_pre, g, hidden, w_hh, backward=True, settings=st, handshake=True)
        torch.cuda.synchronize()
        assert flags[1].item() == want, f"B={B}: programs answered {flags[1].item()}, expected {want}"
        if st is None:
            p2, h2, gp2 = pre.clone(), torch.empty_like(pre), torch.empty_like(pre)
            K._launch_rnn_loop(h2, p2, p2, w_hh, backward=False)
            K._launch_rnn_loop(gp2, g, hidden, w_hh, backward=True)
            assert torch.equal(h2, hidden) and torch.equal(p2, p) and torch.equal(gp2, g_pre)
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=5e-3, atol=5e-3)  # TF32 products
        pre64, hid64 = pre.double(), torch.empty(B, T, H, dtype=torch.float64, device="cuda")
        K.rnn_forward_loop_ref(pre64, w_hh.double(), hid64)
        assert_close(hidden, hid64, name=f"hidden B={B}", **tol)
        g64 = 1.0 - hidden.double() ** 2
        K.rnn_backward_loop_ref(g.double(), w_hh.double(), g64, torch.empty(B, H, dtype=torch.float64, device="cuda"))
        assert_close(g_pre, g64, name=f"gPre B={B}", **tol)
