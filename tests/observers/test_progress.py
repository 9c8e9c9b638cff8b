"""Console output: Loom's exact epoch line (checked against real Loom's own lines), torchloom's line
with human-readable durations, the extras appended to both, and the tqdm progress bar (one line in a
narrow terminal, plain lines when not a terminal, no per-batch hook when it advances per epoch)."""

import ctypes
import io
import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from loom_oracle import welvet
from torchloom import Dense, Network, TrainingConfig, TweenConfig, train
from torchloom.observers.base import ObserverList
from torchloom.observers.progress import (
    EpochLinePrinter,
    ProgressObserver,
    format_duration,
    format_epoch_extras,
    format_epoch_line,
    format_log_value,
    human_duration,
    print_line,
)

LOOM_LINE = re.compile(
    r"Epoch (\d+)/(\d+) - Loss: (\d+\.\d{6}) \| Time: (\S+) \| Samples/s: (\d+\.\d{2}) \| ETA: (\S+)"
)
_DUR = r"(?:\d+(?:\.\d+)? (?:ns|µs|ms|s)|\d+ min \d\d s|\d+ h \d\d min|\d+ d \d\d h)"
HUMAN_LINE = re.compile(
    rf"Epoch (\d+)/(\d+) - Loss: (\d+\.\d{{6}}|nan) \| Time: ({_DUR}) \| Samples/s: (\d+\.\d{{2}}) \| ETA: ({_DUR})"
)


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def _net(seed=0):
    torch.manual_seed(seed)
    return Network(Dense(6, 12, "tanh", dtype=torch.float64), Dense(12, 4, "sigmoid", dtype=torch.float64))


