"""as_batch_iterable / predict_inputs: every data form, seeded shuffling, set_epoch, bad input."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from torchloom.engine.data import Batches, as_batch_iterable, epoch_seed, predict_inputs
from torchloom.engine.types import TrainingBatch


def _xy(n=10, f=3):
    X = torch.arange(n * f, dtype=torch.float32).reshape(n, f)
    Y = torch.arange(n) * 10
    return X, Y


def _rows(batches):
    """Row ids of each batch, from X's first column (X[i, 0] = 3 * i)."""
    return [(x[:, 0] / 3).long().tolist() for x, _ in batches]


def _flat(rows):
    return [r for b in rows for r in b]


# ------------------------------------------------------------------------------ list of batches
def test_list_forms_are_normalised_to_pairs_in_order():
    x1, y1 = torch.randn(2, 3), torch.randn(2, 1)
    x2, y2 = torch.randn(4, 3), torch.randn(4, 1)
    x3, y3 = torch.randn(1, 3), torch.randn(1, 1)
    b = as_batch_iterable([(x1, y1), TrainingBatch(x2, y2), {"input": x3, "target": y3}])
    assert isinstance(b, Batches) and b.is_list and len(b) == 3 and b.sized
    for _ in range(2):  # re-iterable: the same batches every epoch
        got = list(b)
        assert [g[0] is e for g, e in zip(got, (x1, x2, x3))] == [True] * 3
        assert [g[1] is e for g, e in zip(got, (y1, y2, y3))] == [True] * 3
    mat = b.materialise()
    assert all(isinstance(p, tuple) and len(p) == 2 for p in mat) and mat[1][0] is x2


def test_tuple_of_pairs_and_generator_and_nested_lists_are_batches():
    pairs = ((torch.ones(2, 1), torch.zeros(2, 1)), (torch.ones(3, 1), torch.zeros(3, 1)))
    assert [x.shape[0] for x, _ in as_batch_iterable(pairs)] == [2, 3]  # a tuple of two *pairs* is batches
    gen = ((torch.ones(1, 2), torch.ones(1, 1)) for _ in range(3))
    b = as_batch_iterable(gen)
    assert len(b) == 3 and len(list(b)) == 3 and len(list(b)) == 3  # read once, kept
    b = as_batch_iterable([([[0.5, 1.0]], [[2.0]])])  # plain lists become tensors
    (x, y), = b
    assert torch.equal(x, torch.tensor([[0.5, 1.0]])) and torch.equal(y, torch.tensor([[2.0]]))


# --------------------------------------------------------------------------------------- (X, Y)
def test_xy_unshuffled_batches_are_consecutive_slices():
    X, Y = _xy(10)
    b = as_batch_iterable((X, Y), batch_size=4)
    assert b.is_list and len(b) == 3
    got = b.materialise()
    assert [x.shape[0] for x, _ in got] == [4, 4, 2]
    for k, (x, y) in enumerate(got):
        assert torch.equal(x, X[4 * k : 4 * k + 4]) and torch.equal(y, Y[4 * k : 4 * k + 4])
    assert _rows(b) == _rows(b)  # same every epoch
    assert len(as_batch_iterable((X, Y), batch_size=4, drop_last=True)) == 2
    assert len(as_batch_iterable((X, Y))) == 1  # default batch size 32 > 10 rows


def test_xy_default_batch_size_is_32():
    X, Y = torch.randn(70, 2), torch.randn(70, 1)
    assert [x.shape[0] for x, _ in as_batch_iterable((X, Y))] == [32, 32, 6]


def test_xy_numpy_arrays_are_accepted():
    X, Y = np.arange(12.0).reshape(6, 2), np.arange(6)
    (x, y), (x2, y2) = as_batch_iterable((X, Y), batch_size=3)
    assert torch.equal(x, torch.as_tensor(X[:3])) and torch.equal(y2, torch.as_tensor(Y[3:]))


