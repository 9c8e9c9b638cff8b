"""Mixed precision: every torchloom layer (but attention and the recurrent layers, tested with their
kernels) under ``torch.autocast`` and with half-precision parameters, forward and backward, through
the module (autograd) and through ``forward_saved``/``backward_saved`` (the trainers' path).

Reference: the same layer with the same weights in float64 without autocast. Tolerance per dtype
(relative error of the whole tensor, ``‖a − ref‖ / ‖ref‖``): bfloat16 3e-2, float16 5e-3 — a few
units of the format's rounding (2⁻⁸, 2⁻¹¹) after the sums of a layer; a wrong gradient is off by
order 1. Every gradient must come back in its own tensor's dtype.
"""

from __future__ import annotations

import copy

import pytest
import torch

from torchloom.layers.containers import Parallel, Residual
from torchloom.layers.conv import Conv1D, Conv2D, Flatten
from torchloom.layers.conv_transpose import ConvTranspose1D, ConvTranspose2D
from torchloom.layers.dense import Dense
from torchloom.layers.embedding import Embedding
from torchloom.layers.network import Network, Sequential
from torchloom.layers.norm import LayerNorm, RMSNorm
from torchloom.layers.softmax import Softmax
from torchloom.layers.swiglu import SwiGLU

RTOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _cases():
    """``name -> (layer factory, input factory, matmul layer?)``; odd sizes."""
    f = lambda *s: (lambda: torch.randn(*s))  # noqa: E731
    return {
        "dense_tanh": (lambda: Dense(7, 5, "tanh"), f(6, 7)),
        "dense_gelu_3d": (lambda: Dense(7, 5, "gelu"), f(2, 3, 7)),
        "dense_nobias_relu": (lambda: Dense(7, 5, "relu", bias=False), f(6, 7)),
        "conv1d": (lambda: Conv1D(3, 4, 3, padding=1, activation="tanh"), f(2, 3, 9)),
        "conv2d": (lambda: Conv2D(3, 4, 3, stride=2, activation="relu"), f(2, 3, 7, 9)),
        "conv_transpose1d": (lambda: ConvTranspose1D(3, 4, 3, stride=2, padding=1, activation="tanh"), f(2, 3, 5)),
        "conv_transpose2d_nobias": (lambda: ConvTranspose2D(3, 2, (3, 2), stride=2, bias=False), f(2, 3, 4, 3)),
        "swiglu": (lambda: SwiGLU(6, 11), f(5, 6)),
        "swiglu_nobias_3d": (lambda: SwiGLU(6, 11, bias=False), f(2, 3, 6)),
        "rmsnorm": (lambda: RMSNorm(9), f(5, 9)),
        "layernorm": (lambda: LayerNorm(9), f(2, 3, 9)),
        "softmax": (lambda: Softmax(temperature=1.5), f(5, 9)),
        "embedding": (lambda: Embedding(11, 6), lambda: torch.randint(0, 11, (4, 3))),
        "residual": (lambda: Residual(Dense(6, 6, "silu")), f(5, 6)),
        "parallel": (lambda: Parallel([Dense(6, 3, "tanh"), SwiGLU(6, 5)], combine="concat"), f(5, 6)),
        "network": (lambda: Network(Dense(6, 8, "relu"), LayerNorm(8), Dense(8, 4), Softmax()), f(5, 6)),
        "conv_flatten_dense": (lambda: Sequential(Conv1D(2, 3, 3), Flatten(), Dense(15, 4)), f(3, 2, 7)),
    }


CASES = _cases()


def _randomize(layer):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + (0.5 if p.dim() == 1 else 0.0))


def _rel(a, ref):
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def _reference(layer, x, g):
    """float64 output and gradients (input's, when floating; every parameter's) of ``layer``."""
    ref = copy.deepcopy(layer).double().cpu()
    xr = x.detach().cpu()
    if xr.is_floating_point():
        xr = xr.double().requires_grad_()
    y = ref(xr)
    y.backward(g.double().cpu())
    return y, (xr.grad if xr.is_floating_point() else None), [p.grad for p in ref.parameters()]


def _check(name, y, gx, grads, layer, x, y_ref, gx_ref, grads_ref, dtype):
    tol = RTOL[dtype]
    assert torch.isfinite(y).all(), f"{name}: non-finite output"
    assert _rel(y, y_ref) < tol, f"{name}: output rel. error {_rel(y, y_ref):.2e} >= {tol}"
    if gx_ref is not None:
        assert gx is not None and gx.dtype == x.dtype, f"{name}: input grad dtype {getattr(gx, 'dtype', None)} != {x.dtype}"
        assert _rel(gx, gx_ref) < tol, f"{name}: input grad rel. error {_rel(gx, gx_ref):.2e}"
    params = list(layer.parameters())
    assert len(grads) == len(params)
    for (pn, p), gp, gr in zip(layer.named_parameters(), grads, grads_ref):
        assert gp is not None and gp.dtype == p.dtype, f"{name}: grad of {pn} has dtype {getattr(gp, 'dtype', None)}, param {p.dtype}"
        assert gp.shape == p.shape
        assert _rel(gp, gr) < tol, f"{name}: grad {pn} rel. error {_rel(gp, gr):.2e} >= {tol}"


