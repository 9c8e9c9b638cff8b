"""Global gradient norm and clip scale (torchloom.kernels.grad_norm) against a float64 computation and
the reference: one reduction over every gradient, results as 0-d device tensors."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import assert_close
from torchloom.kernels._triton import interpreter_enabled, triton_available
from torchloom.kernels.grad_norm import clip_grad_norm_, grad_norm, grad_norm_clip_scale, grad_norm_ref

SIZES = [1, 7, 255, 256, 257, 4097, 1000003]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not (triton_available() and interpreter_enabled()), reason="needs Triton's interpreter")),
    pytest.param("cuda", marks=pytest.mark.cuda),
]


def _norm64(grads: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
def test_kernel_norm_matches_float64_and_reference(device, n):
    grads = [torch.randn(n, device=device), torch.randn(3, 5, device=device)]
    norm = grad_norm(grads, backend="triton")
    assert norm.shape == () and norm.device == grads[0].device and norm.dtype == torch.float32
    expected = torch.tensor(_norm64(grads), dtype=torch.float64)
    assert_close(norm, expected, name=f"norm n={n}", rtol=2e-6, atol=0)
    # the float32 reference accumulates less carefully: within 2e-5 of float64 at a million elements
    assert_close(grad_norm_ref(grads), expected, name="reference", rtol=2e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_norm_mixed_dtypes_and_shapes(device):
    grads = [
        torch.randn(17, 9, device=device),
        torch.empty(0, device=device),  # an empty gradient adds nothing
        torch.randn(4097, device=device).bfloat16(),
        torch.randn(2, 3, 5, device=device),
    ]
    norm = grad_norm(grads, backend="triton")
    assert_close(norm, torch.tensor(_norm64(grads), dtype=torch.float64), name="norm", rtol=2e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_kernel_clip_scale(device, max_norm):
    grads = [torch.randn(300, device=device), torch.randn(7, device=device)]
    norm, scale, found_inf = grad_norm_clip_scale(grads, max_norm, backend="triton")
    n64 = _norm64(grads)
    expected_scale = max_norm / n64 if n64 > max_norm else 1.0
    assert_close(scale, torch.tensor(expected_scale), name="scale", rtol=1e-6, atol=0)
    assert float(found_inf) == 0.0
    ref = grad_norm_clip_scale(grads, max_norm, backend="reference")
    for got, want, name in zip((norm, scale, found_inf), ref, ("norm", "scale", "found_inf")):
        assert_close(got, want, name=name, rtol=2e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_kernel_non_finite_gradient_sets_found_inf(device, bad):
    grads = [torch.randn(1000, device=device), torch.randn(5, device=device)]
    grads[1][3] = bad
    norm, scale, found_inf = grad_norm_clip_scale(grads, 1.0, backend="triton")
    assert not math.isfinite(float(norm))
    assert float(found_inf) == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_clip_grad_norm_in_place(device):
    grads = [torch.randn(50, 3, device=device), torch.randn(3, device=device)]
    before = [g.clone() for g in grads]
    n64 = _norm64(before)
    norm = clip_grad_norm_(grads, 1.0, backend="triton")
    assert_close(norm, torch.tensor(n64), name="returned norm", rtol=2e-6, atol=0)
    for g, b in zip(grads, before):
        assert_close(g, b.double() / n64, name="clipped grad", rtol=2e-6, atol=1e-9)
    assert_close(torch.tensor(_norm64(grads)), torch.tensor(1.0), name="norm after clip", rtol=2e-6, atol=0)


def test_reference_clip_leaves_small_gradients_alone():
    grads = [torch.tensor([0.3, 0.4])]  # norm 0.5
    norm = clip_grad_norm_(grads, 1.0)
    assert float(norm) == pytest.approx(0.5)
    assert torch.equal(grads[0], torch.tensor([0.3, 0.4]))


def test_bad_arguments():
    with pytest.raises(ValueError, match="non-empty list"):
        grad_norm([])
    with pytest.raises(ValueError, match="max_norm"):
        grad_norm_clip_scale([torch.ones(3)], 0.0)
    with pytest.raises(TypeError, match=r"grads\[1\]"):
        grad_norm([torch.ones(3), torch.ones(3, dtype=torch.int64)])
