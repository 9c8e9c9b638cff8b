"""EarlyStopping and Checkpoint on a constructed plateau whose trajectory is known in closed form.

One weight ``w``, input 1, target 0, MSE: the batch loss is ``w²`` and SGD maps ``w → w(1 − 2·lr)``.
With lr 0.25 for the first steps ``w`` halves each epoch (loss falls by 4×); then lr 1.5 makes it
``w → −2w`` (loss rises 4× an epoch). One batch per epoch, so the epoch loss is the pre-update ``w²``.
"""

import pytest
import torch

from torchloom.layers.dense import Dense
from torchloom.layers.network import Network
from torchloom.observers.callbacks import Checkpoint, EarlyStopping
from torchloom.engine.train import TrainingConfig, train

SWITCH = 4  # steps 0..3 at lr 0.25, then lr 1.5


def _model_state(path):
    """The model's state_dict in a Checkpoint file (full training state by default)."""
    state = torch.load(path, weights_only=True)
    return state["training"]["model"] if "format" in state else state


def _lr(step):
    return 0.25 if step < SWITCH else 1.5


def _net():
    net = Network(Dense(1, 1, bias=False, dtype=torch.float64))
    with torch.no_grad():
        net.layers[0].weight.fill_(1.0)
    return net


BATCHES = [(torch.ones(1, 1, dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64))]


def _trajectory(epochs):
    """Closed form: the weight at the start of each epoch and after the last, and the epoch losses."""
    w = [1.0]
    for step in range(epochs):
        w.append(w[-1] * (1 - 2 * _lr(step)))
    return w, [v * v for v in w[:-1]]


def _config(epochs, observers):
    return TrainingConfig(epochs=epochs, learning_rate=0.25, scheduler=_lr, verbose=0, observers=observers)


def test_early_stopping_stops_and_restores_best():
    w, losses = _trajectory(20)
    best = min(range(20), key=losses.__getitem__)
    assert best == SWITCH  # the plateau: losses fall until epoch 4, then rise

    net = _net()
    stop = EarlyStopping(monitor="loss", patience=2)
    result = train(net, BATCHES, _config(20, [stop]))

    assert result.loss_history == pytest.approx(losses[: best + 3], rel=1e-12)  # two bad epochs, then stop
    assert stop.stopped_epoch == best + 2
    assert stop.best_epoch == best and stop.best == pytest.approx(losses[best], rel=1e-12)
    # restored: the weights at the end of the best epoch (Keras' convention), not the last ones
    assert net.layers[0].weight.item() == pytest.approx(w[best + 1], rel=1e-12)
    assert w[best + 1] != pytest.approx(w[best + 3])


def test_early_stopping_without_restore_keeps_last_weights():
    w, _ = _trajectory(20)
    net = _net()
    stop = EarlyStopping(patience=3, restore_best=False)
    result = train(net, BATCHES, _config(20, [stop]))
    assert len(result.loss_history) == SWITCH + 4
    assert net.layers[0].weight.item() == pytest.approx(w[SWITCH + 4], rel=1e-12)


def test_early_stopping_min_delta_and_max_mode():
    # min_delta larger than every improvement after epoch 0: epochs 1.. never count as better
    _, losses = _trajectory(20)
    stop = EarlyStopping(patience=2, min_delta=10.0)
    result = train(_net(), BATCHES, _config(20, [stop]))
    assert len(result.loss_history) == 3 and stop.best_epoch == 0

    # mode="max" on the loss: the rising part is the "improvement", the falling part stalls
    stop = EarlyStopping(patience=4, mode="max", restore_best=False)
    result = train(_net(), BATCHES, _config(20, [stop]))
    assert stop.best_epoch == 0 and len(result.loss_history) == 5


def test_early_stopping_monitor_must_exist():
    with pytest.raises(ValueError, match="'val_loss' is not in the epoch logs"):
        train(_net(), BATCHES, _config(3, [EarlyStopping(monitor="val_loss")]))


def test_early_stopping_rejects_bad_arguments():
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping(patience=0)
    with pytest.raises(ValueError, match="mode"):
        EarlyStopping(mode="lowest")
    with pytest.raises(ValueError, match="min_delta"):
        EarlyStopping(min_delta=-1)
    with pytest.raises(TypeError, match="restore_best"):
        EarlyStopping(restore_best="yes")


def test_checkpoint_saves_best_state_dict(tmp_path):
    w, losses = _trajectory(10)
    path = tmp_path / "best.pt"
    ckpt = Checkpoint(path)
    train(_net(), BATCHES, _config(10, [ckpt]))
    assert ckpt.saved_epochs == list(range(SWITCH + 1))  # improved every epoch up to the plateau
    state = _model_state(path)
    assert set(state) == {"layers.0.weight"}
    assert state["layers.0.weight"].item() == pytest.approx(w[SWITCH + 1], rel=1e-12)
    fresh = _net()
    fresh.load_state_dict(state)  # loads into a model of the same shape
    assert not (tmp_path / "best.pt.tmp").exists()


