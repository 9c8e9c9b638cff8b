"""Bad input and faults for the observers that write files or watch a value, and for the schedules.

Each case asserts the exact exception type and that nothing changed: the files in the directory
(names and bytes) and the model's weights. Diverged epochs are fed to the hooks directly, as the
training loop reports them (``loss = NaN``, ``counted = 0``, per-batch extras absent), with a small
stand-in trainer that has the two attributes the observers use: ``model`` and ``stop_training``.
"""

from __future__ import annotations

import io
import math
import os
import sys

import pytest
import torch

from torchloom.observers import _files
from torchloom.observers.callbacks import Checkpoint, EarlyStopping
from torchloom.observers.csv_logger import CSVLogger
from torchloom.observers.plots import LossPlot
from torchloom.optim.schedules import (
    ScheduleLR,
    constant,
    cosine_annealing,
    linear_decay,
    step_decay,
    warmup,
)

pytest.importorskip("matplotlib")

LINUX = sys.platform.startswith("linux")
ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
NAN, INF = math.nan, math.inf


class Trainer:
    """The trainer interface the observers use."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.stop_training = False
        self.epochs = 3


def _model(fill: float = 1.0) -> torch.nn.Module:
    m = torch.nn.Linear(2, 2, dtype=torch.float64)
    with torch.no_grad():
        m.weight.fill_(fill)
        m.bias.fill_(-fill)
    return m


def _weights(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _same(m: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    now = m.state_dict()
    return now.keys() == state.keys() and all(torch.equal(now[k], state[k]) for k in state)


def _files_in(d) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(d):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, d)] = f.read()
    return out


def _raises_exactly(exc: type[BaseException], fn, *args, **kwargs) -> BaseException:
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert type(info.value) is exc, f"expected exactly {exc.__name__}, got {type(info.value).__name__}: {info.value}"
    return info.value


def _logs(loss: float, counted: int = 2, **extra: float) -> dict[str, float]:
    """An epoch's logs as the loop reports them: ``counted == 0`` drops the per-batch extras."""
    logs = {"loss": loss}
    if counted:
        logs.update(extra)
    logs.update({"skipped": 2.0 - counted, "counted": float(counted), "epoch_time": 0.01,
                 "samples_per_second": 100.0, "eta": 0.0})
    return logs


# ------------------------------------------------------------------- bad construction arguments
def _paths(tmp_path):
    (tmp_path / "afile.txt").write_text("not a directory")
    return {
        "dir": str(tmp_path),
        "under_file": str(tmp_path / "afile.txt" / "sub" / "out.bin"),
        "empty": "",
        "nul": str(tmp_path / "a\x00b.bin"),
        "devnull": os.devnull,
        "proc_missing_parent": "/proc/torchloom-no-such-dir/deeper/out.bin",
        "proc_unwritable": "/proc/out.bin",
    }


PATH_CASES = ["dir", "under_file", "empty", "nul", "devnull", "proc_missing_parent", "proc_unwritable"]
MAKERS = {
    "Checkpoint": lambda p: Checkpoint(p),
    "CSVLogger": lambda p: CSVLogger(p),
    "LossPlot": lambda p: LossPlot(p),
}


@pytest.mark.parametrize("owner", sorted(MAKERS))
@pytest.mark.parametrize("case", PATH_CASES)
def test_bad_path_fails_at_construction(tmp_path, owner, case):
    if case.startswith("proc") and not LINUX:
        pytest.skip("/proc is Linux's")
    path = _paths(tmp_path)[case]
    before = _files_in(tmp_path)
    err = _raises_exactly(ValueError, MAKERS[owner], path)
    assert f"{owner}: path" in str(err)
    assert _files_in(tmp_path) == before


@pytest.mark.parametrize("owner", sorted(MAKERS))
@pytest.mark.parametrize("path", [None, 3, b"out.bin", ["out.bin"]], ids=["None", "int", "bytes", "list"])
def test_path_of_the_wrong_type(tmp_path, owner, path):
    err = _raises_exactly(TypeError, MAKERS[owner], path)
    assert "path must be a str or os.PathLike" in str(err)
    assert _files_in(tmp_path) == {}


