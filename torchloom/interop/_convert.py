"""Layer-by-layer mapping between Loom's saved-network JSON and torchloom modules.

Import: ``build_network(spec, dtype, gelu)`` turns a validated ``NetSpec`` into a ``Network``.
Export: ``export_layers(net, shapes)`` turns torchloom modules into Loom layer dicts; ``shapes`` maps
``id(module)`` to the input shape recorded from an example input (Loom stores spatial sizes and
sequence lengths that torchloom layers do not hold).
"""

from __future__ import annotations

import base64

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from ..layers.base import Layer
from ..layers.containers import Parallel, Residual
from ..layers.conv import Conv1D, Conv2D, Conv3D, Flatten, _ConvND
from ..layers.conv_transpose import ConvTranspose1D, ConvTranspose2D, ConvTranspose3D, _ConvTransposeND
from ..layers.dense import Dense
from ..layers.embedding import Embedding
from ..layers.lstm import LSTM
from ..layers.network import Network, Sequential
from ..layers.norm import LayerNorm, RMSNorm
from ..layers.rnn import RNN
from ..layers.softmax import Softmax, softmax_backward, softmax_forward
from ..layers.swiglu import SwiGLU
from ..layers.attention import MultiHeadAttention
from ._codec import LayerSpec, NetSpec, decode_weights, encode_float32

__all__ = ["build_network", "export_layers", "LoomReshape", "LoomGridSoftmax", "ACT_FROM_LOOM", "GELU_CHOICES"]

# Loom activation spelling (upper-cased) → torchloom name. "GELU" is resolved by the gelu option.
ACT_FROM_LOOM = {
    "RELU": "relu", "SILU": "silu", "GELU": None, "TANH": "tanh", "SIGMOID": "sigmoid",
    "LEAKYRELU": "leaky_relu", "LEAKY_RELU": "leaky_relu", "LINEAR": "linear", "": "linear",
}
GELU_CHOICES = ("gelu_tanh", "gelu_loom")
_ACT_TO_LOOM = {
    "relu": "ReLU", "silu": "Silu", "gelu_tanh": "GELU", "gelu_loom": "GELU", "tanh": "Tanh",
    "sigmoid": "Sigmoid", "leaky_relu": "LeakyReLU", "linear": "Linear",
}
_CONV = {"CNN1": (Conv1D, 1), "CNN2": (Conv2D, 2), "CNN3": (Conv3D, 3)}
_CONVT = {"ConvTransposed1D": (ConvTranspose1D, 1), "ConvTransposed2D": (ConvTranspose2D, 2), "ConvTransposed3D": (ConvTranspose3D, 3)}
_COMBINE = {"concat": "concat", "": "concat", "grid_scatter": "concat", "add": "add", "avg": "avg"}


def _err(where: str, msg: str) -> ValueError:
    return ValueError(f"Loom JSON: {where}: {msg}")


