"""Observers that write files: LossPlot (a valid PNG), CSVLogger (rows that parse), and
print_gradient_stats (numbers against torch autograd)."""

import builtins
import copy
import csv
import io
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torchloom.layers.dense import Dense
from torchloom.layers.network import Network
from torchloom.observers.csv_logger import CSVLogger
from torchloom.observers.gradient_stats import format_gradient_stats, print_gradient_stats
from torchloom.observers.plots import LossPlot
from torchloom.engine.train import TrainingConfig, train


def _net():
    return Network(Dense(3, 6, "relu"), Dense(6, 2))


def _batches(n=3, bs=5):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(bs, 3, generator=g), torch.randn(bs, 2, generator=g)) for _ in range(n)]


# ------------------------------------------------------------------------ LossPlot
def test_loss_plot_writes_a_valid_png(tmp_path):
    mpimg = pytest.importorskip("matplotlib.image")
    path = tmp_path / "loss.png"
    train(_net(), _batches(), TrainingConfig(epochs=5, verbose=0, observers=[LossPlot(path)]))
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.shape[:2] == (500, 800)  # 8×5 in at 100 dpi: rows, columns
    assert img[..., :3].std() > 0.01  # something was drawn, not a blank canvas


def test_loss_plot_with_accuracy_and_size(tmp_path):
    mpimg = pytest.importorskip("matplotlib.image")
    plot = LossPlot(tmp_path / "acc.png", figsize=(4, 3), dpi=50)

    class Trainer:  # the hooks need nothing from the trainer
        pass

    plot.on_train_begin(Trainer())
    for epoch, (loss, acc) in enumerate([(1.0, 0.2), (0.5, 0.6), (0.25, 0.9)]):
        plot.on_epoch_end(Trainer(), epoch, {"loss": loss, "accuracy": acc, "epoch_time": 0.1})
    plot.on_train_end(Trainer(), None)
    assert plot.history == {"loss": [1.0, 0.5, 0.25], "accuracy": [0.2, 0.6, 0.9]}
    assert mpimg.imread(tmp_path / "acc.png").shape[:2] == (150, 200)


def test_loss_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=re.escape("pip install torchloom[plot]")):
        LossPlot(tmp_path / "x.png")


def test_loss_plot_rejects_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="path"):
        LossPlot(3)
    with pytest.raises(ValueError, match="figsize"):
        LossPlot(tmp_path / "x.png", figsize=(0, 3))
    with pytest.raises(ValueError, match="dpi"):
        LossPlot(tmp_path / "x.png", dpi=0)


# ----------------------------------------------------------------------- CSVLogger
def test_csv_logger_rows_parse(tmp_path):
    path = tmp_path / "log.csv"
    result = train(_net(), _batches(), TrainingConfig(epochs=4, verbose=0, observers=[CSVLogger(path)]))
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    assert list(rows[0]) == ["epoch", "loss", "lr", "skipped", "counted", "diverged", "epoch_time", "samples_per_second", "eta"]
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2, 3]
    assert [float(r["loss"]) for r in rows] == result.loss_history  # full precision round trip
    assert [float(r["epoch_time"]) for r in rows] == result.epoch_times
    assert float(rows[-1]["eta"]) == 0.0


def test_csv_logger_append_keeps_header(tmp_path):
    path = tmp_path / "log.csv"
    train(_net(), _batches(), TrainingConfig(epochs=2, verbose=0, observers=[CSVLogger(path)]))
    train(_net(), _batches(), TrainingConfig(epochs=3, verbose=0, observers=[CSVLogger(path, append=True)]))
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    assert len(lines) == 1 + 2 + 3 and lines[0].startswith("epoch,loss")
    assert [ln.split(",")[0] for ln in lines[1:]] == ["0", "1", "0", "1", "2"]


