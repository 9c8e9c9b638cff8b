"""The feedback rules on the engine's device path: their fused backward (``kernels/feedback.py``,
through Triton's interpreter on CPU tensors; native on CUDA) trains as their host step (the plain
PyTorch backward), and alignment diagnostics on the device path (the runner's probe) log the host
path's numbers. CUDA-only tests (graph capture) skip without a GPU."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from torchloom import Dense, DFAConfig, Network, SignSymmetryConfig, TrainingConfig, train
from torchloom.engine.cuda_path import CudaRunner
from torchloom.engine.train import make_trainer
from torchloom.kernels._triton import triton_available

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
RULES = {
    "dfa": DFAConfig(seed=5),
    "sign_symmetry": SignSymmetryConfig(),
    "sign_symmetry_unit": SignSymmetryConfig(scale="unit"),
    "sign_symmetry_number": SignSymmetryConfig(scale=0.3),
    "feedback_alignment": "feedback_alignment",
    "fast_proxy": "fast_proxy",
}


def _net(seed=0, device=DEVICE):
    torch.manual_seed(seed)
    return Network(Dense(6, 9, "tanh"), Dense(9, 4, "relu"), Dense(4, 3)).to(device)


def _data(n=3, bs=5, device=DEVICE):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(bs, 6, generator=g).to(device), torch.randint(0, 3, (bs,), generator=g).to(device)) for _ in range(n)]


def _cfg(rule, **kw):
    return TrainingConfig(**{"method": copy.deepcopy(RULES[rule]), "loss_type": "cross_entropy", "epochs": 2, "verbose": 0,
                             "optimizer": "momentum", "learning_rate": 0.2, **kw})


@pytest.mark.skipif(not triton_available(), reason="the fused backward is a Triton kernel")
@pytest.mark.parametrize("rule", list(RULES))
def test_fused_device_step_equals_the_host_step(rule, monkeypatch):
    from torchloom.kernels import feedback

    launches = []
    real = feedback._launch
    monkeypatch.setattr(feedback, "_launch", lambda *a: launches.append(1) or real(*a))
    data = _data()
    host = _net()
    rh = train(host, data, _cfg(rule, cuda_graph=False))
    launches.clear()
    trainer = make_trainer(_net(), _cfg(rule))
    trainer.kernel_backend = "triton" if DEVICE == "cpu" else None
    trainer._runner = CudaRunner(trainer)  # the device step, eager, on any device
    rd = trainer.fit(data, 2)
    # DFA: two launches a step (e [B_1|B_2], then the three layers' dW/db); sign symmetry: one for each
    # layer above the first; the others keep the layers' backward
    per_step = {"dfa": 2, "feedback_alignment": 0, "fast_proxy": 0}.get(rule, 2)
    assert len(launches) == per_step * 6
    np.testing.assert_allclose(rd.loss_history, rh.loss_history, rtol=1e-5)
    for p, q in zip(trainer.model.parameters(), host.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
