"""Issue 32, items 1, 3 and 4: what a resumed run keeps.

* item 1, the class "observers with state across a run resume it": every observer with
  ``state_dict()`` / ``load_state_dict()`` (``Checkpoint``, ``EarlyStopping``, one of your own) has its
  state saved in a full-state checkpoint and given back on resume; the built-in ones also catch up
  from the restored history on epochs their saved state had not seen (a ``Checkpoint`` listed earlier
  wrote the file), or on all of them (a checkpoint without observer states). Reference: the same run
  without interruption; best value, best epoch, saved epochs, wait, the best file and the final
  weights are equal.
* item 3, the class "a setting the checkpoint overrides is named": every hyper-parameter saved in a
  checkpoint (each optimizer param-group entry, the rates, the schedule's settings) that differs from
  this run's config gives one ``UserWarning`` naming it, both values and the one used (the
  checkpoint's, as ``optimizer.load_state_dict`` does in PyTorch and Lightning).
* item 4, the class "a checkpoint that does not fit changes nothing": another optimizer, a frozen
  layer, another architecture: a ``ValueError`` naming what differs, before the weights change.
"""

import warnings

import pytest
import torch

from torchloom import Checkpoint, Dense, EarlyStopping, Network, TrainingConfig, train
from torchloom.observers.base import Observer

F64 = torch.float64


def _net(hidden=6):
    torch.manual_seed(0)
    return Network(Dense(4, hidden, "tanh", dtype=F64), Dense(hidden, 3, dtype=F64))


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 4, generator=g, dtype=F64), torch.rand(5, 3, generator=g, dtype=F64)) for _ in range(3)]


class EpochCounter(Observer):
    """An observer of one's own with state across a run: the epochs it has seen, and their losses."""

    def __init__(self):
        self.losses = []

    def on_epoch_end(self, trainer, epoch, logs):
        self.losses.append(logs["loss"])

    def state_dict(self):
        return {"losses": list(self.losses)}

    def load_state_dict(self, state):
        self.losses = list(state["losses"])


def _observers(tmp, tag, mode):
    return [
        Checkpoint(tmp / f"last_{tag}.pt", save_best_only=False),  # writes before the best one has judged
        Checkpoint(tmp / f"best_{tag}.pt", mode=mode),
        EarlyStopping(mode=mode, patience=10),
        EpochCounter(),
    ]


def _cfg(epochs, observers, **kw):
    return TrainingConfig(epochs=epochs, verbose=0, optimizer="momentum", learning_rate=0.05, observers=observers, **kw)


def _uninterrupted(tmp, mode):
    net, obs = _net(), _observers(tmp, "a", mode)
    train(net, _data(), _cfg(5, obs))
    return net, obs


@pytest.mark.parametrize("mode", ["min", "max"])  # max: the best is epoch 0, so every resumed epoch is worse
def test_resumed_observers_equal_an_uninterrupted_run(tmp_path, mode):
    want_net, want = _uninterrupted(tmp_path, mode)
    net = _net()
    train(net, _data(), _cfg(2, _observers(tmp_path, "b", mode)))
    got = _observers(tmp_path, "b", mode)  # new objects, as in a new process
    train(net, _data(), _cfg(5, got, resume_from=str(tmp_path / "last_b.pt")))
    for w, g in zip(want[1:3], got[1:3]):
        assert (g.best, g.best_epoch) == (w.best, w.best_epoch)
    assert got[1].saved_epochs == want[1].saved_epochs
    assert got[2].wait == want[2].wait
    assert got[3].losses == want[3].losses
    a = torch.load(tmp_path / "best_a.pt", weights_only=True)
    b = torch.load(tmp_path / "best_b.pt", weights_only=True)
    assert a["epoch"] == b["epoch"] == want[1].best_epoch + 1
    for k, v in a["training"]["model"].items():
        assert torch.equal(b["training"]["model"][k], v), k
    for p, q in zip(net.parameters(), want_net.parameters()):  # EarlyStopping restored the same best weights
        assert torch.equal(p, q)


