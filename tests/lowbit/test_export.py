"""``to_loom_json(net, dtype=...)``: native codes and their scale. Read back by torchloom's importer
the trained forward is reproduced bit for bit; by real Loom (welvet) to float tolerance; and
``loom_compat`` training equals Loom v0.80's own ``Train`` in every dtype (same codes)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from torchloom import Dense, LowBitConfig, Network, TrainingConfig, from_loom_json, to_loom_json, train
from torchloom.lowbit import LOOM_DTYPES, quantize, scale_for

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from loom_oracle import LoomDense, welvet  # noqa: E402


def _trained(dtype, **kw):
    torch.manual_seed(0)
    net = Network(Dense(12, 8, "tanh", bias=False), Dense(8, 4, bias=False))
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(32, 12, generator=g), torch.randint(0, 4, (32,), generator=g)
    train(net, [(x, y)], TrainingConfig(epochs=3, loss_type="cross_entropy", learning_rate=0.1, verbose=0,
                                        weight_dtype=dtype, low_bit=LowBitConfig(**kw)))
    return net, x


@pytest.mark.parametrize("dtype", LOOM_DTYPES)
def test_export_import_reproduces_the_trained_forward_exactly(dtype):
    net, x = _trained(dtype)
    saved = to_loom_json(net)
    assert [layer["dtype"] for layer in saved["layers"]] == [dtype, dtype]
    back = from_loom_json(json.loads(json.dumps(saved)))
    with torch.no_grad():
        assert torch.equal(back(x), net(x))
    if welvet is not None:  # real Loom reads the same file and computes the same forward
        handle = welvet.deserialize_network(json.dumps(saved))
        try:
            loom = np.asarray(welvet.forward_polymorphic(handle, x.reshape(-1).tolist(), list(x.shape)), dtype=np.float32)
        finally:
            welvet.free_network(handle)
        np.testing.assert_allclose(loom.reshape(-1), net(x).detach().numpy().reshape(-1), rtol=1e-5, atol=1e-6)


def test_export_of_a_float_net_in_a_dtype_is_round_to_nearest_per_tensor():
    torch.manual_seed(0)
    net = Network(Dense(5, 3, bias=False))
    back = from_loom_json(to_loom_json(net, dtype="int4"))
    w = net.layers[0].weight.detach()
    assert torch.equal(back.layers[0].weight.detach(), quantize(w, "int4", scale_for(w, "int4")))


def test_export_refusals():
    net, _ = _trained("int8", scale="per_row")
    with pytest.raises(ValueError, match=r"to_loom_json: layer 0: trained in int8 with scale='per_row'; a Loom file holds one scale per layer"):
        to_loom_json(net)
    with pytest.raises(ValueError, match=r"to_loom_json: dtype: unknown Loom dtype 'int7'"):
        to_loom_json(net, dtype="int7")
    net, _ = _trained("int8")
    with torch.no_grad():
        net.layers[1].weight.add_(1e-3)
    with pytest.raises(ValueError, match=r"to_loom_json: layer 1: its weights are not int8 codes times the scale"):
        to_loom_json(net, dtype="int8")


@pytest.mark.loom
@pytest.mark.skipif(welvet is None, reason="needs Loom's Python binding welvet (pip install welvet==0.80.0)")
@pytest.mark.parametrize("dtype", LOOM_DTYPES)
def test_loom_compat_equals_loom_train(dtype, monkeypatch):
    """Three epochs of Loom's ``Train`` (MSE, SGD) on a Dense network whose layers are ``dtype``,
    from the same float32 weights: the same codes (bit for bit) and the same losses (Loom's scale
    set once, its truncating fp8 / float16 / bfloat16 encoders, round half away, int8 wrap)."""
    rng = np.random.default_rng(0)
    w = [rng.normal(0, 0.5, (5, 6)).astype(np.float32), rng.normal(0, 0.5, (3, 5)).astype(np.float32)]
    x = rng.normal(0, 1, (2, 4, 6)).astype(np.float32)
    t = rng.normal(0, 1, (2, 4, 3)).astype(np.float32)
    build = welvet.build_network
    monkeypatch.setattr(welvet, "build_network", lambda cfg: build({**cfg, "layers": [{**l, "dtype": dtype} for l in cfg["layers"]]}))
    loom = LoomDense([6, 5, 3], ["tanh", "linear"], w)
    try:
        losses = loom.train(x, t, epochs=3, learning_rate=0.05)
        loom_net = from_loom_json(welvet.serialize_network(loom.handle))
    finally:
        loom.close()
    net = Network(Dense(6, 5, "tanh", bias=False), Dense(5, 3, "linear", bias=False))
    with torch.no_grad():
        for p, v in zip(net.parameters(), w):
            p.copy_(torch.from_numpy(v))
    res = train(net, [(torch.from_numpy(x[i]), torch.from_numpy(t[i])) for i in range(2)],
                TrainingConfig(epochs=3, learning_rate=0.05, verbose=0, weight_dtype=dtype, low_bit=LowBitConfig(loom_compat=True)))
    np.testing.assert_allclose(res.loss_history, losses, rtol=1e-6)
    for ours, theirs in zip(net.parameters(), loom_net.parameters()):
        if dtype in ("float32", "float64"):  # no codes: float32 training itself agrees to ~1e-7 (PARITY.md)
            torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=1e-6)
        else:
            assert torch.equal(ours.detach(), theirs.detach())
