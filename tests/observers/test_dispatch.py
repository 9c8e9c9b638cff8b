"""Observer dispatch (SPEC §10): observers cost nothing when absent, any object with a matching
method is an observer, logs are plain floats, and the verbose levels print what they should."""

import io
import re

import pytest
import torch

from torchloom.layers.dense import Dense
from torchloom.layers.network import Network
from torchloom.observers import layer_stats as layer_stats_module
from torchloom.observers.base import ObserverList
from torchloom.observers.console import ConsoleObserver
from torchloom.observers.csv_logger import CSVLogger
from torchloom.observers.history import History
from torchloom.observers.progress import EpochLinePrinter, ProgressObserver
from torchloom.engine.train import TrainingConfig, train

EPOCH_LINE = re.compile(
    r"^Epoch (\d+)/(\d+) - Loss: (\d+\.\d{6}) \| Time: \S+ \| Samples/s: \d+\.\d{2} \| ETA: \S+$"
)
# verbose 1: torchloom's line, the same fields with human-readable durations ("12.3 ms", "1.2 s")
HUMAN_LINE = re.compile(
    r"^Epoch (\d+)/(\d+) - Loss: (\d+\.\d{6}) \| Time: [0-9.]+ (ns|µs|ms|s) \| Samples/s: \d+\.\d{2} \| ETA: [0-9.]+ (ns|µs|ms|s)$"
)


def _net():
    return Network(Dense(3, 5, "tanh"), Dense(5, 2))


def _batches(n=3, bs=4):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(bs, 3, generator=g), torch.randn(bs, 2, generator=g)) for _ in range(n)]


@pytest.fixture
def counters(monkeypatch):
    """Counts calls of the per-layer statistics and of the recording forward/backward."""
    counts = {"stats": 0, "forward_record": 0, "backward": 0}
    real_stats = layer_stats_module.layer_stats
    real_record = Network.forward_record
    real_backward = Network.backward

    def stats(t):
        counts["stats"] += 1
        return real_stats(t)

    def record(self, *a, **k):
        counts["forward_record"] += 1
        return real_record(self, *a, **k)

    def backward(self, *a, **k):
        counts["backward"] += 1
        return real_backward(self, *a, **k)

    monkeypatch.setattr(layer_stats_module, "layer_stats", stats)
    monkeypatch.setattr(Network, "forward_record", record)
    monkeypatch.setattr(Network, "backward", backward)
    return counts


def test_no_layer_work_without_layer_observers(counters, tmp_path):
    # epoch-level observers of every kind, verbose on: still the lean path
    observers = [History(), CSVLogger(tmp_path / "log.csv"), EpochLinePrinter(stream=io.StringIO())]
    train(_net(), _batches(), TrainingConfig(epochs=2, verbose=1, observers=observers))
    assert counters == {"stats": 0, "forward_record": 0, "backward": 0}


def test_layer_observer_does_the_work(counters):
    # the same counters do see the work once someone listens (so the test above can fail)
    train(_net(), _batches(), TrainingConfig(epochs=2, verbose=0, observers=[ConsoleObserver(stream=io.StringIO())]))
    steps = 2 * 3
    assert counters == {"stats": steps * 2 * 2, "forward_record": steps, "backward": steps}


def test_no_per_batch_dispatch_unless_wanted(monkeypatch):
    # without a terminal the progress printer has no on_batch_end, so the loop skips batch logs
    calls = []
    real = ObserverList.__call__

    def spy(self, hook, *args):
        calls.append(hook)
        return real(self, hook, *args)

    monkeypatch.setattr(ObserverList, "__call__", spy)
    train(_net(), _batches(), TrainingConfig(epochs=2, verbose=1))
    assert "on_batch_end" not in calls
    assert calls.count("on_epoch_end") == 2
    assert not ObserverList([ProgressObserver(stream=io.StringIO())]).wants("on_batch_end")
    assert ObserverList([ProgressObserver(stream=io.StringIO(), bar=True, per_batch=True)]).wants("on_batch_end")
    # a bar that advances per epoch (a trainer on its device path) has no per-batch hook either
    assert not ObserverList([ProgressObserver(stream=io.StringIO(), bar=True, per_batch=False)]).wants("on_batch_end")


def test_user_class_with_only_on_epoch_end():
    class MyObserver:  # no base class, one hook
        def __init__(self):
            self.seen = []

        def on_epoch_end(self, trainer, epoch, logs):
            self.seen.append((epoch, dict(logs)))

    obs = MyObserver()
    result = train(_net(), _batches(), TrainingConfig(epochs=3, verbose=0, observers=[obs]))
    assert [e for e, _ in obs.seen] == [0, 1, 2]
    assert [logs["loss"] for _, logs in obs.seen] == result.loss_history
    for _, logs in obs.seen:
        assert all(type(v) is float for v in logs.values()), logs  # plain floats, no tensors
        assert {"loss", "epoch_time", "samples_per_second", "eta"} <= logs.keys()


