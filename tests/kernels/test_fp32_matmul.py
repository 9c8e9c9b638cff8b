"""``fp32_matmul.mm`` (a float32 product in a precision chosen per call) against float64 products of
the same operands (TF32-rounded by an independent bit operation for "tf32"), on CPU through Triton's
interpreter and natively on CUDA; and ``recurrent.projection_mm``, which picks it for the recurrent
layers where PyTorch's RNN switch and cuBLAS's disagree."""

from __future__ import annotations

import struct

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from helpers import assert_close, fresh_interpreter_output
from torchloom.kernels import fp32_matmul as MM
from torchloom.kernels import recurrent as K
from torchloom.layers.lstm import LSTM
from torchloom.layers.rnn import RNN

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "triton" if DEVICE == "cpu" else None  # the kernel either way: the interpreter or CUDA


def _tf32_python(v: float) -> float:
    """The nearest TF32 to a float32 (ties away from zero), by integer arithmetic on its bits in Python."""
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    sign, mag = bits & 0x80000000, bits & 0x7FFFFFFF
    if mag >= 0x7F800000:  # NaN / Inf
        return v
    mag = ((mag + 0x1000) >> 13) << 13
    return struct.unpack("<f", struct.pack("<I", sign | mag))[0]


def test_tf32_rounding_reference_against_python_bits():
    g = torch.Generator().manual_seed(1)
    t = torch.cat([torch.randn(200, generator=g) * 10.0 ** torch.randint(-30, 30, (200,), generator=g),
                   torch.tensor([0.0, -0.0, 1.0 + 2**-11, 1.0 + 2**-12, -(1.0 + 3 * 2**-12), float("inf"), -float("inf"),
                                 3.4028234e38])])
    want = torch.tensor([_tf32_python(v) for v in t.tolist()])
    got = MM.round_tf32_ref(t)
    assert torch.equal(got, want), (got - want).abs().max()
    nan = MM.round_tf32_ref(torch.tensor([float("nan")]))
    assert nan.isnan().all()


def _operands(m, k, n, transposed, g, device="cpu"):
    a = torch.randn(k, m, generator=g).t() if transposed else torch.randn(m, k, generator=g)
    b = torch.randn(n, k, generator=g).t() if transposed else torch.randn(k, n, generator=g)
    bias = torch.randn(n, generator=g)
    return a.to(device), b.to(device), bias.to(device)


def _truth(a, b, bias, precision):
    if precision == "tf32":
        a, b = MM.round_tf32_ref(a), MM.round_tf32_ref(b)
    out = a.double() @ b.double()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("precision", MM.PRECISIONS)
@pytest.mark.parametrize("m,k,n,splits", [(37, 70, 45, 1), (37, 70, 45, 3), (64, 96, 64, 2), (5, 1, 3, 1), (70, 33, 9, 5)])
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
def test_kernel_against_float64(precision, m, k, n, splits, transposed):
    """Ragged tiles, K splits (the last one ragged, or empty beyond K), transposed operands, a bias;
    through Triton's interpreter on the CPU."""
    a, b, bias = _operands(m, k, n, transposed, torch.Generator().manual_seed(m + k + n), DEVICE)
    strided_bias = torch.stack([bias, torch.full_like(bias, 1e6)], 1)[:, 0]  # every other element
    for bi in (None, bias, strided_bias):
        got = MM.mm(a, b, precision, bi, backend=BACKEND, splits=splits)
        assert got.shape == (m, n) and got.dtype == torch.float32 and got.is_contiguous()
        want = _truth(a, b, bi, precision)
        scale = (a.abs().double() @ b.abs().double()).max().item()
        assert_close(got, want, name=f"{precision} splits={splits}", rtol=0, atol=8 * 2**-24 * scale * k**0.5)
        assert_close(MM.mm_ref(a, b, precision, bi), want, name="reference", rtol=0, atol=8 * 2**-24 * scale * k**0.5)