def test_shuffle_is_a_new_seeded_permutation_every_epoch_and_leaves_the_global_rng_alone():
    X, Y = _xy(10)
    state = torch.get_rng_state()
    b = as_batch_iterable((X, Y), batch_size=4, shuffle=True, seed=123)
    assert not b.is_list and len(b) == 3
    epochs = [_rows(b) for _ in range(4)]
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG was never used
    for rows in epochs:
        assert sorted(_flat(rows)) == list(range(10)) and [len(r) for r in rows] == [4, 4, 2]
    assert len({tuple(_flat(r)) for r in epochs}) == 4  # a new order each epoch
    # pairs stay aligned
    for x, y in b:
        assert torch.equal(y, (x[:, 0] / 3).long() * 10)
    # reproducible run to run: the same seed gives the same orders; another seed others
    again = as_batch_iterable((X, Y), batch_size=4, shuffle=True, seed=123)
    assert [_rows(again) for _ in range(4)] == epochs
    other = as_batch_iterable((X, Y), batch_size=4, shuffle=True, seed=124)
    assert [_rows(other) for _ in range(4)] != epochs
    # the order of epoch e is randperm from a generator seeded with epoch_seed(seed, e)
    for e in range(4):
        ref = torch.randperm(10, generator=torch.Generator().manual_seed(epoch_seed(123, e))).tolist()
        assert _flat(epochs[e]) == ref


def test_set_epoch_picks_the_order_and_first_does_not_advance():
    X, Y = _xy(10)
    b = as_batch_iterable((X, Y), batch_size=3, shuffle=True, seed=7)
    orders = [_rows(b) for _ in range(3)]
    resumed = as_batch_iterable((X, Y), batch_size=3, shuffle=True, seed=7)
    resumed.set_epoch(2)
    assert _rows(resumed) == orders[2]
    assert resumed.epoch == 3
    b.set_epoch(1)
    x0, _ = b.first()
    assert b.epoch == 1 and (x0[:, 0] / 3).long().tolist() == orders[1][0]
    state = b.state_dict()
    fresh = as_batch_iterable((X, Y), batch_size=3, shuffle=True, seed=99)
    fresh.load_state_dict(state)
    assert fresh.seed == 7 and _rows(fresh) == orders[1]


def test_shuffle_without_seed_draws_one_base_seed_from_the_global_rng():
    X, Y = _xy(12)
    torch.manual_seed(5)
    a = as_batch_iterable((X, Y), batch_size=5, shuffle=True)
    torch.manual_seed(5)
    b = as_batch_iterable((X, Y), batch_size=5, shuffle=True)
    assert isinstance(a.seed, int) and a.seed == b.seed
    assert [_rows(a) for _ in range(2)] == [_rows(b) for _ in range(2)]


def test_shuffled_xy_cannot_be_materialised():
    X, Y = _xy(6)
    with pytest.raises(TypeError, match="materialise"):
        as_batch_iterable((X, Y), shuffle=True, seed=0).materialise()
    loader = DataLoader(TensorDataset(X, Y), batch_size=2)
    with pytest.raises(TypeError, match="DataLoader"):
        as_batch_iterable(loader).materialise()


# ---------------------------------------------------------------------------- DataLoader / Dataset
def test_dataloader_batches_as_pairs():
    X, Y = _xy(10)
    loader = DataLoader(TensorDataset(X, Y), batch_size=4)
    b = as_batch_iterable(loader)
    assert not b.is_list and len(b) == 3
    got = list(b)
    assert all(isinstance(p, tuple) for p in got)
    assert torch.equal(torch.cat([x for x, _ in got]), X) and torch.equal(torch.cat([y for _, y in got]), Y)


def test_dataloader_of_dicts():
    class D(Dataset):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            return {"input": torch.full((2,), float(i)), "target": torch.tensor([float(i)])}

    b = as_batch_iterable(DataLoader(D(), batch_size=2))
    assert [y[:, 0].tolist() for _, y in b] == [[0.0, 1.0], [2.0, 3.0], [4.0]]


