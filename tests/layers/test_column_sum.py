"""``column_sum``: the bias gradients' row sum, against float64 ``sum(0)``; on CUDA without the
scratch memory that PyTorch's ``sum(0)`` stages."""

import pytest
import torch

from torchloom.layers.base import column_sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_equals_sum(dtype):
    t = torch.randn(37, 5, dtype=dtype, generator=torch.Generator().manual_seed(0))
    assert torch.equal(column_sum(t), t.sum(0))
    out = torch.empty(5, dtype=dtype)
    assert column_sum(t, out=out) is out and torch.equal(out, t.sum(0))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float64, 1e-12)])
def test_cuda_matches_float64_sum_without_scratch(dtype, tol):
    t = torch.randn(8192, 3072, device="cuda", dtype=dtype)
    expected = t.double().sum(0)
    column_sum(t)  # cuBLAS' workspace exists before the measured call
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = column_sum(t)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert got.dtype == dtype and got.shape == (3072,)
    scale = expected.abs().max().item()
    assert (got.double() - expected).abs().max().item() <= tol * max(scale, 1.0)
    assert extra < 1 << 20, f"column_sum used {extra / 2**20:.1f} MB of scratch"
    out = torch.empty(3072, device="cuda", dtype=dtype)
    assert column_sum(t, out=out) is out and torch.equal(out, got)


@pytest.mark.cuda
def test_cuda_under_autocast_keeps_the_input_dtype():
    t = torch.randn(64, 8, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = column_sum(t)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, t.sum(0))


@pytest.mark.cuda
def test_cuda_out_of_another_dtype_and_strided_input_fall_back_to_sum():
    t = torch.randn(512, 64, device="cuda")
    out = torch.empty(64, device="cuda", dtype=torch.float64)
    assert column_sum(t, out=out) is out
    torch.testing.assert_close(out, t.double().sum(0), rtol=1e-5, atol=1e-4)
    wide = torch.randn(512, 128, device="cuda")
    strided = wide[:, ::2]  # neither dimension contiguous: a GEMV would copy it first
    torch.testing.assert_close(column_sum(strided), strided.sum(0), rtol=0, atol=0)
    transposed = torch.randn(64, 512, device="cuda").t()  # columns contiguous: the GEMV reads it in place
    torch.testing.assert_close(column_sum(transposed), transposed.double().sum(0).float(), rtol=1e-5, atol=1e-4)
