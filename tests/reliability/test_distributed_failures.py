"""Issue 32, item 5: data-parallel failures (CPU, gloo, 2 processes on 127.0.0.1, bounded time).

The classes:

* "a failure on one rank is a failure on every rank, at once": a batch that fails to load on one
  rank, an observer or the validation data failing on one rank at an epoch's end, a check failing on
  one rank before training: that rank raises its own error and every other rank a ``RuntimeError``
  naming where, within seconds (the process group's timeout here is 90 s; PyTorch's default is 30
  min), and the process group stays usable (the next scenario runs in it);
* "loaders of unequal length end the epoch together": unsized loaders (an ``IterableDataset``) of
  different lengths: every rank stops the epoch at the shortest, rank 0 warns, the weights stay equal;
* "per-rank data is not sharded again": ``(X, Y)`` that differs between ranks is each rank's own
  shard (``batch_size`` stays the global batch: each rank takes ``batch_size / world`` of its own
  rows a step), equal to one process on the concatenated global batches; ``shard_data=True`` forces
  the engine's sharding.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset

from torchloom import Dense, Network, TrainingConfig, train
from torchloom.observers.base import Observer
from helpers import spawn_ranks

WORLD = 2
TIMEOUT_S = 240  # the whole spawn: a hung collective fails the test instead of hanging CI
QUICK_S = 30.0  # an agreed failure reaches every rank well within this (the group's timeout: 90 s)


def _net():
    torch.manual_seed(0)
    return Network(Dense(6, 8, "tanh", dtype=torch.float64), Dense(8, 4, dtype=torch.float64))


def _xy(n=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,), generator=g)


def _cfg(**kw):
    return TrainingConfig(**{"epochs": 2, "verbose": 0, "loss_type": "cross_entropy", "optimizer": "sgd",
                             "learning_rate": 0.1, **kw})


class _Rows(Dataset):
    """Rows of (X, Y); row ``bad`` raises on rank ``rank``."""

    def __init__(self, rank, bad):
        self.X, self.Y = _xy()
        self.rank, self.bad = rank, bad

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        if i == self.bad and dist.get_rank() == self.rank:
            raise ValueError(f"row {i} is unreadable")
        return self.X[i], self.Y[i]


class _Stream(IterableDataset):
    """``batches`` batches of 4 rows (no length)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        X, Y = _xy()
        for k in range(self.batches):
            yield X[4 * k : 4 * k + 4], Y[4 * k : 4 * k + 4]


class _FailOnRank(Observer):
    def on_epoch_end(self, trainer, epoch, logs):
        if dist.get_rank() == 1:
            raise OSError("disk full")


def _outcome(fn):
    start = time.monotonic()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = fn()
        return {"ok": value, "warnings": [str(w.message) for w in caught], "s": time.monotonic() - start}
    except Exception as e:  # noqa: BLE001
        return {"error": (type(e).__name__, str(e)), "s": time.monotonic() - start}


def _scenarios(rank, tmp):
    out = {}
    # a batch that fails to load on rank 1 (row 9: a DistributedSampler gives rank 1 rows 1, 3, 5, ...: its batch 1)
    loader = DataLoader(_Rows(rank=1, bad=9), batch_size=4)
    out["bad-batch"] = _outcome(lambda: train(_net(), loader, _cfg()))
    # an observer failing on rank 1 at the end of epoch 1
    X, Y = _xy()
    out["observer"] = _outcome(lambda: train(_net(), (X, Y), _cfg(batch_size=8, observers=[_FailOnRank()])))
    # validation data that does not fit on rank 1 only: found before training, agreed
    val = (X, Y) if rank == 0 else (X[:, :5], Y)
    out["start"] = _outcome(lambda: train(_net(), (X, Y), _cfg(batch_size=8, validation_data=val)))
    # unsized loaders of unequal length: rank 0 has 4 batches, rank 1 has 3
    net = _net()
    out["unequal"] = _outcome(lambda: train(net, DataLoader(_Stream(4 if rank == 0 else 3), batch_size=None), _cfg()).history["counted"])
    out["unequal-weights"] = [p.detach().clone() for p in net.parameters()]
    # per-rank (X, Y): rank r holds its own 16 rows
    mine = (X[16 * rank : 16 * rank + 16], Y[16 * rank : 16 * rank + 16])
    net = _net()
    result = train(net, mine, _cfg(batch_size=8, epochs=3))
    out["own"] = ([p.detach().clone() for p in net.parameters()], result.loss_history)
    # the same data on every rank, shard_data=False: each rank trains on all of it, 4 rows a step
    # a shuffled list of batches without a seed, each rank's RNG elsewhere: the same orders (rank 0's seed)
    torch.manual_seed(100 + rank)
    net, seen = _net(), []
    original = net.forward_saved

    def forward_saved(x, *a, **k):  # this instance notes which batch each forward reads
        seen.append(int(x[0, 0]))
        return original(x, *a, **k)

    net.forward_saved = forward_saved
    batches = [(torch.full((2, 6), float(k), dtype=torch.float64), torch.zeros(2, dtype=torch.long)) for k in range(6)]
    train(net, batches, _cfg(shuffle=True, epochs=2))
    out["list-orders"] = seen[-12:]  # the 12 steps (a probe forward checked the batches' shape first)
    for setting in (False, True):
        rows = _StepRows()
        train(_net(), (X, Y), _cfg(batch_size=8, epochs=1, shard_data=setting, observers=[rows]))
        out[f"shard_data={setting}"] = rows.rows
    return out


