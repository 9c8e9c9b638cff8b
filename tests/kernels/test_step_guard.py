"""The device-side NaN/Inf guard: kernel (interpreter / CUDA) and reference against Loom's rules."""

import itertools
import math

import pytest
import torch

from torchloom.kernels._triton import triton_available
from torchloom.kernels.step_guard import NAN_GRAD, NAN_LOSS, NOT_RUN, OK, step_guard_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference"] + (["triton"] if triton_available() else [])


def _expected(loss, norm, dead, max_norm):
    """Loom's rules (SPEC §5) written out case by case."""
    if dead:
        status = NOT_RUN
    elif not math.isfinite(loss):
        status = NAN_LOSS
    elif not math.isfinite(norm):
        status = NAN_GRAD
    else:
        status = OK
    scale = max_norm / norm if (max_norm > 0 and math.isfinite(norm) and norm > max_norm) else 1.0
    return status, (loss if status == OK else 0.0), float(status != OK), int(dead or not math.isfinite(loss)), scale


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "loss,norm,dead,max_norm",
    list(itertools.product([0.75, float("nan"), float("inf")], [0.0, 0.5, 3.0, float("nan"), float("inf")], [0, 1], [0.0, 1.0])),
)
def test_guard_follows_loom_rules(backend, loss, norm, dead, max_norm):
    t = lambda v, dt=torch.float32: torch.tensor(v, dtype=dt, device=DEVICE)
    dead_t = t(dead, torch.int32)
    step_loss = torch.full((4,), -7.0, device=DEVICE)
    step_status = torch.full((4,), -7, dtype=torch.int32, device=DEVICE)
    found_inf, scale = t(-7.0), t(-7.0)
    # the loss and the squared norm arrive as partial sums (here split in two and three pieces)
    loss_parts = t([loss / 2, loss / 2])
    sq_parts = t([norm**2 / 4, norm**2 / 2, norm**2 / 4])
    step_guard_(loss_parts, sq_parts, dead_t, step_loss[2], step_status[2], found_inf, scale, max_norm, backend=backend)
    status, kept, f_inf, new_dead, exp_scale = _expected(loss, norm, dead, max_norm)
    assert step_status.tolist() == [-7, -7, status, -7]  # only its own slot is written
    assert step_loss[2].item() == pytest.approx(kept) and step_loss[0].item() == -7.0
    assert found_inf.item() == f_inf
    assert dead_t.item() == new_dead
    if math.isfinite(norm):
        assert scale.item() == pytest.approx(exp_scale, rel=1e-6)
