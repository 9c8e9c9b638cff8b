"""Fused AdamW update (torchloom.kernels.adamw) against its reference: odd sizes, the device scalars
(lr and step as tensors, grad_scale, found_inf), several tensors and bf16."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close
from torchloom.kernels._triton import interpreter_enabled, triton_available
from torchloom.kernels.adamw import adamw_ref, adamw_update_

SIZES = [1, 7, 255, 256, 257, 4097, 1000003]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not (triton_available() and interpreter_enabled()), reason="needs Triton's interpreter")),
    pytest.param("cuda", marks=pytest.mark.cuda),
]
HP = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)


def _state(n: int, device: str):
    """Weights, gradient and moments as after a few steps (v > 0)."""
    return (
        torch.randn(n, device=device),
        torch.randn(n, device=device),
        0.1 * torch.randn(n, device=device),
        0.01 * torch.rand(n, device=device),
    )


def _run(backend: str, state, step, dtype=torch.float32, **kwargs):
    w, g, m, v = (t.to(dtype).clone() for t in state)  # rounded to dtype first: both start equal
    if backend == "reference":
        w, g, m, v = (t.float() for t in (w, g, m, v))  # bf16 state: the reference runs in float32
        adamw_ref([w], [g], [m], [v], [step], **{**HP, **kwargs})
    else:
        adamw_update_([w], [g], [m], [v], step, backend=backend, **{**HP, **kwargs})
    return w, m, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
def test_kernel_matches_reference_all_sizes(device, n):
    state = _state(n, device)
    extra = dict(clip_value=1.5, grad_scale=torch.tensor(0.8, device=device))
    got = _run("triton", state, 3, **extra)
    want = _run("reference", state, 3, **extra)
    for a, b, name in zip(got, want, ("w", "exp_avg", "exp_avg_sq")):
        assert_close(a, b, name=f"{name} n={n}", rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("step", [1, 2, 10, 1000])
def test_kernel_bias_correction_steps(device, step):
    state = _state(257, device)
    got = _run("triton", state, step)
    want = _run("reference", state, step)
    for a, b, name in zip(got, want, ("w", "exp_avg", "exp_avg_sq")):
        assert_close(a, b, name=f"{name} step={step}", rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("step", [1, 7, 1000])
def test_lr_and_step_as_device_tensors(device, step):
    state = _state(300, device)
    got = _run("triton", state, torch.tensor(float(step), device=device), lr=torch.tensor(0.01, device=device))
    want = _run("reference", state, step)
    # the device-side bias corrections are float32: within 1e-6 relative of the host's float64 ones
    for a, b, name in zip(got, want, ("w", "exp_avg", "exp_avg_sq")):
        assert_close(a, b, name=name, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_found_inf_writes_nothing(device):
    w, g, m, v = _state(1000, device)
    before = [t.clone() for t in (w, m, v)]
    adamw_update_([w], [g], [m], [v], 1, lr=0.1, found_inf=torch.tensor(1.0, device=device), backend="triton")
    for a, b in zip((w, m, v), before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [7, 4097])
def test_kernel_bfloat16(device, n):
    state = _state(n, device)
    got = _run("triton", state, 4, dtype=torch.bfloat16)
    want = _run("reference", state, 4, dtype=torch.bfloat16)
    for a, b, name in zip(got, want, ("w", "exp_avg", "exp_avg_sq")):
        assert a.dtype == torch.bfloat16
        assert_close(a.float(), b, name=f"{name} bf16", rtol=2**-7, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_several_tensors_with_their_own_steps(device):
    shapes = [(6, 4), (4,), (1,)]
    ws = [torch.randn(s, device=device) for s in shapes]
    gs = [torch.randn(s, device=device) for s in shapes]
    ms = [0.1 * torch.randn(s, device=device) for s in shapes]
    vs = [0.01 * torch.rand(s, device=device) for s in shapes]
    steps = [1, 5, 9]
    a = [[t.clone() for t in lst] for lst in (ws, ms, vs)]
    b = [[t.clone() for t in lst] for lst in (ws, ms, vs)]
    adamw_update_(a[0], gs, a[1], a[2], steps, backend="triton", **HP)
    adamw_ref(b[0], gs, b[1], b[2], steps, **HP)
    for la, lb in zip(a, b):
        for x, y in zip(la, lb):
            assert_close(x, y, name="tensor", rtol=1e-6, atol=1e-8)


def test_bad_arguments():
    w, g, m, v = _state(4, "cpu")
    with pytest.raises(ValueError, match="beta2"):
        adamw_update_([w], [g], [m], [v], 1, lr=0.1, beta2=1.0)
    with pytest.raises(ValueError, match="steps"):
        adamw_update_([w], [g], [m], [v], [1, 2], lr=0.1)
    with pytest.raises(ValueError, match=r"steps\[0\]"):
        adamw_update_([w], [g], [m], [v], 0, lr=0.1)
    with pytest.raises(ValueError, match="exp_avgs"):
        adamw_update_([w], [g], [None], [v], 1, lr=0.1)
