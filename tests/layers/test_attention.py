"""MultiHeadAttention: hand-written backward against gradcheck and ``F.scaled_dot_product_attention``
with an independent RoPE and GQA through ``repeat_interleave`` (SPEC §3, §13)."""

from __future__ import annotations

import contextlib

import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from torchloom.layers.attention import MultiHeadAttention, MultiHeadAttentionFunction, multi_head_attention
from torchloom.layers.dense import Dense
from torchloom.layers.network import Network
from torchloom.engine.train import TrainingConfig, train

# (B, S, d_model, heads, kv_heads, causal, rope, bias): odd sequence lengths, batch > 1, plain MHA,
# grouped-query (G = 3), multi-query (one kv head), no mask, no RoPE, no bias, head size 2.
CASES = [
    (2, 5, 12, 6, 2, True, True, True),
    (3, 4, 8, 2, 2, True, True, False),
    (2, 3, 6, 3, 1, False, True, True),
    (3, 5, 9, 3, 3, True, False, True),
    (2, 7, 8, 4, 2, False, False, False),
]


def _ids(c):
    b, s, d, h, kv, causal, rope, bias = c
    return f"B{b}S{s}d{d}H{h}K{kv}-{'causal' if causal else 'full'}-{'rope' if rope else 'norope'}-{'bias' if bias else 'nobias'}"


def _layer(case, dtype=torch.float64, theta=10000.0):
    b, s, d, h, kv, causal, rope, bias = case
    layer = MultiHeadAttention(d, h, kv, causal=causal, rope=rope, bias=bias, rope_theta=theta, dtype=dtype)
    with torch.no_grad():  # non-zero biases, so a missing bias gradient shows
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    return layer


# ------------------------------------------------------------------------------ independent reference
def _rope_reference(t: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as complex multiplication: the pair (t_i, t_{i+D/2}) is the complex number
    t_i + j·t_{i+D/2}, multiplied by e^{j·s/θ^(2i/D)} at position s (Loom's formula). ``t [B,H,S,D]``."""
    s, d = t.shape[-2], t.shape[-1]
    half = d // 2
    pos = torch.arange(s, dtype=torch.float64, device=t.device)
    freq = torch.tensor([1.0 / theta ** (2 * i / d) for i in range(half)], dtype=torch.float64, device=t.device)
    rot = torch.polar(torch.ones(s, half, dtype=torch.float64, device=t.device), pos[:, None] * freq[None, :])
    z = torch.complex(t[..., :half].double(), t[..., half:].double()) * rot
    return torch.cat((z.real, z.imag), dim=-1).to(t.dtype)


def _reference(x, params, heads, kv_heads, causal, rope, theta=10000.0):
    """Attention written with F.linear, the RoPE above, repeat_interleave for GQA and
    F.scaled_dot_product_attention (default scale 1/√D)."""
    qw, kw, vw, ow, *biases = params
    qb, kb, vb, ob = biases if biases else (None,) * 4
    b, s, d = x.shape
    hd = d // heads
    q = F.linear(x, qw, qb).view(b, s, heads, hd).transpose(1, 2)
    k = F.linear(x, kw, kb).view(b, s, kv_heads, hd).transpose(1, 2)
    v = F.linear(x, vw, vb).view(b, s, kv_heads, hd).transpose(1, 2)
    if rope:
        q, k = _rope_reference(q, theta), _rope_reference(k, theta)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    merged = o.transpose(1, 2).reshape(b, s, d)
    return F.linear(merged, ow, ob), merged


# ------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gradcheck_float64(case):
    b, s, d, h, kv, causal, rope, bias = case
    layer = _layer(case)
    x = torch.randn(b, s, d, dtype=torch.float64, requires_grad=True)
    params = [p.detach().clone().requires_grad_() for p in layer._params() if p is not None]
    if not bias:
        params += [None] * 4
    assert torch.autograd.gradcheck(MultiHeadAttentionFunction.apply, (x, *params, layer.spec))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-11), (torch.float32, 2e-5)])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_matches_sdpa_reference(case, dtype, tol):
    """Forward and every gradient equal the SDPA reference with weights copied across, through the
    module (autograd Function) and through ``backward_saved``; ``pre`` is the merged heads."""
    b, s, d, h, kv, causal, rope, bias = case
    layer = _layer(case, dtype)
    params = tuple(layer.parameters())
    names = [n for n, _ in layer.named_parameters()]
    refs = [p.detach().clone().requires_grad_() for p in params]
    x = torch.randn(b, s, d, dtype=dtype)
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = layer(xo)
    y_ref, merged = _reference(xr, refs, h, kv, causal, rope)
    assert_close(y, y_ref, name="output", rtol=tol, atol=tol)
    g = torch.randn_like(y_ref)
    y.backward(g)
    ref_grads = torch.autograd.grad(y_ref, [xr, *refs], g)
    assert_close(xo.grad, ref_grads[0], name="grad input", rtol=tol, atol=tol)
    for p, r, n in zip(params, ref_grads[1:], names):
        assert_close(p.grad, r, name=f"grad {n}", rtol=tol, atol=tol)

    with torch.no_grad():
        y2, saved = layer.forward_saved(x)
        gx, grads = layer.backward_saved(g, saved)
    assert len(grads) == len(params) == (8 if bias else 4)
    assert_close(y2, y_ref, name="forward_saved output", rtol=tol, atol=tol)
    assert_close(layer.pre_activation(saved), merged, name="pre (merged heads)", rtol=tol, atol=tol)
    assert_close(gx, ref_grads[0], name="backward_saved grad input", rtol=tol, atol=tol)
    for got, r, n in zip(grads, ref_grads[1:], names):
        assert_close(got, r, name=f"backward_saved grad {n}", rtol=tol, atol=tol)
    assert layer.backward_saved(g, saved, needs_input_grad=False)[0] is None