@pytest.mark.parametrize("precision", MM.PRECISIONS)
@pytest.mark.parametrize("splits", [1, 4])
def test_grouped_contraction_reads_the_steps_in_place(precision, splits):
    """``a [M, G, K] @ b [G, K, N]`` summed over G and K: a recurrent layer's ``dW_hh`` over the steps
    ``t ≥ 1`` of ``gPre [B, T, 4H]`` against ``h_{t−1}`` of ``hidden [B, T, H]``, both slices read in
    place (no 2-D view holds those rows)."""
    g = torch.Generator().manual_seed(7)
    B, T, H = 8, 17, 6  # K = 8 · 16 = 128: four splits of one 32-wide chunk each, crossing groups
    g_pre = torch.randn(B, T, 4 * H, generator=g).to(DEVICE)
    hidden = torch.randn(B, T, H, generator=g).to(DEVICE)
    a, b = g_pre[:, 1:].permute(2, 0, 1), hidden[:, :-1]
    assert not a.is_contiguous() and not b.is_contiguous()
    got = MM.mm(a, b, precision, backend=BACKEND, splits=splits)
    a2, b2 = g_pre[:, 1:].reshape(-1, 4 * H).t(), hidden[:, :-1].reshape(-1, H)
    want = _truth(a2, b2, None, precision)
    scale = (a2.abs().double() @ b2.abs().double()).max().item()
    assert_close(got, want, name="grouped", rtol=0, atol=8 * 2**-24 * scale * 12)
    assert_close(MM.mm_ref(a, b, precision), want, name="reference", rtol=0, atol=8 * 2**-24 * scale * 12)
    assert_close(K.projection_mm(a, b), a2.double() @ b2.double(), name="projection_mm", rtol=0, atol=1e-2 * scale)


@pytest.mark.parametrize("precision", MM.PRECISIONS)
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_many_products_in_one_launch_against_float64(precision, splits):
    """``mm_many``: three products of different shapes in one launch, one with a bias, one grouped and
    read in place, one with its ``a``'s row sums; each split along K (its partials then summed by the
    second launch) or not; each against its own float64 product, the row sums against float64 sums;
    the first also fills a tensor of its shape with a bit pattern (a persistent loop's flags)."""
    g = torch.Generator().manual_seed(11)
    a0, b0, bias0 = _operands(37, 70, 45, False, g, DEVICE)
    x = torch.randn(5, 9, 20, generator=g).to(DEVICE)
    a1, b1 = x[:, 1:].permute(2, 0, 1), torch.randn(5, 9, 13, generator=g).to(DEVICE)[:, :-1]  # [20, 5, 8] @ [5, 8, 13]
    a2, b2, _ = _operands(70, 33, 9, True, g, DEVICE)
    flags = torch.zeros(37, 45, dtype=torch.int32 if splits != 3 else torch.float32, device=DEVICE)  # bits into either
    got = MM.mm_many([MM.Product(a0, b0, bias0, fill=flags, fill_value=0x7F800001), MM.Product(a1, b1),
                      MM.Product(a2, b2, row_sums=True)], precision, backend=BACKEND, splits=splits)
    assert (flags.view(torch.int32) == 0x7F800001).all(), "fill: every element of the product's shape written"
    a1_2d, b1_2d = x[:, 1:].reshape(-1, 20).t(), b1.reshape(-1, 13)
    for i, ((out, rs), (a, b, bias), k) in enumerate(zip(got, [(a0, b0, bias0), (a1_2d, b1_2d, None), (a2, b2, None)],
                                                         [70, 40, 33])):
        want = _truth(a, b, bias, precision)
        assert out.shape == want.shape and out.dtype == torch.float32 and out.is_contiguous()
        scale = (a.abs().double() @ b.abs().double()).max().item()
        assert_close(out, want, name=f"product {i}", rtol=0, atol=8 * 2**-24 * scale * k**0.5)
        if i < 2:
            assert rs is None
    rs = got[2][1]
    assert rs.shape == (70,) and rs.dtype == torch.float32
    assert_close(rs, a2.double().sum(1), name="row sums", rtol=0, atol=8 * 2**-24 * a2.abs().double().sum(1).max().item())


