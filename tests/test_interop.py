"""Loom JSON interop without Loom: round trips for every layer type, Loom's weight layouts and dtype
encodings (built here by hand from Loom's documented byte formats), refusals, atomic ``save_loom``.
The checks against real Loom live in tests/interop/test_loom_layers.py."""

import base64
import json

import numpy as np
import pytest
import torch

import torchloom
from torchloom import (
    LSTM, RNN, Conv1D, Conv2D, Conv3D, ConvTranspose1D, ConvTranspose2D, ConvTranspose3D, Dense, Embedding,
    Flatten, LastStep, LayerNorm, MultiHeadAttention, Network, Parallel, Residual, RMSNorm, Sequential, Softmax,
    SwiGLU,
)
from torchloom.interop import from_loom_json, load_loom, save_loom, to_loom_json


def _b64(arr, dt="<f4"):
    return base64.b64encode(np.asarray(arr, dtype=dt).tobytes()).decode()


def _one(layer):
    return {"depth": 1, "rows": 1, "cols": 1, "layers_per_cell": 1, "layers": [dict(layer, x=0)]}


ROUND_TRIP = {
    "Dense": (lambda: Network(Dense(6, 5, "relu", bias=False), Dense(5, 3, "gelu_loom", bias=False)), (3, 6)),
    "Conv": (lambda: Network(Conv2D(2, 3, 3, 2, 1, "tanh", bias=False), Flatten(), Dense(12, 2, bias=False)), (2, 2, 4, 4)),
    "Conv1D/3D": (lambda: Network(Conv1D(2, 2, 3, bias=False), ), (2, 2, 6)),
    "Conv3D": (lambda: Network(Conv3D(1, 2, 2, bias=False)), (1, 1, 3, 3, 3)),
    "ConvT": (lambda: Network(ConvTranspose1D(2, 3, 3, 2, 1, 1, bias=False), ConvTranspose1D(3, 1, 2, bias=False)), (2, 2, 4)),
    "ConvT2D/3D": (lambda: Network(ConvTranspose2D(2, 2, 2, 2, bias=False)), (1, 2, 2, 3)),
    "ConvT3D": (lambda: Network(ConvTranspose3D(1, 2, 2, 1, bias=False)), (1, 1, 2, 2, 2)),
    "RNN/LSTM": (lambda: Network(RNN(3, 4), LSTM(4, 2)), (2, 5, 3)),
    "MHA": (lambda: Network(MultiHeadAttention(8, 4, 1), RMSNorm(8), LayerNorm(8), SwiGLU(8, 6)), (2, 3, 8)),
    "Embedding": (lambda: Network(Embedding(7, 4), MultiHeadAttention(4, 2)), (2, 3)),
    "containers": (lambda: Network(Residual(Dense(4, 4, "tanh", bias=False)),
                                   Parallel([Dense(4, 2, bias=False), Sequential(Dense(4, 3, bias=False), Dense(3, 2, "silu", bias=False))], "avg"),
                                   Softmax(temperature=0.5)), (3, 4)),
}


