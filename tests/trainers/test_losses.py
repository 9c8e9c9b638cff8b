"""Losses (SPEC §4) against torch.nn.functional + autograd and the written formulas."""

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from torchloom.engine.losses import compute_loss, loss_and_grad, loss_gradient


def test_mse_matches_torch():
    o = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randn(7, 5, dtype=torch.float64)
    loss, grad = loss_and_grad(o.detach(), y, "mse")
    ref = F.mse_loss(o, y)
    (ref_grad,) = torch.autograd.grad(ref, o)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-13)
    assert_close(grad, ref_grad, name="grad", rtol=1e-13, atol=1e-15)


def test_mse_float32_loss_is_summed_in_float64_like_loom():
    o = torch.randn(1000, 10)
    y = torch.randn(1000, 10)
    loss = compute_loss(o, y, "mse")
    assert loss.dtype == torch.float64
    d = (o - y).double()  # float32 difference, float64 squares and sum (Loom CalculateLoss)
    assert loss.item() == pytest.approx((d * d).sum().item() / d.numel(), rel=1e-15)


@pytest.mark.parametrize("rows,classes", [(1, 2), (6, 10), (5, 7)])
def test_cross_entropy_labels_match_torch(rows, classes):
    o = torch.randn(rows, classes, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, classes, (rows,))
    loss, grad = loss_and_grad(o.detach(), labels, "cross_entropy")
    ref = F.cross_entropy(o, labels)
    (ref_grad,) = torch.autograd.grad(ref, o)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert_close(grad, ref_grad, name="grad", rtol=1e-12, atol=1e-14)
    onehot = F.one_hot(labels, classes).double()
    loss2, grad2 = loss_and_grad(o.detach(), onehot, "cross_entropy")
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-12)
    assert_close(grad2, grad, name="grad one-hot", rtol=1e-12, atol=1e-14)


def test_cross_entropy_soft_targets_and_extra_leading_dims():
    o = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    t = torch.softmax(torch.randn(2, 3, 4, dtype=torch.float64), -1)
    loss, grad = loss_and_grad(o.detach(), t, "cross_entropy")
    ref = F.cross_entropy(o.reshape(6, 4), t.reshape(6, 4))  # B = 6 rows
    (ref_grad,) = torch.autograd.grad(ref, o)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert_close(grad, ref_grad, name="grad", rtol=1e-12, atol=1e-14)


def test_loom_crossentropy_formula():
    o = torch.rand(4, 3, dtype=torch.float64) * 0.9 + 0.05
    y = torch.rand(4, 3, dtype=torch.float64)
    loss, grad = loss_and_grad(o, y, "crossentropy")
    n = 12
    expected = sum(-y.flatten()[i].item() * torch.log(o.flatten()[i] + 1e-10).item() for i in range(n)) / n
    assert loss.item() == pytest.approx(expected, rel=1e-13)
    assert_close(grad, -y / (o + 1e-10) / n, name="grad", rtol=1e-13, atol=0)
    # with eps the gradient stays finite at o = 0
    g0 = loss_gradient(torch.zeros(1, 2), torch.ones(1, 2), "crossentropy")
    assert torch.isfinite(g0).all()


@pytest.mark.parametrize(
    "output,target,loss_type,match",
    [
        (torch.zeros(2, 3), torch.zeros(2, 3), "MSE", "names are case-sensitive"),
        (torch.zeros(2, 3), torch.zeros(2, 3), "hinge", "unknown loss_type 'hinge'"),
        (torch.zeros(2, 3), torch.zeros(2, 4), "mse", r"target shape \[2, 4\] does not match output shape \[2, 3\]"),
        (torch.zeros(2, 3), torch.tensor([0, 3]), "cross_entropy", r"class labels must lie in \[0, 3\), got values in \[0, 3\]"),
        (torch.zeros(2, 3), torch.tensor([0, 1, 2]), "cross_entropy", r"class labels must have shape \[2\]"),
        (torch.zeros(2, 3), torch.tensor([0, 1]), "mse", "only accepted by loss_type='cross_entropy'"),
    ],
)
def test_bad_input(output, target, loss_type, match):
    with pytest.raises(ValueError, match=match):
        loss_and_grad(output, target, loss_type)
