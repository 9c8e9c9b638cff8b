"""``TrainingConfig(compile=...)``: backprop's steps through ``torch.compile`` of the model.

References: a plain PyTorch loop (``F.cross_entropy`` / MSE, ``loss.backward()``, ``torch.optim.SGD``)
over a copy of the model, and the eager ``train()`` run with the same settings. The compiled runs use
the ``aot_eager`` backend (AOTAutograd traces forward and backward; the trace is what is under test,
and it is fast) through a ``CompileCounterWithBackend`` given as ``compile={"backend": ...}``; one
run compiles with Inductor, the default. Tiny models: compiling on a CPU is slow.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch.nn.functional as F
from torch import nn

from helpers import assert_close
from torchloom import DivergenceWarning, Dense, Network, RMSNorm, TargetPropConfig, TrainingConfig, TweenConfig, train
from torchloom.engine.train import as_network, make_trainer
from torchloom.layers.attention import MultiHeadAttention
from torchloom.layers.embedding import Embedding
from torchloom.methods.backprop import Backprop


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _Mixed(nn.Module):
    """torchloom layers and plain PyTorch modules in one model: tokens [B, S] -> logits [B, 3]."""

    def __init__(self):
        super().__init__()
        self.embed = Embedding(11, 8)
        self.norm = nn.LayerNorm(8)
        self.attn = MultiHeadAttention(8, 2, causal=True)
        self.head = nn.Sequential(RMSNorm(8), nn.Linear(8, 6), nn.GELU(), Dense(6, 3, "tanh"))

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.attn(self.norm(h))
        return self.head(h.mean(1))


def _data(rows=12, seq=5):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 11, (rows, seq), generator=g), torch.randint(0, 3, (rows,), generator=g)


def _graph_targets(counter):
    return [str(n.target) for gm in counter.graphs for n in gm.graph.nodes if n.op == "call_function"]


def _plain_pytorch(model, x, y, epochs, batch, lr):
    """The reference: PyTorch's own loop, autograd and ``torch.optim.SGD``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for i in range(0, len(x), batch):
            opt.zero_grad()
            F.cross_entropy(model(x[i:i + batch]), y[i:i + batch]).backward()
            opt.step()


def test_compiled_backprop_equals_eager_and_pytorch():
    """A model mixing torchloom layers and plain modules: ``explain`` of the model train() compiles
    shows one graph and no break; two epochs of compiled steps (one compile, no recompile) end at the
    weights of eager ``train()`` and of PyTorch's own loop, with the layers' ``autograd.Function``s in
    the graph (their hand-written backward kept)."""
    x, y = _data()
    torch.manual_seed(0)
    model = _Mixed()
    eager, plain = copy.deepcopy(model), copy.deepcopy(model)
    explanation = torch._dynamo.explain(as_network(model))(x[:4])
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    cfg = dict(epochs=2, batch_size=4, loss_type="cross_entropy", learning_rate=0.2, verbose=0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        r = train(model, (x, y), TrainingConfig(compile={"backend": counter, "fullgraph": True}, **cfg))
    r_eager = train(eager, (x, y), TrainingConfig(**cfg))
    _plain_pytorch(plain, x, y, epochs=2, batch=4, lr=0.2)
    assert counter.frame_count == 1
    assert any("autograd_function_apply" in t for t in _graph_targets(counter))
    assert r.loss_history == pytest.approx(r_eager.loss_history, rel=1e-6)
    for (name, p), q, s in zip(model.named_parameters(), eager.parameters(), plain.parameters()):
        assert_close(p, q, name=f"{name} vs eager train()", rtol=1e-5, atol=1e-6)
        assert_close(p, s, name=f"{name} vs PyTorch's loop", rtol=1e-5, atol=1e-6)
    assert r.loss_history[1] < r.loss_history[0]


def test_compiled_backprop_with_inductor():
    """``compile=True`` (Inductor, generated C++ here) on a small Network with a plain module in its
    chain, Adam and a per-batch schedule: the eager run's weights. (Scalar C++, ``cpp.vec_isa_ok=False``,
    restored after: on a cold cache the vectorised build first probes the compiler, ~10 s.)"""
    import torch._inductor.config

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(12, 6, generator=g), torch.randn(12, 3, generator=g)
    torch.manual_seed(0)
    net = Network(Dense(6, 8, "silu"), nn.LayerNorm(8), RMSNorm(8), Dense(8, 3))
    eager = copy.deepcopy(net)
    cfg = dict(epochs=2, batch_size=4, optimizer="adam", learning_rate=0.01, verbose=0)
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
        r = train(net, (x, y), TrainingConfig(compile=True, **cfg))
    r_eager = train(eager, (x, y), TrainingConfig(**cfg))
    assert r.loss_history == pytest.approx(r_eager.loss_history, rel=1e-5)
    for (name, p), q in zip(net.named_parameters(), eager.parameters()):
        assert_close(p, q, name=name, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_compiled_mixed_precision_and_frozen_parameter(precision):
    """``precision="bf16-mixed"`` / ``"16-mixed"`` (the epoch's autocast around the compiled model;
    float16's loss scaling on the gradient entering the compiled backward) and a frozen parameter: the
    eager run's losses and weights (to half-precision rounding), the frozen one unchanged."""
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)
    torch.manual_seed(0)
    net = Network(Dense(5, 7, "gelu"), RMSNorm(7), Dense(7, 2))
    net[1].weight.requires_grad_(False)
    frozen = net[1].weight.detach().clone()
    eager = copy.deepcopy(net)
    # float16's first step overflows at the initial loss scale and is skipped, so epoch 1's Loom mean comes
    # out low and epoch 2 would be reported as diverged: the watch is off for it (bfloat16 must stay healthy)
    cfg = dict(epochs=2, batch_size=4, precision=precision, learning_rate=0.01, verbose=0,
               divergence_factor=10.0 if precision == "bf16-mixed" else 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DivergenceWarning)  # a healthy run (torch's own compile warnings aside)
        r = train(net, (x, y), TrainingConfig(compile={"backend": "aot_eager"}, **cfg))
    r_eager = train(eager, (x, y), TrainingConfig(**cfg))
    assert r.loss_history == pytest.approx(r_eager.loss_history, rel=1e-2)
    for (name, p), q in zip(net.named_parameters(), eager.parameters()):
        assert_close(p, q, name=name, rtol=1e-2, atol=1e-3)
    assert torch.equal(net[1].weight, frozen)
    assert all(p.dtype == torch.float32 for p in net.parameters())


# ---------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("method,label", [("target_prop", "TargetPropConfig"), (TweenConfig(), "TweenConfig"),
                                          (TargetPropConfig(), "TargetPropConfig"),
                                          ("feedback_alignment", "FeedbackAlignmentConfig"), ("dfa", "DFAConfig")])
