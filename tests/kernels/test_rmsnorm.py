"""RMSNorm kernels (forward and backward) against their PyTorch reference and ``F.rms_norm``, through
Triton's interpreter on CPU (``TRITON_INTERPRET=1``, set by conftest) and natively on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from torchloom.kernels import rmsnorm as K

pytestmark = pytest.mark.usefixtures("cuda_default_device")


# Odd widths around powers of two, width 1, rows that do not divide evenly among programs.
SHAPES = [(1, 1), (3, 7), (37, 5), (5, 255), (2, 257), (2, 3, 1000)]


def _ids(s):
    return "x".join(map(str, s))


def _truth(x, w, g, eps):
    """float64 autograd through F.rms_norm: (y, dx, dw)."""
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    y = F.rms_norm(xr, (x.shape[-1],), wr, eps)
    dx, dw = torch.autograd.grad(y, (xr, wr), g.double())
    return y.detach(), dx, dw


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_kernels_match_reference_float32(shape):
    n = shape[-1]
    x, g, w = torch.randn(*shape) * 2, torch.randn(*shape), torch.randn(n)
    y, rstd = K.rmsnorm(x, w, 1e-6, backend="triton")
    y_ref, rstd_ref = K.rmsnorm_ref(x, w, 1e-6)
    assert rstd.shape == shape[:-1] and rstd.dtype == torch.float32
    assert_close(y, y_ref, name="y", rtol=1e-5, atol=1e-6)
    assert_close(rstd, rstd_ref, name="rstd", rtol=1e-6, atol=0)
    dx, dw = K.rmsnorm_backward(g, x, w, rstd, backend="triton")
    dx_ref, dw_ref = K.rmsnorm_backward_ref(g, x, w, rstd_ref)
    assert_close(dx, dx_ref, name="dx", rtol=1e-5, atol=1e-5)
    assert_close(dw, dw_ref, name="dw", rtol=1e-5, atol=1e-5)
    y64, dx64, dw64 = _truth(x, w, g, 1e-6)
    assert_close(y, y64, name="y vs F.rms_norm", rtol=1e-5, atol=1e-5)
    assert_close(dx, dx64, name="dx vs autograd", rtol=1e-4, atol=1e-5)
    assert_close(dw, dw64, name="dw vs autograd", rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(5, 37), (3, 16), (2, 100)], ids=_ids)
def test_chunked_rows(shape):
    """Rows longer than one block (forced to 16 here) take the two-sweep path, with dw accumulated
    in each program's row of the partial buffer."""
    n = shape[-1]
    x, g, w = torch.randn(*shape), torch.randn(*shape), torch.randn(n)
    y, rstd = K._launch_rmsnorm(x, w, 1e-5, block=16)
    y_ref, rstd_ref = K.rmsnorm_ref(x, w, 1e-5)
    assert_close(y, y_ref, name="y", rtol=1e-5, atol=1e-6)
    dx, dw = K._launch_rmsnorm_backward(g, x, w, rstd, block=16)
    dx_ref, dw_ref = K.rmsnorm_backward_ref(g, x, w, rstd_ref)
    assert_close(dx, dx_ref, name="dx", rtol=1e-5, atol=1e-5)
    assert_close(dw, dw_ref, name="dw", rtol=1e-5, atol=1e-5)


def test_bfloat16_within_twice_torch_error():
    x, g, w = torch.randn(9, 257), torch.randn(9, 257), torch.randn(257)
    y64, dx64, dw64 = _truth(x, w, g, 1e-6)
    xb, gb, wb = x.bfloat16(), g.bfloat16(), w.bfloat16()
    y, rstd = K.rmsnorm(xb, wb, 1e-6, backend="triton")
    dx, dw = K.rmsnorm_backward(gb, xb, wb, rstd, backend="triton")
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16
    # PyTorch's own bf16 result for each quantity (autograd through F.rms_norm in bf16).
    xt, wt = xb.clone().requires_grad_(), wb.clone().requires_grad_()
    yt = F.rms_norm(xt, (257,), wt, 1e-6)
    dxt, dwt = torch.autograd.grad(yt, (xt, wt), gb)
    for got, torch_lowp, truth, name in ((y, yt, y64, "y"), (dx, dxt, dx64, "dx"), (dw, dwt, dw64, "dw")):
        err = (got.double() - truth).abs().max().item()
        ref_err = (torch_lowp.double() - truth).abs().max().item()
        assert err <= 2 * ref_err + 1e-6, f"{name}: kernel error {err:.3e} > 2 × torch error {ref_err:.3e}"


def test_dispatch():
    x, w = torch.randn(3, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    y, rstd = K.rmsnorm(x, w, 1e-6)
    assert rstd.dtype == torch.float64 and torch.equal(y, K.rmsnorm_ref(x, w, 1e-6)[0])
    with pytest.raises(ValueError, match="float64"):
        K.rmsnorm(x, w, 1e-6, backend="triton")


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(1, 1), (8192, 4096), (17, 8193), (3, 70001)], ids=_ids)
def test_native_cuda(shape):
    n = shape[-1]
    x, g, w = torch.randn(*shape, device="cuda"), torch.randn(*shape, device="cuda"), torch.randn(n, device="cuda")
    y, rstd = K.rmsnorm(x, w, 1e-6)
    y_ref, rstd_ref = K.rmsnorm_ref(x, w, 1e-6)
    assert_close(y, y_ref, name="y", rtol=1e-5, atol=1e-5)
    dx, dw = K.rmsnorm_backward(g, x, w, rstd)
    dx_ref, dw_ref = K.rmsnorm_backward_ref(g, x, w, rstd_ref)
    assert_close(dx, dx_ref, name="dx", rtol=1e-4, atol=1e-4)
    assert_close(dw, dw_ref, name="dw", rtol=1e-4, atol=1e-2)  # sums over up to 8192 rows in float32
