"""Hostile Loom JSON and failing writes: every bad input is a ValueError / TypeError (exact type)
naming the field, raised before anything is allocated or written; the file on disk and the model
stay unchanged; ``save_loom`` is atomic."""

import base64
import copy
import json
import math
import os
import re
import tracemalloc

import numpy as np
import pytest
import torch

from torchloom import Conv1D, Dense, Network
from torchloom.interop import from_loom_json, load_loom, save_loom, to_loom_json


def _w(n, fill=None, dt="<f4"):
    a = np.full(n, fill, dt) if fill is not None else (np.arange(n, dtype=np.float32) / 10).astype(dt)
    return base64.b64encode(a.tobytes()).decode()


def _dense(i, o, **kw):
    d = {"type": "Dense", "activation": "ReLU", "dtype": "float32", "input_height": i, "output_height": o,
         "weights": _w(i * o), "native": True, "scale": 1}
    d.update(kw)
    return d


BASE = {"id": "n", "depth": 1, "rows": 1, "cols": 2, "layers_per_cell": 1,
        "layers": [dict(_dense(3, 4), z=0, y=0, x=0, l=0), dict(_dense(4, 2), z=0, y=0, x=1, l=0)]}


def _set(path, value):
    """A mutation setting BASE[path...] = value."""
    def mutate(c):
        obj = c
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
    return mutate


def _L0(key, value):
    return _set(("layers", 0, key), value)


def _deep_seq(levels):
    inner = _dense(3, 4)
    for _ in range(levels):
        inner = {"type": "Sequential", "sequential_layers": [inner]}
    return inner


def _no_w(layer):
    """``layer`` without its weights (to change its type): a missing key, as Loom writes a layer without
    weights (a ``null`` is refused)."""
    layer.pop("weights", None)
    return layer


def _raw(text):
    return ("raw", text)


