"""Unreduced partial sums (what the CUDA training step feeds its step guard) add up to the values."""

import pytest
import torch

from torchloom.kernels._triton import interpreter_enabled, triton_available
from torchloom.kernels.grad_norm import grad_norm_ref, grad_sq_partials
from torchloom.engine.losses import loss_and_grad

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference"] + (["triton"] if triton_available() and (DEVICE == "cuda" or interpreter_enabled()) else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["mse", "cross_entropy", "crossentropy"])
def test_loss_partials_sum_to_the_loss(loss_type, backend):
    out = torch.rand(37, 13, device=DEVICE) + 0.05
    target = torch.randint(0, 13, (37,), device=DEVICE) if loss_type == "cross_entropy" else torch.rand(37, 13, device=DEVICE)
    loss, grad = loss_and_grad(out, target, loss_type, backend=backend)
    parts, grad2 = loss_and_grad(out, target, loss_type, backend=backend, unreduced=True)
    assert parts.dim() == 1 and parts.numel() >= 1
    assert parts.sum().item() == pytest.approx(loss.item(), rel=1e-5)
    assert torch.equal(grad, grad2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_square_partials_sum_to_the_squared_norm(backend):
    grads = [torch.randn(s, device=DEVICE) for s in [(7, 5), (7,), (1000, 3), (1,)]]
    parts = grad_sq_partials(grads, backend=backend)
    expected = grad_norm_ref(grads).item() ** 2
    assert parts.sum().item() == pytest.approx(expected, rel=1e-5)
    grads[2][3, 1] = float("inf")
    assert not torch.isfinite(grad_sq_partials(grads, backend=backend).sum())