@pytest.mark.parametrize("name", list(ROUND_TRIP))
def test_round_trip_keeps_every_weight_and_output(name, tmp_path):
    make, shape = ROUND_TRIP[name]
    net = make()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randint(0, 7, shape) if name == "Embedding" else torch.randn(*shape)
    path = tmp_path / "net.json"
    save_loom(net, path, example_input=x.shape)
    again = load_loom(str(path), gelu="gelu_loom")
    assert [p.shape for p in again.parameters()] == [p.shape for p in net.parameters()]
    for p, q in zip(net.parameters(), again.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(net(x), again(x))


def test_loom_weight_layouts_by_hand():
    """Loom's flat orders: LSTM gate blocks [W_ih | W_hh | b] × (i, f, g, o); ConvTransposed [F, C, k]."""
    i, h = 2, 3
    blocks = [np.arange(g * 100, g * 100 + i * h + h * h + h, dtype=np.float32) for g in range(4)]
    net = from_loom_json(_one({"type": "lstm", "input_height": i, "output_height": h, "seq_length": 2,
                               "weights": _b64(np.concatenate(blocks)), "native": True}))
    lstm = net[0]
    for g in range(4):
        assert torch.equal(lstm.weight_ih[g * h:(g + 1) * h].reshape(-1), torch.from_numpy(blocks[g][: i * h]))
        assert torch.equal(lstm.weight_hh[g * h:(g + 1) * h].reshape(-1), torch.from_numpy(blocks[g][i * h: i * h + h * h]))
        assert torch.equal(lstm.bias[g * h:(g + 1) * h], torch.from_numpy(blocks[g][i * h + h * h:]))
    w = np.arange(3 * 2 * 2, dtype=np.float32)  # Loom [F=3, C=2, k=2]
    ct = from_loom_json(_one({"type": "ConvTransposed1D", "input_channels": 2, "filters": 3, "kernel_size": 2, "stride": 1,
                              "input_width": 4, "output_width": 5, "weights": _b64(w), "native": True}))[0]
    assert torch.equal(ct.weight, torch.from_numpy(w.reshape(3, 2, 2)).transpose(0, 1))


def _codes_case(dtype, codes_bytes, scale, expected):
    spec = _one({"type": "dense", "input_height": len(expected), "output_height": 1, "dtype": dtype, "native": True,
                 "scale": scale, "weights": base64.b64encode(bytes(codes_bytes)).decode()})
    got = from_loom_json(spec)[0].weight.detach().reshape(-1).numpy()
    np.testing.assert_array_equal(got, np.asarray(expected, dtype=np.float32))


def test_quantised_dtypes_decode_as_loom_documents():
    s = 0.5
    _codes_case("int8", [0x80, 0xFF, 0x00, 0x7F], s, [-128 * s, -1 * s, 0, 127 * s])
    _codes_case("uint8", [0x80, 0xFF], s, [128 * s, 255 * s])
    # 4-bit: high nibble first; int4 signed (0xF = -1, 0x8 = -8)
    _codes_case("int4", [0x7F, 0x80], s, [7 * s, -1 * s, -8 * s, 0])
    _codes_case("uint4", [0x7F, 0x80], s, [7 * s, 15 * s, 8 * s, 0])
    # 2-bit: most significant pair first; int2/ternary signed (3 = -1, 2 = -2)
    _codes_case("int2", [0b00011011], s, [0, 1 * s, -2 * s, -1 * s])
    _codes_case("uint2", [0b00011011], s, [0, 1 * s, 2 * s, 3 * s])
    # binary: MSB first, 1 → +scale, 0 → −scale
    _codes_case("binary", [0b10100000], s, [s, -s, s, -s, -s, -s, -s, -s])
    # fp4 codes (Loom's table): 0x2 = 1.0, 0xB = -1.5
    _codes_case("fp4", [0x2B], s, [1.0 * s, -1.5 * s])
    # fp8 e4m3: 0x38 = 1.0, 0xC0 = -2.0; e5m2: 0x3C = 1.0
    _codes_case("fp8e4m3", [0x38, 0xC0], s, [1.0 * s, -2.0 * s])
    _codes_case("fp8e5m2", [0x3C], s, [1.0 * s])
    # wide ints: little-endian
    _codes_case("int16", np.array([-3, 300], "<i2").tobytes(), s, [-3 * s, 300 * s])
    _codes_case("uint32", np.array([7], "<u4").tobytes(), s, [7 * s])
    _codes_case("int64", np.array([-5], "<i8").tobytes(), s, [-5 * s])
    # float types ignore the scale
    v = np.array([1.5, -0.25, 3.0], np.float32)
    _codes_case("float16", v.astype("<f2").tobytes(), 7.0, v)
    _codes_case("bfloat16", (v.view(np.uint32) >> 16).astype("<u2").tobytes(), 7.0, v)
    _codes_case("float64", v.astype("<f8").tobytes(), 7.0, v)


def test_float64_model_dtype():
    net = from_loom_json(_one({"type": "dense", "input_height": 2, "output_height": 1, "weights": _b64([0.1, 0.2])}),
                         dtype=torch.float64)
    assert net[0].weight.dtype == torch.float64
    assert net[0].weight[0, 0].item() == float(np.float32(0.1))


def test_build_schema_flat_order_and_str_paths(tmp_path):
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
    path.write_text(json.dumps(cfg))
    assert len(from_loom_json(str(path))) == 4  # a str path, as well as JSON text
    assert len(load_loom(str(path))) == 4
    save_loom(net, str(path))
    layer0 = json.loads(path.read_text())["layers"][0]
    w = np.frombuffer(base64.b64decode(layer0["weights"]), dtype="<f4").reshape(3, 2)
    assert np.array_equal(w, net[0].weight.detach().numpy())  # [out, in], little-endian float32
    assert layer0["native"] is True and layer0["dtype"] == "float32"


def test_loom_residual_semantics_on_import():
    d = lambda i, o: {"type": "dense", "input_height": i, "output_height": o, "weights": _b64(np.eye(o, i) * 0.5)}
    seq = {"type": "sequential", "sequential_layers": [d(3, 3), {"type": "residual"}]}
    net = from_loom_json(_one(seq))
    assert isinstance(net[0][0], Residual)
    x = torch.randn(2, 3)
    torch.testing.assert_close(net(x), x + 0.5 * x)
    top = {"depth": 1, "rows": 1, "cols": 2, "layers_per_cell": 1, "layers": [dict(d(3, 3), x=0), {"type": "residual", "x": 1}]}
    torch.testing.assert_close(from_loom_json(top)(x), 0.5 * x)  # Loom: a top-level Residual has no skip input
    disabled = _one({"type": "sequential", "sequential_layers": [d(3, 3), dict(d(3, 3), is_disabled=True), {"type": "residual"}]})
    torch.testing.assert_close(from_loom_json(disabled)(x), x + 0.5 * x)


@pytest.mark.parametrize(
    "make,kw,match",
    [
        (lambda: Network(Dense(2, 2)), {}, "has a bias; Loom's Dense has none"),
        (lambda: Network(Dense(2, 2, "relu2", bias=False)), {}, "'relu2': Loom v0.80 writes 'ReLU2' but reads it back"),
        (lambda: Network(Dense(2, 2, "gelu", bias=False)), {}, "Loom's GELU is the tanh approximation"),
        (lambda: Network(Conv1D(1, 1, 2)), {"example_input": (1, 1, 4)}, "Loom's CNN1 has none"),
        (lambda: Network(Conv1D(1, 1, 2, bias=False)), {}, "pass example_input="),
        (lambda: Network(RNN(2, 2)), {}, "sequence length; pass example_input="),
        (lambda: Network(Conv2D(1, 1, (2, 3), bias=False)), {"example_input": (1, 1, 4, 4)}, "one kernel size"),
        (lambda: Network(MultiHeadAttention(4, 2, causal=False)), {}, "always causal with RoPE"),
        (lambda: Network(RMSNorm(4, eps=1e-5)), {}, "uses eps=1e-06"),
        (lambda: Network(LayerNorm(4, eps=1e-6)), {}, "uses eps=1e-05"),
        (lambda: Network(RNN(2, 2), LastStep()), {"example_input": (1, 3, 2)}, "LastStep has no Loom equivalent"),
        (lambda: Network(Softmax(dim=1)), {"example_input": (1, 3, 2)}, "normalises the last dimension only"),
        (lambda: Network(Residual(Flatten())), {"example_input": (1, 3)}, "exactly one Loom layer"),
    ],
)
def test_what_loom_cannot_hold_is_refused(make, kw, match):
    with pytest.raises(ValueError, match=match):
        to_loom_json(make(), **kw)


def test_loom_gelu_is_opt_in():
    from torchloom.layers.activations import activation_names, get_activation

    assert "gelu_loom" not in activation_names()  # never picked up by "every activation" loops
    a, t = get_activation("gelu_loom"), get_activation("gelu_tanh")
    x = torch.linspace(-5, 5, 101, dtype=torch.float64)
    torch.testing.assert_close(a(x), t(x))  # same forward
    # Loom's derivative, evaluated independently in numpy: tanh-form Φ plus the exact Gaussian x·φ(x)
    v = x.numpy()
    cdf = 0.5 * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3)))
    want = cdf + v * np.exp(-0.5 * v * v) / np.sqrt(2 * np.pi)
    np.testing.assert_allclose(a.derivative(x).numpy(), want, rtol=1e-12, atol=1e-15)
    assert (a.derivative(x) - t.derivative(x)).abs().max() > 5e-4  # not the forward's derivative