# --------------------------------------- missing directories: only the last level is ever made
def _tensorboard(path):
    from torchloom.observers.tensorboard import TensorBoardLogger

    return TensorBoardLogger(path)


# Every observer that writes files: (factory, whether the path names a file (else a directory))
WRITERS = {
    "Checkpoint": (lambda p: Checkpoint(p), True),
    "CSVLogger": (lambda p: CSVLogger(p), True),
    "LossPlot": (lambda p: LossPlot(p), True),
    "TensorBoardLogger": (_tensorboard, False),
}


def _writer(owner):
    if owner == "TensorBoardLogger":
        pytest.importorskip("tensorboard")
    return WRITERS[owner]


def _target(tmp_path, is_file, *levels):
    """The path an observer is given: ``levels`` of directories under ``tmp_path``, then a file."""
    d = tmp_path.joinpath(*levels)
    return d / "out.bin" if is_file else d


@pytest.mark.parametrize("owner", sorted(WRITERS))
def test_a_mistyped_directory_is_an_error_before_anything_is_made(tmp_path, owner):
    """Two missing levels (``typo/run1``): a ``ValueError`` naming the argument, the missing parent and
    the rule, at construction; nothing is created."""
    make, is_file = _writer(owner)
    path = _target(tmp_path, is_file, "typo", "run1")
    name = "path" if is_file else "log_dir"
    err = _raises_exactly(ValueError, make, path)
    run1, typo = str(tmp_path / "typo" / "run1"), str(tmp_path / "typo")
    assert str(err) == (
        f"{owner}: {name} {str(path)!r} cannot be written: the directory {run1!r} does not exist and its parent "
        f"{typo!r} does not exist either. torchloom makes only the last missing directory level (a mistyped path "
        f"should fail, not become a new tree of folders): create {typo!r} first, or fix the path"
    )
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("owner", sorted(WRITERS))
def test_a_path_changed_to_a_mistyped_directory_fails_before_training_changes_anything(tmp_path, owner):
    from torchloom.layers.dense import Dense
    from torchloom.layers.network import Network
    from torchloom.engine.train import TrainingConfig, train

    make, is_file = _writer(owner)
    obs = make(_target(tmp_path, is_file, "run0"))
    setattr(obs, "path" if is_file else "log_dir", str(_target(tmp_path, is_file, "typo", "run1")))
    net = Network(Dense(2, 2))
    state = _weights(net)
    batches = [(torch.randn(4, 2), torch.randn(4, 2))]
    err = _raises_exactly(ValueError, train, net, batches, TrainingConfig(epochs=2, verbose=0, observers=[obs]))
    assert "torchloom makes only the last missing directory level" in str(err)
    assert _same(net, state) and os.listdir(tmp_path) == []


@pytest.mark.parametrize("owner", sorted(WRITERS))
def test_the_last_missing_level_is_made_when_training_writes_not_before(tmp_path, owner):
    from torchloom.layers.dense import Dense
    from torchloom.layers.network import Network
    from torchloom.engine.train import TrainingConfig, train

    make, is_file = _writer(owner)
    path = _target(tmp_path, is_file, "run1")
    obs = make(path)
    assert os.listdir(tmp_path) == []  # construction makes nothing
    batches = [(torch.randn(4, 2), torch.randn(4, 2))]
    train(Network(Dense(2, 2)), batches, TrainingConfig(epochs=2, verbose=0, observers=[obs]))
    assert os.listdir(tmp_path) == ["run1"]
    assert path.is_file() if is_file else os.listdir(path)


def test_atomic_write_makes_only_the_last_level(tmp_path):
    """The write itself never makes parents either (a directory removed after the check)."""
    with pytest.raises(OSError, match="could not write"):
        _files.atomic_write("T", str(tmp_path / "a" / "b" / "f.bin"), lambda f: f.write(b"x"))
    assert os.listdir(tmp_path) == []
    _files.atomic_write("T", str(tmp_path / "a" / "f.bin"), lambda f: f.write(b"x"))
    assert (tmp_path / "a" / "f.bin").read_bytes() == b"x"