def test_methods_that_call_the_hand_written_backward_refuse_compile(method, label):
    """TargetProp and Tweening run the layers' hand-written backward directly, the feedback rules a
    backward of their own: refused by name when the config is built."""
    with pytest.raises(ValueError) as e:
        TrainingConfig(method=method, compile=True)
    assert str(e.value) == (
        f"TrainingConfig: compile is for backprop; method {label} runs the layers' hand-written backward (or its "
        "own) directly, outside autograd, which torch.compile does not trace (leave compile=False)"
    )


def test_compile_setting_is_checked():
    with pytest.raises(ValueError) as e:
        TrainingConfig(compile={"fulgraph": True})
    assert str(e.value) == (
        "TrainingConfig: compile has unknown torch.compile option 'fulgraph' (did you mean 'fullgraph'?); valid: "
        "'fullgraph', 'dynamic', 'backend', 'mode', 'options'"
    )
    with pytest.raises(TypeError) as e:
        TrainingConfig(compile="inductor")
    assert str(e.value) == (
        "TrainingConfig: compile must be a bool or a mapping of torch.compile options (e.g. {'mode': "
        "'reduce-overhead'}), got 'inductor'"
    )
    with pytest.raises(ValueError) as e:
        TrainingConfig(compile={"mode": "max-autotune", "options": {}})
    assert str(e.value) == "TrainingConfig: compile cannot hold both 'mode' and 'options' (torch.compile takes one of them)"
    for spec, message in [
        ({"fullgraph": "yes"}, "compile['fullgraph'] must be a bool, got 'yes'"),
        ({"dynamic": 1}, "compile['dynamic'] must be a bool or None, got 1"),
        ({"backend": 3}, "compile['backend'] must be a backend name (a str) or a callable, got 3"),
        ({"mode": 2}, "compile['mode'] must be None or a mode's name (a str, e.g. 'reduce-overhead'), got 2"),
        ({"options": "x"}, "compile['options'] must be None or a mapping of option names (str) to values, got 'x'"),
        ({"options": {1: True}}, "compile['options'] must be None or a mapping of option names (str) to values, got {1: True}"),
    ]:
        with pytest.raises(TypeError) as e:
            TrainingConfig(compile=spec)
        assert str(e.value) == f"TrainingConfig: {message}", spec
    for spec in ({"fullgraph": False, "dynamic": None, "backend": lambda gm, inputs: gm, "mode": None},
                 {"mode": "max-autotune-no-cudagraphs"}, {"options": {"trace.enabled": False}},
                 {"mode": None, "options": {"trace.enabled": False}}, {"mode": "lite", "options": None}):
        TrainingConfig(compile=spec)  # accepted: which modes exist is the backend's to say
    with pytest.raises(ValueError) as e:
        TrainingConfig(compile=True, cuda_graph=True)
    assert str(e.value) == (
        "TrainingConfig: compile and cuda_graph=True cannot be combined: compiled steps run the host loop, not the "
        "CUDA device path; for CUDA graphs of the compiled step use compile={'mode': 'reduce-overhead'}"
    )
    assert TrainingConfig(compile={"dynamic": True}).compile == {"dynamic": True}