def test_public_names():
    for name in ("from_loom_json", "to_loom_json", "load_loom", "save_loom", "ConvTranspose2D"):
        assert name in torchloom.__all__ and hasattr(torchloom, name)


def test_loom_reshape_between_flat_and_structured_layers():
    from torchloom.interop._convert import LoomReshape

    d = {"type": "dense", "input_height": 4, "output_height": 6}
    c = {"type": "cnn1", "input_channels": 2, "filters": 1, "kernel_size": 2, "stride": 1, "input_height": 3, "output_height": 2}
    cfg = {"depth": 1, "rows": 1, "cols": 2, "layers_per_cell": 1, "layers": [dict(d, x=0), dict(c, x=1)]}
    net = from_loom_json(cfg)
    assert isinstance(net[1], LoomReshape) and net[1].shape == (2, 3)
    x = torch.randn(2, 4, dtype=torch.float32, requires_grad=True)
    y = net(x)
    ref = torch.nn.functional.conv1d(net[0](x).reshape(2, 2, 3), net[2].weight)
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(ref, x, g)[0])
    assert len(to_loom_json(net, example_input=x)["layers"]) == 2  # the reshape is implicit in Loom
    with pytest.raises(ValueError, match="each sample must hold 6 values"):
        net[1](torch.randn(2, 5))


