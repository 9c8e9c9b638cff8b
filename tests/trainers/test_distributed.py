"""Data-parallel training through ``torch.distributed`` (CPU, gloo, 2 processes on 127.0.0.1).

One spawn of 2 ranks runs every scenario (starting processes costs seconds); each rank saves what it
saw, and the tests compare it with an independent reference: the same ``train()`` call in this one
process on the concatenated global batch (``distributed=False``), and the ranks with each other.

* every method (backprop, TargetProp chain rule and pure, Tweening): weights and loss history after
  several epochs equal one process on the global batch (float64 to 1e-10; float32 to float tolerance),
  with the data as ``(X, Y)`` tensors (sharded by the engine, shuffled), as a list of batches the
  caller sharded, and as a ``DataLoader`` (``DistributedSampler``);
* a NaN/Inf that only one rank sees: both ranks skip the same steps and keep the same weights;
* an observer stopping on one rank stops both; only rank 0 prints and writes files;
* a full-state checkpoint written by the 2 ranks resumes in 1 process, equal to 4 epochs in one;
* a ``DistributedDataParallel``-wrapped model trains its ``.module``, with a note.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import time
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from torchloom import (
    Checkpoint, ConsoleObserver, CSVLogger, Dense, DFAConfig, FeedbackAlignmentConfig, Network, TargetPropConfig, TrainingConfig,
    TweenConfig, train,
)
from torchloom.observers.base import Observer
from test_examples import load_example
from helpers import free_port, spawn_ranks

WORLD = 2
PERM = [(7 * i + 3) % 64 for i in range(64)]  # a row order of the user's own sampler
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 120  # bounded: a hung collective fails the test instead of hanging CI

METHODS = {
    "backprop": dict(method="backprop", loss_type="cross_entropy", optimizer="momentum", learning_rate=0.05),
    "tp-chain": dict(method=TargetPropConfig(learning_rate=0.05, gate_threshold=0.3)),
    "tp-pure": dict(method=TargetPropConfig(mode="pure", learning_rate=0.02)),
    "tween": dict(method=TweenConfig(base_rate=0.05), loss_type="cross_entropy"),
    # a rule written outside torchloom (examples/08_custom_method.py): data-parallel like the others
    "custom": dict(method=load_example("08_custom_method.py").FeedbackAlignment(seed=4), loss_type="cross_entropy",
                   optimizer="momentum", learning_rate=0.05),
    # the feedback rules: each all-reduces its own gradients as backprop does
    "feedback_alignment": dict(method=FeedbackAlignmentConfig(seed=4), loss_type="cross_entropy", optimizer="momentum", learning_rate=0.05),
    "dfa": dict(method=DFAConfig(seed=4), loss_type="cross_entropy", optimizer="momentum", learning_rate=0.05),
    "sign_symmetry": dict(method="sign_symmetry", loss_type="cross_entropy", optimizer="momentum", learning_rate=0.05),
    "fast_proxy": dict(method="fast_proxy", loss_type="cross_entropy", optimizer="momentum", learning_rate=0.05),
}
# the default rates (None): a step of B < 16 rows moves B/16 of the rate, B the global batch
AUTO = {
    "tween-auto": dict(method=TweenConfig(), loss_type="cross_entropy"),
    "tp-chain-auto": dict(method=TargetPropConfig(gate_threshold=0.3)),
}
# a caller's shards of unequal size (the global batch counted: 7 rows of 4 + 3)
UNEQUAL = {**AUTO, "tp-chain-explicit": dict(method=TargetPropConfig(learning_rate=0.05, gate_threshold=0.3))}
ALIGNED = ("dfa", "tween")  # alignment diagnostics under data-parallel training: a rule's direction, an applied change


def _net(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return Network(Dense(6, 12, "tanh", dtype=dtype), Dense(12, 4, "sigmoid", dtype=dtype))


def _xy(n=64, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 4, (n,), generator=g)


def _cfg(name, **kw):
    base = copy.deepcopy(METHODS[name])
    return TrainingConfig(**{"epochs": 3, "verbose": 0, **base, **kw})


def _weights(net):
    return [p.detach().clone() for p in net.parameters()]


class _StopOnRank(Observer):
    """Asks to stop after epoch ``epoch`` on rank ``rank`` only."""

    def __init__(self, rank, epoch):
        self.rank, self.epoch = rank, epoch

    def on_epoch_end(self, trainer, epoch, logs):
        if dist.get_rank() == self.rank and epoch == self.epoch:
            trainer.stop_training = True


class _Rows(Observer):
    """Records the rows of every step this rank ran."""

    def __init__(self):
        self.rows = []

    def on_batch_end(self, trainer, step, logs):
        self.rows.append(int(logs["batch_size"]))


# ----------------------------------------------------------------------------- the ranks' work
def _scenarios(rank, tmp):
    out = {}
    X, Y = _xy()
    # every method, (X, Y) sharded by the engine, shuffled with a seed: float64
    for name in METHODS:
        net, rows = _net(), _Rows()
        r = train(net, (X, Y), _cfg(name, batch_size=16, shuffle=True, seed=3, observers=[rows]))
        out[f"xy-{name}"] = (_weights(net), r.loss_history)
        out[f"rows-{name}"] = rows.rows
    # alignment diagnostics: the global batch's exact gradient and direction (averaged over the ranks)
    for name in ALIGNED:
        net = _net()
        r = train(net, (X, Y), _cfg(name, batch_size=16, shuffle=True, seed=3, alignment_every=3))
        out[f"align-{name}"] = (_weights(net), r.loss_history, {k: v for k, v in r.history.history.items() if k.startswith("alignment_bp/")})
    # float32 backprop and tween
    X32 = X.float()
    for name in ("backprop", "tween"):
        net = _net(torch.float32)
        r = train(net, (X32, Y), _cfg(name, batch_size=16))
        out[f"f32-{name}"] = (_weights(net), r.loss_history)
    # a list of batches sharded by the caller (rank r: rows r*8 .. r*8+7 of every batch of 16)
    shards = [(X[j + rank * 8 : j + rank * 8 + 8], Y[j + rank * 8 : j + rank * 8 + 8]) for j in range(0, 64, 16)]
    for name in ("tween", "tp-chain"):
        net = _net()
        r = train(net, shards, _cfg(name))
        out[f"list-{name}"] = (_weights(net), r.loss_history)
    # the default rates on global batches of 8 (4 rows per rank): the scale of the global batch, 8/16
    shards = [(X[j + rank * 4 : j + rank * 4 + 4], Y[j + rank * 4 : j + rank * 4 + 4]) for j in range(0, 64, 8)]
    for name, method in AUTO.items():
        net = _net()
        r = train(net, shards, TrainingConfig(epochs=3, verbose=0, **copy.deepcopy(method)))
        out[f"auto-{name}"] = (_weights(net), r.loss_history)
    # shards of unequal size from the caller (rank 0: 4 rows, rank 1: 3 of every batch of 7): the update
    # of the counted global batch, on every rank alike (an automatic rate's scale too)
    lo, hi = (0, 4) if rank == 0 else (4, 7)
    uneven = [(X[j + lo : j + hi], Y[j + lo : j + hi]) for j in range(0, 63, 7)]
    for name, method in UNEQUAL.items():
        net = _net()
        train(net, uneven, TrainingConfig(epochs=3, verbose=0, **copy.deepcopy(method)))
        out[f"unequal-{name}"] = _weights(net)
    # a DataLoader: a DistributedSampler is put in (8 rows per rank per batch)
    net = _net()
    r = train(net, DataLoader(TensorDataset(X, Y), batch_size=8), _cfg("backprop"))
    out["loader-backprop"] = (_weights(net), r.loss_history)
    # a DataLoader with a sampler of the user's own (this rank's rows of every batch of 16): respected
    mine = [PERM[j + rank * 8 + k] for j in range(0, 64, 16) for k in range(8)]
    net = _net()
    r = train(net, DataLoader(TensorDataset(X, Y), batch_size=8, sampler=mine), _cfg("backprop"))
    out["own-sampler-backprop"] = (_weights(net), r.loss_history)
    # the device step (the engine's runner, here on CPU tensors: every decision in tensors, no host read)
    for name in METHODS:
        net = _net()
        r, _ = _forced(net, (X, Y), _cfg(name, batch_size=16))
        out[f"device-{name}"] = (_weights(net), r.loss_history)
        bad = [(x.clone(), y) for x, y in shards]
        if rank == 1:
            bad[1][0][0, 0] = float("nan")
        net = _net()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r, _ = _forced(net, bad, _cfg(name))
        out[f"device-nan-{name}"] = (_weights(net), r.loss_history, r.skipped_per_epoch)
    # the same with each layer's gradients reduced during the backward (what large models do)
    from torchloom.engine import distributed as tl_dist

    saved_bytes, tl_dist.OVERLAP_BYTES = tl_dist.OVERLAP_BYTES, 0
    try:
        for name in ("backprop", "tween"):
            net = _net()
            r, _ = _forced(net, (X, Y), _cfg(name, batch_size=16))
            out[f"overlap-{name}"] = (_weights(net), r.loss_history)
    finally:
        tl_dist.OVERLAP_BYTES = saved_bytes
    # a NaN only this rank sees (rank 1, its shard of batch 1): every rank skips the same step
    for name in METHODS:
        bad = [(x.clone(), y) for x, y in shards]
        if rank == 1:
            bad[1][0][0, 0] = float("nan")
        net = _net()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = train(net, bad, _cfg(name))
        out[f"nan-{name}"] = (_weights(net), r.loss_history, r.skipped_per_epoch)
    # stopping asked on rank 1 alone after epoch 2 stops both; only rank 0 prints and writes
    net = _net()
    buf = io.StringIO()
    obs = [_StopOnRank(1, 1), ConsoleObserver(every=4), Checkpoint(os.path.join(tmp, f"ck{rank}.pt")), CSVLogger(os.path.join(tmp, f"log{rank}.csv"))]
    with contextlib.redirect_stdout(buf):
        r = train(net, (X, Y), _cfg("tween", batch_size=16, epochs=4, verbose=2, observers=obs))
    out["stop"] = (_weights(net), r.loss_history)
    out["printed"] = buf.getvalue()
    # a checkpoint written by the 2 ranks (rank 0 writes), to resume in 1 process (the test) and in 2 (here)
    for name in ("backprop", "tween"):
        net = _net()
        train(net, (X, Y), _cfg(name, batch_size=16, epochs=2, observers=[Checkpoint(os.path.join(tmp, f"resume-{name}.pt"))]))
        dist.barrier()  # written (by rank 0) before any rank reads it
        net = _net(seed=5)
        r = train(net, (X, Y), _cfg(name, batch_size=16, epochs=4, resume_from=os.path.join(tmp, f"resume-{name}.pt")))
        out[f"resumed-{name}"] = (_weights(net), r.loss_history)
    # collectives per step: one all-reduce per step for every method (host, device and fused device steps)
    out["collectives"] = _collectives(X, Y, shards)
    # a DistributedDataParallel-wrapped model
    net = _net()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = train(ddp, (X, Y), _cfg("backprop", batch_size=16))
    out["ddp"] = (_weights(net), r.loss_history, [str(w.message) for w in caught])
    # examples/07_multi_gpu.py inside the running process group
    try:
        import sklearn  # noqa: F401
    except ImportError:
        return out
    out["example"] = _example().main(epochs=2, verbose=False)
    return out


def _collectives(X, Y, shards):
    """Per method and step kind: ``(collectives inside each step, host reads inside the device steps)``,
    counted by wrapping ``torch.distributed.all_reduce`` and the method's step for the length of one
    ``train`` call; and the fused device steps' results (Triton's interpreter on CPU, float32)."""
    from torchloom.engine.cuda_path import _NoHostReads
    from torchloom.engine.train import make_trainer

    real = dist.all_reduce
    counts = {"inside": False, "n": 0}

    def counting(*args, **kwargs):
        counts["n"] += counts["inside"]
        return real(*args, **kwargs)

    out = {}
    for name in ("tween", "tp-chain", "tp-pure", "backprop"):
        for kind in ("host", "device", "fused", "fused-overlap"):
            if (kind.startswith("fused") and name == "backprop") or (kind == "fused-overlap" and name == "tp-chain"):
                continue  # (tp-chain's fused backward is Tween's: one overlapped run of each kind of backward)
            fused = kind.startswith("fused")
            dtype = torch.float32 if fused else torch.float64
            # the fused steps run in Triton's interpreter: 2 steps of 32 rows (16 a rank), 1 epoch
            cfg = _cfg(name, **(dict(batch_size=32, epochs=1, loss_type="mse") if fused else dict(batch_size=16, epochs=2)))
            trainer = make_trainer(_net(dtype), cfg)
            per_step, reads = [], []
            method = trainer.method
            if kind == "host":
                inner = method.step

                def wrapped(x, y, inner=inner):
                    counts["inside"], counts["n"] = True, 0
                    try:
                        return inner(x, y)
                    finally:
                        counts["inside"] = False
                        per_step.append(counts["n"])

                method.step = wrapped
            else:
                if fused:
                    trainer.kernel_backend = "triton"
                from torchloom.engine.cuda_path import CudaRunner

                inner = method.device_step

                def wrapped(x, y, slot, runner, inner=inner):
                    counts["inside"], counts["n"] = True, 0
                    try:
                        # a host read in the step raises here (backprop's CPU optimizer references read
                        # their guard flag on the host: not checked there)
                        with _NoHostReads() if name != "backprop" else contextlib.nullcontext():
                            inner(x, y, slot, runner)
                        reads.append(0)
                    finally:
                        counts["inside"] = False
                        per_step.append(counts["n"])

                method.device_step = wrapped
                from torchloom.engine import distributed as tl_dist

                saved_bytes = tl_dist.OVERLAP_BYTES
                tl_dist.OVERLAP_BYTES = 0 if kind == "fused-overlap" else saved_bytes  # each layer's directions summed as written
                try:
                    trainer._runner = CudaRunner(trainer)
                finally:
                    tl_dist.OVERLAP_BYTES = saved_bytes
                if fused:
                    assert getattr(method, "_fused", None) is not None, f"{name}: the fused step was not taken"
            dist.all_reduce = counting
            try:
                data = (X.to(dtype), Y) if fused else (X, Y)
                r = trainer.fit(data, cfg.epochs)
            finally:
                dist.all_reduce = real
            out[f"{name}-{kind}"] = (per_step, len(reads), _weights(trainer.model), r.loss_history)
    return out


def _example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("multi_gpu_example", os.path.join(ROOT, "examples", "07_multi_gpu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _forced(net, data, cfg):
    """The engine's device runner on a CPU trainer (as tests/trainers/test_engine.py does)."""
    from torchloom.engine.cuda_path import CudaRunner
    from torchloom.engine.train import make_trainer

    trainer = make_trainer(net, cfg)
    trainer._runner = CudaRunner(trainer)
    return trainer.fit(data, cfg.epochs), trainer


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dist"))
    return spawn_ranks(_scenarios, WORLD, tmp, TIMEOUT_S), tmp