def test_batch_logs_are_plain_floats_and_steps_count():
    seen = []

    class Batches:
        def on_batch_end(self, trainer, step, logs):
            seen.append((step, logs))

    train(_net(), _batches(n=3, bs=4), TrainingConfig(epochs=2, verbose=0, observers=[Batches()]))
    assert [s for s, _ in seen] == list(range(6))
    for _, logs in seen:
        assert type(logs["loss"]) is float and logs["batch_size"] == 4.0


def test_object_without_hooks_is_rejected():
    with pytest.raises(TypeError, match="has none of the hooks"):
        train(_net(), _batches(), TrainingConfig(epochs=1, verbose=0, observers=[object()]))


def test_stop_training_from_an_observer():
    class StopAfterTwo:
        def on_epoch_end(self, trainer, epoch, logs):
            if epoch == 1:
                trainer.stop_training = True

    result = train(_net(), _batches(), TrainingConfig(epochs=10, verbose=0, observers=[StopAfterTwo()]))
    assert len(result.loss_history) == 2 and result.history.epochs == [0, 1]


# ------------------------------------------------------------------ verbose levels
@pytest.mark.parametrize("verbose", [True, 1, 2])
def test_verbose_prints_epoch_lines_only_when_not_a_terminal(verbose, capsys):
    result = train(_net(), _batches(), TrainingConfig(epochs=3, verbose=verbose))
    out = capsys.readouterr().out
    assert "\r" not in out  # no bar redraws into a captured stream
    lines = out.splitlines()
    assert len(lines) == 3
    for i, line in enumerate(lines):
        m = (EPOCH_LINE if verbose == 2 else HUMAN_LINE).match(line)  # Loom's exact line at verbose 2
        assert m, f"not an epoch line: {line!r}"
        assert (int(m.group(1)), int(m.group(2))) == (i + 1, 3)
        assert float(m.group(3)) == pytest.approx(result.loss_history[i], abs=5e-7)


@pytest.mark.parametrize("verbose", [0, False])
def test_verbose_zero_is_silent(verbose, capsys):
    train(_net(), _batches(), TrainingConfig(epochs=2, verbose=verbose))
    assert capsys.readouterr().out == ""


def test_verbose_rejects_other_values():
    for bad in (3, -1, "yes", None):
        with pytest.raises(ValueError, match="verbose must be"):
            TrainingConfig(verbose=bad)


def test_verbose_one_on_a_terminal_draws_the_bar(monkeypatch, capsys):
    # pretend stdout is a terminal (and no CUDA: the bar advances within the epoch): level 1 then
    # draws a tqdm bar in place and ends each epoch with the epoch line
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    train(_net(), _batches(n=3), TrainingConfig(epochs=2, verbose=1))
    out = capsys.readouterr().out
    bars = re.findall(r"\rEpoch (\d)/2: +\d+%\|[^|]*\| (\d)/3 \[", out)
    assert ("1", "0") in bars and ("2", "0") in bars  # each epoch's bar is drawn when it starts
    lines = [ln.split("\r")[-1] for ln in out.split("\n") if ln.split("\r")[-1]]
    assert len(lines) == 2 and all(HUMAN_LINE.match(ln) for ln in lines), lines


def test_progress_bar_contents():
    buf = io.StringIO()
    obs = ProgressObserver(stream=buf, bar=True, width=100, interval=0.0, per_batch=True)
    result = train(_net(), _batches(n=4, bs=3), TrainingConfig(epochs=1, verbose=0, observers=[obs]))
    frames = buf.getvalue().split("\r")
    bars = [f.strip() for f in frames if f.strip().startswith("Epoch 1/1:")]
    assert [re.search(r"\| (\d/\d) \[", b).group(1) for b in bars] == ["0/4", "1/4", "2/4", "3/4", "4/4"]
    # the bar's running loss after the last batch is the epoch's mean loss
    loss = float(re.search(r"loss=(\d+\.\d+)", bars[-1]).group(1))
    assert loss == pytest.approx(result.final_loss, abs=5e-5)
    assert frames[-1].startswith("Epoch 1/1 - Loss: ")  # the epoch line replaces the bar


def test_progress_observer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="width"):
        ProgressObserver(width=0)
    with pytest.raises(ValueError, match="interval"):
        ProgressObserver(interval=-1)
    with pytest.raises(TypeError, match="bar"):
        ProgressObserver(bar="yes")
