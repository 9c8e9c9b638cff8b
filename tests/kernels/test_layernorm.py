"""LayerNorm kernels and the row-tiled norm kernels RMSNorm shares, against their PyTorch references
and ``F.layer_norm`` / ``F.rms_norm`` with autograd in float64, through Triton's interpreter on CPU
(``TRITON_INTERPRET=1``) on odd sizes, and natively on CUDA; plus the SwiGLU gate backward written
over its input buffer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from torchloom.kernels import layernorm as K
from torchloom.kernels import rmsnorm as KR
from torchloom.kernels import swiglu as KG

pytestmark = pytest.mark.usefixtures("cuda_default_device")

SHAPES = [(1, 1), (3, 5), (7, 33), (2, 3, 100), (37, 257)]


def _ids(s):
    return "x".join(map(str, s))


def _truth_ln(x, w, b, g):
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    y = F.layer_norm(xr, (x.shape[-1],), wr, br, 1e-5)
    return (y.detach(), *torch.autograd.grad(y, (xr, wr, br), g.double()))


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_layernorm_kernel_matches_reference_and_autograd(shape):
    n = shape[-1]
    x, g = torch.randn(*shape) * 2 + 0.5, torch.randn(*shape)
    w, b = torch.randn(n), torch.randn(n)
    y, mean, rstd = K.layernorm(x, w, b, 1e-5, backend="triton")
    y_ref, mean_ref, rstd_ref = K.layernorm_ref(x, w, b, 1e-5)
    assert_close(y, y_ref, name="y", rtol=1e-5, atol=1e-5)
    assert_close(mean, mean_ref, name="mean", rtol=1e-5, atol=1e-6)
    assert_close(rstd, rstd_ref, name="rstd", rtol=1e-5, atol=1e-6)
    dx, dw, db = K.layernorm_backward(g, x, w, mean, rstd, backend="triton")
    dx_ref, dw_ref, db_ref = K.layernorm_backward_ref(g, x, w, mean_ref, rstd_ref)
    assert_close(dx, dx_ref, name="dx", rtol=1e-4, atol=1e-5)
    assert_close(dw, dw_ref, name="dw", rtol=1e-4, atol=1e-4)
    assert_close(db, db_ref, name="db", rtol=1e-4, atol=1e-4)
    y64, dx64, dw64, db64 = _truth_ln(x, w, b, g)
    assert_close(y, y64, name="y vs F.layer_norm", rtol=1e-5, atol=1e-5)
    assert_close(dx, dx64, name="dx vs autograd", rtol=1e-4, atol=1e-4)
    assert_close(dw, dw64, name="dw vs autograd", rtol=1e-4, atol=1e-4)
    assert_close(db, db64, name="db vs autograd", rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_tiled_rmsnorm_matches_autograd(shape):
    n = shape[-1]
    x, g, w = torch.randn(*shape) * 2, torch.randn(*shape), torch.randn(n)
    y, rstd = KR.rmsnorm(x, w, 1e-6, backend="triton")  # rows fit one block: the tiled kernel
    dx, dw = KR.rmsnorm_backward(g, x, w, rstd, backend="triton")
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    yr = F.rms_norm(xr, (n,), wr, 1e-6)
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), g.double())
    assert_close(y, yr, name="y", rtol=1e-5, atol=1e-5)
    assert_close(dx, dxr, name="dx", rtol=1e-4, atol=1e-4)
    assert_close(dw, dwr, name="dw", rtol=1e-4, atol=1e-4)


def test_layernorm_kernel_bfloat16_computes_in_float32():
    x, g = torch.randn(9, 40, dtype=torch.bfloat16), torch.randn(9, 40, dtype=torch.bfloat16)
    w, b = torch.randn(40), torch.randn(40)  # float32 parameters with bfloat16 activations
    y, mean, rstd = K.layernorm(x, w, b, 1e-5, backend="triton")
    assert y.dtype == torch.bfloat16 and mean.dtype == rstd.dtype == torch.float32
    dx, dw, db = K.layernorm_backward(g, x, w, mean, rstd, backend="triton")
    assert dx.dtype == torch.bfloat16 and dw.dtype == db.dtype == torch.float32
    y64, dx64, dw64, db64 = _truth_ln(x.float(), w, b, g.float())
    assert_close(y, y64, name="y", rtol=2e-2, atol=2e-2)
    assert_close(dx, dx64, name="dx", rtol=2e-2, atol=5e-2)
    assert_close(dw, dw64, name="dw", rtol=1e-4, atol=1e-4)  # sums in float32 from the bf16 inputs
    assert_close(db, db64, name="db", rtol=1e-4, atol=1e-4)


def test_layernorm_reference_on_cpu_by_default():
    x, w, b = torch.randn(3, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    y, _, _ = K.layernorm(x, w, b, 1e-5)
    assert torch.equal(y, K.layernorm_ref(x, w, b, 1e-5)[0])
    with pytest.raises(ValueError, match="dtypes"):
        K.layernorm(x, w, b, 1e-5, backend="triton")


@pytest.mark.parametrize("n", [1, 255, 1000])
def test_swiglu_backward_over_its_input_buffer(n):
    """``out_gate=grad``: d_gate overwrites the incoming gradient, with the same values."""
    g, u, da = torch.randn(n) * 3, torch.randn(n), torch.randn(n)
    dg_ref, du_ref = KG.swiglu_backward_ref(da, g, u)
    buf = da.clone()
    dg, du = KG.swiglu_backward(buf, g, u, backend="triton", out_gate=buf)
    assert dg.data_ptr() == buf.data_ptr()
    assert_close(dg, dg_ref, name="d_gate", rtol=1e-5, atol=1e-6)
    assert_close(du, du_ref, name="d_up", rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4096, 1024), (3, 333, 777), (64, 8192), (5, 12000)])
def test_cuda_norms_match_autograd(shape, dtype):
    n = shape[-1]
    x, g = (torch.randn(*shape, device="cuda") * 2 + 0.3).to(dtype), torch.randn(*shape, device="cuda").to(dtype)
    w, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    y, mean, rstd = K.layernorm(x, w, b, 1e-5)
    dx, dw, db = K.layernorm_backward(g, x, w, mean, rstd)
    y64, dx64, dw64, db64 = _truth_ln(x.float(), w, b, g.float())
    for name, a, r in (("y", y, y64), ("dx", dx, dx64), ("dw", dw, dw64), ("db", db, db64)):
        err = float((a.double() - r).norm() / r.norm())
        assert err < tol, f"LayerNorm {name}: rel. error {err:.2e}"
    y, rstd = KR.rmsnorm(x, w, 1e-6)
    dx, dw = KR.rmsnorm_backward(g, x, w, rstd)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    yr = F.rms_norm(xr, (n,), wr, 1e-6)
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), g.double())
    for name, a, r in (("y", y, yr), ("dx", dx, dxr), ("dw", dw, dwr)):
        err = float((a.double() - r.detach()).norm() / r.norm())
        assert err < tol, f"RMSNorm {name}: rel. error {err:.2e}"
