"""The device backprop step with SGD checks its update ahead (``SGD.probe``) instead of backing the
weights up and checking them after: a refused step (NaN/Inf gradient, or an update that would
overflow) must still leave the weights and the optimizer state bit for bit as they were.

The runner is forced onto CPU tensors (as in test_cuda_path.py); with ``backend="triton"`` the probe
and the update run as Triton kernels in the interpreter. The reference for "as they were" is the same
run without the refused batch: a refused step is one that never happened."""

from __future__ import annotations

import warnings

import pytest
import torch

from torchloom import BackpropTrainer, Dense, DivergenceWarning, Network, TrainingConfig
from torchloom.engine.cuda_path import CudaRunner
from torchloom.kernels._triton import interpreter_enabled, triton_available
from torchloom.optim import SGD

BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not (triton_available() and interpreter_enabled()), reason="needs Triton's interpreter"))]


def _net():
    torch.manual_seed(0)
    net = Network(Dense(3, 4, "tanh"), Dense(4, 1))
    with torch.no_grad():  # a huge input then gives a finite loss and a huge first-layer gradient
        net[0].weight.zero_()
    return net


def _run(batches, backend, *, scheduler=None, epochs=1):
    net = _net()
    opt = SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, backend=backend)
    cfg = TrainingConfig(epochs=epochs, verbose=0, optimizer=opt, scheduler=scheduler)
    trainer = BackpropTrainer(net, cfg)
    runner = trainer._runner = CudaRunner(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DivergenceWarning)
        result = trainer.fit(batches, cfg.epochs)
    state = [opt.state[p]["momentum_buffer"].clone() for p in net.parameters() if "momentum_buffer" in opt.state[p]]
    return net, state, result, runner


def _good(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)


def _assert_same_bits(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x.detach().view(torch.int32), y.detach().view(torch.int32)), f"{what} {i}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_gradient_refuses_the_step_and_leaves_weights_and_momentum_bit_identical(backend):
    x, y = _good(2)
    bad_x = x.clone()
    bad_x[0, 0] = 3e38  # finite loss (zero first-layer weights), a first-layer gradient whose square is Inf
    # first, while the first layer's weights are still zero (later the tanh would saturate); the
    # refused first step must also leave the momentum "not started" (the next step takes v = g)
    with_bad, state_bad, result_bad, runner = _run([(bad_x, y), _good(1), _good(3)], backend)
    without, state_ok, result_ok, _ = _run([_good(1), _good(3)], backend)
    assert result_bad.skipped_batches == 1 and result_ok.skipped_batches == 0
    assert runner.update_guard._backup == []  # the single-pass guard ran: no backup was ever made
    _assert_same_bits(list(with_bad.parameters()), list(without.parameters()), "weight")
    _assert_same_bits(state_bad, state_ok, "momentum buffer")


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_update_that_would_overflow_is_refused_before_it_writes(backend):
    # step 1's learning rate sends the weights past float32's range: NAN_WEIGHTS, nothing written
    lr = lambda step: 0.1 if step != 1 else 3e38  # noqa: E731
    with_bad, state_bad, result_bad, runner = _run([_good(1), _good(2)], backend, scheduler=lr)
    without, state_ok, result_ok, _ = _run([_good(1)], backend, scheduler=lr)
    assert result_bad.skipped_batches == 1 and result_ok.skipped_batches == 0
    assert runner.update_guard._backup == []
    for p in with_bad.parameters():
        assert torch.isfinite(p).all()
    _assert_same_bits(list(with_bad.parameters()), list(without.parameters()), "weight")
    _assert_same_bits(state_bad, state_ok, "momentum buffer")


def test_a_clip_by_norm_keeps_the_backup_guard():
    # clip by norm needs the norm before the update's values are known: the old guard stays
    net = _net()
    cfg = TrainingConfig(epochs=1, verbose=0, optimizer="momentum", gradient_clip=0.05)
    trainer = BackpropTrainer(net, cfg)
    runner = trainer._runner = CudaRunner(trainer)
    trainer.fit([_good(1), _good(2)], 1)
    assert runner.update_guard._backup != []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_weight_non_finite_from_the_start_refuses_every_step_as_on_the_host_path(backend):
    """A NaN in an embedding row no batch looks up: its gradient is 0, so the update leaves it NaN and
    the look-ahead (which flags values an update makes non-finite) would let every step through. The
    device step then keeps the backed-up guard, which refuses every step (``NAN_WEIGHTS``) as the host
    loop does, and the weights stay as they were."""
    from torchloom import Embedding

    def run(host):
        torch.manual_seed(0)
        net = Network(Embedding(5, 3), Dense(3, 1))
        with torch.no_grad():
            net[0].weight[4, 0] = float("nan")
        start = [p.detach().clone() for p in net.parameters()]
        opt = SGD(net.parameters(), lr=0.1, momentum=0.9, backend=backend)
        trainer = BackpropTrainer(net, TrainingConfig(epochs=1, verbose=0, optimizer=opt))
        if not host:
            trainer._runner = CudaRunner(trainer)
        g = torch.Generator().manual_seed(4)
        batches = [(torch.randint(0, 4, (2, 3), generator=g), torch.randn(2, 3, 1, generator=g)) for _ in range(3)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DivergenceWarning)
            result = trainer.fit(batches, 1)
        return net, start, result, trainer

    host_net, host_start, host_result, _ = run(host=True)
    net, start, result, trainer = run(host=False)
    assert host_result.skipped_batches == 3  # the host loop's verdict
    assert result.skipped_batches == 3
    assert not trainer.method._can_probe()
    for p, q in zip(net.parameters(), start):
        assert torch.equal(torch.nan_to_num(p.detach(), nan=7.0), torch.nan_to_num(q, nan=7.0))
