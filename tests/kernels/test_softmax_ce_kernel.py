"""Fused softmax cross-entropy (torchloom.kernels.softmax_ce) against its reference and torch autograd:
class labels and one-hot / soft targets, many row and class counts (non-powers of two, rows longer
than one block)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from torchloom.kernels._triton import interpreter_enabled, triton_available
from torchloom.kernels.softmax_ce import softmax_ce_loss_grad, softmax_ce_loss_grad_ref

CLASSES = [1, 7, 255, 256, 257, 4097, 1000003]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not (triton_available() and interpreter_enabled()), reason="needs Triton's interpreter")),
    pytest.param("cuda", marks=pytest.mark.cuda),
]


def _targets(kind: str, rows: int, c: int, device: str) -> torch.Tensor:
    labels = torch.randint(0, c, (rows,), device=device)
    if kind == "labels":
        return labels
    if kind == "one_hot":
        return F.one_hot(labels, c).float()
    return torch.softmax(torch.randn(rows, c, device=device), dim=-1)  # soft


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["labels", "soft"])
@pytest.mark.parametrize("c", CLASSES)
def test_kernel_matches_reference_over_class_counts(device, kind, c):
    rows = 1 if c > 10000 else 3
    x = 3 * torch.randn(rows, c, device=device)
    y = _targets(kind, rows, c, device)
    loss, grad = softmax_ce_loss_grad(x, y, backend="triton")
    # the reference evaluated in float64: torch's own float32 log_softmax drifts by ~1e-4 relative
    # over a million classes, more than the kernel does
    ref_loss, ref_grad = softmax_ce_loss_grad_ref(x.double(), y if kind == "labels" else y.double())
    assert loss.shape == () and loss.device == x.device and grad.shape == x.shape and grad.dtype == x.dtype
    assert_close(grad, ref_grad, name=f"grad C={c}", rtol=1e-5, atol=1e-7)
    assert_close(loss, ref_loss, name=f"loss C={c}", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["labels", "one_hot", "soft"])
@pytest.mark.parametrize("rows,c", [(1, 10), (5, 10), (33, 10), (17, 257), (2, 3000)])
def test_kernel_agrees_with_autograd_float64(device, kind, rows, c):
    x = 2 * torch.randn(rows, c, device=device)
    y = _targets(kind, rows, c, device)
    loss, grad = softmax_ce_loss_grad(x, y, backend="triton")
    x64 = x.double().requires_grad_()
    ref = F.cross_entropy(x64, y if kind == "labels" else y.double())
    ref.backward()
    assert_close(loss, ref.detach(), name="loss vs F.cross_entropy", rtol=1e-5, atol=1e-7)
    assert_close(grad, x64.grad, name="grad vs autograd", rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_leading_dimensions_are_rows(device):
    x = torch.randn(2, 3, 11, device=device)
    labels = torch.randint(0, 11, (2, 3), device=device)
    loss, grad = softmax_ce_loss_grad(x, labels, backend="triton")
    ref_loss, ref_grad = softmax_ce_loss_grad_ref(x, labels)
    assert grad.shape == (2, 3, 11)
    assert_close(grad, ref_grad, name="grad", rtol=1e-5, atol=1e-8)
    assert_close(loss, ref_loss, name="loss", rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["labels", "soft"])
def test_kernel_bfloat16(device, kind):
    x = (2 * torch.randn(4, 300, device=device)).bfloat16()
    y = _targets(kind, 4, 300, device)
    loss, grad = softmax_ce_loss_grad(x, y, backend="triton")
    ref_loss, ref_grad = softmax_ce_loss_grad_ref(x.float(), y)
    assert grad.dtype == torch.bfloat16
    assert_close(grad.float(), ref_grad, name="grad bf16", rtol=2**-7, atol=1e-6)
    assert_close(loss, ref_loss, name="loss bf16", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_int32_labels_and_large_logits(device):
    x = torch.tensor([[1000.0, 0.0, -1000.0], [5.0, 5.0, 5.0]], device=device)  # no overflow: max-shifted
    labels = torch.tensor([2, 1], dtype=torch.int32, device=device)
    loss, grad = softmax_ce_loss_grad(x, labels, backend="triton")
    ref = F.cross_entropy(x.double(), labels.long())
    assert_close(loss, ref, name="loss", rtol=1e-6, atol=0)
    expected = torch.tensor([[1.0, 0.0, -1.0], [1 / 3, -2 / 3, 1 / 3]], dtype=torch.float64) / 2
    assert_close(grad, expected, name="grad", rtol=1e-6, atol=1e-7)
