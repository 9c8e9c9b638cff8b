"""``TensorBoardLogger``: every numeric epoch log as a scalar per epoch, read back from the event
files with TensorBoard's own ``EventAccumulator``; non-finite values skipped; flushed every epoch,
closed at the end; only rank 0 writes; bad settings rejected before training changes anything."""

import importlib.util
import math
import os
import sys

import numpy as np
import pytest
import torch

from torchloom import Dense, Network, TensorBoardLogger, TrainingConfig, train
from torchloom.observers import tensorboard as tb_module

needs_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None, reason="needs the tensorboard extra (pip install torchloom[tensorboard])"
)


def _net(seed=0):
    torch.manual_seed(seed)
    return Network(Dense(5, 8, "tanh", dtype=torch.float64), Dense(8, 3, dtype=torch.float64))


def _data(n=3, bs=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (bs,), generator=g)) for _ in range(n)]


def _scalars(log_dir):
    """``{tag: [(step, value), ...]}`` of every event file in ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class _Trainer:
    epochs = 3


@needs_tensorboard
def test_every_numeric_epoch_log_is_a_scalar_per_epoch(tmp_path):
    log_dir = tmp_path / "runs"
    logger = TensorBoardLogger(log_dir)
    assert not log_dir.exists()  # nothing is made before training starts (then only this last level)
    result = train(_net(), _data(), TrainingConfig(epochs=3, verbose=0, loss_type="cross_entropy",
                                                   validation_data=_data(n=2, seed=7), observers=[logger]))
    assert logger.writer is None  # closed at the end of training
    scalars = _scalars(log_dir)
    history = result.history
    assert set(scalars) == set(history.keys())
    assert {"loss", "val_loss", "epoch_time", "samples_per_second", "eta", "skipped", "counted"} <= set(scalars)
    for key, points in scalars.items():
        assert [s for s, _ in points] == [0, 1, 2]
        np.testing.assert_allclose([v for _, v in points], np.float32(history[key]), rtol=1e-6, err_msg=key)


@needs_tensorboard
def test_prefix_keys_and_non_finite_values(tmp_path):
    logger = TensorBoardLogger(tmp_path, prefix="train/", keys=["loss", "val_loss", "acc", "note", "flag"])
    logger.on_train_begin(_Trainer())
    logger.on_epoch_end(_Trainer(), 0, {"loss": 0.5, "val_loss": 0.75, "acc": 0.25, "other": 1.0})
    # a diverged epoch: NaN/Inf are skipped, not written; non-numbers ignored
    logger.on_epoch_end(_Trainer(), 1, {"loss": math.nan, "val_loss": math.inf, "acc": 0.5, "note": "text", "flag": True})
    logger.on_epoch_end(_Trainer(), 2, {"loss": 0.25, "val_loss": -math.inf, "acc": np.float32(0.75)})
    logger.on_train_end(_Trainer(), None)
    assert _scalars(tmp_path) == {
        "train/loss": [(0, 0.5), (2, 0.25)],
        "train/val_loss": [(0, 0.75)],
        "train/acc": [(0, 0.25), (1, 0.5), (2, 0.75)],
    }


@needs_tensorboard
def test_flushed_at_every_epoch_end(tmp_path):
    seen = []

    class Reader:  # runs after the logger: the epoch's scalars must already be on disk
        def on_epoch_end(self, trainer, epoch, logs):
            seen.append(sorted(s for s, _ in _scalars(tmp_path).get("loss", [])))

    train(_net(), _data(), TrainingConfig(epochs=3, verbose=0, loss_type="cross_entropy",
                                          observers=[TensorBoardLogger(tmp_path), Reader()]))
    assert seen == [[0], [0, 1], [0, 1, 2]]


@needs_tensorboard
def test_only_rank_zero_writes(tmp_path, monkeypatch):
    # torch.distributed initialised (faked at its API: the engine is not run here), this process rank 1
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    log_dir = tmp_path / "runs"

    def run(logger):
        logger.on_train_begin(_Trainer())
        for epoch in range(2):
            logger.on_epoch_end(_Trainer(), epoch, {"loss": 1.0 / (epoch + 1)})
        logger.on_train_end(_Trainer(), None)

    logger = TensorBoardLogger(log_dir)
    run(logger)
    assert not log_dir.exists() and logger.writer is None
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    run(logger)
    assert _scalars(log_dir) == {"loss": [(0, 1.0), (1, 0.5)]}


def test_bad_settings(tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="log_dir .* not a directory"):
        TensorBoardLogger(a_file)
    with pytest.raises(ValueError, match="log_dir .* is a file"):
        TensorBoardLogger(a_file / "sub")
    with pytest.raises(TypeError, match="log_dir"):
        TensorBoardLogger(3)
    with pytest.raises(ValueError, match="log_dir"):
        TensorBoardLogger("")
    with pytest.raises(TypeError, match="prefix"):
        TensorBoardLogger(tmp_path, prefix=1)
    with pytest.raises(TypeError, match="keys"):
        TensorBoardLogger(tmp_path, keys="loss")
    with pytest.raises(ValueError, match="keys"):
        TensorBoardLogger(tmp_path, keys=["loss", ""])


@pytest.mark.skipif(sys.platform == "win32" or (hasattr(os, "geteuid") and os.geteuid() == 0), reason="needs POSIX permissions, not root")
def test_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="cannot be written"):
            TensorBoardLogger(ro / "runs")
    finally:
        ro.chmod(0o700)


@needs_tensorboard
def test_checked_again_before_training_changes_anything(tmp_path):
    logger = TensorBoardLogger(tmp_path / "runs")
    (tmp_path / "blocker").write_text("x")
    logger.log_dir = tmp_path / "blocker"  # changed after construction: caught before any update
    net = _net()
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match="not a directory"):
        train(net, _data(), TrainingConfig(epochs=1, verbose=0, loss_type="cross_entropy", observers=[logger]))
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))


def test_missing_tensorboard_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"torchloom\[tensorboard\]"):
        TensorBoardLogger(tmp_path)
    with pytest.raises(ImportError, match=r"torchloom\[tensorboard\]"):
        tb_module._summary_writer_class()
