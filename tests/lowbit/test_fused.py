"""The fused low-bit update (``lowbit/fused.py``, ``kernels/requant_groups.py``) in the engine: on the
CPU through Triton's interpreter (``kernel_backend="triton"``), the host loop and the device runner
against the torch path (``kernel_backend="reference"``), a refused step, an exact resume; on CUDA,
the graph-captured device step against the host loop."""

from __future__ import annotations

import pytest
import torch

from torchloom import Checkpoint, LowBitConfig, TrainingConfig
from torchloom.engine.cuda_path import CudaRunner
from torchloom.engine.loop import Trainer
from torchloom.kernels._triton import interpreter_enabled, triton_available

from .test_training import _data, _net, _on_grid

needs_interpreter = pytest.mark.skipif(not (triton_available() and interpreter_enabled()),
                                       reason="needs Triton's interpreter (TRITON_INTERPRET=1)")

CASES = [("int8", dict(rounding="stochastic")), ("int4", {}), ("ternary", dict(rounding="stochastic")),
         ("int8", dict(master="none"))]


def _fit(dtype, kw, backend, device_path, epochs=2, data=None, **extra):
    net = _net()
    cfg = TrainingConfig(epochs=epochs, verbose=0, weight_dtype=dtype, low_bit=LowBitConfig(**kw), loss_type="cross_entropy",
                         optimizer="momentum", learning_rate=0.1, seed=1, **extra)
    t = Trainer(net, cfg)
    t.kernel_backend = backend
    t._build_runner = lambda: None
    if device_path:
        t.setup()
        t._runner = CudaRunner(t)
    t.fit(data or _data(), epochs)
    return t, net


@needs_interpreter
@pytest.mark.parametrize("dtype,kw", CASES)
def test_fused_update_equals_the_torch_path(dtype, kw):
    """Host loop and device runner with the fused kernels, and the host loop in torch ops: the same
    masters, scales and weights (the method's device step itself differs from its host step by float
    rounding, hence the tolerance, as in test_training's device test)."""
    runs = []
    for backend, device_path in (("reference", False), ("triton", False), ("triton", True)):
        t, net = _fit(dtype, kw, backend, device_path)
        assert (t.lowbit.fused is not None) == (backend == "triton")
        if device_path:
            assert int(t._lowbit_step) == 6
        _on_grid(net)
        runs.append(([p.detach().clone() for p in net.parameters()], t.lowbit.state_dict()))
    (ref, ref_state), *fused = runs
    for params, state in fused:
        for a, b in zip(ref, params):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
        for key in ("master", "scales"):
            for a, b in zip(ref_state[key], state[key]):
                for x, y in zip(a, b):
                    torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-7)


@needs_interpreter
def test_a_refused_device_step_keeps_weights_master_and_scales():
    net = _net()
    t = Trainer(net, TrainingConfig(epochs=1, verbose=0, weight_dtype="int4", loss_type="cross_entropy", learning_rate=0.1))
    t.kernel_backend = "triton"
    t._build_runner = lambda: None
    t.setup()
    t._runner = CudaRunner(t)
    assert t.lowbit.fused is not None
    before = [p.detach().clone() for p in net.parameters()], t.lowbit.state_dict()
    bad = [(torch.full((16, 6), float("nan")), torch.zeros(16, dtype=torch.long))]
    with pytest.warns(Warning):
        t.fit(bad, 1)
    after = t.lowbit.state_dict()
    for a, b in zip(before[0], net.parameters()):
        assert torch.equal(a, b.detach())
    for key in ("master", "scales"):
        for a, b in zip(before[1][key], after[key]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert int(t._lowbit_step) == 1  # the step ran (and was refused): the next one draws new bits


@needs_interpreter
def test_resume_is_exact_with_the_fused_update(tmp_path):
    kw = dict(rounding="stochastic")
    _, full = _fit("int4", kw, "triton", False, epochs=4)
    path = tmp_path / "c.pt"
    _fit("int4", kw, "triton", False, epochs=2, observers=[Checkpoint(str(path))])
    net = _net(seed=9)
    t = Trainer(net, TrainingConfig(epochs=4, verbose=0, weight_dtype="int4", low_bit=LowBitConfig(**kw), loss_type="cross_entropy",
                                    optimizer="momentum", learning_rate=0.1, seed=1, resume_from=str(path)))
    t.kernel_backend = "triton"
    t.fit(_data(), 4)
    assert t.lowbit.fused is not None
    for a, b in zip(full.parameters(), net.parameters()):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,kw", CASES)
def test_cuda_device_step_equals_the_host_loop(dtype, kw):
    """On CUDA: the graph-captured device step (fused update inside the graph) and the host loop
    (the same fused kernels after each kept step): the same weights, masters and scales."""
    data = [(x.cuda(), y.cuda()) for x, y in _data()]
    runs = []
    for graphed in (False, True):
        net = _net().cuda()
        cfg = TrainingConfig(epochs=3, verbose=0, weight_dtype=dtype, low_bit=LowBitConfig(**kw), use_gpu=True,
                             loss_type="cross_entropy", optimizer="momentum", learning_rate=0.1, seed=1,
                             cuda_graph=True if graphed else None)
        t = Trainer(net, cfg)
        if not graphed:
            t._build_runner = lambda: None  # the host loop
        t.fit(data, 3)
        assert t.lowbit.fused is not None
        if graphed:
            assert t.runner.capture_count > 0 and int(t._lowbit_step) == 9
        _on_grid(net)
        runs.append(([p.detach().clone() for p in net.parameters()], t.lowbit.state_dict()))
    (host, host_state), (dev, dev_state) = runs
    for a, b in zip(host, dev):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    for key in ("master", "scales"):
        for a, b in zip(host_state[key], dev_state[key]):
            for x, y in zip(a, b):
                torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,kw", CASES)
def test_cuda_graphed_update_equals_the_host_update_bit_for_bit(dtype, kw):
    """The low-bit update alone, same updates in: captured in a CUDA graph (device counter, status
    read on the device) and replayed, against the host loop's call after each step."""
    from torchloom.lowbit.weights import LowBitWeights

    nets = [_net(bias=True).cuda(), _net(bias=True).cuda()]
    host, dev = (LowBitWeights(n, dtype, LowBitConfig(**kw), seed=3) for n in nets)
    host.start()
    dev.start()
    assert host.fused is not None and dev.fused is not None
    g = torch.Generator().manual_seed(0)
    deltas = [[(torch.randn(p.shape, generator=g) * 0.05).cuda() for p in nets[0].parameters()] for _ in range(4)]
    counter = torch.zeros((), dtype=torch.int64, device="cuda")
    status = torch.full((), 3, dtype=torch.int32, device="cuda")
    slots = [torch.zeros_like(p) for p in nets[1].parameters()]
    dev.device_update(counter, status)  # a step that did not run: compiles the kernels, changes nothing
    status.zero_()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with torch.no_grad():
            for p, d in zip(nets[1].parameters(), slots):
                p.add_(d)
        dev.device_update(counter, status)
    for step, ds in enumerate(deltas):
        with torch.no_grad():
            for p, d in zip(nets[0].parameters(), ds):
                p.add_(d)
        host.after_update(step)
        for s, d in zip(slots, ds):
            s.copy_(d)
        graph.replay()
    assert int(counter) == 4
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    hs, ds_ = host.state_dict(), dev.state_dict()
    for key in ("master", "scales"):
        for a, b in zip(hs[key], ds_[key]):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), key