def test_rope_theta_is_used():
    case = (2, 6, 8, 2, 1, True, True, True)
    layer = _layer(case, theta=50.0)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    y_ref, _ = _reference(x, tuple(layer.parameters()), 2, 1, True, True, theta=50.0)
    assert_close(layer(x), y_ref, name="output theta=50", rtol=1e-11, atol=1e-11)
    y_default, _ = _reference(x, tuple(layer.parameters()), 2, 1, True, True)
    assert (layer(x) - y_default).abs().max() > 1e-3


def test_rope_positions_start_at_zero_in_every_sample():
    """Loom's KV cache continues positions across the batch; here sample b at position s uses angle
    s·θ^(−2i/D) whatever b is, so the same sequence gives the same output in any batch slot."""
    layer = _layer((3, 4, 8, 2, 2, True, True, True))
    seq = torch.randn(1, 4, 8, dtype=torch.float64)
    x = torch.cat([torch.randn(1, 4, 8, dtype=torch.float64), seq, torch.randn(1, 4, 8, dtype=torch.float64)])
    assert_close(layer(x)[1:2], layer(seq), name="slot 1 vs alone", rtol=1e-13, atol=1e-13)


def test_rope_tables_are_kept_per_key_and_equal_fresh_ones(monkeypatch):
    """The kept tables are rope_tables' own (made once per S, D, θ, device, dtype), plain tensors even
    when first made under inference mode, and the store drops its oldest tables past its byte budget."""
    from torchloom.layers import attention as A

    monkeypatch.setattr(A, "_ROPE_CACHE", {})
    dev = torch.device("cpu")
    with torch.inference_mode():
        cos, sin = A._rope_tables_kept(7, 4, 100.0, dev, torch.float32)
    ref_cos, ref_sin = A.rope_tables(7, 4, 100.0, dev, torch.float32)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert not cos.is_inference() and not sin.is_inference()
    assert A._rope_tables_kept(7, 4, 100.0, dev, torch.float32)[0] is cos  # kept
    other = A._rope_tables_kept(7, 4, 100.0, dev, torch.float64)  # another dtype: other tables
    assert other[0].dtype == torch.float64 and other[0] is not cos
    assert A._rope_tables_kept(7, 4, 50.0, dev, torch.float32)[0] is not cos  # another θ
    # a budget for two [7, 2] float32 pairs (2·14·4 bytes each): the oldest goes first
    monkeypatch.setattr(A, "_ROPE_CACHE", {})
    monkeypatch.setattr(A, "_ROPE_CACHE_BYTES", 2 * 2 * 14 * 4)
    first = A._rope_tables_kept(7, 4, 1.0, dev, torch.float32)[0]
    A._rope_tables_kept(7, 4, 2.0, dev, torch.float32)
    A._rope_tables_kept(7, 4, 3.0, dev, torch.float32)
    assert len(A._ROPE_CACHE) == 2 and A._rope_tables_kept(7, 4, 1.0, dev, torch.float32)[0] is not first
    kept = dict(A._ROPE_CACHE)
    big = A._rope_tables_kept(100, 4, 1.0, dev, torch.float32)  # larger than the whole budget: never kept,
    assert torch.equal(big[0], A.rope_tables(100, 4, 1.0, dev, torch.float32)[0])
    assert A._ROPE_CACHE == kept  # and the kept tables stay


