"""``EarlyStopping`` and ``Checkpoint``: the callbacks users of Keras and Lightning expect, as
observers. Both watch one key of the epoch logs (``monitor``, default ``"loss"``; any key works, e.g.
``"val_loss"`` or ``"accuracy"``) and use only the trainer interface: ``trainer.model`` and
``trainer.stop_training``.

Divergence is never mistaken for success: a monitored value that is NaN or ±Inf (an epoch in which
no batch counted reports ``loss = NaN``), or a key missing from an epoch that counted no batch, is
never an improvement. It is never the best value, never saved as the best checkpoint, never restored
as the best weights, and it counts as a bad epoch for ``EarlyStopping``'s patience.

A monitored key that is missing from the first epoch's logs (of an epoch that counted batches)
raises ``ValueError`` naming the key and the keys available, at the end of that first epoch.

Note: the epoch ``loss`` is the mean of the batches' **pre-update** losses (Loom's definition), so the
weights kept as "best" are those at the end of the best epoch, one update past the last loss counted
in it — the same convention as Keras' training-loss monitoring.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any

import torch

from .._weights_file import load_weights, read_checkpoint, weights_of
from ._files import atomic_write, check_output_path
from .base import Observer

__all__ = ["EarlyStopping", "Checkpoint", "TerminateOnDivergence"]

_MODES = ("min", "max", "auto")


def _check_monitor(owner: str, monitor: Any, mode: Any, min_delta: Any) -> None:
    if not isinstance(monitor, str):
        raise TypeError(f"{owner}: monitor must be the name (str) of an epoch log key such as 'loss', got {monitor!r}")
    if not monitor:
        raise ValueError(f"{owner}: monitor must be the name of an epoch log key such as 'loss', got {monitor!r}")
    if not isinstance(mode, str) or mode not in _MODES:
        raise ValueError(f"{owner}: mode must be one of {_MODES}, got {mode!r}")
    if (
        isinstance(min_delta, bool)
        or not isinstance(min_delta, numbers.Real)
        or not math.isfinite(min_delta)
        or min_delta < 0
    ):
        raise ValueError(f"{owner}: min_delta must be a finite number >= 0, got {min_delta!r}")


def _check_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be a bool, got {value!r}")


def resolve_mode(monitor: str, mode: str) -> str:
    """``"min"`` or ``"max"``: ``"auto"`` picks ``"max"`` for a key containing ``"acc"`` (accuracy),
    else ``"min"`` (loss-like)."""
    if mode != "auto":
        return mode
    return "max" if "acc" in monitor.lower() else "min"


def _nothing_counted(logs: dict[str, Any]) -> bool:
    """Whether the epoch counted no batch (its per-batch extras such as accuracy are then absent)."""
    if "counted" in logs:
        try:
            return float(logs["counted"]) == 0.0
        except (TypeError, ValueError):
            return False
    try:
        return not math.isfinite(float(logs.get("loss", 0.0)))
    except (TypeError, ValueError):
        return False


class _Tracker:
    """The best value of one log key during a run. ``value(logs)`` reads it (NaN when the key is
    absent from an epoch that counted nothing, or absent after having been seen); ``better(value)``
    says whether a *finite* value beats the best by more than ``min_delta``; ``record`` keeps it."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.start("loss", "min", 0.0)

    def start(self, monitor: str, mode: str, min_delta: float) -> None:
        self.monitor = monitor
        self.mode = resolve_mode(monitor, mode)
        self.min_delta = float(min_delta)
        self.best = math.inf if self.mode == "min" else -math.inf
        self.best_epoch: int | None = None
        self.seen = False

    def value(self, logs: dict[str, Any]) -> float:
        if logs.get("diverged"):  # an epoch the engine found diverged is never an improvement
            return math.nan
        if self.monitor not in logs:
            if self.seen or _nothing_counted(logs):
                return math.nan
            raise ValueError(
                f"{self.owner}: monitor {self.monitor!r} is not in the epoch logs; available keys: {sorted(logs)} "
                "(set monitor to one of them)"
            )
        self.seen = True
        v = logs[self.monitor]
        if isinstance(v, (str, bytes, bool)):
            raise TypeError(f"{self.owner}: the epoch log {self.monitor!r} must be a number, got {v!r}")
        try:
            return float(v)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"{self.owner}: the epoch log {self.monitor!r} must be a number, got {type(v).__name__} {v!r}"
            ) from None

    def better(self, value: float) -> bool:
        if not math.isfinite(value):  # a diverged epoch (NaN/Inf) is never an improvement
            return False
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def record(self, value: float, epoch: int) -> None:
        self.best = value
        self.best_epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "mode": self.mode, "best": self.best, "best_epoch": self.best_epoch, "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_epoch, self.seen = float(state["best"]), state["best_epoch"], bool(state["seen"])

    def fits(self, state: Any) -> bool:
        """Whether a saved tracker ``state`` watched the same key the same way."""
        return isinstance(state, dict) and state.get("monitor") == self.monitor and state.get("mode") == self.mode