# (id, mutation of BASE or raw text, exact exception type, message fragment)
CASES = [
    ("is_disabled-string", _L0("is_disabled", "false"), TypeError, "'is_disabled' must be true or false"),
    ("is_disabled-int", _L0("is_disabled", 0), TypeError, "'is_disabled' must be true or false"),
    ("is_disabled-null", _L0("is_disabled", None), ValueError, "layers[0]: 'is_disabled' is null; Loom would silently read it as false"),
    ("native-string", _L0("native", "yes"), TypeError, "'native' must be true or false"),
    ("weights-empty", _L0("weights", ""), ValueError, "'weights' is empty"),
    ("weights-bad-chars", _L0("weights", "@@@@" * 4), ValueError, "not valid base64"),
    ("weights-bad-padding", _L0("weights", "AAA"), ValueError, "not valid base64"),
    ("weights-whitespace", _L0("weights", _w(12)[:8] + "\n" + _w(12)[8:]), ValueError, "not valid base64"),
    ("weights-short", _L0("weights", _w(11)), ValueError, "holds 44 bytes, expected 48"),
    ("weights-long", _L0("weights", _w(13)), ValueError, "holds 52 bytes, expected 48"),
    ("weights-nan", _L0("weights", _w(12, np.nan)), ValueError, "non-finite value"),
    ("weights-inf", _L0("weights", _w(12, np.inf)), ValueError, "non-finite value"),
    ("weights-list", _L0("weights", [0.1] * 12), TypeError, "'weights' must be a string"),
    ("weights-number", _L0("weights", 3), TypeError, "'weights' must be a string"),
    ("weights-f64-overflow", lambda c: c["layers"][0].update(dtype="float64", weights=_w(12, 1e300, "<f8")), ValueError, "beyond float32"),
    ("weights-bf16-nan", lambda c: c["layers"][0].update(dtype="bfloat16", weights=_w(12, 0x7FC0, "<u2")), ValueError, "non-finite value"),
    ("weights-fp4-inf-code", lambda c: c["layers"][0].update(dtype="fp4", weights=base64.b64encode(bytes([0x66] * 6)).decode()), ValueError, "non-finite value"),
    ("weights-master-int8", lambda c: c["layers"][0].update(dtype="int8", native=False), ValueError, "native=false"),
    ("weights-on-softmax", lambda c: c["layers"][1].update(type="Softmax", weights=_w(2)), ValueError, "has no weights"),
    ("height-string", _L0("input_height", "3"), TypeError, "'input_height' must be an integer"),
    ("height-float", _L0("input_height", 3.0), TypeError, "'input_height' must be an integer"),
    ("height-bool", _L0("input_height", True), TypeError, "'input_height' must be an integer"),
    ("height-negative", _L0("input_height", -3), ValueError, "'input_height' must lie in"),
    ("height-huge", _L0("input_height", 2**40), ValueError, "'input_height' must lie in"),
    ("height-zero", _L0("input_height", 0), ValueError, "Dense needs 'input_height' >= 1"),
    ("params-over-cap", lambda c: _no_w(c["layers"][0]).update(input_height=100_000, output_height=100_000), ValueError, "max_parameters"),
    ("params-over-cap-many", lambda c: c.update(cols=40, layers=[dict(_no_w(_dense(1500, 1000)), x=i) for i in range(40)]), ValueError, "max_parameters"),
    ("scale-string", _L0("scale", "1"), TypeError, "'scale' must be a number"),
    ("scale-huge", _L0("scale", 1e300), ValueError, "'scale' must be a finite float32"),
    ("top-list", _raw("[1, 2]"), TypeError, "top level must be a JSON object"),
    ("top-truncated", _raw('{"depth": 1, "rows": '), ValueError, "not valid JSON"),
    ("nan-constant", _raw(json.dumps(BASE).replace('"scale": 1', '"scale": NaN', 1)), ValueError, "constant NaN"),
    ("inf-constant", _raw(json.dumps(BASE).replace('"scale": 1', '"scale": -Infinity', 1)), ValueError, "constant -Infinity"),
    ("deep-arrays", _raw('{"layers": ' + "[" * 100_000 + "]" * 100_000 + "}"), ValueError, "nested too deeply"),
    ("not-utf8", _raw(b'{"id": "\xff\xfe"}'), ValueError, "not UTF-8"),
    ("deep-sequential", lambda c: c["layers"].__setitem__(0, dict(_deep_seq(40), x=0)), ValueError, "nested more than 32 levels"),
    ("layers-dict", _set(("layers",), {"0": {}}), TypeError, "'layers' must be a list"),
    ("layers-empty", _set(("layers",), []), ValueError, "'layers' must be a non-empty list"),
    ("layer-string", lambda c: c["layers"].__setitem__(0, "Dense"), TypeError, "layers[0] must be a JSON object"),
    ("depth-zero", _set(("depth",), 0), ValueError, "'depth' must be an int in"),
    ("rows-string", _set(("rows",), "1"), TypeError, "'rows' must be an integer"),
    ("lpc-missing", lambda c: c.pop("layers_per_cell"), ValueError, "'layers_per_cell' must be an int in"),
    ("grid-too-big", _set(("cols",), 3), ValueError, "has 3 cells but 'layers' lists 2"),
    ("outside-grid", _L0("x", 5), ValueError, "lies outside the grid"),
    ("duplicate-cell", _L0("x", 1), ValueError, "two layers at"),
    ("type-unknown", _L0("type", "conv9"), ValueError, "layer type 'conv9' is not supported"),
    ("type-int", _L0("type", 0), TypeError, "'type' must be a string"),
    ("type-kmeans", lambda c: _no_w(c["layers"][0]).update(type="KMeans", num_clusters=2), ValueError, "layer type KMeans is not supported: Loom's KMeans treats its whole input buffer"),
    ("activation-unknown", _L0("activation", "softplus"), ValueError, "unknown activation 'softplus'"),
    ("activation-relu2", _L0("activation", "ReLU2"), ValueError, "reads this name back as linear"),
    ("dtype-unknown", _L0("dtype", "float8"), ValueError, "dtype 'float8' is not one Loom writes"),
    ("key-case", lambda c: c["layers"][0].update(Weights=c["layers"][0].pop("weights")), ValueError, "differs from Loom's 'weights' only in case"),
    ("branches-dict", lambda c: _no_w(c["layers"][0]).update(type="Parallel", parallel_branches={"a": 1}), TypeError, "'parallel_branches' must be a list"),
    ("branches-on-dense", _L0("parallel_branches", [_dense(3, 4)]), ValueError, "'parallel_branches' given for a Dense layer"),
    ("branch-not-object", lambda c: _no_w(c["layers"][0]).update(type="Parallel", parallel_branches=[5]), TypeError, "parallel_branches[0] must be a JSON object"),
    ("combine-filter", lambda c: _no_w(c["layers"][0]).update(type="Parallel", combine_mode="filter", parallel_branches=[_dense(3, 4)]), ValueError, "'filter' needs Loom's gate layer"),
    ("combine-unknown", lambda c: _no_w(c["layers"][0]).update(type="Parallel", combine_mode="mul", parallel_branches=[_dense(3, 4)]), ValueError, "combine_mode 'mul'"),
    ("residual-twice", lambda c: c["layers"].__setitem__(0, {"type": "Sequential", "x": 0, "sequential_layers": [_dense(3, 4), {"type": "Residual"}, {"type": "Residual"}]}), ValueError, "two Residual layers in a row"),
    ("remote-link", _L0("is_remote_link", True), ValueError, "remote links"),
    ("softmax-temperature", lambda c: _no_w(c["layers"][1]).update(type="Softmax", temperature=-1.0), ValueError, "temperature must be > 0"),
    ("softmax-type", lambda c: _no_w(c["layers"][1]).update(type="Softmax", softmax_type="Gumbel"), ValueError, "softmax_type 'Gumbel'"),
    ("mha-heads", lambda c: _no_w(c["layers"][0]).update(type="MHA", d_model=6, num_heads=4), ValueError, "head_dim"),
    ("conv-sizes", lambda c: _no_w(c["layers"][0]).update(type="CNN1", input_channels=1, filters=1, kernel_size=3, stride=1, input_height=5, output_height=4), ValueError, "does not follow from input size"),
    ("norm-sizes", lambda c: _no_w(c["layers"][0]).update(type="RMSNorm", input_height=4, output_height=3), ValueError, "output_height == input_height"),
]