def test_rope_tables_under_a_dispatch_mode_are_neither_kept_nor_read(monkeypatch):
    """Fake-tensor tracing (a TorchDispatchMode) gets tables of its own mode, and leaves the store alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchloom.layers import attention as A

    monkeypatch.setattr(A, "_ROPE_CACHE", {})
    dev = torch.device("cpu")
    real = A._rope_tables_kept(6, 4, 10.0, dev, torch.float32)[0]
    with FakeTensorMode():
        fake = A._rope_tables_kept(6, 4, 10.0, dev, torch.float32)[0]
        fresh = A._rope_tables_kept(5, 4, 10.0, dev, torch.float32)[0]
    assert fake is not real and type(fake) is not torch.Tensor and type(fresh) is not torch.Tensor
    assert list(A._ROPE_CACHE) == [(6, 4, 10.0, dev, torch.float32, None)]
    assert A._rope_tables_kept(6, 4, 10.0, dev, torch.float32)[0] is real


@pytest.mark.cuda
def test_rope_tables_in_a_capture_kept_ones_read_and_pinned_others_not_kept(monkeypatch):
    """A CUDA graph capture reads the tables kept for its stream (no sin/cos kernels in every replay)
    and pins them: a later flood of the store never drops them, and a replay still computes with
    them. Tables the store does not hold (another stream's, or none) are made in the capture and not
    kept."""
    from torchloom.layers import attention as A

    monkeypatch.setattr(A, "_ROPE_CACHE", {})
    monkeypatch.setattr(A, "_ROPE_PINNED", set())
    dev = torch.device("cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        A._rope_tables_kept(9, 4, 10.0, dev, torch.float32)
    assert A._ROPE_CACHE == {}
    cos, _ = A._rope_tables_kept(9, 4, 10.0, dev, torch.float32)
    assert torch.equal(cos, A.rope_tables(9, 4, 10.0, dev, torch.float32)[0]) and len(A._ROPE_CACHE) == 1
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        kept, _ = A._rope_tables_kept(7, 4, 10.0, dev, torch.float32)
    torch.cuda.synchronize()
    out = torch.empty(7, 2, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        captured, _ = A._rope_tables_kept(7, 4, 10.0, dev, torch.float32)
        torch.mul(captured, 2.0, out=out)
    assert captured is kept
    key = (7, 4, 10.0, dev, torch.float32, side.stream_id)
    assert A._ROPE_PINNED == {key}
    # a budget for two pairs: filling it again drops every table but the pinned one
    monkeypatch.setattr(A, "_ROPE_CACHE_BYTES", 2 * 2 * 14 * 4)
    for theta in (1.0, 2.0, 3.0):
        A._rope_tables_kept(7, 4, theta, dev, torch.float32)
    assert key in A._ROPE_CACHE and A._ROPE_CACHE[key][0] is kept
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, 2.0 * A.rope_tables(7, 4, 10.0, dev, torch.float32)[0])


def test_functional_matches_module_and_rejects_partial_biases():
    layer = _layer((2, 5, 12, 6, 3, True, True, True))
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    y = multi_head_attention(x, *layer.parameters(), num_heads=6, num_kv_heads=3)
    assert torch.equal(y, layer(x))
    with pytest.raises(ValueError, match="all four biases"):
        multi_head_attention(x, *list(layer.parameters())[:5], num_heads=6, num_kv_heads=3)


@pytest.mark.parametrize("causal", [True, False])
def test_batch_independence(causal):
    """Output and gradients of samples 1.. do not depend on sample 0 (Loom attends across the batch
    through its KV cache: SPEC §13)."""
    layer = _layer((4, 5, 8, 4, 2, causal, True, True), dtype=torch.float32)
    x = torch.randn(4, 5, 8)
    x2 = x.clone()
    x2[0] = torch.randn(5, 8) * 3
    y, y2 = layer(x), layer(x2)
    assert not torch.allclose(y[0], y2[0])
    assert torch.equal(y[1:], y2[1:])
    xr = x.clone().requires_grad_()
    layer(xr)[1:].sum().backward()
    assert torch.count_nonzero(xr.grad[0]) == 0 and torch.count_nonzero(xr.grad[1:]) > 0


def test_causal_mask_hides_the_future():
    layer = _layer((2, 6, 8, 2, 1, True, True, True))
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    x2 = x.clone()
    x2[:, 4:] = torch.randn(2, 2, 8, dtype=torch.float64)
    y, y2 = layer(x), layer(x2)
    assert torch.equal(y[:, :4], y2[:, :4])
    assert not torch.allclose(y[:, 4:], y2[:, 4:])


def test_inside_network_with_history():
    """Dense → MultiHeadAttention → Dense in Loom mode: history and the hand-written backward equal
    autograd through the SDPA reference."""
    dt = torch.float64
    mha = _layer((3, 5, 8, 4, 2, True, True, True))
    net = Network(Dense(3, 8, "tanh", dtype=dt), mha, Dense(8, 2, dtype=dt), record_history=True)
    x = torch.randn(3, 5, 3, dtype=dt)
    y = net(x)
    g = torch.randn_like(y)
    gx = net.backward(g, input_grad=True)
    got = [p.grad.clone() for p in net.parameters()]
    params = [p.detach().clone().requires_grad_() for p in net.parameters()]
    xr = x.clone().requires_grad_()
    h0 = torch.tanh(F.linear(xr, params[0], params[1]))
    h1, merged = _reference(h0, params[2:10], 4, 2, True, True)
    y_ref = F.linear(h1, params[10], params[11])
    assert_close(y, y_ref, name="output", rtol=1e-11, atol=1e-11)
    assert_close(net.history[1].pre, merged, name="history pre", rtol=1e-11, atol=1e-11)
    ref = torch.autograd.grad(y_ref, [xr, *params], g)
    assert_close(gx, ref[0], name="grad input", rtol=1e-10, atol=1e-11)
    for i, (a, r) in enumerate(zip(got, ref[1:])):
        assert_close(a, r, name=f"param {i}", rtol=1e-10, atol=1e-11)


def test_parameter_names_shapes_order_and_init():
    torch.manual_seed(1)
    layer = MultiHeadAttention(64, 8, 2)
    kv = 2 * 8
    assert [(n, tuple(p.shape)) for n, p in layer.named_parameters()] == [
        ("q_weight", (64, 64)), ("k_weight", (kv, 64)), ("v_weight", (kv, 64)), ("o_weight", (64, 64)),
        ("q_bias", (64,)), ("k_bias", (kv,)), ("v_bias", (kv,)), ("o_bias", (64,)),
    ]
    assert abs(layer.q_weight.std().item() - 1 / 8) < 0.01
    assert all(torch.count_nonzero(getattr(layer, f"{c}_bias")) == 0 for c in "qkvo")
    nb = MultiHeadAttention(6, 3, bias=False, rope=False, causal=False, dtype=torch.float64)
    assert [n for n, _ in nb.named_parameters()] == ["q_weight", "k_weight", "v_weight", "o_weight"]
    assert nb.num_kv_heads == 3 and nb.head_dim == 2 and nb.q_weight.dtype == torch.float64
    assert "d_model=6, num_heads=3, num_kv_heads=3, causal=False, rope=False, bias=False" in repr(nb)


@pytest.mark.parametrize(
    "args,kwargs,exc,pattern",
    [
        ((10, 4), {}, ValueError, r"d_model \(10\) must be divisible by num_heads \(4\)"),
        ((12, 6, 4), {}, ValueError, r"num_heads \(6\) must be divisible by num_kv_heads \(4\)"),
        ((9, 3), {}, ValueError, r"rope=True needs an even head size d_model/num_heads, got 9/3 = 3"),
        ((0, 2), {}, ValueError, "d_model must be a positive int, got 0"),
        ((8, 0), {}, ValueError, "num_heads must be a positive int, got 0"),
        ((8, 2, 0), {}, ValueError, "num_kv_heads must be a positive int, got 0"),
        ((8, 2), {"rope_theta": 0.0}, ValueError, "rope_theta must be a finite number > 0, got 0.0"),
        ((8, 2), {"causal": 1}, TypeError, "causal must be a bool, got 1"),
    ],
)
def test_bad_constructor_args(args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        MultiHeadAttention(*args, **kwargs)


@pytest.mark.parametrize("shape", [(2, 5, 6), (5, 8), (2, 0, 8)], ids=["wrong-d", "2d", "empty-seq"])
def test_bad_input_shape(shape):
    layer = MultiHeadAttention(8, 2)
    want = rf"\[batch, seq, 8\], got \[{', '.join(map(str, shape))}\]"
    with pytest.raises(ValueError, match=want):
        layer(torch.randn(*shape))
    with pytest.raises(ValueError, match=want):
        layer.forward_saved(torch.randn(*shape))


def _sequence_batches(device, n=96, batch=16, seq=6):
    """Target at step t: the running mean of the first input feature over steps 0..t (needs causal
    attention spread evenly over the past)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, seq, 4, generator=g)
    y = torch.cumsum(x[..., :1], dim=1) / torch.arange(1, seq + 1).view(1, seq, 1)
    return [(x[i : i + batch].to(device), y[i : i + batch].to(device)) for i in range(0, n, batch)]


