"""Every layer under ``torch.compile(fullgraph=True)`` on the CPU: no graph break, the hand-written
backward kept (each layer's ``autograd.Function`` is one ``autograd_function_apply`` node of the captured
graph), compiled forward and backward equal to eager, no recompile across training steps of one
shape, ``dynamic=True`` over batch sizes, float32 and ``torch.autocast(bfloat16)``, and a model mixing
torchloom layers with plain ``nn.Module``s compiled as one graph.

References: the same layer run eagerly with the same weights (the compiled graph runs the same
hand-written math, so the match is tight), and a float64 copy of it run eagerly (checked against
``gradcheck`` and PyTorch's own modules in the other layer tests), with float32 / bfloat16 tolerances.
The compiled functions use the ``aot_eager`` backend (AOTAutograd traces forward and backward,
then runs the graphs eagerly: the trace is what is under test, and it is fast); one test compiles a
mixed model with Inductor, the backend users get by default.

Dynamo is reset before and after every test, and every setting is changed only through
``torch._dynamo.config.patch``, which puts it back.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import re

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch import nn

from helpers import assert_close
from torchloom.layers.attention import MultiHeadAttention
from torchloom.layers.containers import Parallel, Residual
from torchloom.layers.conv import Conv1D, Conv2D, Conv3D, Flatten
from torchloom.layers.base import Layer
from torchloom.layers.conv_transpose import ConvTranspose1D, ConvTranspose2D, ConvTranspose3D
from torchloom.layers.dense import Dense
from torchloom.layers.embedding import Embedding
from torchloom.layers.lstm import LSTM
from torchloom.layers.module_layer import ModuleLayer
from torchloom.layers.network import Network, Sequential
from torchloom.layers.norm import LayerNorm, RMSNorm
from torchloom.layers.rnn import RNN, LastStep
from torchloom.layers.softmax import Softmax
from torchloom.layers.swiglu import SwiGLU


def _randn(*trailing):
    return lambda batch: torch.randn(batch, *trailing)


# name -> (layer factory, input factory of the batch size); odd sizes throughout.
CASES = {
    "dense": (lambda: Dense(7, 5, "gelu"), _randn(7)),
    "conv1d": (lambda: Conv1D(3, 4, 3, padding=1, activation="tanh"), _randn(3, 9)),
    "conv2d": (lambda: Conv2D(3, 4, 3, stride=2, padding=1, activation="relu"), _randn(3, 7, 5)),
    "conv3d": (lambda: Conv3D(2, 3, 2, activation="silu"), _randn(2, 4, 3, 4)),
    "conv_transpose1d": (lambda: ConvTranspose1D(3, 4, 3, stride=2, padding=1, output_padding=1, activation="tanh"), _randn(3, 5)),
    "conv_transpose2d": (lambda: ConvTranspose2D(3, 2, (3, 2), stride=2, padding=1), _randn(3, 4, 3)),
    "conv_transpose3d": (lambda: ConvTranspose3D(2, 3, 2, activation="sigmoid"), _randn(2, 3, 2, 3)),
    "rnn": (lambda: RNN(5, 7), _randn(4, 5)),
    "lstm": (lambda: LSTM(5, 6), _randn(4, 5)),
    "lstm_nobias_one_step": (lambda: LSTM(3, 5, bias=False), _randn(1, 3)),
    "mha": (lambda: MultiHeadAttention(12, 3, causal=False, rope=False), _randn(5, 12)),
    "mha_causal": (lambda: MultiHeadAttention(12, 3, causal=True, rope=False), _randn(5, 12)),
    "mha_rope": (lambda: MultiHeadAttention(12, 3, causal=True, rope=True), _randn(5, 12)),
    "mha_gqa": (lambda: MultiHeadAttention(16, 4, num_kv_heads=2, causal=True, rope=True), _randn(5, 16)),
    "swiglu": (lambda: SwiGLU(6, 11), _randn(6)),
    "rmsnorm": (lambda: RMSNorm(9), _randn(3, 9)),
    "layernorm": (lambda: LayerNorm(9), _randn(9)),
    "softmax": (lambda: Softmax(temperature=1.5), _randn(9)),
    "embedding": (lambda: Embedding(11, 6), lambda batch: torch.randint(0, 11, (batch, 3))),
    "residual": (lambda: Residual(Dense(6, 6, "silu")), _randn(6)),
    "parallel": (lambda: Parallel([Dense(6, 3, "tanh"), SwiGLU(6, 5)], combine="concat"), _randn(6)),
    "sequential": (lambda: Sequential(Conv1D(2, 3, 3), Flatten(), Dense(15, 4), LayerNorm(4)), _randn(2, 7)),
    "network": (lambda: Network(LSTM(4, 6), LastStep(), Dense(6, 8, "relu"), RMSNorm(8), Dense(8, 3), Softmax()), _randn(3, 4)),
}
# The compiled-vs-eager training runs take ~1 s each: under autocast and dynamic=True they cover one
# case per autograd.Function and the containers (every case is traced in those modes by the explain
# test or by a fullgraph=True compiled test).
BF16_CASES = ["dense", "conv2d", "conv_transpose1d", "rnn", "lstm", "mha", "mha_gqa", "swiglu", "rmsnorm",
              "layernorm", "softmax", "embedding", "residual", "parallel", "sequential", "network"]
DYNAMIC_CASES = ["dense", "conv2d", "conv_transpose2d", "rnn", "mha_gqa", "swiglu", "layernorm", "softmax",
                 "embedding", "parallel", "network"]
BATCH = 4
LR = 0.05  # the plain SGD step between training steps (the parameters change, the graph must not)


ATTENTION = importlib.import_module("torchloom.layers.attention")


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    """Each test compiles from scratch and leaves no compiled code behind, with an empty store of
    RoPE tables (eager attention keeps its tables there; a traced region must not touch it)."""
    monkeypatch.setattr(ATTENTION, "_ROPE_CACHE", {})
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _randomize(layer: nn.Module) -> nn.Module:
    """Non-trivial parameters (biases away from zero), from one seed."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (0.3 if p.dim() == 1 else 0.0))
    return layer


