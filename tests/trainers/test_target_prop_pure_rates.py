"""Pure-mode TargetProp's documented setting for one rate at every batch size (docs/target-prop.md, "Rates
that work"): a rate annealed once per epoch (``cosine_annealing(lr, 0, epochs)``,
``scheduler_interval="epoch"``) and ``gradient_clip`` on the averaged step, through ``train()``,
against the rule written out here in float64 torch (difference targets, the delta rule, link budgets,
gate, depth factor, momentum, the global-norm clip and the cosine), independently of torchloom."""

from __future__ import annotations

import math

import pytest
import torch

from torchloom import Dense, Network, TargetPropConfig, TrainingConfig, train
from torchloom.schedules import cosine_annealing

F64 = torch.float64


def _net() -> Network:
    torch.manual_seed(5)
    return Network(Dense(6, 8, "relu", dtype=F64), Dense(8, 7, "relu", dtype=F64), Dense(7, 4, dtype=F64))


def _batches(n: int = 4, rows: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(rows, 6, generator=g, dtype=F64), torch.randint(0, 4, (rows,), generator=g)) for _ in range(n)]


def _reference(params, batches, epochs, lr0, clip, *, mu=0.9, factor=1.1, gate=0.2):
    """The rule of target_prop_rules.py's docstring for a ReLU MLP on cross-entropy, step by step.
    Returns the final parameters and, per step, whether the clip scaled the step."""
    params = [[w.clone(), b.clone()] for w, b in params]
    vel = [[torch.zeros_like(w), torch.zeros_like(b)] for w, b in params]
    budgets = [0.0] * len(params)
    clipped = []
    for epoch in range(epochs):
        lr = 0.0 + (lr0 - 0.0) * (1 + math.cos(math.pi * epoch / epochs)) / 2  # cosine_annealing(lr0, 0, epochs)
        for x, labels in batches:
            acts = [x]
            for k, (w, b) in enumerate(params):
                z = acts[-1] @ w.T + b
                acts.append(z if k == len(params) - 1 else z.clamp_min(0.0))
            y = acts[-1]
            onehot = torch.nn.functional.one_hot(labels, y.shape[1]).to(F64)
            targets = {len(params): y + onehot - torch.softmax(y, dim=1)}
            directions = [None] * len(params)
            for i in range(len(params) - 1, -1, -1):
                w = params[i][0]
                gap = targets[i + 1] - acts[i + 1]
                directions[i] = [gap.T @ acts[i], gap.sum(0)]  # delta rule, no f'
                if i > 0:  # difference target: a_i + Σ_o W[o, j]·gap[o] / Σ_o |W[o, j]|
                    den = w.abs().sum(0)
                    est = torch.where(den > 0.01, (gap @ w) / torch.where(den > 0.01, den, 1.0), 0.0)
                    targets[i] = acts[i] + est
            for i in range(len(params)):
                f, t = acts[i + 1].reshape(-1), targets[i + 1].reshape(-1)
                if f.norm() > 0 and t.norm() > 0:
                    budgets[i] = min(1.0, max(0.0, (float(f @ t / (f.norm() * t.norm())) + 1) / 2))
            rows = x.shape[0]
            averaged = [d / rows for ds in directions for d in ds]
            norm = float(torch.sqrt(sum((d**2).sum() for d in averaged)))
            scale = min(1.0, clip / norm)
            clipped.append(scale < 1.0)
            for i in range(len(params)):
                if budgets[i] < gate:
                    continue
                rate = lr * (0.5 + 0.5 * budgets[i]) * factor**i
                for k in range(2):
                    vel[i][k] = mu * vel[i][k] + (1 - mu) * rate * scale * directions[i][k] / rows
                    params[i][k] = params[i][k] + vel[i][k]
    return params, clipped


def _device_path(net, batches, cfg):
    """The engine's device runner on a CPU trainer (the device step, every decision in tensors)."""
    from torchloom.engine.cuda_path import CudaRunner
    from torchloom.engine.train import make_trainer

    trainer = make_trainer(net, cfg)
    trainer._runner = CudaRunner(trainer)
    return trainer.fit(batches, cfg.epochs)


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("clip", [1.5, 0.0], ids=["clipped", "no-clip"])
def test_pure_mode_with_the_annealed_rate_and_clip_is_the_rule(clip, path):
    net, batches, epochs, lr0 = _net(), _batches(), 3, 0.5
    start = [[layer.weight.detach().clone(), layer.bias.detach().clone()] for layer in net.layers]
    cfg = TrainingConfig(
        method=TargetPropConfig(mode="pure", learning_rate=lr0), loss_type="cross_entropy", epochs=epochs, verbose=0,
        scheduler=cosine_annealing(lr0, 0.0, epochs), scheduler_interval="epoch", gradient_clip=clip,
    )
    result = train(net, batches, cfg) if path == "host" else _device_path(net, batches, cfg)
    expected, clipped = _reference(start, batches, epochs, lr0, clip if clip > 0 else math.inf)
    for layer, (w, b) in zip(net.layers, expected):
        torch.testing.assert_close(layer.weight.detach(), w, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(layer.bias.detach(), b, rtol=1e-10, atol=1e-12)
    assert result.skipped_batches == 0
    # the test sees both parts of the setting: the clip scales some steps and not others, and the
    # weights moved (an annealed rate of 0 or a clip of everything would not)
    if clip > 0:
        assert any(clipped) and not all(clipped)
    else:
        assert not any(clipped)
    assert any(not torch.equal(layer.weight.detach(), w0) for layer, (w0, _) in zip(net.layers, start))