def test_set_epoch_forwards_to_a_distributed_sampler():
    from torch.utils.data.distributed import DistributedSampler

    X, Y = _xy(8)
    ds = TensorDataset(X, Y)
    sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=3)
    b = as_batch_iterable(DataLoader(ds, batch_size=2, sampler=sampler))
    b.set_epoch(5)
    assert sampler.epoch == 5
    rows = _flat(_rows(b))
    ref = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=3)
    ref.set_epoch(5)
    assert rows == list(ref)
    list(b)  # the next epoch (6) reaches the sampler too
    assert sampler.epoch == 6


def test_map_dataset_is_batched_and_seeded():
    X, Y = _xy(10)
    ds = TensorDataset(X, Y)
    b = as_batch_iterable(ds, batch_size=4)
    assert len(b) == 3 and _rows(b) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    state = torch.get_rng_state()
    s1 = as_batch_iterable(ds, batch_size=4, shuffle=True, seed=11)
    s2 = as_batch_iterable(ds, batch_size=4, shuffle=True, seed=11)
    e1 = [_rows(s1) for _ in range(3)]
    assert [_rows(s2) for _ in range(3)] == e1
    assert torch.equal(torch.get_rng_state(), state)
    assert len({tuple(_flat(r)) for r in e1}) == 3 and all(sorted(_flat(r)) == list(range(10)) for r in e1)
    s2.set_epoch(1)
    assert _rows(s2) == e1[1]
    assert len(as_batch_iterable(ds, batch_size=4, drop_last=True)) == 2
    assert [x.shape[0] for x, _ in as_batch_iterable(TensorDataset(torch.randn(40, 1), torch.randn(40, 1)))] == [32, 8]


def test_iterable_dataset_is_batched_in_its_order():
    class Stream(IterableDataset):
        def __iter__(self):
            for i in range(5):
                yield torch.tensor([float(i)]), torch.tensor([2.0 * i])

    b = as_batch_iterable(Stream(), batch_size=2)
    assert not b.sized
    with pytest.raises(TypeError, match="not known"):
        len(b)
    assert [x[:, 0].tolist() for x, _ in b] == [[0.0, 1.0], [2.0, 3.0], [4.0]]
    assert [y[:, 0].tolist() for _, y in b] == [[0.0, 2.0], [4.0, 6.0], [8.0]]


def test_a_batches_object_passes_through():
    X, Y = _xy(4)
    b = as_batch_iterable((X, Y), batch_size=2)
    assert as_batch_iterable(b) is b


# ------------------------------------------------------------------------------------ bad input
def _pair():
    return torch.randn(2, 3), torch.randn(2, 1)