def _loss_fn(layer: nn.Module, autocast: bool):
    """``x, g -> (y, loss)``: the layer's output and ``Σ y·g`` (float32; ``Σ y²`` when ``g`` is None),
    under bfloat16 autocast when asked (the autocast context inside the compiled region)."""

    def step(x, g=None):
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = layer(x)
        else:
            y = layer(x)
        return y, (y.float() * (y.float() if g is None else g)).sum()

    return step


def _run(step, layer, x, g):
    """One forward and backward: ``(output, input grad or None, parameter grads)``."""
    layer.zero_grad(set_to_none=True)
    xa = x.clone().requires_grad_() if x.is_floating_point() else x
    y, loss = step(xa, g)
    loss.backward()
    grads = [p.grad for p in layer.parameters()]
    assert all(gp is not None for gp in grads)
    return y.detach(), (xa.grad if x.is_floating_point() else None), grads


def _sgd(layer: nn.Module) -> None:
    with torch.no_grad():
        for p in layer.parameters():
            p.sub_(p.grad, alpha=LR)


def _compare(tag, got, ref, rtol, atol):
    (y, gx, grads), (y_ref, gx_ref, grads_ref) = got, ref
    assert y.dtype == y_ref.dtype, f"{tag}: output dtype {y.dtype} != eager's {y_ref.dtype}"
    assert_close(y, y_ref, name=f"{tag} output", rtol=rtol, atol=atol)
    if gx_ref is not None:
        assert gx.dtype == gx_ref.dtype
        assert_close(gx, gx_ref, name=f"{tag} input grad", rtol=rtol, atol=atol)
    for i, (gp, gr) in enumerate(zip(grads, grads_ref)):
        assert gp.dtype == gr.dtype, f"{tag}: grad of parameter {i} has dtype {gp.dtype}, eager {gr.dtype}"
        assert_close(gp, gr, name=f"{tag} grad of parameter {i}", rtol=rtol, atol=atol)


def _float64_reference(layer, x, g):
    """The same layer (current weights) in float64, eagerly: output and gradients."""
    ref = copy.deepcopy(layer).double()
    xr = x.double() if x.is_floating_point() else x
    return _run(_loss_fn(ref, False), ref, xr, g.double())


def _assert_hand_written_backward_kept(counter, name):
    """The captured graph calls the layers' ``autograd.Function``s (Dynamo's ``autograd_function_apply``
    node holds the hand-written backward); autograd would otherwise differentiate the forward's ops."""
    targets = [str(n.target) for gm in counter.graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert any("autograd_function_apply" in t for t in targets), f"{name}: no autograd.Function in the graph: {targets}"


def _rel(a, ref):
    """``‖a − ref‖ / max(‖ref‖, 1)``: relative error, at unit scale at least (some gradients are exactly
    zero in theory, e.g. attention's key bias, whose shift the softmax ignores: float32 leaves ~1e-6)."""
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1.0))


def _train_and_compare(name, *, autocast, dynamic, batches, rtol, atol, floor):
    """Train an eager copy and a compiled copy of one layer side by side (SGD steps between), comparing
    outputs and every gradient at each step with eager's (``rtol``, ``atol``) and with float64's: the
    compiled error may be at most twice eager's own error at that precision, plus ``floor``. Returns
    the compile counter."""
    make_layer, make_x = CASES[name]
    torch.manual_seed(0)
    eager = _randomize(make_layer())
    compiled_layer = copy.deepcopy(eager)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_loss_fn(compiled_layer, autocast), backend=counter, fullgraph=True, dynamic=dynamic)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step, batch in enumerate(batches):
            x = make_x(batch)
            with torch.no_grad():
                y0 = eager(x)  # only for the shape of the upstream gradient
            g = torch.randn(y0.shape, generator=torch.Generator().manual_seed(10 + step))
            ref = _run(_loss_fn(eager, autocast), eager, x, g)
            got = _run(compiled, compiled_layer, x, g)
            _compare(f"{name} step {step} (batch {batch}) compiled vs eager", got, ref, rtol, atol)
            y64, gx64, grads64 = _float64_reference(eager, x, g)
            pairs = [("output", got[0], ref[0], y64), ("input grad", got[1], ref[1], gx64)]
            pairs += [(f"grad of parameter {i}", gp, gr, g64) for i, (gp, gr, g64) in enumerate(zip(got[2], ref[2], grads64))]
            for what, a, e, r in pairs:
                if r is not None:
                    err, eager_err = _rel(a, r), _rel(e, r)
                    assert err <= 2 * eager_err + floor, (
                        f"{name} step {step}: {what} vs float64, rel. error {err:.1e} (eager's {eager_err:.1e})")
            _sgd(eager)
            _sgd(compiled_layer)
            if step == 0:
                first_compiles = counter.frame_count
    # Under dynamic=True the first compile may call the backend twice: Dynamo restarts once when a float
    # it traced as symbolic gets specialised (attention's rope_theta). The later steps add nothing.
    allowed = 2 if dynamic else 1
    assert counter.frame_count == first_compiles <= allowed, f"{name}: {counter.frame_count} compiles, {first_compiles} at step 0"
    _assert_hand_written_backward_kept(counter, name)
    return counter