BAD_SETTINGS = [
    # (factory, exception, words the message must contain)
    (lambda p: Checkpoint(p, monitor=""), ValueError, "monitor"),
    (lambda p: Checkpoint(p, monitor=3), TypeError, "monitor"),
    (lambda p: Checkpoint(p, mode="lowest"), ValueError, "mode must be one of"),
    (lambda p: Checkpoint(p, mode=None), ValueError, "mode must be one of"),
    (lambda p: Checkpoint(p, min_delta=-1), ValueError, "min_delta"),
    (lambda p: Checkpoint(p, min_delta=NAN), ValueError, "min_delta"),
    (lambda p: Checkpoint(p, min_delta="0.1"), ValueError, "min_delta"),
    (lambda p: Checkpoint(p, save_best_only=1), TypeError, "save_best_only"),
    (lambda p: Checkpoint(p, every_n_epochs=0), ValueError, "every_n_epochs must be an int >= 1, got 0"),
    (lambda p: Checkpoint(p, every_n_epochs=-2), ValueError, "every_n_epochs"),
    (lambda p: Checkpoint(p, every_n_epochs=1.5), ValueError, "every_n_epochs"),
    (lambda p: Checkpoint(p, every_n_epochs=True), ValueError, "every_n_epochs"),
    (lambda p: EarlyStopping(patience=0), ValueError, "patience must be an int >= 1, got 0"),
    (lambda p: EarlyStopping(patience=-1), ValueError, "patience"),
    (lambda p: EarlyStopping(patience=2.0), ValueError, "patience"),
    (lambda p: EarlyStopping(patience=True), ValueError, "patience"),
    (lambda p: EarlyStopping(restore_best="yes"), TypeError, "restore_best"),
    (lambda p: EarlyStopping(mode="maximum"), ValueError, "mode"),
    (lambda p: EarlyStopping(monitor=None), TypeError, "monitor"),
    (lambda p: EarlyStopping(min_delta=INF), ValueError, "min_delta"),
    (lambda p: CSVLogger(p, separator=";;"), ValueError, "separator"),
    (lambda p: CSVLogger(p, separator=""), ValueError, "separator"),
    (lambda p: CSVLogger(p, separator='"'), ValueError, "separator"),
    (lambda p: CSVLogger(p, separator="\n"), ValueError, "separator"),
    (lambda p: CSVLogger(p, separator=1), ValueError, "separator"),
    (lambda p: CSVLogger(p, append="yes"), TypeError, "append must be a bool"),
    (lambda p: LossPlot(p, figsize=(0, 3)), ValueError, "figsize"),
    (lambda p: LossPlot(p, figsize=(INF, 3)), ValueError, "figsize"),
    (lambda p: LossPlot(p, figsize=(3,)), ValueError, "figsize"),
    (lambda p: LossPlot(p, figsize="8x5"), ValueError, "figsize"),
    (lambda p: LossPlot(p, figsize=(1000, 1000)), ValueError, "pixels"),
    (lambda p: LossPlot(p, figsize=(0.001, 5)), ValueError, "pixels"),
    (lambda p: LossPlot(p, dpi=0), ValueError, "dpi"),
    (lambda p: LossPlot(p, dpi=1.5), ValueError, "dpi"),
    (lambda p: LossPlot(p, dpi=True), ValueError, "dpi"),
    (lambda p: LossPlot(p, every_epoch="no"), TypeError, "every_epoch must be a bool"),
    (lambda p: LossPlot(p, log_scale=1), TypeError, "log_scale must be a bool"),
    (lambda p: LossPlot(p, title=None), TypeError, "title"),
]


@pytest.mark.parametrize("make,exc,words", BAD_SETTINGS)
def test_bad_setting_fails_at_construction(tmp_path, make, exc, words):
    err = _raises_exactly(exc, make, tmp_path / "out.bin")
    assert words in str(err)
    assert _files_in(tmp_path) == {}


