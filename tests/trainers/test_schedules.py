"""Learning-rate schedules (SPEC §7): exact values at chosen steps (worked by hand from the SPEC
formulas), use as LRSchedulers with any torch optimizer, train(..., scheduler=...), bad arguments."""

from __future__ import annotations

import math

import pytest
import torch

from torchloom.layers.dense import Dense
from torchloom.layers.network import Network
from torchloom.optim.schedules import (
    SCHEDULES,
    ScheduleLR,
    constant,
    cosine_annealing,
    cosine_warm_restarts,
    exponential_decay,
    linear_decay,
    polynomial_decay,
    step_decay,
    warmup,
)
from torchloom.engine.train import train

# (schedule, {step: expected lr}); expected values are written out, not computed by the code under test
EXACT = [
    (constant(0.05), {0: 0.05, 1: 0.05, 10**6: 0.05}),
    (linear_decay(0.1, 0.01, 10), {0: 0.1, 1: 0.091, 5: 0.055, 9: 0.019, 10: 0.01, 11: 0.01, 500: 0.01}),
    (linear_decay(0.0, 1.0, 4), {0: 0.0, 1: 0.25, 3: 0.75, 4: 1.0}),  # increasing works too
    (cosine_annealing(0.1, 0.0, 100), {0: 0.1, 50: 0.05, 100: 0.0, 150: 0.0, 25: 0.05 * (1 + math.sqrt(0.5))}),
    (cosine_annealing(1.0, 0.2, 4), {0: 1.0, 1: 0.2 + 0.8 * (1 + math.sqrt(0.5)) / 2, 2: 0.6, 3: 0.2 + 0.8 * (1 - math.sqrt(0.5)) / 2, 4: 0.2}),
    (cosine_warm_restarts(1.0, 0.0, 4), {0: 1.0, 1: (1 + math.sqrt(0.5)) / 2, 2: 0.5, 4: 1.0, 6: 0.5, 8: 1.0}),
    (exponential_decay(0.1, 0.5, 10), {0: 0.1, 10: 0.05, 20: 0.025, 5: 0.1 * math.sqrt(0.5), 15: 0.05 * math.sqrt(0.5)}),
    (step_decay(0.1, 0.5, 10), {0: 0.1, 9: 0.1, 10: 0.05, 19: 0.05, 20: 0.025, 35: 0.0125}),
    (polynomial_decay(0.1, 0.01, 10, 2.0), {0: 0.1, 5: 0.09 * 0.25 + 0.01, 9: 0.09 * 0.01 + 0.01, 10: 0.01, 12: 0.01}),
    (polynomial_decay(1.0, 0.0, 4), {0: 1.0, 1: 0.75, 2: 0.5, 4: 0.0}),  # power 1 = linear
    (warmup(4, 0.0, 0.1), {0: 0.0, 1: 0.025, 2: 0.05, 3: 0.075, 4: 0.1, 100: 0.1}),
    (warmup(2, 0.01, 0.1, after=step_decay(0.1, 0.5, 3)), {0: 0.01, 1: 0.055, 2: 0.1, 4: 0.1, 5: 0.05, 8: 0.025}),
    (warmup(0, 0.5, 0.2), {0: 0.2, 3: 0.2}),  # no warm-up steps: base_lr at once
    (warmup(2, 0.0, 1.0, after=lambda s: 1.0 / (1 + s)), {0: 0.0, 1: 0.5, 2: 1.0, 3: 0.5, 5: 0.25}),
]


@pytest.mark.parametrize("schedule,values", EXACT, ids=lambda v: repr(v) if not isinstance(v, dict) else "")
def test_exact_values(schedule, values):
    for step, expected in values.items():
        assert schedule.get_lr(step) == pytest.approx(expected, rel=1e-12, abs=1e-15), f"{schedule!r} at step {step}"
        assert schedule(step) == schedule.get_lr(step)
        assert isinstance(schedule(step), float)


def test_registry_lists_every_spec_schedule():
    assert set(SCHEDULES) == {
        "constant", "linear_decay", "cosine_annealing", "cosine_warm_restarts",
        "exponential_decay", "step_decay", "polynomial_decay", "warmup",
    }


def test_as_lr_scheduler_of_any_torch_optimizer():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([p, ], lr=123.0)  # the schedule replaces the optimizer's lr from step 0
    sched = step_decay(0.1, 0.5, 2).scheduler(opt)
    assert isinstance(sched, ScheduleLR)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones(1)
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025])


def test_schedule_lr_updates_a_tensor_lr_in_place():
    p = torch.nn.Parameter(torch.zeros(1))
    lr = torch.tensor(0.5)
    opt = torch.optim.SGD([p], lr=lr)
    sched = ScheduleLR(opt, linear_decay(1.0, 0.0, 4))
    assert opt.param_groups[0]["lr"] is lr and float(lr) == 1.0
    p.grad = torch.ones(1)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr and float(lr) == 0.75


