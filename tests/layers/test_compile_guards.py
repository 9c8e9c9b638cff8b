"""What a compiled layer's every call checks: Dynamo's guards.

Every call of a ``torch.compile``d function first evaluates the guards of its cached graph, and each
guard is host time on every step. A compiled torchloom layer used to guard about twice what PyTorch's
module guards (issue 36): its saved-tensor ``NamedTuple`` (the class, its ``__new__``, the closure of
``collections.namedtuple``), the kernel dispatch's tables (``BACKENDS``, ``KERNEL_DTYPES``, on CUDA
the environment and the Triton import) and its modules' integer attributes. These tests compile the
layers on the CPU and read the guards Dynamo installed: none of those sources may appear (the
environment's and the import's reads are made on the CPU through ``backend="triton"`` with Triton's
interpreter).

``constant_under_compile`` stands in for ``torch.compiler.assume_constant_result``, whose import costs
``import torchloom`` a second; the first test checks that it does exactly what that decorator does.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import autocast, bfloat16
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from torchloom.kernels import _triton
from torchloom.layers.conv import Conv2D
from torchloom.layers.conv_transpose import ConvTranspose2D
from torchloom.layers.dense import Dense
from torchloom.layers.attention import MultiHeadAttention
from torchloom.layers.embedding import Embedding
from torchloom.layers.lstm import LSTM
from torchloom.layers.norm import LayerNorm, RMSNorm
from torchloom.layers.rnn import RNN
from torchloom.layers.softmax import Softmax
from torchloom.layers.swiglu import SwiGLU


def _compiled_guards(fn, *args, code=None, backend: str = "aot_eager", backward: bool = True):
    """``(output, guard trees)``: ``fn`` compiled whole with static shapes and called on ``args`` (then,
    with ``backward``, a backward of its first output's squares), and the printed guard trees Dynamo
    keeps for ``code`` (``fn``'s own by default; a module's ``forward`` when ``fn`` is the module).
    Dynamo's caches are reset before and after."""
    torch._dynamo.reset()
    try:
        out = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)(*args)
        if backward:
            (out[0] if isinstance(out, tuple) else out).float().square().sum().backward()
        return out, [str(e.guard_manager) for e in _debug_get_cache_entry_list(code or fn.__code__)]
    finally:
        torch._dynamo.reset()


def _layer_and_input(make, shape):
    """A ``LAYERS`` entry's layer and an input for it (integer indices where ``shape`` is None), seeded."""
    torch.manual_seed(0)
    layer = make()
    return layer, torch.randint(0, 10, (4, 3)) if shape is None else torch.randn(*shape, requires_grad=True)


def test_constant_under_compile_marks_as_assume_constant_result_does():
    def ours():
        return 1

    def theirs():
        return 1

    before = set(vars(theirs))
    torch.compiler.assume_constant_result(theirs)
    added = {k: v for k, v in vars(theirs).items() if k not in before}
    assert _triton.constant_under_compile(ours) is ours
    assert added and vars(ours) == added


@pytest.mark.parametrize("backend", [None, "triton"])
def test_a_folded_choice_is_not_traced(backend, monkeypatch):
    """Folded, the choice's reads leave no guard, and it is still made. With ``backend="triton"`` and
    the interpreter on, the choice reads the environment and the Triton import (traced, both are
    guarded: ``environ``, ``interpreter_enabled``, ``triton_available`` appear in the tree)."""
    if backend == "triton":
        if not _triton.triton_available():
            pytest.skip("backend='triton' needs the triton package")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(4, 8)

    def fn(x):
        return x * (2.0 if _triton.use_kernel(x, backend) else 3.0)

    out, (tree,) = _compiled_guards(fn, x, backend="eager", backward=False)
    assert torch.equal(out, x * (2.0 if backend == "triton" else 3.0))
    for source in ("KERNEL_DTYPES", "BACKENDS", "interpreter_enabled", "environ", "triton_available", "_preload"):
        assert source not in tree, source


def test_a_bad_backend_under_compile_raises_what_eager_raises(monkeypatch):
    """The folded choice returns its error; the caller raises it, so compiled code (where the
    graph breaks at the raise) fails with the same ValueError / RuntimeError as eager code."""
    from torchloom.kernels import rmsnorm

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w = torch.randn(4, 8), torch.ones(8)
    for backend, error in (("bogus", ValueError), ("triton", RuntimeError)):
        torch._dynamo.reset()
        try:
            with pytest.raises(error, match="backend"):
                torch.compile(lambda x: rmsnorm.rmsnorm(x, w, 1e-6, backend)[0], backend="eager")(x)
        finally:
            torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("backend", [None, "reference"])
def test_use_kernel_is_use_triton_with_the_kernel_dtypes(dtype, backend):
    t = torch.zeros(2, dtype=dtype)
    assert _triton.use_kernel(t, backend) == _triton.use_triton(t, backend, _triton.KERNEL_DTYPES)


LAYERS = {
    "Dense": (lambda: Dense(8, 6), (5, 8)),
    "Conv2D": (lambda: Conv2D(3, 4, 3, padding=1), (2, 3, 6, 6)),
    "ConvTranspose2D": (lambda: ConvTranspose2D(3, 4, 3, stride=2), (2, 3, 5, 5)),
    "RMSNorm": (lambda: RMSNorm(8), (5, 8)),
    "LayerNorm": (lambda: LayerNorm(8), (5, 8)),
    "SwiGLU": (lambda: SwiGLU(8, 12), (5, 8)),
    "Softmax": (lambda: Softmax(), (5, 8)),
    "Embedding": (lambda: Embedding(10, 6, activation="tanh"), None),
}
RECURRENT_AND_ATTENTION = {
    "RNN": (lambda: RNN(8, 6), (2, 5, 8)),
    "LSTM": (lambda: LSTM(8, 6), (2, 5, 8)),
    "MultiHeadAttention": (lambda: MultiHeadAttention(8, 2), (2, 5, 8)),
}
# Sources that a compiled step must not guard: the saved records (built only outside the autograd
# Functions), the dispatch's tables and decisions, and the layers' size attributes (the weights'
# shapes, guarded with every tensor, say the same).
FORBIDDEN = ("Saved", "_tuple_new", "KERNEL_DTYPES", "BACKENDS", "check_backend", "COMPILED_AS_REFERENCE",
             "in_features", "out_features", "in_channels", "normalized_shape", "hidden")