def _text(case):
    mut = case[1]
    if isinstance(mut, tuple):
        return mut[1]
    cfg = copy.deepcopy(BASE)
    mut(cfg)
    return json.dumps(cfg)


def test_base_is_valid():
    net = from_loom_json(json.dumps(BASE))
    assert net(torch.ones(1, 3)).shape == (1, 2)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_file_is_a_clear_error_and_nothing_changes(case, tmp_path):
    _, _, exc, fragment = case
    text = _text(case)
    path = tmp_path / "net.json"
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    before = path.read_bytes()
    tracemalloc.start()
    try:
        with pytest.raises(exc) as info:
            load_loom(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.type is exc, info.value
    assert fragment in str(info.value)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["net.json"]
    assert peak < 64 * 2**20  # refused before allocating the declared layers
    if not isinstance(text, bytes):  # the same from JSON text, as a str path and as a dict
        with pytest.raises(exc):
            from_loom_json(text)
        with pytest.raises(exc):
            load_loom(str(path))
        if text.lstrip().startswith("{") and case[0] not in ("top-truncated", "nan-constant", "inf-constant", "deep-arrays"):
            with pytest.raises(exc):
                from_loom_json(json.loads(text))


def test_self_referencing_dict_is_refused():
    cfg = copy.deepcopy(BASE)
    seq = {"type": "Sequential", "x": 0}
    seq["sequential_layers"] = [seq]
    cfg["layers"][0] = seq
    with pytest.raises(ValueError, match="nested more than 32 levels"):
        from_loom_json(cfg)


@pytest.mark.parametrize(
    "call,exc",
    [
        (lambda p: from_loom_json(12), TypeError),
        (lambda p: load_loom(12), TypeError),
        (lambda p: load_loom(p / "missing.json"), FileNotFoundError),
        (lambda p: load_loom(p), ValueError),  # a directory
        (lambda p: from_loom_json(json.dumps(BASE), max_parameters=0), ValueError),
        (lambda p: from_loom_json(json.dumps(BASE), gelu="gelu"), ValueError),
        (lambda p: from_loom_json(json.dumps(BASE), dtype=torch.int32), TypeError),
        (lambda p: from_loom_json(json.dumps(BASE), max_parameters=10), ValueError),
        (lambda p: from_loom_json(json.dumps(BASE), max_parameters=True), ValueError),
        (lambda p: from_loom_json(" " * (11 * 100 + 16 * 2**20 + 1) + "{}", max_parameters=100), ValueError),
        (lambda p: (p / "big.json").write_bytes(b" " * (11 * 100 + 16 * 2**20 + 1)) and load_loom(p / "big.json", max_parameters=100), ValueError),
    ],
)
def test_bad_loader_arguments(call, exc, tmp_path):
    with pytest.raises(exc) as info:
        call(tmp_path)
    assert info.type is exc


# ------------------------------------------------------------------------------ writing
def _net():
    torch.manual_seed(0)
    return Network(Dense(3, 4, "relu", bias=False), Dense(4, 2, bias=False))


def _state(net):
    return [p.detach().clone() for p in net.parameters()]


def _bad_nan():
    net = _net()
    with torch.no_grad():
        net[0].weight[0, 0] = math.nan
    return net, {}


SAVE_CASES = [
    ("relu2", lambda: (Network(Dense(3, 2, "relu2", bias=False)), {}), ValueError),
    ("dense-bias", lambda: (Network(Dense(3, 2)), {}), ValueError),
    ("nan-weight", _bad_nan, ValueError),
    ("conv-no-shape", lambda: (Network(Conv1D(1, 1, 2, bias=False)), {}), ValueError),
    ("example-wrong-type", lambda: (_net(), {"example_input": "3"}), TypeError),
    ("example-bad-shape", lambda: (_net(), {"example_input": (1, 0)}), ValueError),
    ("example-does-not-fit", lambda: (_net(), {"example_input": (1, 5)}), ValueError),
    ("not-a-layer", lambda: (torch.nn.Linear(2, 2), {}), TypeError),
]


@pytest.mark.parametrize("case", SAVE_CASES, ids=[c[0] for c in SAVE_CASES])
def test_refused_save_leaves_old_file_and_model(case, tmp_path):
    _, make, exc = case
    path = tmp_path / "net.json"
    save_loom(_net(), path)
    before = path.read_bytes()
    net, kw = make()
    state = _state(net)
    with pytest.raises(exc) as info:
        save_loom(net, path, **kw)
    assert info.type is exc
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["net.json"]
    for a, b in zip(state, net.parameters()):
        assert torch.equal(a, b) or (a.isnan() == b.isnan()).all()


@pytest.mark.parametrize(
    "path_of,exc",
    [(lambda p: 5, TypeError), (lambda p: p / "no-dir" / "net.json", FileNotFoundError), (lambda p: p, ValueError)],
)
def test_bad_save_path(path_of, exc, tmp_path):
    with pytest.raises(exc) as info:
        save_loom(_net(), path_of(tmp_path))
    assert info.type is exc
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fail_at", ["fsync", "replace"])
def test_interrupted_write_keeps_old_file_and_leaves_no_temp(fail_at, tmp_path, monkeypatch):
    path = tmp_path / "net.json"
    old = _net()
    save_loom(old, str(path))
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError(f"injected failure in {fail_at}")

    monkeypatch.setattr(os, fail_at, boom)
    new = Network(Dense(3, 4, "tanh", bias=False), Dense(4, 2, bias=False))
    with pytest.raises(OSError, match="injected"):
        save_loom(new, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["net.json"]
    again = load_loom(path)
    x = torch.randn(2, 3)
    assert torch.equal(again(x), old(x))


def test_save_replaces_and_keeps_mode(tmp_path):
    path = tmp_path / "net.json"
    path.write_text("old")
    os.chmod(path, 0o640)
    save_loom(_net(), path)
    assert json.loads(path.read_text())["cols"] == 2
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert to_loom_json(_net()) == json.loads(path.read_text())


# --------------------------------------- files that would run differently in Loom (issue 10, 11)
def _grid(*layers):
    return {"id": "n", "depth": 1, "rows": 1, "cols": len(layers), "layers_per_cell": 1,
            "layers": [dict(layer, z=0, y=0, x=i, l=0) for i, layer in enumerate(layers)]}


def _d(i, o, act="tanh"):
    return {"type": "Dense", "input_height": i, "output_height": o, "activation": act}


def _emb(v=5, e=4, **kw):
    return {"type": "Embedding", "vocab_size": v, "embedding_dim": e, **kw}


def _seq(*layers):
    return {"type": "Sequential", "sequential_layers": list(layers)}


_CHAIN = "the layer sizes do not chain"
REFUSED = [
    # (id, network, the exact message)
    ("dense-chain", _grid(_d(2, 3), _d(5, 1)),
     f"Loom JSON: layers[1]: Dense takes input_height=5 values per sample, but layers[0] (Dense) outputs 3 values per sample; {_CHAIN}"),
    ("chain-in-sequential", _grid(_seq(_d(2, 3), _d(5, 1))),
     "Loom JSON: layers[0].sequential_layers[1]: Dense takes input_height=5 values per sample, but "
     f"layers[0].sequential_layers[0] (Dense) outputs 3 values per sample; {_CHAIN}"),
    ("chain-after-parallel", _grid({"type": "Parallel", "parallel_branches": [_d(2, 3), _d(2, 4)]}, _d(8, 1)),
     f"Loom JSON: layers[1]: Dense takes input_height=8 values per sample, but layers[0] (Parallel) outputs 7 values per sample; {_CHAIN}"),
    ("chain-conv", _grid(_d(4, 6), {"type": "CNN1", "input_channels": 2, "filters": 1, "kernel_size": 2, "stride": 1,
                                   "input_height": 4, "output_height": 3}),
     "Loom JSON: layers[1]: CNN1 takes 8 values per sample [2, 4] (input_channels × input sizes), but layers[0] (Dense) "
     f"outputs 6 values per sample; {_CHAIN}"),
    ("chain-rnn", _grid(_d(4, 6), {"type": "RNN", "input_height": 4, "output_height": 2, "seq_length": 2}),
     "Loom JSON: layers[1]: RNN takes 8 values per sample [2, 4] (seq_length × input_height), but layers[0] (Dense) "
     f"outputs 6 values per sample; {_CHAIN}"),
    ("chain-dense-after-conv", _grid({"type": "CNN1", "input_channels": 2, "filters": 3, "kernel_size": 2, "stride": 1,
                                     "input_height": 4, "output_height": 3}, _d(8, 1)),
     "Loom JSON: layers[1]: Dense takes input_height=8 values per sample, but layers[0] (CNN1) outputs 9 values per "
     f"sample ([3, 3]); {_CHAIN}"),
    ("chain-mha", _grid(_emb(e=6), {"type": "MHA", "d_model": 8, "num_heads": 2}),
     "Loom JSON: layers[1]: MultiHeadAttention takes inputs whose last dimension is d_model=8, but layers[0] (Embedding) "
     f"outputs values of shape […, 6] per sample; {_CHAIN}"),
    ("chain-norm", _grid(_d(4, 6), {"type": "RMSNorm", "input_height": 5, "output_height": 5}),
     f"Loom JSON: layers[1]: RMSNorm takes rows of input_height=5 values, but layers[0] (Dense) outputs 6 values per sample; {_CHAIN}"),
    ("embedding-not-first", _grid(_d(4, 6), _emb()),
     "Loom JSON: layers[1]: an Embedding after another layer (layers[0] (Dense)): Loom would read that layer's float "
     "outputs as token ids (truncated); torchloom's Embedding takes the network's integer token ids, so it must come first"),
    ("grid-spans-samples", _grid(_d(4, 6), {"type": "Softmax", "softmax_type": "Grid", "softmax_rows": 3, "softmax_cols": 4}),
     "Loom JSON: layers[1]: a 'Grid' softmax with softmax_cols=4 over the 6 values per sample that layers[0] (Dense) "
     "outputs: Loom's groups of 4 would span two samples; not supported"),
    ("grid-rows-no-whole-sample", _grid(_d(4, 6), {"type": "Softmax", "softmax_type": 1, "softmax_rows": 1, "softmax_cols": 3}),
     "Loom JSON: layers[1]: a 'Grid' softmax of softmax_rows × softmax_cols = 1×3 values over samples of 6 values: Loom "
     "normalises exactly 3 values of the whole batch and leaves the rest 0, and that is no whole number of samples; not supported"),
    ("parallel-add-sizes", _grid({"type": "Parallel", "combine_mode": "add", "parallel_branches": [_d(2, 3), _d(2, 4)]}),
     "Loom JSON: layers[0]: combine_mode 'add' over branches of [3, 4] values per sample: Loom adds them into a buffer "
     "of the first branch's size (a crash or a partial sum); not supported"),
    ("conv-kernel-0", _grid({"type": "CNN1", "input_channels": 2, "filters": 1, "kernel_size": 0, "stride": 1,
                            "input_height": 4, "output_height": 4}),
     "Loom JSON: layers[0]: CNN1 needs 'kernel_size' >= 1, got 0 (Loom's kernel loop then sums nothing: every output "
     "would be the activation of 0)"),
    ("convT-kernel-0", _grid({"type": "ConvTransposed1D", "input_channels": 2, "filters": 1, "kernel_size": 0, "stride": 1,
                             "input_width": 4, "output_width": 3}),
     "Loom JSON: layers[0]: ConvTransposed1D needs 'kernel_size' >= 1, got 0 (Loom's kernel loop then sums nothing: every "
     "output would be the activation of 0)"),
    ("residual-around-embedding-1", _grid(_seq(_emb(e=1), {"type": "Residual"})),
     "Loom JSON: layers[0].sequential_layers[1]: Residual around an Embedding of embedding_dim 1: Loom adds the token ids "
     "to the embeddings; not supported"),
    ("residual-reshaping-conv", _grid(_seq(_d(4, 8), {"type": "CNN1", "input_channels": 2, "filters": 4, "kernel_size": 3,
                                                     "stride": 1, "padding": 0, "input_height": 4, "output_height": 2},
                                          {"type": "Residual"})),
     "Loom JSON: layers[0].sequential_layers[2]: Residual around a layer that maps [2, 4] to [4, 2]: Loom adds the two "
     "flat buffers, torchloom's Residual needs one shape; not supported"),
    ("kmeans-with-weights", _grid({"type": "KMeans", "num_clusters": 2, "input_height": 3, "weights": _w(6)}),
     "Loom JSON: layers[0]: layer type KMeans is not supported: Loom's KMeans treats its whole input buffer (every sample "
     "of the batch together) as one feature vector and fills only the first sample's outputs, so it is defined for a "
     "batch of one sample only (a larger batch reads past its num_clusters × input_height cluster centres); torchloom "
     "has no layer that computes this per sample"),
    ("metacognition", _grid({"type": "Meta"}),
     "Loom JSON: layers[0]: layer type Metacognition is not supported: Loom's Metacognition layer watches another layer's "
     "statistics and rewrites layers of the network while it runs (its meta_rules); torchloom has no equivalent, and the "
     "file alone does not say what the network computes"),
    ("z-null", {**_grid(_d(2, 3)), "layers": [dict(_d(2, 3), z=None, y=0, x=0, l=0)]},
     "Loom JSON: layers[0]: 'z' is null; Loom would silently read it as 0. Give a value or leave the key out"),
    ("activation-null", _grid(_d(2, 3, None)),
     "Loom JSON: layers[0]: 'activation' is null; Loom would silently read it as \"\" (linear). Give a value or leave the key out"),
    ("nested-height-null", _grid(_seq(dict(_d(2, 3), output_height=None))),
     "Loom JSON: layers[0].sequential_layers[0]: 'output_height' is null; Loom would silently read it as 0. Give a "
     "value or leave the key out"),
    ("temperature-null", _grid(_d(2, 3), {"type": "Softmax", "temperature": None}),
     "Loom JSON: layers[1]: 'temperature' is null; Loom would silently read it as 0. Give a value or leave the key out"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_file_that_would_run_differently_is_refused_with_the_exact_message(case, tmp_path):
    _, cfg, message = case
    for load in (lambda: from_loom_json(cfg), lambda: from_loom_json(json.dumps(cfg))):
        with pytest.raises(ValueError) as info:
            load()
        assert info.type is ValueError
        assert str(info.value) == message
    path = tmp_path / "net.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        load_loom(path)
    assert sorted(os.listdir(tmp_path)) == ["net.json"]


def test_null_lists_are_what_go_writes_for_nil():
    """Go writes a nil slice or pointer as ``null``: those still load (``parallel_branches: null`` is
    an empty Parallel, which Loom passes through)."""
    cfg = _grid(_d(2, 3), dict(_seq(), sequential_layers=None), dict(_d(3, 3), parallel_branches=None, mask=None,
                                                                      meta_observed_layer=None))
    net = from_loom_json(cfg)
    assert len(net) == 2


# ----------------------------------------------------- a str that is neither a file nor JSON text
@pytest.mark.parametrize(
    "text,what",
    [("null", "nor JSON text of a Loom network (as JSON it is null; a Loom network is a JSON object)"),
     ("3", "nor JSON text of a Loom network (as JSON it is a number; a Loom network is a JSON object)"),
     ('"net.json"', "nor JSON text of a Loom network (as JSON it is a string; a Loom network is a JSON object)"),
     ("not json", "nor valid JSON (Expecting value); give a path, JSON text of a Loom network, or a dict"),
     ("models/missing.json", "nor valid JSON (Expecting value); give a path, JSON text of a Loom network, or a dict")],
)
def test_a_str_that_is_neither_an_existing_file_nor_json_says_both(text, what, tmp_path, monkeypatch):
    from torchloom.interop import NotFileNorJSONError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(NotFileNorJSONError) as info:
        from_loom_json(text)
    assert isinstance(info.value, ValueError) and isinstance(info.value, FileNotFoundError)
    where = os.path.join(str(tmp_path), text)
    assert str(info.value) == f"from_loom_json: cfg {text!r} is neither an existing file (no such file: {where!r}) {what}"
    assert os.listdir(tmp_path) == []


def test_an_existing_file_named_like_json_is_read_as_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "null").write_text(json.dumps(BASE))
    assert from_loom_json("null")(torch.ones(1, 3)).shape == (1, 2)
    with pytest.raises(FileNotFoundError, match="load_loom: no such file"):
        load_loom("missing.json")  # a path argument: the plain FileNotFoundError
