"""Softmax kernels (forward and backward) against their PyTorch reference, through Triton's
interpreter on CPU (``TRITON_INTERPRET=1``, set by conftest) and natively on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from torchloom.kernels import softmax as K

pytestmark = pytest.mark.usefixtures("cuda_default_device")


# Odd row lengths around powers of two, a single column, several leading dims.
SHAPES = [(1, 1), (3, 7), (5, 255), (2, 257), (2, 3, 1000)]


def _ids(s):
    return "x".join(map(str, s))


def _within_torch_error(got, torch_lowp, truth, name):
    """Kernel error at low precision is at most 2× PyTorch's own error there (plus float32 eps)."""
    err = (got.double() - truth).abs().max().item()
    ref_err = (torch_lowp.double() - truth).abs().max().item()
    assert err <= 2 * ref_err + 1e-6, f"{name}: kernel error {err:.3e} > 2 × torch error {ref_err:.3e}"


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_kernels_match_reference_float32(shape, temperature):
    x = torch.randn(*shape) * 4
    g = torch.randn(*shape)
    p = K.softmax(x, temperature, backend="triton")
    assert_close(p, F.softmax(x.double() / temperature, dim=-1), name="p", rtol=1e-5, atol=1e-7)
    assert_close(p, K.softmax_ref(x, temperature), name="p vs ref", rtol=1e-5, atol=1e-7)
    dx = K.softmax_backward(g, p, temperature, backend="triton")
    assert_close(dx, K.softmax_backward_ref(g, p, temperature), name="dx", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [37, 100])
def test_chunked_rows(n):
    """Rows longer than one block (forced to 16 here) take the two-sweep path; a row that starts
    with a masked (−inf) prefix longer than a block stays finite."""
    x = torch.randn(4, n) * 3
    x[1, :20] = float("-inf")
    g = torch.randn(4, n)
    p = K._launch_softmax(x, 0.8, block=16)
    assert_close(p, K.softmax_ref(x, 0.8), name="p", rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(p[1, :20]) == 0
    dx = K._launch_softmax_backward(g, p, 0.8, block=16)
    assert_close(dx, K.softmax_backward_ref(g, p, 0.8), name="dx", rtol=1e-5, atol=1e-6)


def test_bfloat16_within_twice_torch_error():
    x = torch.randn(6, 257) * 3
    g = torch.randn(6, 257)
    truth = F.softmax(x.double() / 0.7, dim=-1)
    xb = x.bfloat16()
    p = K.softmax(xb, 0.7, backend="triton")
    assert p.dtype == torch.bfloat16
    _within_torch_error(p, F.softmax(xb / 0.7, dim=-1), truth, "p")
    dx_truth = K.softmax_backward_ref(g.double(), truth, 0.7)
    pb = truth.bfloat16()
    dx = K.softmax_backward(g.bfloat16(), pb, 0.7, backend="triton")
    gb = g.bfloat16()
    torch_dx = pb * (gb - (gb * pb).sum(-1, keepdim=True)) / 0.7  # eager bf16 arithmetic
    _within_torch_error(dx, torch_dx, dx_truth, "dx")


def test_dispatch():
    """CPU tensors take the reference unless Triton is asked for; float64 is not a kernel dtype."""
    x = torch.randn(3, 5, dtype=torch.float64)
    assert torch.equal(K.softmax(x, 0.5), K.softmax_ref(x, 0.5))
    assert torch.equal(K.softmax(x.float(), backend="reference"), K.softmax_ref(x.float()))
    with pytest.raises(ValueError, match="float64"):
        K.softmax(x, backend="triton")
    with pytest.raises(ValueError, match="backend must be one of"):
        K.softmax(x, backend="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(1, 1), (4096, 1000), (3, 8193), (2, 70001)], ids=_ids)
def test_native_cuda(shape):
    x = torch.randn(*shape, device="cuda") * 4
    g = torch.randn(*shape, device="cuda")
    p = K.softmax(x, 0.7)
    assert_close(p, K.softmax_ref(x, 0.7), name="p", rtol=1e-5, atol=1e-7)
    dx = K.softmax_backward(g, p, 0.7)
    assert_close(dx, K.softmax_backward_ref(g, p, 0.7), name="dx", rtol=1e-4, atol=1e-6)
    pb = K.softmax(x.bfloat16(), 0.7)
    _within_torch_error(pb, F.softmax(x.bfloat16() / 0.7, dim=-1), F.softmax(x.double() / 0.7, dim=-1), "p bf16")