class _StepRows(Observer):
    def __init__(self):
        self.rows = []

    def on_batch_end(self, trainer, step, logs):
        self.rows.append(int(logs["batch_size"]))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_scenarios, WORLD, str(tmp_path_factory.mktemp("dist-fail")), TIMEOUT_S, pg_timeout_s=90)


def _other(where):
    return (
        "RuntimeError",
        f"data-parallel training stopped at {where}: another rank failed there (its error is in its own output); "
        "rank 0 stops with it",
    )


def test_a_batch_failing_on_one_rank_stops_every_rank_at_once(ranks):
    r0, r1 = ranks[0]["bad-batch"], ranks[1]["bad-batch"]
    assert r1["error"][0] == "ValueError" and "row 9 is unreadable" in r1["error"][1]
    assert r0["error"] == _other("epoch 1, batch 1")
    assert r0["s"] < QUICK_S and r1["s"] < QUICK_S


def test_an_observer_failing_on_one_rank_stops_every_rank_at_once(ranks):
    assert ranks[1]["observer"]["error"] == ("OSError", "disk full")
    assert ranks[0]["observer"]["error"] == _other("the end of epoch 1")
    assert ranks[0]["observer"]["s"] < QUICK_S


def test_a_check_failing_on_one_rank_before_training_stops_every_rank(ranks):
    assert ranks[1]["start"]["error"][0] == "ValueError"
    assert ranks[0]["start"]["error"] == _other("the start of training (the data and checkpoint checks)")


def test_unsized_loaders_of_unequal_length_end_the_epoch_together(ranks):
    r0, r1 = ranks[0]["unequal"], ranks[1]["unequal"]
    assert r0["ok"] == r1["ok"] == [3.0, 3.0]  # both epochs: 3 batches counted on every rank
    want = (
        "data-parallel training: epoch {e} ends after 3 batches on every rank: 1 of 2 ranks had no batch 3 (loaders "
        "of unequal length; the other ranks' remaining batches are left out)"
    )
    assert [w for w in r0["warnings"] if w.startswith("data-parallel")] == [want.format(e=1), want.format(e=2)]
    assert not [w for w in r1["warnings"] if w.startswith("data-parallel")]  # rank 0 alone warns
    for p, q in zip(ranks[0]["unequal-weights"], ranks[1]["unequal-weights"]):
        assert torch.equal(p, q)


def test_per_rank_data_is_each_ranks_shard_as_one_process_on_the_global_batches(ranks):
    X, Y = _xy()
    # the global batch j: rank 0's rows 4j..4j+3 of its half, then rank 1's
    batches = [(torch.cat([X[4 * j : 4 * j + 4], X[16 + 4 * j : 16 + 4 * j + 4]]),
                torch.cat([Y[4 * j : 4 * j + 4], Y[16 + 4 * j : 16 + 4 * j + 4]])) for j in range(4)]
    ref = _net()
    want = train(ref, batches, _cfg(epochs=3, distributed=False))
    for res in ranks:
        weights, losses = res["own"]
        np.testing.assert_allclose(losses, want.loss_history, rtol=1e-10, atol=1e-12)
        for p, q in zip(weights, ref.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-10, atol=1e-12)


def test_shard_data_false_trains_each_rank_on_all_its_rows_and_true_on_its_share(ranks):
    for res in ranks:
        assert res["shard_data=False"] == [4] * 8  # all 32 rows, batch_size / world = 4 a step
        assert res["shard_data=True"] == [4] * 4  # its 4 rows of each of the 4 global batches of 8


def test_a_shuffled_list_draws_the_same_orders_on_every_rank(ranks):
    a, b = ranks[0]["list-orders"], ranks[1]["list-orders"]
    assert a == b and sorted(a[:6]) == list(range(6)) and sorted(a[6:]) == list(range(6))


def test_shard_data_must_be_a_bool_or_none():
    with pytest.raises(TypeError) as e:
        TrainingConfig(shard_data="no")
    assert str(e.value) == "TrainingConfig: shard_data must be None (automatic), True or False, got 'no'"
