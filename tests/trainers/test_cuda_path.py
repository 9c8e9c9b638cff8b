"""The device-decided training path (trainers/cuda_path.py).

On CPU the same runner is forced onto a CPU trainer (kernels fall back to their references) to check
its bookkeeping against Loom's host-checked loop: NaN/Inf guards, clipping, schedules, epoch losses.
On CUDA (run on the GPU machine) it must equal the CPU results, with and without graph capture.
"""

import copy
import math

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from helpers import assert_close
from torchloom import Dense, Network, TrainingConfig, train
from torchloom.engine.cuda_path import _RECORD_VS_REPLAY, STEPS_PER_GRAPH, CudaRunner, steps_per_graph
from torchloom import BackpropTrainer


def _net(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return Network(Dense(5, 16, "relu", dtype=dtype), Dense(16, 12, "tanh", dtype=dtype), Dense(12, 3, "sigmoid", dtype=dtype))


def _batches(n=6, bs=4, ragged=3, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(bs, 5, generator=g, dtype=dtype), torch.rand(bs, 3, generator=g, dtype=dtype)) for _ in range(n)]
    if ragged:
        out.append((torch.randn(ragged, 5, generator=g, dtype=dtype), torch.rand(ragged, 3, generator=g, dtype=dtype)))
    return out


def _run_forced(net, batches, cfg):
    trainer = BackpropTrainer(net, cfg)
    trainer._runner = CudaRunner(trainer)  # the device-decided runner, here on CPU tensors
    return trainer.fit(batches, cfg.epochs)