def test_conv_inside_parallel_is_refused_clearly():
    net = Network(Parallel([Conv1D(1, 1, 2, bias=False), Conv1D(1, 1, 2, bias=False)], "add"))
    with pytest.raises(ValueError, match="inside a Parallel branch is not supported"):
        to_loom_json(net, example_input=(1, 1, 4))


# ------------------------------------- every field that changes the computation is honoured (issue 10)
# (refusals: tests/reliability/test_loom_json_hostile.py; the same networks against real Loom:
# tests/interop/test_loom_layers.py)
def _grid(*layers):
    return {"depth": 1, "rows": 1, "cols": len(layers), "layers_per_cell": 1,
            "layers": [dict(layer, x=i) for i, layer in enumerate(layers)]}


def _d(i, o, act="tanh"):
    return {"type": "dense", "input_height": i, "output_height": o, "activation": act}


@pytest.mark.parametrize("loom_name,ours", [("Sigmoid", "sigmoid"), ("Tanh", "tanh"), ("LeakyReLU", "leaky_relu"), ("", "linear")])
def test_embedding_activation_is_applied(loom_name, ours):
    w = np.arange(20, dtype=np.float32).reshape(5, 4) / 10 - 1
    net = from_loom_json(_one({"type": "embedding", "vocab_size": 5, "embedding_dim": 4, "activation": loom_name,
                               "weights": _b64(w)}))
    assert net[0].activation.name == ours
    idx = torch.tensor([[0, 4, 2]])
    want = {"sigmoid": torch.sigmoid, "tanh": torch.tanh, "linear": lambda t: t,
            "leaky_relu": lambda t: torch.nn.functional.leaky_relu(t, 0.01)}[ours](torch.from_numpy(w)[idx])
    torch.testing.assert_close(net(idx), want, rtol=0, atol=0)
    assert to_loom_json(net)["layers"][0]["activation"] == {"linear": "Linear", "leaky_relu": "LeakyReLU"}.get(ours, loom_name)


def _group_softmax(x, cols, t):
    """Independent reference: numpy softmax of ``x / t`` over consecutive groups of ``cols`` per sample."""
    v = x.detach().numpy().reshape(x.shape[0], -1, cols) / t
    e = np.exp(v - v.max(-1, keepdims=True))
    return torch.from_numpy((e / e.sum(-1, keepdims=True)).reshape(x.shape))


@pytest.mark.parametrize("cols,kind", [(10, "Softmax"), (5, "LoomGridSoftmax"), (2, "LoomGridSoftmax")])
def test_grid_softmax_normalises_groups_of_softmax_cols(cols, kind):
    net = from_loom_json(_grid(_d(6, 10), {"type": "softmax", "softmax_type": "Grid", "softmax_rows": 30 // cols,
                                            "softmax_cols": cols, "temperature": 0.5}), dtype=torch.float64)
    assert type(net[1]).__name__ == kind
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    y = net(x)
    h = net[0](x)
    torch.testing.assert_close(y, _group_softmax(h, cols, 0.5), rtol=1e-12, atol=1e-15)
    ref = torch.softmax(h.reshape(3, -1, cols) / 0.5, -1).reshape(3, 10)  # autograd reference for the gradient
    g = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(ref, x, g)[0], rtol=1e-12, atol=1e-15)
    assert torch.autograd.gradcheck(net[1], (h.detach().requires_grad_(),))


