"""The default rates of TargetProp and Tweening (issue 31, item 4: chosen from the measured rate table,
docs/target-prop.md and docs/tweening.md).

``TargetPropConfig(learning_rate=None)`` and ``TweenConfig(base_rate=None)`` (the defaults) take the
rate measured for mini-batches, 0.1 for the chain rule, 0.05 for pure mode and 0.03 for Tweening, and a
step of ``B < 16`` rows moves ``B/16`` of it. The expected rates are written out here from that rule;
every run with an automatic rate is compared with the same run at the explicit rate the rule gives (the
explicit-rate steps are checked against autograd, SGD and real Loom elsewhere). An explicit rate is
used as given; a run resumed from a checkpoint goes on exactly as the uninterrupted run.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

from torchloom import (
    Checkpoint,
    Dense,
    Network,
    TargetPropConfig,
    TargetPropState,
    TrainingConfig,
    TweenConfig,
    TweenState,
    apply_target_prop_gaps,
    target_prop_backward,
    target_prop_forward,
    train,
)
from torchloom.engine.train import make_trainer

F64 = torch.float64
BATCHES = [1, 2, 4, 8, 15, 16, 17, 32, 256]


def _rule(rate: float, batch: int) -> float:
    return rate * min(1.0, batch / 16)


def _net():
    torch.manual_seed(0)
    return Network(Dense(5, 7, "tanh", dtype=F64), Dense(7, 3, dtype=F64))


def _data(batch, n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 5, generator=g, dtype=F64), torch.randint(0, 3, (batch,), generator=g)) for _ in range(n)]


def _cfg(method, epochs=2, **kw):
    return TrainingConfig(method=copy.deepcopy(method), epochs=epochs, verbose=0, loss_type="cross_entropy", **kw)


# ------------------------------------------------------------------------------ the rule
def test_target_prop_default_rate_per_mode_and_batch():
    chain, pure = TargetPropConfig(), TargetPropConfig(mode="pure")
    assert chain.learning_rate is None and TargetPropConfig(use_chain_rule=False).base_rate == 0.05
    assert chain.base_rate == 0.1 and pure.base_rate == 0.05
    for b in BATCHES:
        assert chain.rate_for(b) == pytest.approx(_rule(0.1, b), rel=1e-15), b
        assert pure.rate_for(b) == pytest.approx(_rule(0.05, b), rel=1e-15), b
    for mode in ("chain_rule", "pure"):  # an explicit rate is the rate, at every batch size
        cfg = TargetPropConfig(mode=mode, learning_rate=0.3)
        assert cfg.learning_rate == 0.3 and cfg.base_rate == 0.3 and {cfg.rate_for(b) for b in BATCHES} == {0.3}
    switched = TargetPropConfig()
    switched.mode, switched.use_chain_rule = "pure", False  # None follows the mode, also after construction
    switched.validate()
    assert switched.rate_for(32) == 0.05


def test_tween_default_rate_per_batch():
    cfg = TweenConfig()
    assert cfg.base_rate is None
    for b in BATCHES:
        assert cfg.rate_for(b) == pytest.approx(_rule(0.03, b), rel=1e-15), b
    assert {TweenConfig(base_rate=0.01).rate_for(b) for b in BATCHES} == {0.01}


def test_bad_explicit_rates_name_the_automatic_choice():
    with pytest.raises(ValueError, match=r"^TargetPropConfig: learning_rate must be a finite number > 0, got -0\.5 \(or None: "
                       r"the mode's default, 0\.1 chain rule / 0\.05 pure\)$"):
        TargetPropConfig(learning_rate=-0.5)
    with pytest.raises(ValueError, match=r"^TweenConfig: base_rate must be a finite number in \(0\.0, inf\), got 0 \(or None: "
                       r"chosen from each step's batch size\)$"):
        TweenConfig(base_rate=0)


def test_by_name_the_method_takes_its_default_unless_a_rate_is_given():
    for name, field, default in (("target_prop", "learning_rate", 0.1), ("tween", "base_rate", 0.03)):
        trainer = make_trainer(_net(), TrainingConfig(method=name, verbose=0))
        assert getattr(trainer.method.config, field) is None and trainer.rates.lr == default, name
        trainer = make_trainer(_net(), TrainingConfig(method=name, learning_rate=0.2, verbose=0))
        assert getattr(trainer.method.config, field) == 0.2 and trainer.rates.lr == 0.2, name
    with pytest.raises(ValueError, match=r"^TrainingConfig: learning_rate=0\.2 disagrees with the method config's base_rate=None "
                       r"\(the config's own default\); set the rate in the TweenConfig only$"):
        make_trainer(_net(), TrainingConfig(method=TweenConfig(), learning_rate=0.2, verbose=0))


# ---------------------------------------------------------------- the same run, explicit rate
@pytest.mark.parametrize("batch", [4, 32])
@pytest.mark.parametrize(
    "auto, rate, explicit",
    [
        (TargetPropConfig(gate_threshold=0.0), 0.1, lambda r: TargetPropConfig(gate_threshold=0.0, learning_rate=r)),
        (TargetPropConfig(mode="pure", gate_threshold=0.0), 0.05, lambda r: TargetPropConfig(mode="pure", gate_threshold=0.0, learning_rate=r)),
        (TweenConfig(gap_threshold=0.0), 0.03, lambda r: TweenConfig(gap_threshold=0.0, base_rate=r)),
    ],
    ids=["tp-chain", "tp-pure", "tween"],
)
def test_an_automatic_rate_trains_as_its_explicit_rate(auto, rate, explicit, batch):
    data = _data(batch)
    a, b = _net(), _net()
    ra = train(a, data, _cfg(auto))
    rb = train(b, data, _cfg(explicit(_rule(rate, batch))))
    torch.testing.assert_close(torch.tensor(ra.loss_history), torch.tensor(rb.loss_history), rtol=1e-12, atol=0)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-15)


def test_functional_apis_take_the_rate_of_the_batch_they_see():
    x, y = _data(2, n=1)[0]
    t = torch.nn.functional.one_hot(y, 3).to(F64)
    nets = [_net(), _net()]
    for net, cfg in zip(nets, (TargetPropConfig(), TargetPropConfig(learning_rate=_rule(0.1, 2)))):
        state = TargetPropState(net, cfg)
        target_prop_forward(net, state, x)
        target_prop_backward(net, state, t)
        state.calculate_link_budgets()
        apply_target_prop_gaps(net, state)
    for p, q in zip(*(n.parameters() for n in nets)):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-15)
    nets = [_net(), _net()]
    states = [TweenState(nets[0], TweenConfig()), TweenState(nets[1], TweenConfig(base_rate=_rule(0.03, 2)))]
    for net, state in zip(nets, states):
        for _ in range(3):
            state.step(net, x, y)
    assert states[0].adaptive_rate == 0.03 and states[1].adaptive_rate == _rule(0.03, 2)
    assert states[0].layer_rates == pytest.approx(states[1].layer_rates, rel=1e-12)
    for p, q in zip(*(n.parameters() for n in nets)):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------------------- resume
def _halfway(method, tmp_path):
    """``(data, whole, part, path)``: batches of 4 rows, a net trained 4 epochs at ``method``, another
    trained 2 of them and checkpointed at ``path``."""
    data = _data(4)
    whole = _net()
    train(whole, data, _cfg(method, epochs=4))
    path = tmp_path / "run.pt"
    part = _net()
    train(part, data, _cfg(method, epochs=2, observers=[Checkpoint(path, save_best_only=False)]))
    return data, whole, part, path


@pytest.mark.parametrize("method, rate", [(TargetPropConfig(), 0.1), (TweenConfig(), 0.03)], ids=["tp-chain", "tween"])
def test_a_resumed_run_keeps_the_automatic_rate(tmp_path, method, rate):
    data, whole, part, path = _halfway(method, tmp_path)
    assert torch.load(path, weights_only=True)["training"]["rates"] == [rate]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same settings: no "the checkpoint's settings are used" warning
        train(part, data, _cfg(method, epochs=4, resume_from=str(path)))
    for p, q in zip(part.parameters(), whole.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "auto, explicit",
    [(TargetPropConfig(), TargetPropConfig(learning_rate=0.1)), (TweenConfig(), TweenConfig(base_rate=0.03))],
    ids=["tp-chain", "tween"],
)
@pytest.mark.parametrize("saved_auto", [True, False])
def test_a_resume_that_switches_automatic_and_explicit_rates_warns_and_keeps_the_checkpoints(tmp_path, auto, explicit, saved_auto):
    """At batch 4 the automatic rate steps min(1, 4/16) of the number an explicit rate steps in full, so
    the checkpoint records which kind its rate is: a resume that switches kinds (the same number either
    way, so the rate itself matches) warns and goes on with the checkpoint's kind, equal to the
    uninterrupted run."""
    first, second = (auto, explicit) if saved_auto else (explicit, auto)
    data, whole, part, path = _halfway(first, tmp_path)
    assert torch.load(path, weights_only=True)["training"]["auto_rate"] is saved_auto
    with pytest.warns(UserWarning, match=r"the rate is (automatic|given explicitly).*\(this run: (given explicitly|automatic)"):
        train(part, data, _cfg(second, epochs=4, resume_from=str(path)))
    for p, q in zip(part.parameters(), whole.parameters()):
        assert torch.equal(p, q)


# ------------------------------------------- TrainingConfig.learning_rate: None is "not set"
@pytest.mark.parametrize("batch", [4, 32])
@pytest.mark.parametrize(
    "name, explicit",
    [("target_prop", lambda r: TargetPropConfig(learning_rate=r)), ("tween", lambda r: TweenConfig(base_rate=r))],
    ids=["tp", "tween"],
)
def test_an_explicit_learning_rate_of_0_01_by_name_is_the_rate(name, explicit, batch):
    """0.01 is a rate like any other: by name it trains exactly as the method config at 0.01, not at
    the automatic rate (which, left unset, the same run does take)."""
    data = _data(batch)
    given, config, unset = _net(), _net(), _net()
    trainer = make_trainer(_net(), TrainingConfig(method=name, learning_rate=0.01, verbose=0))
    assert trainer.method.config.base_rate == 0.01 and trainer.rates.lr == 0.01
    ra = train(given, data, _cfg(name, learning_rate=0.01))
    rb = train(config, data, _cfg(explicit(0.01)))
    torch.testing.assert_close(torch.tensor(ra.loss_history), torch.tensor(rb.loss_history), rtol=1e-12, atol=0)
    for p, q in zip(given.parameters(), config.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-15)
    assert TrainingConfig().learning_rate is None
    train(unset, data, _cfg(name))  # not set: the automatic rate, another run
    assert any(not torch.allclose(p, q, rtol=1e-6, atol=0) for p, q in zip(unset.parameters(), given.parameters()))


def test_backprop_by_name_trains_at_0_01_unless_a_rate_is_given():
    """Backprop's named optimizer, learning_rate unset: torch.optim.SGD at lr 0.01 (an nn.Sequential
    trained by hand with torch.optim is the reference); a number given is the rate."""
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(8, 5, generator=g, dtype=F64), torch.randn(8, 3, generator=g, dtype=F64)) for _ in range(3)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
    for lr, kw in ((0.01, {}), (0.01, {"learning_rate": 0.01}), (0.2, {"learning_rate": 0.2})):
        mine, ref = copy.deepcopy(model), copy.deepcopy(model)
        result = train(mine, data, TrainingConfig(epochs=2, verbose=0, **kw))
        opt, losses = torch.optim.SGD(ref.parameters(), lr=lr), []
        for _ in range(2):
            total = 0.0
            for x, y in data:
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(ref(x), y)
                loss.backward()
                opt.step()
                total += loss.item()
            losses.append(total / len(data))
        assert result.loss_history == pytest.approx(losses, rel=1e-12), kw
        for p, q in zip(mine.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-15)


def test_any_number_given_beside_a_rate_of_its_own_must_equal_it():
    from functools import partial

    from torchloom.optim import SGD

    net = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"^TrainingConfig: learning_rate=0\.01 disagrees with the method config's base_rate=None "
                       r"\(the config's own default\); set the rate in the TweenConfig only$"):
        TrainingConfig(method=TweenConfig(), learning_rate=0.01)
    with pytest.raises(ValueError, match=r"^TrainingConfig: learning_rate=0\.01 disagrees with the method config's learning_rate=0\.2; "
                       r"set the rate in the TargetPropConfig only$"):
        TrainingConfig(method=TargetPropConfig(learning_rate=0.2), learning_rate=0.01)
    assert TrainingConfig(method=TweenConfig(base_rate=0.01), learning_rate=0.01).method_config().base_rate == 0.01
    with pytest.raises(ValueError, match=r"^TrainingConfig: learning_rate=0\.01 is given with an optimizer instance whose lr is "
                       r"0\.1; the instance's lr is used: leave learning_rate unset \(None\) or build the optimizer with that lr$"):
        TrainingConfig(optimizer=SGD(net.parameters(), lr=0.1), learning_rate=0.01)
    TrainingConfig(optimizer=SGD(net.parameters(), lr=0.1))  # unset: the instance's rate
    with pytest.raises(ValueError, match=r"^TrainingConfig: learning_rate=0\.01 is given with an optimizer factory that builds lr "
                       r"0\.1; the factory's lr is used: leave learning_rate unset \(None\) or give the factory"):
        make_trainer(net, TrainingConfig(optimizer=partial(torch.optim.SGD, lr=0.1), learning_rate=0.01, verbose=0))
    assert make_trainer(net, TrainingConfig(optimizer=partial(torch.optim.SGD, lr=0.1), verbose=0)).optimizer.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("value", [0, 0.0, -0.01, float("nan"), float("inf"), "0.01", True])
def test_a_bad_learning_rate_is_refused(value):
    with pytest.raises(ValueError, match=r"^TrainingConfig: learning_rate must be a finite number > 0 or None \(not set: 0\.01 for an "
                       rf"optimizer given by name, TargetProp's / Tweening's automatic rate\), got {re.escape(repr(value))}$"):
        TrainingConfig(learning_rate=value)
    cfg = TrainingConfig()
    cfg.learning_rate = value  # changed after construction: checked when the run starts
    with pytest.raises(ValueError, match=r"^TrainingConfig: learning_rate must be a finite number > 0 or None"):
        train(torch.nn.Linear(5, 3).double(), _data(4, n=1), cfg)


def test_make_graphed_step_takes_an_instances_rate_when_unset():
    from torchloom import make_graphed_step
    from torchloom.optim import SGD

    x, y = _data(4, n=1)[0]
    net = _net()
    step = make_graphed_step(net, x, torch.nn.functional.one_hot(y, 3).to(F64), optimizer=SGD(net.parameters(), lr=0.3))
    assert step.trainer.optimizer.param_groups[0]["lr"] == 0.3
    net = _net()
    step = make_graphed_step(net, x, torch.nn.functional.one_hot(y, 3).to(F64))
    assert step.trainer.optimizer.param_groups[0]["lr"] == 0.01