def test_train_uses_schedule_value_k_on_batch_k():
    # one weight, x = 1, y = 0, MSE: each SGD step is w ← w − lr_k·2w, so w_final = w0·Π(1 − 2·lr_k)
    net = Network(Dense(1, 1, bias=False))
    with torch.no_grad():
        net[0].weight.fill_(1.0)
    schedule = warmup(2, 0.05, 0.2, after=cosine_annealing(0.2, 0.02, 3))
    batches = [(torch.ones(1, 1), torch.zeros(1, 1))] * 3
    train(net, batches, epochs=2, learning_rate=1.0, scheduler=schedule, verbose=False)
    lrs = [0.05, 0.125, 0.2, 0.02 + 0.18 * 0.75, 0.02 + 0.18 * 0.25, 0.02]  # steps 0..5, by hand
    expected = math.prod(1 - 2 * lr for lr in lrs)
    assert net[0].weight.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("make,exc,match", [
    (lambda: constant(-0.1), ValueError, "constant: lr must be a finite learning rate >= 0, got -0.1"),
    (lambda: constant(float("inf")), ValueError, "lr must be a finite"),
    (lambda: linear_decay(0.1, 0.0, 0), ValueError, "linear_decay: total must be an int >= 1, got 0"),
    (lambda: linear_decay(0.1, 0.0, 2.5), ValueError, "total must be an int"),
    (lambda: cosine_annealing(0.1, -1.0, 10), ValueError, "lr_min"),
    (lambda: cosine_warm_restarts(0.1, 0.0, 0), ValueError, "period"),
    (lambda: exponential_decay(0.1, 0.0, 10), ValueError, "rate must be a finite number > 0"),
    (lambda: exponential_decay(0.1, 0.9, True), ValueError, "decay_steps"),
    (lambda: step_decay(0.1, -0.5, 10), ValueError, "gamma"),
    (lambda: step_decay(0.1, 0.5, 0), ValueError, "step_size"),
    (lambda: polynomial_decay(0.1, 0.0, 10, 0.0), ValueError, "power"),
    (lambda: warmup(-1, 0.0, 0.1), ValueError, "warmup_steps must be an int >= 0"),
    (lambda: warmup(2, 0.0, 0.1, after="cosine"), TypeError, "after must be None, a schedule or a callable"),
])
def test_bad_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_bad_step_and_bad_schedule_output():
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
        constant(0.1).get_lr(-1)
    with pytest.raises(ValueError, match="step must be an int"):
        constant(0.1)(1.5)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="gave lr=nan at step 0"):
        ScheduleLR(opt, lambda step: float("nan"))
    with pytest.raises(TypeError, match="schedule must be callable"):
        ScheduleLR(opt, 0.1)


# every schedule of EXACT except the warm-up whose ``after`` is a plain function (not storable as data;
# test_state_dict_of_a_function_schedule covers that case)
ROUND_TRIP = [s for s, _ in EXACT if not (isinstance(s, warmup) and s.after is not None and type(s.after) not in SCHEDULES.values())]
assert len(ROUND_TRIP) == len(EXACT) - 1 and {type(s) for s in ROUND_TRIP} == set(SCHEDULES.values())


@pytest.mark.parametrize("schedule", ROUND_TRIP, ids=repr)
def test_state_dict_round_trips_through_weights_only_load(schedule):
    import io

    def make(s):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=1.0)
        return opt, ScheduleLR(opt, s)

    opt, sched = make(schedule)
    for _ in range(7):
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save({"scheduler": sched.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert saved["scheduler"]["schedule"]["name"] == type(schedule).__name__
    # a scheduler built over another schedule takes the saved one back and carries on exactly
    opt2, other = make(constant(0.5))
    opt2.load_state_dict(saved["optimizer"])
    other.load_state_dict(saved["scheduler"])
    assert other.state_dict() == sched.state_dict()
    for _ in range(5):
        opt.step()
        sched.step()
        opt2.step()
        other.step()
        assert other.get_last_lr() == sched.get_last_lr() == [schedule.get_lr(sched.last_epoch)]
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_state_dict_of_a_function_schedule():
    import io

    def make():
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=1.0)
        return ScheduleLR(opt, warmup(2, 0.0, 1.0, after=lambda s: 1.0 / (1 + s)))

    sched = make()
    for _ in range(4):
        sched.optimizer.step()
        sched.step()
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert state["schedule"] is None  # a function is not data: the loading scheduler keeps its own
    other = make()
    other.load_state_dict(state)
    other.optimizer.step()
    other.step()
    assert other.last_epoch == 5 and other.get_last_lr() == [pytest.approx(1.0 / 4)]


def test_schedule_parameters_are_stored_as_plain_numbers():
    import numpy as np

    s = cosine_annealing(np.float32(0.1), np.float64(0.0), np.int64(10))
    assert type(s.lr0) is float and type(s.lr_min) is float and type(s.total) is int
    assert s.lr0 == float(np.float32(0.1))