# ------------------------------------------------------------------------------------- graph breaks
# The compiled-vs-eager tests below compile with fullgraph=True, which fails on any graph break: in a
# mode where a case has such a test, explain would repeat it, except for attention, whose traces
# there follow an eager call that filled the RoPE store (explain traces with the store cold). So
# explain covers the cases without a compiled test in that mode, and attention in every mode.
COMPILED_IN = {"fp32": set(CASES), "bf16": set(BF16_CASES), "dynamic": set(DYNAMIC_CASES)}
EXPLAIN_CASES = [(name, mode) for mode in ("fp32", "bf16", "dynamic") for name in CASES
                 if name not in COMPILED_IN[mode] or name.startswith("mha")]


@pytest.mark.parametrize("name,mode", EXPLAIN_CASES, ids=[f"{n}-{m}" for n, m in EXPLAIN_CASES])
def test_explain_no_graph_breaks(name, mode):
    """``torch._dynamo.explain`` of the forward (which traces the hand-written backward too): one
    graph, no break; in float32, under bfloat16 autocast, and with every size symbolic (what
    ``torch.compile(dynamic=True)`` sets: ``assume_static_by_default=False``). Then a forward and
    backward compiled with ``fullgraph=True`` on a fresh copy: explain has reported no break where
    ``fullgraph`` fails (a container whose traced backward set an attribute)."""
    make_layer, make_x = CASES[name]
    layer = _randomize(make_layer())
    x = make_x(8)  # a batch size equal to no other dimension (Dynamo would tie equal sizes together)
    if x.is_floating_point():
        x.requires_grad_()
    # (no eager call first: the traced code meets every store and cache cold, as in a fresh process)
    with torch._dynamo.config.patch(assume_static_by_default=mode != "dynamic"):
        explanation = torch._dynamo.explain(_loss_fn(layer, mode == "bf16"))(x)
    reasons = [str(b.reason).splitlines()[0] for b in explanation.break_reasons]
    assert explanation.graph_break_count == 0, f"{name}: {explanation.graph_break_count} graph breaks: {reasons}"
    assert explanation.graph_count == 1, f"{name}: {explanation.graph_count} graphs"
    fresh = _randomize(make_layer())
    torch._dynamo.reset()
    compiled = torch.compile(_loss_fn(fresh, mode == "bf16"), backend="eager", fullgraph=True, dynamic=mode == "dynamic" or None)
    _, loss = compiled(x)
    loss.backward()


# ------------------------------------------------------------------------ compiled == eager, 3 steps
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_float32_matches_eager(name):
    """fullgraph=True, three SGD steps of one shape: one compile, outputs and gradients equal to eager
    (to float32 rounding: the same ops, possibly fused or reordered) and to float64."""
    _train_and_compare(name, autocast=False, dynamic=None, batches=(BATCH,) * 3, rtol=1e-5, atol=1e-6, floor=1e-6)


@pytest.mark.parametrize("name", BF16_CASES)
def test_compiled_bf16_autocast_matches_eager(name):
    """The same under ``torch.autocast("cpu", bfloat16)`` inside the compiled region: outputs in the
    eager dtypes, gradients in the parameters' dtype, equal to eager within two bfloat16 units of
    rounding (the same ops run: bit-equal with torch 2.13) and within bfloat16 error of float64."""
    _train_and_compare(name, autocast=True, dynamic=None, batches=(BATCH,) * 3, rtol=8e-3, atol=1e-4, floor=1e-3)


@pytest.mark.parametrize("name", DYNAMIC_CASES)
def test_compiled_dynamic_batch(name):
    """``dynamic=True``: three batch sizes, one graph (``error_on_recompile``), eager's numbers. (Sizes
    that equal no other dimension of the inputs: Dynamo would tie equal sizes into one symbol.)"""
    counter = _train_and_compare(name, autocast=False, dynamic=True, batches=(8, 13, 10), rtol=1e-5, atol=1e-6, floor=1e-6)
    placeholders = [n for n in counter.graphs[-1].graph.nodes if n.op == "placeholder"]
    assert any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in placeholders) or any(
        not isinstance(s, int) for n in placeholders for s in getattr(n.meta.get("example_value"), "shape", ())
    ), f"{name}: the graph has no symbolic size"


# Under autocast and dynamic=True together, a handful (each of these modes alone covers more cases
# above): a GEMM, a convolution, a time loop, attention, a norm, a gate, a lookup.
BF16_DYNAMIC_CASES = ["dense", "conv2d", "rnn", "mha", "rmsnorm", "swiglu", "embedding"]


@pytest.mark.parametrize("name", BF16_DYNAMIC_CASES)
def test_compiled_bf16_autocast_dynamic_batch(name):
    """``torch.autocast(bfloat16)`` inside a ``dynamic=True`` graph: two batch sizes, one graph
    (``error_on_recompile``, and the compile counter unchanged after the first step), eager's
    bfloat16 numbers, within bfloat16 error of float64."""
    _train_and_compare(name, autocast=True, dynamic=True, batches=(8, 13), rtol=8e-3, atol=1e-4, floor=1e-3)


