"""The PyTorch kernels of a run noted, kept and loaded on helper threads by the next run
(``torchloom/trainers/op_warm.py``)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import torchloom
from torchloom import Dense, Network, TrainingConfig
from torchloom.engine import op_warm
from torchloom.engine.start import _data_signature

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_real_resolve = op_warm._resolve


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHLOOM_WARM_OPS", raising=False)


def _record(fn, dev=torch.device("cpu")):
    rec = op_warm.OpRecorder(dev)
    with rec:
        fn()
    return rec.specs


def _names(specs):
    return [s["op"] for s in specs]


def test_recorder_notes_kernel_ops_once_in_order_and_leaves_value_readers_out():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(8, 4, generator=g), torch.randn(3, 4, generator=g), torch.randn(3, generator=g)
    idx = torch.tensor([0, 2])
    out = torch.empty(2, 8, 4)

    def step():
        y = torch.addmm(b, x, w.t())
        z = torch.relu(y)
        torch.randn(3)  # draws random numbers: never replayed
        torch.index_select(x, 0, idx)  # reads values as indices: never replayed
        torch.stack([x, x], out=out)
        (z > 0).sum()
        torch.addmm(b, x, w.t())  # the same op and layout again: noted once

    specs = _record(step)
    assert _names(specs) == [
        "aten::addmm.default", "aten::relu.default", "aten::stack.out", "aten::gt.Scalar", "aten::sum.default",
    ]
    addmm = specs[0]["args"]["l"]
    assert addmm[2] == {"t": [[4, 3], [1, 4], "float32", 0]}  # the transposed weight's strides are kept
    json.dumps(specs)  # plain JSON: no tensor is held


def test_recorder_leaves_out_tensors_on_another_device():
    specs = _record(lambda: torch.ones(3) + 1, dev=torch.device("meta"))
    assert specs == []


def test_replay_runs_each_op_on_scratch_tensors_without_touching_the_random_stream():
    x = torch.randn(5, 3)
    specs = _record(lambda: (torch.sigmoid(x), torch.cat([x, x]), x.to(torch.float64), torch.zeros(4)))
    assert len(specs) == 4
    state = torch.get_rng_state()
    calls = []
    real = torch.ops.aten.sigmoid.default

    class Spy:  # the replayed op gets fresh tensors of the noted layout, not the recorded ones
        _schema, tags = real._schema, real.tags

        def __call__(self, *args, **kwargs):
            calls.append(args)
            return real(*args, **kwargs)

    spy = Spy()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(op_warm, "_resolve", lambda name: spy if name == "aten::sigmoid.default" else _real_resolve(name))
        assert [op_warm.replay_one(s, torch.device("cpu")) for s in specs] == [True] * 4
    assert len(calls) == 1 and calls[0][0].shape == x.shape and calls[0][0].data_ptr() != x.data_ptr()
    assert torch.equal(torch.get_rng_state(), state)


def test_replay_skips_what_it_cannot_rebuild():
    cpu = torch.device("cpu")
    assert not op_warm.replay_one({"op": "aten::no_such_op.default", "args": {"l": []}}, cpu)
    big = {"op": "aten::relu.default", "args": {"l": [{"t": [[1 << 25], [1], "float32", 0]}]}}  # 128 MB > 64 MB
    assert not op_warm.replay_one(big, cpu)
    bad = {"op": "aten::relu.default", "args": {"l": [{"what": 1}]}}
    assert not op_warm.replay_one(bad, cpu)
    misaligned = {"op": "aten::relu.default", "args": {"l": [{"t": [[4, 2], [2, 1], "float32", 1]}]}}
    assert op_warm.replay_one(misaligned, cpu)


def test_threads_run_every_op_and_put_the_switch_interval_back():
    x = torch.randn(6, 6)
    specs = _record(lambda: [torch.exp(x), torch.tanh(x), x @ x, x.sum(1), torch.cat([x, x]), x.abs(), x * 2, x - 1, x / 3])
    assert len(specs) == 9
    before = sys.getswitchinterval()
    warm = op_warm.OpWarm(specs, torch.device("cpu"))
    warm.join()
    assert warm.done == 9
    assert sys.getswitchinterval() == before
    assert op_warm.OpWarm([], torch.device("cpu")).done == 0  # nothing to do: no thread


def test_lists_are_kept_per_key_atomically_and_bad_files_read_as_none(tmp_path):
    specs = _record(lambda: torch.ones(2) * 3)
    key = op_warm.run_key(["a", 1])
    assert op_warm.run_key(["a", 1]) == key and op_warm.run_key(["a", 2]) != key
    assert op_warm.load(key) is None
    assert op_warm.save(key, specs)
    assert op_warm.load(key) == specs
    path = tmp_path / "cache" / "ops" / f"{key}.json"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    path.write_text("{not json")
    assert op_warm.load(key) is None
    path.write_text(json.dumps({"format": 999, "ops": specs}))
    assert op_warm.load(key) is None


def test_an_unwritable_cache_is_no_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(blocker / "below-a-file"))
    assert not op_warm.save("k", [])


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHLOOM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert op_warm.cache_dir() == tmp_path / "xdg" / "torchloom"


def test_the_data_signature_tells_batch_shapes_apart():
    cfg = TrainingConfig()
    a = [(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)), (torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))]
    b = [(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)), (torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))]
    assert _data_signature(a, cfg) != _data_signature(b, cfg)
    assert _data_signature(a, cfg) == _data_signature(list(a), cfg)
    assert _data_signature((torch.zeros(10, 3), torch.zeros(10)), cfg)[0] == "tensors"
    assert _data_signature(iter(a), cfg) is None and _data_signature([], cfg) is None


# --------------------------------------------------------------------------------------- on the GPU
def _run(data, method):
    torch.manual_seed(0)
    net = Network(Dense(12, 16, "relu"), Dense(16, 3, "linear")).cuda()
    cfg = TrainingConfig(epochs=2, verbose=0, seed=3, loss_type="cross_entropy" if method == "backprop" else "mse", method=method)
    result = torchloom.train(net, data, cfg)
    return result, [p.detach().cpu() for p in net.parameters()]


@CUDA
@pytest.mark.parametrize("method", ["backprop", "tween", "target_prop"])
def test_a_second_run_warms_the_first_runs_kernels_and_trains_the_same(monkeypatch, method):
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 12, generator=g).cuda(), torch.randint(0, 3, (8,), generator=g).cuda()) for _ in range(5)]
    data.append((torch.randn(3, 12, generator=g).cuda(), torch.randint(0, 3, (3,), generator=g).cuda()))
    if method != "backprop":
        data = [(x, torch.nn.functional.one_hot(y, 3).float()) for x, y in data]
    started = []
    real = op_warm.OpWarm

    def counting(specs, device):
        warm = real(specs, device)
        started.append((warm, len(specs)))
        return warm

    monkeypatch.setattr(op_warm, "OpWarm", counting)
    first, w_first = _run(data, method)  # notes its kernels
    files = list(op_warm.cache_dir().glob("ops/*.json"))
    assert len(files) == 1 and not started
    names = {s["op"] for s in json.loads(files[0].read_text())["ops"]}
    assert "aten::addmm.default" in names or "aten::mm.default" in names
    second, w_second = _run(data, method)  # warms them on helper threads
    assert len(started) == 1 and started[0][1] == len(json.loads(files[0].read_text())["ops"])
    assert started[0][0].done > 0
    monkeypatch.setenv("TORCHLOOM_WARM_OPS", "0")
    third, w_third = _run(data, method)  # no warming
    assert len(started) == 1
    assert first.loss_history == second.loss_history == third.loss_history
    for a, b, c in zip(w_first, w_second, w_third):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_workers_that_cannot_start_count_as_ended(monkeypatch):
    """When no more threads can be had, the started workers do every op and the switch interval still
    comes back."""
    x = torch.randn(4, 4)
    specs = _record(lambda: [torch.exp(x), torch.tanh(x), x @ x, x.abs()])
    real_start = op_warm.threading.Thread.start
    started = []

    def start(self):
        if len(started) >= 2:
            raise RuntimeError("can't start new thread")
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(op_warm.threading.Thread, "start", start)
    before = sys.getswitchinterval()
    warm = op_warm.OpWarm(specs, torch.device("cpu"))
    warm.join()
    assert warm.done == 4 and len(started) == 2
    assert sys.getswitchinterval() == before


def test_replay_counts_outputs_and_keeps_to_what_a_recorder_would_note(monkeypatch):
    cpu = torch.device("cpu")
    x = torch.randn(3, 4)
    (spec,) = _record(lambda: torch.exp(x))
    assert spec["out_bytes"] == x.numel() * 4
    assert op_warm.replay_one(spec, cpu)
    assert not op_warm.replay_one(dict(spec, out_bytes=65 << 20), cpu)  # its output alone is over 64 MB
    random_op = {"op": "aten::normal_.default", "args": {"l": [{"t": [[4], [1], "float32", 0]}]}, "kwargs": {}}
    assert not op_warm.replay_one(random_op, cpu)  # a list from elsewhere cannot replay a random draw
    not_a_dtype = {"op": "aten::relu.default", "args": {"l": [{"t": [[4], [1], "Tensor", 0]}]}}
    assert not op_warm.replay_one(not_a_dtype, cpu)
    w = torch.randn(2, 2, 3, 3)
    (conv,) = [s for s in _record(lambda: torch.nn.functional.conv2d(torch.randn(1, 2, 5, 5), w)) if "convolution" in s["op"]]
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert not op_warm.replay_one(conv, cpu)  # cuDNN would time its algorithms under the helpers' load
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    assert op_warm.replay_one(conv, cpu)


def test_the_cache_keeps_the_newest_lists(tmp_path, monkeypatch):
    import os

    monkeypatch.setattr(op_warm, "_MAX_LISTS", 3)
    for i in range(5):
        assert op_warm.save(f"k{i}", [])
        os.utime(op_warm._path(f"k{i}"), (1000 + i, 1000 + i))
    assert op_warm.save("k5", [])
    assert sorted(p.stem for p in (tmp_path / "cache" / "ops").iterdir()) == ["k3", "k4", "k5"]


def test_cancel_leaves_the_ops_not_yet_started(monkeypatch):
    import time

    monkeypatch.setattr(op_warm, "replay_one", lambda spec, device: time.sleep(0.01) or True)
    warm = op_warm.OpWarm([{"op": "x"}] * 200, torch.device("cpu"))
    warm.cancel()
    warm.join()
    assert warm.done < 200


def _key_of(monkeypatch, data, **cfg):
    """The run key ``Trainer._start_op_warm`` asks the cache for (the decision made as on a GPU)."""
    from torchloom.engine.train import make_trainer

    asked = []
    monkeypatch.setattr(op_warm, "load", lambda key: asked.append(key))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    torch.manual_seed(0)
    trainer = make_trainer(Network(Dense(3, 4, "relu"), Dense(4, 2)), TrainingConfig(verbose=0, **cfg))
    trainer.device = torch.device("cuda", 0)  # only the decision is exercised: no CUDA call is made
    monkeypatch.setattr(type(trainer), "device_ready", lambda self: True)
    trainer._start_op_warm(data)
    assert len(asked) == 1 and trainer._op_record_key == asked[0]
    return asked[0]


def test_run_keys_are_the_same_in_every_process_and_follow_what_changes_kernels(monkeypatch):
    from torchloom import TargetPropConfig
    from torchloom.optim.schedules import linear_decay

    class Obs:
        def on_epoch_end(self, *a):
            pass

    data = [(torch.randn(4, 3), torch.rand(4, 2)) for _ in range(3)]
    a = _key_of(monkeypatch, data, method=TargetPropConfig(learning_rate=0.01), observers=[Obs()], scheduler=linear_decay(0.1, 0.01, 100))
    b = _key_of(monkeypatch, data, method=TargetPropConfig(learning_rate=0.05), observers=[Obs(), Obs()],
                scheduler=linear_decay(0.2, 0.02, 500), epochs=7, seed=3)
    assert a == b  # no address, no rate's size, no epochs or seed in the key
    assert _key_of(monkeypatch, data, method=TargetPropConfig(mode="pure")) != _key_of(monkeypatch, data, method=TargetPropConfig())
    clip = _key_of(monkeypatch, data, gradient_clip=1)
    assert clip == _key_of(monkeypatch, data, gradient_clip=2.5) != _key_of(monkeypatch, data)
    assert _key_of(monkeypatch, data, loss_type="cross_entropy", method="backprop") != _key_of(monkeypatch, data, method="backprop")
    assert _key_of(monkeypatch, data[:2]) != _key_of(monkeypatch, [*data[:2], (torch.randn(1, 3), torch.rand(1, 2))])


def test_an_in_place_op_on_a_view_of_a_big_buffer_is_not_charged_the_buffer():
    buf = torch.zeros(1 << 24)  # 64 MB
    view, src = buf[:1024], torch.ones(1024)
    specs = _record(lambda: (view.copy_(src), view.add_(src), torch.exp(view)))
    assert [s["out_bytes"] for s in specs] == [0, 0, 4096]
    assert all(op_warm.replay_one(s, torch.device("cpu")) for s in specs)


def test_torch_attributes_are_checked_for_their_kind():
    assert op_warm._torch_attr("float32", torch.dtype) is torch.float32
    for name, kind in (("manual_seed", torch.dtype), ("float32", torch.memory_format), (3, torch.dtype)):
        with pytest.raises(op_warm._Unwarmable):
            op_warm._torch_attr(name, kind)


def test_noting_never_fails_the_op_it_watches(monkeypatch):
    def broken(func):
        raise AttributeError("an operator without a schema")

    monkeypatch.setattr(op_warm, "_warmable", broken)
    x = torch.randn(3)
    rec = op_warm.OpRecorder(torch.device("cpu"))
    with rec:
        y = torch.exp(x)
    assert torch.equal(y, torch.exp(x)) and rec.specs == []