class LoomReshape(Layer):
    """Reshapes each sample to ``shape``: ``[B, ...] → [B, *shape]`` (C order), as Loom reads its flat
    activation buffers; backward reshapes the gradient back. Inserted on import where a layer that
    needs a structured input (convolution, RNN, LSTM) follows one with a flat output. No parameters."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = tuple(shape)

    def _check(self, x: Tensor) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"LoomReshape: input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x[:1].numel() != math.prod(self.shape):
            raise ValueError(f"LoomReshape{self.shape}: each sample must hold {math.prod(self.shape)} values, got input {list(x.shape)}")

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return super().forward(x)

    def forward_saved(self, x: Tensor):
        self._check(x)
        return x.reshape(x.shape[0], *self.shape), tuple(x.shape)

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        return (grad_out.reshape(saved) if needs_input_grad else None), ()

    def extra_repr(self) -> str:
        return f"shape={self.shape}"


class LoomGridSoftmax(Layer):
    """Loom's ``Grid`` softmax: each sample's values, in C order, normalised in consecutive groups of
    ``cols`` (``[B, …] → [B, n/cols, cols]``, softmax of ``x / temperature`` over each group, back to
    the input's shape). Built on import where ``softmax_cols`` is not the input's last dimension (when
    it is, the import builds ``Softmax(dim=-1)``, the same computation). Each sample must hold a
    multiple of ``cols`` values: a group spanning two samples is a ``ValueError``. No parameters."""

    kernel_modules = ("torchloom.kernels.softmax",)

    def __init__(self, cols: int, temperature: float = 1.0) -> None:
        super().__init__()
        if isinstance(cols, bool) or not isinstance(cols, int) or cols < 1:
            raise ValueError(f"LoomGridSoftmax: cols must be an int >= 1, got {cols!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
            raise ValueError(f"LoomGridSoftmax: temperature must be a finite number > 0, got {temperature!r}")
        self.cols, self.temperature = cols, float(temperature)

    def _check(self, x: Tensor) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"LoomGridSoftmax: input must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"LoomGridSoftmax: input must be a floating-point tensor, got dtype {x.dtype}")
        if x.dim() < 2 or x[:1].numel() % self.cols:
            raise ValueError(f"LoomGridSoftmax(cols={self.cols}): each sample must hold a multiple of {self.cols} "
                             f"values (Loom's groups would span two samples), got input {list(x.shape)}")

    def forward_saved(self, x: Tensor):
        self._check(x)
        p, saved = softmax_forward(x.reshape(x.shape[0], -1, self.cols), -1, self.temperature)
        return p.reshape(x.shape), (saved, tuple(x.shape))

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        inner, shape = saved
        g, _ = softmax_backward(grad_out.reshape(shape[0], -1, self.cols), inner, needs_input_grad)
        return (g.reshape(shape) if g is not None else None), ()

    def pre_activation(self, saved):
        return None

    def extra_repr(self) -> str:
        return f"cols={self.cols}, temperature={self.temperature}"


# =============================================================================== import
@dataclass(frozen=True)
class _Shape:
    """What a Loom file says about the values passed between two layers, per sample: ``dims`` (an int
    per dimension, ``None`` where the size is known only at run time), after leading dimensions of
    unknown number when ``lead`` (an Embedding's token positions); ``src`` names the layer that made
    them, for messages. Loom passes flat buffers and every layer reads its own sizes from the file, so
    these shapes are what makes a file that does not chain an error at load time."""

    dims: tuple[int | None, ...]
    src: str
    lead: bool = False

    @property
    def numel(self) -> int | None:
        return None if self.lead or None in self.dims else math.prod(self.dims)

    @property
    def last(self) -> int | None:
        return self.dims[-1] if self.dims else None

    @property
    def flat(self) -> bool:
        return not self.lead and len(self.dims) == 1

    def __str__(self) -> str:
        dims = ["…"] * self.lead + ["?" if d is None else str(d) for d in self.dims]
        return f"[{', '.join(dims)}]"


class _Piece(NamedTuple):
    """One Loom layer built: the reshapes torchloom makes explicit before it (``adapters``), its module
    (``None`` for an empty container, which Loom passes through) and the shapes after the adapters
    and after the module (``None``: unknown, the network's input)."""

    adapters: list[nn.Module]
    module: nn.Module | None
    shape_in: _Shape | None
    shape_out: _Shape | None


class _Builder:
    """Turns validated layer specs into modules, following the shape of the values from layer to
    layer: Loom reads every layer's input from a flat buffer with that layer's own sizes, so the
    builder checks that the sizes chain (a ``ValueError`` naming both layers otherwise) and makes
    Loom's implicit reshapes explicit (``Flatten`` before a Dense or a norm that reads a whole
    sample, ``LoomReshape`` before a convolution / RNN / LSTM, a flattened output per Parallel branch,
    as Loom's Parallel concatenates flat per-sample buffers)."""

    def __init__(self, dtype: torch.dtype, gelu: str, biased: frozenset[str] = frozenset()) -> None:
        self.dtype = dtype
        self.gelu = gelu
        self.biased = biased  # the layers (by ``where``) that get a bias: torchloom's descriptions only

    def activation(self, s: LayerSpec) -> str:
        raw = s.f["activation"] or ""
        key = raw.upper()
        if key == "RELU2":
            raise _err(s.where, "activation 'ReLU2': Loom v0.80 reads this name back as linear, so the file "
                       "does not say which one ran; refusing rather than guessing")
        if key not in ACT_FROM_LOOM:
            raise _err(s.where, f"unknown activation {raw!r} (Loom would silently run it as linear); Loom's "
                       f"spellings: {sorted(k for k in ACT_FROM_LOOM if k)}")
        return self.gelu if key == "GELU" else ACT_FROM_LOOM[key]

    def weights(self, s: LayerSpec) -> np.ndarray | None:
        return decode_weights(s) if s.f["weights"] is not None else None

    def _set(self, param: Tensor, values: np.ndarray, shape=None) -> None:
        t = torch.from_numpy(np.ascontiguousarray(values))
        with torch.no_grad():
            param.copy_(t.reshape(shape if shape is not None else param.shape).to(param.dtype))

    def common_checks(self, s: LayerSpec) -> None:
        f = s.f
        if f["is_remote_link"]:
            raise _err(s.where, "remote links (is_remote_link) are not supported")
        if f["meta_rules"] or f["meta_observed_layer"] is not None:
            raise _err(s.where, "metacognition rules are not supported")
        if f["gumbel_noise"]:
            raise _err(s.where, "Gumbel noise (gumbel_noise) is not supported")

    # ------------------------------------------------------------------ chaining
    @staticmethod
    def _no_chain(s: LayerSpec, takes: str, shape: _Shape) -> ValueError:
        if shape.flat and shape.numel is not None:
            have = f"{shape.numel} values per sample"
        elif shape.numel is not None:
            have = f"{shape.numel} values per sample ({shape})"
        else:
            have = f"values of shape {shape} per sample"
        return _err(s.where, f"{s.kind} takes {takes}, but {shape.src} outputs {have}; the layer sizes do not chain")

    def _flat_input(self, s: LayerSpec, shape: _Shape | None, n: int, field: str) -> list[nn.Module]:
        """Adapters for a layer that reads each sample as ``n`` flat values (Dense): a ``Flatten``
        unless the input already is ``[B, n]``; the sizes must agree where the file fixes them."""
        if shape is None:
            return []
        if shape.numel is not None and shape.numel != n:
            raise self._no_chain(s, f"{field}={n} values per sample", shape)
        return [] if shape.flat else [Flatten()]

    def _structured_input(self, s: LayerSpec, shape: _Shape | None, need: tuple[int, ...], fields: str) -> list[nn.Module]:
        """Adapters for a layer that reads each sample as ``need`` (convolutions, RNN, LSTM): a
        ``LoomReshape(need)`` unless the input has that shape already or is the network's input (the
        caller gives the first layer its structured input)."""
        if shape is None or (not shape.lead and shape.dims == need):
            return []
        if shape.numel is not None and shape.numel != math.prod(need):
            raise self._no_chain(s, f"{math.prod(need)} values per sample {list(need)} ({fields})", shape)
        return [LoomReshape(need)]

    def _last_dim(self, s: LayerSpec, shape: _Shape | None, n: int, field: str) -> None:
        """A layer applied along the last dimension (attention, SwiGLU): it must be ``n``."""
        if shape is not None and shape.last is not None and shape.last != n:
            raise self._no_chain(s, f"inputs whose last dimension is {field}={n}", shape)

    # ------------------------------------------------------------------ containers
    def build_list(self, specs: list[LayerSpec], shape: _Shape | None, *, in_sequential: bool) -> tuple[list[nn.Module], _Shape | None]:
        """Modules for a run of layers, and the shape after them. Inside a Sequential, Loom's Residual
        adds the previous (enabled) sub-layer's input to its output when the two have the same length,
        and passes its input through otherwise; with no previous sub-layer, and at the top level,
        Loom's Residual has no skip input and passes its input through."""
        out: list[nn.Module] = []
        last: _Piece | None = None
        last_was_residual = False
        for s in specs:
            if s.f["is_disabled"]:
                continue  # Loom's forward skips disabled layers
            self.common_checks(s)
            if s.kind == "Residual":
                if in_sequential and last is not None:
                    if last_was_residual:
                        raise _err(s.where, "two Residual layers in a row: Loom adds the first residual's "
                                   "input again, which torchloom's Residual cannot express")
                    if last.module is None:
                        raise _err(s.where, "a Residual after an empty Sequential / Parallel (Loom adds the "
                                   "input to itself there) is not supported")
                    if self._residual_adds(s, last):
                        out[-1] = Residual(out[-1])
                    last_was_residual = True
                continue  # otherwise an identity: no skip input of the right length in Loom
            last_was_residual = False
            piece = self.build_piece(s, shape)
            out.extend(piece.adapters)
            if piece.module is not None:
                out.append(piece.module)
            last, shape = piece, piece.shape_out
        return out, shape

    @staticmethod
    def _residual_adds(s: LayerSpec, prev: _Piece) -> bool:
        """Whether Loom's Residual after ``prev`` adds its skip (the same number of values in and out)
        or passes the input through (different numbers; Loom compares the lengths)."""
        if isinstance(prev.module, Embedding):  # skip: the token ids, T values; output T·E values
            if prev.module.embedding_dim == 1:
                raise _err(s.where, "Residual around an Embedding of embedding_dim 1: Loom adds the token ids to "
                           "the embeddings; not supported")
            return False
        i, o = prev.shape_in, prev.shape_out
        if i is None or o is None or i.numel is None or o.numel is None:
            return True  # torchloom's Residual checks the shapes when it runs
        if i.numel != o.numel:
            return False
        if i.dims != o.dims:
            raise _err(s.where, f"Residual around a layer that maps {i} to {o}: Loom adds the two flat buffers, "
                       "torchloom's Residual needs one shape; not supported")
        return True

    def build_piece(self, s: LayerSpec, shape: _Shape | None) -> _Piece:
        k, f = s.kind, s.f
        src = f"{s.where} ({k})"
        if k == "Sequential":
            mods, out = self.build_list(s.children, shape, in_sequential=True)
            # empty: Loom passes the input through
            return _Piece([], Sequential(*mods) if mods else None, shape, out if mods else shape)
        if k == "Parallel":
            return self._parallel(s, shape)
        if k == "Softmax":
            return self._softmax(s, shape)
        if k == "Dense":
            i, o = f["input_height"], f["output_height"]
            return _Piece(self._flat_input(s, shape, i, "input_height"), self.make(s), _Shape((i,), ""), _Shape((o,), src))
        if k in _CONV or k in _CONVT:
            nd = _CONV[k][1] if k in _CONV else _CONVT[k][1]
            n_in, n_out = _spatial(f, nd, conv=k in _CONV)
            need = (f["input_channels"], *n_in)
            adapters = self._structured_input(s, shape, need, "input_channels × input sizes")
            return _Piece(adapters, self.make(s), _Shape(need, ""), _Shape((f["filters"], *n_out), src))
        if k in ("RNN", "LSTM"):
            need = (max(f["seq_length"], 1), f["input_height"])  # Loom reads seq_length 0 as 1
            adapters = self._structured_input(s, shape, need, "seq_length × input_height")
            return _Piece(adapters, self.make(s), _Shape(need, ""), _Shape((need[0], f["output_height"]), src))
        if k in ("MultiHeadAttention", "SwiGLU"):
            n = f["d_model"] if k == "MultiHeadAttention" else f["input_height"]
            self._last_dim(s, shape, n, "d_model" if k == "MultiHeadAttention" else "input_height")
            out = _Shape(shape.dims, src, shape.lead) if shape is not None else _Shape((n,), src, lead=True)
            return _Piece([], self.make(s), shape, out)
        if k in ("RMSNorm", "LayerNorm"):
            n = f["input_height"]
            adapters: list[nn.Module] = []
            if shape is not None and shape.last is not None and shape.last != n:
                if shape.numel != n:
                    raise self._no_chain(s, f"rows of input_height={n} values", shape)
                adapters = [Flatten()]  # Loom normalises the whole sample, as one row
            out = _Shape((n,), src, lead=True) if shape is None else _Shape((n,) if adapters else shape.dims, src, shape.lead and not adapters)
            return _Piece(adapters, self.make(s), shape if not adapters else _Shape((n,), ""), out)
        if k == "Embedding":
            if shape is not None:
                raise _err(s.where, f"an Embedding after another layer ({shape.src}): Loom would read that layer's "
                           "float outputs as token ids (truncated); torchloom's Embedding takes the network's "
                           "integer token ids, so it must come first")
            return _Piece([], self.make(s), None, _Shape((f["embedding_dim"],), src, lead=True))
        raise _err(s.where, f"layer type {k} is not supported")  # pragma: no cover

    def _parallel(self, s: LayerSpec, shape: _Shape | None) -> _Piece:
        f = s.f
        mode = f["combine_mode"] or ""
        if mode == "filter":
            raise _err(s.where, "combine_mode 'filter' needs Loom's gate layer, which Loom does not save "
                       "(a loaded 'filter' Parallel outputs zeros in Loom)")
        if mode not in _COMBINE:
            raise _err(s.where, f"combine_mode {mode!r} is not one of Loom's {sorted(set(_COMBINE) | {'filter'})}")
        if not s.children:
            return _Piece([], None, shape, shape)  # Loom passes the input through
        branches, sizes = [], []
        for c in s.children:
            self.common_checks(c)
            if c.kind == "Residual":
                raise _err(c.where, "a Residual as a Parallel branch (an identity in Loom) is not supported")
            piece = self.build_piece(c, shape)  # Loom runs every branch, even a disabled one
            if piece.module is None:
                raise _err(c.where, "an empty branch is not supported")
            mods = [*piece.adapters, piece.module]
            out = piece.shape_out
            if out is not None and not out.flat:
                mods.append(Flatten())  # Loom's Parallel joins each sample's flat branch outputs
            branches.append(mods[0] if len(mods) == 1 else Sequential(*mods))
            sizes.append(out.numel if out is not None else None)
        combine = _COMBINE[mode]
        if combine != "concat" and None not in sizes and len(set(sizes)) > 1:
            raise _err(s.where, f"combine_mode {mode!r} over branches of {sizes} values per sample: Loom adds them "
                       "into a buffer of the first branch's size (a crash or a partial sum); not supported")
        if combine == "concat":
            n = None if None in sizes else sum(sizes)
        else:
            n = sizes[0]
        return _Piece([], Parallel(branches, combine=combine), shape, _Shape((n,), f"{s.where} (Parallel)"))

    def _softmax(self, s: LayerSpec, shape: _Shape | None) -> _Piece:
        f = s.f
        st = f["softmax_type"]
        grid = st in ("Grid", 1)
        if not grid and st not in (None, "", "Standard", "Temperature", 0, 3):
            raise _err(s.where, f"softmax_type {st!r} is not supported (only 'Standard', 'Temperature', 'Grid')")
        t = f["temperature"] or 1.0  # Loom reads temperature 0 as 1
        if t <= 0:
            raise _err(s.where, f"temperature must be > 0, got {t}")
        out = _Shape(shape.dims, f"{s.where} (Softmax)", shape.lead) if shape is not None else None
        if not grid:
            return _Piece([], Softmax(dim=-1, temperature=t), shape, out)
        rows, cols = f["softmax_rows"], f["softmax_cols"]
        if rows < 1 or cols < 1:
            raise _err(s.where, "a 'Grid' softmax needs softmax_rows and softmax_cols >= 1")
        n = shape.numel if shape is not None else None
        if n is not None and n % cols:
            raise _err(s.where, f"a 'Grid' softmax with softmax_cols={cols} over the {n} values per sample that "
                       f"{shape.src} outputs: Loom's groups of {cols} would span two samples; not supported")
        if n is not None and (rows * cols) % n:
            raise _err(s.where, f"a 'Grid' softmax of softmax_rows × softmax_cols = {rows}×{cols} values over "
                       f"samples of {n} values: Loom normalises exactly {rows * cols} values of the whole batch "
                       "and leaves the rest 0, and that is no whole number of samples; not supported")
        if shape is not None and shape.last == cols:
            return _Piece([], Softmax(dim=-1, temperature=t), shape, out)
        return _Piece([], LoomGridSoftmax(cols, t), shape, out)

    # ------------------------------------------------------------------ leaf layers
    def make(self, s: LayerSpec) -> nn.Module:
        """The torchloom module of one leaf layer, with the file's weights when it has them."""
        k = s.kind
        f = s.f
        w = self.weights(s)
        dt = self.dtype
        if k == "Dense":
            i, o = f["input_height"], f["output_height"]
            m = Dense(i, o, self.activation(s), bias=s.where in self.biased, dtype=dt)
            if w is not None:
                self._set(m.weight, w, (o, i))
            return m
        if k in _CONV or k in _CONVT:
            transposed = k in _CONVT
            cls, nd = (_CONVT if transposed else _CONV)[k]
            kk, st, pd = f["kernel_size"], f["stride"], f["padding"]
            if kk < 1:
                raise _err(s.where, f"{k} needs 'kernel_size' >= 1, got {kk} (Loom's kernel loop then sums nothing: "
                           "every output would be the activation of 0)")
            if st < 1:
                raise _err(s.where, f"{k} needs 'stride' >= 1, got {st}")
            n_in, n_out = _spatial(f, nd, conv=not transposed)
            if not transposed:
                want = tuple((n + 2 * pd - kk) // st + 1 for n in n_in)
                if any(n < 1 for n in n_in) or n_out != want:
                    raise _err(s.where, f"{k}: output size {n_out} does not follow from input size {n_in}, kernel {kk}, "
                               f"stride {st}, padding {pd} (expected {want}); Loom would compute a different result")
                m = cls(f["input_channels"], f["filters"], kk, st, pd, self.activation(s), bias=s.where in self.biased, dtype=dt)
                if w is not None:
                    self._set(m.weight, w)
                return m
            natural = tuple((n - 1) * st - 2 * pd + kk for n in n_in)
            op = tuple(o - n for o, n in zip(n_out, natural))
            if any(n < 1 for n in n_in) or any(not 0 <= p < st for p in op):
                raise _err(s.where, f"{k}: output size {n_out} is not (n − 1)·stride − 2·padding + kernel + "
                           f"output_padding with 0 <= output_padding < stride for input size {n_in} (that is, "
                           f"{natural} + [0, {st})); Loom would crop or pad differently")
            m = cls(f["input_channels"], f["filters"], kk, st, pd, op, self.activation(s), bias=s.where in self.biased, dtype=dt)
            if w is not None:  # Loom: [F, C, k...]; torchloom (PyTorch): [C, F, k...]
                loom_w = torch.from_numpy(np.ascontiguousarray(w)).reshape(f["filters"], f["input_channels"], *m.kernel_size)
                self._set(m.weight, loom_w.transpose(0, 1).contiguous().numpy())
            return m
        if k == "RNN":
            i, h = f["input_height"], f["output_height"]
            m = RNN(i, h, bias=True, dtype=dt)
            if w is not None:
                self._set(m.weight_ih, w[: h * i])
                self._set(m.weight_hh, w[h * i : h * i + h * h])
                self._set(m.bias, w[h * i + h * h :])
            return m
        if k == "LSTM":
            i, h = f["input_height"], f["output_height"]
            m = LSTM(i, h, bias=True, dtype=dt)
            if w is not None:
                g = i * h + h * h + h
                blocks = w.reshape(4, g)
                self._set(m.weight_ih, blocks[:, : h * i])
                self._set(m.weight_hh, blocks[:, h * i : h * i + h * h])
                self._set(m.bias, blocks[:, h * i + h * h :])
            return m
        if k == "MultiHeadAttention":
            d, heads = f["d_model"], f["num_heads"]
            kvh = f["num_kv_heads"] or heads
            hd = f["head_dim"] or d // heads
            if hd * heads != d or f["query_dim"] not in (0, d):
                raise _err(s.where, f"MultiHeadAttention with head_dim {hd} × num_heads {heads} != d_model {d} "
                           f"(or query_dim {f['query_dim']} != d_model) is not supported")
            if heads % kvh or hd % 2:
                raise _err(s.where, f"MultiHeadAttention needs num_heads ({heads}) divisible by num_kv_heads "
                           f"({kvh}) and an even head_dim ({hd}) for RoPE")
            theta = f["rope_freq_base"] or 10000.0
            if theta <= 0:
                raise _err(s.where, f"rope_freq_base must be > 0, got {theta}")
            m = MultiHeadAttention(d, heads, kvh, causal=True, rope=True, bias=True, rope_theta=theta, dtype=dt)
            if w is not None:
                kv = kvh * hd
                sizes = [d * d, kv * d, kv * d, d * d, d, kv, kv, d]
                parts = np.split(w, np.cumsum(sizes)[:-1])
                for p, vals in zip((m.q_weight, m.k_weight, m.v_weight, m.o_weight, m.q_bias, m.k_bias, m.v_bias, m.o_bias), parts):
                    self._set(p, vals)
            return m
        if k == "SwiGLU":
            h, mm = f["input_height"], f["output_height"]
            m = SwiGLU(h, mm, bias=True, dtype=dt)
            if w is not None:
                sizes = [mm * h, mm * h, h * mm, mm, mm, h]
                parts = np.split(w, np.cumsum(sizes)[:-1])
                for p, vals in zip((m.gate_weight, m.up_weight, m.down_weight, m.gate_bias, m.up_bias, m.down_bias), parts):
                    self._set(p, vals)
            return m
        if k in ("RMSNorm", "LayerNorm"):
            n = f["input_height"]
            if f["output_height"] != n:
                raise _err(s.where, f"{k} needs output_height == input_height (Loom sizes the weights by one and "
                           f"normalises by the other), got {f['output_height']} and {n}")
            if k == "RMSNorm":
                m = RMSNorm(n, eps=1e-6, dtype=dt)
                if w is not None:
                    self._set(m.weight, w)
            else:
                m = LayerNorm(n, eps=1e-5, dtype=dt)
                if w is not None:
                    self._set(m.weight, w[:n])
                    self._set(m.bias, w[n:])
            return m
        if k == "Embedding":
            m = Embedding(f["vocab_size"], f["embedding_dim"], activation=self.activation(s), dtype=dt)
            if w is not None:
                self._set(m.weight, w)
            return m
        raise _err(s.where, f"layer type {k} is not supported")  # pragma: no cover


def _spatial(f: dict, nd: int, conv: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Input and output spatial sizes as Loom reads them (CNN2/CNN3 default missing width/depth to
    the height, as Loom's builder does; ConvTransposed1D uses the width fields)."""
    if nd == 1:
        if conv:
            return (f["input_height"],), (f["output_height"],)
        return (f["input_width"],), (f["output_width"],)
    ih, oh = f["input_height"], f["output_height"]
    iw = f["input_width"] or (ih if conv else 0)
    ow = f["output_width"] or (oh if conv else 0)
    if nd == 2:
        return (ih, iw), (oh, ow)
    idp = f["input_depth"] or (ih if conv else 0)
    odp = f["output_depth"] or (oh if conv else 0)
    return (idp, ih, iw), (odp, oh, ow)


def build_network(spec: NetSpec, dtype: torch.dtype, gelu: str, biased: frozenset[str] = frozenset()) -> Network:
    """The ``Network`` of ``spec``; ``biased`` names the layers (their ``where``, e.g.
    ``"layers[0]"``) built with a bias (torchloom's own descriptions; a Loom file has none)."""
    mods, _ = _Builder(dtype, gelu, biased).build_list(spec.layers, None, in_sequential=False)
    if not mods:
        raise ValueError("Loom JSON: no layer computes anything (every layer is disabled or an identity)")
    return Network(*mods)


# =============================================================================== export
def _refuse(name: str, msg: str) -> ValueError:
    return ValueError(f"to_loom_json: {name}: {msg}")


def _act(layer, name: str) -> str:
    a = layer.activation.name
    if a == "relu2":
        raise _refuse(name, "activation 'relu2': Loom v0.80 writes 'ReLU2' but reads it back (and builds it) as "
                      "linear, so the network would run differently in Loom")
    if a == "gelu":
        raise _refuse(name, "activation 'gelu' (exact erf form): Loom's GELU is the tanh approximation; use "
                      "'gelu_tanh' (or 'gelu_loom' for Loom's training arithmetic)")
    if a not in _ACT_TO_LOOM:
        raise _refuse(name, f"activation {a!r} has no Loom equivalent; Loom has {sorted(_ACT_TO_LOOM)}")
    return _ACT_TO_LOOM[a]


def _flat(*tensors: Tensor | None, like: Tensor) -> str:
    parts = [
        (t if t is not None else like.new_zeros(n)).detach().to("cpu", torch.float32).reshape(-1)
        for t, n in tensors
    ]
    vals = torch.cat(parts).numpy()
    if not np.isfinite(vals).all():
        raise ValueError("to_loom_json: weights must be finite to be written, found NaN/Inf")
    return encode_float32(vals)


def _same(values: tuple[int, ...], what: str, name: str) -> int:
    if len(set(values)) != 1:
        raise _refuse(name, f"Loom has one {what} for every spatial dimension, got {values}")
    return values[0]


def _base(loom_type: str, act: str = "Linear") -> dict:
    return {"type": loom_type, "activation": act, "dtype": "float32"}


def _weights(d: dict, mod: nn.Module, encode: Callable[[], str], description: bool = False) -> dict:
    """``d`` with its weights: ``encode()`` (Loom's base64 blob), or none in a torchloom description
    (its weights are the checkpoint's ``state_dict``; encoding them would cost seconds)."""
    if description:
        return d
    d["weights"] = encode()
    d["native"] = True
    d["scale"] = 1
    d["_module"] = mod  # for a low-bit export (``to_loom_json(dtype=...)``), removed before it returns
    return d


def requantize_layer(d: dict, dtype: str | None, name: str) -> None:
    """Rewrite a layer dict's float32 blob (and its nested layers') as native codes of ``dtype``
    (``None``: the dtype the module was trained in, ``TrainingConfig(weight_dtype=...)``, else float32)
    with their one scale. A module trained in that dtype is written exactly (its weights are codes ·
    its scale; checked bit for bit); any other is quantised round-to-nearest with the per-tensor
    scale ``lowbit.scale_for`` (post-training quantisation)."""
    for key in ("parallel_branches", "sequential_layers"):
        for i, sub in enumerate(d.get(key, ())):
            requantize_layer(sub, dtype, f"{name}.{key}[{i}]")
    mod = d.pop("_module", None)
    if mod is None:
        return
    from ..lowbit.codec import decode, dtype_info, encode, pack, scale_for

    trained = getattr(mod, "loom_lowbit", None)
    want = dtype if dtype is not None else (trained["dtype"] if trained else "float32")
    info = dtype_info(want, "to_loom_json: dtype")
    if info.name == "float32":
        return
    values = torch.from_numpy(np.frombuffer(base64.b64decode(d["weights"]), dtype="<f4").astype(np.float32))
    if trained and trained["dtype"] == info.name:
        if trained["scale"] is None:
            raise _refuse(name, f"trained in {info.name} with scale='per_row'; a Loom file holds one scale per layer "
                          "(train with scale='per_tensor' or 'fixed' to export it)")
        scale = trained["scale"].detach().to("cpu", torch.float32)
        codes = encode(values, info.name, scale, "nearest")
        if not torch.equal(decode(codes, info.name, scale).view(torch.int32), values.view(torch.int32)):
            raise _refuse(name, f"its weights are not {info.name} codes times the scale it was trained with (changed "
                          "after training?); pass dtype='float32', or retrain")
    else:
        scale = scale_for(values, info.name)
        codes = encode(values, info.name, scale, "nearest")
    d["dtype"] = info.name
    d["scale"] = float(scale) if info.scaled else 1
    d["weights"] = base64.b64encode(pack(codes, info.name)).decode("ascii")


def export_layers(mod: nn.Module, shapes: dict[int, tuple[int, ...]], name: str, *, description: bool = False) -> list[dict]:
    """Loom layer dicts for ``mod`` (empty for Flatten, several for a Network / Sequential at the
    top level is handled by the caller). ``description=True`` makes torchloom's own network
    description for checkpoints (never a Loom file): a Dense's or convolution's bias is written as
    ``"bias": true`` where Loom, which has none, refuses it, and no weights are written."""
    shape = shapes.get(id(mod))
    if isinstance(mod, (Flatten, LoomReshape)):
        return []  # Loom's activations are flat buffers already
    if isinstance(mod, Dense):
        if mod.bias is not None and not description:
            raise _refuse(name, "Dense has a bias; Loom's Dense has none (use bias=False)")
        if shape is not None and len(shape) > 2:
            raise _refuse(name, f"Dense on an input of shape {list(shape)}: Loom's Dense reads each sample as one row "
                          f"of input_height values (it would take the first {shape[0]}×{mod.in_features} values of the "
                          "batch), not every position; flatten first (Flatten) or use a layer Loom applies per position "
                          "(SwiGLU)")
        d = _base("Dense", _act(mod, name))
        d.update(input_height=mod.in_features, output_height=mod.out_features)
        if mod.bias is not None:
            d["bias"] = True
        return [_weights(d, mod, lambda: _flat((mod.weight, 0), like=mod.weight), description)]
    if isinstance(mod, (_ConvND, _ConvTransposeND)):
        transposed = isinstance(mod, _ConvTransposeND)
        nd = mod.ndim
        kind = f"ConvTransposed{nd}D" if transposed else f"CNN{nd}"
        if mod.bias is not None and not description:
            raise _refuse(name, f"{type(mod).__name__} has a bias; Loom's {kind} has none (use bias=False)")
        k = _same(mod.kernel_size, "kernel size", name)
        st = _same(mod.stride, "stride", name)
        pd = _same(mod.padding, "padding", name)
        if shape is None:
            raise _refuse(name, f"{type(mod).__name__}: Loom stores the spatial input/output sizes; " + (
                "its input shape could not be recorded from example_input (a convolution inside a Parallel "
                "branch is not supported)" if shapes else
                "pass example_input= (a tensor or its shape) to to_loom_json / save_loom"))
        n_in = tuple(shape[2:])
        n_out = mod.output_shape(n_in)
        d = _base(kind, _act(mod, name))
        d.update(input_channels=mod.in_channels, filters=mod.filters, kernel_size=k, stride=st, padding=pd)
        if mod.bias is not None:
            d["bias"] = True
        if transposed:
            op = _same(mod.output_padding, "output padding", name)
            if op:
                d["output_padding"] = op
            keys = {1: ("width",), 2: ("height", "width"), 3: ("depth", "height", "width")}[nd]
            w = mod.weight.transpose(0, 1)  # PyTorch [C, F, k...] → Loom [F, C, k...]
        else:
            keys = {1: ("height",), 2: ("height", "width"), 3: ("depth", "height", "width")}[nd]
            w = mod.weight
        for key, a, b in zip(keys, n_in, n_out):
            d[f"input_{key}"] = a
            d[f"output_{key}"] = b
        return [_weights(d, mod, lambda: _flat((w.contiguous(), 0), like=mod.weight), description)]
    if isinstance(mod, (RNN, LSTM)):
        if shape is None:
            raise _refuse(name, f"{type(mod).__name__}: Loom stores the sequence length; " + (
                "its input shape could not be recorded from example_input (an RNN / LSTM inside a Parallel "
                "branch is not supported)" if shapes else
                "pass example_input= (a tensor or its shape [batch, time, features]) to to_loom_json / save_loom"))
        i, h = mod.input_size, mod.hidden_size
        d = _base(type(mod).__name__, "Tanh")
        d.update(input_height=i, output_height=h, seq_length=int(shape[1]))
        def encode() -> str:
            if isinstance(mod, RNN):
                return _flat((mod.weight_ih, 0), (mod.weight_hh, 0), (mod.bias, h), like=mod.weight_ih)
            bias = mod.bias if mod.bias is not None else torch.zeros(4 * h, dtype=mod.weight_ih.dtype)
            blocks = torch.cat([mod.weight_ih.detach().reshape(4, h * i), mod.weight_hh.detach().reshape(4, h * h),
                                bias.detach().reshape(4, h)], dim=1)
            return _flat((blocks, 0), like=mod.weight_ih)

        return [_weights(d, mod, encode, description)]
    if isinstance(mod, MultiHeadAttention):
        if not (mod.causal and mod.rope):
            raise _refuse(name, "MultiHeadAttention: Loom's attention is always causal with RoPE; "
                          f"got causal={mod.causal}, rope={mod.rope}")
        dm, kv = mod.d_model, mod.num_kv_heads * mod.head_dim
        d = _base("MultiHeadAttention")
        d.update(d_model=dm, num_heads=mod.num_heads, num_kv_heads=mod.num_kv_heads, head_dim=mod.head_dim,
                 rope_freq_base=mod.rope_theta)
        if shape is not None and len(shape) == 3:
            d["seq_length"] = int(shape[1])
        return [_weights(d, mod, lambda: _flat(
            (mod.q_weight, 0), (mod.k_weight, 0), (mod.v_weight, 0), (mod.o_weight, 0),
            (mod.q_bias, dm), (mod.k_bias, kv), (mod.v_bias, kv), (mod.o_bias, dm), like=mod.q_weight), description)]
    if isinstance(mod, SwiGLU):
        h, m = mod.hidden, mod.intermediate
        d = _base("SwiGLU")
        d.update(input_height=h, output_height=m)
        return [_weights(d, mod, lambda: _flat(
            (mod.gate_weight, 0), (mod.up_weight, 0), (mod.down_weight, 0),
            (mod.gate_bias, m), (mod.up_bias, m), (mod.down_bias, h), like=mod.gate_weight), description)]
    if isinstance(mod, (RMSNorm, LayerNorm)):
        want = 1e-6 if isinstance(mod, RMSNorm) else 1e-5
        if mod.eps != want:
            raise _refuse(name, f"{type(mod).__name__}(eps={mod.eps}): Loom's {type(mod).__name__} uses eps={want} "
                          "and does not store it")
        n = mod.normalized_shape
        d = _base(type(mod).__name__)
        d.update(input_height=n, output_height=n)
        parts = [(mod.weight, 0)] + ([(mod.bias, 0)] if isinstance(mod, LayerNorm) else [])
        return [_weights(d, mod, lambda: _flat(*parts, like=mod.weight), description)]
    if isinstance(mod, Embedding):
        d = _base("Embedding", _act(mod, name))
        d.update(vocab_size=mod.num_embeddings, embedding_dim=mod.embedding_dim)
        return [_weights(d, mod, lambda: _flat((mod.weight, 0), like=mod.weight), description)]
    if isinstance(mod, LoomGridSoftmax):
        if shape is None:
            raise _refuse(name, "LoomGridSoftmax: Loom fixes the number of rows of a 'Grid' softmax in the file; "
                          "pass example_input= (a tensor or its shape) to to_loom_json / save_loom")
        d = _base("Softmax")
        d.update(temperature=mod.temperature, softmax_type="Grid", softmax_rows=math.prod(shape) // mod.cols,
                 softmax_cols=mod.cols)
        return [d]
    if isinstance(mod, Softmax):
        if mod.dim != -1 and not (shape is not None and mod.dim == len(shape) - 1):
            raise _refuse(name, f"Softmax(dim={mod.dim}): Loom normalises the last dimension only; use dim=-1")
        d = _base("Softmax")
        d["temperature"] = mod.temperature
        if shape is not None:  # Loom fixes the number of rows in the file: rows × last dim
            d.update(softmax_type="Grid", softmax_rows=math.prod(shape[:-1]), softmax_cols=shape[-1])
        else:  # Loom's Standard softmax spans the whole input: torchloom's result for one row
            d["softmax_type"] = "Standard" if mod.temperature == 1.0 else "Temperature"
        return [d]
    if isinstance(mod, Residual):
        inner = export_layers(mod.inner, shapes, f"{name}.inner", description=description)
        if len(inner) != 1:
            raise _refuse(name, "Residual: its inner layer must map to exactly one Loom layer")
        # Loom's Residual inside a Sequential adds the previous sub-layer's input to its output.
        d = _base("Sequential")
        d["sequential_layers"] = inner + [_base("Residual")]
        return [d]
    if isinstance(mod, Parallel):
        branches = []
        for i, b in enumerate(mod.branches):
            out = export_layers(b, shapes, f"{name}.branches[{i}]", description=description)
            if len(out) != 1:
                raise _refuse(name, f"Parallel: branch {i} must map to exactly one Loom layer")
            branches.append(out[0])
        d = _base("Parallel")
        d.update(combine_mode=mod.combine, parallel_branches=branches)
        return [d]
    if isinstance(mod, Sequential):  # Network too, when nested
        subs = []
        for i, c in enumerate(mod):
            subs.extend(export_layers(c, shapes, f"{name}[{i}]", description=description))
        if not subs:
            raise _refuse(name, "Sequential: nothing to write")
        d = _base("Sequential")
        d["sequential_layers"] = subs
        return [d]
    raise _refuse(name, f"{getattr(mod, 'loom_type', type(mod).__name__)} has no Loom equivalent that runs the same")
