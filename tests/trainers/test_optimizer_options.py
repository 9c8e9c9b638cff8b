"""Optimizer options of ``train()`` (issue 33 item 4): ``"adam"``, ``optimizer_options`` for named
optimizers, a factory ``params -> Optimizer``, and the clear error for an optimizer left on another
device. Trajectories are compared against ``torch.optim`` driving the same plain PyTorch loop."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchloom.engine.loop as loop_module
from helpers import assert_close
from torchloom import TrainingConfig, train
from torchloom.engine.config import check_optimizer_device

F64 = torch.float64
LR = 0.05


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7, dtype=F64), nn.Tanh(), nn.Linear(7, 3, dtype=F64))


def _data(n: int = 4, bs: int = 6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(bs, 5, generator=g, dtype=F64), torch.randint(0, 3, (bs,), generator=g)) for _ in range(n)]


def _torch_loop(make_optimizer, epochs: int = 3) -> nn.Sequential:
    """The reference: a plain PyTorch loop with a torch.optim optimizer."""
    ref = _model()
    opt = make_optimizer(ref)
    for _ in range(epochs):
        for x, y in _data():
            opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            opt.step()
    return ref


def _torchloom(epochs: int = 3, **settings) -> nn.Sequential:
    model = _model()
    train(model, _data(), TrainingConfig(epochs=epochs, loss_type="cross_entropy", verbose=0, **settings))
    return model


def _same(mine: nn.Module, theirs: nn.Module) -> None:
    for (k, a), b in zip(mine.state_dict().items(), theirs.state_dict().values()):
        assert_close(a, b, name=k, rtol=1e-9, atol=1e-12)


def _decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """torchloom's AdamW rule given plain parameters: matrices decayed, biases not."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2]}, {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def test_adam_by_name_with_options_is_torch_adam():
    mine = _torchloom(learning_rate=LR, optimizer="adam", optimizer_options={"betas": (0.8, 0.99), "eps": 1e-6})
    _same(mine, _torch_loop(lambda m: torch.optim.Adam(m.parameters(), lr=LR, betas=(0.8, 0.99), eps=1e-6)))
    # the options matter: the default betas give another trajectory (the comparison can fail)
    with pytest.raises(AssertionError):
        _same(_torchloom(learning_rate=LR, optimizer="adam"), mine)


def test_adamw_weight_decay_and_betas_are_torch_adamw():
    mine = _torchloom(learning_rate=LR, optimizer="adamw", optimizer_options={"weight_decay": 0.3, "betas": (0.85, 0.95)})
    _same(mine, _torch_loop(lambda m: torch.optim.AdamW(_decay_groups(m, 0.3), lr=LR, weight_decay=0.3, betas=(0.85, 0.95))))


def test_sgd_nesterov_and_weight_decay_are_torch_sgd():
    options = {"momentum": 0.8, "nesterov": True, "weight_decay": 0.01}
    mine = _torchloom(learning_rate=LR, optimizer="sgd", optimizer_options=options)
    _same(mine, _torch_loop(lambda m: torch.optim.SGD(m.parameters(), lr=LR, **options)))
    # "momentum" is SGD with momentum 0.9 unless an option says otherwise
    _same(_torchloom(learning_rate=LR, optimizer="momentum", optimizer_options={"momentum": 0.5}),
          _torch_loop(lambda m: torch.optim.SGD(m.parameters(), lr=LR, momentum=0.5)))


def test_rmsprop_options_are_torch_rmsprop():
    options = {"alpha": 0.9, "centered": True, "momentum": 0.5}
    _same(_torchloom(learning_rate=0.01, optimizer="rmsprop", optimizer_options=options),
          _torch_loop(lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, **options)))


