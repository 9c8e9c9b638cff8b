"""``CSVLogger``: one CSV row per epoch with every key of the epoch logs (Keras' ``CSVLogger``)."""

from __future__ import annotations

import csv
import os
from typing import Any, TextIO

from .base import Observer

__all__ = ["CSVLogger"]


class CSVLogger(Observer):
    """Writes ``epoch`` (0-based, as the hooks count) and every epoch log key, one row per epoch.

    The columns are fixed by the first epoch's logs (``loss``, ``epoch_time``, ``samples_per_second``,
    ``eta`` and whatever the trainer adds); a key missing later is left empty. Each row is flushed
    as it is written, so the file is complete up to the last finished epoch even after a crash.

    Args:
        path: the CSV file.
        append: add rows to an existing file (its header is kept) instead of starting a new one.
        separator: the field separator.
    """

    def __init__(self, path: str | os.PathLike, append: bool = False, separator: str = ",") -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"CSVLogger: path must be a str or os.PathLike, got {type(path).__name__}")
        if not isinstance(separator, str) or len(separator) != 1:
            raise ValueError(f"CSVLogger: separator must be a single character, got {separator!r}")
        self.path = os.fspath(path)
        self.append = bool(append)
        self.separator = separator
        self._file: TextIO | None = None
        self._writer: csv.DictWriter | None = None
        self._fields: list[str] | None = None

    def on_train_begin(self, trainer: Any) -> None:
        self._fields = None
        if self.append and os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            with open(self.path, newline="") as f:
                header = next(csv.reader(f, delimiter=self.separator), None)
            self._fields = header or None
            self._file = open(self.path, "a", newline="")
        else:
            self._file = open(self.path, "w", newline="")
        if self._fields is not None:
            self._writer = self._make_writer(self._fields)

    def _make_writer(self, fields: list[str]) -> csv.DictWriter:
        return csv.DictWriter(self._file, fieldnames=fields, delimiter=self.separator, restval="", extrasaction="ignore")

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        if self._file is None:  # used outside fit(): open lazily
            self.on_train_begin(trainer)
        if self._writer is None:
            self._fields = ["epoch", *logs]
            self._writer = self._make_writer(self._fields)
            self._writer.writeheader()
        self._writer.writerow({"epoch": epoch, **{k: repr(float(v)) for k, v in logs.items()}})
        self._file.flush()

    def on_train_end(self, trainer: Any, result: Any) -> None:
        if self._file is not None:
            self._file.close()
        self._file = None
        self._writer = None