def test_checkpoint_every_epoch(tmp_path):
    w, _ = _trajectory(6)
    path = tmp_path / "last.pt"
    ckpt = Checkpoint(path, save_best_only=False)
    train(_net(), BATCHES, _config(6, [ckpt]))
    assert ckpt.saved_epochs == list(range(6))
    assert _model_state(path)["layers.0.weight"].item() == pytest.approx(w[6], rel=1e-12)


def test_checkpoint_and_early_stopping_together(tmp_path):
    w, _ = _trajectory(20)
    path = tmp_path / "best.pt"
    net = _net()
    train(net, BATCHES, _config(20, [Checkpoint(path), EarlyStopping(patience=2)]))
    assert _model_state(path)["layers.0.weight"].item() == net.layers[0].weight.item() == pytest.approx(w[SWITCH + 1])


def test_checkpoint_rejects_bad_arguments():
    with pytest.raises(TypeError, match="path"):
        Checkpoint(None)
    with pytest.raises(TypeError, match="save_best_only"):
        Checkpoint("x.pt", save_best_only=1)
    with pytest.raises(ValueError, match="monitor"):
        Checkpoint("x.pt", monitor="")


def test_checkpoint_every_n_epochs(tmp_path):
    w, _ = _trajectory(7)
    path = tmp_path / "every3.pt"
    ckpt = Checkpoint(path, save_best_only=False, every_n_epochs=3)
    train(_net(), BATCHES, _config(7, [ckpt]))
    assert ckpt.saved_epochs == [2, 5]  # 1-based epochs 3 and 6
    assert _model_state(path)["layers.0.weight"].item() == pytest.approx(w[6], rel=1e-12)


def test_mode_auto_watches_accuracy_upwards(tmp_path):
    class T:
        model = _net()
        stop_training = False

    ckpt = Checkpoint(tmp_path / "acc.pt", monitor="val_accuracy")
    stop = EarlyStopping(monitor="val_accuracy", patience=1, restore_best=False)
    for obs in (ckpt, stop):
        obs.on_train_begin(T)
        for epoch, acc in enumerate([0.5, 0.7, 0.6]):
            obs.on_epoch_end(T, epoch, {"loss": 1.0 - acc, "val_accuracy": acc, "counted": 1.0})
        assert obs.best == 0.7 and obs.best_epoch == 1
    assert ckpt.saved_epochs == [0, 1] and stop.stopped_epoch == 2
    # and "auto" on a loss key is "min"
    stop = EarlyStopping(monitor="val_loss", patience=1)
    stop.on_train_begin(T)
    for epoch, v in enumerate([0.5, 0.3, 0.4]):
        stop.on_epoch_end(T, epoch, {"val_loss": v})
    assert stop.best == 0.3 and stop.stopped_epoch == 2


def test_restore_best_and_checkpoint_skip_diverged_epochs_in_training(tmp_path):
    """Through train(): from epoch 6 on every batch has a NaN input, so those epochs count nothing and
    report loss NaN. Epochs 0-4 improve, 5 gets worse, 6 and 7 diverge: patience 3 stops at 7, and
    the weights restored (and checkpointed) are epoch 4's, never a diverged epoch's."""
    w, _ = _trajectory(8)

    class Data(torch.utils.data.Dataset):
        poisoned = False

        def __len__(self):
            return 1

        def __getitem__(self, i):
            x = torch.full((1, 1), float("nan") if self.poisoned else 1.0, dtype=torch.float64)
            return x, torch.zeros(1, 1, dtype=torch.float64)

    data = Data()

    class Poison:
        def on_epoch_end(self, trainer, epoch, logs):
            data.poisoned = epoch >= 5

    net = _net()
    stop = EarlyStopping(patience=3)
    ckpt = Checkpoint(tmp_path / "best.pt")
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    with pytest.warns(Warning, match="no batch counted"):
        result = train(net, loader, _config(20, [Poison(), stop, ckpt]))
    assert len(result.loss_history) == 8 and stop.stopped_epoch == 7
    assert all(v != v for v in result.loss_history[6:])  # NaN, never a fake 0.0
    assert stop.best_epoch == ckpt.best_epoch == SWITCH
    assert ckpt.saved_epochs == list(range(SWITCH + 1))
    assert net.layers[0].weight.item() == pytest.approx(w[SWITCH + 1], rel=1e-12)
    assert _model_state(tmp_path / "best.pt")["layers.0.weight"].item() == pytest.approx(w[SWITCH + 1])
    assert w[SWITCH + 1] != pytest.approx(w[6])
