"""Full-state checkpoints of a run: what ``Checkpoint(full_state=True)`` writes and
``TrainingConfig(resume_from=path)`` reads back, so that 2 epochs + a resume for 2 equal 4 epochs in
one run, bit for bit on CPU. Only tensors, numbers, strings, lists and dicts:
``torch.load(path, weights_only=True)`` reads it back (a file is data, never code)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..observers.history import History
from ..saving import describe_network

__all__ = ["CHECKPOINT_FORMAT", "state_of", "read", "restore", "method_label", "network_description"]

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
        raise ValueError(f"resume_from: the checkpoint's model does not match this model (parameters {sorted(theirs)} vs {sorted(own)})")
    return state


def restore(trainer: Any, state: dict[str, Any], history: History) -> int:
    """Put a checked checkpoint's state in place in ``trainer``; returns the first epoch to run."""
    trainer.load_training_state(_to_device(state["training"], trainer.device))
    for key, values in state["history"].items():
        history.history[key] = list(values)
    history.epochs = list(range(state["epoch"]))
    trainer.loss_history = list(state["loss_history"])
    trainer.epoch_times = list(state["epoch_times"])
    trainer.skipped_per_epoch = list(state["skipped_per_epoch"])
    trainer.global_step = int(state["global_step"])
    if "divergence" in state:  # (a checkpoint of an earlier release has none: the watch starts afresh)
        trainer.divergence.load_state_dict(state["divergence"])
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
