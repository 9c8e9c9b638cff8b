"""``LowBitWeights``: the weight transform the engine wraps around every method's step.

The model's parameters always hold the dtype's values (codes · scale, as float32), so the method's
forward and backward run on exactly what a Loom file of that dtype serves. Around each update:

1. before the step the parameter holds ``q``; the method updates it in place (any rule, any
   optimizer) to ``p``;
2. with ``master="fp32"`` the float32 master takes the update, ``master += p − q`` (the step as the
   method wrote it), and the parameter becomes ``q' = Q(master)``; with ``master="none"`` it becomes
   ``q' = Q(p)``;
3. ``Q`` encodes and decodes (``codec.py``): round-to-nearest, or stochastic rounding with draws keyed
   by ``(seed, step, parameter index)`` (``rng.py``), so every rank draws the same bits and a
   resumed run the bits it would have drawn; ``loom_compat`` uses Loom's own encoders and scale
   instead (``loom_compat.py``).

A step the engine's guard undid (non-finite loss, gradients or weights) leaves the master, the
parameters and the scales as they were. On CUDA the grid-dtype groups with one scale per layer take
one fused update for all of them (``lowbit/fused.py``: four launches a step, the device step's
status and step counter read on the device); the others, and every group on CPU, the torch ops
below, which compute the same. A **group** is one module's own parameters (one Loom layer): they share
one dtype and, with ``scale="per_tensor"`` or ``"fixed"``, one scale, which is what a Loom file
holds per layer (``to_loom_json`` reads it from the module's ``loom_lowbit`` attribute).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .codec import decode, dtype_info, encode, scale_for, warm_tables
from .config import NO_MASTER_DTYPES, LowBitConfig
from .loom_compat import fp4_table, loom_clamp_master_, loom_encode, loom_scale
from .rng import stream_key, uniform

__all__ = ["LowBitWeights", "resolve_weight_dtypes", "check_weight_dtype"]

INIT_STEP = (1 << 64) - 1  # the key of the first quantisation, before step 0
_NOT_RUN = 3  # the device step guard's status of a step that did not run (kernels/step_guard.py)


def check_weight_dtype(weight_dtype: Any, cfg: LowBitConfig, where: str = "TrainingConfig") -> None:
    """``ValueError`` / ``TypeError`` unless ``weight_dtype`` is ``None``, a Loom dtype name, or a
    dict ``{module name: dtype name or None}``, and every dtype can train with ``cfg.master``."""
    if weight_dtype is None:
        return
    if isinstance(weight_dtype, str):
        names = {"*": weight_dtype}
    elif isinstance(weight_dtype, Mapping):
        names = dict(weight_dtype)
        if not names:
            raise ValueError(f"{where}: weight_dtype as a dict must name at least one layer, got {{}}")
        for k in names:
            if not isinstance(k, str):
                raise TypeError(f"{where}: weight_dtype's keys must be module names (str), got {k!r}")
    else:
        raise TypeError(
            f"{where}: weight_dtype must be None, a Loom dtype name (e.g. 'int8') or a dict "
            f"{{module name: dtype}}, got {type(weight_dtype).__name__}"
        )
    for key, name in names.items():
        if name is None:
            continue
        info = dtype_info(name, f"{where}: weight_dtype[{key!r}]" if key != "*" else f"{where}: weight_dtype")
        if cfg.master == "none" and info.name not in NO_MASTER_DTYPES:
            raise ValueError(
                f"{where}: weight_dtype {name!r} cannot train with master='none': below 8 bits an update "
                "smaller than one step of the grid is lost (or, stochastically rounded, drowns in its noise); "
                f"use master='fp32' (the default), or one of {', '.join(NO_MASTER_DTYPES)}"
            )


def _groups(model: nn.Module) -> list[tuple[str, nn.Module, list[tuple[int, Tensor]]]]:
    """``(name, module, [(parameter index, parameter)])`` of every module that owns trainable
    parameters itself, indices in ``model.parameters()`` order."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    out = []
    for name, mod in model.named_modules():
        own = [(index[id(p)], p) for p in mod.parameters(recurse=False) if p.requires_grad and id(p) in index]
        if own:
            out.append((name, mod, own))
    return out