def test_loom_grid_softmax_export_writes_the_rows_of_the_example():
    from torchloom.interop import LoomGridSoftmax

    net = Network(Dense(6, 10, bias=False), LoomGridSoftmax(5, 0.5))
    sm = to_loom_json(net, example_input=(3, 6))["layers"][1]
    assert (sm["softmax_type"], sm["softmax_rows"], sm["softmax_cols"], sm["temperature"]) == ("Grid", 6, 5, 0.5)
    x = torch.randn(3, 6)
    again = from_loom_json(to_loom_json(net, example_input=x))
    torch.testing.assert_close(again(x), net(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"^to_loom_json: layer 1 \(LoomGridSoftmax\): LoomGridSoftmax: Loom fixes the number of rows"):
        to_loom_json(net)
    with pytest.raises(ValueError, match=r"each sample must hold a multiple of 4 values"):
        LoomGridSoftmax(4)(torch.randn(2, 6))


def test_residual_after_a_size_change_is_the_identity_loom_computes():
    """Loom adds a Sequential's skip only when it has the output's length; otherwise it passes the
    input through (and torchloom's Residual would fail or broadcast)."""
    w = np.full((4, 6), 0.1, np.float32)
    net = from_loom_json(_one({"type": "sequential", "sequential_layers": [dict(_d(6, 4), weights=_b64(w)), {"type": "residual"}]}))
    assert [type(m).__name__ for m in net[0]] == ["Dense"]
    x = torch.randn(2, 6)
    torch.testing.assert_close(net(x), torch.tanh(x @ torch.from_numpy(w).T))


def test_loom_flat_reads_are_explicit():
    """An Embedding's ``[B, T, E]`` before a Dense of T·E inputs, a norm over a whole RNN sample and
    Parallel branches with structured outputs are flattened, as Loom reads its flat buffers."""
    emb = {"type": "embedding", "vocab_size": 5, "embedding_dim": 4}
    net = from_loom_json(_grid(emb, _d(12, 3)))
    assert [type(m).__name__ for m in net] == ["Embedding", "Flatten", "Dense"]
    idx = torch.randint(0, 5, (2, 3))
    torch.testing.assert_close(net(idx), torch.tanh(net[0](idx).reshape(2, 12) @ net[2].weight.T))
    with pytest.raises(ValueError, match=r"Dense\(12→3\): input must have shape \[batch, \.\.\., 12\], got \[2, 8\]"):
        net(torch.randint(0, 5, (2, 2)))  # 2 tokens: 8 values, not the 12 the file declares
    norm = from_loom_json(_grid({"type": "rnn", "input_height": 4, "output_height": 5, "seq_length": 3},
                                {"type": "layernorm", "input_height": 15, "output_height": 15}))
    assert [type(m).__name__ for m in norm] == ["RNN", "Flatten", "LayerNorm"]
    par = from_loom_json(_one({"type": "parallel", "parallel_branches": [emb, dict(emb, embedding_dim=3)]}))
    assert [[type(m).__name__ for m in b] for b in par[0].branches] == [["Embedding", "Flatten"], ["Embedding", "Flatten"]]
    assert par(idx).shape == (2, 21)


def test_dense_on_a_structured_input_is_not_exported():
    net = Network(Embedding(5, 4), Dense(4, 3, bias=False))
    with pytest.raises(ValueError) as info:
        to_loom_json(net, example_input=(2, 3))
    assert str(info.value) == (
        "to_loom_json: layer 1 (Dense): Dense on an input of shape [2, 3, 4]: Loom's Dense reads each sample as one row "
        "of input_height values (it would take the first 2×4 values of the batch), not every position; flatten first "
        "(Flatten) or use a layer Loom applies per position (SwiGLU)"
    )