def test_many_products_bad_inputs_and_empty_ones():
    x, y = torch.randn(3, 5), torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"products must hold 1 to 3 Product, got 4"):
        MM.mm_many([MM.Product(x, y)] * 4)
    with pytest.raises(ValueError, match=r"products must hold 1 to 3 Product, got 0"):
        MM.mm_many([])
    with pytest.raises(TypeError, match="products must be Product tuples, got tuple"):
        MM.mm_many([(x, y)])
    with pytest.raises(TypeError, match=r"mm_many: a must be float32, got torch.float64"):
        MM.mm_many([MM.Product(x, y), MM.Product(x.double(), y)])
    for bad in (torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, 5, dtype=torch.int32),
                torch.zeros(4, 3, dtype=torch.int32).t()):
        with pytest.raises(ValueError, match=r"fill must be a contiguous int32 or float32 \[3, 4\], got"):
            MM.mm_many([MM.Product(x, y, fill=bad)])
    # an empty contraction beside a real one: zeros (and zero row sums) for it, the other computed
    e, flags = torch.randn(3, 0, device=DEVICE), torch.zeros(3, 4, device=DEVICE)  # float32: the bits of 7
    (z, zs), (p, _) = MM.mm_many([MM.Product(e, torch.randn(0, 4, device=DEVICE), row_sums=True, fill=flags, fill_value=7),
                                  MM.Product(x.to(DEVICE), y.to(DEVICE))], "ieee", backend=BACKEND)
    assert torch.equal(z, torch.zeros(3, 4, device=DEVICE)) and torch.equal(zs, torch.zeros(3, device=DEVICE))
    assert (flags.view(torch.int32) == 7).all()
    assert_close(p, x.double() @ y.double(), name="beside an empty one", rtol=0, atol=1e-5)
    # the reference path writes a fill's bits too, into an int32 or a float32 tensor
    for dtype in (torch.int32, torch.float32):
        flags = torch.zeros(3, 4, dtype=dtype, device=DEVICE)
        MM.mm_many([MM.Product(x.to(DEVICE), y.to(DEVICE), fill=flags, fill_value=0x7F800001)], "ieee", backend="reference")
        assert (flags.view(torch.int32) == 0x7F800001).all(), dtype


def test_tf32_products_differ_from_exact_ones():
    """The "tf32" kernel rounds its operands to the nearest TF32 (1 + 3·2⁻¹², three quarters of a TF32
    step, becomes 1 + 2⁻¹⁰; truncation would give 1), and "ieee" multiplies exactly."""
    a = torch.full((16, 16), 1.0 + 3 * 2**-12, device=DEVICE)
    b = torch.eye(16, device=DEVICE)
    assert torch.equal(MM.mm(a, b, "tf32", backend=BACKEND), torch.full((16, 16), 1.0 + 2**-10, device=DEVICE))
    assert torch.equal(MM.mm(a, b, "ieee", backend=BACKEND), a)


def test_empty_and_bad_inputs():
    a, b = torch.randn(3, 0, device=DEVICE), torch.randn(0, 4, device=DEVICE)
    bias = torch.randn(4, device=DEVICE)
    assert torch.equal(MM.mm(a, b, "tf32", backend=BACKEND), torch.zeros(3, 4, device=DEVICE))
    assert torch.equal(MM.mm(a, b, "tf32", bias, backend=BACKEND), bias.expand(3, 4))
    x, y = torch.randn(3, 5), torch.randn(5, 4)
    with pytest.raises(ValueError, match="precision must be one of"):
        MM.mm(x, y, "bf16")
    with pytest.raises(TypeError, match="b must be float32, got torch.float64"):
        MM.mm(x, y.double())
    with pytest.raises(ValueError, match=r"a \[M, K\] and b \[K, N\], or .* needed, got \[3, 5\] and \[4, 4\]"):
        MM.mm(x, torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"needed, got \[3, 2, 5\] and \[2, 4, 4\]"):
        MM.mm(torch.randn(3, 2, 5), torch.randn(2, 4, 4))
    with pytest.raises(ValueError, match=r"bias must be \[N\] = \[4\], got \[5\]"):
        MM.mm(x, y, bias=torch.randn(5))


