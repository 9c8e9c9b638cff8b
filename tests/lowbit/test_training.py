"""Training in a Loom dtype through the engine: every method, the master's update against a float64
autograd reference, exact resume, bf16-mixed precision, and the refusals."""

from __future__ import annotations

import pytest
import torch

from torchloom import Checkpoint, Dense, LowBitConfig, Network, TargetPropConfig, TrainingConfig, TweenConfig, train
from torchloom.engine.loop import Trainer
from torchloom.lowbit import decode, encode, quantize, scale_for


def _net(seed=0, bias=False):
    torch.manual_seed(seed)
    return Network(Dense(6, 10, "tanh", bias=bias), Dense(10, 4, "sigmoid", bias=bias))


def _data(n=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return [(x[i:i + 16], torch.randint(0, 4, (16,), generator=g)) for i in range(0, n, 16)]


def _on_grid(net):
    for m in (net.layers[0], net.layers[1]):
        tag = m.loom_lowbit
        w = m.weight.detach()
        assert torch.equal(decode(encode(w, tag["dtype"], tag["scale"]), tag["dtype"], tag["scale"]), w)


METHODS = {
    "backprop": dict(loss_type="cross_entropy", optimizer="momentum", learning_rate=0.1),
    "target_prop": dict(method=TargetPropConfig(learning_rate=0.05, gate_threshold=0.3)),
    "tween": dict(method=TweenConfig(base_rate=0.05), loss_type="cross_entropy"),
}


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("dtype,master", [("int4", "fp32"), ("int8", "none"), ("ternary", "fp32")])
def test_every_method_trains_on_the_dtype_grid(name, dtype, master):
    net = _net()
    res = train(net, _data(), TrainingConfig(epochs=4, verbose=0, weight_dtype=dtype,
                                             low_bit=LowBitConfig(master=master), **METHODS[name]))
    assert all(l == l for l in res.loss_history)
    _on_grid(net)


def test_master_takes_the_sgd_update_of_the_quantised_forward():
    """One SGD step on int8 (nearest): master1 = w0 − lr·∇L(q0), q1 = Q(master1); reference in float64
    with autograd over the quantised weights (straight-through: the gradient at q0)."""
    net = _net()
    w0 = [p.detach().clone() for p in net.parameters()]
    (x, y), = _data(16)
    t = Trainer(net, TrainingConfig(epochs=1, verbose=0, weight_dtype="int8", learning_rate=0.3,
                                    low_bit=LowBitConfig(rounding="nearest"), loss_type="mse"))
    target = torch.nn.functional.one_hot(y, 4).double()
    q0 = [quantize(w, "int8", scale_for(w, "int8")).double().requires_grad_() for w in w0]
    h = torch.tanh(x.double() @ q0[0].T)
    out = torch.sigmoid(h @ q0[1].T)
    loss = ((out - target) ** 2).mean()
    loss.backward()
    t.fit([(x, target.float())], 1)
    masters = t.lowbit.masters()
    for w, q, m, p in zip(w0, q0, [masters["layers.0"][0], masters["layers.1"][0]], net.parameters()):
        want = w.double() - 0.3 * q.grad
        torch.testing.assert_close(m.double(), want, rtol=0, atol=1e-6)
        assert torch.equal(p.detach(), quantize(m, "int8", scale_for(m, "int8")))


@pytest.mark.parametrize("master", ["fp32", "none"])
def test_resume_is_exact(tmp_path, master):
    cfg = dict(verbose=0, weight_dtype={"layers.0": "int4" if master == "fp32" else "int8", "layers.1": "bfloat16"},
               low_bit=LowBitConfig(master=master, rounding="stochastic"), loss_type="cross_entropy",
               optimizer="momentum", learning_rate=0.1, seed=3)
    full = _net()
    train(full, _data(), TrainingConfig(epochs=4, **cfg))
    half = _net()
    path = tmp_path / "c.pt"
    train(half, _data(), TrainingConfig(epochs=2, observers=[Checkpoint(str(path))], **cfg))
    resumed = _net(seed=9)
    train(resumed, _data(), TrainingConfig(epochs=4, resume_from=str(path), **cfg))
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_bf16_mixed_precision_keeps_the_grid():
    net = _net()
    train(net, _data(), TrainingConfig(epochs=2, verbose=0, weight_dtype="fp8e4m3", precision="bf16-mixed",
                                       loss_type="cross_entropy", learning_rate=0.1))
    _on_grid(net)


def test_a_layer_left_in_float32_by_the_dict():
    net = _net()
    before = net.layers[1].weight.detach().clone()
    train(net, _data(), TrainingConfig(epochs=1, verbose=0, weight_dtype={"0": "int4", "1": None}, learning_rate=1e-9,
                                       loss_type="cross_entropy"))
    assert not hasattr(net.layers[1], "loom_lowbit")
    torch.testing.assert_close(net.layers[1].weight.detach(), before, rtol=0, atol=1e-6)
    w, s = net.layers[0].weight.detach(), net.layers[0].loom_lowbit["scale"]
    assert net.layers[0].loom_lowbit["dtype"] == "int4"
    assert torch.equal(decode(encode(w, "int4", s), "int4", s), w)


def test_refusals_name_the_field_and_value():
    with pytest.raises(ValueError, match=r"TrainingConfig: weight_dtype 'int4' cannot train with master='none'"):
        TrainingConfig(weight_dtype="int4", low_bit=LowBitConfig(master="none"))
    with pytest.raises(ValueError, match=r"TrainingConfig: weight_dtype: unknown Loom dtype 'int3'; valid: float64"):
        TrainingConfig(weight_dtype="int3")
    with pytest.raises(TypeError, match=r"TrainingConfig: low_bit must be None or a torchloom.LowBitConfig, got dict"):
        TrainingConfig(weight_dtype="int8", low_bit={"master": "none"})
    with pytest.raises(TypeError, match=r"TrainingConfig: weight_dtype must be None, a Loom dtype name"):
        TrainingConfig(weight_dtype=8)
    with pytest.raises(ValueError, match=r"LowBitConfig: master must be one of \('fp32', 'none'\), got 'fp16'"):
        LowBitConfig(master="fp16")
    with pytest.raises(ValueError, match=r"LowBitConfig: loom_compat=True is Loom's own update"):
        LowBitConfig(loom_compat=True, rounding="nearest")
    with pytest.raises(ValueError, match=r"weight_dtype names layer 'layers.7', which owns no trainable parameter"):
        train(_net(), _data(), TrainingConfig(epochs=1, verbose=0, weight_dtype={"layers.7": "int8"}))
    with pytest.raises(ValueError, match=r"weight_dtype needs float32 parameters .* got torch.float64 for layer 'layers.0'"):
        train(Network(Dense(6, 4, dtype=torch.float64)), [(torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64))],
              TrainingConfig(epochs=1, verbose=0, weight_dtype="int8"))


