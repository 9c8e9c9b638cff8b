"""Fused SGD update (torchloom.kernels.sgd) against its reference: every flag, odd sizes, the device
scalars (lr tensor, grad_scale, found_inf) and bf16."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close
from torchloom.kernels._triton import interpreter_enabled, triton_available
from torchloom.kernels.sgd import sgd_ref, sgd_update_

SIZES = [1, 7, 255, 256, 257, 4097, 1000003]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not (triton_available() and interpreter_enabled()), reason="needs Triton's interpreter")),
    pytest.param("cuda", marks=pytest.mark.cuda),
]
FULL = dict(momentum=0.9, dampening=0.1, weight_decay=0.01, clip_value=0.8)
CONFIGS = {
    "plain": dict(),
    "weight_decay": dict(weight_decay=0.05),
    "momentum_first_step": dict(momentum=0.9, dampening=0.3),
    "momentum": dict(momentum=0.9, dampening=0.3),
    "nesterov_clip": dict(momentum=0.8, nesterov=True, weight_decay=0.01, clip_value=0.5),
}


def _run_both(n: int, device: str, cfg: dict, *, first_step: bool, dtype=torch.float32, **kwargs):
    """One update through the kernel and through the reference, from the same random state."""
    w = torch.randn(n, device=device)
    g = torch.randn(n, device=device)
    buf = None if first_step else torch.randn(n, device=device)
    out = {}
    for backend in ("triton", "reference"):
        work_dtype = dtype if backend == "triton" else torch.float32  # bf16: reference in float32
        # rounded to ``dtype`` first so both start from the same values; clone: .to() may alias
        ws = [w.to(dtype).to(work_dtype).clone()]
        bufs = [None if buf is None else buf.to(dtype).to(work_dtype).clone()]
        gs = [g.to(dtype).to(work_dtype)]
        if backend == "triton":
            sgd_update_(ws, gs, bufs, lr=0.1, backend="triton", **cfg, **kwargs)
        else:
            sgd_ref(ws, gs, bufs, lr=0.1, **cfg, **kwargs)
        out[backend] = (ws[0], bufs[0])
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
def test_kernel_matches_reference_all_sizes(device, n):
    out = _run_both(n, device, FULL, first_step=False, grad_scale=torch.tensor(0.7, device=device))
    (w, v), (rw, rv) = out["triton"], out["reference"]
    assert_close(w, rw, name=f"w n={n}", rtol=1e-6, atol=1e-7)
    assert_close(v, rv, name=f"momentum buffer n={n}", rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("n", [7, 257])
def test_kernel_matches_reference_every_flag(device, name, n):
    cfg = CONFIGS[name]
    out = _run_both(n, device, cfg, first_step=name != "momentum")
    (w, v), (rw, rv) = out["triton"], out["reference"]
    assert_close(w, rw, name=f"w {name}", rtol=1e-6, atol=1e-7)
    if cfg.get("momentum", 0):
        assert_close(v, rv, name=f"momentum buffer {name}", rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [7, 4097])
def test_kernel_bfloat16_state_and_weights(device, n):
    out = _run_both(n, device, FULL, first_step=False, dtype=torch.bfloat16)
    (w, v), (rw, rv) = out["triton"], out["reference"]
    assert w.dtype == torch.bfloat16 and v.dtype == torch.bfloat16
    assert_close(w.float(), rw, name="w bf16", rtol=2**-7, atol=1e-6)
    assert_close(v.float(), rv, name="buffer bf16", rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_lr_tensor_equals_lr_number(device):
    w = torch.randn(300, device=device)
    g = torch.randn(300, device=device)
    a, b = [w.clone()], [w.clone()]
    bufs_a, bufs_b = [None], [None]
    sgd_update_(a, [g], bufs_a, lr=0.05, momentum=0.9, backend="triton")
    sgd_update_(b, [g], bufs_b, lr=torch.tensor(0.05, device=device), momentum=0.9, backend="triton")
    assert torch.equal(a[0], b[0]) and torch.equal(bufs_a[0], bufs_b[0])


@pytest.mark.parametrize("device", DEVICES)
def test_found_inf_writes_nothing(device):
    w = torch.randn(1000, device=device)
    buf = torch.randn(1000, device=device)
    g = torch.randn(1000, device=device)
    w0, buf0 = w.clone(), buf.clone()
    sgd_update_([w], [g], [buf], lr=0.1, momentum=0.9, weight_decay=0.1, found_inf=torch.tensor(1.0, device=device), backend="triton")
    assert torch.equal(w, w0) and torch.equal(buf, buf0)
    sgd_update_([w], [g], [buf], lr=0.1, momentum=0.9, weight_decay=0.1, found_inf=torch.tensor(0.0, device=device), backend="triton")
    assert not torch.equal(w, w0)


@pytest.mark.parametrize("device", DEVICES)
def test_several_tensors_in_one_call(device):
    shapes = [(5, 3), (3,), (1,), (17, 4, 2)]
    ws = [torch.randn(s, device=device) for s in shapes]
    gs = [torch.randn(s, device=device) for s in shapes]
    a, b = [w.clone() for w in ws], [w.clone() for w in ws]
    bufs_a, bufs_b = [None] * 4, [None] * 4
    for _ in range(3):
        sgd_update_(a, gs, bufs_a, lr=0.1, momentum=0.5, nesterov=True, backend="triton")
        sgd_ref(b, gs, bufs_b, lr=0.1, momentum=0.5, nesterov=True)
    for x, y in zip(a + bufs_a, b + bufs_b):
        assert_close(x, y, name="tensor", rtol=1e-6, atol=1e-7)


def test_bad_arguments_raise_before_any_change():
    w = torch.randn(4)
    w0 = w.clone()
    with pytest.raises(ValueError, match="grads"):
        sgd_update_([w], [torch.randn(4), torch.randn(4)], lr=0.1)
    with pytest.raises(ValueError, match=r"grads\[0\] has shape \[3\]"):
        sgd_update_([w], [torch.randn(3)], lr=0.1)
    with pytest.raises(ValueError, match="lr must be a finite number >= 0"):
        sgd_update_([w], [torch.randn(4)], lr=-1.0)
    with pytest.raises(ValueError, match="needs momentum_buffers"):
        sgd_update_([w], [torch.randn(4)], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="nesterov"):
        sgd_update_([w], [torch.randn(4)], [None], lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)
    with pytest.raises(ValueError, match="found_inf"):
        sgd_update_([w], [torch.randn(4)], lr=0.1, found_inf=torch.zeros(2))
    assert torch.equal(w, w0)