def _train_attention_net(device):
    torch.manual_seed(0)
    net = Network(Dense(4, 8), MultiHeadAttention(8, 2, 1), Dense(8, 1)).to(device)
    res = train(net, _sequence_batches(device), TrainingConfig(epochs=25, learning_rate=0.05, optimizer="momentum", verbose=False))
    return res.loss_history[0], res.final_loss


def test_train_reduces_loss():
    first, last = _train_attention_net("cpu")
    assert last < 0.3 * first, (first, last)


@pytest.mark.cuda
def test_cuda_matches_reference_and_trains():
    """On CUDA (softmax in the fused kernels) forward and every gradient equal the float64 SDPA
    reference on the CPU, and training reduces the loss."""
    case = (3, 37, 32, 4, 2, True, True, True)
    layer = _layer(case)
    x = torch.randn(3, 37, 32, dtype=torch.float64)
    refs = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    xr = x.clone().requires_grad_()
    y_ref, _ = _reference(xr, refs, 4, 2, True, True)
    g = torch.randn_like(y_ref)
    ref_grads = torch.autograd.grad(y_ref, [xr, *refs], g)
    cuda_layer = layer.float().cuda()
    xc = x.float().cuda().requires_grad_()
    y = cuda_layer(xc)
    y.backward(g.float().cuda())
    assert_close(y, y_ref, name="output", rtol=1e-4, atol=1e-4)
    assert_close(xc.grad, ref_grads[0], name="grad input", rtol=1e-4, atol=1e-4)
    for (n, p), r in zip(cuda_layer.named_parameters(), ref_grads[1:]):
        assert_close(p.grad, r, name=f"grad {n}", rtol=1e-4, atol=1e-3)
    first, last = _train_attention_net("cuda")
    assert last < 0.3 * first, (first, last)