def _check(weights, losses, ref_net, ref_result, tol):
    np.testing.assert_allclose(losses, ref_result.loss_history, rtol=tol, atol=tol)
    for p, q in zip(weights, ref_net.parameters()):
        torch.testing.assert_close(p, q.detach(), rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("name", list(METHODS))
def test_xy_sharded_equals_one_process_on_global_batch(ranks, name):
    results, _ = ranks
    X, Y = _xy()
    ref = _net()
    r = train(ref, (X, Y), _cfg(name, batch_size=16, shuffle=True, seed=3, distributed=False))
    for res in results:
        _check(*res[f"xy-{name}"], ref, r, 1e-10)
        assert res[f"rows-{name}"] == [8] * 12  # each rank ran its 8 rows of each of the 4 global batches, 3 epochs
    assert not all(torch.equal(p, q) for p, q in zip(results[0][f"xy-{name}"][0], _weights(_net())))  # it trained


@pytest.mark.parametrize("name", ALIGNED)
def test_alignment_diagnostics_equal_one_process(ranks, name):
    results, _ = ranks
    X, Y = _xy()
    ref = _net()
    r = train(ref, (X, Y), _cfg(name, batch_size=16, shuffle=True, seed=3, distributed=False, alignment_every=3))
    want = {k: v for k, v in r.history.history.items() if k.startswith("alignment_bp/")}
    assert set(want) == {"alignment_bp/0", "alignment_bp/1"}
    for res in results:
        weights, losses, got = res[f"align-{name}"]
        _check(weights, losses, ref, r, 1e-10)
        assert set(got) == set(want)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-7, atol=1e-5, err_msg=k)  # degrees; arccos near 0° amplifies rounding