def _run_autocast(name, device, dtype):
    make_layer, make_x = CASES[name]
    torch.manual_seed(0)
    layer = make_layer().to(device)
    _randomize(layer)
    x = make_x().to(device)
    # --- module path: autocast forward, backward outside (the documented pattern) and inside
    for backward_inside in (False, True):
        layer.zero_grad(set_to_none=True)
        xa = x.clone().requires_grad_() if x.is_floating_point() else x
        with torch.autocast(device_type=device, dtype=dtype):
            y = layer(xa)
            g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(device)
            if backward_inside:
                (y.float() * g).sum().backward()
        if not backward_inside:
            (y.float() * g).sum().backward()
        y_ref, gx_ref, grads_ref = _reference(layer, x, g)
        gx = xa.grad if x.is_floating_point() else None
        _check(f"{name} (module, backward {'inside' if backward_inside else 'outside'} autocast)",
               y, gx, [p.grad for p in layer.parameters()], layer, x, y_ref, gx_ref, grads_ref, dtype)
    # --- trainer path: forward_saved under autocast, backward_saved with a float32 gradient
    with torch.no_grad():
        with torch.autocast(device_type=device, dtype=dtype):
            y2, saved = layer.forward_saved(x)
        gx2, grads2 = layer.backward_saved(g.to(torch.float32), saved, needs_input_grad=x.is_floating_point())
    _check(f"{name} (forward_saved/backward_saved)", y2, gx2, list(grads2), layer, x, y_ref, gx_ref, grads_ref, dtype)


def _run_half_params(name, device, dtype):
    make_layer, make_x = CASES[name]
    torch.manual_seed(0)
    layer = make_layer()
    _randomize(layer)
    layer = layer.to(device=device, dtype=dtype)
    x = make_x().to(device)
    if x.is_floating_point():
        x = x.to(dtype)
    xa = x.clone().requires_grad_() if x.is_floating_point() else x
    y = layer(xa)
    assert y.dtype == dtype
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(device)
    y.backward(g.to(dtype))
    y_ref, gx_ref, grads_ref = _reference(layer, x, g)  # same (rounded) weights, in float64
    gx = xa.grad if x.is_floating_point() else None
    _check(f"{name} ({dtype} parameters)", y, gx, [p.grad for p in layer.parameters()], layer, x, y_ref, gx_ref, grads_ref, dtype)


@pytest.mark.parametrize("name", list(CASES))
def test_cpu_bf16_autocast(name):
    _run_autocast(name, "cpu", torch.bfloat16)


@pytest.mark.parametrize("name", list(CASES))
def test_cpu_bf16_parameters(name):
    _run_half_params(name, "cpu", torch.bfloat16)


def test_autocast_output_dtypes_follow_pytorch():
    """Matrix-product layers return the autocast dtype (as ``nn.Linear`` does), norms and softmax the
    input's dtype; the parameters stay float32 and no ``.grad`` changes dtype."""
    x = torch.randn(4, 6)
    dense, norm = Dense(6, 6), RMSNorm(6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = dense(x)
        assert h.dtype == torch.nn.Linear(6, 6)(x).dtype == torch.bfloat16
        assert norm(h).dtype == torch.bfloat16 and norm(x).dtype == torch.float32
    assert dense.weight.dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_autocast(name, dtype):
    _run_autocast(name, "cuda", dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_half_parameters(name, dtype):
    _run_half_params(name, "cuda", dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_autocast_large_rows_use_kernels(dtype):
    """Sizes where the Triton norm / SwiGLU kernels run (many rows, a row of 1000 columns)."""
    for layer, x in (
        (RMSNorm(1000), torch.randn(300, 1000)),
        (LayerNorm(1000), torch.randn(3, 100, 1000) * 3 + 1),
        (SwiGLU(96, 250), torch.randn(300, 96)),
    ):
        layer = layer.cuda()
        _randomize(layer)
        xa = x.cuda().requires_grad_()
        with torch.autocast("cuda", dtype=dtype):
            y = layer(xa.to(dtype) if isinstance(layer, (RMSNorm, LayerNorm)) else xa)
        g = torch.randn(y.shape, device="cuda")
        (y.float() * g).sum().backward()
        y_ref, gx_ref, grads_ref = _reference(layer, x, g)
        _check(type(layer).__name__, y, xa.grad, [p.grad for p in layer.parameters()], layer, xa, y_ref, gx_ref, grads_ref, dtype)


def test_precision_context():
    """The autocast factory the trainers can use: bf16-mixed trains a Dense/RMSNorm net with float32
    master weights to the same loss as float32 (loose), and bad names are ValueErrors."""
    from torchloom.layers.base import precision_context

    with precision_context("32", "cpu"):
        assert not torch.is_autocast_enabled("cpu")
    with precision_context("bf16-mixed", "cpu"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    for bad in ("bf16", "fp16", 16, None):
        with pytest.raises(ValueError, match="precision"):
            precision_context(bad, "cpu")
    losses = {}
    for precision in ("32", "bf16-mixed"):
        torch.manual_seed(0)
        net = Network(Dense(8, 16, "relu"), RMSNorm(16), Dense(16, 1))
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        x = torch.randn(64, 8)
        y = x[:, :1] * 2 - x[:, 1:2]
        for _ in range(60):
            opt.zero_grad()
            with precision_context(precision, "cpu"):
                out = net(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            loss.backward()
            assert all(p.grad.dtype == torch.float32 for p in net.parameters())
            opt.step()
        losses[precision] = float(loss.detach())
    assert losses["bf16-mixed"] < 0.2 * float(y.var()) and abs(losses["bf16-mixed"] - losses["32"]) < 0.05 * float(y.var()) + 0.02
