"""Flash-style attention kernels (forward, dQ/dK/dV backward) against torch autograd through a
materialised softmax in float64, through Triton's interpreter on CPU (``TRITON_INTERPRET=1``) and
natively on CUDA: causal and not, ragged sequence lengths, head sizes 16/32 (and a non-power of two),
grouped-query heads, strided (non-contiguous) inputs, half precision."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import assert_close
from torchloom.kernels import flash_attention as K

pytestmark = pytest.mark.usefixtures("cuda_default_device")


def _truth(q, k, v, do, causal):
    """float64 autograd through softmax(q kᵀ/√D) v with explicit repeat of the kv heads."""
    b, s, h, d = q.shape
    g = h // k.shape[2]
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    qh = qr.permute(0, 2, 1, 3)
    kh = kr.permute(0, 2, 1, 3).repeat_interleave(g, 1)
    vh = vr.permute(0, 2, 1, 3).repeat_interleave(g, 1)
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    o = (torch.softmax(scores, -1) @ vh).permute(0, 2, 1, 3)
    dq, dk, dv = torch.autograd.grad(o, (qr, kr, vr), do.double())
    return o.detach(), lse.detach(), dq, dk, dv


def _inputs(b, s, h, kv, d, dtype=torch.float32):
    q = torch.randn(b, s, h, d) * 1.5
    k = torch.randn(b, s, kv, d) * 1.5
    v = torch.randn(b, s, kv, d)
    do = torch.randn(b, s, h, d)
    return [t.to(dtype) for t in (q, k, v, do)]


CASES = [  # (B, S, H, KV, D)
    (1, 1, 2, 2, 16),
    (2, 17, 2, 1, 16),
    (1, 65, 4, 2, 32),
    (1, 33, 3, 3, 24),  # head size not a power of two
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", CASES, ids=lambda c: "x".join(map(str, c)))
def test_forward_and_every_gradient_float32(shape, causal):
    q, k, v, do = _inputs(*shape)
    o, lse = K.flash_attention(q, k, v, causal, backend="triton")
    o64, lse64, dq64, dk64, dv64 = _truth(q, k, v, do, causal)
    tol = dict(rtol=1e-4, atol=2e-5)
    assert_close(o, o64, name="o", **tol)
    assert_close(lse, lse64, name="lse", **tol)
    dq, dk, dv = K.flash_attention_backward(do, q, k, v, o, lse, causal, backend="triton")
    assert_close(dq, dq64, name="dq", rtol=1e-4, atol=1e-4)
    assert_close(dk, dk64, name="dk (summed over the group)", rtol=1e-4, atol=1e-4)
    assert_close(dv, dv64, name="dv (summed over the group)", rtol=1e-4, atol=1e-4)
    # The materialised reference (what the CPU runs) agrees too.
    o_ref, lse_ref = K.flash_attention(q, k, v, causal, backend="reference")
    assert_close(o_ref, o64, name="o reference", **tol)
    for name, got, want in zip(("dq", "dk", "dv"), K.flash_attention_backward(do, q, k, v, o_ref, lse_ref, causal, backend="reference"), (dq64, dk64, dv64)):
        assert_close(got, want, name=f"{name} reference", rtol=1e-4, atol=1e-4)


def test_strided_views_of_a_projection():
    """q, k, v as head views of one [B, S, (H+2K)·D] projection output (no copies) and a strided dO."""
    b, s, h, kv, d = 2, 19, 4, 2, 16
    qkv = torch.randn(b, s, (h + 2 * kv) * d)
    q = qkv[..., : h * d].view(b, s, h, d)
    k = qkv[..., h * d : (h + kv) * d].view(b, s, kv, d)
    v = qkv[..., (h + kv) * d :].view(b, s, kv, d)
    do = torch.randn(b, s, h, 2 * d)[..., ::2]  # unit stride required on D: made contiguous inside
    do = do.contiguous()
    o, lse = K.flash_attention(q, k, v, True, backend="triton")
    o64, _, dq64, dk64, dv64 = _truth(q, k, v, do, True)
    assert_close(o, o64, name="o", rtol=1e-4, atol=2e-5)
    for name, got, want in zip(("dq", "dk", "dv"), K.flash_attention_backward(do, q, k, v, o, lse, True, backend="triton"), (dq64, dk64, dv64)):
        assert_close(got, want, name=name, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_within_dtype_tolerance(dtype):
    """Half inputs: the error against float64 truth stays within a few units of the dtype's rounding
    (scaled like flash-attention's tests: at most 3× the error of the float32-math reference on the
    same half inputs, plus one rounding step)."""
    q, k, v, do = _inputs(1, 33, 2, 1, 32, dtype)
    o, lse = K.flash_attention(q, k, v, True, backend="triton")
    dq, dk, dv = K.flash_attention_backward(do, q, k, v, o, lse, True, backend="triton")
    truth = _truth(q, k, v, do, True)
    o_ref, _ = K.attention_ref(q, k, v, True, 1 / math.sqrt(32))
    refs = (o_ref, *K._backward_ref(do, q, k, v, True, 1 / math.sqrt(32)))
    eps = torch.finfo(dtype).eps
    for name, got, ref, want in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), refs, (truth[0], *truth[2:])):
        assert got.dtype == dtype, name
        err = (got.double() - want).abs().max().item()
        ref_err = (ref.double() - want).abs().max().item()
        assert err <= 3 * ref_err + eps * want.abs().max().item(), f"{name}: error {err:.3e} vs reference's {ref_err:.3e}"


def test_bad_shapes_are_refused():
    q = torch.randn(1, 4, 3, 16)
    kv = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        K.flash_attention(q, kv, kv, True, backend="triton")
    big = torch.randn(1, 4, 1, 160)
    with pytest.raises(ValueError, match="head_dim must be <= 128"):
        K.flash_attention(big, big, big, True, backend="triton")


@pytest.mark.parametrize("inverse", [False, True], ids=["rotate", "inverse"])
def test_rope_kernel_in_place_on_a_strided_view(inverse):
    """The in-place RoPE kernel on the q|k part of a fused projection equals the PyTorch reference,
    leaves the rest untouched, and the inverse undoes the rotation."""
    b, s, nq, nv, d = 2, 7, 3, 2, 16
    buf = torch.randn(b, s, nq + nv, d)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angle.cos().float(), angle.sin().float()
    got, want = buf.clone(), buf.clone()
    K.rope_(got[:, :, :nq], cos, sin, inverse, backend="triton")
    K.rope_ref_(want[:, :, :nq], cos, sin, inverse)
    assert_close(got, want, name="rotated", rtol=1e-6, atol=1e-6)
    assert torch.equal(got[:, :, nq:], buf[:, :, nq:])
    K.rope_(got[:, :, :nq], cos, sin, not inverse, backend="triton")
    assert_close(got, buf, name="round trip", rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_rope_out_of_place_from_a_separate_tensor(backend):
    """``rope_(dst, ..., src=src)`` rotates ``src`` (its own strides) into a strided view ``dst`` in one
    pass: ``dst`` equals the in-place rotation of a copy of ``src``, ``src`` and the rest of the buffer
    stay as they were; a ``src`` of another shape is a ValueError."""
    b, s, nq, nv, d = 2, 7, 3, 2, 16
    buf = torch.randn(b, s, nq + nv, d)
    src = torch.randn(b, nq, s, d).transpose(1, 2)  # [B, S, nq, D], not contiguous
    angle = torch.arange(s, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angle.cos().float(), angle.sin().float()
    before_src, before_buf = src.clone(), buf.clone()
    K.rope_(buf[:, :, :nq], cos, sin, True, backend=backend, src=src)
    want = K.rope_ref_(src.clone(), cos, sin, True)
    assert_close(buf[:, :, :nq], want, name="rotated into dst", rtol=1e-6, atol=1e-6)
    assert torch.equal(src, before_src) and torch.equal(buf[:, :, nq:], before_buf[:, :, nq:])
    with pytest.raises(ValueError, match="src must match"):
        K.rope_(buf[:, :, :nq], cos, sin, True, backend=backend, src=src[:, :, :2])
    with pytest.raises(ValueError, match="must not share memory"):
        K.rope_(buf[:, :, :nq], cos, sin, True, backend=backend, src=buf[:, :, nv:])


def test_pytorchs_fused_attention_operators_take_the_arguments_passed(monkeypatch):
    """The private ATen operators behind ``sdpa_forward`` / ``sdpa_backward`` (and the chooser) take, in
    the installed torch, exactly the arguments torchloom passes them; an operator of another signature
    (an older or newer torch) is reported as not matching, and ``sdpa_choice`` then leaves the core to
    the Triton kernel. On CPU tensors there is no fused kernel to choose."""
    for choice in (0, K.SDPA_FLASH, K.SDPA_EFFICIENT, K.SDPA_CUDNN):
        assert K.sdpa_ops_match(choice), choice
    changed = {**K._SDPA_SCHEMAS, K.SDPA_CUDNN: {"_scaled_dot_product_cudnn_attention": "query key value dropout_p"}}
    monkeypatch.setattr(K, "_SDPA_SCHEMAS", changed)
    K.sdpa_ops_match.cache_clear()
    try:
        assert not K.sdpa_ops_match(K.SDPA_CUDNN)
        assert K.sdpa_ops_match(K.SDPA_FLASH)
        missing = {**K._SDPA_SCHEMAS, K.SDPA_FLASH: {"_no_such_attention_operator": "query"}}
        monkeypatch.setattr(K, "_SDPA_SCHEMAS", missing)
        K.sdpa_ops_match.cache_clear()
        assert not K.sdpa_ops_match(K.SDPA_FLASH)
    finally:
        K.sdpa_ops_match.cache_clear()
    q = torch.randn(1, 4, 2, 16, device="cpu")
    assert K.sdpa_choice(q, q, q, True) is None


def test_fused_kernels_log_sum_exp_shapes_and_the_chooser_inputs():
    """``_raw_lse_shape`` (from each operator's meta kernel): FlashAttention-2 ``[1, 1, S]``, the
    memory-efficient kernel S padded to a multiple of 32, cuDNN ``[1, 1, S, 1]``; ``_as_trained`` hands
    the chooser the same data requiring grad (left as it is where that is refused)."""
    assert K._raw_lse_shape(K.SDPA_FLASH, 77) == (1, 1, 77)
    assert K._raw_lse_shape(K.SDPA_EFFICIENT, 77) == (1, 1, 96)
    assert K._raw_lse_shape(K.SDPA_EFFICIENT, 64) == (1, 1, 64)
    assert K._raw_lse_shape(K.SDPA_CUDNN, 77) == (1, 1, 77, 1)
    t = torch.randn(2, 3, device="cpu")
    trained = K._as_trained(t)
    assert trained.requires_grad and not t.requires_grad and trained.data_ptr() == t.data_ptr()
    with torch.inference_mode():
        inf = torch.randn(2, 3, device="cpu")
    assert K._as_trained(inf) is inf  # an inference tensor outside inference mode: refused, left as it is