def _epoch_logs(trainer: Any, epoch: int) -> dict[str, Any] | None:
    """Epoch ``epoch``'s logs as the restored history of ``trainer`` holds them (None when absent)."""
    history = getattr(trainer, "history", None)
    epochs = list(getattr(history, "epochs", ()))
    if epoch not in epochs:
        return None
    at = epochs.index(epoch)
    return {k: v[at] for k, v in history.history.items() if at < len(v)}


def _pending_epochs(trainer: Any, seen: int | None) -> list[int]:
    """The epochs a resumed run completed after ``seen`` (the last one an observer's saved state
    took in): the observer catches up on them from the restored history."""
    done = int(getattr(trainer, "epoch", 0) or 0)
    return list(range(-1 if seen is None else int(seen), done))[1:] if done else []


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model.state_dict()`` on the model's own device (no host transfer, no sync)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class EarlyStopping(Observer):
    """Stops training when ``monitor`` has not improved for ``patience`` epochs in a row.

    An epoch whose monitored value is NaN or ±Inf (a diverged epoch) is never an improvement: it
    counts towards ``patience`` and its weights are never kept as the best.

    Args:
        monitor: the epoch log key to watch (``"loss"``, ``"val_loss"``, ``"accuracy"``, ...).
        patience: stop after this many epochs in a row without improvement (>= 1; Lightning's
            default 3 rides out a short plateau).
        min_delta: an improvement must beat the best value by more than this (>= 0).
        mode: ``"min"`` (loss-like), ``"max"`` (accuracy-like) or ``"auto"`` (``"max"`` when the key
            contains ``"acc"``, else ``"min"``).
        restore_best: at the end of training, load the weights of the best (finite) epoch back into
            the model (kept as an on-device copy of ``state_dict()`` at each improvement). When no
            epoch had a finite value nothing is restored.

    ``check_ready()`` re-checks these settings (they may be changed after construction); trainers
    call it before a run changes anything.

    After training: ``stopped_epoch`` (0-based epoch at which it stopped, ``None`` if it never did),
    ``best`` (best monitored value), ``best_epoch`` (0-based, ``None`` when no epoch was finite),
    ``wait`` (epochs since the last improvement).
    """

    def __init__(
        self,
        monitor: str = "loss",
        patience: int = 3,
        min_delta: float = 0.0,
        mode: str = "auto",
        restore_best: bool = True,
    ) -> None:
        self.monitor = monitor
        self.patience = patience
        self.min_delta = min_delta
        self.mode = mode
        self.restore_best = restore_best
        self.check_ready()
        self._tracker = _Tracker("EarlyStopping")
        self._restored: dict[str, Any] | None = None
        self._reset()

    def check_ready(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the setting when one is invalid."""
        p = self.patience
        if isinstance(p, bool) or not isinstance(p, numbers.Integral) or p < 1:
            raise ValueError(f"EarlyStopping: patience must be an int >= 1, got {p!r}")
        _check_bool("EarlyStopping", "restore_best", self.restore_best)
        _check_monitor("EarlyStopping", self.monitor, self.mode, self.min_delta)

    def _reset(self) -> None:
        self._tracker.start(self.monitor, self.mode, self.min_delta)
        self.wait = 0
        self.stopped_epoch: int | None = None
        self.best_state: dict[str, torch.Tensor] | None = None
        self._last_epoch: int | None = None

    @property
    def best(self) -> float:
        return self._tracker.best

    @property
    def best_epoch(self) -> int | None:
        return self._tracker.best_epoch

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs (saved in a full-state ``Checkpoint``): the best value and epoch,
        ``wait``, the last epoch seen and, with ``restore_best``, the best epoch's weights."""
        return {
            "tracker": self._tracker.state_dict(), "wait": self.wait, "epoch": self._last_epoch,
            "best_state": self.best_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a saved ``state_dict()`` in at the start of a resumed run (``on_train_begin``)."""
        self._restored = state

    def on_train_begin(self, trainer: Any) -> None:
        self.check_ready()
        self._reset()
        state, self._restored = self._restored, None
        seen = None
        if state is not None and self._tracker.fits(state.get("tracker")):
            self._tracker.load_state_dict(state["tracker"])
            self.wait, seen = int(state["wait"]), state["epoch"]
            if self.restore_best and state.get("best_state") is not None:
                self.best_state = {k: v.clone() for k, v in state["best_state"].items()}
        for epoch in _pending_epochs(trainer, seen):  # epochs of the resumed run this state has not seen
            logs = _epoch_logs(trainer, epoch)
            if logs is not None:
                self._judge(trainer, epoch, logs, replay=True)
        self.stopped_epoch = None

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        self._judge(trainer, epoch, logs)

    def _judge(self, trainer: Any, epoch: int, logs: dict[str, float], replay: bool = False) -> None:
        self._last_epoch = epoch
        value = self._tracker.value(logs)
        if self._tracker.better(value):
            self._tracker.record(value, epoch)
            self.wait = 0
            if self.restore_best:
                # a replayed epoch (a resumed run catching up): its weights are the model's only when it
                # is the last epoch done; an earlier one's are gone, and no weights beat wrong ones
                latest = not replay or epoch == int(getattr(trainer, "epoch", 0) or 0) - 1
                self.best_state = _snapshot(trainer.model) if latest else None
            return
        self.wait += 1
        if self.wait >= self.patience and not replay:
            self.stopped_epoch = epoch
            trainer.stop_training = True

    def on_train_end(self, trainer: Any, result: Any) -> None:
        if self.restore_best and self.best_state is not None:
            trainer.model.load_state_dict(self.best_state)


class Checkpoint(Observer):
    """Saves the training state with ``torch.save`` at the end of an epoch: the best so far by
    ``monitor`` (``save_best_only=True``) or every epoch (overwriting ``path``).

    With ``full_state=True`` (the default) the file holds the whole run after that epoch: model,
    optimizer or method state (TargetProp / Tween velocities, Tween's adaptive rate and explosion
    watch), schedule, random-number states, epoch count and history, so that
    ``TrainingConfig(resume_from=path)`` continues exactly where it stopped (2 epochs + resume for 2
    equals 4 epochs in one run), and a description of a torchloom ``Network`` (``"network"``) that
    ``torchloom.load_checkpoint(path)`` rebuilds it from without its code. With ``full_state=False``
    the file is ``state_dict()`` alone. For inference, ``load_best(model)`` or
    ``torchloom.load_checkpoint(path, model)`` loads either kind into a model in one call (the weights
    are under ``"training"`` → ``"model"``, named as in the chain ``train()`` trains:
    ``layers.0.module.weight`` for a plain module).

    The file is written to a temporary file beside ``path`` and then renamed over it, so an
    interrupted or failed save leaves the previous checkpoint intact and no temporary file; a failed
    save raises ``OSError`` naming the path. The directory of ``path`` is made at the first save
    when only its last level is missing (a missing parent is an error before training). An epoch whose monitored value is NaN or ±Inf is never saved as the best. Both kinds of
    file load with ``torch.load(path, weights_only=True)``: data, never code.

    Args:
        path: the file to write (its directory must exist, or miss only its last level; writable).
        monitor: the epoch log key that decides "best".
        save_best_only: save only when ``monitor`` improves (else every ``every_n_epochs`` epochs).
        mode: ``"min"``, ``"max"`` or ``"auto"`` (``"max"`` when the key contains ``"acc"``).
        min_delta: an improvement must beat the best value by more than this (>= 0).
        every_n_epochs: consider saving only at the end of every n-th epoch (1-based epochs n, 2n,
            ...); with ``save_best_only`` the best is judged among those epochs only.
        full_state: save the whole training state (default), or ``model.state_dict()`` only.

    ``check_ready()`` re-checks the path and these settings (they may be changed after
    construction); trainers call it before a run changes anything.

    After training: ``best``, ``best_epoch`` (0-based; ``None`` when no epoch was finite) and
    ``saved_epochs`` (every epoch saved).

    Resume: a full-state file also holds the state of every observer with ``state_dict()`` /
    ``load_state_dict()`` (this one's best value and saved epochs, ``EarlyStopping``'s best and
    ``wait``, one of your own), given back before ``on_train_begin`` of the resumed run, so that the
    first resumed epoch never "improves" on a forgotten best. Checkpoints are called after the other
    observers of an epoch, so the state they save is the state after that epoch; a ``Checkpoint``
    whose saved state missed an epoch (another ``Checkpoint`` wrote the file first, or an earlier
    release wrote it without observer states) judges the missed epochs again from the restored
    history, without writing.
    """

    writes_checkpoint = True  # the engine calls it after the other observers of an epoch

    def __init__(
        self,
        path: str | os.PathLike,
        monitor: str = "loss",
        save_best_only: bool = True,
        mode: str = "auto",
        min_delta: float = 0.0,
        every_n_epochs: int = 1,
        full_state: bool = True,
    ) -> None:
        self.path = path
        self.full_state = full_state
        self.monitor = monitor
        self.save_best_only = save_best_only
        self.mode = mode
        self.min_delta = min_delta
        self.every_n_epochs = every_n_epochs
        self.check_ready()
        self._tracker = _Tracker("Checkpoint")
        self._tracker.start(self.monitor, self.mode, self.min_delta)
        self.saved_epochs: list[int] = []
        self._last_epoch: int | None = None
        self._restored: dict[str, Any] | None = None

    def check_ready(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the argument when the path cannot be written or a
        setting is invalid (``path`` is normalised to a ``str``)."""
        self.path = check_output_path("Checkpoint", self.path)
        _check_bool("Checkpoint", "save_best_only", self.save_best_only)
        _check_bool("Checkpoint", "full_state", self.full_state)
        _check_monitor("Checkpoint", self.monitor, self.mode, self.min_delta)
        n = self.every_n_epochs
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"Checkpoint: every_n_epochs must be an int >= 1, got {n!r}")

    @property
    def best(self) -> float:
        return self._tracker.best

    @property
    def best_epoch(self) -> int | None:
        return self._tracker.best_epoch

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs (saved in a full-state checkpoint): the best value and epoch, the
        epochs saved and the last epoch seen."""
        return {"tracker": self._tracker.state_dict(), "saved_epochs": list(self.saved_epochs), "epoch": self._last_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a saved ``state_dict()`` in at the start of a resumed run (``on_train_begin``)."""
        self._restored = state

    def on_train_begin(self, trainer: Any) -> None:
        self.check_ready()
        self._tracker.start(self.monitor, self.mode, self.min_delta)
        self.saved_epochs = []
        self._last_epoch = None
        state, self._restored = self._restored, None
        seen = None
        if state is not None and self._tracker.fits(state.get("tracker")):
            self._tracker.load_state_dict(state["tracker"])
            self.saved_epochs, seen = [int(e) for e in state["saved_epochs"]], state["epoch"]
        # a resumed run: the epochs this state has not seen (all of them, from a checkpoint without
        # one; the epoch a Checkpoint listed before this one wrote) are judged again from the history,
        # without writing, so the best is the best of the whole run
        for epoch in _pending_epochs(trainer, seen):
            logs = _epoch_logs(trainer, epoch)
            if logs is not None:
                self._judge(trainer, epoch, logs, replay=True)

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        self._judge(trainer, epoch, logs)

    def _judge(self, trainer: Any, epoch: int, logs: dict[str, float], replay: bool = False) -> None:
        self._last_epoch = epoch
        value = self._tracker.value(logs)  # read every epoch: a missing key is reported at once
        if (epoch + 1) % self.every_n_epochs:
            return
        improved = self._tracker.better(value)
        if replay:  # the file was written then (or by the run that wrote the checkpoint): only the record
            if improved:
                self._tracker.record(value, epoch)
            if improved or not self.save_best_only:
                self.saved_epochs.append(epoch)
            return
        if improved or not self.save_best_only:
            before = (self._tracker.state_dict(), list(self.saved_epochs))
            if improved:  # recorded before the file is written, so that its saved state knows this epoch ...
                self._tracker.record(value, epoch)
            self.saved_epochs.append(epoch)
            try:
                full = self.full_state and hasattr(trainer, "checkpoint_state")
                if getattr(trainer, "is_main", True):  # data-parallel training: rank 0 alone writes
                    state = trainer.checkpoint_state() if full else trainer.model.state_dict()
                    atomic_write("Checkpoint", self.path, lambda f: torch.save(state, f))
            except BaseException:  # ... and forgotten when it fails: best still names the file's epoch
                self._tracker.load_state_dict(before[0])
                self.saved_epochs = before[1]
                raise


    def load_best(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` with the weights of the file written last (the best epoch's with
        ``save_best_only=True``), in eval mode, ready for inference; returned. ``model`` is the model
        that was trained or one built the same way (a plain ``nn.Module`` too).
        ``torchloom.load_checkpoint(path)`` also rebuilds a torchloom ``Network`` without one.
        Raises ``FileNotFoundError`` before any epoch was saved, ``ValueError`` naming the keys
        when the weights do not fit ``model``."""
        if model is None:
            raise TypeError(
                "Checkpoint.load_best: pass the model to load the best weights into; "
                f"torchloom.load_checkpoint({self.path!r}) rebuilds a torchloom Network without one"
            )
        state = read_checkpoint(self.path, "Checkpoint.load_best")
        return load_weights(model, weights_of(state, self.path, "Checkpoint.load_best"), self.path, "Checkpoint.load_best")


class TerminateOnDivergence(Observer):
    """Stops training at the end of an epoch that diverged (Keras' ``TerminateOnNaN``, for every kind
    of divergence the engine finds: a NaN/Inf epoch, a loss far above its best, blown-up weights, a
    method's collapse; ``logs["diverged"]``). The weights stay as that epoch left them; with
    ``Checkpoint(save_best_only=True)`` beside it the best epoch's file is untouched.

    ``stopped_epoch``: the 0-based epoch it stopped at (``None`` when it did not)."""

    def __init__(self) -> None:
        self.stopped_epoch: int | None = None

    def on_train_begin(self, trainer: Any) -> None:
        self.stopped_epoch = None

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        loss = logs.get("loss", 0.0)
        if logs.get("diverged") or (isinstance(loss, float) and not math.isfinite(loss)):
            self.stopped_epoch = epoch
            trainer.stop_training = True
