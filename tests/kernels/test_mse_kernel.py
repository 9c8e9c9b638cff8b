"""Fused MSE gradient + partial loss (torchloom.kernels.mse) against its reference and torch autograd.

The kernel runs through Triton's interpreter on CPU tensors (CI) and natively on CUDA (``cuda`` mark).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from torchloom.kernels._triton import interpreter_enabled, triton_available
from torchloom.kernels.mse import mse_loss_grad, mse_loss_grad_ref

SIZES = [1, 7, 255, 256, 257, 4097, 1000003]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not (triton_available() and interpreter_enabled()), reason="needs Triton's interpreter")),
    pytest.param("cuda", marks=pytest.mark.cuda),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
def test_kernel_matches_reference_float32(device, n):
    o = torch.randn(n, device=device)
    y = torch.randn(n, device=device)
    loss, grad = mse_loss_grad(o, y, backend="triton")
    ref_loss, ref_grad = mse_loss_grad_ref(o, y)
    assert loss.shape == () and loss.device == o.device and loss.dtype == torch.float32
    assert grad.dtype == o.dtype and grad.shape == o.shape
    assert_close(grad, ref_grad, name=f"grad n={n}", rtol=1e-6, atol=1e-12)
    assert_close(loss, ref_loss, name=f"loss n={n}", rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [7, 257, 4097])
def test_kernel_bfloat16_accumulates_in_float32(device, n):
    o = torch.randn(n, device=device).bfloat16()
    y = torch.randn(n, device=device).bfloat16()
    loss, grad = mse_loss_grad(o, y, backend="triton")
    assert grad.dtype == torch.bfloat16
    # the same math in float32 from the same bf16 inputs, rounded to bf16 once at the end: the kernel
    # may differ by one bf16 rounding step (the interpreter truncates where CUDA rounds)
    ref_loss, ref_grad = mse_loss_grad_ref(o.float(), y.float())
    assert_close(grad.float(), ref_grad, name="grad bf16", rtol=2**-7, atol=1e-30)
    assert_close(loss, ref_loss, name="loss bf16", rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_agrees_with_autograd_float64_and_keeps_shape(device):
    o = torch.randn(6, 5, device=device).t()  # non-contiguous [5, 6]
    y = torch.randn(5, 6, device=device)
    loss, grad = mse_loss_grad(o, y, backend="triton")
    o64 = o.detach().double().requires_grad_()
    ref = F.mse_loss(o64, y.double())
    ref.backward()
    assert grad.shape == (5, 6)
    assert_close(loss, ref.detach(), name="loss vs F.mse_loss", rtol=1e-6, atol=0)
    assert_close(grad, o64.grad, name="grad vs autograd", rtol=1e-5, atol=1e-9)


def test_reference_agrees_with_autograd_float64():
    o = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(4, 3, dtype=torch.float64)
    ref = F.mse_loss(o, y)
    ref.backward()
    loss, grad = mse_loss_grad_ref(o.detach(), y)
    assert_close(loss, ref.detach(), name="loss", rtol=1e-12, atol=0)
    assert_close(grad, o.grad, name="grad", rtol=1e-12, atol=1e-15)


def test_default_backend_on_cpu_is_the_reference():
    o, y = torch.randn(10), torch.randn(10)
    loss, _ = mse_loss_grad(o, y)
    assert loss.dtype == torch.float64  # the reference sums in float64; the kernel returns float32