CONFIGS = {
    "sgd": dict(),
    "momentum-norm-clip": dict(optimizer="momentum", gradient_clip=0.05),
    "momentum-value-clip": dict(optimizer="momentum", gradient_clip=0.05, clip_mode="value"),  # SGD.probe's path
    "adamw-value-clip": dict(optimizer="adamw", learning_rate=0.01, gradient_clip=0.01, clip_mode="value"),
    "rmsprop-schedule": dict(optimizer="rmsprop", learning_rate=0.01, scheduler=lambda step: 0.01 / (1 + 0.1 * step)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_device_decided_runner_matches_host_loop(name):
    batches = _batches()
    a, b = _net(), _net()
    cfg = TrainingConfig(**{"epochs": 3, "learning_rate": 0.2, "verbose": False, **CONFIGS[name]})
    ra = train(a, batches, cfg)
    rb = _run_forced(b, batches, cfg)
    # per-step losses are stored in float32 on the device path
    np.testing.assert_allclose(rb.loss_history, ra.loss_history, rtol=1e-6)
    for i, (p, q) in enumerate(zip(b.parameters(), a.parameters())):
        assert_close(p, q, name=f"param {i}", rtol=1e-12, atol=1e-12)
    assert rb.skipped_batches == ra.skipped_batches == 0


def test_device_decided_runner_guards_like_loom(capsys):
    batches = _batches()
    batches[3] = (batches[3][0].clone(), batches[3][1])
    batches[3][0][0, 1] = float("nan")  # NaN loss in batch 3: epoch abandoned there
    a, b = _net(), _net()
    cfg = TrainingConfig(epochs=2, learning_rate=0.2, verbose=True)
    ra = train(a, batches, cfg)
    host_out = capsys.readouterr().out
    rb = _run_forced(b, batches, cfg)
    dev_out = capsys.readouterr().out
    assert host_out.count("Fatal NaN/Inf loss") == dev_out.count("Fatal NaN/Inf loss") == 2
    np.testing.assert_allclose(rb.loss_history, ra.loss_history, rtol=1e-6)
    assert rb.skipped_batches == ra.skipped_batches == 2 * 4  # the NaN batch and 3 unreached, per epoch
    for p, q in zip(b.parameters(), a.parameters()):
        assert torch.isfinite(p).all()
        assert_close(p, q, name="param", rtol=1e-12, atol=1e-12)


def test_device_decided_runner_skips_nan_gradients(capsys):
    net = Network(Dense(1, 1, bias=False))
    with torch.no_grad():
        net[0].weight.zero_()
    batches = [(torch.tensor([[3e38]]), torch.tensor([[1.0]])), (torch.tensor([[0.5]]), torch.tensor([[1.0]]))]
    ref = copy.deepcopy(net)
    ra = train(ref, batches, epochs=2, learning_rate=0.1, verbose=True)
    host_out = capsys.readouterr().out
    rb = _run_forced(net, batches, TrainingConfig(epochs=2, learning_rate=0.1, verbose=True))
    dev_out = capsys.readouterr().out
    assert host_out.count("Fatal NaN/Inf gradients") == dev_out.count("Fatal NaN/Inf gradients") == 2
    assert rb.skipped_batches == ra.skipped_batches == 2
    np.testing.assert_allclose(rb.loss_history, ra.loss_history, rtol=1e-6)
    assert net[0].weight.item() == pytest.approx(ref[0].weight.item(), rel=1e-6)


def test_device_decided_runner_streams_a_dataloader():
    data = TensorDataset(torch.randn(30, 5, dtype=torch.float64), torch.rand(30, 3, dtype=torch.float64))
    a, b = _net(), _net()
    cfg = TrainingConfig(epochs=2, learning_rate=0.1, verbose=False)
    ra = train(a, DataLoader(data, batch_size=8), cfg)
    rb = _run_forced(b, DataLoader(data, batch_size=8), cfg)
    np.testing.assert_allclose(rb.loss_history, ra.loss_history, rtol=1e-6)
    assert rb.samples_per_second > 0


# ------------------------------------------------------------------------------------- on CUDA
def _cpu_then_cuda(cfg_kwargs, batches, epochs=4, **gpu_kwargs):
    cpu_net, gpu_net = _net(torch.float32), _net(torch.float32)
    r_cpu = train(cpu_net, batches, TrainingConfig(epochs=epochs, verbose=False, **cfg_kwargs))
    r_gpu = train(gpu_net, batches, TrainingConfig(epochs=epochs, verbose=False, use_gpu=True, **cfg_kwargs, **gpu_kwargs))
    return r_cpu, r_gpu, cpu_net, gpu_net


@pytest.mark.cuda
@pytest.mark.parametrize("cuda_graph", [None, False])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_equals_cpu(name, cuda_graph):
    batches = _batches(dtype=torch.float32)
    cfg = {"learning_rate": 0.2, **CONFIGS[name]}
    r_cpu, r_gpu, cpu_net, gpu_net = _cpu_then_cuda(cfg, batches, cuda_graph=cuda_graph)
    np.testing.assert_allclose(r_gpu.loss_history, r_cpu.loss_history, rtol=2e-5)
    for i, (p, q) in enumerate(zip(gpu_net.parameters(), cpu_net.parameters())):
        assert p.is_cuda
        assert_close(p.cpu(), q, name=f"param {i}", rtol=2e-4, atol=2e-5)


def test_steps_per_graph_records_fewer_steps_in_short_runs():
    """The chunk graph's length: a power of two in [2, STEPS_PER_GRAPH], never shorter for a longer
    run, the allowed length nearest to sqrt(steps / _RECORD_VS_REPLAY) on a log scale (recording once
    against replays per step); 4 for the benchmark's 236-step run, 16 for a long one."""
    ks = [steps_per_graph(n) for n in range(1, 20001)]
    assert set(ks) == {2, 4, 8, STEPS_PER_GRAPH}
    assert all(a <= b for a, b in zip(ks, ks[1:]))
    for n in (1, 80, 236, 500, 1876, 7500, 10**6):
        best = math.sqrt(n / _RECORD_VS_REPLAY)
        k = steps_per_graph(n)
        # nearest on a log scale among the allowed lengths
        allowed = [2, 4, 8, 16]
        assert abs(math.log(k / best)) <= min(abs(math.log(a / best)) for a in allowed) + 1e-12, (n, k)
    assert steps_per_graph(236) == 4 and steps_per_graph(7500) == 16


@pytest.mark.cuda
@pytest.mark.parametrize("epochs", [1, 3, 40])
def test_gpu_graphs_are_captured_and_replayed_with_a_ragged_last_batch(epochs):
    batches = _batches(n=70, bs=4, ragged=3, dtype=torch.float32)  # 71 steps: 2 graphs
    net = _net(torch.float32)
    cfg = TrainingConfig(epochs=epochs, learning_rate=0.1, verbose=False, use_gpu=True)
    trainer = BackpropTrainer(net, cfg)
    result = trainer.fit(batches, epochs)
    assert trainer._runner.capture_count == 2 and trainer._runner.graphs is not None
    # the chunk graph's length follows the run's length (2, 4, then 16 steps here)
    assert trainer._runner._chunk["x"].shape[0] == steps_per_graph(71 * epochs) == {1: 2, 3: 4, 40: 16}[epochs]
    ref = _net(torch.float32)
    r_cpu = train(ref, batches, TrainingConfig(epochs=epochs, learning_rate=0.1, verbose=False))
    np.testing.assert_allclose(result.loss_history, r_cpu.loss_history, rtol=2e-5)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert_close(p.cpu(), q, name="param", rtol=2e-4, atol=2e-5)


@pytest.mark.cuda
def test_gpu_nan_guards_hold_inside_graphs(capsys):
    batches = _batches(dtype=torch.float32)
    batches[2] = (batches[2][0].clone(), batches[2][1])
    batches[2][0][0, 0] = float("nan")
    r_cpu, r_gpu, cpu_net, gpu_net = _cpu_then_cuda(dict(learning_rate=0.2), batches, epochs=3)
    assert capsys.readouterr().out == ""  # verbose is off: no messages, but the bookkeeping must match
    assert r_gpu.skipped_batches == r_cpu.skipped_batches
    np.testing.assert_allclose(r_gpu.loss_history, r_cpu.loss_history, rtol=2e-5)
    for p, q in zip(gpu_net.parameters(), cpu_net.parameters()):
        assert torch.isfinite(p).all()
        assert_close(p.cpu(), q, name="param", rtol=2e-4, atol=2e-5)


@pytest.mark.cuda
def test_gpu_dataloader_and_cuda_graph_true_errors():
    data = TensorDataset(torch.randn(30, 5), torch.rand(30, 3))
    a, b = _net(torch.float32), _net(torch.float32)
    ra = train(a, DataLoader(data, batch_size=8), epochs=2, verbose=False)
    rb = train(b, DataLoader(data, batch_size=8), epochs=2, verbose=False, use_gpu=True)
    np.testing.assert_allclose(rb.loss_history, ra.loss_history, rtol=2e-5)
    with pytest.raises(ValueError, match="cuda_graph=True\\) needs a fixed list of batches"):
        train(_net(torch.float32), DataLoader(data, batch_size=8), epochs=1, verbose=False, use_gpu=True, cuda_graph=True)
    with pytest.raises(ValueError, match="needs one of torchloom's optimizers"):
        net = _net(torch.float32).cuda()
        train(net, _batches(dtype=torch.float32), epochs=1, verbose=False, use_gpu=True, cuda_graph=True,
              optimizer=torch.optim.SGD(net.parameters(), lr=0.1))


class _HostReadingDense(Dense):
    """A Dense layer whose forward reads a value back to the host: it cannot be graph-captured."""

    def forward_saved(self, x):
        float(x.sum())
        return super().forward_saved(x)


@pytest.mark.cuda
def test_a_step_that_cannot_be_captured_warns_and_runs_eagerly():
    torch.manual_seed(0)
    net = Network(_HostReadingDense(5, 8, "tanh"), Dense(8, 3))
    ref = copy.deepcopy(net)
    batches = _batches(dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="cannot be captured in a CUDA graph"):
        r_gpu = train(net, batches, epochs=3, learning_rate=0.1, verbose=False, use_gpu=True)
    r_cpu = train(ref, batches, epochs=3, learning_rate=0.1, verbose=False)
    np.testing.assert_allclose(r_gpu.loss_history, r_cpu.loss_history, rtol=2e-5)
    with pytest.raises(RuntimeError):
        train(copy.deepcopy(ref), batches, epochs=2, learning_rate=0.1, verbose=False, use_gpu=True, cuda_graph=True)
    torch.randn(3, device="cuda")  # CUDA's random-number state survived: no capture was left half done


def test_host_reads_are_found_before_a_capture_without_any_process_setting():
    """The warm-up before a capture runs under a dispatch mode of its own thread that refuses host
    reads (a capture that failed half way would leave CUDA's random state unusable); ordinary ops pass,
    and nothing process-wide (the sync debug mode) is touched."""
    from torchloom.engine.cuda_path import _NoHostReads

    x = torch.randn(4, 3)
    with _NoHostReads():
        y = torch.tanh(x @ x.T).sum(0)  # device work: fine
        for read in (lambda: float(y.sum()), lambda: bool(y[0] > 0), lambda: torch.nonzero(y)):  # (a copy to the CPU: the CUDA test)
            with pytest.raises(RuntimeError, match="reads a device value on the host"):
                read()
    assert float(y.sum()) == pytest.approx(float(torch.tanh(x @ x.T).sum()))  # outside the mode: allowed again
