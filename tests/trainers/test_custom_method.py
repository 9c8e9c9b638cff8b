"""A credit-assignment rule written outside torchloom gets what the built-in rules get (SPEC §15).

* ``examples/08_custom_method.py``'s feedback alignment: one step equals an independent float64
  reference written from the paper's equations (Lillicrap et al. 2016: ``δ_l = (δ_{l+1} B_{l+1}) ⊙
  f'(z_l)``, ``ΔW_l = −η δ_lᵀ a_{l−1}``), not from the code under test; the engine's features work
  with it (validation, metrics, guards, schedules, exact resume; the example itself: test_examples.py);
* a rule with its own update (a ``Method`` subclass, not a ``Backprop`` one) trains through
  ``train()`` with a schedule, guards and exact resume;
* the registry: names, aliases, conflicts, re-definition, and the errors a bad method gives.
"""

from __future__ import annotations

import copy

import pytest
import torch

import torchloom
from torchloom import Checkpoint, Dense, Method, Network, RateHolder, StepOutput, StepStatus, TrainingConfig, train
from test_examples import load_example

FA = load_example("08_custom_method.py").FeedbackAlignment


def _net(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return Network(Dense(5, 7, "tanh", dtype=dtype), Dense(7, 3, dtype=dtype))


def _data(n=4, bs=8, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, 5, generator=g, dtype=dtype), torch.randint(0, 3, (bs,), generator=g)) for _ in range(n)]


def _fa_reference_step(net, feedback, x, y, lr):
    """One feedback-alignment SGD step from the paper's equations, in float64, on copies."""
    (w1, b1), (w2, b2) = [(layer.weight.detach().clone(), layer.bias.detach().clone()) for layer in net.layers]
    z1 = x @ w1.T + b1
    a1 = torch.tanh(z1)
    out = a1 @ w2.T + b2
    delta2 = (torch.softmax(out, -1) - torch.nn.functional.one_hot(y, 3).double()) / x.shape[0]  # mean CE
    delta1 = (delta2 @ feedback[1]) * (1 - a1**2)  # B_2 in place of W_2; f'(z) of tanh
    return [w1 - lr * delta1.T @ x, b1 - lr * delta1.sum(0), w2 - lr * delta2.T @ a1, b2 - lr * delta2.sum(0)]


def test_feedback_alignment_step_equals_the_papers_equations():
    net, (x, y) = _net(), _data(n=1)[0]
    method = FA(seed=3)
    before = copy.deepcopy(net)
    train(net, [(x, y)], TrainingConfig(method=method, epochs=1, loss_type="cross_entropy", learning_rate=0.3, verbose=0))
    want = _fa_reference_step(before, [b.double() for b in method.feedback], x, y, 0.3)
    for got, expected in zip(net.parameters(), want):
        torch.testing.assert_close(got.detach(), expected, rtol=1e-12, atol=1e-12)
    # and it is not backprop: the exact gradient moves the first layer elsewhere
    exact = copy.deepcopy(before)
    train(exact, [(x, y)], TrainingConfig(epochs=1, loss_type="cross_entropy", learning_rate=0.3, verbose=0))
    assert not torch.allclose(exact.layers[0].weight, net.layers[0].weight)
    torch.testing.assert_close(exact.layers[1].weight, net.layers[1].weight, rtol=1e-12, atol=1e-12)  # top layer: same rule


def test_custom_rule_gets_validation_metrics_schedule_and_exact_resume(tmp_path):
    data, val = _data(n=6), _data(n=2, seed=9)
    sched = torchloom.schedules.cosine_annealing(0.2, 0.01, 18)

    def cfg(**kw):
        return TrainingConfig(method=FA(seed=2), loss_type="cross_entropy", optimizer="momentum", learning_rate=0.2,
                              scheduler=sched, validation_data=val, metrics=("accuracy",), verbose=0, **kw)

    whole = _net()
    result = train(whole, data, cfg(epochs=3))
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(result.history.history)
    path = tmp_path / "fa.pt"
    half = _net()
    train(half, data, cfg(epochs=1, observers=[Checkpoint(path, save_best_only=False)]))
    assert torch.load(path, weights_only=True)["method"] == "custom_feedback_alignment"
    resumed = _net()
    again = train(resumed, data, cfg(epochs=3, resume_from=path))
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters()))
    assert again.loss_history == result.loss_history