def test_csv_logger_append_onto_another_header_writes_the_union_of_columns(tmp_path):
    """A file with other columns is rewritten with the union (old columns first): every old value
    kept, new values in their own columns, no empty rows."""
    path = tmp_path / "log.csv"
    path.write_text("epoch,loss,val_loss\r\n0,2.0,2.5\r\n1,1.0,1.5\r\n")

    class T:
        pass

    logger = CSVLogger(path, append=True)
    logger.on_train_begin(T())
    logger.on_epoch_end(T(), 0, {"loss": 0.5, "accuracy": 0.75})
    logger.on_epoch_end(T(), 1, {"loss": 0.25, "accuracy": 0.875})
    logger.on_train_end(T(), None)
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [
        ["epoch", "loss", "val_loss", "accuracy"],
        ["0", "2.0", "2.5", ""],
        ["1", "1.0", "1.5", ""],
        ["0", "0.5", "", "0.75"],
        ["1", "0.25", "", "0.875"],
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.csv"]  # no temporary file left


def test_csv_logger_keeps_the_old_file_until_the_first_epoch_ends(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("old,log\n")

    class T:
        pass

    logger = CSVLogger(path)  # append=False: replaced, but only once there is a row to write
    logger.on_train_begin(T())
    assert path.read_text() == "old,log\n"
    logger.on_epoch_end(T(), 0, {"loss": 1.5})
    assert path.read_text().splitlines() == ["epoch,loss", "0,1.5"]


def test_csv_logger_appends_after_a_last_row_without_line_end(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("epoch,loss\n0,2.0")  # e.g. written by hand; the row itself is complete

    class T:
        pass

    logger = CSVLogger(path, append=True)
    logger.on_epoch_end(T(), 0, {"loss": 1.0})  # hooks outside fit() start the log themselves
    with open(path, newline="") as f:
        assert list(csv.reader(f)) == [["epoch", "loss"], ["0", "2.0"], ["0", "1.0"]]


def test_csv_logger_rejects_bad_arguments():
    with pytest.raises(TypeError, match="path"):
        CSVLogger(None)
    with pytest.raises(ValueError, match="separator"):
        CSVLogger("x.csv", separator=";;")


# ------------------------------------------------------------- print_gradient_stats
def test_print_gradient_stats_matches_autograd():
    net = Network(Dense(3, 6, "relu", dtype=torch.float64), Dense(6, 2, dtype=torch.float64))
    x, y = (t.double() for t in _batches(1)[0])
    ref = copy.deepcopy(net)
    out = net.forward_record(x)
    net.backward(2 * (out - y) / out.numel())
    buf = io.StringIO()
    print_gradient_stats(net, stream=buf)
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("Gradient statistics")
    assert len(lines) == 3

    l0, l1 = ref.layers
    loss = F.mse_loss(F.linear(torch.relu(F.linear(x, l0.weight, l0.bias)), l1.weight, l1.bias), y)
    grads = torch.autograd.grad(loss, list(ref.parameters()))
    per_layer = [torch.cat([grads[0].reshape(-1), grads[1]]), torch.cat([grads[2].reshape(-1), grads[3]])]
    pattern = re.compile(r"^  Layer (\d) \(Dense\): min=(\S+) max=(\S+) mean=(\S+) norm=(\S+)$")
    for i, (line, g) in enumerate(zip(lines[1:], per_layer)):
        m = pattern.match(line)
        assert m and int(m.group(1)) == i, line
        expected = [g.min().item(), g.max().item(), g.mean().item(), g.norm().item()]
        np.testing.assert_allclose([float(v) for v in m.groups()[1:]], expected, rtol=1e-5, atol=1e-12)


def test_print_gradient_stats_before_backward_and_bad_model():
    assert "no gradients yet" in format_gradient_stats(_net())[0]
    with pytest.raises(TypeError, match="must be a torchloom Network"):
        print_gradient_stats(torch.nn.Linear(2, 2))


def test_print_gradient_stats_of_a_trainer(capsys):
    from torchloom import BackpropTrainer

    trainer = BackpropTrainer(_net(), TrainingConfig(verbose=0))
    trainer.fit(_batches(), 1)
    print_gradient_stats(trainer)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and all(math.isfinite(float(v)) for v in re.findall(r"norm=(\S+)", "\n".join(out)))