@pytest.mark.parametrize("name", ["backprop", "tween"])
def test_float32_equals_one_process(ranks, name):
    results, _ = ranks
    X, Y = _xy()
    ref = _net(torch.float32)
    r = train(ref, (X.float(), Y), _cfg(name, batch_size=16, distributed=False))
    for res in results:
        _check(*res[f"f32-{name}"], ref, r, 1e-5)


@pytest.mark.parametrize("name", ["tween", "tp-chain"])
def test_caller_sharded_list_equals_one_process(ranks, name):
    results, _ = ranks
    X, Y = _xy()
    ref = _net()
    r = train(ref, [(X[j : j + 16], Y[j : j + 16]) for j in range(0, 64, 16)], _cfg(name, distributed=False))
    for res in results:
        _check(*res[f"list-{name}"], ref, r, 1e-10)


@pytest.mark.parametrize("name", list(AUTO))
def test_default_rates_take_the_global_batch(ranks, name):
    """Two ranks of 4 rows each step as one process on the global batch of 8 (the default rate scaled by
    8/16, not by a rank's 4/16)."""
    results, _ = ranks
    X, Y = _xy()
    ref = _net()
    r = train(ref, [(X[j : j + 8], Y[j : j + 8]) for j in range(0, 64, 8)], TrainingConfig(epochs=3, verbose=0, distributed=False, **copy.deepcopy(AUTO[name])))
    for res in results:
        _check(*res[f"auto-{name}"], ref, r, 1e-10)