# ------------------------------------------------------------------------------------ mixed models
class _Mixed(nn.Module):
    """torchloom layers and plain PyTorch modules in one model."""

    def __init__(self):
        super().__init__()
        self.embed = Embedding(13, 16)
        self.norm = nn.LayerNorm(16)
        self.attn = MultiHeadAttention(16, 4, num_kv_heads=2)
        self.head = nn.Sequential(RMSNorm(16), nn.Linear(16, 8), nn.GELU(), Dense(8, 5, "tanh"))

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.attn(self.norm(h))
        return self.head(h)


def _mixed_network():
    """A ``Network`` whose chain holds plain modules (wrapped as ``ModuleLayer``)."""
    return Network(Conv2D(2, 4, 3, padding=1, activation="relu"), nn.BatchNorm2d(4), Flatten(), Dense(4 * 5 * 5, 10, "silu"),
                   nn.Dropout(0.0), RMSNorm(10), nn.Linear(10, 3))


def test_mixed_model_inductor():
    """A model of torchloom layers and plain modules compiles as one graph (explain: no break) with
    Inductor, the default backend (generated C++ here); forward and backward equal eager over two SGD
    steps with one compile. Scalar C++ (``cpp.vec_isa_ok=False``, restored after): on a cold cache the
    vectorised build first probes the compiler for each instruction set, ~10 s of this test's ~17."""
    import torch._inductor.config

    torch.manual_seed(0)
    eager = _randomize(_Mixed())
    compiled_model = copy.deepcopy(eager)
    g = torch.randn(3, 6, 5)
    explanation = torch._dynamo.explain(_loss_fn(eager, False))(torch.randint(0, 13, (3, 6)), g)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(_loss_fn(compiled_model, False), backend=counter, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True), torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
        for step in range(2):
            tokens = torch.randint(0, 13, (3, 6))
            ref = _run(_loss_fn(eager, False), eager, tokens, g)
            got = _run(compiled, compiled_model, tokens, g)
            _compare(f"mixed model (inductor) step {step}", got, ref, rtol=1e-4, atol=1e-5)
            _sgd(eager)
            _sgd(compiled_model)
    assert counter.frame_count == 1
    _assert_hand_written_backward_kept(counter, "mixed model")


def test_network_of_plain_modules_compiles():
    """A torchloom ``Network`` holding plain modules (BatchNorm in train mode: its running statistics
    are updated by the compiled graph as by eager)."""
    torch.manual_seed(0)
    eager = _randomize(_mixed_network())
    compiled_net = copy.deepcopy(eager)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_loss_fn(compiled_net, False), backend=counter, fullgraph=True)
    g = torch.randn(4, 3)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(2):
            x = torch.randn(4, 2, 5, 5)
            ref = _run(_loss_fn(eager, False), eager, x, g)
            got = _run(compiled, compiled_net, x, g)
            _compare(f"network step {step}", got, ref, rtol=1e-5, atol=1e-6)
            _sgd(eager)
            _sgd(compiled_net)
    assert counter.frame_count == 1
    bn_eager, bn_compiled = eager[1].module, compiled_net[1].module
    assert_close(bn_compiled.running_mean, bn_eager.running_mean, name="running_mean", rtol=1e-6, atol=1e-7)
    assert_close(bn_compiled.running_var, bn_eager.running_var, name="running_var", rtol=1e-6, atol=1e-7)


class _TwoParams(Layer):
    """A user's layer on the base class's ``forward`` with exactly two parameters: ``y = x w + b``."""

    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(6, 6) * 0.3), nn.Parameter(torch.randn(6) * 0.3)

    def forward_saved(self, x):
        return x @ self.w + self.b, x

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        return grad_out @ self.w.t(), (saved.t() @ grad_out, grad_out.sum(0))


_NO_GRAD_CASES = {  # each with exactly two parameters: the count torch.compile's no-grad trace of the Function got wrong
    "residual": lambda: Residual(Dense(6, 6, "tanh")),
    "parallel": lambda: Parallel([Dense(6, 3, bias=False), Dense(6, 2, bias=False)]),
    "own layer": _TwoParams,
}


@pytest.mark.parametrize("how", ["no_grad", "inference_mode", "frozen"])
@pytest.mark.parametrize("name", list(_NO_GRAD_CASES))
def test_layers_compile_where_nothing_needs_a_gradient(name, how):
    """Under ``no_grad``, ``inference_mode`` or with every parameter and the input frozen, a layer on
    the base class's ``forward`` (here with two parameters) compiles with ``fullgraph=True`` and gives
    the output of its autograd call with gradients on."""
    torch.manual_seed(0)
    layer = _NO_GRAD_CASES[name]()
    x = torch.randn(4, 6)
    want = layer(x.clone().requires_grad_()).detach()  # through the autograd Function
    if how == "frozen":
        layer.requires_grad_(False)
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "frozen": torch.enable_grad}[how]
    torch._dynamo.reset()
    with context():
        got = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
    assert not got.requires_grad
    assert_close(got, want, name=f"{name} ({how})", rtol=0, atol=0)


_PLAIN_INSIDE_CASES = {
    "residual(sequential)": lambda: Residual(Sequential(Dense(6, 6, "tanh"), RMSNorm(6))),
    "residual(plain module)": lambda: Residual(ModuleLayer(nn.Linear(6, 6))),
    "parallel(plain module, dense)": lambda: Parallel([ModuleLayer(nn.LayerNorm(6)), Dense(6, 3)]),
    "network(residual(sequential(plain module)))": lambda: Network(
        Dense(6, 6), Residual(Sequential(ModuleLayer(nn.Linear(6, 6)), Dense(6, 6, "tanh"))), Dense(6, 2)),
}


