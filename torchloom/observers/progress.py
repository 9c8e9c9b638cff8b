"""Console output of training: the epoch lines, a progress bar on a terminal (drawn by ``tqdm``),
and the two duration formats the lines use.

Verbose levels (``TrainingConfig.verbose``, Keras' convention):

* ``0`` — silent.
* ``1`` (= ``True``) — ``ProgressObserver``: on a terminal a progress bar, then torchloom's epoch
  line at the end of every epoch; when the stream is not a terminal (a log file, a notebook
  capture, CI) only the epoch lines, as plain lines (no ``\\r`` redraws).
* ``2`` — ``EpochLinePrinter``: Loom's exact epoch line at the end of every epoch.

Epoch lines
-----------
Loom's line (verbose 2; durations in Go's ``time.Duration`` format, ``format_duration``; ETA rounded
to whole seconds as Loom does)::

    Epoch 3/10 - Loss: 0.123456 | Time: 12.3ms | Samples/s: 81234.50 | ETA: 1s

torchloom's line (verbose 1): the same fields, durations human-readable (``human_duration``)::

    Epoch 3/10 - Loss: 0.123456 | Time: 12.3 ms | Samples/s: 81234.50 | ETA: 1.2 s

Either line then gets `` | key: value`` for each of these present in the epoch's logs, in this
order (``format_epoch_extras``):

1. the training metrics (``TrainingConfig(metrics=...)``, in their order; also a method's own
   ``accuracy``): ``accuracy: 0.9500``;
2. the validation values, in log order: ``val_loss: 0.1234 | val_accuracy: 0.9300``;
3. at verbose 2 only, the method's per-epoch logs (the means of its per-step logs, e.g. Tweening's
   ``mean_gap``, ``mean_link_budget``, ``explosion``, ``adaptive_rate``; TargetProp's
   ``mean_link_budget``, ``mean_gap``), in log order;
4. ``skipped: 2`` when batches of the epoch did not count (NaN/Inf loss or gradients, an undone
   update, batches an abandoned epoch did not reach), then ``DIVERGED`` when the engine found the
   epoch diverged (``logs["diverged"]``: engine/divergence.py).

Values print with 4 decimals (``0.9500``) when ``1e-3 <= |v| < 1e5`` or ``v == 0``, else with 4
significant digits in scientific notation (``2.500e-05``); NaN and ±Inf as ``nan``, ``inf``,
``-inf``. The keys that make the fixed fields (``loss``, ``epoch_time``, ``samples_per_second``,
``eta``), the batch counts (``counted``, ``skipped``), ``diverged`` and the learning rates (``lr``,
``lr_group1``, ...) never appear as values. An epoch in which no batch counted prints ``Loss: nan``.
``Samples/s`` is the epoch's own (its samples over its time), not a running average.

Durations
---------
``format_duration`` is Go's ``Duration.String()`` (``850ns``, ``1.5µs``, ``12.345678ms``, ``2.5s``,
``1m30s``, ``2h0m0s``), used only in Loom's exact line. ``human_duration`` is torchloom's:
``850 ns``, ``12.3 µs``, ``850 ms``, ``1.23 ms``, ``1.2 s``, ``3 min 04 s``, ``2 h 05 min``,
``1 d 03 h`` (3 significant digits below a second, one decimal below a minute, then two units).

Progress bar (verbose 1 on a terminal or in a Jupyter notebook)
---------------------------------------------------------------
Drawn by ``tqdm`` (imported only when a bar is shown; in a notebook ``tqdm.auto``'s widget, when
ipywidgets is installed), in one of two modes:

* **within the epoch** (``per_batch=True``)::

      Epoch 3/10:  40%|████      | 2/5 [00:01<00:01, loss=0.1234]

  batches counted so far, elapsed < remaining time of this epoch (the in-epoch ETA), and the mean
  loss of the batches counted so far (for a loader of unknown length: the count, elapsed time and
  batches/s). It needs every batch's loss, so only in this mode does the observer have an
  ``on_batch_end`` hook; the bar is cleared at the epoch's end and the epoch line takes its place.
* **per epoch** (``per_batch=False``)::

      Training:  30%|███       | 3/10 [00:05<00:11]

  epochs done, elapsed < remaining time of the run, advanced at each epoch's end, with the epoch
  lines printed above it. The observer then has no per-batch hook, so a trainer on its CUDA
  device path (one host sync per epoch) stays on it: a per-batch listener would force a host read
  every batch.

Other output while a bar is drawn (e.g. the trainer's NaN/Inf messages) belongs above it:
``print_line`` prints there.

``per_batch=None`` (the default) picks "within the epoch" unless CUDA is available (only then can
the device path run); a trainer that knows whether its device path runs passes ``per_batch``. The
line's width follows the terminal's (read again at every redraw) or ``width``: tqdm shrinks the bar,
then trims the line, so it stays on one line in a narrow terminal.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import sys
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

from .base import Observer, is_main_process

__all__ = [
    "EpochLinePrinter",
    "ProgressObserver",
    "format_duration",
    "human_duration",
    "format_epoch_line",
    "format_epoch_extras",
    "format_log_value",
    "print_line",
]

# keys of the epoch logs that make the fixed fields of the line, or batch counts: never extras
_FIXED_KEYS = frozenset({"loss", "epoch_time", "samples_per_second", "eta", "skipped", "counted", "diverged"})
_DURATION_STYLES = ("go", "human")


def _is_rate_key(key: str) -> bool:
    """``lr`` / ``lr_group<i>``: the learning rates the logs carry (History, CSV, TensorBoard), not
    shown on the epoch line (Loom's line has no rate)."""
    return key == "lr" or (key.startswith("lr_group") and key[8:].isdigit())


def _trim(v: float, decimals: int) -> str:
    s = f"{v:.{decimals}f}"
    return s.rstrip("0").rstrip(".") if "." in s else s


def format_duration(seconds: float) -> str:
    """Go's ``time.Duration.String()``: ``850ns``, ``1.5µs``, ``12.345678ms``, ``2.5s``, ``1m30s``, ``2h0m0s``."""
    if seconds != seconds or seconds in (math.inf, -math.inf):
        return str(seconds)
    ns = int(round(seconds * 1e9))
    sign = "-" if ns < 0 else ""
    ns = abs(ns)
    if ns == 0:
        return "0s"
    if ns < 1_000:
        return f"{sign}{ns}ns"
    if ns < 1_000_000:
        return f"{sign}{_trim(ns / 1e3, 3)}µs"
    if ns < 1_000_000_000:
        return f"{sign}{_trim(ns / 1e6, 6)}ms"
    h, rem = divmod(ns, 3_600_000_000_000)
    m, rem = divmod(rem, 60_000_000_000)
    s = _trim(rem / 1e9, 9)
    if h:
        return f"{sign}{h}h{m}m{s}s"
    if m:
        return f"{sign}{m}m{s}s"
    return f"{sign}{s}s"


def _three_digits(v: float) -> str:
    """``v`` in [0, 999.5) with 3 significant digits: ``1.23``, ``12.3``, ``123``."""
    if v < 9.995:
        return f"{v:.2f}"
    if v < 99.95:
        return f"{v:.1f}"
    return f"{v:.0f}"


def human_duration(seconds: float) -> str:
    """A duration for people: ``850 ns``, ``12.3 µs``, ``850 ms``, ``1.2 s``, ``3 min 04 s``,
    ``2 h 05 min``, ``1 d 03 h``; ``0 s`` for zero, a leading ``-`` for a negative duration and
    ``nan`` / ``inf`` for those values.

    Below a second: 3 significant digits in the largest unit that keeps the value >= 1 (ns, µs,
    ms). From 1 s to a minute: one decimal. Above: the two largest units, the second one zero-padded
    (``min`` and ``s``, ``h`` and ``min``, ``d`` and ``h``), rounded to the nearest unit; a value
    that rounds up to the next unit moves to it (59.96 s is ``1 min 00 s``)."""
    seconds = float(seconds)
    if math.isnan(seconds) or math.isinf(seconds):
        return str(seconds)
    if seconds < 0:
        return "-" + human_duration(-seconds)
    if seconds == 0:
        return "0 s"
    for unit, scale in (("ns", 1e-9), ("µs", 1e-6), ("ms", 1e-3)):
        value = seconds / scale
        if value < 999.5:
            return f"{_three_digits(value)} {unit}"
    if seconds < 59.95:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 3600:
        m, s = divmod(whole, 60)
        return f"{m} min {s:02d} s"
    minutes = round(seconds / 60)
    if minutes < 24 * 60:
        h, m = divmod(minutes, 60)
        return f"{h} h {m:02d} min"
    d, h = divmod(round(seconds / 3600), 24)
    return f"{d} d {h:02d} h"


def format_log_value(value: float) -> str:
    """One extra value of the epoch line: 4 decimals when ``1e-3 <= |v| < 1e5`` or ``v == 0``
    (``0.9500``), else 4 significant digits in scientific notation (``2.500e-05``); ``nan``,
    ``inf``, ``-inf`` as such."""
    v = float(value)
    if math.isnan(v) or math.isinf(v):
        return str(v)
    if v == 0 or 1e-3 <= abs(v) < 1e5:
        return f"{v:.4f}"
    return f"{v:.3e}"


def format_epoch_line(
    epoch: int, epochs: int, loss: float, epoch_time: float, samples_per_second: float, eta: float,
    *, durations: str = "go",
) -> str:
    """The fixed part of an epoch line (1-based ``epoch``).

    ``durations="go"``: Loom's exact line, ``Epoch 3/10 - Loss: 0.123456 | Time: 12.3ms |
    Samples/s: 81234.50 | ETA: 1s`` (Go's duration format; ETA rounded to whole seconds as Loom
    does). ``durations="human"``: torchloom's, ``Epoch 3/10 - Loss: 0.123456 | Time: 12.3 ms |
    Samples/s: 81234.50 | ETA: 1.2 s`` (``human_duration``)."""
    if durations == "go":
        time_s, eta_s = format_duration(epoch_time), format_duration(round(eta))
    elif durations == "human":
        time_s, eta_s = human_duration(epoch_time), human_duration(eta)
    else:
        raise ValueError(f"format_epoch_line: durations must be one of {_DURATION_STYLES}, got {durations!r}")
    return (
        f"Epoch {epoch}/{epochs} - Loss: {loss:.6f} | Time: {time_s} | "
        f"Samples/s: {samples_per_second:.2f} | ETA: {eta_s}"
    )


def _metric_names_of(trainer: Any) -> tuple[str, ...]:
    """The names ``trainer``'s epoch logs hold as metrics: ``trainer.metric_names`` (the engine's: its
    training metrics, then the built-in names), else its ``metric_set``'s names."""
    names = getattr(trainer, "metric_names", None)
    if names is not None:
        return tuple(names)
    metric_set = getattr(trainer, "metric_set", None)
    return tuple(getattr(metric_set, "names", ())) if metric_set is not None else ()


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def format_epoch_extras(
    logs: Mapping[str, Any], *, metric_names: Iterable[str] = (), method_logs: bool = True
) -> str:
    """`` | key: value`` for the extras of an epoch's ``logs`` (``""`` when there are none): the
    training metrics (``metric_names`` order), the ``val_*`` values, the method's logs when
    ``method_logs`` (every other numeric key but the fixed fields and batch counts), then
    ``skipped: N`` when ``logs["skipped"] > 0``. Values by ``format_log_value``."""
    metric_names = tuple(metric_names)
    metrics = [k for k in metric_names if k in logs and _is_number(logs[k])]
    others = [
        k for k in logs
        if isinstance(k, str) and k not in _FIXED_KEYS and not _is_rate_key(k) and k not in metric_names and _is_number(logs[k])
    ]
    validation = [k for k in others if k.startswith("val_")]
    method = [k for k in others if not k.startswith("val_")] if method_logs else []
    parts = [f"{k}: {format_log_value(logs[k])}" for k in (*metrics, *validation, *method)]
    skipped = logs.get("skipped", 0.0)
    if _is_number(skipped) and skipped > 0:
        parts.append(f"skipped: {int(skipped)}")
    if logs.get("diverged"):
        parts.append("DIVERGED")
    return "".join(f" | {p}" for p in parts)


def print_line(text: str, stream: TextIO | None = None) -> None:
    """Print ``text`` as a line of its own on ``stream`` (default ``sys.stdout``), flushed. While a
    tqdm bar is drawn on the console the line goes above it (``tqdm.write``: the bar is cleared, the
    line printed, the bar redrawn) instead of being glued to the bar's text. Never imports tqdm."""
    out = stream or sys.stdout
    tqdm_module = sys.modules.get("tqdm")
    if tqdm_module is not None and getattr(getattr(tqdm_module, "tqdm", None), "_instances", None):
        tqdm_module.tqdm.write(text, file=out)
        out.flush()
    else:
        print(text, file=out, flush=True)


def _check_line_options(owner: str, durations: Any, method_logs: Any) -> None:
    if durations not in _DURATION_STYLES:
        raise ValueError(
            f"{owner}: durations must be 'go' (Loom's exact line) or 'human' (torchloom's), got {durations!r}"
        )
    if not isinstance(method_logs, bool):
        raise TypeError(f"{owner}: method_logs must be a bool, got {method_logs!r}")


class EpochLinePrinter(Observer):
    """Prints an epoch line at the end of every epoch (verbose level 2): by default Loom's exact
    line, then the metrics, validation values, the method's per-epoch logs and the skipped count
    (see the module's description). When ``torch.distributed`` is initialised only rank 0 prints.

    Args:
        stream: where to print (default: ``sys.stdout`` at the time of printing).
        durations: ``"go"`` (Loom's exact line) or ``"human"`` (``human_duration``).
        method_logs: append the method's per-epoch logs (``mean_gap``, ``adaptive_rate``, ...).
    """

    def __init__(self, stream: TextIO | None = None, *, durations: str = "go", method_logs: bool = True) -> None:
        _check_line_options(type(self).__name__, durations, method_logs)
        self.stream = stream
        self.durations = durations
        self.method_logs = method_logs

    def format_line(self, trainer: Any, epoch: int, logs: Mapping[str, Any]) -> str:
        """The line for 0-based ``epoch`` of ``trainer.epochs``."""
        line = format_epoch_line(
            epoch + 1,
            trainer.epochs,
            logs["loss"],
            logs["epoch_time"],
            logs["samples_per_second"],
            logs["eta"],
            durations=self.durations,
        )
        return line + format_epoch_extras(logs, metric_names=_metric_names_of(trainer), method_logs=self.method_logs)

    def write_line(self, line: str) -> None:
        print_line(line, self.stream)

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        if is_main_process():
            self.write_line(self.format_line(trainer, epoch, logs))


_EPOCH_BAR = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (ValueError, OSError):  # a closed or detached stream
        return False


def _in_notebook(stream: TextIO | None) -> bool:
    """Whether ``stream`` (``None``: ``sys.stdout``) is the output of a Jupyter kernel that can show
    a widget bar (IPython's kernel running, ipywidgets installed): then ``tqdm.auto`` draws one.
    Imports nothing: a kernel has imported IPython already."""
    if stream is not None and stream is not sys.stdout:
        return False
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    try:
        shell = get() if callable(get) else None
        in_kernel = shell is not None and "IPKernelApp" in getattr(shell, "config", {})
    except Exception:  # noqa: BLE001 - an unusual shell: no widget
        return False
    return in_kernel and importlib.util.find_spec("ipywidgets") is not None


def _have_tqdm() -> bool:
    return importlib.util.find_spec("tqdm") is not None


def _cuda_available() -> bool:
    import torch

    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver install: no device path either
        return False


class ProgressObserver(EpochLinePrinter):
    """Verbose level 1: a tqdm progress bar on a terminal (within the epoch or per epoch), and
    torchloom's epoch line at the end of every epoch; just the epoch lines, as plain lines, when the
    stream is not a terminal. See the module's description for the formats and the two bar modes.
    When ``torch.distributed`` is initialised only rank 0 draws and prints.

    Args:
        stream: where to print (default: ``sys.stdout`` at the time of printing).
        bar: draw the bar; ``None`` (default) = when ``stream`` is a terminal, or the output of a
            Jupyter notebook (a widget bar through ``tqdm.auto``, with ipywidgets installed), and tqdm
            is installed. ``True`` without tqdm is an ``ImportError``.
        width: the width of the bar's line in characters; ``None`` (default) = the terminal's.
        interval: the least seconds between redraws of the bar within an epoch (tqdm's
            ``mininterval``); 0.1 s keeps a fast loop from spending its time printing.
        per_batch: ``True`` = the bar advances every batch (this observer then has an
            ``on_batch_end`` hook, which keeps a trainer off its CUDA device path); ``False`` = the
            bar advances every epoch (no per-batch hook); ``None`` = ``True`` unless CUDA is
            available.
        durations: ``"human"`` (default) or ``"go"`` for the epoch line's durations.
        method_logs: append the method's per-epoch logs to the epoch line (default ``False``;
            verbose 2 shows them).

    Only when the bar is drawn and ``per_batch`` holds does the observer have an ``on_batch_end``
    hook (an instance attribute); otherwise the trainer sees no per-batch listener and does no
    per-batch work for it (no host sync on GPU).
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        bar: bool | None = None,
        width: int | None = None,
        interval: float = 0.1,
        per_batch: bool | None = None,
        *,
        durations: str = "human",
        method_logs: bool = False,
    ) -> None:
        super().__init__(stream, durations=durations, method_logs=method_logs)
        if bar is not None and not isinstance(bar, bool):
            raise TypeError(f"ProgressObserver: bar must be a bool or None (auto), got {bar!r}")
        if per_batch is not None and not isinstance(per_batch, bool):
            raise TypeError(f"ProgressObserver: per_batch must be a bool or None (auto), got {per_batch!r}")
        if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
            raise ValueError(f"ProgressObserver: width must be an int >= 1 (characters) or None (the terminal's), got {width!r}")
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 <= interval < math.inf:
            raise ValueError(f"ProgressObserver: interval must be a finite number of seconds >= 0, got {interval!r}")
        if bar is True and not _have_tqdm():
            raise ImportError(
                "ProgressObserver(bar=True) needs tqdm, a dependency of torchloom: install it with `pip install 'tqdm>=4.60'`"
            )
        self.notebook = _in_notebook(stream)  # a Jupyter kernel: tqdm.auto's widget bar
        self.bar = ((self.notebook or _is_terminal(stream or sys.stdout)) and _have_tqdm()) if bar is None else bar
        self.width = width
        self.interval = float(interval)
        self.per_batch = (not _cuda_available()) if per_batch is None else per_batch
        if self.bar and self.per_batch:  # an instance attribute: otherwise no per-batch hook at all
            self.on_batch_end = self._advance_batch
        self._bar: Any = None
        self._loss_sum = 0.0
        self._batches = 0

    # ------------------------------------------------------------------ the bar
    def _new_bar(self, **kwargs: Any) -> Any:
        if self.notebook:  # a widget in the notebook's output cell (tqdm.auto picks tqdm.notebook there)
            from tqdm.auto import tqdm as auto_tqdm

            return auto_tqdm(leave=False, **kwargs)
        from tqdm import tqdm

        return tqdm(
            file=self.stream or sys.stdout,
            ncols=self.width,
            dynamic_ncols=self.width is None,
            leave=False,
            **kwargs,
        )

    def _close_bar(self) -> None:
        if self._bar is not None:
            bar, self._bar = self._bar, None
            bar.close()

    def on_train_begin(self, trainer: Any) -> None:
        self._close_bar()  # a bar left open by a run that raised

    def on_epoch_begin(self, trainer: Any, epoch: int) -> None:
        self._loss_sum = 0.0
        self._batches = 0
        if not self.bar or not is_main_process():
            return
        if self.per_batch:
            self._close_bar()
            total = getattr(trainer, "steps_per_epoch", None)
            self._bar = self._new_bar(
                total=total,
                desc=f"Epoch {epoch + 1}/{trainer.epochs}",
                unit="batch",
                mininterval=self.interval,
                # no rate (the epoch line has samples/s): the ETA and the loss come before tqdm trims
                bar_format=_EPOCH_BAR if total else None,
            )
        elif self._bar is None:
            self._bar = self._new_bar(
                total=trainer.epochs, initial=epoch, desc="Training", unit="epoch", mininterval=0.0, bar_format=_EPOCH_BAR
            )

    def _advance_batch(self, trainer: Any, step: int, logs: dict[str, float]) -> None:
        bar = self._bar
        if bar is None:  # hooks called outside a trainer's fit(): start as fit() would
            self.on_epoch_begin(trainer, getattr(trainer, "epoch", 0))
            bar = self._bar
            if bar is None:  # not the main process
                return
        self._loss_sum += logs["loss"]
        self._batches += 1
        bar.set_postfix_str(f"loss={self._loss_sum / self._batches:.4f}", refresh=False)
        bar.update(1)

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        if not is_main_process():
            return
        line = self.format_line(trainer, epoch, logs)
        if self._bar is None:
            self.write_line(line)
        elif self.per_batch:  # the epoch line takes the bar's place
            self._close_bar()
            self.write_line(line)
        else:  # the line above the run's bar, which then advances
            self.write_line(line)
            self._bar.update(1)

    def on_train_end(self, trainer: Any, result: Any) -> None:
        self._close_bar()