def _matches(key: str, name: str) -> int:
    """How specifically ``key`` names module ``name`` (-1: not at all): the module itself or a
    container above it; ``"*"`` matches everything, least specifically; a Network's ``layers.``
    prefix may be left out."""
    if key == "*":
        return 0
    for n in (name, name[len("layers."):] if name.startswith("layers.") else None):
        if n is not None and (n == key or n.startswith(key + ".")):
            return 1 + key.count(".") + 1
    return -1


def resolve_weight_dtypes(model: nn.Module, weight_dtype: Any) -> list[tuple[str, nn.Module, list[tuple[int, Tensor]], str]]:
    """The groups that train in a Loom dtype: ``(name, module, [(index, parameter)], dtype)``.
    A dict key that names no module is a ``ValueError`` listing the names there are."""
    groups = _groups(model)
    spec = {"*": weight_dtype} if isinstance(weight_dtype, str) else dict(weight_dtype)
    names = [n for n, _, _ in groups]
    for key in spec:
        if key != "*" and not any(_matches(key, n) >= 0 for n in names):
            raise ValueError(f"TrainingConfig: weight_dtype names layer {key!r}, which owns no trainable parameter; "
                             f"layers with parameters: {names}")
    out = []
    for name, mod, params in groups:
        best, dtype = -1, None
        for key, value in spec.items():
            m = _matches(key, name)
            if m > best:
                best, dtype = m, value
        if dtype is None:
            continue
        info = dtype_info(dtype)
        for i, p in params:
            if p.dtype != torch.float32:
                raise ValueError(f"TrainingConfig: weight_dtype needs float32 parameters (the master and the "
                                 f"dtype's values are float32), got {p.dtype} for layer {name!r}")
        out.append((name, mod, params, info.name))
    return out


@dataclass
class _Group:
    name: str
    module: nn.Module
    dtype: str
    index: list[int]
    params: list[Tensor]
    master: list[Tensor] | None = None
    before: list[Tensor] | None = None  # q: what the parameters held before the step
    scales: list[Tensor] = field(default_factory=list)  # the scale of each parameter now
    fixed: list[Tensor] | None = None  # scale="fixed" / loom_compat: set once
    fused: int | None = None  # its row in the FusedGrid (lowbit/fused.py), when it takes the fused update