@pytest.mark.parametrize("name", list(_PLAIN_INSIDE_CASES))
def test_containers_compile_around_chains_and_plain_modules(name):
    """A ``Sequential`` or a plain module (``ModuleLayer``) inside ``Residual`` / ``Parallel``, compiled
    with ``fullgraph=True`` on a fresh model (no eager backward first), gives the eager model's output and
    gradients; eagerly the containers run their hand-written backward, which for the plain module calls
    ``torch.autograd.grad`` (compiled: the children called as modules)."""
    torch.manual_seed(0)
    eager = _randomize(_PLAIN_INSIDE_CASES[name]())
    compiled_model = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(_loss_fn(compiled_model, False), backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 6)
    g = torch.randn(eager(x).shape)
    got = _run(compiled, compiled_model, x, g)
    ref = _run(_loss_fn(eager, False), eager, x, g)
    _compare(f"{name} compiled vs eager", got, ref, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------- checks compiled
def test_compiled_embedding_still_checks_indices():
    """The index range check survives compilation as a device-side assertion: an out-of-range index
    fails the compiled call with the layer's message (eagerly it is a ``ValueError``)."""
    layer = Embedding(11, 6)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    ok = torch.randint(0, 11, (4, 3))
    assert_close(compiled(ok), layer(ok), name="lookup", rtol=0, atol=0)
    for bad in (torch.tensor([[0, 11, 2]]), torch.tensor([[-1, 0, 1]])):
        with pytest.raises(RuntimeError, match=r"indices must lie in \[0, 11\)"):
            compiled(bad)
        with pytest.raises(ValueError, match=r"indices must lie in \[0, 11\)"):
            layer(bad)


def test_compiled_attention_keeps_no_rope_tables():
    """Eager attention keeps its RoPE tables in a host-side store; a compiled graph of the materialised
    path (here: the CPU default) makes its own and neither reads nor fills the store (its tensors are
    fake while it traces; a kept table would also pin the sequence length). (The flash path's opaque
    operators use the store at run time: ``test_compiled_flash_attention_runs_the_eager_core``.)"""
    layer = _randomize(MultiHeadAttention(16, 4, num_kv_heads=2))
    x = torch.randn(2, 7, 16)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    y.sum().backward()
    assert ATTENTION._ROPE_CACHE == {}
    assert_close(y, layer(x), name="output", rtol=1e-5, atol=1e-6)
    assert len(ATTENTION._ROPE_CACHE) == 1  # the eager call kept its tables


# ------------------------------------------------------------ the flash path behind opaque operators
def _flash_device() -> str:
    """The flash kernels' device: CUDA where there is one, else the CPU through Triton's interpreter."""
    from torchloom.kernels._triton import interpreter_enabled, triton_available

    if not triton_available() or not (torch.cuda.is_available() or interpreter_enabled()):
        pytest.skip("the flash path needs Triton (its interpreter on CPU)")
    return "cuda" if torch.cuda.is_available() else "cpu"


def _flash_layer(d, h, kv, causal, rope, bias, device):
    """A randomised MultiHeadAttention whose spec asks for the flash kernel (``backend="triton"``)."""
    layer = _randomize(MultiHeadAttention(d, h, num_kv_heads=kv, causal=causal, rope=rope, bias=bias)).to(device)
    layer.spec = dataclasses.replace(layer.spec, backend="triton")
    return layer


def _graph_targets(counter) -> list[str]:
    """Every call in the captured graphs and their subgraphs (the Function's forward and backward)."""
    return [str(n.target) for gm in counter.graphs for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
            for n in sub.graph.nodes if n.op == "call_function"]


# (d_model, heads, kv heads, causal, rope, bias, batches, dynamic, bfloat16 autocast); sequence lengths
# 5 and 7, ragged against the interpreter's 16-wide blocks.
FLASH_COMPILE_CASES = {
    "gqa_causal_rope": (16, 4, 2, True, True, True, (3, 3), None, False),
    "full_norope_nobias": (12, 3, 3, False, False, False, (2, 2), None, False),
    "mqa_rope_dynamic": (16, 2, 1, False, True, True, (3, 5), True, False),
    "gqa_causal_rope_bf16": (16, 4, 2, True, True, True, (3, 3), None, True),
}


@pytest.mark.parametrize("name", list(FLASH_COMPILE_CASES))
def test_compiled_flash_attention_runs_the_eager_core(name):
    """``backend="triton"`` (the flash path) under ``fullgraph=True``: the captured graph calls the
    opaque ``torchloom::flash_attention_core`` / ``flash_attention_core_backward`` (the eager RoPE and
    flash kernels, not a traced copy of them), and two training steps give eager's output and every
    gradient (the same kernels: equal to rounding) and float64's (the materialised path; within twice
    eager's own error, plus a floor), with one compile; the RoPE tables come from the store at run
    time, as eagerly. In float32 and under ``torch.autocast(bfloat16)``."""
    device = _flash_device()
    d, h, kv, causal, rope, bias, batches, dynamic, autocast = FLASH_COMPILE_CASES[name]
    if autocast and device == "cuda":
        pytest.skip("the autocast here is the CPU's")
    tol = dict(rtol=8e-3, atol=1e-4) if autocast else dict(rtol=1e-5, atol=1e-6)
    seq = 5 if causal else 7
    eager = _flash_layer(d, h, kv, causal, rope, bias, device)
    compiled_layer = copy.deepcopy(eager)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_loss_fn(compiled_layer, autocast), backend=counter, fullgraph=True, dynamic=dynamic)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step, batch in enumerate(batches):
            x, g = torch.randn(batch, seq, d, device=device), torch.randn(batch, seq, d, device=device)
            got = _run(compiled, compiled_layer, x, g)
            if step == 0 and rope:  # only the compiled layer has run: its operators kept the tables
                assert [k[:2] + k[3:5] for k in ATTENTION._ROPE_CACHE] == [(seq, d // h, x.device, torch.float32)]
            ref = _run(_loss_fn(eager, autocast), eager, x, g)
            _compare(f"{name} step {step} compiled vs eager", got, ref, **tol)
            reference = copy.deepcopy(eager)
            reference.spec = dataclasses.replace(reference.spec, backend=None)  # float64: the materialised path
            y64, gx64, grads64 = _float64_reference(reference, x, g)
            pairs = [("output", got[0], ref[0], y64), ("input grad", got[1], ref[1], gx64)]
            pairs += [(f"grad of parameter {i}", gp, gr, g64) for i, (gp, gr, g64) in enumerate(zip(got[2], ref[2], grads64))]
            for what, a, e, r in pairs:
                err, eager_err = _rel(a, r), _rel(e, r)
                assert err <= 2 * eager_err + (1e-3 if autocast else 1e-6), (
                    f"{name} step {step}: {what} vs float64, rel. error {err:.1e} (eager's {eager_err:.1e})")
            _sgd(eager)
            _sgd(compiled_layer)
            if step == 0:
                first_compiles = counter.frame_count
    allowed = 2 if dynamic else 1  # dynamic=True: one restart of the first compile (see _train_and_compare)
    assert counter.frame_count == first_compiles <= allowed, f"{name}: {counter.frame_count} compiles, {first_compiles} at step 0"
    targets = _graph_targets(counter)
    for op in ("torchloom.flash_attention_core.default", "torchloom.flash_attention_core_backward.default"):
        assert op in targets, f"{name}: the graph does not call {op}: {sorted(set(targets))}"
    _assert_hand_written_backward_kept(counter, name)


class _Traced(Exception):
    """Raised by ``_capture_only``'s backend once it holds the graph (the graph is not run)."""


def _capture_only(module, x, dynamic):
    """The calls in the forward and backward graphs AOTAutograd makes of ``torch.compile(module,
    fullgraph=True)`` for ``module(x)``, not compiled further nor run (a CUDA operator in them could not
    run on the CPU): a graph break, or a failure of AOTAutograd's tracing, raises here."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition

    graphs = []

    def partition(joint, inputs, **kwargs):
        graphs.extend(default_partition(joint, inputs, **kwargs))
        raise _Traced

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=partition)
    with pytest.raises(Exception) as caught:
        torch.compile(module, backend=backend, fullgraph=True, dynamic=dynamic)(x)
    inner = getattr(caught.value, "inner_exception", caught.value)  # Dynamo wraps the backend's exception
    assert isinstance(inner, _Traced), repr(caught.value)
    torch._dynamo.reset()
    # an operator that writes an input is called through auto_functionalized(operator, ...)
    return [" ".join(map(str, (n.target, *n.args[:1]))) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("choice", ["flash", "efficient", "cudnn"])
def test_compiled_flash_path_traces_pytorchs_fused_kernel(choice, monkeypatch):
    """Where PyTorch's fused attention kernel serves the flash path's core (CUDA; forced here on the
    CPU, where only the capture is checked: tests/layers/test_compile_cuda.py runs it), a compiled
    layer traces it with no graph break: its forward and backward graphs call the kernel's ATen
    operators and none of torchloom's opaque ones; the RoPE tables are a constant of the graph (no
    sin/cos traced). With ``dynamic=True`` (symbolic sizes: the kernel cannot be chosen while
    tracing) the opaque operators run instead."""
    from torchloom.kernels import flash_attention as FA
    from torchloom.layers import _traced_attention as TRACED

    code = {"flash": FA.SDPA_FLASH, "efficient": FA.SDPA_EFFICIENT, "cudnn": FA.SDPA_CUDNN}[choice]
    monkeypatch.setattr(ATTENTION, "_use_flash", lambda x, spec: True)  # the opaque path, with dynamic=True
    monkeypatch.setattr(TRACED, "sdpa_choice_constant", torch.compiler.assume_constant_result(lambda *args: code))
    layer = MultiHeadAttention(16, 4, num_kv_heads=4 if choice == "efficient" else 2)
    x = torch.randn(2, 6, 16, requires_grad=True)
    targets = _capture_only(layer, x, dynamic=False)
    for op in (f"aten._scaled_dot_product_{choice}_attention.default",
               f"aten._scaled_dot_product_{choice}_attention_backward.default"):
        assert any(t.startswith(op) for t in targets), f"the graph does not call {op}: {sorted(set(targets))}"
    assert not [t for t in targets if "torchloom" in t or "flash_attention_core" in t], sorted(set(targets))
    assert not [t for t in targets if re.search(r"\b(cos|sin)\b", t)], f"RoPE tables traced: {sorted(set(targets))}"
    dynamic = _capture_only(layer, x, dynamic=True)
    assert any("torchloom.flash_attention_core.default" in t for t in dynamic), sorted(set(dynamic))
    assert not [t for t in dynamic if "_scaled_dot_product" in t], sorted(set(dynamic))


def test_compiled_flash_path_stays_traced_after_a_ragged_batch(monkeypatch):
    """A ragged last batch makes Dynamo compile again with a symbolic batch size (``dynamic=None``, the
    default and ``train(compile=True)``'s): that graph still traces PyTorch's fused kernel (chosen for
    one sample), not the opaque operators."""
    from torchloom.kernels import flash_attention as FA
    from torchloom.layers import _traced_attention as TRACED

    seen = []
    monkeypatch.setattr(TRACED, "sdpa_choice_constant",
                        torch.compiler.assume_constant_result(lambda *args: seen.append(args) or FA.SDPA_CUDNN))
    layer = MultiHeadAttention(16, 4, num_kv_heads=2)
    x = torch.randn(4, 6, 16, requires_grad=True)
    torch._dynamo.mark_dynamic(x, 0)  # what the recompile after a ragged batch does
    targets = _capture_only(layer, x, dynamic=None)
    assert any(t.startswith("aten._scaled_dot_product_cudnn_attention.default") for t in targets), sorted(set(targets))
    assert not any("torchloom" in t for t in targets), sorted(set(targets))
    assert seen and all(a[0] == 6 for a in seen), seen  # asked for S = 6, no batch


def _sdpa_float64_raw(choice, q, k, v, causal, scale):
    """``flash_attention.sdpa_forward_raw``'s contract in float64 on the CPU (for the traced path's math):
    ``(o [B,S,H,D], lse, seed, offset)``; lse/seed/offset unused placeholders."""
    o = _sdpa_float64(q, k, v, causal, scale)
    return o, o.new_zeros(()), o.new_zeros(()), o.new_zeros(())


def _sdpa_float64(q, k, v, causal, scale):
    g = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)))
    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale).transpose(1, 2)


def _sdpa_float64_backward_raw(choice, do, q, k, v, o, lse, seed, offset, causal, scale):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        out = _sdpa_float64(*leaves, causal, scale)
    return torch.autograd.grad(out, leaves, do)


@pytest.mark.parametrize("kv,bias,rope,causal,input_grad", [
    (4, True, True, True, True), (2, True, True, False, True), (1, False, True, True, False),
    (2, False, False, True, True), (4, True, False, False, False),
])
def test_traced_flash_path_math_equals_the_materialised_path(kv, bias, rope, causal, input_grad, monkeypatch):
    """The traced flash path's own math (its products, RoPE and its inverse, the joined q|k gradient,
    the bias sums, grouped heads), with the fused kernel's calls replaced by float64 attention and its
    autograd backward, and its RoPE tables made in float64 (float32 on the GPU): output and every
    gradient equal the materialised path's in float64."""
    from torchloom.kernels import flash_attention as FA
    from torchloom.layers import _traced_attention as TRACED
    from torchloom.layers.rope import rope_tables

    monkeypatch.setattr(FA, "sdpa_forward_raw", _sdpa_float64_raw)
    monkeypatch.setattr(FA, "sdpa_backward_raw", _sdpa_float64_backward_raw)
    monkeypatch.setattr(TRACED, "rope_tables", lambda s, d, theta, device, dtype: rope_tables(s, d, theta, device, torch.float64))
    TRACED._make_rope_table.cache_clear()
    layer = _randomize(MultiHeadAttention(24, 4, num_kv_heads=kv, bias=bias, rope=rope, causal=causal)).double()
    params = layer._params()
    x, gy = torch.randn(3, 7, 24, dtype=torch.float64), torch.randn(3, 7, 24, dtype=torch.float64)
    try:
        y, saved = ATTENTION._traced_forward(x, *params, layer.spec, FA.SDPA_CUDNN)
        assert isinstance(saved, ATTENTION.SdpaAttentionSaved)
        dx, grads = ATTENTION.attention_backward(gy, saved, input_grad)
    finally:
        TRACED._make_rope_table.cache_clear()  # no float64 table left for a later test
    spec = dataclasses.replace(layer.spec, backend="reference")
    y_ref, saved_ref = ATTENTION.attention_forward(x, *params, spec)
    dx_ref, grads_ref = ATTENTION.attention_backward(gy, saved_ref, True)
    assert_close(y, y_ref, name="output", rtol=1e-10, atol=1e-10)
    assert (dx is None) == (not input_grad)
    if input_grad:
        assert_close(dx, dx_ref, name="input grad", rtol=1e-10, atol=1e-10)
    assert len(grads) == len(grads_ref) == (8 if bias else 4)
    for i, (g, r) in enumerate(zip(grads, grads_ref)):
        assert_close(g, r, name=f"grad of parameter {i}", rtol=1e-10, atol=1e-10)