def test_custom_rule_by_registered_name_and_its_guards():
    net = _net()
    data = _data(n=3)
    bad = (torch.full((8, 5), float("nan"), dtype=torch.float64), data[0][1])
    with pytest.warns(torchloom.DivergenceWarning):
        result = train(net, [bad], TrainingConfig(method="custom_feedback_alignment", epochs=1, loss_type="cross_entropy", verbose=0))
    assert result.skipped_batches == 1 and all(torch.isfinite(p).all() for p in net.parameters())
    good = train(net, data, TrainingConfig(method="custom-feedback-alignment", epochs=2, loss_type="cross_entropy", verbose=0))
    assert good.loss_history[-1] < good.loss_history[0]


class SignDescent(Method):
    """A rule with its own update, from scratch: ``w −= rate · sign(∂L/∂w)`` (signSGD) on the MSE."""

    name = "test_sign_descent"

    def __init__(self, rate: float = 0.01) -> None:
        self.rate = rate

    def bind(self, engine) -> None:
        super().bind(engine)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.rates = RateHolder(self.params, self.rate)
        self.steps = 0

    def schedulable(self):
        return self.rates

    @torch.no_grad()
    def step(self, x, y):
        out, saved = self.model.forward_saved(x)
        target = torch.nn.functional.one_hot(y, out.shape[-1]).to(out.dtype) if y.dtype == torch.long else y
        loss = float(((out - target) ** 2).mean())
        if loss != loss or loss in (float("inf"), float("-inf")):
            return StepOutput(loss, StepStatus.NAN_LOSS)
        _, grads = self.model.backward_saved(2 * (out - target) / out.numel(), saved, needs_input_grad=False)
        for p, g in zip(self.params, grads):
            p.sub_(float(self.rates.lr) * torch.sign(g))
        self.steps += 1
        return StepOutput(loss, StepStatus.OK, {"steps": float(self.steps)})

    def state_dict(self):
        return {"sign_descent": {"steps": self.steps}}

    def load_state_dict(self, state):
        self.steps = state["sign_descent"]["steps"]


def test_a_rule_with_its_own_update_trains_resumes_and_is_scheduled(tmp_path):
    data = _data(n=4)
    sched = torchloom.schedules.step_decay(0.05, 0.5, 4)

    def cfg(**kw):
        return TrainingConfig(method=SignDescent(), scheduler=sched, verbose=0, **kw)

    whole = _net()
    before = copy.deepcopy(whole)
    result = train(whole, data, cfg(epochs=4))
    # independent reference: signSGD by hand with the scheduled rate per step
    ref, step = before, 0
    for _ in range(4):
        for x, y in data:
            ref.zero_grad()
            out = ref(x)
            ((out - torch.nn.functional.one_hot(y, 3).double()) ** 2).mean().backward()
            with torch.no_grad():
                for p in ref.parameters():
                    p.sub_(sched(step) * torch.sign(p.grad))
            step += 1
    for a, b in zip(whole.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert result.history["steps"][-1] == pytest.approx(14.5)  # mean of the 4th epoch's counts 13..16
    path = tmp_path / "sd.pt"
    half = _net()
    train(half, data, cfg(epochs=2, observers=[Checkpoint(path, save_best_only=False)]))
    resumed = _net()
    train(resumed, data, cfg(epochs=4, resume_from=path))
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters()))
    with pytest.raises(ValueError, match="own momentum rule"):
        TrainingConfig(method=SignDescent(), optimizer="adamw")


def test_registry_names_conflicts_and_errors():
    assert {"backprop", "target_prop", "tween", "custom_feedback_alignment"} <= set(torchloom.method_names())

    class Other(Method):
        name = "custom_feedback_alignment"

    with pytest.raises(ValueError, match="'custom_feedback_alignment' is taken by"):
        torchloom.register_method(Other)
    with pytest.raises(TypeError, match="subclass of torchloom.Method"):
        torchloom.register_method(object)

    class Nameless(Method):
        pass

    with pytest.raises(ValueError, match="name must be a non-empty string"):
        torchloom.register_method(Nameless)
    with pytest.raises(ValueError, match="unknown method 'no_such_rule'; valid: 'backprop', 'target_prop', 'tween'"):
        TrainingConfig(method="no_such_rule")
    # the same class defined again (a re-run cell, a reloaded example) takes its name back
    again = load_example("08_custom_method.py").FeedbackAlignment
    assert again is not FA and torchloom.engine.method.method_class("custom_feedback_alignment")[0] is again