# ------------------------------------------------- settings changed after construction: check_ready()
def _ready(tmp_path):
    return {
        "Checkpoint": Checkpoint(tmp_path / "c.pt"),
        "EarlyStopping": EarlyStopping(),
        "CSVLogger": CSVLogger(tmp_path / "log.csv"),
        "LossPlot": LossPlot(tmp_path / "loss.png"),
    }


CHANGES = [
    ("Checkpoint", "path", "DIR", ValueError),
    ("Checkpoint", "path", None, TypeError),
    ("Checkpoint", "every_n_epochs", 0, ValueError),
    ("Checkpoint", "mode", "lowest", ValueError),
    ("Checkpoint", "monitor", "", ValueError),
    ("Checkpoint", "min_delta", -1.0, ValueError),
    ("Checkpoint", "save_best_only", "no", TypeError),
    ("EarlyStopping", "patience", 0, ValueError),
    ("EarlyStopping", "restore_best", None, TypeError),
    ("EarlyStopping", "mode", "up", ValueError),
    ("CSVLogger", "separator", "ab", ValueError),
    ("CSVLogger", "path", "UNDER_FILE", ValueError),
    ("CSVLogger", "append", 1, TypeError),
    ("LossPlot", "dpi", -1, ValueError),
    ("LossPlot", "path", "DIR", ValueError),
    ("LossPlot", "figsize", (0, 1), ValueError),
]


@pytest.mark.parametrize("owner,attr,value,exc", CHANGES, ids=[f"{o}.{a}={v!r}" for o, a, v, _ in CHANGES])
def test_check_ready_rechecks_a_changed_setting(tmp_path, owner, attr, value, exc):
    obs = _ready(tmp_path)[owner]
    obs.check_ready()  # fine as constructed
    (tmp_path / "afile.txt").write_text("x")
    value = {"DIR": str(tmp_path), "UNDER_FILE": str(tmp_path / "afile.txt" / "log.csv")}.get(value, value)
    setattr(obs, attr, value)
    before = _files_in(tmp_path)
    model = _model()
    state = _weights(model)
    err = _raises_exactly(exc, obs.check_ready)
    assert attr in str(err)
    _raises_exactly(exc, obs.on_train_begin, Trainer(model))  # the hook checks too, before any change
    assert _files_in(tmp_path) == before and _same(model, state)


def test_train_runs_check_ready_before_anything_changes(tmp_path):
    from torchloom.layers.dense import Dense
    from torchloom.layers.network import Network
    from torchloom.engine.train import TrainingConfig, train

    net = Network(Dense(2, 2))
    state = _weights(net)
    plot = LossPlot(tmp_path / "loss.png")
    plot.path = str(tmp_path)  # now a directory: caught before the first step, not after the run
    batches = [(torch.randn(4, 2), torch.randn(4, 2))]
    _raises_exactly(ValueError, train, net, batches, TrainingConfig(epochs=2, verbose=0, observers=[plot]))
    assert _same(net, state) and _files_in(tmp_path) == {}


@pytest.mark.skipif(ROOT or not hasattr(os, "geteuid"), reason="permission bits do not bind root")
@pytest.mark.parametrize("owner", sorted(MAKERS))
def test_read_only_directory(tmp_path, owner):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    try:
        _raises_exactly(ValueError, MAKERS[owner], d / "out.bin")
        assert os.listdir(d) == []
    finally:
        d.chmod(0o755)


# ------------------------------------------------------------------- CSVLogger(append=True) onto a file
BAD_LOGS = {
    "not_a_log_header": b"a,b\r\n1,2\r\n",
    "binary": b"\x89PNG\r\n\x1a\n\x00\xff\xfe",
    "ragged_rows": b"epoch,loss\r\n0,1.0\r\n1,0.5,9\r\n",
    "duplicate_columns": b"epoch,loss,loss\r\n0,1.0,1.0\r\n",
    "empty_column_name": b"epoch,,loss\r\n0,,1.0\r\n",
    "other_separator": b"epoch;loss\r\n0;1.0\r\n",  # read with ',' the header is one column 'epoch;loss'
}


