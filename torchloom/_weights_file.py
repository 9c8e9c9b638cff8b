"""Reading the weights of a checkpoint file back into a model: what ``torchloom.load_checkpoint`` and
``Checkpoint.load_best`` share (``torchloom.saving`` adds rebuilding a ``Network`` without its code).

A file of ``Checkpoint(full_state=True)`` holds the whole run, the weights under ``"training"`` →
``"model"`` (and a description of the network under ``"network"``); one of ``full_state=False`` holds
``state_dict()`` alone. Either is read with ``torch.load(weights_only=True)``: data, never code. The
weights are those of the chain ``train()`` trains (``layers.network.chain_of``), whose keys read
``layers.0.weight`` or, for a plain module, ``layers.0.module.weight``; they are loaded through the
same chain, so a plain ``nn.Module`` gets them under its own names.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

from .layers.network import chain_of

__all__ = ["TRAINING_STATE_PREFIX", "read_checkpoint", "is_full_state", "weights_of", "load_weights"]

TRAINING_STATE_PREFIX = "torchloom-training-state"  # the "format" of a full-state checkpoint


def read_checkpoint(path: Any, owner: str, map_location: Any = "cpu") -> dict[str, Any]:
    """The dict a checkpoint file holds, read with ``weights_only=True``. ``FileNotFoundError`` for
    a missing file; ``ValueError`` for a file ``torch.load`` cannot read safely or that holds no dict;
    ``TypeError`` for a ``path`` that is not a ``str`` or ``os.PathLike``."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{owner}: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{owner}: no such file {path!r}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # a damaged file, or one holding objects weights_only refuses to build
        raise ValueError(f"{owner}: {path!r} is not a readable torchloom checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{owner}: {path!r} holds a {type(state).__name__}, not a checkpoint (a dict)")
    return state


def is_full_state(state: dict[str, Any]) -> bool:
    """Whether ``state`` is a full-state checkpoint (``Checkpoint(full_state=True)``)."""
    fmt = state.get("format")
    return isinstance(fmt, str) and fmt.startswith(TRAINING_STATE_PREFIX)


def weights_of(state: dict[str, Any], path: str, owner: str) -> dict[str, Tensor]:
    """The model's ``state_dict`` in a checkpoint: ``state["training"]["model"]`` of a full-state
    file, the file itself when it is a ``state_dict`` (every value a tensor)."""
    if is_full_state(state):
        weights = state.get("training", {}).get("model") if isinstance(state.get("training"), dict) else None
        if not isinstance(weights, dict):
            raise ValueError(f"{owner}: {path!r} is a training state without the model's weights (training → model)")
        return weights
    if state and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        return state
    raise ValueError(
        f"{owner}: {path!r} is neither a torchloom checkpoint (Checkpoint's file) nor a state_dict "
        f"(its keys: {sorted(map(str, state))[:8]})"
    )


def load_weights(model: nn.Module, weights: dict[str, Tensor], path: str, owner: str) -> nn.Module:
    """``model`` with ``weights`` loaded (through ``chain_of(model)``, the chain ``train()`` saved,
    or directly when the keys are the model's own), in eval mode, ready for inference. A mismatch
    is a ``ValueError`` naming the missing and unexpected keys before any weight changes."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{owner}: model must be an nn.Module (or a torchloom Network) to load the weights into, got {type(model).__name__}")
    target: nn.Module = model
    if set(weights) != set(model.state_dict()):
        try:
            target = chain_of(model)
        except TypeError:
            target = model
    own = target.state_dict()
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    shapes = [k for k in own if k in weights and tuple(own[k].shape) != tuple(weights[k].shape)]
    if missing or unexpected or shapes:
        detail = "; ".join(
            part for part in (
                f"missing {missing[:6]}{' ...' if len(missing) > 6 else ''}" if missing else "",
                f"unexpected {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}" if unexpected else "",
                "other shapes: " + ", ".join(f"{k} {list(weights[k].shape)} vs {list(own[k].shape)}" for k in shapes[:6]) if shapes else "",
            ) if part
        )
        raise ValueError(f"{owner}: the weights in {path!r} do not fit this model ({detail}); pass the model the checkpoint was trained from")
    target.load_state_dict(weights)
    model.eval()
    return model