SIZE_CHECKED = ("Dense", "Conv2D", "RMSNorm", "LayerNorm", "SwiGLU")  # the layers whose checks read only tensors


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_a_compiled_layer_guards_no_record_table_or_size_attribute(name):
    layer, x = _layer_and_input(*LAYERS[name])
    _, trees = _compiled_guards(layer, x, code=type(layer).forward.__code__)
    assert len(trees) == 1
    tree = trees[0]
    assert "TENSOR_MATCH" in tree  # the tree is the layer's (it guards the input and the weights)
    forbidden = FORBIDDEN if name in SIZE_CHECKED else FORBIDDEN[:6]
    found = [s for s in forbidden if s in tree]
    assert not found, found


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("name", ["Dense", "Conv2D"])
def test_autocast_entered_inside_the_compiled_function_is_seen(name, enabled):
    """``autocast_dtype`` and ``autocast_off`` are folded to constants while Dynamo traces (the
    autocast state is guarded with the global state); an autocast region opened inside the compiled
    function is the state they must see. Output dtype, output and input gradient equal eager's."""
    layer, x = _layer_and_input(*LAYERS[name])

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            return layer(x)

    torch._dynamo.reset()
    try:
        want = step(x)
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
        (g_want,) = torch.autograd.grad(want.float().sum(), x)
        (g_got,) = torch.autograd.grad(got.float().sum(), x)
    finally:
        torch._dynamo.reset()
    assert got.dtype == want.dtype == (torch.bfloat16 if enabled else torch.float32)
    assert torch.equal(got, want) and torch.equal(g_got, g_want)


def _aliasing_guards(tree: str) -> list[str]:
    """The guard tree's object-aliasing checks (``a is b``): Dynamo adds one, evaluated by a Python
    lambda on every call, for each object it reached from two sources, such as the ``torch`` module
    read from two modules' globals."""
    return [line.split("LAMBDA_GUARD:")[1].split("#")[0].strip()
            for line in tree.splitlines() if "LAMBDA_GUARD" in line and " is " in line]


@pytest.mark.parametrize("autocast_on", [False, True], ids=["float32", "autocast"])
@pytest.mark.parametrize("name", sorted(LAYERS) + sorted(RECURRENT_AND_ATTENTION))
def test_a_compiled_layer_reads_no_object_through_two_sources(name, autocast_on):
    """The traced code reaches torch's functions by imported names or as tensor methods (``from torch
    import is_tensor``, ``x.mm(w)``), never as ``torch.X`` or through the ``Tensor`` class: any
    module's ``torch`` is the module that ``autograd.Function``'s own tracing reads first (and that the
    caller's code reads too), so each further module reading it added an aliasing check to every
    compiled call. The function compiled here opens autocast through an imported name, as such a
    caller would."""
    layer, x = _layer_and_input(*{**LAYERS, **RECURRENT_AND_ATTENTION}[name])

    def step(x):
        with autocast("cpu", dtype=bfloat16, enabled=autocast_on):
            return layer(x)

    _, (tree,) = _compiled_guards(step, x)
    assert "TENSOR_MATCH" in tree
    assert _aliasing_guards(tree) == []


class _EveryLayer(torch.nn.Module):
    """One module calling every layer, as a user's model does: the modules' traced code meets in one
    graph, so an object that two of them read (a namespace such as ``torch.ops.aten``) shows here."""

    def __init__(self):
        super().__init__()
        self.dense = Dense(8, 8, activation="relu")
        self.norms = torch.nn.ModuleList([RMSNorm(8), LayerNorm(8)])
        self.swiglu, self.softmax = SwiGLU(8, 12), Softmax()
        self.conv = Conv2D(3, 4, 3, padding=1, activation="relu")
        self.deconv = ConvTranspose2D(4, 3, 3, padding=1, activation="relu")
        self.embedding = Embedding(10, 8, activation="tanh")
        self.rnn, self.lstm, self.attention = RNN(8, 8), LSTM(8, 8), MultiHeadAttention(8, 2)

    def forward(self, x, image, indices):
        h = self.dense(x) + self.embedding(indices)
        for norm in self.norms:
            h = norm(h)
        h = self.softmax(self.swiglu(h)) + self.attention(self.lstm(self.rnn(h)))
        return h.float().square().mean() + self.deconv(self.conv(image)).float().square().mean()


@pytest.mark.parametrize("autocast_on", [False, True], ids=["float32", "autocast"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_compiled_model_of_every_layer_reads_no_object_through_two_sources(device, autocast_on):
    torch.manual_seed(0)
    model = _EveryLayer().to(device)
    x = torch.randn(2, 5, 8, device=device, requires_grad=True)
    image = torch.randn(2, 3, 6, 6, device=device, requires_grad=True)
    indices = torch.randint(0, 10, (2, 5), device=device)

    def step(x, image, indices):
        with autocast(device, dtype=bfloat16, enabled=autocast_on):
            return model(x, image, indices)

    _, (tree,) = _compiled_guards(step, x, image, indices)
    assert "TENSOR_MATCH" in tree
    assert _aliasing_guards(tree) == []