@pytest.mark.parametrize("case", sorted(BAD_LOGS))
def test_csv_append_onto_a_file_that_is_not_such_a_log(tmp_path, case):
    path = tmp_path / "log.csv"
    path.write_bytes(BAD_LOGS[case])
    before = _files_in(tmp_path)
    err = _raises_exactly(ValueError, CSVLogger, path, append=True)
    assert "append=True" in str(err) and str(path) in str(err)
    assert _files_in(tmp_path) == before
    logger = CSVLogger(path)  # without append it is replaced, but only at the first epoch's end
    logger.on_train_begin(Trainer(_model()))
    assert _files_in(tmp_path) == before


def test_csv_append_onto_a_file_changed_after_construction(tmp_path):
    path = tmp_path / "log.csv"
    logger = CSVLogger(path, append=True)  # no file yet: fine
    path.write_bytes(BAD_LOGS["ragged_rows"])
    before = _files_in(tmp_path)
    _raises_exactly(ValueError, logger.check_ready)
    _raises_exactly(ValueError, logger.on_train_begin, Trainer(_model()))
    assert _files_in(tmp_path) == before


# ---------------------------------------------------------------------------- interrupted writes
def _partial_torch_save(obj, f, *a, **k):
    f.write(b"PK\x03\x04 half a checkpoint")
    raise RuntimeError("No space left on device")


def _interrupting_torch_save(obj, f, *a, **k):
    f.write(b"PK\x03\x04 half a checkpoint")
    raise KeyboardInterrupt


def _failing_replace(src, dst):
    raise PermissionError(13, "Permission denied")


def _failing_fsync(fd):
    raise OSError(28, "No space left on device")


CKPT_FAULTS = [
    ("torch.save raises mid-way", "torch_save", _partial_torch_save, OSError),
    ("KeyboardInterrupt mid-way", "torch_save", _interrupting_torch_save, KeyboardInterrupt),
    ("rename refused", "replace", _failing_replace, OSError),
    ("fsync: disk full", "fsync", _failing_fsync, OSError),
]


def _patch(monkeypatch, where, fn):
    if where == "torch_save":
        monkeypatch.setattr(torch, "save", fn)
    elif where == "replace":
        monkeypatch.setattr(_files.os, "replace", fn)
    elif where == "fsync":
        monkeypatch.setattr(_files.os, "fsync", fn)
    elif where == "savefig":
        from matplotlib.figure import Figure

        monkeypatch.setattr(Figure, "savefig", fn)


@pytest.mark.parametrize("name,where,fault,exc", CKPT_FAULTS, ids=[c[0] for c in CKPT_FAULTS])
def test_checkpoint_write_fault_keeps_the_previous_file(tmp_path, monkeypatch, name, where, fault, exc):
    path = tmp_path / "best.pt"
    ckpt = Checkpoint(path)
    good = _model(1.0)
    ckpt.on_train_begin(Trainer(good))
    ckpt.on_epoch_end(Trainer(good), 0, _logs(1.0))
    before = _files_in(tmp_path)
    better = _model(2.0)
    state = _weights(better)
    _patch(monkeypatch, where, fault)
    err = _raises_exactly(exc, ckpt.on_epoch_end, Trainer(better), 1, _logs(0.5))
    if exc is OSError:
        assert "Checkpoint: could not write" in str(err) and str(path) in str(err)
    monkeypatch.undo()
    assert _files_in(tmp_path) == before  # no stray temporary file, the old checkpoint intact
    assert torch.load(path, weights_only=True)["weight"].eq(1.0).all()
    assert ckpt.best == 1.0 and ckpt.best_epoch == 0 and ckpt.saved_epochs == [0]
    assert _same(better, state)


def _partial_savefig(self, f, *a, **k):
    f.write(b"\x89PNG\r\n\x1a\n half")
    raise RuntimeError("Agg: out of memory")


PLOT_FAULTS = [
    ("savefig raises mid-way", "savefig", _partial_savefig, OSError),
    ("rename refused", "replace", _failing_replace, OSError),
    ("fsync: disk full", "fsync", _failing_fsync, OSError),
]


