"""``TensorBoardLogger``: every numeric epoch log as a TensorBoard scalar, one point per epoch (and
the per-step logs of ``TrainingConfig(log_every_n_steps=N)`` as ``<key>_step`` scalars per step).

TensorBoard is an optional extra of torchloom (``pip install torchloom[tensorboard]``);
``torch.utils.tensorboard`` is imported when a ``TensorBoardLogger`` is created, never when
torchloom is imported. View the logs with ``tensorboard --logdir <log_dir>``.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable
from typing import Any

from ._files import check_directory, make_last_level, text_path
from .base import Observer, is_main_process

__all__ = ["TensorBoardLogger"]

_MISSING = (
    "TensorBoardLogger needs the tensorboard package, an optional extra of torchloom: install it with "
    "`pip install torchloom[tensorboard]` (or `pip install tensorboard`)"
)


def _summary_writer_class() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``; ``ImportError`` naming the extra without tensorboard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError(f"{_MISSING} ({e})") from e
    return SummaryWriter


def check_log_dir(owner: str, log_dir: Any, name: str = "log_dir", *, filesystem: bool = True) -> str:
    """``log_dir`` as a ``str`` once it is known to be usable as a directory of log files;
    ``TypeError``/``ValueError`` naming ``owner``'s argument ``name`` otherwise. With ``filesystem``
    the path must be a directory that accepts a new file, or a missing last level under one (made
    when training starts: only that level, never missing parents). Creates nothing."""
    if not filesystem:
        return text_path(owner, log_dir, name, "directory")
    return check_directory(owner, log_dir, name)


class TensorBoardLogger(Observer):
    """Writes every numeric key of the epoch logs (``loss``, ``val_loss``, the metrics, the method's
    logs, ``epoch_time``, ``samples_per_second``, ``eta``, ``skipped``, ``counted``, ...) as a scalar
    with tag ``prefix + key`` at step ``epoch`` (0-based, as the hooks and ``CSVLogger`` count; a
    resumed run continues at the epoch it resumes from). The event file is flushed at the end of
    every epoch and closed at the end of training.

    Non-finite values (a diverged epoch's ``loss = NaN``, an Inf) are **skipped**, not written: the
    epoch leaves a gap in that curve, and its ``counted`` (0 for an epoch in which no batch counted)
    and ``skipped`` scalars show what happened. Values that are not real numbers are ignored.

    When ``torch.distributed`` is initialised, only the process of rank 0 writes (the others create
    no directory and no file).

    Args:
        log_dir: the directory of the event files: an existing directory, or a missing last level
            under an existing writable directory (made at the start of training; missing parents are
            an error, so that a mistyped path fails before training).
        prefix: put in front of every tag, e.g. ``"train/"`` (TensorBoard groups tags by the part
            before a ``/``).
        keys: write only these log keys (``None``, the default: every numeric key).

    Raises ``ImportError`` naming the ``tensorboard`` extra when tensorboard is not installed, and
    ``ValueError``/``TypeError`` naming the argument for a bad ``log_dir``, ``prefix`` or ``keys``.
    ``check_ready()`` re-checks them (they may be changed after construction); trainers call it before
    a run changes anything. Nothing is created before training starts. ``writer`` is the open
    ``SummaryWriter`` during training (``None`` otherwise), to add your own summaries to the same run.
    """

    def __init__(self, log_dir: str | os.PathLike, *, prefix: str = "", keys: Iterable[str] | None = None) -> None:
        self.log_dir = log_dir
        self.prefix = prefix
        self.keys = keys
        self.writer: Any = None
        self.check_ready()

    def check_ready(self) -> None:
        """Raise ``ImportError`` without tensorboard, ``ValueError``/``TypeError`` naming the argument
        for a bad setting (the directory is checked on the main process only)."""
        self.log_dir = check_log_dir("TensorBoardLogger", self.log_dir, filesystem=is_main_process())
        if not isinstance(self.prefix, str):
            raise TypeError(f"TensorBoardLogger: prefix must be a str, got {type(self.prefix).__name__}")
        if self.keys is not None:
            if isinstance(self.keys, (str, bytes)) or not isinstance(self.keys, Iterable):
                raise TypeError(
                    f"TensorBoardLogger: keys must be a list of log key names (or None for every key), got {self.keys!r}"
                )
            keys = tuple(self.keys)
            bad = [k for k in keys if not isinstance(k, str) or not k]
            if bad:
                raise ValueError(f"TensorBoardLogger: keys must be non-empty str log key names, got {bad!r} among {keys!r}")
            self.keys = keys
        _summary_writer_class()

    # -------------------------------------------------------------------- hooks
    def _open(self) -> None:
        self._close()
        if is_main_process():
            make_last_level(os.path.abspath(self.log_dir))  # checked in check_ready(); SummaryWriter would make parents too
            self.writer = _summary_writer_class()(log_dir=self.log_dir)

    def _close(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()

    def on_train_begin(self, trainer: Any) -> None:
        self.check_ready()
        self._open()

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        if self.writer is None:
            if not is_main_process():
                return
            self._open()  # hooks called outside a trainer's fit(): start as fit() would
        keys = logs.keys() if self.keys is None else [k for k in self.keys if k in logs]
        for key in keys:
            value = logs[key]
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                continue
            value = float(value)
            if math.isfinite(value):
                self.writer.add_scalar(f"{self.prefix}{key}", value, global_step=epoch)
        self.writer.flush()

    def on_step_log(self, trainer: Any, step: int, logs: dict[str, float]) -> None:
        """The per-step logs (``TrainingConfig(log_every_n_steps=N)``) as scalars tagged
        ``prefix + key + "_step"`` at ``step`` (0-based over the run; Lightning's ``loss_step``)."""
        if self.writer is None:
            if not is_main_process():
                return
            self._open()
        keys = logs.keys() if self.keys is None else [k for k in self.keys if k in logs]
        for key in keys:
            value = logs[key]
            if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value)):
                self.writer.add_scalar(f"{self.prefix}{key}_step", float(value), global_step=step)

    def on_train_end(self, trainer: Any, result: Any) -> None:
        self._close()