@pytest.mark.parametrize("name", list(UNEQUAL))
def test_unequal_caller_shards_step_as_one_process(ranks, name):
    """Rank 0 holds 4 rows and rank 1 3 rows of each batch of 7: both ranks end with the weights of one
    process on the batches of 7 (TargetProp's host step divides by the counted rows; an automatic rate
    scales by 7/16 on every rank, not by a rank's own 4/16 or 3/16). Weights only: the logged loss
    averages the ranks' losses as if their shards were equal."""
    results, _ = ranks
    X, Y = _xy()
    ref = _net()
    train(ref, [(X[j : j + 7], Y[j : j + 7]) for j in range(0, 63, 7)], TrainingConfig(epochs=3, verbose=0, distributed=False, **copy.deepcopy(UNEQUAL[name])))
    for res in results:
        for p, q in zip(res[f"unequal-{name}"], ref.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-10, atol=1e-10)


def test_dataloader_gets_distributed_sampler(ranks):
    results, _ = ranks
    X, Y = _xy()
    ref = _net()
    r = train(ref, DataLoader(TensorDataset(X, Y), batch_size=16), _cfg("backprop", distributed=False))
    for res in results:
        _check(*res["loader-backprop"], ref, r, 1e-10)
    perm = torch.tensor(PERM)
    ref = _net()
    r = train(ref, [(X[perm[j : j + 16]], Y[perm[j : j + 16]]) for j in range(0, 64, 16)], _cfg("backprop", distributed=False))
    for res in results:
        _check(*res["own-sampler-backprop"], ref, r, 1e-10)  # the user's sampler is kept, not replaced


