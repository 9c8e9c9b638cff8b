"""``mm_sum``: an input gradient fed by several projections, ``Σ a[i] @ b[i]``, against float64
products, eagerly and compiled; under ``torch.compile`` its GEMMs are traced (``mm``, then ``addmm``
with the running sum as addend: no opaque operator), and compiled equals eager in bfloat16 too."""

import dataclasses

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

from torchloom.layers.attention import MultiHeadAttention
from torchloom.layers.base import mm_sum
from torchloom.layers.swiglu import SwiGLU


def _pairs(ks, n=9, m=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(len(ks))
    return ([torch.randn(n, k, generator=g, dtype=dtype) for k in ks],
            [torch.randn(k, m, generator=g, dtype=dtype) for k in ks])


@pytest.mark.parametrize("ks", [(4,), (4, 6), (3, 3, 8)])
def test_equals_float64_sum_of_products(ks):
    a, b = _pairs(ks)
    expected = sum(x.double() @ w.double() for x, w in zip(a, b))
    got = mm_sum(a, b)
    assert got.shape == (9, 5) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert all(got.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in a + b)


@pytest.mark.parametrize("ks", [(4, 6), (3, 3, 8)])
def test_compiled_equals_float64_sum_of_products(ks):
    a, b = _pairs(ks)
    torch._dynamo.reset()
    got = torch.compile(mm_sum, backend="aot_eager", fullgraph=True)(a, b)
    expected = sum(x.double() @ w.double() for x, w in zip(a, b))
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def _backward_targets(layer, x):
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(layer, backend=aot_autograd(fw_compiler=lambda gm, _: gm.forward, bw_compiler=keep),
                             fullgraph=True)
    x = x.clone().requires_grad_()
    compiled(x).sum().backward()
    assert graphs, "no backward graph compiled"
    return {n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("make", [lambda: (MultiHeadAttention(16, 4), torch.randn(2, 5, 16)),
                                  lambda: (SwiGLU(8, 12), torch.randn(6, 8))],
                         ids=["attention", "swiglu"])
def test_compiled_backward_sums_traced_products(make):
    """The input gradient of the compiled backward: traced GEMMs (``aten.mm``, ``aten.addmm``), no
    opaque operator."""
    torch._dynamo.reset()
    layer, x = make()
    targets = _backward_targets(layer, x)
    assert {torch.ops.aten.mm.default, torch.ops.aten.addmm.default} <= targets, sorted(map(str, targets))
    assert not any(str(t).startswith("torchloom.") for t in targets), sorted(map(str, targets))


def test_compiled_bfloat16_rounds_as_eager():
    """Each product is added inside its GEMM, compiled as eagerly: bfloat16 products that nearly cancel
    give the eager sum (rounding the products first and adding them would not)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    w = torch.randn(32, 48, generator=g)
    a = [x.bfloat16(), (-x + 1e-2 * torch.randn(64, 32, generator=g)).bfloat16()]
    b = [w.bfloat16(), w.bfloat16()]
    torch._dynamo.reset()
    got = torch.compile(mm_sum, backend="aot_eager", fullgraph=True)(a, b)
    torch.testing.assert_close(got, mm_sum(a, b), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_flash_attention_backward_sums_traced_products(dtype):
    """The same on CUDA, where attention takes its flash path (the fused q|k|v projection) behind the
    opaque core operators: with the Triton kernel (``backend="triton"``). (Where PyTorch's fused kernel
    serves the core the compiled path is traced instead: tests/layers/test_compile_cuda.py.)"""
    torch._dynamo.reset()
    layer = MultiHeadAttention(64, 4, device="cuda", dtype=dtype)
    layer.spec = dataclasses.replace(layer.spec, backend="triton")
    targets = _backward_targets(layer, torch.randn(2, 33, 64, device="cuda", dtype=dtype))
    assert torch.ops.torchloom.flash_attention_core_backward.default in targets, sorted(map(str, targets))
    assert torch.ops.aten.addmm.default in targets, sorted(map(str, targets))


@pytest.mark.cuda
def test_compiled_bfloat16_rounds_as_eager_under_inductor_on_cuda():
    """The same under Inductor on CUDA: each product added inside its GEMM, so the compiled sum of two
    nearly cancelling bfloat16 products stays within a thousandth of a product of eager's (rounding
    each product first would be off by ~1/256 of one)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g)
    w = torch.randn(128, 192, generator=g)
    a = [x.bfloat16().cuda(), (-x + 1e-2 * torch.randn(256, 128, generator=g)).bfloat16().cuda()]
    b = [w.bfloat16().cuda(), w.bfloat16().cuda()]
    torch._dynamo.reset()
    got = torch.compile(mm_sum, fullgraph=True)(a, b)
    scale = (a[0].float() @ b[0].float()).abs().max().item()
    assert (got.float() - mm_sum(a, b).float()).abs().max().item() <= 1e-3 * scale