class LowBitWeights:
    """The engine's low-bit weight transform for ``model`` (see the module docstring).

    Args:
        model: the network (its parameters are changed in place).
        weight_dtype: a Loom dtype name or ``{module name: dtype or None}``.
        config: a ``LowBitConfig``.
        seed: the stochastic-rounding key (``config.seed`` when set).
    """

    def __init__(self, model: nn.Module, weight_dtype: Any, config: LowBitConfig, seed: int = 0) -> None:
        check_weight_dtype(weight_dtype, config)
        self.config = config
        self.seed = int(config.seed if config.seed is not None else seed)
        self.groups = [_Group(n, m, d, [i for i, _ in ps], [p for _, p in ps]) for n, m, ps, d in resolve_weight_dtypes(model, weight_dtype)]
        self.started = False
        self.fused: Any = None  # the FusedGrid of the grid groups on CUDA (lowbit/fused.py), else None

    # ------------------------------------------------------------------------------ quantisation
    def _scales(self, g: _Group, src: list[Tensor]) -> list[Tensor]:
        if g.fixed is not None:
            return g.fixed
        mode = self.config.scale
        if mode == "per_row":
            return [scale_for(t, g.dtype, dim=0) if t.dim() >= 2 else scale_for(t, g.dtype) for t in src]
        s = scale_for(torch.cat([t.detach().reshape(-1) for t in src]), g.dtype)  # one per Loom layer
        return [s] * len(src)

    @torch.no_grad()
    def _requantize(self, g: _Group, src: list[Tensor], step: Any, ok: Tensor | None = None) -> None:
        """Parameters of ``g`` := Q(src) (where ``ok``, a 0-d bool device tensor, holds; everywhere when
        it is ``None``); remembers the scales and what the parameters hold."""
        cfg = self.config
        info = dtype_info(g.dtype)
        if cfg.loom_compat:
            if g.fixed is None:
                g.fixed = [loom_scale(torch.cat([t.reshape(-1) for t in src]), g.dtype)] * len(src)
            if not (isinstance(step, int) and step == INIT_STEP):
                for t, s in zip(src, g.fixed):
                    loom_clamp_master_(t, g.dtype, s)
            qs = [decode(loom_encode(t, g.dtype, s), g.dtype, s) for t, s in zip(src, g.fixed)]
            scales = g.fixed
        else:
            if cfg.scale == "fixed" and g.fixed is None:
                g.fixed = self._scales(g, src)
            scales = self._scales(g, src)
            if info.kind == "grid" and all(sc.dim() == 0 for sc in scales) and all(p.is_contiguous() for p in g.params):
                self._requantize_grid(g, src, scales, step, ok)
                return
            qs = []
            for i, t, s in zip(g.index, src, scales):
                u = uniform(t.numel(), self.seed, step, i, t.device) if cfg.effective_rounding == "stochastic" and info.kind != "identity" else None
                qs.append(decode(encode(t, g.dtype, s, cfg.effective_rounding, u), g.dtype, s).reshape(t.shape))
        if ok is not None:  # device step: a step the guard refused keeps its weights and scales
            qs = [torch.where(ok, q, p) for q, p in zip(qs, g.params)]
            if g.scales:
                scales = [torch.where(ok, s, old) for s, old in zip(scales, g.scales)]
        for p, q in zip(g.params, qs):
            p.copy_(q)
        if g.master is not None:
            for b, p in zip(g.before, g.params):
                b.copy_(p)
        g.scales = list(scales)
        self._tag(g)

    def _requantize_grid(self, g: _Group, src: list[Tensor], scales: list[Tensor], step: Any, ok: Tensor | None) -> None:
        """The grid dtypes in one fused launch per parameter (``kernels/requant.py``: Triton on CUDA,
        its torch reference elsewhere; the same bits either way) for the groups ``FusedGrid`` does not
        take (32- and 64-bit grids; ``backend="reference"``) and, on CPU, all of them. The keys are computed
        only for stochastic rounding (in int64 torch ops: ~90 small launches per parameter on a
        device step counter)."""
        from ..kernels.requant import requant_grid_

        info = dtype_info(g.dtype)
        stochastic = self.config.effective_rounding == "stochastic"
        if ok is not None and g.scales:
            scales = [torch.where(ok, sc, old) for sc, old in zip(scales, g.scales)]
        flag = ok if ok is not None else torch.ones((), dtype=torch.bool, device=g.params[0].device)
        befores = g.before if g.master is not None else [None] * len(g.params)
        zero = None if stochastic else torch.zeros((), dtype=torch.int64, device=flag.device)  # keys unused
        for i, t, p, b, sc in zip(g.index, src, g.params, befores, scales):
            key_a, key_b = stream_key(self.seed, step, i) if stochastic else (zero, zero)
            requant_grid_(t.detach().reshape(-1).contiguous(), p.data, b, sc, flag, key_a, key_b, info.lo, info.hi, stochastic)
        g.scales = list(scales)
        self._tag(g)

    def _tag(self, g: _Group) -> None:
        """What ``to_loom_json`` reads: the module's dtype and its one scale (``None`` per row)."""
        shared = self.config.scale != "per_row" or self.config.loom_compat or not dtype_info(g.dtype).scaled
        g.module.loom_lowbit = {"dtype": g.dtype, "scale": g.scales[0] if shared else None}

    @torch.no_grad()
    def start(self, backend: str | None = None) -> None:
        """Once, when training starts: the master copies the weights, which become the dtype's values.
        On CUDA (or ``backend="triton"``) the grid groups then take the fused update (``lowbit/fused.py``);
        ``backend="reference"`` keeps the torch ops."""
        if self.started:  # a second fit() of the same trainer keeps its master
            for g in self.groups:
                dev = g.params[0].device
                if g.master is not None and g.master[0].device != dev:
                    g.master = [m.to(dev) for m in g.master]
                    g.before = [b.to(dev) for b in g.before]
                g.scales = [s.to(dev) for s in g.scales]
                g.fixed = [s.to(dev) for s in g.fixed] if g.fixed is not None else None
            self._fuse(backend)
            return
        for g in self.groups:
            warm_tables(g.dtype, g.params[0].device)  # no host-to-device copy inside a captured step
            fp4_table(g.params[0].device)
            if self.config.master == "fp32":
                g.master = [p.detach().clone() for p in g.params]
                g.before = [torch.empty_like(p) for p in g.params]
            self._requantize(g, g.master if g.master is not None else list(g.params), INIT_STEP)
        self.started = True
        self._fuse(backend)

    def _fuse(self, backend: str | None) -> None:
        """Build the ``FusedGrid`` of the groups that can take it, where Triton runs (anew on a
        device change: its buffers and tables live on the parameters' device)."""
        from ..kernels._triton import use_triton
        from .fused import FusedGrid, fusable

        if self.fused is not None and self.fused.device == self.groups[0].params[0].device and self.fused.backend == backend:
            return
        for g in self.groups:
            if g.fused is not None:  # the flat buffers' views become tensors of their own again
                g.master = [m.clone() for m in g.master] if g.master is not None else None
                g.before = [b.clone() for b in g.before] if g.before is not None else None
                g.scales = [s.clone() for s in g.scales]
                g.fixed = [s.clone() for s in g.fixed] if g.fixed is not None else None
                g.fused = None
        self.fused = None
        if not self.groups or not use_triton(self.groups[0].params[0], backend, (torch.float32,)):
            return
        dev = self.groups[0].params[0].device
        chosen = [g for g in self.groups if fusable(g, self.config) and g.params[0].device == dev]
        if chosen:
            for i, g in enumerate(chosen):
                g.fused = i
            self.fused = FusedGrid(chosen, self.seed, self.config.effective_rounding == "stochastic", backend)
        for g in self.groups:
            self._tag(g)  # the scale tensor to_loom_json reads is now the fused buffer's (or its own again)

    @torch.no_grad()
    def after_update(self, step: Any, ok: Tensor | None = None) -> None:
        """After an update the engine kept (host loop: called only then), or after every device step
        with ``ok`` its 0-d bool verdict (device ops only, no host read: graph-capturable): the master
        takes the update, the weights are requantised with the draws of ``step`` (a Python int, or a
        0-d int64 device tensor counting the steps)."""
        if self.fused is not None:
            if ok is not None:
                raise RuntimeError("LowBitWeights.after_update: a device step with fused groups calls device_update")
            self.fused.update(step, None)
        for g in self.groups:
            if g.fused is None:
                self._update_group(g, step, ok)

    def _update_group(self, g: _Group, step: Any, ok: Tensor | None) -> None:
        """``after_update`` for one group, in torch ops."""
        if g.master is not None:
            for m, b, p in zip(g.master, g.before, g.params):
                delta = p - b
                m.add_(delta if ok is None else torch.where(ok, delta, torch.zeros_like(delta)))
            self._requantize(g, g.master, step, ok)
        else:
            self._requantize(g, [p.detach().clone() for p in g.params], step, ok)

    @torch.no_grad()
    def device_update(self, counter: Tensor, status: Tensor) -> None:
        """After every device step (device ops only, graph-capturable): ``status`` the step guard's
        0-d int32 verdict (0: the update was kept; 3: the step did not run), ``counter`` the 0-d int64
        device count of the steps that ran, which keys the draws and moves on by one unless status
        is 3. The fused groups take one ``FusedGrid`` update, the others ``after_update``'s torch ops."""
        if any(g.fused is None for g in self.groups):
            ok = status == 0
            for g in self.groups:
                if g.fused is None:
                    self._update_group(g, counter, ok)
        if self.fused is not None:
            self.fused.update(counter, status)  # the counter moves on inside
        else:
            counter.add_((status != _NOT_RUN).to(torch.int64))

    # ------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The master weights and the scales set once (the parameters are the model's state)."""
        return {
            "master": [[m.clone() for m in g.master] if g.master is not None else [] for g in self.groups],
            "fixed": [[s.clone() for s in g.fixed] if g.fixed is not None else [] for g in self.groups],
            "scales": [[s.clone() for s in g.scales] for g in self.groups],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for g, master, fixed, scales in zip(self.groups, state["master"], state["fixed"], state["scales"]):
            if g.master is not None:
                for m, v in zip(g.master, master):
                    m.copy_(v)
                for b, p in zip(g.before, g.params):
                    b.copy_(p)
            if g.fused is not None:  # views of the fused buffers: written in place
                self.fused.load_scale(g.fused, (fixed or scales)[0])
            else:
                if fixed:
                    g.fixed = [s.to(g.params[0].device) for s in fixed]
                g.scales = [s.to(g.params[0].device) for s in scales]
            self._tag(g)

    def masters(self) -> dict[str, list[Tensor]]:
        """``{module name: its float32 master tensors}`` (empty with ``master="none"``)."""
        return {g.name: list(g.master) for g in self.groups if g.master is not None}
