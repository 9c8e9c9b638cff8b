"""Fused RMSprop update (torchloom.kernels.rmsprop) against its reference: plain, centered, momentum,
weight decay, clip, the device scalars and bf16, on odd sizes."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close
from torchloom.kernels._triton import interpreter_enabled, triton_available
from torchloom.kernels.rmsprop import rmsprop_ref, rmsprop_update_

SIZES = [1, 7, 255, 256, 257, 4097, 1000003]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not (triton_available() and interpreter_enabled()), reason="needs Triton's interpreter")),
    pytest.param("cuda", marks=pytest.mark.cuda),
]
CONFIGS = {
    "plain": dict(),
    "momentum": dict(momentum=0.9),
    "centered": dict(centered=True),
    "centered_momentum_wd_clip": dict(centered=True, momentum=0.5, weight_decay=0.01, clip_value=1.0),
}


def _run(backend: str, n: int, device: str, cfg: dict, dtype=torch.float32, **kwargs):
    torch.manual_seed(n)
    g = torch.randn(n, device=device)
    ga = 0.1 * torch.randn(n, device=device)
    # the square average above the centered mean's square (as after real steps) and away from 0,
    # so √(s − ḡ²) does not amplify float32 rounding past the tolerances
    s = ga * ga + 0.05 + torch.rand(n, device=device)
    tensors = [torch.randn(n, device=device), g, s, ga, 0.1 * torch.randn(n, device=device)]
    tensors = [t.to(dtype).clone() for t in tensors]  # rounded to dtype first: both start equal
    if backend == "reference":
        tensors = [t.float() for t in tensors]
    w, g, s, ga, b = tensors
    if backend == "reference":
        rmsprop_ref([w], [g], [s], [ga], [b], lr=0.01, alpha=0.9, eps=1e-6, **cfg, **kwargs)
    else:
        rmsprop_update_([w], [g], [s], [ga], [b], lr=0.01, alpha=0.9, eps=1e-6, backend=backend, **cfg, **kwargs)
    return w, s, ga, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
def test_kernel_matches_reference_all_sizes(device, n):
    cfg = CONFIGS["centered_momentum_wd_clip"]
    extra = dict(grad_scale=torch.tensor(1.3, device=device))
    got = _run("triton", n, device, cfg, **extra)
    want = _run("reference", n, device, cfg, **extra)
    for a, b, name in zip(got, want, ("w", "square_avg", "grad_avg", "momentum_buffer")):
        assert_close(a, b, name=f"{name} n={n}", rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_kernel_matches_reference_every_flag(device, name):
    got = _run("triton", 257, device, CONFIGS[name])
    want = _run("reference", 257, device, CONFIGS[name])
    for a, b, what in zip(got, want, ("w", "square_avg", "grad_avg", "momentum_buffer")):
        assert_close(a, b, name=f"{what} {name}", rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_lr_tensor_and_found_inf(device):
    w = torch.randn(100, device=device)
    g = torch.randn(100, device=device)
    s = torch.rand(100, device=device)
    b = torch.randn(100, device=device)
    before = [t.clone() for t in (w, s, b)]
    rmsprop_update_([w], [g], [s], None, [b], lr=torch.tensor(0.01, device=device), momentum=0.9,
                    found_inf=torch.tensor(1.0, device=device), backend="triton")
    for x, y in zip((w, s, b), before):
        assert torch.equal(x, y)
    rmsprop_update_([w], [g], [s], None, [b], lr=torch.tensor(0.01, device=device), momentum=0.9, backend="triton")
    ref = [t.clone() for t in before]
    rmsprop_ref([ref[0]], [g], [ref[1]], None, [ref[2]], lr=0.01, momentum=0.9)
    for x, y in zip((w, s, b), ref):
        assert_close(x, y, name="lr tensor", rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [7, 4097])
def test_kernel_bfloat16(device, n):
    cfg = CONFIGS["centered_momentum_wd_clip"]
    got = _run("triton", n, device, cfg, dtype=torch.bfloat16)
    want = _run("reference", n, device, cfg, dtype=torch.bfloat16)
    for a, b, name in zip(got, want, ("w", "square_avg", "grad_avg", "momentum_buffer")):
        assert a.dtype == torch.bfloat16
        assert_close(a.float(), b, name=f"{name} bf16", rtol=2**-7, atol=1e-6)


def test_bad_arguments():
    w = torch.randn(3)
    with pytest.raises(ValueError, match="centered=True needs grad_avgs"):
        rmsprop_update_([w], [torch.randn(3)], [torch.zeros(3)], lr=0.1, centered=True)
    with pytest.raises(ValueError, match="alpha"):
        rmsprop_update_([w], [torch.randn(3)], [torch.zeros(3)], lr=0.1, alpha=1.5)
    with pytest.raises(ValueError, match="square_avgs"):
        rmsprop_update_([w], [torch.randn(3)], [None], lr=0.1)
