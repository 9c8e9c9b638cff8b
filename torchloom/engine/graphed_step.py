"""``make_graphed_step``: the device-side training step of ``train()`` for custom loops.

    step = torchloom.make_graphed_step(net, x0, y0, loss_type="mse", optimizer="adamw", learning_rate=1e-3)
    for x, y in loader:            # same shapes as x0, y0
        loss = step(x, y)          # 0-d device tensor, no host sync

Each call runs one complete step — forward, loss and output gradient (fused), the hand-written
backward, the NaN/Inf guard and clip decided on the device, the fused optimizer update — exactly the
step ``train()`` runs on CUDA (the backprop method's ``device_step`` under the engine's ``CudaRunner``). On CUDA the first call runs it
eagerly (compiling kernels, creating optimizer state); the second captures it in a CUDA graph, which
every later call replays after copying its inputs into the graph's static buffers. On a CPU model
(or with ``cuda_graph=False``) every call runs the same step eagerly.

A step whose loss or gradients are NaN/Inf changes nothing (weights and optimizer state stay as they
were); ``step.last_status`` says what happened (0 ok, 1 NaN/Inf loss, 2 NaN/Inf gradient) and the
returned loss is then 0. The returned tensor is overwritten by the next call: ``clone()`` or
``item()`` it to keep it.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..layers.base import Layer, host_checks
from ..layers.network import Network
from ..optim.optimizers import FusedOptimizer, flatten_optimizer_
from .config import TrainingConfig, as_network
from .cuda_path import CudaRunner, capturing
from .loop import Trainer

__all__ = ["GraphedStep", "make_graphed_step"]


class GraphedStep:
    """A training step for custom loops; see ``make_graphed_step``."""

    def __init__(self, trainer: Trainer, example_x: Tensor, example_y: Tensor, cuda_graph: bool | None) -> None:
        self.trainer = trainer
        self.runner = trainer.runner or CudaRunner(trainer)  # the CPU case: the same step, run eagerly
        x, y = trainer.convert_batch(example_x, example_y, 0)
        self.x, self.y = x.clone(), y.clone()  # the static inputs every call copies into
        self.runner._prepare_arrays(1)
        self.use_graph = trainer.device.type == "cuda" and cuda_graph is not False
        self.graph: torch.cuda.CUDAGraph | None = None
        self.calls = 0

    @property
    def last_status(self) -> Tensor:
        """The last step's status as a 0-d int32 device tensor: 0 ok, 1 NaN/Inf loss, 2 NaN/Inf
        gradient (the update was skipped in both)."""
        return self.runner.step_status[0, 0]

    @torch.no_grad()
    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        """One training step on ``x``, ``y`` (the shapes of the example batch); returns the loss (0-d
        device tensor, 0 when the step was skipped), without a host sync."""
        for name, got, want in (("x", x, self.x), ("y", y, self.y)):
            if not isinstance(got, Tensor) or got.shape != want.shape:
                shape = list(got.shape) if isinstance(got, Tensor) else type(got).__name__
                raise ValueError(f"GraphedStep: {name} must have the example's shape {list(want.shape)}, got {shape}")
        self.x.copy_(x)
        self.y.copy_(y)
        if self.graph is not None:
            self.graph.replay()
        elif self.use_graph and self.calls >= 1:
            self._capture()
            self.graph.replay()
        else:
            self._step()
            if self.calls == 0:  # optimizer state created by the first step joins the flat layout
                flatten_optimizer_(self.trainer.optimizer)
        self.calls += 1
        return self.runner.step_loss[0, 0]

    def close(self) -> None:
        """Drop the captured graph (a later call captures it again). Under a process group the step
        all-reduces inside the graph, and a graph holding NCCL collectives keeps
        ``destroy_process_group`` (and the process's exit) waiting: call ``close()`` (or drop the step)
        before it."""
        self.graph = None

    def _step(self) -> None:
        self.runner.dead.zero_()  # every call stands alone: no "rest of the epoch" to abandon
        self.trainer.device_step(self.x, self.y, 0, self.runner)

    def _capture(self) -> None:
        runner, dev = self.runner, self.trainer.device
        with host_checks(False):
            runner.dead.fill_(1)  # masked warm-up: compiles what the graph uses, updates nothing
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")  # a host read would break the capture: find it now
            try:
                self.trainer.device_step(self.x, self.y, 0, runner)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph):
                self._step()
        self.graph = graph


def make_graphed_step(
    model: Network | Layer,
    example_input: Tensor,
    example_target: Tensor,
    *,
    loss_type: str = "mse",
    optimizer: str | Optimizer = "sgd",
    learning_rate: float | None = None,
    gradient_clip: float = 0.0,
    clip_mode: str = "norm",
    cuda_graph: bool | None = None,
) -> GraphedStep:
    """A callable ``step(x, y) -> loss`` that trains ``model`` one batch per call (module docstring).

    Args:
        model: a torchloom ``Network`` or layer, on the device to train on (CUDA for graphs).
        example_input, example_target: a batch of the shapes every call will use (``[batch, ...]``;
            targets of the output's shape, or class labels
            for ``"cross_entropy"``); validated like ``train()``'s batches.
        loss_type, optimizer, learning_rate, gradient_clip, clip_mode: as ``TrainingConfig``; the
            optimizer must be one of torchloom's (a name, or an instance: AdamW with ``capturable=True``
            on CUDA), whose update obeys the device-side guard. ``learning_rate=None`` (default):
            0.01 for an optimizer given by name, an instance's own lr (a number given beside an
            instance must equal its lr).
        cuda_graph: None (default) or True: capture on CUDA; False: run every call eagerly.

    Raises ``ValueError``/``TypeError`` for bad settings or an example that does not fit the model.
    """
    net = as_network(model)
    first = next(net.parameters(), None)
    device = first.device if first is not None else None
    config = TrainingConfig(
        epochs=1, learning_rate=learning_rate, loss_type=loss_type, optimizer=optimizer,
        gradient_clip=gradient_clip, clip_mode=clip_mode, verbose=False, device=device, cuda_graph=cuda_graph,
    )
    trainer = Trainer(net, config)  # TrainingConfig's default method: backprop
    # on CUDA the update must obey the guard without a host read; on the CPU any of ours will do
    ok = trainer.device_ready() if trainer.device.type == "cuda" else isinstance(trainer.optimizer, FusedOptimizer)
    if not ok:
        raise TypeError(
            "make_graphed_step needs one of torchloom's optimizers (torchloom.optim.SGD, AdamW with "
            f"capturable=True, RMSprop) or their names, got {type(trainer.optimizer).__name__}"
        )
    if cuda_graph and trainer.device.type != "cuda":
        raise ValueError(f"make_graphed_step(cuda_graph=True) needs a model on CUDA, it is on {trainer.device}")
    return GraphedStep(trainer, example_input, example_target, cuda_graph)