def test_projection_mm_off_cuda_is_cublas_or_cpu_mm():
    g = torch.Generator().manual_seed(0)
    a, b, bias = torch.randn(6, 5, generator=g), torch.randn(5, 4, generator=g), torch.randn(4, generator=g)
    assert torch.equal(K.projection_mm(a, b), torch.mm(a, b))
    assert torch.equal(K.projection_mm(a, b, bias), torch.addmm(bias, a, b))
    out = torch.empty(6, 4)
    assert K.projection_mm(a, b, bias, out=out) is out and torch.equal(out, torch.addmm(bias, a, b))
    assert torch.equal(K.projection_mm(a.double(), b.double()), torch.mm(a.double(), b.double()))


def test_recurrent_mm_operator_under_opcheck():
    g = torch.Generator().manual_seed(0)
    a, b, bias = torch.randn(6, 5, generator=g), torch.randn(5, 4, generator=g), torch.randn(4, generator=g)
    torch.library.opcheck(torch.ops.torchloom.recurrent_mm.default, (a, b, bias))
    torch.library.opcheck(torch.ops.torchloom.recurrent_mm.default, (a, b, None))


def _recurrent_case(B, T, I, H, gates, g):
    g_pre = torch.randn(B, T, gates * H, generator=g).to(DEVICE)
    x = torch.randn(B, I, T, generator=g).to(DEVICE).transpose(1, 2)  # a strided input, as a user's may be
    hidden = torch.randn(B, T, H, generator=g).to(DEVICE)
    w_ih = torch.randn(gates * H, I, generator=g).to(DEVICE)
    return g_pre, x, hidden, w_ih


@pytest.mark.parametrize("gates", [1, 4], ids=["rnn", "lstm"])
@pytest.mark.parametrize("precision", [None, "ieee", "tf32"], ids=["cublas", "ieee", "tf32"])
@pytest.mark.parametrize("has_bias,needs_input_grad", [(True, True), (False, False)])
def test_recurrent_grads_against_float64(gates, precision, has_bias, needs_input_grad, monkeypatch):
    """``layers.rnn.recurrent_grads``, the products after a recurrent layer's time loop, against their
    float64 definitions: ``dx = gPre W_ih``, ``dW_ih = Σ_t gPre_tᵀ x_t``, ``dW_hh = Σ_{t ≥ 1} gPre_tᵀ
    h_{t−1}``, ``db = Σ gPre``; through cuBLAS / PyTorch (``gemm_precision`` None) or in one
    ``mm_many`` launch (the precision forced, the kernel run by Triton's interpreter on the CPU)."""
    from torchloom.layers.rnn import recurrent_grads

    monkeypatch.setattr(K, "gemm_precision", lambda a, b, backend: precision)
    g_pre, x, hidden, w_ih = _recurrent_case(3, 7, 10, 6, gates, torch.Generator().manual_seed(gates))
    dx, dw_ih, dw_hh, db = recurrent_grads(g_pre, x, hidden, w_ih, has_bias, needs_input_grad,
                                           BACKEND if precision else None)
    rd = (lambda t: MM.round_tf32_ref(t).double()) if precision == "tf32" else (lambda t: t.double())
    gd, xd, hd = rd(g_pre), rd(x), rd(hidden)
    want = {"dW_ih": torch.einsum("btg,bti->gi", gd, xd), "dW_hh": torch.einsum("btg,bth->gh", gd[:, 1:], hd[:, :-1])}
    got = {"dW_ih": dw_ih, "dW_hh": dw_hh}
    if needs_input_grad:
        want["dx"], got["dx"] = gd @ rd(w_ih), dx
    else:
        assert dx is None
    if has_bias:
        want["db"], got["db"] = g_pre.double().sum((0, 1)), db  # the bias gradient: unrounded sums
    else:
        assert db is None
    for name, w in want.items():
        assert got[name].shape == w.shape and got[name].dtype == torch.float32, name
        assert_close(got[name], w, name=name, rtol=0, atol=1e-5 * w.abs().max().item())


