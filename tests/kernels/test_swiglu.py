"""SwiGLU gate kernels (forward and backward) against their PyTorch reference and autograd through
``F.silu(g) * u``, through Triton's interpreter on CPU (``TRITON_INTERPRET=1``) and on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from torchloom.kernels import swiglu as K

pytestmark = pytest.mark.usefixtures("cuda_default_device")


SIZES = [1, 255, 257, 1000003]


def _truth(g, u, da):
    gr, ur = g.double().requires_grad_(), u.double().requires_grad_()
    a = F.silu(gr) * ur
    dg, du = torch.autograd.grad(a, (gr, ur), da.double())
    return a.detach(), dg, du


@pytest.mark.parametrize("n", SIZES)
def test_kernels_match_reference_float32(n):
    g, u, da = torch.randn(n) * 3, torch.randn(n), torch.randn(n)
    a = K.swiglu(g, u, backend="triton")
    assert_close(a, K.swiglu_ref(g, u), name="a", rtol=1e-5, atol=1e-6)
    dg, du = K.swiglu_backward(da, g, u, backend="triton")
    dg_ref, du_ref = K.swiglu_backward_ref(da, g, u)
    assert_close(dg, dg_ref, name="d_gate", rtol=1e-5, atol=1e-6)
    assert_close(du, du_ref, name="d_up", rtol=1e-5, atol=1e-6)
    a64, dg64, du64 = _truth(g, u, da)
    assert_close(a, a64, name="a vs autograd", rtol=1e-5, atol=1e-6)
    assert_close(dg, dg64, name="d_gate vs autograd", rtol=1e-5, atol=1e-6)
    assert_close(du, du64, name="d_up vs autograd", rtol=1e-5, atol=1e-6)


def test_non_contiguous_and_shaped_inputs():
    g = torch.randn(7, 5).t()  # transposed view
    u = torch.randn(5, 7)
    a = K.swiglu(g, u, backend="triton")
    assert a.shape == (5, 7)
    assert_close(a, K.swiglu_ref(g, u), name="a", rtol=1e-5, atol=1e-6)


def test_bfloat16_within_twice_torch_error():
    g, u, da = torch.randn(4097) * 3, torch.randn(4097), torch.randn(4097)
    a64, dg64, du64 = _truth(g, u, da)
    gb, ub, dab = g.bfloat16(), u.bfloat16(), da.bfloat16()
    a = K.swiglu(gb, ub, backend="triton")
    dg, du = K.swiglu_backward(dab, gb, ub, backend="triton")
    gt, ut = gb.clone().requires_grad_(), ub.clone().requires_grad_()
    at = F.silu(gt) * ut
    dgt, dut = torch.autograd.grad(at, (gt, ut), dab)
    for got, torch_lowp, truth, name in ((a, at, a64, "a"), (dg, dgt, dg64, "d_gate"), (du, dut, du64, "d_up")):
        assert got.dtype == torch.bfloat16
        err = (got.double() - truth).abs().max().item()
        ref_err = (torch_lowp.double() - truth).abs().max().item()
        assert err <= 2 * ref_err + 1e-6, f"{name}: kernel error {err:.3e} > 2 × torch error {ref_err:.3e}"


def test_dispatch():
    g, u = torch.randn(9, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    assert torch.equal(K.swiglu(g, u), K.swiglu_ref(g, u))
    with pytest.raises(ValueError, match="float64"):
        K.swiglu(g, u, backend="triton")


@pytest.mark.cuda
@pytest.mark.parametrize("n", SIZES + [(1 << 24) + 3])
def test_native_cuda(n):
    g, u, da = (torch.randn(n, device="cuda") for _ in range(3))
    assert_close(K.swiglu(g, u), K.swiglu_ref(g, u), name="a", rtol=1e-5, atol=1e-6)
    for got, ref, name in zip(K.swiglu_backward(da, g, u), K.swiglu_backward_ref(da, g, u), ("d_gate", "d_up")):
        assert_close(got, ref, name=name, rtol=1e-5, atol=1e-6)