def test_a_factory_builds_the_optimizer_over_the_parameters():
    factory = functools.partial(torch.optim.AdamW, lr=0.02, weight_decay=0.1, betas=(0.9, 0.95))
    _same(_torchloom(optimizer=factory), _torch_loop(lambda m: factory(m.parameters())))
    # a class is a factory too (its default lr); learning_rate equal to the built lr is fine
    _same(_torchloom(optimizer=torch.optim.Adam), _torch_loop(lambda m: torch.optim.Adam(m.parameters())))
    _same(_torchloom(optimizer=torch.optim.Adam, learning_rate=1e-3), _torch_loop(lambda m: torch.optim.Adam(m.parameters())))


def _message(settings: dict, exc=ValueError) -> str:
    with pytest.raises(exc) as e:
        TrainingConfig(**settings)
    return str(e.value)


def test_bad_options_are_refused_when_the_config_is_built():
    assert _message({"optimizer": "adamw", "optimizer_options": {"weight_decy": 0.1}}) == (
        "TrainingConfig: optimizer_options: unknown option 'weight_decy' for optimizer 'adamw'; did you mean "
        "'weight_decay'? valid options: 'betas', 'eps', 'weight_decay', 'clip_value', 'backend'"
    )
    assert _message({"optimizer": "sgd", "optimizer_options": {"lr": 0.1}}) == (
        "TrainingConfig: optimizer_options: 'lr' is TrainingConfig.learning_rate; set it there"
    )
    assert _message({"optimizer": "adam", "optimizer_options": {"weight_decay": 0.1}}) == (
        "TrainingConfig: optimizer_options: 'adam' takes no weight_decay; use optimizer='adamw' for decoupled weight "
        "decay, or optimizer=functools.partial(torch.optim.Adam, weight_decay=...) for torch.optim.Adam's L2 term"
    )
    assert _message({"optimizer": "adamw", "optimizer_options": {"betas": (1.5, 0.9)}}) == (
        "TrainingConfig: optimizer_options: AdamW: betas[0] must be a finite number >= 0.0 and < 1.0, got 1.5"
    )
    assert _message({"optimizer": "sgd", "optimizer_options": {"nesterov": True}}) == (
        "TrainingConfig: optimizer_options: SGD: nesterov needs momentum > 0 and dampening 0, got momentum=0.0, dampening=0.0"
    )
    assert _message({"optimizer": "sgd", "optimizer_options": [("momentum", 0.9)]}, TypeError) == (
        "TrainingConfig: optimizer_options must be a dict of the optimizer's settings, e.g. {'weight_decay': 0.1}, got list"
    )
    assert _message({"optimizer": torch.optim.AdamW, "optimizer_options": {"weight_decay": 0.1}}) == (
        "TrainingConfig: optimizer_options apply to an optimizer given by name; an optimizer instance or factory "
        "carries its own settings (e.g. functools.partial(torch.optim.AdamW, weight_decay=0.1))"
    )
    assert _message({"optimizer": 3}, TypeError) == (
        "TrainingConfig: optimizer must be a name ('sgd', 'momentum', 'adam', 'adamw', 'rmsprop'), a torch.optim.Optimizer "
        "or a factory params -> Optimizer (e.g. functools.partial(torch.optim.AdamW, weight_decay=0.1)), got int"
    )
    assert _message({"method": "tween", "optimizer_options": {"momentum": 0.9}}) == (
        "TrainingConfig: optimizer_options cannot be used with method TweenConfig: it updates the weights with its own "
        "momentum rule (its settings are in its config)"
    )