def test_early_stopping_resumed_stops_where_the_uninterrupted_run_stops(tmp_path):
    # mode="max" on the falling loss: epoch 0 stays the best, so patience 2 stops at epoch 2
    whole = EarlyStopping(mode="max", patience=2)
    want = train(_net(), _data(), _cfg(6, [whole]))
    net = _net()
    train(net, _data(), _cfg(2, [Checkpoint(tmp_path / "s.pt", save_best_only=False), EarlyStopping(mode="max", patience=2)]))
    resumed = EarlyStopping(mode="max", patience=2)
    got = train(net, _data(), _cfg(6, [resumed], resume_from=str(tmp_path / "s.pt")))
    assert whole.stopped_epoch == resumed.stopped_epoch == 2
    assert got.loss_history == want.loss_history


def test_a_checkpoint_without_observer_states_is_caught_up_from_its_history(tmp_path):
    _, want = _uninterrupted(tmp_path, "max")
    net = _net()
    train(net, _data(), _cfg(2, _observers(tmp_path, "b", "max")))
    state = torch.load(tmp_path / "last_b.pt", weights_only=True)
    del state["observers"]  # as an earlier release wrote it
    torch.save(state, tmp_path / "old.pt")
    best = Checkpoint(tmp_path / "best_c.pt", mode="max")
    train(net, _data(), _cfg(5, [best], resume_from=str(tmp_path / "old.pt")))
    assert (best.best, best.best_epoch) == (want[1].best, want[1].best_epoch) == (want[1].best, 0)
    assert not (tmp_path / "best_c.pt").exists()  # no resumed epoch beat epoch 0: nothing overwritten


def test_two_observers_of_one_class_keep_their_own_state(tmp_path):
    net = _net()
    first, second = EarlyStopping(mode="max", patience=10), EarlyStopping(mode="min", patience=10)
    train(net, _data(), _cfg(2, [Checkpoint(tmp_path / "s.pt", save_best_only=False), first, second]))
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    assert state["observers"]["EarlyStopping"]["tracker"]["mode"] == "max"
    assert state["observers"]["EarlyStopping#2"]["tracker"]["mode"] == "min"


# ------------------------------------------------------------------------------------ item 3
def _saved(tmp_path, **kw):
    path = tmp_path / "run.pt"
    settings = dict(optimizer="momentum", learning_rate=0.05) | kw
    train(_net(), _data(), TrainingConfig(epochs=2, verbose=0, observers=[Checkpoint(path, save_best_only=False)], **settings))
    return path


_TAIL = (
    ". To go on with new settings, start a new run from the weights: model.load_state_dict(torch.load(path, "
    "weights_only=True)['training']['model'])"
)
_HEAD = "resume_from: the checkpoint's settings are used where this run's config differs (as optimizer.load_state_dict does in PyTorch): "


def _resume_warnings(path, **kw):
    net = _net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(net, _data(), TrainingConfig(epochs=3, verbose=0, resume_from=str(path), **kw))
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "resume_from" in str(w.message)], net


def test_a_new_learning_rate_or_momentum_is_named_and_the_checkpoints_is_used(tmp_path):
    from torchloom.optim import SGD

    path = _saved(tmp_path)
    got, _ = _resume_warnings(path, optimizer="momentum", learning_rate=0.1)
    assert got == [_HEAD + "optimizer lr 0.05 (this run: 0.1)" + _TAIL]
    net = _net()
    opt = SGD(net.parameters(), lr=0.05, momentum=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(net, _data(), TrainingConfig(epochs=3, verbose=0, resume_from=str(path), optimizer=opt))
    assert [str(w.message) for w in caught if "resume_from" in str(w.message)] == [_HEAD + "optimizer momentum 0.9 (this run: 0.5)" + _TAIL]
    assert opt.param_groups[0]["momentum"] == 0.9  # the checkpoint's value is the one used


def test_a_new_schedule_or_method_rate_is_named(tmp_path):
    from torchloom.optim.schedules import step_decay

    path = _saved(tmp_path, scheduler=step_decay(0.05, 0.5, 2))
    got, _ = _resume_warnings(path, optimizer="momentum", learning_rate=0.05, scheduler=step_decay(0.1, 0.5, 3))
    assert got == [_HEAD + "schedule lr0 0.05 (this run: 0.1); schedule step_size 2 (this run: 3)" + _TAIL]
    got, _ = _resume_warnings(path, optimizer="momentum", learning_rate=0.05)
    assert got == [_HEAD + "a schedule: the checkpoint has one, this run none (the rates stay where it left them)" + _TAIL]
    for method in ("target_prop", "tween"):
        path = _saved(tmp_path, method=method, optimizer="sgd")
        got, _ = _resume_warnings(path, method=method, learning_rate=0.2)
        assert got == [_HEAD + "rate 0.05 (this run: 0.2)" + _TAIL], method


def test_the_same_settings_give_no_warning(tmp_path):
    path = _saved(tmp_path)
    got, _ = _resume_warnings(path, optimizer="momentum", learning_rate=0.05)
    assert got == []


# ------------------------------------------------------------------------------------ item 4
def _refused(path, net, **kw):
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ValueError) as e:
        train(net, _data(), TrainingConfig(epochs=3, verbose=0, resume_from=str(path), **kw))
    for k, v in before.items():  # the weights untouched
        assert torch.equal(net.state_dict()[k], v), k
    return str(e.value)


