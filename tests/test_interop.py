"""Loom JSON interop (SPEC §12): formats checked against real Loom (welvet) and round trips."""

import base64
import json

import numpy as np
import pytest
import torch

from loom_oracle import LoomDense, welvet
from torchloom import Dense, Network
from torchloom.interop import from_loom_json, load_loom, save_loom, to_loom_json

needs_loom = pytest.mark.skipif(welvet is None, reason="needs Loom's Python binding welvet")


def _loom_forward(handle, x):
    out = welvet.forward_polymorphic(handle, x.reshape(-1).tolist(), list(x.shape))
    return np.asarray(out, dtype=np.float32)


@needs_loom
def test_loom_saved_network_loads_and_computes_what_loom_computes():
    torch.manual_seed(0)
    ws = [torch.randn(7, 5) * 0.5, torch.randn(3, 7) * 0.5]
    loom = LoomDense([5, 7, 3], ["tanh", "sigmoid"], [w.numpy() for w in ws])
    try:
        saved = welvet.serialize_network(loom.handle)
        x = np.random.RandomState(0).randn(4, 5).astype(np.float32)
        loom_out = _loom_forward(loom.handle, x).reshape(4, 3)
    finally:
        loom.close()
    net = from_loom_json(saved)
    assert [type(layer) for layer in net] == [Dense, Dense]
    assert torch.equal(net[0].weight, ws[0]) and torch.equal(net[1].weight, ws[1])
    assert net[0].activation.name == "tanh" and net[1].activation.name == "sigmoid"
    np.testing.assert_allclose(net(torch.from_numpy(x)).detach().numpy(), loom_out, rtol=1e-6, atol=1e-7)


@needs_loom
def test_torchloom_network_saved_for_loom_runs_in_loom():
    torch.manual_seed(1)
    net = Network(Dense(6, 4, "silu", bias=False), Dense(4, 2, "leaky_relu", bias=False))
    handle = welvet.deserialize_network(json.dumps(to_loom_json(net)))
    try:
        x = np.random.RandomState(1).randn(3, 6).astype(np.float32)
        loom_out = _loom_forward(handle, x).reshape(3, 2)
    finally:
        welvet.free_network(handle)
    np.testing.assert_allclose(net(torch.from_numpy(x)).detach().numpy(), loom_out, rtol=1e-6, atol=1e-7)


def test_build_schema_flat_order_and_file_round_trip(tmp_path):
    cfg = {
        "depth": 1, "rows": 2, "cols": 2, "layers_per_cell": 1,
        "layers": [  # listed out of order: Loom runs ((z·rows + y)·cols + x)·lpc + l
            {"z": 0, "y": 1, "x": 0, "l": 0, "type": "dense", "input_height": 5, "output_height": 6, "activation": "relu"},
            {"z": 0, "y": 0, "x": 0, "l": 0, "type": "dense", "input_height": 2, "output_height": 3, "activation": "TANH"},
            {"z": 0, "y": 1, "x": 1, "l": 0, "type": "dense", "input_height": 6, "output_height": 1, "activation": "gelu"},
            {"z": 0, "y": 0, "x": 1, "l": 0, "type": "Dense", "input_height": 3, "output_height": 5, "activation": "sigmoid"},
        ],
    }
    net = from_loom_json(json.dumps(cfg))
    assert [(l.in_features, l.out_features, l.activation.name) for l in net] == [
        (2, 3, "tanh"), (3, 5, "sigmoid"), (5, 6, "relu"), (6, 1, "gelu_tanh")
    ]
    path = tmp_path / "net.json"
    save_loom(net, path)
    again = load_loom(path)
    x = torch.randn(4, 2)
    assert torch.equal(net(x), again(x))
    layer0 = json.loads(path.read_text())["layers"][0]
    w = np.frombuffer(base64.b64decode(layer0["weights"]), dtype="<f4").reshape(3, 2)
    assert np.array_equal(w, net[0].weight.detach().numpy())  # [out, in], little-endian float32


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda c: c["layers"][0].update(type="conv9"), "layer type 'conv9' is not supported"),
        (lambda c: c["layers"][0].update(activation="softplus"), "unknown activation 'softplus'"),
        (lambda c: c.update(cols=3), "1 grid cell\\(s\\) have no layer"),
        (lambda c: c["layers"][1].update(x=5), "outside the grid"),
        (lambda c: c["layers"][0].update(weights=base64.b64encode(b"\0" * 8).decode()), "holds 2 floats, expected 3×2"),
        (lambda c: c.pop("layers_per_cell"), "'layers_per_cell' must be an int >= 1"),
    ],
)
def test_bad_loom_json(mutate, match):
    cfg = {"depth": 1, "rows": 1, "cols": 2, "layers_per_cell": 1, "layers": [
        {"x": 0, "type": "dense", "input_height": 2, "output_height": 3, "activation": "relu"},
        {"x": 1, "type": "dense", "input_height": 3, "output_height": 1, "activation": "linear"},
    ]}
    mutate(cfg)
    with pytest.raises(ValueError, match=match):
        from_loom_json(cfg)


def test_what_loom_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="has a bias; Loom's Dense has none"):
        to_loom_json(Network(Dense(2, 2)))
    with pytest.raises(ValueError, match="activation 'gelu', which Loom does not have"):
        to_loom_json(Network(Dense(2, 2, "gelu", bias=False)))