@pytest.mark.parametrize("name,where,fault,exc", PLOT_FAULTS, ids=[c[0] for c in PLOT_FAULTS])
def test_loss_plot_write_fault_keeps_the_previous_png(tmp_path, monkeypatch, name, where, fault, exc):
    path = tmp_path / "loss.png"
    plot = LossPlot(path, every_epoch=True, figsize=(2, 2), dpi=20)
    trainer = Trainer(_model())
    plot.on_train_begin(trainer)
    plot.on_epoch_end(trainer, 0, _logs(1.0))
    before = _files_in(tmp_path)
    assert before["loss.png"][:8] == b"\x89PNG\r\n\x1a\n"
    _patch(monkeypatch, where, fault)
    err = _raises_exactly(exc, plot.on_epoch_end, trainer, 1, _logs(0.5))
    assert "LossPlot: could not write" in str(err)
    monkeypatch.undo()
    assert _files_in(tmp_path) == before


class _HalfWriter:
    """A binary file whose ``write`` puts down half the bytes and then fails (disk full)."""

    def __init__(self, f):
        self._f = f

    def write(self, data):
        self._f.write(data[: len(data) // 2])
        self._f.flush()
        raise OSError(28, "No space left on device")

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def test_csv_row_interrupted_mid_write_is_cut_back(tmp_path, monkeypatch):
    from torchloom.observers import csv_logger as mod

    path = tmp_path / "log.csv"
    logger = CSVLogger(path)
    trainer = Trainer(_model())
    logger.on_train_begin(trainer)
    logger.on_epoch_end(trainer, 0, _logs(1.0))
    logger.on_epoch_end(trainer, 1, _logs(0.5))
    before = _files_in(tmp_path)
    real_open = open
    monkeypatch.setattr(mod, "open", lambda p, m="r", *a, **k: _HalfWriter(real_open(p, m, *a, **k)), raising=False)
    err = _raises_exactly(OSError, logger.on_epoch_end, trainer, 2, _logs(0.25))
    assert "CSVLogger: could not append a row" in str(err)
    monkeypatch.undo()
    assert _files_in(tmp_path) == before  # the half row is gone: the file ends with a complete row
    logger.on_epoch_end(trainer, 2, _logs(0.25))  # and the log carries on
    rows = (tmp_path / "log.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows] == ["epoch", "0", "1", "2"]


@pytest.mark.parametrize("when", ["header of a new file", "rewrite for a new column"])
@pytest.mark.parametrize("where,fault", [("fsync", _failing_fsync), ("replace", _failing_replace)])
def test_csv_atomic_writes_fail_cleanly(tmp_path, monkeypatch, when, where, fault):
    path = tmp_path / "log.csv"
    path.write_bytes(b"epoch,loss\r\n0,2.0\r\n")  # a previous run's log
    logger = CSVLogger(path, append=(when != "header of a new file"))
    trainer = Trainer(_model())
    logger.on_train_begin(trainer)
    before = _files_in(tmp_path)
    _patch(monkeypatch, where, fault)
    err = _raises_exactly(OSError, logger.on_epoch_end, trainer, 0, _logs(1.0, accuracy=0.5))
    assert "CSVLogger: could not write" in str(err)
    monkeypatch.undo()
    assert _files_in(tmp_path) == before


# ------------------------------------------------------------------- diverged epochs and monitors
BAD_VALUES = [NAN, INF, -INF]


@pytest.mark.parametrize("bad", BAD_VALUES, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("mode", ["min", "max"])
def test_checkpoint_never_saves_a_diverged_epoch_as_best(tmp_path, bad, mode):
    path = tmp_path / "best.pt"
    ckpt = Checkpoint(path, mode=mode)
    good = _model(1.0)
    ckpt.on_train_begin(Trainer(good))
    ckpt.on_epoch_end(Trainer(good), 0, _logs(1.0))
    before = _files_in(tmp_path)
    diverged = _model(99.0)
    state = _weights(diverged)
    ckpt.on_epoch_end(Trainer(diverged), 1, _logs(bad, counted=0 if bad != bad else 2))
    assert _files_in(tmp_path) == before and _same(diverged, state)
    assert ckpt.best == 1.0 and ckpt.best_epoch == 0 and ckpt.saved_epochs == [0]
    assert torch.load(path, weights_only=True)["weight"].eq(1.0).all()


@pytest.mark.parametrize("bad", BAD_VALUES, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("mode", ["min", "max"])
def test_early_stopping_counts_a_diverged_epoch_as_bad_and_restores_the_finite_best(bad, mode):
    stop = EarlyStopping(patience=2, mode=mode, restore_best=True)
    good = _model(1.0)
    trainer = Trainer(good)
    stop.on_train_begin(trainer)
    stop.on_epoch_end(trainer, 0, _logs(1.0))
    with torch.no_grad():
        good.weight.fill_(-5.0)  # the weights moved on in the diverged epochs
    stop.on_epoch_end(trainer, 1, _logs(bad, counted=0))
    assert stop.wait == 1 and not trainer.stop_training
    stop.on_epoch_end(trainer, 2, _logs(bad, counted=0))
    assert stop.wait == 2 and trainer.stop_training and stop.stopped_epoch == 2
    assert stop.best == 1.0 and stop.best_epoch == 0
    stop.on_train_end(trainer, None)
    assert _same(good, _weights(_model(1.0)))  # the finite best epoch's weights, not the diverged ones


@pytest.mark.parametrize("observer", ["EarlyStopping", "Checkpoint"])
def test_only_diverged_epochs_keep_nothing_as_best(tmp_path, observer):
    obs = EarlyStopping(patience=5) if observer == "EarlyStopping" else Checkpoint(tmp_path / "best.pt")
    model = _model(3.0)
    state = _weights(model)
    trainer = Trainer(model)
    obs.on_train_begin(trainer)
    for epoch in range(3):
        obs.on_epoch_end(trainer, epoch, _logs(NAN, counted=0))
    obs.on_train_end(trainer, None)
    assert obs.best_epoch is None and math.isinf(obs.best)
    assert _files_in(tmp_path) == {} and _same(model, state)


@pytest.mark.parametrize("observer", ["EarlyStopping", "Checkpoint"])
def test_accuracy_absent_from_a_diverged_epoch_is_no_improvement(tmp_path, observer):
    obs = (EarlyStopping(monitor="accuracy", patience=1) if observer == "EarlyStopping"
           else Checkpoint(tmp_path / "best.pt", monitor="accuracy"))
    model = _model()
    trainer = Trainer(model)
    obs.on_train_begin(trainer)
    obs.on_epoch_end(trainer, 0, _logs(NAN, counted=0, accuracy=0.9))  # first epoch diverged: no error
    obs.on_epoch_end(trainer, 1, _logs(0.5, accuracy=0.6))
    before = _files_in(tmp_path)
    obs.on_epoch_end(trainer, 2, _logs(NAN, counted=0, accuracy=0.9))
    assert obs.best == 0.6 and obs.best_epoch == 1  # "auto" picked max for accuracy
    assert _files_in(tmp_path) == before


@pytest.mark.parametrize("observer", ["EarlyStopping", "Checkpoint"])
def test_monitored_key_never_logged_is_a_clear_error(tmp_path, observer):
    obs = (EarlyStopping(monitor="val_loss") if observer == "EarlyStopping"
           else Checkpoint(tmp_path / "best.pt", monitor="val_loss"))
    model = _model()
    state = _weights(model)
    obs.on_train_begin(Trainer(model))
    err = _raises_exactly(ValueError, obs.on_epoch_end, Trainer(model), 0, _logs(1.0))
    assert "monitor 'val_loss' is not in the epoch logs" in str(err) and "'loss'" in str(err)
    assert _files_in(tmp_path) == {} and _same(model, state)


@pytest.mark.parametrize("value", ["0.5", None, [0.5]], ids=["str", "None", "list"])
def test_monitored_value_that_is_not_a_number(tmp_path, value):
    ckpt = Checkpoint(tmp_path / "best.pt")
    ckpt.on_train_begin(Trainer(_model()))
    _raises_exactly(TypeError, ckpt.on_epoch_end, Trainer(_model()), 0, {"loss": value})
    assert _files_in(tmp_path) == {}


def test_csv_and_plot_record_a_diverged_epoch_as_nan(tmp_path):
    trainer = Trainer(_model())
    logger = CSVLogger(tmp_path / "log.csv")
    plot = LossPlot(tmp_path / "loss.png", figsize=(2, 2), dpi=20, log_scale=True)
    for obs in (logger, plot):
        obs.on_train_begin(trainer)
        obs.on_epoch_end(trainer, 0, _logs(1.0, accuracy=0.5))
        obs.on_epoch_end(trainer, 1, _logs(NAN, counted=0, accuracy=0.5))
        obs.on_epoch_end(trainer, 2, _logs(0.5, accuracy=0.75))
        obs.on_train_end(trainer, None)
    lines = (tmp_path / "log.csv").read_text().splitlines()
    assert lines[0] == "epoch,loss,accuracy,skipped,counted,epoch_time,samples_per_second,eta"
    assert lines[2].split(",")[:5] == ["1", "nan", "", "2.0", "0.0"]  # accuracy empty, never a fake value
    assert plot.history["loss"][1] != plot.history["loss"][1]
    assert plot.history["accuracy"][1] != plot.history["accuracy"][1]  # a gap, not a shifted curve
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------- schedules
def _sched(schedule=None):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    return ScheduleLR(opt, schedule or cosine_annealing(0.1, 0.0, 10))


BAD_STATES = [
    ("not a dict", [1, 2], TypeError),
    ("unknown schedule", {"schedule": {"name": "cyclic", "lr0": 0.1}}, ValueError),
    ("schedule not a dict", {"schedule": "cosine_annealing"}, ValueError),
    ("missing parameter", {"schedule": {"name": "step_decay", "lr0": 0.1}}, ValueError),
    ("unknown parameter", {"schedule": {"name": "constant", "lr": 0.1, "gamma": 2}}, ValueError),
    ("negative lr", {"schedule": {"name": "constant", "lr": -0.1}}, ValueError),
    ("bad nested after", {"schedule": {"name": "warmup", "warmup_steps": 2, "warmup_lr": 0.0, "base_lr": 0.1,
                                       "after": {"name": "nope"}}}, ValueError),
]


@pytest.mark.parametrize("name,state,exc", BAD_STATES, ids=[c[0] for c in BAD_STATES])
def test_schedule_lr_rejects_a_bad_state_dict_without_changing(name, state, exc):
    sched = _sched()
    sched.optimizer.step()
    sched.step()
    before = sched.state_dict()
    lr = sched.optimizer.param_groups[0]["lr"]
    _raises_exactly(exc, sched.load_state_dict, state)
    assert sched.state_dict() == before and sched.optimizer.param_groups[0]["lr"] == lr
    sched.step()
    assert sched.last_epoch == 2 and sched.get_last_lr() == [cosine_annealing(0.1, 0.0, 10)(2)]


@pytest.mark.parametrize("make,exc", [
    (lambda: constant(torch.tensor(0.1)), ValueError),
    (lambda: step_decay(0.1, 0.5, 2.0), ValueError),
    (lambda: linear_decay(0.1, NAN, 5), ValueError),
    (lambda: warmup(2, 0.0, 0.1, after=3), TypeError),
], ids=["tensor lr", "float step_size", "nan lr_final", "int after"])
def test_schedule_rejects_more_bad_arguments(make, exc):
    _raises_exactly(exc, make)


def test_schedule_state_of_a_function_schedule_loads_weights_only():
    sched = _sched(lambda step: 0.1 / (1 + step))
    for _ in range(3):
        sched.optimizer.step()
        sched.step()
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert state["schedule"] is None and state["last_epoch"] == 3
    other = _sched(lambda step: 0.1 / (1 + step))
    other.load_state_dict(state)
    other.step()
    assert other.get_last_lr() == pytest.approx([0.1 / 5])
