"""``LossPlot``: a PNG of the loss (and the accuracy, when the trainer logs one) per epoch.

matplotlib is an optional extra (``pip install torchloom[plot]``); it is imported when a
``LossPlot`` is created, never when torchloom is imported. The figure is drawn on matplotlib's Agg
canvas directly (no ``pyplot``), so it works without a display and leaves pyplot's state alone.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any

from ._files import atomic_write, check_output_path
from .base import Observer

__all__ = ["LossPlot"]

_MISSING = (
    "LossPlot needs matplotlib, which is an optional extra of torchloom: install it with "
    "`pip install torchloom[plot]` (or `pip install matplotlib`)"
)


_MAX_PIXELS = 2**16  # Agg refuses images this wide or tall


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError(_MISSING) from e


def _is_loss(key: str) -> bool:
    return key == "loss" or key.endswith("_loss")


def _is_accuracy(key: str) -> bool:
    return key in ("accuracy", "acc") or key.endswith(("_accuracy", "_acc"))


class LossPlot(Observer):
    """Saves a line plot of every loss key (``loss``, ``*_loss``) per epoch on the left axis, and
    every accuracy key (``accuracy``, ``acc``, ``*_accuracy``) on a right axis when present.

    Args:
        path: the PNG file, written at the end of training (and after every epoch when
            ``every_epoch``).
        every_epoch: redraw after each epoch, to watch a long run (costs ~50 ms an epoch).
        log_scale: logarithmic loss axis, useful when the loss falls by orders of magnitude.
        title: the figure title.
        figsize: inches; with ``dpi`` sets the pixel size (default 8×5 in at 100 dpi = 800×500 px).
        dpi: dots per inch.

    Raises ``ImportError`` naming the ``plot`` extra when matplotlib is not installed, and
    ``ValueError``/``TypeError`` naming the argument for a path that cannot be written (a directory,
    a directory missing more than its last level, a read-only location) or a bad setting. Epochs whose loss is NaN
    (no batch counted) leave a gap in the curve.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        every_epoch: bool = False,
        log_scale: bool = False,
        title: str = "Training",
        figsize: tuple[float, float] = (8.0, 5.0),
        dpi: int = 100,
    ) -> None:
        self.path = path
        self.every_epoch = every_epoch
        self.log_scale = log_scale
        self.title = title
        self.figsize = figsize
        self.dpi = dpi
        self.check_ready()
        self.epochs: list[int] = []
        self.history: dict[str, list[float]] = {}

    def check_ready(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the argument when the path cannot be written or a
        setting is invalid (they may be changed after construction; trainers call this before a run
        changes anything), ``ImportError`` when matplotlib is missing."""
        self.path = check_output_path("LossPlot", self.path)
        for name in ("every_epoch", "log_scale"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LossPlot: {name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.title, str):
            raise TypeError(f"LossPlot: title must be a str, got {type(self.title).__name__}")
        figsize, dpi = self.figsize, self.dpi
        if (
            not isinstance(figsize, (tuple, list))
            or len(figsize) != 2
            or not all(
                isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in figsize
            )
        ):
            raise ValueError(f"LossPlot: figsize must be (width, height) in inches, both finite and > 0, got {figsize!r}")
        if isinstance(dpi, bool) or not isinstance(dpi, numbers.Integral) or dpi < 1:
            raise ValueError(f"LossPlot: dpi must be an int >= 1, got {dpi!r}")
        w, h = figsize[0] * dpi, figsize[1] * dpi
        if max(w, h) >= _MAX_PIXELS or min(w, h) < 1:
            raise ValueError(
                f"LossPlot: figsize {tuple(figsize)!r} at dpi {dpi} gives {w:.0f}x{h:.0f} pixels; each side must be "
                f"at least 1 and below {_MAX_PIXELS} (matplotlib's limit)"
            )
        self.figsize = (float(figsize[0]), float(figsize[1]))
        self.dpi = int(dpi)
        _require_matplotlib()

    def on_train_begin(self, trainer: Any) -> None:
        self.check_ready()
        self.epochs = []
        self.history = {}
        history = getattr(trainer, "history", None)  # a resumed run: the curves start with the epochs done
        for at, epoch in enumerate(getattr(history, "epochs", ()) if getattr(trainer, "epoch", 0) else ()):
            self._add(epoch, {k: v[at] for k, v in history.history.items() if at < len(v)})

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        self._add(epoch, logs)
        if self.every_epoch and getattr(trainer, "is_main", True):  # data-parallel training: rank 0 alone writes
            self.save()

    def _add(self, epoch: int, logs: dict[str, float]) -> None:
        self.epochs.append(epoch + 1)  # plotted 1-based, as the epoch lines print them
        for key, value in logs.items():
            if _is_loss(key) or _is_accuracy(key):
                self.history.setdefault(key, []).append(float(value))
        for key, values in self.history.items():  # a key absent this epoch (no batch counted): a gap
            if key not in logs:
                values.append(math.nan)

    def on_train_end(self, trainer: Any, result: Any) -> None:
        if getattr(trainer, "is_main", True):
            self.save()

    def save(self, path: str | os.PathLike | None = None) -> str:
        """Draw the curves recorded so far and write the PNG atomically (temporary file, then
        rename: a failed write raises ``OSError`` and leaves the previous file intact); returns its
        path. ``path`` defaults to ``self.path``."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        path = check_output_path("LossPlot.save", path if path is not None else self.path)
        fig = Figure(figsize=self.figsize, dpi=self.dpi)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        for key, values in self.history.items():
            if _is_loss(key):
                ax.plot(self.epochs[-len(values):], values, marker="o" if len(values) < 30 else None, label=key)
        ax.set_xlabel("epoch")
        ax.set_ylabel("loss")
        if self.log_scale:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        acc_keys = [k for k in self.history if _is_accuracy(k)]
        if acc_keys:
            ax2 = ax.twinx()
            for i, key in enumerate(acc_keys):
                values = self.history[key]
                ax2.plot(self.epochs[-len(values):], values, linestyle="--", color=f"C{(i + 3) % 10}", label=key)
            ax2.set_ylabel("accuracy")
            h2, l2 = ax2.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        if handles:
            ax.legend(handles, labels, loc="best")
        ax.set_title(self.title)
        fig.tight_layout()
        atomic_write("LossPlot", path, lambda f: fig.savefig(f, format="png"))
        return path