def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_changes(tmp_path):
    path = _saved(tmp_path)
    assert _refused(path, _net(), optimizer="adamw") == (
        "resume_from: the checkpoint was written with another optimizer than this run's AdamW: its settings "
        "['dampening', 'momentum', 'nesterov'] are not AdamW's, and AdamW's ['betas', 'capturable', 'eps'] are "
        "missing; nothing was changed"
    )
    frozen = _net()
    frozen.layers[0].weight.requires_grad_(False)
    assert _refused(path, frozen, optimizer="momentum", learning_rate=0.05) == (
        "resume_from: param group 0 of the checkpoint's optimizer holds 4 parameters, this run's SGD 3 (a layer "
        "frozen or unfrozen since?); nothing was changed"
    )
    assert _refused(path, _net(hidden=7), optimizer="momentum", learning_rate=0.05) == (
        "resume_from: the checkpoint's model does not match this model (shapes differ (checkpoint vs this model): "
        "layers.0.weight [6, 4] vs [7, 4], layers.0.bias [6] vs [7], layers.1.weight [3, 6] vs [3, 7]); nothing was changed"
    )


def test_a_resumed_csv_log_and_loss_plot_hold_the_whole_run(tmp_path):
    import csv

    from torchloom import CSVLogger, LossPlot

    want = train(_net(), _data(), _cfg(4, []))
    net = _net()
    train(net, _data(), _cfg(2, [Checkpoint(tmp_path / "s.pt", save_best_only=False), CSVLogger(tmp_path / "a.csv")]))
    observers = [CSVLogger(tmp_path / "b.csv"), LossPlot(tmp_path / "b.png")]
    train(net, _data(), _cfg(4, observers, resume_from=str(tmp_path / "s.pt")))
    with open(tmp_path / "b.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2, 3]
    assert [float(r["loss"]) for r in rows] == pytest.approx(want.loss_history, rel=1e-12)
    assert observers[1].epochs == [1, 2, 3, 4]
    assert observers[1].history["loss"] == pytest.approx(want.loss_history, rel=1e-12)


def test_a_state_that_fails_to_load_puts_everything_back(tmp_path):
    # what read()'s checks cannot foresee (here a schedule the file describes wrongly) fails after the
    # weights were loaded: they are put back, and the error says nothing was changed
    from torchloom.optim.schedules import step_decay

    path = _saved(tmp_path, scheduler=step_decay(0.05, 0.5, 2))
    state = torch.load(path, weights_only=True)
    state["training"]["scheduler"]["schedule"] = {"name": "no_such_schedule"}
    torch.save(state, tmp_path / "bad.pt")
    net = _net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (the schedule's name differs: named, then refused)
        message = _refused(tmp_path / "bad.pt", net, optimizer="momentum", learning_rate=0.05, scheduler=step_decay(0.05, 0.5, 2))
    assert message.startswith("resume_from: the checkpoint's state does not fit this run (ValueError: ScheduleLR.load_state_dict: ")
    assert message.endswith("); nothing was changed")