@pytest.mark.parametrize(
    "data, kwargs, exc, match",
    [
        ([], {}, ValueError, "data is empty"),
        ((torch.randn(0, 3), torch.randn(0, 1)), {}, ValueError, "0 rows"),
        ((torch.randn(4, 3), torch.randn(5, 1)), {}, ValueError, r"same number of rows.*\[4, 3\].*\[5, 1\]"),
        ((torch.tensor(1.0), torch.randn(5, 1)), {}, ValueError, "first"),
        ([_pair()], {"batch_size": 4}, ValueError, "batch_size=4 does not apply to a list"),
        ([_pair()], {"shuffle": True}, ValueError, "shuffle=True does not apply to a list"),
        ((torch.randn(4, 3), torch.randn(4, 1)), {"batch_size": 0}, ValueError, "batch_size must be >= 1, got 0"),
        ((torch.randn(4, 3), torch.randn(4, 1)), {"batch_size": 2.0}, TypeError, "batch_size must be a positive int"),
        ((torch.randn(4, 3), torch.randn(4, 1)), {"batch_size": True}, TypeError, "batch_size"),
        ((torch.randn(4, 3), torch.randn(4, 1)), {"shuffle": 1}, TypeError, "shuffle must be True or False, got 1"),
        ((torch.randn(4, 3), torch.randn(4, 1)), {"drop_last": "yes"}, TypeError, "drop_last must be True or False"),
        ((torch.randn(4, 3), torch.randn(4, 1)), {"seed": 1.5}, TypeError, "seed must be an int"),
        ((torch.randn(4, 3), torch.randn(4, 1)), {"batch_size": 8, "drop_last": True}, ValueError, "leaves no batch"),
        (torch.zeros(3), {}, TypeError, "data must be a list.*Tensor.*single batch"),
        ("abc", {}, TypeError, "data must be a list"),
        (5, {}, TypeError, "data must be a list"),
        (TrainingBatch(*_pair()), {}, TypeError, "wrap it in a list"),
        ([torch.randn(4, 3), torch.randn(4, 1)], {}, TypeError, r"pass the tuple \(X, Y\)"),
        ([_pair(), (torch.randn(2, 3),)], {}, TypeError, "batch 1 must be a TrainingBatch.*tuple of length 1"),
        ([{"x": 1, "y": 2}], {}, TypeError, "dict without 'input' and 'target'"),
        ([(torch.randn(3, 2), torch.randn(2, 1))], {}, ValueError, "batch 0: target must have the input's batch size 3"),
        ([(torch.tensor(1.0), torch.randn(1, 1))], {}, ValueError, r"batch 0: input must be \[batch"),
        ([(["a"], torch.randn(1, 1))], {}, TypeError, "batch 0: input must be a tensor"),
    ],
)
def test_bad_input(data, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        as_batch_iterable(data, **kwargs)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="^validation_data is empty"):
        as_batch_iterable([], name="validation_data")
    with pytest.raises(TypeError, match="^batches must be a list"):
        as_batch_iterable(torch.zeros(3), name="batches")
    with pytest.raises(TypeError, match="name must be a str"):
        as_batch_iterable([_pair()], name=3)


def test_bad_dataloader_and_dataset_arguments_consume_nothing():
    class Counting(Dataset):
        def __init__(self, item, n=4):
            self.item, self.n, self.reads = item, n, 0

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            self.reads += 1
            return self.item

    ds = Counting((torch.ones(2), torch.ones(1)))
    loader = DataLoader(ds, batch_size=2)
    for kwargs, match in (({"batch_size": 2}, "batch_size=2 does not apply to a DataLoader"),
                          ({"shuffle": True}, "shuffle=True does not apply to a DataLoader"),
                          ({"drop_last": True}, "drop_last=True does not apply to a DataLoader")):
        with pytest.raises(ValueError, match=match):
            as_batch_iterable(loader, **kwargs)
    assert ds.reads == 0
    with pytest.raises(ValueError, match="the DataLoader has no batches"):
        as_batch_iterable(DataLoader(Counting((1, 2), n=0)))
    with pytest.raises(ValueError, match="the Dataset has 0 items"):
        as_batch_iterable(Counting((1, 2), n=0))
    with pytest.raises(TypeError, match=r"items must be \(x, y\) pairs.*item 0 = Tensor"):
        as_batch_iterable(Counting(torch.ones(3)))
    with pytest.raises(TypeError, match=r"items must be \(x, y\) pairs.*tuple of length 1"):
        as_batch_iterable(TensorDataset(torch.ones(4, 2)))

    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.ones(1), torch.ones(1)

    with pytest.raises(ValueError, match="shuffle=True does not apply to an IterableDataset"):
        as_batch_iterable(Stream(), shuffle=True)