def test_compiled_flash_attention_inductor_writes_the_projection_in_place():
    """Inductor (the default backend) on the flash path: output and gradients equal eager's, and RoPE
    writes the q|k|v projection's own buffer: the buffer the fused product is written into (``out=``)
    is the one handed to ``torchloom::flash_attention_core`` and saved for the backward, with no copy
    of it between (the operator declares the write; Inductor's re-inplacing proves it safe). On the
    CPU through Triton's interpreter (tests/layers/test_compile_cuda.py checks Inductor on CUDA)."""
    import torch._inductor.config
    from torch._inductor.utils import run_and_get_code

    if torch.cuda.is_available():
        pytest.skip("the CPU's generated code is read here; on CUDA see tests/layers/test_compile_cuda.py")
    device = _flash_device()
    eager = _flash_layer(16, 4, 2, True, True, True, device)
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(_loss_fn(compiled_layer, False), backend="inductor", fullgraph=True)
    x, g = torch.randn(2, 7, 16, device=device), torch.randn(2, 7, 16, device=device)
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):  # scalar C++: no probe of the instruction sets
        got, codes = run_and_get_code(lambda: _run(compiled, compiled_layer, x, g))
    _compare("inductor compiled vs eager", got, _run(_loss_fn(eager, False), eager, x, g), rtol=1e-5, atol=1e-6)
    forward = next(c for c in codes if "flash_attention_core.default(" in c)
    line = next(ln for ln in forward.splitlines() if "flash_attention_core.default(" in ln)
    call = re.search(r"= torch\.ops\.torchloom\.flash_attention_core\.default\((buf\d+),", line)
    assert call, f"flash_attention_core is not handed a buffer as it is (a copy or a reinterpretation between?): {line.strip()}"
    qkv = call.group(1)
    written = re.findall(rf"extern_kernels\.(?:addmm|mm)\([^\n]*out={qkv}\)", forward)
    assert written, f"{qkv} (handed to flash_attention_core) is not the q|k|v product's output buffer"
    assert not re.search(rf"(clone|copy_)\w*(\.run)?\([^\n]*\b{qkv}\b", forward), f"{qkv} is copied"
    assert re.search(rf"return \(.*\b{qkv}\b", forward), f"{qkv} (after RoPE) is not saved for the backward"
    assert any("flash_attention_core_backward.default(" in c for c in codes)