def test_recurrent_grads_operator_under_opcheck():
    g_pre, x, hidden, w_ih = _recurrent_case(2, 5, 4, 3, 4, torch.Generator().manual_seed(0))
    g_pre, x, hidden, w_ih = (t.cpu() for t in (g_pre, x, hidden, w_ih))
    for flags in ((True, True), (False, False), (True, False)):
        torch.library.opcheck(torch.ops.torchloom.recurrent_grads.default, (g_pre, x, hidden, w_ih, *flags))


_CUBLAS_CASES = r"""
import torch
from torchloom.kernels._triton import cublas_allows_tf32
b = torch.backends
got = [cublas_allows_tf32()]  # PyTorch's default: exact
torch.set_float32_matmul_precision("high")
got.append(cublas_allows_tf32())
torch.set_float32_matmul_precision("highest")
got.append(cublas_allows_tf32())
b.cuda.matmul.fp32_precision = "tf32"  # the newer API: the legacy getter refuses to answer now
try:
    b.cuda.matmul.allow_tf32
    got.append("legacy getter answered")
except RuntimeError:
    pass
got.append(cublas_allows_tf32())
b.cuda.matmul.fp32_precision = "ieee"
got.append(cublas_allows_tf32())
b.cuda.matmul.fp32_precision = "none"
b.fp32_precision = "tf32"
got.append(cublas_allows_tf32())
print(got)
"""


@pytest.mark.parametrize("op,settings,want", [
    ("matmul", {("cuda", "matmul"): "tf32"}, True),
    ("matmul", {("cuda", "matmul"): "ieee", ("generic", "all"): "tf32"}, False),
    ("rnn", {("cuda", "all"): "tf32", ("generic", "all"): "ieee"}, True),  # "none" defers to the backend
    ("rnn", {("cuda", "all"): "ieee", ("generic", "all"): "tf32"}, False),
    ("rnn", {("generic", "all"): "tf32"}, True),  # ... and then to the generic setting
    ("matmul", {("generic", "all"): "bf16"}, False),  # bfloat16 on CUDA: not TF32
    ("rnn", {}, False),  # "none" throughout: IEEE
])
def test_precision_chain(op, settings, want, monkeypatch):
    """``_triton._allows_tf32``'s resolution, PyTorch's ``Context::float32Precision``: the op's
    setting, "none" deferring to the CUDA backend's, then the generic one (the getter stands in for
    PyTorch's, whose setters hand a parent's setting down to its ops)."""
    from torchloom.kernels import _triton

    monkeypatch.setattr(torch._C, "_get_fp32_precision_getter", lambda backend, o: settings.get((backend, o), "none"))
    assert _triton._allows_tf32(op, lambda: pytest.fail("the legacy getter was read")) is want


def test_cublas_switch_read_as_cublas_reads_it():
    """``cublas_allows_tf32``: PyTorch's default exact; ``set_float32_matmul_precision`` and the newer
    ``fp32_precision`` settings (after which PyTorch's legacy ``allow_tf32`` getter raises) are read
    without an error; "none" defers to the generic setting. In a fresh interpreter: the settings are
    process-wide."""
    if getattr(torch._C, "_get_fp32_precision_getter", None) is None:
        pytest.skip("this torch has no fp32_precision settings")
    assert fresh_interpreter_output(_CUBLAS_CASES) == repr([False, True, False, True, False, True])


# ------------------------------------------------------------------------------------ GPU only
@pytest.mark.cuda
@pytest.mark.parametrize("m,k,n", [(4096, 256, 256), (256, 4096, 256), (1024, 4032, 256), (4096, 256, 1024), (33, 7, 5)])
def test_cuda_kernel_against_float64(m, k, n):
    """The layers' shapes (projections, weight gradients summed over B·T rows: split along K) and a
    ragged one; "tf32" within fp32 rounding of the float64 product of the TF32-rounded operands."""
    g = torch.Generator().manual_seed(m)
    for transposed in (False, True):
        a, b, bias = _operands(m, k, n, transposed, g, "cuda")
        for precision in MM.PRECISIONS:
            got = MM.mm(a, b, precision, bias)
            want = _truth(a, b, bias, precision)
            scale = (a.abs().double() @ b.abs().double()).max().item()
            assert_close(got, want, name=f"{precision} {m}x{k}x{n}", rtol=0, atol=4 * 2**-24 * scale * k**0.5)


