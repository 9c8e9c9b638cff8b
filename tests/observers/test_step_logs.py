"""Per-step logs (``TrainingConfig.log_every_n_steps``), the learning rate in the logs, per-epoch
samples/s and the notebook progress bar (issue 33, item 6)."""

from __future__ import annotations

import copy
import csv
import importlib.util
import io

import pytest
import torch
import torch.nn.functional as F

import torchloom
from torchloom import CSVLogger, Dense, Network, TensorBoardLogger, TrainingConfig, TweenConfig
from torchloom.observers import progress as progress_module
from torchloom.observers.base import ObserverList


def _data(n: int = 3, rows: int = 4):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(rows, 3, generator=g, dtype=torch.float64), torch.randn(rows, 2, generator=g, dtype=torch.float64)) for _ in range(n)]


def schedule(step: int) -> float:
    return 0.1 / (1 + step)


class StepRecorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, dict]] = []

    def on_step_log(self, trainer, step, logs) -> None:
        self.calls.append((step, dict(logs)))


def test_step_logs_match_a_torch_loop() -> None:
    """Every 2nd step: its pre-update loss and the rate it used, against plain autograd + SGD."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    ref = copy.deepcopy(model)
    data = _data()
    rec = StepRecorder()
    result = torchloom.train(model, data, TrainingConfig(epochs=3, verbose=0, log_every_n_steps=2, scheduler=schedule, observers=[rec]))
    want_loss, want_lr, step = {}, {}, 0
    for _ in range(3):
        for x, y in data:
            loss = F.mse_loss(ref(x), y)
            ref.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in ref.parameters():
                    p -= schedule(step) * p.grad
            want_loss[step], want_lr[step] = loss.item(), schedule(step)
            step += 1
    assert [s for s, _ in rec.calls] == [1, 3, 5, 7] == result.history.steps
    for s, logs in rec.calls:
        assert logs.keys() == {"loss", "lr", "skipped"}
        assert logs["loss"] == pytest.approx(want_loss[s], rel=1e-12)
        assert logs["lr"] == schedule(s) and logs["skipped"] == 0.0
    assert result.history.step_history["loss"] == [logs["loss"] for _, logs in rec.calls]
    # per epoch: the rate the epoch starts with, and the epoch's own samples/s
    assert result.history["lr"] == [schedule(0), schedule(3), schedule(6)]
    for sps, t in zip(result.history["samples_per_second"], result.history["epoch_time"]):
        assert sps == 12 / t


def test_no_step_logs_by_default_and_the_hook_keeps_the_device_path() -> None:
    rec = StepRecorder()
    result = torchloom.train(torch.nn.Linear(3, 2).double(), _data(), TrainingConfig(epochs=1, verbose=0, observers=[rec]))
    assert rec.calls == [] and result.history.steps == []
    assert ObserverList([rec]).wants("on_step_log") and not ObserverList([rec]).wants("on_batch_end")
    with pytest.raises(ValueError) as e:
        TrainingConfig(log_every_n_steps=-1)
    assert str(e.value) == "TrainingConfig: log_every_n_steps must be an int >= 0 (0 = off), got -1"


def _tween_net() -> Network:
    torch.manual_seed(1)
    return Network(Dense(3, 4, activation="tanh"), Dense(4, 2)).double()


def test_device_path_delivers_the_same_step_logs_at_the_epoch_end() -> None:
    """The device runner (here on CPU tensors) reads the logged steps with the epoch's one read: the
    same steps, losses, method logs and rates as the host loop."""
    from torchloom.engine.cuda_path import CudaRunner
    from torchloom.engine.train import make_trainer

    data = [(x, y) for x, y in _data(5)]
    cfg = lambda: TrainingConfig(epochs=2, verbose=0, method=TweenConfig(), log_every_n_steps=3, scheduler=schedule)  # noqa: E731
    host = torchloom.train(_tween_net(), data, cfg())
    trainer = make_trainer(_tween_net(), cfg())
    trainer._runner = CudaRunner(trainer)
    on_device = trainer.fit(data, 2)
    assert host.history.steps == on_device.history.steps == [2, 5, 8]
    assert set(host.history.step_history) == set(on_device.history.step_history)
    assert len(host.history.step_history) > 3  # Tween's own step logs came too
    for key, values in host.history.step_history.items():
        assert on_device.history.step_history[key] == pytest.approx(values, rel=1e-6, abs=1e-9), key


def test_csv_step_file(tmp_path) -> None:
    logger = CSVLogger(tmp_path / "epochs.csv", step_path=tmp_path / "steps.csv")
    result = torchloom.train(torch.nn.Linear(3, 2).double(), _data(), TrainingConfig(epochs=2, verbose=0, log_every_n_steps=2, observers=[logger]))
    with open(tmp_path / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", "loss", "lr", "skipped"]
    assert [int(r["step"]) for r in rows] == [1, 3, 5]
    assert [float(r["loss"]) for r in rows] == result.history.step_history["loss"]
    with open(tmp_path / "epochs.csv", newline="") as f:
        epochs = list(csv.DictReader(f))
    assert [float(r["lr"]) for r in epochs] == [0.01, 0.01]
    with pytest.raises(ValueError) as e:
        CSVLogger(tmp_path / "a.csv", step_path=tmp_path / "a.csv")
    assert str(e.value) == f"CSVLogger: step_path must be another file than path, got {str(tmp_path / 'a.csv')!r} for both"


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs the tensorboard extra")
def test_tensorboard_step_scalars(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = torchloom.train(
        torch.nn.Linear(3, 2).double(), _data(), TrainingConfig(epochs=2, verbose=0, log_every_n_steps=2, observers=[TensorBoardLogger(tmp_path)])
    )
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    steps = [(e.step, e.value) for e in acc.Scalars("loss_step")]
    assert [s for s, _ in steps] == [1, 3, 5]
    assert [v for _, v in steps] == pytest.approx(result.history.step_history["loss"], rel=1e-6)
    assert [e.value for e in acc.Scalars("lr")] == pytest.approx([0.01, 0.01])


def test_notebook_gets_a_tqdm_auto_bar(monkeypatch) -> None:
    made = []

    class FakeAutoBar:
        def __init__(self, **kwargs) -> None:
            made.append(kwargs)

        def update(self, n=1) -> None: ...
        def set_postfix_str(self, *a, **k) -> None: ...
        def close(self) -> None: ...

    import tqdm.auto

    monkeypatch.setattr(tqdm.auto, "tqdm", FakeAutoBar)
    monkeypatch.setattr(progress_module, "_in_notebook", lambda stream: True)
    obs = progress_module.ProgressObserver(per_batch=True)  # a notebook's stdout is no terminal
    assert obs.bar is True
    torchloom.train(torch.nn.Linear(3, 2).double(), _data(), TrainingConfig(epochs=1, verbose=0, observers=[obs]))
    assert made and made[0]["desc"] == "Epoch 1/1" and made[0]["total"] == 3
    # outside a kernel: no widget, and a non-terminal stream draws no bar
    monkeypatch.undo()
    assert progress_module._in_notebook(None) is False
    assert progress_module.ProgressObserver(stream=io.StringIO()).bar is False


@pytest.mark.cuda
def test_graph_captured_steps_deliver_the_host_loops_step_logs() -> None:
    """On CUDA with graph capture: the same logged steps, rates and (float32) losses as the host loop
    the same run takes with a per-batch observer."""

    class PerBatch:
        def on_batch_end(self, trainer, step, logs) -> None: ...

    data = [(x.float().cuda(), y.float().cuda()) for x, y in _data(6)]
    runs = []
    for extra in ([], [PerBatch()]):
        torch.manual_seed(0)
        net = Network(Dense(3, 8, activation="tanh"), Dense(8, 2))
        cfg = TrainingConfig(epochs=3, use_gpu=True, verbose=0, log_every_n_steps=4, scheduler=schedule, observers=extra)
        runs.append(torchloom.train(net, data, cfg))
    graphed, host = runs
    assert graphed.history.steps == host.history.steps == [3, 7, 11, 15]
    assert graphed.history.step_history["lr"] == host.history.step_history["lr"] == [schedule(s) for s in (3, 7, 11, 15)]
    assert graphed.history.step_history["loss"] == pytest.approx(host.history.step_history["loss"], rel=1e-5)