@pytest.mark.parametrize("name", list(METHODS))
def test_device_step_equals_one_process(ranks, name):
    results, _ = ranks
    X, Y = _xy()
    ref = _net()
    r = train(ref, (X, Y), _cfg(name, batch_size=16, distributed=False))
    for res in results:
        weights, losses = res[f"device-{name}"]
        np.testing.assert_allclose(losses, r.loss_history, rtol=1e-6)  # the runner keeps per-step losses in float32
        for p, q in zip(weights, ref.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["backprop", "tween"])
def test_device_step_overlapping_the_backward_equals_one_process(ranks, name):
    results, _ = ranks
    X, Y = _xy()
    ref = _net()
    r = train(ref, (X, Y), _cfg(name, batch_size=16, distributed=False))
    for res in results:
        weights, losses = res[f"overlap-{name}"]
        np.testing.assert_allclose(losses, r.loss_history, rtol=1e-6)
        for p, q in zip(weights, ref.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("name", list(METHODS))
def test_nan_on_one_rank_is_agreed(ranks, name, path):
    results, _ = ranks
    key = f"nan-{name}" if path == "host" else f"device-nan-{name}"
    (w0, l0, s0), (w1, l1, s1) = results[0][key], results[1][key]
    assert s0 == s1 and sum(s0) >= 1  # both ranks skipped the same steps
    np.testing.assert_array_equal(l0, l1)
    for p, q in zip(w0, w1):
        assert torch.equal(p, q)
        assert torch.isfinite(p).all()


def test_stop_agreed_and_only_rank0_prints_and_writes(ranks):
    results, tmp = ranks
    assert len(results[0]["stop"][1]) == len(results[1]["stop"][1]) == 2  # rank 1 alone asked after epoch 2
    for p, q in zip(results[0]["stop"][0], results[1]["stop"][0]):
        assert torch.equal(p, q)
    assert "Epoch 2/4" in results[0]["printed"] and "[FWD]" in results[0]["printed"]
    assert results[1]["printed"] == ""
    assert os.path.exists(os.path.join(tmp, "ck0.pt")) and os.path.exists(os.path.join(tmp, "log0.csv"))
    assert not os.path.exists(os.path.join(tmp, "ck1.pt")) and not os.path.exists(os.path.join(tmp, "log1.csv"))


@pytest.mark.parametrize("name", ["backprop", "tween"])
def test_checkpoint_of_two_ranks_resumes_in_one_process_and_in_two(ranks, name):
    results, tmp = ranks
    X, Y = _xy()
    resumed = _net(seed=5)  # other initial weights: the checkpoint replaces them
    r = train(resumed, (X, Y), _cfg(name, batch_size=16, epochs=4, resume_from=os.path.join(tmp, f"resume-{name}.pt"), distributed=False))
    ref = _net()
    rr = train(ref, (X, Y), _cfg(name, batch_size=16, epochs=4, distributed=False))
    _check(_weights(resumed), r.loss_history, ref, rr, 1e-10)  # in one process
    for res in results:  # in the 2 processes that wrote it
        _check(*res[f"resumed-{name}"], ref, rr, 1e-10)


# collectives inside one step (wrapping torch.distributed.all_reduce): one for every method and step
# kind of a float64 model (gradients, statistics and loss in one buffer); backprop's host step averages
# its loss (read before the backward) and its gradients apart (two); a fused step that sums each layer's
# directions as its backward writes them (large models) has one per layer (2 here) and one for the rest
_PER_STEP = {"backprop-host": 2, "tween-fused-overlap": 3, "tp-pure-fused-overlap": 3}


@pytest.mark.parametrize(
    "key", [f"{m}-{k}" for m in ("tween", "tp-chain", "tp-pure") for k in ("host", "device", "fused")]
    + ["tween-fused-overlap", "tp-pure-fused-overlap", "backprop-host", "backprop-device"],
)
def test_collectives_per_step(ranks, key):
    results, _ = ranks
    steps = 2 if "fused" in key else 8  # fused: 2 global batches, 1 epoch; else 4 global batches × 2 epochs
    for res in results:
        per_step, device_steps, _, _ = res["collectives"][key]
        assert per_step == [_PER_STEP.get(key, 1)] * steps, per_step
        if not key.endswith("host"):
            assert device_steps == steps  # every device step ran without a host read (_NoHostReads)


@pytest.mark.parametrize("name", ["tween", "tp-chain", "tp-pure"])
def test_fused_device_step_data_parallel_equals_one_process(ranks, name):
    """The fused device step (Triton's interpreter on CPU) under data-parallel training, against one
    process's host step on the global batches: float32 partial sums in another order, so to float
    tolerance."""
    results, _ = ranks
    X, Y = _xy()
    ref = _net(torch.float32)
    r = train(ref, (X.float(), Y), _cfg(name, batch_size=32, epochs=1, loss_type="mse", distributed=False))
    for res in results:
        for kind in ("fused", "fused-overlap") if name != "tp-chain" else ("fused",):
            _, _, weights, losses = res["collectives"][f"{name}-{kind}"]
            np.testing.assert_allclose(losses, r.loss_history, rtol=2e-5)
            for p, q in zip(weights, ref.parameters()):
                torch.testing.assert_close(p, q.detach(), rtol=2e-4, atol=2e-5)


def test_ddp_wrapped_model_trains_its_module(ranks):
    results, _ = ranks
    X, Y = _xy()
    ref = _net()
    r = train(ref, (X, Y), _cfg("backprop", batch_size=16, distributed=False))
    for res in results:
        weights, losses, notes = res["ddp"]
        _check(weights, losses, ref, r, 1e-10)
        assert any("DistributedDataParallel" in n for n in notes)


def test_distributed_true_without_group_is_an_error():
    with pytest.raises(RuntimeError, match="process group"):
        train(_net(), [_xy(8)], _cfg("backprop", distributed=True))
    with pytest.raises(TypeError, match="distributed"):
        TrainingConfig(distributed="yes")


def test_example_equals_one_process(ranks):
    pytest.importorskip("sklearn")
    results, _ = ranks
    one = _example().main(epochs=2, verbose=False)
    for res in results:
        for method, acc in one.items():
            assert abs(res["example"][method] - acc) <= 1.5 / 450, method  # float32: at most one test digit flips


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU check; on GPUs run the benchmark itself")
def test_bench_dry_run_prints_the_table():
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "bench_distributed.py"), "--dry-run"],
        capture_output=True, text=True, timeout=90, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for method in ("torchloom backprop", "torchloom tween", "torchloom tp-chain", "torchloom tp-pure", "plain PyTorch DDP"):
        assert proc.stdout.count(f"| {method} |") == 2, proc.stdout  # 2 toy networks × 1 batch size
    assert "| 2 GPUs |" in proc.stdout
    # backprop and DDP side by side: every round's pair printed, on 1 GPU and on 2, per setting
    rounds = [line for line in proc.stdout.splitlines() if "backprop/DDP per round:" in line]
    assert len(rounds) == 4 and all(line.count("=") == 3 for line in rounds), proc.stdout
    assert "⚠" not in proc.stdout  # no run skipped a batch (TargetProp at rates that stay finite)


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_distributed", os.path.join(ROOT, "bench", "bench_distributed.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_marks_a_run_that_skipped_batches():
    """Runs E and G's 18× low tp-pure figure: pure TargetProp diverged, every later epoch stopped at
    its first batch, and samples/s counted that batch alone. The table now says so."""
    bench, cpu = _bench_module(), torch.device("cpu")
    sizes = (16, 32, 32, 4)
    diverged = bench.torchloom_rate("tp-pure", sizes, 8, 4, 2, cpu, 0, False, True, {"tp-chain": 0.01, "tp-pure": 1e3})
    fine = bench.torchloom_rate("tp-pure", sizes, 8, 4, 2, cpu, 0, False, True)
    assert diverged.skipped > 0 and fine.skipped == 0
    row = dict(net="16-32-32-4", batch=8, method="tp-pure", one=diverged, many=fine, ddp_many=1.0)
    text = bench.table([row], 2, "CPU")
    assert f"⚠ {diverged.skipped} skipped |" in text and text.count("⚠") == 2  # the cell, and the note below