def _data(n=4, bs=6, seed=1, one_hot=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(bs, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 4, (bs,), generator=g)
        out.append((x, torch.nn.functional.one_hot(y, 4).double() if one_hot else y))
    return out


def _split(line):
    """``(fixed part, {extra key: value text})`` of an epoch line."""
    fields = line.split(" | ")
    return " | ".join(fields[:4]), dict(f.split(": ", 1) for f in fields[4:])


# ------------------------------------------------------------------ durations
@pytest.mark.parametrize(
    "seconds, text",
    [
        (0.0, "0 s"),
        (850e-9, "850 ns"),
        (1.5e-9, "1.50 ns"),
        (12.34e-6, "12.3 µs"),
        (999.4e-6, "999 µs"),
        (999.6e-6, "1.00 ms"),  # rounds up into the next unit
        (1.234e-3, "1.23 ms"),
        (0.0123, "12.3 ms"),
        (0.85, "850 ms"),
        (0.9996, "1.0 s"),
        (1.2, "1.2 s"),
        (1.25, "1.2 s"),  # 1.25 is 1.24999... in binary
        (59.94, "59.9 s"),
        (59.96, "1 min 00 s"),
        (184.4, "3 min 04 s"),
        (3599.6, "1 h 00 min"),
        (2 * 3600 + 5 * 60 + 10, "2 h 05 min"),
        (27 * 3600 + 100, "1 d 03 h"),
        (-1.2, "-1.2 s"),
        (math.nan, "nan"),
        (math.inf, "inf"),
    ],
)
def test_human_duration(seconds, text):
    assert human_duration(seconds) == text


@pytest.mark.parametrize(
    "seconds, go",
    [  # Go's time.Duration.String() of these durations
        (0.0, "0s"),
        (850e-9, "850ns"),
        (1.5e-6, "1.5µs"),
        (0.012345678, "12.345678ms"),
        (2.5, "2.5s"),
        (90.0, "1m30s"),
        (7200.0, "2h0m0s"),
        (3723.5, "1h2m3.5s"),
        (-1.5, "-1.5s"),
    ],
)
def test_format_duration_is_gos(seconds, go):
    assert format_duration(seconds) == go


def _parse_go_duration(text):
    """Seconds of a Go duration string (``1h2m3.5s``, ``163.719µs``): an independent reader."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|µs|us|ns)", text)
    assert "".join(a + b for a, b in parts) == text, text
    return sum(float(a) * units[b] for a, b in parts)


@pytest.mark.loom
@pytest.mark.skipif(welvet is None, reason="needs Loom's Python binding welvet (pip install welvet==0.80.0)")
@pytest.mark.parametrize("sizes, n_batches", [([3, 2], 3), ([64, 256, 10], 24)])  # µs and ms epoch times
def test_loom_epoch_line_matches_real_loom(capfd, sizes, n_batches):
    import loom_oracle as lo

    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((b, a)).astype(np.float32) * 0.1 for a, b in zip(sizes[:-1], sizes[1:])]
    net = lo.LoomDense(sizes, ["tanh"] * (len(sizes) - 1), weights)
    try:
        x = rng.standard_normal((n_batches, 32, sizes[0])).astype(np.float32)
        y = rng.random((n_batches, 32, sizes[-1])).astype(np.float32)
        cfg = {"Epochs": 3, "LearningRate": 0.01, "LossType": "mse", "GradientClip": 0.0, "Verbose": True, "UseGPU": False}
        fp = ctypes.POINTER(ctypes.c_float)
        capfd.readouterr()
        lo._take_string(
            lo._lib().LoomTrain(net.handle, x.ctypes.data_as(fp), x.size, y.ctypes.data_as(fp), y.size, 32,
                                sizes[0], sizes[-1], json.dumps(cfg).encode())
        )
    finally:
        net.close()
    lines = [ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("Epoch ")]
    assert len(lines) == 3
    for line in lines:  # Loom's own line, re-rendered from its numbers, is the same text
        m = LOOM_LINE.fullmatch(line)
        assert m, line
        epoch, epochs, loss, took, sps, eta = m.groups()
        ours = format_epoch_line(int(epoch), int(epochs), float(loss), _parse_go_duration(took), float(sps),
                                 _parse_go_duration(eta))
        assert ours == line


# -------------------------------------------------------------- line extras
class _Trainer:
    def __init__(self, metric_names=(), epochs=10):
        self.epochs = epochs
        self.metric_set = type("MS", (), {"names": tuple(metric_names)})() if metric_names else None


LOGS = {
    "loss": 0.123456789,
    "mean_gap": 0.01234,
    "my_score": 0.5,  # a callable metric's name
    "val_loss": 0.2,
    "adaptive_rate": 2.5e-5,
    "val_my_score": 0.25,
    "skipped": 0.0,
    "counted": 5.0,
    "epoch_time": 0.0123,
    "samples_per_second": 81234.5,
    "eta": 1.234,
}


def test_verbose_two_line_is_looms_then_every_extra():
    out = io.StringIO()
    EpochLinePrinter(stream=out).on_epoch_end(_Trainer(["my_score"]), 2, dict(LOGS))
    assert out.getvalue() == (
        "Epoch 3/10 - Loss: 0.123457 | Time: 12.3ms | Samples/s: 81234.50 | ETA: 1s"
        " | my_score: 0.5000 | val_loss: 0.2000 | val_my_score: 0.2500 | mean_gap: 0.0123 | adaptive_rate: 2.500e-05\n"
    )


def test_verbose_one_line_has_human_durations_and_no_method_logs():
    out = io.StringIO()
    ProgressObserver(stream=out, bar=False).on_epoch_end(_Trainer(["my_score"]), 2, {**LOGS, "skipped": 2.0})
    assert out.getvalue() == (
        "Epoch 3/10 - Loss: 0.123457 | Time: 12.3 ms | Samples/s: 81234.50 | ETA: 1.2 s"
        " | my_score: 0.5000 | val_loss: 0.2000 | val_my_score: 0.2500 | skipped: 2\n"
    )


def test_extras_order_values_and_fixed_keys():
    # built-in metric names count as metrics even without a metric set (TargetProp's own accuracy)
    logs = {"loss": 1.0, "explosion": 0.0, "accuracy": 1.0, "val_accuracy": math.nan, "note": "text", "flag": True}
    assert format_epoch_extras(logs, metric_names=("accuracy",)) == " | accuracy: 1.0000 | val_accuracy: nan | explosion: 0.0000"
    assert format_epoch_extras(logs, metric_names=("accuracy",), method_logs=False) == " | accuracy: 1.0000 | val_accuracy: nan"
    assert format_epoch_extras({"loss": 1.0, "epoch_time": 1.0, "counted": 3.0, "skipped": 0.0}) == ""
    assert [format_log_value(v) for v in (0.0, 1e-3, 99999.0, 1e5, -2.5e-7, math.inf, -math.inf)] == [
        "0.0000", "0.0010", "99999.0000", "1.000e+05", "-2.500e-07", "inf", "-inf"
    ]


def test_diverged_epoch_prints_nan():
    out = io.StringIO()
    EpochLinePrinter(stream=out, durations="human").on_epoch_end(
        _Trainer(), 0, {**LOGS, "loss": math.nan, "skipped": 5.0, "counted": 0.0}
    )
    fixed, extras = _split(out.getvalue().rstrip("\n"))
    assert HUMAN_LINE.fullmatch(fixed) and "Loss: nan" in fixed
    assert extras["skipped"] == "5"


def test_verbose_levels_in_a_real_run_with_validation_and_method_logs(capsys):
    data, val = _data(one_hot=True), _data(n=2, seed=5, one_hot=True)
    cfg = dict(method=TweenConfig(base_rate=0.05), epochs=2, loss_type="mse", validation_data=val)
    results = {}
    for verbose in (1, 2):
        results[verbose] = train(_net(), data, TrainingConfig(verbose=verbose, **cfg))
        results[verbose, "out"] = capsys.readouterr().out
    assert results[1].loss_history == results[2].loss_history
    history = results[2].history
    for verbose, pattern in ((1, HUMAN_LINE), (2, LOOM_LINE)):
        lines = results[verbose, "out"].splitlines()
        assert "\r" not in results[verbose, "out"] and len(lines) == 2
        for epoch, line in enumerate(lines):
            fixed, extras = _split(line)
            assert pattern.fullmatch(fixed), line
            assert float(extras.pop("val_loss")) == pytest.approx(history["val_loss"][epoch], abs=5e-5)
            if verbose == 1:
                assert extras == {}  # the method's logs only at verbose 2
            else:
                method_keys = [k for k in history.keys() if k in ("mean_gap", "mean_link_budget", "adaptive_rate")]
                assert len(method_keys) == 3 and set(method_keys) <= set(extras)
                for key in method_keys:
                    assert float(extras[key]) == pytest.approx(history[key][epoch], abs=5e-5)


# ------------------------------------------------------------------ the bar
def _frames(text):
    return [f for chunk in text.split("\n") for f in chunk.split("\r") if f]


def test_bar_within_the_epoch_stays_on_one_narrow_line():
    term = FakeTerminal()
    obs = ProgressObserver(stream=term, width=40, interval=0.0, per_batch=True)
    assert ObserverList([obs]).wants("on_batch_end")
    result = train(_net(), _data(n=5), TrainingConfig(epochs=2, verbose=0, loss_type="cross_entropy", observers=[obs]))
    text = term.getvalue()
    bar_frames = [f for f in _frames(text) if f.startswith("Epoch ") and " - Loss: " not in f]
    assert bar_frames and all(len(f.rstrip()) <= 40 for f in bar_frames)  # trimmed to the width
    for epoch in (1, 2):  # every batch redraws (interval 0): 0/5 .. 5/5 with an in-epoch ETA
        counts = [int(m.group(1)) for f in bar_frames if (m := re.match(rf"Epoch {epoch}/2: +\d+%\|.*?\| (\d)/5 \[", f))]
        assert counts == [0, 1, 2, 3, 4, 5], bar_frames
        assert any(re.search(r"\[\d\d:\d\d<\d\d:\d\d", f) for f in bar_frames if f.startswith(f"Epoch {epoch}/2:"))
    lines = text.split("\n")  # no new line until the epoch ends: each epoch ends with its epoch line
    assert len(lines) == 3 and lines[-1] == ""
    for epoch, line in enumerate(lines[:2]):
        last = line.split("\r")[-1]
        assert HUMAN_LINE.fullmatch(last), line
        assert float(last.split("Loss: ")[1].split(" ")[0]) == pytest.approx(result.loss_history[epoch], abs=5e-7)


def test_bar_per_epoch_has_no_batch_hook():
    term = FakeTerminal()
    obs = ProgressObserver(stream=term, width=60, per_batch=False)
    assert "on_batch_end" not in vars(obs) and not ObserverList([obs]).wants("on_batch_end")
    train(_net(), _data(), TrainingConfig(epochs=3, verbose=0, loss_type="cross_entropy", observers=[obs]))
    text = term.getvalue()
    counts = [int(m.group(1)) for f in _frames(text) if (m := re.match(r"Training: +\d+%\|.*?\| (\d)/3 \[", f))]
    assert counts[0] == 0 and counts[-1] == 3 and counts == sorted(counts)
    epoch_lines = [f for f in _frames(text) if HUMAN_LINE.fullmatch(f)]
    assert [ln.split(" - ")[0] for ln in epoch_lines] == ["Epoch 1/3", "Epoch 2/3", "Epoch 3/3"]
    assert text.endswith("\r")  # the run's bar is cleared at the end


class _BarTrainer:
    epochs = 2
    epoch = 0
    steps_per_epoch = 4
    metric_set = None


def test_print_line_goes_above_a_live_bar():
    term = FakeTerminal()
    obs = ProgressObserver(stream=term, width=60, interval=0.0, per_batch=True)
    t = _BarTrainer()
    obs.on_epoch_begin(t, 0)
    obs.on_batch_end(t, 0, {"loss": 1.0, "batch_size": 4.0})
    print_line("⚠️ a message", term)  # what the trainer's NaN/Inf messages would use
    obs.on_batch_end(t, 1, {"loss": 3.0, "batch_size": 4.0})
    text = term.getvalue()
    lines = text.split("\n")
    assert lines[0].split("\r")[-1] == "⚠️ a message"  # a line of its own, the bar cleared first
    assert re.match(r"Epoch 1/2: +50%\|.*\| 2/4 \[.*loss=2\.0000\]$", lines[1].split("\r")[-1])  # redrawn below
    obs.on_train_end(t, None)
    plain = io.StringIO()
    print_line("no bar", plain)
    assert plain.getvalue() == "no bar\n"


def test_only_rank_zero_prints(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    for obs_type in (EpochLinePrinter, ProgressObserver):
        term = FakeTerminal()
        obs = obs_type(stream=term) if obs_type is EpochLinePrinter else ProgressObserver(stream=term, per_batch=True)
        t = _BarTrainer()
        obs.on_epoch_begin(t, 0)
        if hasattr(obs, "_advance_batch"):
            obs.on_batch_end(t, 0, {"loss": 1.0, "batch_size": 4.0})
        obs.on_epoch_end(t, 0, dict(LOGS))
        obs.on_train_end(t, None)
        assert term.getvalue() == "", obs_type
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    term = FakeTerminal()
    EpochLinePrinter(stream=term).on_epoch_end(_BarTrainer(), 0, dict(LOGS))
    assert term.getvalue().startswith("Epoch 1/2 - Loss: 0.123457 | Time: 12.3ms")


def test_bar_per_epoch_starts_at_a_resumed_epoch():
    term = FakeTerminal()
    obs = ProgressObserver(stream=term, width=80, per_batch=False)
    t = type("T", (), {"epochs": 5, "metric_set": None})()
    obs.on_train_begin(t)
    obs.on_epoch_begin(t, 2)  # resumed after 2 epochs
    obs.on_epoch_end(t, 2, dict(LOGS))
    obs.on_train_end(t, None)
    counts = [m.group(1) for f in _frames(term.getvalue()) if (m := re.match(r"Training: +\d+%\|.*?\| (\d/5) \[", f))]
    assert counts[0] == "2/5" and counts[-1] == "3/5"


def test_per_batch_auto_follows_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ProgressObserver(stream=FakeTerminal()).per_batch is False
    assert not ObserverList([ProgressObserver(stream=FakeTerminal())]).wants("on_batch_end")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ProgressObserver(stream=FakeTerminal()).per_batch is True
    assert ObserverList([ProgressObserver(stream=FakeTerminal())]).wants("on_batch_end")


def test_not_a_terminal_means_plain_lines():
    out = io.StringIO()
    obs = ProgressObserver(stream=out, per_batch=True)
    assert obs.bar is False and not ObserverList([obs]).wants("on_batch_end")
    train(_net(), _data(), TrainingConfig(epochs=2, verbose=0, loss_type="cross_entropy", observers=[obs]))
    lines = out.getvalue().split("\n")
    assert "\r" not in out.getvalue() and lines[-1] == "" and all(HUMAN_LINE.fullmatch(ln) for ln in lines[:-1])


def test_bad_arguments():
    with pytest.raises(ValueError, match="width"):
        ProgressObserver(width=0)
    with pytest.raises(ValueError, match="interval"):
        ProgressObserver(interval=math.inf)
    with pytest.raises(TypeError, match="per_batch"):
        ProgressObserver(per_batch=1)
    with pytest.raises(ValueError, match="durations"):
        EpochLinePrinter(durations="iso")
    with pytest.raises(TypeError, match="method_logs"):
        ProgressObserver(method_logs="yes")
    with pytest.raises(ValueError, match="durations"):
        format_epoch_line(1, 1, 0.0, 0.0, 0.0, 0.0, durations="iso")


def test_bar_true_without_tqdm_is_an_import_error(monkeypatch):
    import torchloom.observers.progress as progress

    monkeypatch.setattr(progress, "_have_tqdm", lambda: False)
    with pytest.raises(ImportError, match="tqdm"):
        ProgressObserver(bar=True)
    assert ProgressObserver(stream=FakeTerminal()).bar is False  # auto: epoch lines only


_IMPORT_PROBE = """
import sys
BLOCKED = ("tqdm", "tensorboard", "torch.utils.tensorboard")
attempts = []
class Block:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            attempts.append(name)
            raise ModuleNotFoundError(name)
        return None
import torch  # torch.hub imports tqdm when it is installed: forget it, then watch what torchloom asks for
for m in [m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED)]:
    del sys.modules[m]
sys.meta_path.insert(0, Block())
import torchloom
print(attempts)
"""


def test_import_torchloom_imports_neither_tqdm_nor_tensorboard():
    out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