def test_device_step_requantises_like_the_host_loop():
    """The device runner (eager, on CPU here; graph-captured on CUDA): the same weights as the host
    loop, on the grid; a step the step guard refuses (a NaN batch) changes neither master nor weights."""
    from torchloom.engine.cuda_path import CudaRunner

    data = _data()
    runs = []
    for device_path in (False, True):
        for dtype, kw in (("int4", {}), ("int8", {"master": "none"})):
            net = _net()
            cfg = TrainingConfig(epochs=2, verbose=0, weight_dtype=dtype, low_bit=LowBitConfig(**kw), loss_type="cross_entropy",
                                 optimizer="momentum", learning_rate=0.1, seed=1)
            t = Trainer(net, cfg)
            if device_path:
                t.kernel_backend = "reference"
                t._runner = CudaRunner(t)
                t._build_runner = lambda: None
            t.fit(data, 2)
            if device_path:
                assert int(t._lowbit_step) == 6  # requantised on the device, 3 batches × 2 epochs
            _on_grid(net)
            runs.append([p.detach().clone() for p in net.parameters()])
    for host, dev in zip(runs[:2], runs[2:]):
        for a, b in zip(host, dev):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    net = _net()
    t = Trainer(net, TrainingConfig(epochs=1, verbose=0, weight_dtype="int8", low_bit=LowBitConfig(master="none"),
                                    loss_type="cross_entropy", learning_rate=0.1))
    t.kernel_backend = "reference"
    t._build_runner = lambda: None
    t.setup()
    t.lowbit.start()
    t._runner = CudaRunner(t)
    before = [p.detach().clone() for p in net.parameters()]
    bad = [(torch.full((16, 6), float("nan")), torch.zeros(16, dtype=torch.long))]
    with pytest.warns(Warning):
        t.fit(bad, 1)
    for a, b in zip(before, net.parameters()):
        assert torch.equal(a, b.detach())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,kw", [("int8", {}), ("int4", {"rounding": "stochastic"}), ("fp8e4m3", {}),
                                      ("bfloat16", {"master": "none"}), ("int8", {"loom_compat": True})])
def test_cuda_graph_captures_the_requantisation(dtype, kw):
    """On CUDA the requantisation sits inside the captured steps (cuda_graph=True refuses to fall back)."""
    net = _net().cuda()
    t = Trainer(net, TrainingConfig(epochs=3, verbose=0, weight_dtype=dtype, low_bit=LowBitConfig(**kw), use_gpu=True,
                                    cuda_graph=True, loss_type="cross_entropy", optimizer="momentum", learning_rate=0.1))
    t.fit([(x.cuda(), y.cuda()) for x, y in _data()], 3)
    assert t.runner.capture_count > 0
    assert int(t._lowbit_step) == 9
    _on_grid(net)


def test_an_unsigned_weight_dtype_warns_that_each_layer_keeps_one_sign(recwarn):
    """uint dtypes decode as code·scale (one sign per layer, Loom's format): training them warns, naming
    the layers and the signed alternative; signed dtypes and ``loom_compat`` (reproducing Loom) do not.
    The run still trains, on the grid."""
    import warnings

    with pytest.warns(UserWarning, match=r"layers\.0: uint4, layers\.1: uint4 — Loom.s unsigned codes .* int4"):
        net = _net()
        train(net, _data(), TrainingConfig(epochs=1, verbose=0, weight_dtype="uint4", **METHODS["backprop"]))
    assert all((m.weight >= 0).all() or (m.weight <= 0).all() for m in net.layers)  # one sign per layer
    _on_grid(net)
    for dtype, cfg in (("int4", LowBitConfig()), ("uint8", LowBitConfig(loom_compat=True))):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*unsigned codes.*")
            train(_net(), _data(), TrainingConfig(epochs=1, verbose=0, weight_dtype=dtype, low_bit=cfg,
                                                  optimizer="sgd", learning_rate=0.01, loss_type="cross_entropy"))