def test_compiled_shape_check_raises():
    """Shape validation is Python on the (traced) shapes: a wrong input shape still fails with the
    layer's message — a ``ValueError`` where Dynamo may fall back to eager, Dynamo's own error quoting
    it under ``fullgraph=True``."""
    layer = Dense(7, 5)
    bad = torch.randn(3, 6)
    for fullgraph in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=fullgraph)
        compiled(torch.randn(3, 7))
        with pytest.raises(ValueError if not fullgraph else Exception, match=r"input must have shape \[batch, \.\.\., 7\]"):
            compiled(bad)


def test_traced_as_reference_only_while_compiling(monkeypatch):
    """``traced_as_reference``: True only while Dynamo traces, for an op and input dtype that
    ``COMPILED_AS_REFERENCE`` names and the default backend (an explicit ``backend="triton"`` keeps the
    kernel); the table is read at call time, so emptying it sends every op back to its kernel."""
    from torchloom.kernels import _triton

    def probe(x, op, backend=None):
        return x + (1.0 if _triton.traced_as_reference(op, x.dtype, backend) else 0.0)

    x16, x32 = torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2)
    assert probe(x16, "rmsnorm").sum().item() == 0.0  # eager
    torch._dynamo.reset()
    compiled = torch.compile(probe, backend="aot_eager", fullgraph=True)
    assert compiled(x16, "rmsnorm").sum().item() == 2.0
    assert compiled(x32, "rmsnorm").sum().item() == 0.0  # float32 norms keep their kernel
    assert compiled(x32, "swiglu").sum().item() == 2.0
    assert compiled(x16, "rmsnorm", "triton").sum().item() == 0.0
    assert compiled(x16, "flash_attention").sum().item() == 0.0  # not in the table
    monkeypatch.setattr(_triton, "COMPILED_AS_REFERENCE", {})
    torch._dynamo.reset()
    assert torch.compile(probe, backend="aot_eager", fullgraph=True)(x16, "rmsnorm").sum().item() == 0.0
    torch._dynamo.reset()