def test_bench_alternates_backprop_and_ddp_rounds():
    bench, calls = _bench_module(), []
    bp, ddp = bench.side_by_side(4, lambda: calls.append("bp") or 2.0, lambda: calls.append("ddp") or 1.0)
    assert calls == ["bp", "ddp", "ddp", "bp", "bp", "ddp", "ddp", "bp"]
    assert bp == [2.0] * 4 and ddp == [1.0] * 4
    line = bench._round_line("x", [3.0, 4.0], [2.0, 4.0])
    assert "3/2=1.500, 4/4=1.000; best 1.000×, median 1.167×" in line


def test_wait_device_gives_up_after_the_timeout_aborts_and_raises():
    """The read-back's bounded wait (CUDA events stand-ins here: ``query()`` answers): events that
    complete pass at once; one that never completes raises within the process group's timeout, after
    aborting the group (so collectives waiting for a rank that is gone end and the process can exit)."""
    from torchloom.engine.distributed import DistContext

    class Event:
        def __init__(self, done_after):
            self.calls, self.done_after = 0, done_after

        def query(self):
            self.calls += 1
            return self.calls > self.done_after

    ctx = DistContext.__new__(DistContext)
    ctx.rank, ctx.world_size, ctx.backend, ctx.group = 1, 2, "nccl", None
    aborted = []
    ctx.abort = lambda: aborted.append(True)
    ctx.timeout_s = lambda: 0.2
    ctx.wait_device([Event(0), Event(3)])  # done at once, done after a few polls: no error
    assert not aborted
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        ctx.wait_device([Event(0), Event(10**9)])
    assert 0.2 <= time.monotonic() - start < 5
    assert aborted == [True]
    assert str(info.value) == (
        "rank 1: the epoch's steps did not complete within the process group's timeout (0.2 s): another rank stopped "
        "taking part in the collectives (it raised an error or its process ended); the process group was aborted "
        "(call torch.distributed.init_process_group again to go on)"
    )