def test_compiled_backprop_takes_the_host_loop_and_refuses_what_it_cannot_do():
    """No device step (the CUDA device path is the eager step's); a subclass with its own backward
    and per-layer observer events are refused by name, before anything runs."""
    net = Network(Dense(3, 2))
    trainer = make_trainer(net, TrainingConfig(compile=True, verbose=0))
    assert trainer.method.device_ready() is False
    assert make_trainer(net, TrainingConfig(verbose=0)).method.device_ready() is True

    class SignSymmetry(Backprop):
        name = ""

        def backward(self, grad_out, saved):
            return super().backward(grad_out, saved)

    with pytest.raises(ValueError) as e:
        make_trainer(net, TrainingConfig(compile=True, method=SignSymmetry()))
    assert str(e.value) == (
        "TrainingConfig: compile cannot be used with SignSymmetry: it overrides backward(), and a compiled step "
        "differentiates the model with autograd (the layers' hand-written backward); leave compile=False"
    )

    class Watch:
        def on_layer_backward(self, event):
            pass

    with pytest.raises(ValueError) as e:
        make_trainer(net, TrainingConfig(compile=True, observers=[Watch()]))
    assert str(e.value) == (
        "TrainingConfig: compile cannot send per-layer observer events (on_layer_backward): they come from the "
        "eager step's layer-by-layer forward; leave compile=False or drop those observers"
    )


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Dense(4, 6, "tanh"), nn.Linear(3, 6)
        self.out = Dense(6, 2)

    def forward(self, u, v):
        return self.out(self.a(u) + self.b(v))


def test_compiled_backprop_with_loss_fn_accumulation_and_two_inputs():
    """A model of two inputs, a custom ``loss_fn`` and ``accumulate_grad_batches=2`` (with a ragged
    last group): the eager run's losses and weights."""
    g = torch.Generator().manual_seed(9)
    u, v, y = torch.randn(12, 4, generator=g), torch.randn(12, 3, generator=g), torch.randn(12, 2, generator=g)
    torch.manual_seed(0)
    model = _TwoInputs()
    eager = copy.deepcopy(model)
    cfg = dict(epochs=2, batch_size=4, accumulate_grad_batches=2, learning_rate=0.1, verbose=0,
               loss_fn=lambda out, target: F.smooth_l1_loss(out, target))
    r = train(model, ((u, v), y), TrainingConfig(compile={"backend": "aot_eager"}, **cfg))
    r_eager = train(eager, ((u, v), y), TrainingConfig(**cfg))
    assert r.loss_history == pytest.approx(r_eager.loss_history, rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close(p, q, name=name, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", [True, {"mode": "reduce-overhead"}], ids=["inductor", "reduce-overhead"])
def test_compiled_backprop_on_cuda(spec):
    """On CUDA: ``compile=True`` (Inductor, the Triton operators inside) and Inductor's CUDA graphs
    (``mode="reduce-overhead"``) run the host loop and end at the eager host loop's weights."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(48, 24, generator=g), torch.randint(0, 5, (48,), generator=g)
    torch.manual_seed(0)
    net = Network(Dense(24, 32, "silu"), nn.LayerNorm(32), RMSNorm(32), Dense(32, 5))
    eager = copy.deepcopy(net)
    cfg = dict(epochs=2, batch_size=8, loss_type="cross_entropy", optimizer="adamw", learning_rate=0.01, verbose=0, use_gpu=True)
    r = train(net, (x, y), TrainingConfig(compile=spec, **cfg))
    r_eager = train(eager, (x, y), TrainingConfig(cuda_graph=False, **cfg))
    assert r.loss_history == pytest.approx(r_eager.loss_history, rel=1e-4)
    for (name, p), q in zip(net.named_parameters(), eager.parameters()):
        assert p.is_cuda
        assert_close(p, q, name=name, rtol=1e-4, atol=1e-5)
