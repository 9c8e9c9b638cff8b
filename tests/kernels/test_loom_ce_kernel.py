"""Loom's probability cross-entropy kernel (torchloom.kernels.loom_ce) against its reference and autograd."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close
from torchloom.kernels._triton import interpreter_enabled, triton_available
from torchloom.kernels.loom_ce import LOOM_CE_EPS, loom_ce_loss_grad, loom_ce_loss_grad_ref

SIZES = [1, 7, 255, 256, 257, 4097, 1000003]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not (triton_available() and interpreter_enabled()), reason="needs Triton's interpreter")),
    pytest.param("cuda", marks=pytest.mark.cuda),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
def test_kernel_matches_reference_float32(device, n):
    o = torch.rand(n, device=device)  # probabilities
    y = torch.rand(n, device=device)
    loss, grad = loom_ce_loss_grad(o, y, backend="triton")
    ref_loss, ref_grad = loom_ce_loss_grad_ref(o, y)
    assert loss.shape == () and loss.device == o.device
    assert_close(grad, ref_grad, name=f"grad n={n}", rtol=2e-6, atol=0)
    assert_close(loss, ref_loss, name=f"loss n={n}", rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_one_hot_targets_and_zero_probabilities(device):
    # probabilities of softmax rows, one exact zero: Loom's +1e-10 keeps the log finite
    o = torch.softmax(torch.randn(5, 7, device=device), dim=-1)
    o[0, 3] = 0.0
    y = torch.zeros(5, 7, device=device)
    y[torch.arange(5), torch.tensor([3, 1, 6, 0, 2])] = 1.0
    loss, grad = loom_ce_loss_grad(o, y, backend="triton")
    ref_loss, ref_grad = loom_ce_loss_grad_ref(o, y)
    assert torch.isfinite(loss)
    assert_close(grad, ref_grad, name="grad", rtol=2e-6, atol=0)
    assert_close(loss, ref_loss, name="loss", rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [7, 4097])
def test_kernel_bfloat16(device, n):
    o = torch.rand(n, device=device).bfloat16()
    y = torch.rand(n, device=device).bfloat16()
    loss, grad = loom_ce_loss_grad(o, y, backend="triton")
    ref_loss, ref_grad = loom_ce_loss_grad_ref(o.float(), y.float())
    assert grad.dtype == torch.bfloat16
    assert_close(grad.float(), ref_grad, name="grad bf16", rtol=2**-7, atol=0)
    assert_close(loss, ref_loss, name="loss bf16", rtol=1e-5, atol=0)


def test_reference_agrees_with_autograd_float64():
    o = torch.rand(3, 4, dtype=torch.float64, requires_grad=True)
    y = torch.rand(3, 4, dtype=torch.float64)
    value = -(y * torch.log(o + LOOM_CE_EPS)).sum() / o.numel()
    value.backward()
    loss, grad = loom_ce_loss_grad_ref(o.detach(), y)
    assert_close(loss, value.detach(), name="loss", rtol=1e-12, atol=0)
    assert_close(grad, o.grad, name="grad", rtol=1e-12, atol=0)
