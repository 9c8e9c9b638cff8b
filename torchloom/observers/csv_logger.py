"""``CSVLogger``: one CSV row per epoch with every key of the epoch logs (Keras' ``CSVLogger``), and
optionally a second file of per-step logs (``step_path``)."""

from __future__ import annotations

import csv
import io
import os
from typing import Any

from ._files import atomic_write, check_output_path
from .base import Observer

__all__ = ["CSVLogger"]


def _fmt(value: Any) -> str:
    try:
        return repr(float(value))  # full precision; NaN is written 'nan' and reads back with float()
    except (TypeError, ValueError, RuntimeError):
        return str(value)


class CSVLogger(Observer):
    """Writes ``epoch`` (0-based, as the hooks count) and every epoch log key, one row per epoch.

    The columns are those of the first epoch's logs (``loss``, ``skipped``, ``counted``,
    ``epoch_time``, ``samples_per_second``, ``eta`` and whatever the trainer adds); a key missing
    later is left empty in its row. A key that appears later (or, with ``append``, a key the existing
    file lacks) adds a column: the file is rewritten atomically with the union of the columns (old
    columns first), earlier rows keeping their values and leaving the new column empty, so no value is
    ever dropped and no row is ever empty.

    Writing is crash-safe: the header (and any rewrite) goes to a temporary file renamed over ``path``,
    so the old file stays intact until the first epoch ends; each later row is appended with one
    write and flushed, and a failed append is cut back, so the file always ends with a complete row.
    A failed write raises ``OSError`` naming the path.

    Args:
        path: the CSV file (its directory must exist, or miss only its last level; writable).
        append: add rows to an existing file instead of replacing it. The file must be a log of this
            kind (first column ``epoch``, every row as long as the header, text in UTF-8), else
            ``ValueError`` at construction and in ``check_ready()``.
        separator: the field separator (one character, not a quote, a line break or a space).
        step_path: a second CSV file for the per-step logs of ``TrainingConfig(log_every_n_steps=N)``:
            first column ``step`` (0-based over the run), then ``loss``, ``lr``, the method's step
            logs and ``skipped``, one row per logged step, written the same crash-safe way (and
            appended to with ``append``). ``None`` (default): no step file.

    ``check_ready()`` re-checks the path, settings and the file to append to (they may change after
    construction); trainers call it before a run changes anything.

    A resumed run (``TrainingConfig(resume_from=...)``) writing a new file (``append=False``) starts it
    with the rows of the epochs done, from the restored history: the file holds the whole run.
    """

    _index = "epoch"  # the first column

    def __init__(self, path: str | os.PathLike, append: bool = False, separator: str = ",", *, step_path: str | os.PathLike | None = None) -> None:
        self.path = path
        self.append = append
        self.separator = separator
        self._header: list[str] | None = None
        self._needs_newline = False
        self._active = False
        self.step_path = step_path
        self._steps: CSVLogger | None = None
        self.check_ready()

    # ----------------------------------------------------------------- checks
    def check_ready(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the argument when the path cannot be written, a
        setting is invalid, or (``append``) the existing file is not a log this class can extend."""
        self.path = check_output_path("CSVLogger", self.path)
        if not isinstance(self.append, bool):
            raise TypeError(f"CSVLogger: append must be a bool, got {self.append!r}")
        sep = self.separator
        if not isinstance(sep, str) or len(sep) != 1 or sep in '"\r\n ' or not sep.isprintable():
            raise ValueError(
                f"CSVLogger: separator must be a single printable character other than a quote, a space or "
                f"a line break, got {sep!r}"
            )
        self._existing_header()
        if self.step_path is not None:
            steps = _StepCSV(self.step_path, self.append, self.separator)
            if os.path.abspath(steps.path) == os.path.abspath(self.path):
                raise ValueError(f"CSVLogger: step_path must be another file than path, got {steps.path!r} for both")
            self._steps = steps
        else:
            self._steps = None

    def _existing_header(self) -> list[str] | None:
        """The header of the file to append to (``None`` when a new file will be written); sets
        whether its last row lacks a line end. Raises ``ValueError`` when it is not such a log."""
        self._needs_newline = False
        if not self.append or not os.path.isfile(self.path) or os.path.getsize(self.path) == 0:
            return None
        try:
            with open(self.path, newline="", encoding="utf-8") as f:
                text = f.read()
            rows = list(csv.reader(io.StringIO(text), delimiter=self.separator))
        except (UnicodeDecodeError, csv.Error, OSError) as e:
            raise ValueError(
                f"CSVLogger: append=True but {self.path!r} cannot be read as a CSV log ({type(e).__name__}: {e}); "
                "use another path or append=False"
            ) from None
        header = rows[0] if rows else []
        if not header or header[0] != self._index or any(not h for h in header) or len(set(header)) != len(header):
            raise ValueError(
                f"CSVLogger: append=True but {self.path!r} is not a CSVLogger log: its header {header!r} must "
                f"start with {self._index!r} and name each column once (separator {self.separator!r}); use another path "
                "or append=False"
            )
        bad = [i + 1 for i, r in enumerate(rows[1:], start=1) if r and len(r) != len(header)]
        if bad:
            raise ValueError(
                f"CSVLogger: append=True but {self.path!r} has rows whose length differs from its header's "
                f"{len(header)} columns (lines {bad[:5]}); the file is damaged: use another path or append=False"
            )
        self._needs_newline = not text.endswith(("\n", "\r"))
        return header

    # ------------------------------------------------------------------ writing
    def _line(self, values: list[str]) -> bytes:
        buf = io.StringIO()
        csv.writer(buf, delimiter=self.separator).writerow(values)
        return buf.getvalue().encode("utf-8")

    def _rewrite(self, header: list[str], new_row: dict[str, str]) -> None:
        """Write ``header``, every row already in the file (re-keyed to ``header``) and ``new_row``
        to a temporary file and rename it over ``path``."""
        old_rows: list[dict[str, str]] = []
        if self._header is not None and os.path.isfile(self.path):
            with open(self.path, newline="", encoding="utf-8") as f:
                reader = csv.reader(f, delimiter=self.separator)
                old_header = next(reader, None) or self._header
                old_rows = [dict(zip(old_header, r)) for r in reader if r]
        lines = [self._line(header)]
        lines += [self._line([r.get(k, "") for k in header]) for r in [*old_rows, new_row]]
        atomic_write("CSVLogger", self.path, lambda f: f.write(b"".join(lines)))
        self._header = header
        self._needs_newline = False

    def _append(self, row: dict[str, str]) -> None:
        data = self._line([row.get(k, "") for k in self._header])
        if self._needs_newline:
            data = b"\r\n" + data
        try:
            with open(self.path, "ab") as f:
                end = f.seek(0, os.SEEK_END)
                try:
                    f.write(data)
                    f.flush()
                except BaseException:
                    f.truncate(end)  # never leave half a row behind
                    raise
        except Exception as e:
            raise OSError(
                f"CSVLogger: could not append a row to {self.path!r} ({type(e).__name__}: {e}); "
                "the rows written before are intact"
            ) from e
        self._needs_newline = False

    # -------------------------------------------------------------------- hooks
    def on_train_begin(self, trainer: Any) -> None:
        self.check_ready()
        self._header = self._existing_header()
        self._active = True
        history = getattr(trainer, "history", None)
        # a resumed run (TrainingConfig.resume_from) into a new file: the epochs done come first, from
        # the restored history, so the file holds the whole run
        resumed = getattr(trainer, "epoch", 0) and history is not None and getattr(trainer, "is_main", True)
        if resumed and not self.append and self._index == "epoch":
            for at, epoch in enumerate(getattr(history, "epochs", ())):
                self._write_row(epoch, {k: v[at] for k, v in history.history.items() if at < len(v)})
        if self._steps is not None:
            self._steps.on_train_begin(trainer)

    def on_step_log(self, trainer: Any, step: int, logs: dict[str, float]) -> None:
        if self.step_path is None or not getattr(trainer, "is_main", True):
            return
        if not self._active:
            self.on_train_begin(trainer)
        self._steps._write_row(step, logs)

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        if not getattr(trainer, "is_main", True):  # data-parallel training: rank 0 alone writes
            return
        if not self._active:  # hooks called outside a trainer's fit(): start as fit() would
            self.on_train_begin(trainer)
        self._write_row(epoch, logs)

    def _write_row(self, index: int, logs: dict[str, float]) -> None:
        row = {self._index: str(index)}
        row.update({str(k): _fmt(v) for k, v in logs.items() if str(k) != self._index})
        if self._header is None:
            self._rewrite(list(row), row)
        elif any(k not in self._header for k in row):
            self._rewrite(self._header + [k for k in row if k not in self._header], row)
        else:
            self._append(row)

    def on_train_end(self, trainer: Any, result: Any) -> None:
        self._header = None
        self._active = False
        if self._steps is not None:
            self._steps.on_train_end(trainer, result)


class _StepCSV(CSVLogger):
    """The step file of ``CSVLogger(step_path=...)``: the same writer, first column ``step``."""

    _index = "step"