# ------------------------------------------------------------------------ flash path (Triton kernel)
def _needs_interpreter_or_cuda():
    from torchloom.kernels._triton import interpreter_enabled, triton_available

    if not triton_available() or not (torch.cuda.is_available() or interpreter_enabled()):
        pytest.skip("needs Triton (its interpreter on CPU)")


# odd lengths (1, 17, 65 with the interpreter's 16-wide blocks), head sizes 16 and 32, GQA and MQA
FLASH_CASES = [
    (2, 1, 32, 2, 1, True, True, True),
    (2, 17, 64, 4, 2, True, True, False),
    (1, 65, 64, 2, 2, False, True, True),
    (2, 17, 48, 3, 1, False, False, True),
]


@pytest.mark.parametrize("case", FLASH_CASES, ids=_ids)
def test_flash_path_matches_reference(case):
    """The flash path (fused q|k|v product, in-place RoPE, the Triton kernel; through the interpreter
    on CPU) gives the SDPA reference's output and every gradient in float32, through the autograd
    Function and through ``forward_saved``/``backward_saved``; nothing of size S×S is saved."""
    _needs_interpreter_or_cuda()
    b, s, d, h, kv, causal, rope, bias = case
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layer = _layer(case, torch.float32).to(dev)
    names = [n for n, _ in layer.named_parameters()]
    refs = [p.detach().double().cpu().requires_grad_() for p in layer.parameters()]
    x = torch.randn(b, s, d, device=dev)
    xr = x.double().cpu().requires_grad_()
    y_ref, merged = _reference(xr, refs, h, kv, causal, rope)
    g = torch.randn_like(y_ref)
    ref_grads = torch.autograd.grad(y_ref, [xr, *refs], g)
    xo = x.clone().requires_grad_()
    params = list(layer.parameters()) + ([] if bias else [None] * 4)
    y = multi_head_attention(xo, *params, num_heads=h, num_kv_heads=kv, causal=causal, rope=rope, backend="triton")
    y.backward(g.float().to(dev))
    tol = dict(rtol=1e-4, atol=1e-4)
    assert_close(y, y_ref, name="output", **tol)
    assert_close(xo.grad, ref_grads[0], name="grad input", **tol)
    for p, r, n in zip(layer.parameters(), ref_grads[1:], names):
        assert_close(p.grad, r, name=f"grad {n}", **tol)

    import dataclasses

    from torchloom.layers.attention import FlashAttentionSaved, attention_backward, attention_forward

    spec = dataclasses.replace(layer.spec, backend="triton")
    with torch.no_grad():
        y2, saved = attention_forward(x, *layer._params(), spec)
        gx, grads = attention_backward(g.float().to(dev), saved)
    assert isinstance(saved, FlashAttentionSaved)
    assert all(t.numel() < b * h * s * s or s == 1 for t in saved if isinstance(t, torch.Tensor) and t.dim() == 4)
    assert tuple(saved.lse.shape) == (b, h, s)
    assert_close(y2, y_ref, name="forward_saved output", **tol)
    assert_close(saved.pre, merged, name="pre (merged heads)", **tol)
    assert_close(gx, ref_grads[0], name="backward_saved grad input", **tol)
    for got, r, n in zip(grads, ref_grads[1:], names):
        assert_close(got, r, name=f"backward_saved grad {n}", **tol)


# (B, S, H, K, D, causal, rope): GQA with RoPE and the causal mask, then plain heads without either;
# S ragged against the interpreter's 16-wide blocks.
CORE_CASES = [(2, 5, 4, 2, 4, True, True), (1, 9, 2, 2, 8, False, False)]


