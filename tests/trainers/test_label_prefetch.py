"""Every batch's label range read in one go before a run (``losses.prefetched_label_bounds``): the
same answers as reading each batch, the same errors for a bad batch, and one host read for a list of
device batches."""

import pytest
import torch

import torchloom
from torchloom import Dense, Network, TargetPropConfig, TrainingConfig, TweenConfig
from torchloom.engine import losses


def test_bounds_equal_per_tensor_reads_and_fall_back_outside_the_prefetch():
    g = torch.Generator().manual_seed(0)
    ys = [torch.randint(-3, 9, (n,), generator=g) for n in (5, 5, 5, 2, 7)]
    ys.append(torch.randint(0, 4, (3, 2), generator=g, dtype=torch.int32))
    with losses.prefetched_label_bounds(ys):
        for y in ys:
            assert losses.label_bounds(y) == (int(y.min()), int(y.max()))
    assert losses.label_bounds(ys[0]) == (int(ys[0].min()), int(ys[0].max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the prefetch reads device tensors")
def test_answers_come_without_a_device_read_and_in_place_changes_are_not_served_stale():
    ys = [torch.randint(0, 10, (32,), device="cuda") for _ in range(50)] + [torch.randint(0, 10, (16,), device="cuda")]
    with losses.prefetched_label_bounds(ys):
        torch.cuda.set_sync_debug_mode("error")  # a host read of a device value would raise here
        try:
            got = [losses.label_bounds(y) for y in ys]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        ys[3][0] = 99  # changed after the read: its version moved, so it is read again
        assert losses.label_bounds(ys[3])[1] == 99
    assert got == [(int(y.min()), int(y.max())) for y in ys[:3]] + [got[3]] + [(int(y.min()), int(y.max())) for y in ys[4:]]


@pytest.mark.parametrize("method", ["backprop", TargetPropConfig(learning_rate=0.01), TweenConfig(base_rate=0.01)], ids=["backprop", "tp", "tween"])
def test_a_bad_batch_among_many_is_named_before_training(method):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, generator=g).to(dev), torch.randint(0, 2, (4,), generator=g).to(dev)) for _ in range(6)]
    data[4] = (data[4][0], torch.tensor([0, 1, 2, 1], device=dev))  # 2 is out of range for 2 outputs
    net = Network(Dense(3, 2, "linear"))
    before = [p.detach().clone() for p in net.parameters()]
    cfg = TrainingConfig(method=method, epochs=1, verbose=0, loss_type="cross_entropy" if method == "backprop" else "mse")
    with pytest.raises(ValueError, match=r"batch 4: .*\[0, 2\), got values in \[0, 2\]"):
        torchloom.train(net, data, cfg)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))


def test_batches_made_under_inference_mode_train(monkeypatch):
    """Inference tensors have no version counter: they are read when asked, never cached."""
    monkeypatch.setattr(losses, "_PREFETCH_CHUNK", 8)  # several stacked chunks per group
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.inference_mode():
        g = torch.Generator().manual_seed(2)
        data = [(torch.randn(4, 3, generator=g).to(dev), torch.randint(0, 2, (4,), generator=g).to(dev)) for _ in range(5)]
    with losses.prefetched_label_bounds([y for _, y in data]):
        assert [losses.label_bounds(y) for _, y in data] == [(int(y.min()), int(y.max())) for _, y in data]
    result = torchloom.train(Network(Dense(3, 2, "linear")), data, TrainingConfig(epochs=1, verbose=0, loss_type="cross_entropy"))
    assert len(result.loss_history) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the prefetch reads device tensors")
@pytest.mark.parametrize("host_reduce", [0, 1 << 20], ids=["reduced-on-device", "reduced-on-cpu"])
def test_chunked_stacking_gives_the_same_bounds(monkeypatch, host_reduce):
    monkeypatch.setattr(losses, "_PREFETCH_CHUNK", 64)  # 2 tensors of 32 per chunk
    monkeypatch.setattr(losses, "_HOST_REDUCE", host_reduce)
    ys = [torch.randint(-5, 10, (32,), device="cuda") for _ in range(7)]
    with losses.prefetched_label_bounds(ys):
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = [losses.label_bounds(y) for y in ys]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert got == [(int(y.min()), int(y.max())) for y in ys]
