"""Issue 32, item 7, the class "``shuffle=True`` is honoured or refused, never ignored": a list of
batches is yielded in a new order of its batches every epoch (``randperm`` seeded by
``epoch_seed(seed, epoch)``: reproducible, and the same orders on a resume, also without a seed);
a ``DataLoader`` keeps its own order, so ``shuffle=True`` with one is a ``ValueError`` before any
change. The reference order is recomputed here from the documented formula."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from torchloom import Checkpoint, Dense, Network, TrainingConfig, train
from torchloom.engine.data import epoch_seed
from torchloom.observers.base import Observer

F64 = torch.float64


def _net():
    torch.manual_seed(0)
    return Network(Dense(3, 2, dtype=F64))


def _batches(n=5):
    # batch k is recognisable: every input element equals k
    return [(torch.full((2, 3), float(k), dtype=F64), torch.zeros(2, 2, dtype=F64)) for k in range(n)]


def _orders(epochs, seed, **kw):
    seen = []

    class Spy(Observer):
        def on_epoch_begin(self, trainer, epoch):
            seen.append([])

    net = _net()
    cfg = TrainingConfig(epochs=epochs, verbose=0, shuffle=True, seed=seed, observers=[Spy(), *kw.pop("observers", [])], **kw)
    net.forward_saved = _recording(net, seen)  # this instance's forward notes which batch it trains on
    train(net, _batches(), cfg)
    return seen


def _recording(net, seen):
    original = net.forward_saved

    def forward_saved(x, *a, **k):
        if seen:
            seen[-1].append(int(x[0, 0]))
        return original(x, *a, **k)

    return forward_saved


def _want(seed, epochs, n=5):
    return [torch.randperm(n, generator=torch.Generator().manual_seed(epoch_seed(seed, e))).tolist() for e in range(epochs)]


def test_a_list_of_batches_is_shuffled_every_epoch_by_the_documented_formula():
    got = _orders(3, seed=7)
    assert got == _want(7, 3)
    assert len({tuple(o) for o in got}) > 1  # the order changes from epoch to epoch
    assert _orders(3, seed=7) == got  # reproducible


def test_a_resumed_run_draws_the_same_orders_also_without_a_seed(tmp_path):
    torch.manual_seed(123)
    full = _orders(4, seed=None)
    assert all(sorted(o) == list(range(5)) for o in full)
    torch.manual_seed(123)
    _orders(2, seed=None, observers=[Checkpoint(tmp_path / "s.pt", save_best_only=False)])
    torch.manual_seed(999)  # another process: another draw, yet the checkpoint's seed is used
    resumed = _orders(4, seed=None, resume_from=str(tmp_path / "s.pt"))
    assert resumed == full[2:]


def test_shuffle_with_a_dataloader_is_refused_before_training():
    net = _net()
    before = [p.clone() for p in net.parameters()]
    loader = DataLoader(TensorDataset(torch.zeros(4, 3, dtype=F64), torch.zeros(4, 2, dtype=F64)), batch_size=2)
    with pytest.raises(ValueError) as e:
        train(net, loader, TrainingConfig(epochs=1, verbose=0, shuffle=True))
    assert str(e.value) == (
        "shuffle=True does not apply to a DataLoader: it keeps its own order; build it with "
        "DataLoader(..., shuffle=True) (or a sampler), or leave shuffle at False"
    )
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