def test_timeout_of_the_process_group_is_read():
    """``timeout_s`` reads ``init_process_group(timeout=...)`` (one gloo process)."""
    import datetime

    from torchloom.engine.distributed import DistContext

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=17))
    try:
        assert DistContext().timeout_s() == 17.0
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend,world,dtype,expected_op", [
    ("nccl", 4, torch.float32, "AVG"), ("nccl", 3, torch.float32, "AVG"), ("nccl", 4, torch.bfloat16, "AVG"),
    ("nccl", 3, torch.bfloat16, "SUM"), ("gloo", 4, torch.float32, "SUM"),
])
def test_a_mean_is_the_collectives_average_under_nccl(monkeypatch, backend, world, dtype, expected_op):
    """``all_reduce_(..., "mean")``: with NCCL one ``ReduceOp.AVG`` collective and no division after it
    (except half precision over a world size that is not a power of two, where AVG's 1/W would round:
    sum, then divide); with gloo (no AVG) a sum divided by the world size. A stand-in collective acts as
    ``world`` ranks holding the same values (SUM: ×world, AVG: ×1), so every path must give the values
    back, bucketed or flat."""
    import torch.distributed as tdist

    from torchloom.engine.distributed import DistContext

    monkeypatch.setattr(tdist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(tdist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(tdist, "get_backend", lambda group=None: backend)
    seen = []

    def fake_all_reduce(t, op=tdist.ReduceOp.SUM, group=None, async_op=False):
        seen.append(op)
        if op == tdist.ReduceOp.SUM:
            t.mul_(world)
        return None

    monkeypatch.setattr(tdist, "all_reduce", fake_all_reduce)
    ctx = DistContext()
    flat = torch.arange(12, dtype=dtype)
    views = [flat[:5].view(5), flat[5:].view(7)]  # consecutive views of one buffer: reduced as one
    apart = [torch.full((3,), 2.5, dtype=dtype), torch.full((2, 2), -1.0, dtype=dtype)]  # copied into a bucket
    want = [v.clone() for v in views + apart]
    ctx.all_reduce_(views, "mean")
    ctx.all_reduce_(apart, "mean")
    for got, ref in zip(views + apart, want):
        assert torch.equal(got, ref)
    assert [str(op).split(".")[-1] for op in seen] == [expected_op, expected_op]