def test_a_factory_that_disagrees_or_builds_no_optimizer_is_refused_before_training():
    model = _model()
    before = [p.clone() for p in model.parameters()]
    cfg = TrainingConfig(optimizer=functools.partial(torch.optim.AdamW, weight_decay=0.1), learning_rate=0.05, verbose=0)
    with pytest.raises(ValueError) as e:
        train(model, _data(), cfg)
    assert str(e.value) == (
        "TrainingConfig: learning_rate=0.05 is given with an optimizer factory that builds lr 0.001; the factory's lr "
        "is used: leave learning_rate unset (None) or give the factory that lr (e.g. functools.partial("
        "torch.optim.AdamW, lr=0.05, ...))"
    )
    with pytest.raises(TypeError) as e:
        train(model, _data(), TrainingConfig(optimizer=lambda params: list(params), verbose=0))
    assert str(e.value) == (
        "optimizer: the factory test_a_factory_that_disagrees_or_builds_no_optimizer_is_refused_before_training.<locals>."
        "<lambda> returned list, not a torch.optim.Optimizer"
    )
    other = _model()
    with pytest.raises(ValueError) as e:
        train(model, _data(), TrainingConfig(optimizer=lambda params: torch.optim.SGD(other.parameters(), lr=0.1), verbose=0))
    assert str(e.value) == "optimizer: SGD holds 4 parameter(s) that are not the model's; build it over model.parameters()"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_an_optimizer_left_on_another_device_is_a_clear_error():
    # the meta device stands in for a GPU: moving there replaces the parameters, as a move that
    # cannot keep them does, and the optimizer built before it still holds the CPU ones
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model.to("meta")
    with pytest.raises(ValueError) as e:
        check_optimizer_device(opt, torch.device("meta"))
    assert str(e.value) == (
        "optimizer: the AdamW instance holds parameters on cpu, but training runs on meta (train() moved the model "
        "there: use_gpu/device); build the optimizer after moving the model (model.to('meta')), or give it by name "
        "or as a factory (e.g. optimizer='adamw' or functools.partial(torch.optim.AdamW, weight_decay=0.1)), which "
        "train() builds on the training device"
    )
    # state made before a move stays where it was
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    F.cross_entropy(model(_data()[0][0]), _data()[0][1]).backward()
    opt.step()
    for p in model.parameters():
        opt.state[p]["momentum_buffer"] = opt.state[p]["momentum_buffer"].to("meta")
    with pytest.raises(ValueError, match=r"^optimizer: the SGD instance holds state 'momentum_buffer' on meta, but training runs on cpu"):
        check_optimizer_device(opt, torch.device("cpu"))
    check_optimizer_device(torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))  # fine: nothing away


def test_train_checks_the_optimizer_after_moving_the_model(monkeypatch):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    monkeypatch.setattr(loop_module, "resolve_device", lambda *a: torch.device("meta"))
    with pytest.raises(ValueError, match=r"^optimizer: the AdamW instance holds parameters on cpu, but training runs on meta"):
        train(model, [(x, torch.zeros(len(x), 3, dtype=F64)) for x, _ in _data()], TrainingConfig(optimizer=opt, verbose=0))


@pytest.mark.cuda
def test_use_gpu_with_an_optimizer_used_on_the_cpu_is_a_clear_error():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data()[0]
    F.cross_entropy(model(x), y).backward()
    opt.step()  # momentum buffers made on the CPU
    with pytest.raises(ValueError, match=r"^optimizer: the SGD instance holds state 'momentum_buffer' on cpu, but training runs on cuda:0"):
        train(model, _data(), TrainingConfig(optimizer=opt, use_gpu=True, loss_type="cross_entropy", verbose=0))
    # one built over the parameters but not used yet moves with them (the move keeps the parameters)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, _data(), TrainingConfig(optimizer=opt, use_gpu=True, loss_type="cross_entropy", verbose=0))
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert not any(torch.equal(a, b.cpu()) for a, b in zip(before, model.parameters()))


def test_state_left_on_another_device_is_refused_before_anything_moves(monkeypatch):
    """The check at the start of a run (before the method binds and lays its buffers out, where a
    mixed-device ``torch.cat`` failed on a GPU with "wrapper_CUDA_cat"): optimizer state on another
    device than the training device is refused, and the model is not moved."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data()[0]
    F.cross_entropy(model(x), y).backward()
    opt.step()
    monkeypatch.setattr(loop_module, "resolve_device", lambda *a: torch.device("meta"))
    with pytest.raises(ValueError, match=r"^optimizer: the SGD instance holds state 'momentum_buffer' on cpu, but training runs on meta"):
        train(model, _data(), TrainingConfig(optimizer=opt, loss_type="cross_entropy", verbose=0))
    assert all(p.device.type == "cpu" for p in model.parameters())