def test_a_bad_streamed_batch_names_its_index():
    class Ragged(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return torch.ones(2), torch.ones(1)

    def collate(items):  # a collate function that returns the wrong structure from batch 1 on
        collate.calls = getattr(collate, "calls", 0) + 1
        return (torch.ones(2, 2), torch.ones(2, 1)) if collate.calls == 1 else torch.ones(2, 2)

    b = as_batch_iterable(DataLoader(Ragged(), batch_size=2, collate_fn=collate), name="batches")
    it = iter(b)
    next(it)
    with pytest.raises(TypeError, match="batches: batch 1 must be a TrainingBatch"):
        next(it)


def test_set_epoch_bad_values():
    b = as_batch_iterable([_pair()])
    with pytest.raises(ValueError, match="epoch must be >= 0, got -1"):
        b.set_epoch(-1)
    with pytest.raises(TypeError, match="epoch must be an int"):
        b.set_epoch(1.0)


# --------------------------------------------------------------------------------- predict_inputs
def test_predict_inputs_forms():
    X, Y = _xy(10)
    assert [x.shape[0] for x in predict_inputs(X, 4)] == [4, 4, 2]
    assert torch.equal(torch.cat(list(predict_inputs(X, 4))), X)
    assert [x.shape[0] for x in predict_inputs(X)] == [10]
    assert torch.equal(torch.cat(list(predict_inputs((X, Y), 3))), X)
    xs = [torch.randn(2, 3), torch.randn(1, 3)]
    got = list(predict_inputs([(xs[0], torch.ones(2)), TrainingBatch(xs[1], torch.ones(1))]))
    assert got[0] is xs[0] and got[1] is xs[1]
    assert [x is e for x, e in zip(predict_inputs(xs), xs)] == [True, True]  # bare tensors are input batches
    assert torch.equal(torch.cat(list(predict_inputs(DataLoader(TensorDataset(X, Y), batch_size=3)))), X)
    assert torch.equal(torch.cat(list(predict_inputs(DataLoader(X, batch_size=3)))), X)  # tensor batches
    assert torch.equal(torch.cat(list(predict_inputs(TensorDataset(X), 4))), X)  # 1-tuples: first element
    assert [x.shape[0] for x in predict_inputs(TensorDataset(X, Y), 4)] == [4, 4, 2]
    assert torch.equal(torch.cat(list(predict_inputs(np.ones((3, 2)), 2))), torch.ones(3, 2, dtype=torch.float64))


@pytest.mark.parametrize(
    "data, batch_size, exc, match",
    [
        (torch.randn(0, 3), None, ValueError, r"n >= 1, got shape \[0, 3\]"),
        (torch.tensor(2.0), None, ValueError, "n >= 1"),
        ((torch.randn(4, 3), torch.randn(5)), None, ValueError, "same number of rows"),
        ([], None, ValueError, "data is empty"),
        ([torch.randn(2, 3)], 2, ValueError, "batch_size=2 does not apply to a list"),
        (DataLoader(TensorDataset(torch.randn(4, 1)), batch_size=2), 2, ValueError, "does not apply to a DataLoader"),
        (torch.randn(4, 3), 0, ValueError, "batch_size must be >= 1"),
        (torch.randn(4, 3), "8", TypeError, "batch_size must be a positive int"),
        ("text", None, TypeError, "data must be a tensor X"),
        ([{"x": 1}], None, TypeError, "batch 0 is a dict without"),
    ],
)
def test_predict_inputs_bad_input(data, batch_size, exc, match):
    with pytest.raises(exc, match=match):
        predict_inputs(data, batch_size)


def test_numpy_x_y_trains_and_validates_like_tensors():
    """An (X, Y) pair of NumPy arrays works wherever data is accepted (train() and validation_data),
    batched and shuffled exactly as the same pair of tensors."""
    import numpy as np

    from torchloom import Dense, Network, TrainingConfig, train

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((40, 3)).astype(np.float32), rng.integers(0, 2, 40)
    runs = []
    for xs, ys in ((x, y), (torch.from_numpy(x), torch.from_numpy(y))):
        torch.manual_seed(0)
        net = Network(Dense(3, 5, "tanh"), Dense(5, 2))
        r = train(net, (xs, ys), TrainingConfig(epochs=3, batch_size=8, shuffle=True, seed=1, loss_type="cross_entropy",
                                                 validation_data=(xs[:10], ys[:10]), metrics=("accuracy",), verbose=0))
        runs.append((r.loss_history, r.history["val_loss"], [p.detach().clone() for p in net.parameters()]))
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2]))
