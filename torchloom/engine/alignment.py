"""Alignment diagnostics (``TrainingConfig(alignment_every=N)``): how far a method's updates point from
the true backprop gradient, per layer.

Every ``N`` steps (global steps ``0, N, 2N, …``), before the step runs, the probe computes the exact
gradient ``∇`` of the training loss on the step's batch at the current weights (the layers'
hand-written backward, a separate no-grad pass; data-parallel: averaged over the ranks, the global
batch's). It compares ``∇`` with the method's **update direction** ``d``:

* a method with ``update_direction`` (backprop and the feedback rules: feedback alignment, DFA, sign
  symmetry, FastProxy): the gradient the rule gives on the same batch, before the optimizer;
* any other method (TargetProp, Tweening, your own ``Method``): the change its step applies,
  ``d = θ_before − θ_after`` (a descent direction), measured when the step counted.

For each layer with trainable parameters (all of them flattened together), the angle
``arccos(⟨d, ∇⟩ / (‖d‖‖∇‖))`` in degrees: 0 = backprop's direction, 90 = orthogonal (no first-order
progress), above 90 = uphill. A layer whose ``d`` or ``∇`` is zero has no angle at that step; so has
a layer whose rule direction is zero up to rounding: its gain ``‖d‖/‖∇‖`` at most ``NOISE_GAIN``
(2⁻¹³) times that of the nearest layer above with a direction. (Sign symmetry under softmax
cross-entropy sends back exactly zero through a unit whose outgoing weights share one sign; what is
left is float32 rounding, whose direction depends on the order of the sums, host, Triton and cuBLAS
each their own: issue 35.) The epoch log gets ``alignment_bp/<i>`` (``i``: the layer's index in the
network) = the mean over the epoch's measured steps at which layer ``i`` has an angle (NaN when
none), hence ``History``, ``CSVLogger``, ``TensorBoardLogger`` and the epoch line at verbose 2. The
angles stay device tensors until the epoch's end (one host read per epoch).

The probe's forwards run under a forked random-number state and the model's buffers (a BatchNorm's
running statistics) are put back after them, so a run with alignment diagnostics trains exactly as
one without (shuffling, dropout, running statistics).

On the CUDA device path (``cuda_path.py``) the same measurement is device ops only: ``measure``
before the step, ``fold`` after it, which adds the angles into device buffers (``dev_sums``,
``dev_defined``, ``dev_count``) when the step's status (a device tensor) says it counted; nothing is read on the host
until ``epoch_logs``, once per epoch. The runner replays the measured steps through a captured
single-step graph that holds the probe (unmeasured steps keep their graphs), so steps stay captured.
Inside a captured graph the CUDA random-number state is not forked (a capture cannot read it): a
model with random layers (Dropout) then draws the probe's randomness from the step's generator, and
its masks differ from an unmeasured run's; everything else trains as without diagnostics.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .losses import loss_and_grad

__all__ = ["AlignmentProbe", "angle_degrees"]


def angle_degrees(a: Tensor, b: Tensor) -> Tensor:
    """The angle between two flat vectors in degrees, a 0-d float64 tensor (NaN when either is 0)."""
    a, b = a.double(), b.double()
    cos = torch.dot(a, b) / (a.norm() * b.norm())
    return torch.rad2deg(torch.acos(cos.clamp(-1.0, 1.0)))


NOISE_GAIN = 2.0**-13
"""A layer whose gain (``‖d‖ / ‖∇‖``) is at most this times the gain of the nearest layer above it
that carries a direction has a direction that is zero up to rounding (see ``_rounding_noise``)."""


def _rounding_noise(gains: Tensor) -> Tensor:
    """Which layers' directions are zero up to rounding, from each layer's gain ``‖d‖ / ‖∇‖``
    (``[layers]``, network order): a gain at most ``NOISE_GAIN`` times that of the nearest layer
    above with a direction (the top layer: none above). A rule's direction can cancel exactly (sign
    symmetry under softmax cross-entropy: a unit whose outgoing weights all have one sign sends back
    ``s · Σ_c ∂loss/∂z_c = 0``), and what is left is float32 rounding (about 1e-7 of a gain), whose
    direction depends on the order of the sums (host, Triton and cuBLAS differ): its angle is no
    measurement. A legitimate gain drops by the rule's feedback scale per layer at most (0.1 for
    feedback alignment's default), far above ``NOISE_GAIN``: a rule configured with a feedback scale
    near ``NOISE_GAIN`` (1e-4) would have its angles dropped as noise. A top layer without a finite,
    positive gain is no reference (the layers below are then judged by the next real one). Device
    ops only (no host read)."""
    noise = torch.zeros_like(gains, dtype=torch.bool)
    top = gains[-1]
    ref = torch.where(torch.isfinite(top) & (top > 0), top, torch.full_like(top, math.nan))  # NaN: compares False
    for i in range(gains.numel() - 2, -1, -1):
        small = gains[i] <= NOISE_GAIN * ref
        noise[i] = small
        real = ~small & torch.isfinite(gains[i]) & (gains[i] > 0)  # (a zero ∇ or d: NaN anyway)
        ref = torch.where(real, gains[i], ref)
    return noise


class AlignmentProbe:
    """Measures, every ``every`` steps, the angle per layer between a trainer's method's update
    direction and the exact gradient (see the module docstring)."""

    def __init__(self, trainer: Any, every: int) -> None:
        self.trainer = trainer
        self.every = every
        model = trainer.model
        trainable = [p for p in model.parameters() if p.requires_grad]
        index = {id(p): k for k, p in enumerate(trainable)}
        # per layer with trainable parameters: (log key, positions among the trainable parameters)
        self.layers: list[tuple[str, list[int]]] = []
        for i, layer in enumerate(model.layers):
            pos = [index[id(p)] for p in layer.parameters() if id(p) in index]
            if pos:
                self.layers.append((f"alignment_bp/{i}", pos))
        self.trainable = trainable
        self.reset()

    def reset(self) -> None:
        self.sums: Tensor | None = None  # per layer: the sum of the defined angles and their number
        self.defined: Tensor | None = None
        self.count = 0
        self._pending: tuple[list[Tensor], list[Tensor] | None, list[Tensor] | None] | None = None
        if self.__dict__.get("dev_sums") is not None:  # in place: captured graphs hold these buffers
            self.dev_sums.zero_()
            self.dev_defined.zero_()
            self.dev_count.zero_()

    def device_buffers(self, device: torch.device) -> None:
        """The device path's accumulators (made once, before any capture): the sums of the counted
        steps' defined angles per layer (``dev_sums [layers]``, float64), their number per layer
        (``dev_defined [layers]``) and the number of counted steps (``dev_count``)."""
        if self.__dict__.get("dev_sums") is None:
            self.dev_sums = torch.zeros(len(self.layers), dtype=torch.float64, device=device)
            self.dev_defined = torch.zeros(len(self.layers), dtype=torch.float64, device=device)
            self.dev_count = torch.zeros((), dtype=torch.float64, device=device)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    @torch.no_grad()
    def exact_gradient(self, x: Tensor, y: Tensor) -> list[Tensor]:
        """The exact gradient of the training loss on ``(x, y)`` at the current weights, one per
        trainable parameter (the global batch's under data-parallel training)."""
        t = self.trainer
        model = t.model
        out, saved = model.forward_saved(x)
        _, grad = loss_and_grad(out, y, t.method.eval_loss_type(), validate=False)
        _, grads = model.backward_saved(grad, saved, needs_input_grad=False)
        keep = [p.requires_grad for p in model.parameters()]
        grads = [g for g, k in zip(grads, keep) if k] if len(grads) != len(self.trainable) else list(grads)
        return grads

    @torch.no_grad()
    def before(self, x: Tensor, y: Tensor) -> None:
        """Before the step on ``(x, y)``: the exact gradient and the method's direction (or a copy of
        the weights, to measure the applied change after the step)."""
        t = self.trainer
        capturing = t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        devices = [t.device] if t.device.type == "cuda" and not capturing else []
        buffers = [b.detach().clone() for b in t.model.buffers()]  # (a BatchNorm's running statistics)
        with torch.random.fork_rng(devices=devices):
            exact = self.exact_gradient(x, y)
            direction = t.method.update_direction(x, y)
        for b, saved in zip(t.model.buffers(), buffers):  # the probe's forwards leave no trace
            b.copy_(saved)
        if t.dist is not None:  # each rank holds a shard: the global batch's
            t.dist.all_reduce_(exact, "mean")
            if direction is not None:
                t.dist.all_reduce_(direction, "mean")
        weights = None if direction is not None else [p.detach().clone() for p in self.trainable]
        self._pending = (exact, direction, weights)

    @torch.no_grad()
    def after(self, counted: bool) -> None:
        """After the step: the angles, when it counted (an update refused by a guard measures nothing)."""
        pending, self._pending = self._pending, None
        if pending is None or not counted:
            return
        values = self._angles(pending)
        defined = ~torch.isnan(values)
        values = torch.where(defined, values, 0.0)
        self.sums = values if self.sums is None else self.sums + values
        self.defined = defined.double() if self.defined is None else self.defined + defined
        self.count += 1

    def _angles(self, pending: tuple[list[Tensor], list[Tensor] | None, list[Tensor] | None]) -> Tensor:
        """The angles per layer ``[layers]`` (float64, on the device) of a measurement after its step."""
        exact, direction, weights = pending
        rule = direction is not None  # a rule's gradient (update_direction), not an applied change
        if direction is None:
            direction = [w - p.detach() for w, p in zip(weights, self.trainable)]
        angles, gains = [], []
        for _, pos in self.layers:
            d = torch.cat([direction[k].reshape(-1) for k in pos])
            g = torch.cat([exact[k].reshape(-1) for k in pos]).to(d.device)
            angles.append(angle_degrees(d, g))
            if rule:
                gains.append(d.double().norm() / g.double().norm())
        angles = torch.stack(angles)
        if rule:
            angles = torch.where(_rounding_noise(torch.stack(gains)), math.nan, angles)
        return angles

    # ------------------------------------------------------------ the device path (cuda_path.py)
    def measure(self, x: Tensor, y: Tensor) -> None:
        """Before a device step on ``(x, y)``: ``before``'s measurement, device ops only (capturable)."""
        self.device_buffers(self.trainer.device)
        self.before(x, y)

    @torch.no_grad()
    def fold(self, status: Tensor) -> None:
        """After the device step ``measure`` preceded: when ``status`` (the step's 0-d device status) is
        0, its defined angles added into ``dev_sums`` (one into ``dev_defined`` for each) and one into
        ``dev_count``; nothing otherwise; no host read."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        ok = status == 0
        angles = self._angles(pending)
        defined = ok & ~torch.isnan(angles)
        self.dev_sums.add_(torch.where(defined, angles, 0.0))
        self.dev_defined.add_(defined)
        self.dev_count.add_(ok)

    def epoch_logs(self) -> dict[str, float]:
        """``{"alignment_bp/<i>": mean angle}`` over the epoch's measured steps at which layer ``i``'s
        angle is defined (NaN when none), then cleared for the next epoch (the epoch's one host read)."""
        n = len(self.layers)
        sums = self.sums.cpu() if self.sums is not None else torch.zeros(n, dtype=torch.float64)
        defined = self.defined.cpu() if self.defined is not None else torch.zeros(n, dtype=torch.float64)
        if self.__dict__.get("dev_sums") is not None:  # the device path's: one read
            host = torch.cat([self.dev_sums, self.dev_defined]).tolist()
            sums = sums + torch.tensor(host[:n], dtype=torch.float64)
            defined = defined + torch.tensor(host[n:], dtype=torch.float64)
        values = torch.where(defined > 0, sums / defined.clamp_min(1.0), math.nan).tolist()
        logs = {key: float(v) for (key, _), v in zip(self.layers, values)}
        self.reset()
        return logs