@pytest.mark.parametrize("case", CORE_CASES, ids=lambda c: f"B{c[0]}S{c[1]}H{c[2]}K{c[3]}D{c[4]}-{c[5]}-{c[6]}")
def test_flash_core_operators(case):
    """``torchloom::flash_attention_core`` / ``flash_attention_core_backward`` (the flash path's core,
    which a compiled layer calls as opaque operators) on the Triton kernel: ``torch.library.opcheck``
    passes (schema, the declared write of ``qkv`` and nothing else, fake tensors, AOT dispatch), and
    against float64 autograd through the complex-number RoPE and SDPA: the forward leaves q and k
    rotated in ``qkv`` (v as it was) and returns ``o`` and the log-sum-exp; the backward gives the
    gradient with respect to the projection before RoPE."""
    _needs_interpreter_or_cuda()
    _check_core(case, "triton", torch.float32, dict(rtol=1e-4, atol=1e-5), opcheck=case == CORE_CASES[0])


# (B, S, H, K, D, causal, rope) on PyTorch's fused kernels: S ragged (77), plain and grouped heads, and a
# head size that is not a multiple of 8 (FlashAttention-2's operator refuses it: never chosen for it)
FUSED_CASES = [(2, 77, 4, 4, 64, True, True), (2, 77, 4, 2, 64, True, True), (1, 77, 2, 2, 32, False, False),
               (2, 77, 4, 4, 12, True, True)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"B{c[0]}S{c[1]}H{c[2]}K{c[3]}D{c[4]}-{c[5]}-{c[6]}")