@pytest.mark.cuda
def test_cuda_projection_mm_follows_the_rnn_switch_where_cublas_does_not(monkeypatch):
    """cuDNN's TF32 switch on and cuBLAS's off (PyTorch's defaults): the TF32 kernel; the other way
    round: the exact kernel; agreeing: cuBLAS itself."""
    g = torch.Generator().manual_seed(0)
    a, b, bias = _operands(512, 300, 96, False, g, "cuda")
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        for rnn, cublas, want in ((True, False, "tf32"), (False, True, "ieee"), (False, False, None), (True, True, None)):
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = rnn, cublas
            got = K.projection_mm(a, b, bias)
            expected = torch.addmm(bias, a, b) if want is None else MM.mm(a, b, want, bias)
            assert torch.equal(got, expected), (rnn, cublas)
            out = torch.empty(512, 96, device="cuda")
            assert K.projection_mm(a, b, bias, out=out) is out and torch.equal(out, expected)
            assert torch.equal(K.projection_mm(a, b, bias, backend="reference"), torch.addmm(bias, a, b))
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, False
        monkeypatch.setattr(K, "_tf32_capable", lambda t: False)  # a GPU without TF32: exact everywhere, as cuDNN's
        assert torch.equal(K.projection_mm(a, b, bias), torch.addmm(bias, a, b))
        assert K._dot_precision(a) == K._FP32_PRODUCT
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.cuda
@pytest.mark.parametrize("cls", [RNN, LSTM])
def test_cuda_layers_compute_their_projections_in_the_rnn_switchs_precision(cls):
    """With PyTorch's default switches an RNN/LSTM step computes in TF32 throughout, as cuDNN's: its
    gradients equal a step with cuBLAS's TF32 on too (both switches agreeing) to TF32's error, and
    differ from the exact step by more than fp32's; compiled, the graph launches ``fp32_matmul``'s kernel
    itself for the projection and the backward's products (``torch.library.triton_op``s, no opaque
    operator), and the numbers equal eager's."""
    torch.manual_seed(0)
    layer = cls(256, 256, device="cuda")
    x, gy = torch.randn(64, 16, 256, device="cuda"), torch.randn(64, 16, 256, device="cuda")

    def grads(fn):
        xr = x.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        fn(xr).backward(gy)
        return [xr.grad] + [p.grad.clone() for p in layer.parameters()]

    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = False
        exact = grads(layer)
        torch.backends.cudnn.allow_tf32 = True  # PyTorch's default: cuDNN's RNN in TF32, cuBLAS exact
        ours = grads(layer)
        graphs = []
        keep = lambda gm, _: graphs.append(gm) or make_boxed_func(gm.forward)  # noqa: E731
        compiled = torch.compile(layer, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
        compiled_grads = grads(compiled)
        torch.backends.cuda.matmul.allow_tf32 = True  # both switches on: cuBLAS's own TF32 products
        all_tf32 = grads(layer)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    nodes = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    targets = {n.target for n in nodes}
    kernels = {getattr(k, "fn", k).__name__ for k in (kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
                                                       for n in nodes if "kernel_idx" in n.kwargs)}
    opaque = {getattr(torch.ops.torchloom, op).default for op in ("rnn_forward", "recurrent_mm", "recurrent_grads")}
    assert not targets & opaque, targets & opaque
    assert "_mm_many_kernel" in kernels, kernels  # the projection and the backward's products, launched by the graph
    if cls is RNN:
        assert "_rnn_loop_kernel" in kernels, kernels
    for got, e, t, c in zip(ours, exact, all_tf32, compiled_grads):
        scale = e.abs().max().item()
        assert_close(got, t, name="TF32 vs cuBLAS TF32", rtol=0, atol=2e-2 * scale)
        assert_close(c, got, name="compiled vs eager", rtol=0, atol=1e-6 * scale)
    d = max((o - e).abs().max().item() / e.abs().max().item() for o, e in zip(ours, exact))
    assert d > 1e-5, f"TF32 step equals the exact one to {d:.1e}: the products were not TF32"