def test_cast_returns_the_tensor_itself_when_its_dtype_fits():
    """The references cast through ``_triton.cast``: no ``.to`` call (a no-op ``.to`` inside an
    ``autograd.Function`` made torch 2.11's compiled gradients wrong), a real cast otherwise."""
    from torchloom.kernels._triton import cast

    t = torch.randn(3)
    assert cast(t, torch.float32) is t
    h = cast(t, torch.bfloat16)
    assert h.dtype == torch.bfloat16 and torch.equal(h, t.to(torch.bfloat16))


def test_compiled_rnn_reads_no_precision_switch_while_tracing(monkeypatch):
    """While Dynamo traces an RNN, the projections' precision (``kernels.recurrent.gemm_precision``,
    whose reads of PyTorch's switches Dynamo cannot trace: a graph break on a float32 CUDA RNN whose
    loop kernel does not apply) is not asked: the opaque operators ask at run time. Asking fails here."""
    from torchloom.kernels import recurrent as K

    def asked(a, b, backend):
        if torch.compiler.is_compiling():
            raise AssertionError("gemm_precision was asked while tracing")
        return None

    monkeypatch.setattr(K, "gemm_precision", asked)
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer, x = RNN(5, 7), torch.randn(3, 4, 5)
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    assert_close(got, layer(x), name="compiled RNN", rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize("make", [
    lambda: (Dense(16, 32), torch.randn(2, 4, 16)),
    lambda: (SwiGLU(16, 24), torch.randn(2, 4, 16)),
    lambda: (MultiHeadAttention(16, 4), torch.randn(2, 5, 16)),
], ids=["dense_3d", "swiglu", "attention"])
def test_compiled_output_is_no_view_of_an_intermediate(make):
    """Layers that reshape a 2-D product into their output return, compiled, a tensor that is not a view
    (``layers.base.output_view``): AOTAutograd would otherwise rebuild the view in Python on every call
    (seen under ``aot_eager``, which hands that rebuilt view back as it is). Values and input gradients
    equal eager."""
    layer, x = make()
    x.requires_grad_()
    torch._dynamo.reset()
    y = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
    assert y._base is None
    (g,) = torch.autograd.grad(y.square().sum(), x)
    y_e = layer(x)
    (g_e,) = torch.autograd.grad(y_e.square().sum(), x)
    assert_close(y, y_e, rtol=1e-5, atol=1e-5, name="output")
    assert_close(g, g_e, rtol=1e-5, atol=1e-5, name="input grad")