def test_flash_core_on_pytorchs_fused_kernels(case, dtype):
    """With ``backend`` None on CUDA the core runs the fused kernel ``F.scaled_dot_product_attention``
    would pick (``sdpa_choice``: FlashAttention-2, the memory-efficient kernel or cuDNN's; the Triton
    kernel only for grouped heads in float32), forward and backward as separate operators: the same
    checks as the Triton core against float64 autograd, within the dtype's tolerance."""
    from torchloom.kernels import flash_attention as FA

    b, s, h, kv, hd, causal, rope = case
    q = torch.empty(b, s, h, hd, device="cuda", dtype=dtype)
    k = torch.empty(b, s, kv, hd, device="cuda", dtype=dtype)
    choice = FA.sdpa_choice(q, k, k, causal)
    if hd % 8:
        assert choice != FA.SDPA_FLASH
    elif dtype != torch.float32 or h == kv:
        assert choice in (FA.SDPA_FLASH, FA.SDPA_EFFICIENT, FA.SDPA_CUDNN), choice
    else:
        assert choice is None  # grouped heads in float32: only the memory-efficient kernel, which does not take them
    tol = {torch.float32: dict(rtol=1e-4, atol=2e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}.get(dtype, dict(rtol=5e-2, atol=5e-2))
    _check_core(case, None, dtype, tol, opcheck=case == FUSED_CASES[0] and dtype == torch.bfloat16)


_KERNELS = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"]


@pytest.mark.cuda
@pytest.mark.parametrize("forward_kernel,backward_kernel", [(f, b) for f in _KERNELS for b in _KERNELS if f != b])
def test_fused_core_backward_fits_a_forward_under_another_kernel(forward_kernel, backward_kernel):
    """The backward chooses its kernel again; a forward under one forced kernel (``sdpa_kernel``) and the
    backward under another still give the float64 gradients: every kernel saves the output and the
    natural-log log-sum-exp per query."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from torchloom.kernels import flash_attention as FA

    b, s, h, kv, hd = 2, 77, 4, 4, 64
    dtype = torch.bfloat16
    qkv0 = torch.randn(b * s, (h + 2 * kv) * hd, device="cuda").to(dtype)
    d_o = torch.randn(b * s, h * hd, device="cuda").to(dtype)
    args = (s, h, kv, True, True, 500.0, None)
    fwd, bwd = getattr(SDPBackend, forward_kernel), getattr(SDPBackend, backward_kernel)
    q = torch.empty(b, s, h, hd, device="cuda", dtype=dtype)
    for kernel in (fwd, bwd):
        with sdpa_kernel(kernel):
            if FA.sdpa_choice(q, q, q, True) != int(kernel):
                pytest.skip(f"{kernel} does not run these inputs on this GPU")
    with sdpa_kernel(fwd):
        qkv = qkv0.clone()
        o, lse = torch.ops.torchloom.flash_attention_core(qkv, *args)
    with sdpa_kernel(bwd):
        grads = torch.ops.torchloom.flash_attention_core_backward(d_o, qkv, o, lse, *args)

    x = qkv0.double().cpu().requires_grad_()
    qr, kr, vr = (t.transpose(1, 2) for t in x.view(b, s, h + 2 * kv, hd).split([h, kv, kv], dim=2))
    qr, kr = _rope_reference(qr, 500.0), _rope_reference(kr, 500.0)
    o_ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True).transpose(1, 2)
    (d_ref,) = torch.autograd.grad(o_ref, x, d_o.double().cpu().view(b, s, h, hd))
    assert_close(o, o_ref, name="o", rtol=5e-2, atol=5e-2)
    assert_close(torch.cat(grads, dim=1), d_ref, name="dq | dk | dv", rtol=5e-2, atol=5e-2)


def _check_core(case, backend, dtype, tol, opcheck):
    b, s, h, kv, hd, causal, rope = case
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args = (s, h, kv, causal, rope, 500.0, backend)
    qkv0 = torch.randn(b * s, (h + 2 * kv) * hd, device=dev).to(dtype)
    d_o = torch.randn(b * s, h * hd, device=dev).to(dtype)

    x = qkv0.double().cpu().requires_grad_()  # float64 truth, with autograd
    q, k, v = (t.transpose(1, 2) for t in x.view(b, s, h + 2 * kv, hd).split([h, kv, kv], dim=2))  # [B,n,S,D]
    if rope:
        q, k = _rope_reference(q, 500.0), _rope_reference(k, 500.0)
    k_rep, v_rep = (t.repeat_interleave(h // kv, dim=1) for t in (k, v))
    scores = q @ k_rep.transpose(-1, -2) / hd**0.5
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    o_ref = F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=causal).transpose(1, 2)  # [B,S,H,D]
    rotated = torch.cat([t.transpose(1, 2) for t in (q, k, v)], dim=2).reshape(b * s, -1)
    (d_ref,) = torch.autograd.grad(o_ref, x, d_o.double().cpu().view(b, s, h, hd))

    qkv = qkv0.clone()
    o, lse = torch.ops.torchloom.flash_attention_core(qkv, *args)
    assert o.shape == (b, s, h, hd) and o.is_contiguous() and lse.shape == (b, h, s) and lse.dtype == torch.float32
    assert_close(o, o_ref, name="o", **tol)
    assert_close(lse, torch.logsumexp(scores, dim=-1), name="lse", **tol)
    assert_close(qkv, rotated, name="qkv after the forward (q, k rotated; v unchanged)", **tol)
    saved = (d_o.clone(), qkv.clone(), o.clone(), lse.clone())
    grads = torch.ops.torchloom.flash_attention_core_backward(d_o, qkv, o, lse, *args)
    assert [tuple(t.shape) for t in grads] == [(b * s, n * hd) for n in (h, kv, kv)]
    assert all(t.is_contiguous() for t in grads)
    assert_close(torch.cat(grads, dim=1), d_ref, name="dq | dk | dv", **tol)
    for name, before, after in zip(("d_o", "qkv", "o", "lse"), saved, (d_o, qkv, o, lse)):
        assert torch.equal(before, after), f"the backward wrote its input {name}"
    if opcheck:  # opcheck runs each operator several times (through the interpreter on CPU): once
        torch.library.opcheck(torch.ops.torchloom.flash_attention_core.default, (qkv0.clone(), *args))
        torch.library.opcheck(torch.ops.torchloom.flash_attention_core_backward.default, (d_o, qkv, o, lse, *args))


# ----------------------------------------------------------------- mixed precision, dtypes, transforms
def _low_precision_check(got, truth, low_ref, name):
    """flash-attention's test rule: the error against the float64 truth is at most twice the error of
    the plain-PyTorch reference computed at the same low precision, plus a small floor."""
    err = (got.detach().double().cpu() - truth).abs().max().item()
    ref_err = (low_ref.detach().double().cpu() - truth).abs().max().item()
    floor = 1e-2 * truth.abs().max().item()
    assert err <= 2 * ref_err + floor, f"{name}: error {err:.3e} vs the PyTorch reference's {ref_err:.3e}"


def _truth_and_low(layer, x, g, h, kv, causal, rope, low):
    """float64 truth and the same math in PyTorch run under ``low()`` (a context) with its inputs."""
    refs = [p.detach().double().cpu().requires_grad_() for p in layer.parameters()]
    xr = x.detach().double().cpu().requires_grad_()
    y, _ = _reference(xr, refs, h, kv, causal, rope)
    truth = (y, *torch.autograd.grad(y, [xr, *refs], g.double().cpu()))
    lp = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    xl = x.detach().clone().requires_grad_()
    with low():
        yl, _ = _reference(xl, lp, h, kv, causal, rope)
    low_res = (yl, *torch.autograd.grad(yl, [xl, *lp], g.to(yl.dtype)))
    return truth, low_res


@pytest.mark.parametrize("flash", [False, True], ids=["materialised", "flash"])
def test_cpu_autocast_bfloat16_forward_and_backward(flash):
    """Under torch.autocast("cpu", bfloat16): bfloat16 output, float32 gradients for the float32
    parameters and input, within the bfloat16 tolerance of the float32 reference."""
    if flash:
        from torchloom.kernels._triton import interpreter_enabled, triton_available

        if not (triton_available() and interpreter_enabled()):
            pytest.skip("the flash path on CPU tensors needs Triton's interpreter")
    case = (2, 17, 32, 2, 1, True, True, True)
    b, s, d, h, kv, causal, rope, _ = case
    layer = _layer(case, torch.float32)
    x = torch.randn(b, s, d)
    g = torch.randn(b, s, d)
    xo = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = multi_head_attention(xo, *layer.parameters(), num_heads=h, num_kv_heads=kv, backend="triton" if flash else None)
    assert y.dtype == torch.bfloat16
    y.backward(g.to(torch.bfloat16))
    assert xo.grad.dtype == torch.float32 and all(p.grad.dtype == torch.float32 for p in layer.parameters())
    truth, low = _truth_and_low(layer, x, g, h, kv, causal, rope, lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    for name, got, t, lo in zip(["output", "grad input", *[n for n, _ in layer.named_parameters()]], (y, xo.grad, *[p.grad for p in layer.parameters()]), truth, low):
        _low_precision_check(got, t, lo, name)


def test_bfloat16_parameters():
    """A bfloat16 layer on bfloat16 input: bfloat16 output and gradients, within tolerance."""
    case = (2, 9, 16, 2, 2, True, True, True)
    b, s, d, h, kv, causal, rope, _ = case
    layer = _layer(case, torch.float32).to(torch.bfloat16)
    x = torch.randn(b, s, d).to(torch.bfloat16)
    g = torch.randn(b, s, d).to(torch.bfloat16)
    xo = x.clone().requires_grad_()
    y = layer(xo)
    y.backward(g)
    assert y.dtype == xo.grad.dtype == layer.q_weight.grad.dtype == torch.bfloat16
    truth, low = _truth_and_low(layer, x, g, h, kv, causal, rope, contextlib.nullcontext)
    for name, got, t, lo in zip(["output", "grad input", *[n for n, _ in layer.named_parameters()]], (y, xo.grad, *[p.grad for p in layer.parameters()]), truth, low):
        _low_precision_check(got, t, lo, name)


def test_dtype_mismatch_is_a_clear_type_error():
    layer = MultiHeadAttention(8, 2)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"input has dtype torch.float64 but the layer's parameters are torch.float32"):
        layer(x)
    with pytest.raises(TypeError, match=r"input has dtype torch.float64"):
        multi_head_attention(x, *layer.parameters(), num_heads=2)
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(2, 3, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="backend must be"):
        multi_head_attention(x.float(), *layer.parameters(), num_heads=2, backend="cuda")


def test_double_backward_raises_instead_of_a_silent_zero():
    layer = _layer((2, 4, 8, 2, 1, True, True, True))
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=False)
    assert gx.abs().sum() > 0
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
    params = [p.detach().clone().requires_grad_() for p in layer._params()]
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.gradgradcheck(MultiHeadAttentionFunction.apply, (x, *params, layer.spec))


def test_functional_call_and_unsupported_transforms():
    """torch.func.functional_call runs the layer on the given tensors (and differentiates to them);
    vmap, which needs setup_context, fails loudly."""
    layer = _layer((2, 5, 8, 2, 1, True, True, True))
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    new = {n: (p.detach() * 0.5).requires_grad_() for n, p in layer.named_parameters()}
    y = torch.func.functional_call(layer, new, (x,))
    y_ref, _ = _reference(x, [new[n] for n, _ in layer.named_parameters()], 2, 1, True, True)
    assert_close(y, y_ref, name="functional_call output", rtol=1e-11, atol=1e-11)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, list(new.values()), g)
    want = torch.autograd.grad(y_ref, list(new.values()), g)
    for n, a, r in zip(new, got, want):
        assert_close(a, r, name=f"functional_call grad {n}", rtol=1e-10, atol=1e-11)
    assert layer.q_weight.grad is None
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.vmap(layer)(x[:, None])
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: layer(t).sum())(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(RuntimeError):
            torch.jit.script(layer)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_autocast_flash_path(dtype):
    """CUDA autocast (the flash kernel in half precision) against the float64 truth, within twice the
    error of PyTorch's own SDPA attention under the same autocast."""
    case = (2, 65, 128, 4, 2, True, True, True)
    b, s, d, h, kv, causal, rope, _ = case
    layer = _layer(case, torch.float32).cuda()
    x = torch.randn(b, s, d, device="cuda")
    g = torch.randn(b, s, d, device="cuda")
    xo = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=dtype):
        y = layer(xo)
    assert y.dtype == dtype
    y.backward(g.to(dtype))
    assert layer.q_weight.grad.dtype == torch.float32
    truth, low = _truth_and_low(layer, x, g, h, kv, causal, rope, lambda: torch.autocast("cuda", dtype=dtype))
    for name, got, t, lo in zip(["output", "grad input", *[n for n, _ in layer.named_parameters()]], (y, xo.grad, *[p.grad for p in layer.parameters()]), truth, low):
        _low_precision_check(got, t, lo, name)
