"""The grid-dtype groups of a ``LowBitWeights`` updated together, in four launches a step whatever
the number of layers: the parameters gathered into one flat buffer (``torch.cat``), the master's
update with the scales' block partials, the requantisation (``kernels/requant_groups.py``), and
the new values copied back (``torch._foreach_copy_``).

The masters, the "before" copies and the scales of those groups live in flat device buffers; each
group's ``master``, ``before``, ``scales`` and ``fixed`` lists hold views of them, so the checkpoint
code (``LowBitWeights.state_dict`` / ``load_state_dict``) and ``to_loom_json`` see the same tensors
as before. It serves the groups whose dtype is an integer grid of at most 2²⁴ codes either side,
with one scale per layer (``scale="per_tensor"`` or ``"fixed"``, not ``loom_compat``), on CUDA (or
through Triton's interpreter with ``backend="triton"``); ``LowBitWeights`` updates the others (and
every group on CPU) with its torch ops, which compute the same thing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .codec import _ABSMEAN, _CLIP_SAMPLE, _CLIP_SEARCH, _clip_ratios, dtype_info

__all__ = ["FusedGrid", "fusable"]

_NARROW = 2 ** 24


def fusable(group: Any, config: Any) -> bool:
    """Whether ``group`` (a ``LowBitWeights`` group) can take the fused update."""
    info = dtype_info(group.dtype)
    return (
        info.kind == "grid" and -_NARROW <= info.lo and info.hi <= _NARROW and not config.loom_compat
        and config.scale in ("per_tensor", "fixed")
        and all(p.dtype == torch.float32 and p.is_contiguous() and p.device == group.params[0].device for p in group.params)
    )


class FusedGrid:
    """The fused update of ``groups`` (``LowBitWeights`` groups, already quantised once: their
    scales, masters and "before" copies set), on their parameters' device."""

    def __init__(self, groups: list[Any], seed: int, stochastic: bool, backend: str | None) -> None:
        from ..kernels.requant_groups import MODE_CLIP, MODE_MAX, MODE_MEAN, grid_layout

        device = groups[0].params[0].device
        specs = []
        for g in groups:
            info = dtype_info(g.dtype)
            mode = MODE_MEAN if info.name in _ABSMEAN else MODE_CLIP if info.name in _CLIP_SEARCH else MODE_MAX
            specs.append(dict(numels=[p.numel() for p in g.params], indices=g.index, lo=info.lo, hi=info.hi,
                              qmax=info.qmax, mode=mode, fixed=g.fixed is not None, sample=_CLIP_SAMPLE))
        self.layout = grid_layout(specs, seed, _clip_ratios(device), device)
        self.device = device
        self.groups = groups
        self.stochastic = stochastic
        self.backend = backend
        n = self.layout.n
        master = groups[0].master is not None
        self.P = torch.empty(n, dtype=torch.float32, device=device)
        self.B = torch.empty(n, dtype=torch.float32, device=device)
        self.M = torch.empty(n, dtype=torch.float32, device=device) if master else None
        self.S = torch.empty(len(groups), dtype=torch.float32, device=device)
        self.params: list[Tensor] = []
        self.before: list[Tensor] = []  # views of B shaped like the parameters
        self.step = torch.zeros((), dtype=torch.int64, device=device)  # the host loop's step, for the draws
        for gi, (g, spec) in enumerate(zip(groups, self.layout.groups)):
            self.S[gi] = g.scales[0].reshape(())
            s = self.S[gi]
            views = []
            for p, (off, numel, _) in zip(g.params, spec["params"]):
                self.B[off:off + numel].copy_(p.detach().reshape(-1))
                views.append(self.B[off:off + numel].view(p.shape))
            if master:
                masters = []
                for m, (off, numel, _) in zip(g.master, spec["params"]):
                    self.M[off:off + numel].copy_(m.reshape(-1))
                    masters.append(self.M[off:off + numel].view(m.shape))
                g.master, g.before = masters, views
            g.scales = [s] * len(g.params)
            if g.fixed is not None:
                g.fixed = [s] * len(g.params)
            self.params += g.params
            self.before += views

    @torch.no_grad()
    def update(self, step: Any, status: Tensor | None) -> None:
        """One step: ``step`` a Python int (the host loop, after a kept update; ``status`` ``None``)
        or the 0-d int64 device counter (the device step: ``status`` its 0-d int32 verdict, and the
        counter moves on past it unless the step did not run)."""
        from ..kernels.requant_groups import requant_groups_

        if status is not None or isinstance(step, Tensor):
            counter, advance = step, status is not None
        else:
            self.step.fill_(step if step < 2 ** 63 else step - 2 ** 64)  # 2^64 - 1 as int64: the same 64 bits
            counter, advance = self.step, False
        torch.cat([p.detach().reshape(-1) for p in self.params], out=self.P)
        requant_groups_(self.layout, self.M, self.P, self.B, self.S, counter, status, self.stochastic, advance, self.backend)
        torch._foreach_copy_(self.params, self.before)

    @torch.no_grad()
    def load_scale(self, row: int, scale: Tensor) -> None:
        """A checkpoint's scale of group ``row``."""
        self.S[row].copy_(scale.reshape(()))
