"""Full-state checkpoints of a run: what ``Checkpoint(full_state=True)`` writes and
``TrainingConfig(resume_from=path)`` reads back, so that 2 epochs + a resume for 2 equal 4 epochs in
one run, bit for bit on CPU. Only tensors, numbers, strings, lists and dicts:
``torch.load(path, weights_only=True)`` reads it back (a file is data, never code)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import Tensor

from ..observers.history import History
from ..saving import describe_network
from .types import user_stacklevel

__all__ = ["CHECKPOINT_FORMAT", "state_of", "read", "restore", "method_label", "stateful_observers", "network_description"]

CHECKPOINT_FORMAT = "torchloom-training-state-1"

# what checkpoints written before methods were plug-ins name their method by
_LEGACY = {"BackpropTrainer": "backprop", "TargetPropTrainer": "target_prop", "TweenTrainer": "tween"}


def method_label(method: Any) -> str:
    """The name a checkpoint records for ``method``: its registry name, else its class name."""
    return getattr(method, "name", "") or type(method).__qualname__


def state_of(trainer: Any) -> dict[str, Any]:
    """The whole state of ``trainer``'s run after ``trainer.epoch`` completed epochs: model, optimizer
    or method state, schedule, random-number states, history."""
    rng: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and trainer.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(trainer.device)
    return {
        "format": CHECKPOINT_FORMAT,
        "method": method_label(trainer.method),
        "epoch": int(trainer.epoch),
        "global_step": int(trainer.global_step),
        "training": trainer.training_state(),
        "rng": rng,
        "history": {k: list(v) for k, v in trainer.history.history.items()},
        "loss_history": list(trainer.loss_history),
        "epoch_times": list(trainer.epoch_times),
        "skipped_per_epoch": list(trainer.skipped_per_epoch),
        "divergence": trainer.divergence.state_dict(),
        "network": network_description(trainer),
        "observers": {key: obs.state_dict() for key, obs in stateful_observers(trainer.user_observers)},
        "shuffle_seed": getattr(getattr(trainer, "source", None), "shuffle_seed", None),
    }


def network_description(trainer: Any) -> dict[str, Any]:
    """What ``torchloom.load_checkpoint(path)`` rebuilds ``trainer.model`` from without its code
    (``saving.describe_network``), made at the first checkpoint of the trainer and kept (the layers
    do not change during a run). Convolutions and RNNs take their sizes from the first input shape
    the trainer checked (``Trainer.output_shape``'s cache; tests/test_saving.py's convolutional case
    fails if its layout changes)."""
    found = trainer.__dict__.get("_network_description")
    if found is None:
        # the cache's keys: one (sample shape, is floating) per input; a model of one input only
        shapes = trainer.__dict__.get("_output_shapes") or {}
        example = next(((1, *key[0][0]) for key in shapes if len(key) == 1), None)
        found = trainer._network_description = describe_network(trainer.model, example)
    return found


def stateful_observers(observers: Any) -> list[tuple[str, Any]]:
    """``(key, observer)`` for every observer with ``state_dict()`` and ``load_state_dict(state)``
    (Lightning's callback protocol): its ``state_key`` attribute, else its class name, with ``#2``,
    ``#3``, ... for the second and later of the same key, in the order the observers are given. A
    full-state checkpoint keeps each one's ``state_dict()`` under its key; a resumed run gives it
    back through ``load_state_dict`` before ``on_train_begin``."""
    out: list[tuple[str, Any]] = []
    counts: dict[str, int] = {}
    for obs in observers:
        if not (callable(getattr(obs, "state_dict", None)) and callable(getattr(obs, "load_state_dict", None))):
            continue
        key = getattr(obs, "state_key", None) or type(obs).__qualname__
        counts[key] = counts.get(key, 0) + 1
        out.append((key if counts[key] == 1 else f"{key}#{counts[key]}", obs))
    return out


def read(trainer: Any, path: Any, epochs: int) -> dict[str, Any]:
    """Read and check a full-state checkpoint for ``trainer``'s run of ``epochs`` epochs."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"resume_from: no such file {str(path)!r}") from None
    except Exception as e:
        raise ValueError(f"resume_from: {str(path)!r} is not a readable torchloom checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"resume_from: {str(path)!r} holds no full training state (write it with Checkpoint(..., full_state=True), "
            "the default); a bare state_dict loads with model.load_state_dict instead"
        )
    written, ours = _LEGACY.get(state["method"], state["method"]), method_label(trainer.method)
    if written != ours:
        raise ValueError(f"resume_from: the checkpoint was written by method {written!r}, this run uses method {ours!r}")
    if state["epoch"] >= epochs:
        raise ValueError(
            f"epochs: the checkpoint has {state['epoch']} epochs done already; epochs counts the whole run, "
            f"so it must be > {state['epoch']} to train more, got {epochs}"
        )
    own = trainer.model.state_dict()
    theirs = state["training"]["model"]
    shapes = {k: tuple(v.shape) for k, v in own.items()}
    if set(theirs) != set(own) or any(tuple(theirs[k].shape) != shapes[k] for k in own):
        missing, extra = sorted(set(own) - set(theirs)), sorted(set(theirs) - set(own))
        shaped = [f"{k} {list(theirs[k].shape)} vs {list(shapes[k])}" for k in own if k in theirs and tuple(theirs[k].shape) != shapes[k]]
        parts = ([f"only in this model: {missing}"] if missing else []) + ([f"only in the checkpoint: {extra}"] if extra else [])
        parts += [f"shapes differ (checkpoint vs this model): {', '.join(shaped)}"] if shaped else []
        raise ValueError(f"resume_from: the checkpoint's model does not match this model ({'; '.join(parts)}); nothing was changed")
    fresh = trainer.training_state()
    _check_optimizer(state["training"].get("optimizer"), fresh.get("optimizer"), trainer)
    differences = _setting_differences(state["training"], fresh)
    if differences and trainer.is_main:  # (data-parallel: rank 0 alone warns; every rank reads the same file)
        warnings.warn(
            "resume_from: the checkpoint's settings are used where this run's config differs (as "
            f"optimizer.load_state_dict does in PyTorch): {'; '.join(differences)}. To go on with new settings, "
            "start a new run from the weights: model.load_state_dict(torch.load(path, weights_only=True)"
            "['training']['model'])",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    return state


def _check_optimizer(saved: Any, fresh: Any, trainer: Any) -> None:
    """``ValueError`` naming what differs when the checkpoint's optimizer state cannot be this run's
    optimizer's: another optimizer (other settings per param group), another number of param groups
    or of parameters in a group (a layer frozen or unfrozen), or state of another shape."""
    if (saved is None) != (fresh is None):
        has = "the checkpoint has optimizer state and this run's method has no optimizer" if fresh is None else (
            "this run's method has an optimizer and the checkpoint has no optimizer state")
        raise ValueError(f"resume_from: {has}; nothing was changed")
    if saved is None:
        return
    name = type(trainer.method.optimizer).__name__ if hasattr(trainer.method, "optimizer") else "optimizer"
    groups, ours = saved["param_groups"], fresh["param_groups"]
    theirs_keys = {k for g in groups for k in g} - {"params", "initial_lr"}
    our_keys = {k for g in ours for k in g} - {"params", "initial_lr"}
    if theirs_keys != our_keys:
        raise ValueError(
            f"resume_from: the checkpoint was written with another optimizer than this run's {name}: its settings "
            f"{sorted(theirs_keys - our_keys)} are not {name}'s, and {name}'s {sorted(our_keys - theirs_keys)} are missing; "
            "nothing was changed"
        )
    if len(groups) != len(ours):
        raise ValueError(
            f"resume_from: the checkpoint's optimizer has {len(groups)} param group(s), this run's {name} has {len(ours)}; "
            "nothing was changed"
        )
    for i, (g, o) in enumerate(zip(groups, ours)):
        if len(g["params"]) != len(o["params"]):
            raise ValueError(
                f"resume_from: param group {i} of the checkpoint's optimizer holds {len(g['params'])} parameters, this "
                f"run's {name} {len(o['params'])} (a layer frozen or unfrozen since?); nothing was changed"
            )
    params = [p for group in trainer.method.optimizer.param_groups for p in group["params"]]
    index = [k for g in groups for k in g["params"]]
    for k, p in zip(index, params):
        for key, value in saved["state"].get(k, {}).items():
            if isinstance(value, Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(p.shape):
                raise ValueError(
                    f"resume_from: the checkpoint's optimizer state {key!r} of parameter {k} has shape "
                    f"{list(value.shape)}, this run's parameter {list(p.shape)}; nothing was changed"
                )


# entries of a schedule's state that are its progress, not its settings
_PROGRESS = {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial", "best",
             "num_bad_epochs", "cooldown_counter", "last_epoch", "verbose", "_initial_step"}


def _leaves(obj: Any, path: str = "") -> dict[str, Any]:
    """The plain values (numbers, strings, booleans, None) of nested dicts and lists by dotted path;
    tensors are state, not settings."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_leaves(v, f"{path}.{k}" if path else str(k)))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(_leaves(v, f"{path}[{i}]"))
        return out
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {path: obj}
    return {}


def _setting_differences(saved: dict[str, Any], fresh: dict[str, Any]) -> list[str]:
    """Each setting a checkpoint's training state holds that differs from this run's (the
    checkpoint's value first): every optimizer param-group entry (the learning rate only without a
    schedule, which moves it), the rates of a method without an optimizer, the schedule's settings
    (its progress aside), and whether there is a schedule or a loss scaler at all."""
    out: list[str] = []
    scheduled = "scheduler" in saved or "scheduler" in fresh
    if ("scheduler" in saved) != ("scheduler" in fresh):
        out.append("a schedule: the checkpoint has one, this run none (the rates stay where it left them)" if "scheduler" in saved
                   else "a schedule: this run has one, the checkpoint none (it starts at its step 0)")
    if ("loss_scaler" in saved) != ("loss_scaler" in fresh):
        out.append("loss scaling (precision='16-mixed'): " + (
            "the checkpoint has it, this run not (its scale is dropped)" if "loss_scaler" in saved
            else "this run has it, the checkpoint not (it starts at its initial scale)"))
    opt_saved, opt_fresh = saved.get("optimizer"), fresh.get("optimizer")
    if opt_saved is not None and opt_fresh is not None:
        one = len(opt_fresh["param_groups"]) == 1
        for i, (g, o) in enumerate(zip(opt_saved["param_groups"], opt_fresh["param_groups"])):
            for key in o:
                if key in ("params", "initial_lr") or (key == "lr" and scheduled) or key not in g:
                    continue
                a, b = _leaves(g[key]), _leaves(o[key])
                if a != b:
                    label = f"optimizer {key}" if one else f"optimizer param group {i} {key}"
                    out.append(f"{label} {_show(g[key])} (this run: {_show(o[key])})")
    elif not scheduled and saved.get("rates") != fresh.get("rates") and "rates" in saved:
        a, b = saved["rates"], fresh["rates"]
        out.append(f"rate {_show(a[0] if len(a) == 1 else a)} (this run: {_show(b[0] if len(b) == 1 else b)})")
    if "rates" in saved and bool(saved.get("auto_rate", False)) != bool(fresh.get("auto_rate", False)):
        kind = {True: "automatic (left unset: scaled by min(1, B/16) below 16 rows)", False: "given explicitly (never scaled)"}
        out.append(f"the rate is {kind[bool(saved.get('auto_rate', False))]} "
                   f"(this run: {kind[bool(fresh.get('auto_rate', False))]})")
    if "scheduler" in saved and "scheduler" in fresh:
        a = {k: v for k, v in _leaves(saved["scheduler"]).items() if k.split(".")[0].split("[")[0] not in _PROGRESS}
        b = {k: v for k, v in _leaves(fresh["scheduler"]).items() if k.split(".")[0].split("[")[0] not in _PROGRESS}
        for key in sorted(set(a) | set(b)):
            if a.get(key, "(none)") != b.get(key, "(none)"):
                label = key.removeprefix("schedule.")  # ScheduleLR's schedule, by its parameters
                out.append(f"schedule {label} {_show(a.get(key, '(none)'))} (this run: {_show(b.get(key, '(none)'))})")
    return out


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else repr(value) if not isinstance(value, str) or value != "(none)" else value


def restore(trainer: Any, state: dict[str, Any], history: History) -> int:
    """Put a checked checkpoint's state in place in ``trainer``; returns the first epoch to run."""
    before = copy.deepcopy(trainer.training_state())
    try:
        trainer.load_training_state(_to_device(state["training"], trainer.device))
    except (RuntimeError, KeyError, IndexError, TypeError, ValueError) as e:  # what read()'s checks did not foresee
        trainer.load_training_state(before)
        raise ValueError(f"resume_from: the checkpoint's state does not fit this run ({type(e).__name__}: {e}); nothing was changed") from None
    for key, values in state["history"].items():
        history.history[key] = list(values)
    history.epochs = list(range(state["epoch"]))
    trainer.loss_history = list(state["loss_history"])
    trainer.epoch_times = list(state["epoch_times"])
    trainer.skipped_per_epoch = list(state["skipped_per_epoch"])
    trainer.global_step = int(state["global_step"])
    if "divergence" in state:  # (a checkpoint of an earlier release has none: the watch starts afresh)
        trainer.divergence.load_state_dict(state["divergence"])
    source = getattr(trainer, "source", None)
    if state.get("shuffle_seed") is not None and source is not None and source.shuffle_seed is not None:
        source.set_shuffle_seed(state["shuffle_seed"])  # the same per-epoch orders as the run it continues
    saved = state.get("observers", {})  # (none in a checkpoint of an earlier release: each observer starts afresh)
    for key, obs in stateful_observers(trainer.user_observers):
        if key in saved:
            obs.load_state_dict(saved[key])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], trainer.device)
    return int(state["epoch"])


def _to_device(obj: Any, device: torch.device) -> Any:
    """Tensors of a loaded state moved to the training device (optimizer states stay where their
    ``load_state_dict`` puts them)."""
    if isinstance(obj, Tensor):
        return obj.to(device) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: (v if k in ("optimizer", "scheduler") else _to_device(v, device)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    return obj
