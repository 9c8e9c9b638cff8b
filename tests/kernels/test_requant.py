"""The fused grid requantisation kernel against its torch reference (bit for bit: same draws, same
rounding), and the reference against ``torchloom.lowbit``'s encoder."""

from __future__ import annotations

import pytest
import torch

from torchloom.kernels.requant import requant_grid_, requant_grid_ref
from torchloom.lowbit import quantize, uniform
from torchloom.lowbit.rng import stream_key


def _case(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3
    edges = torch.tensor([0.5, 1.5, -0.5, -2.5, 2.5, 0.0, 7.49, -8.51])  # ties and edges on scale 1
    x[: min(n, 8)] = edges[: min(n, 8)]
    return x


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("lo,hi", [(-128, 127), (-8, 7), (-1, 1), (0, 15)])
@pytest.mark.parametrize("n", [1, 37, 1000])
def test_kernel_equals_reference(cuda_default_device, n, lo, hi, stochastic):
    x = _case(n).to(torch.get_default_device())
    a, b = stream_key(5, torch.tensor(11, device=x.device), 2)
    for scale_value, ok_value in ((1.0, True), (0.37, True), (0.37, False)):
        scale = torch.tensor(scale_value, device=x.device)
        ok = torch.tensor(ok_value, device=x.device)
        p_ref, p_k = torch.full_like(x, 9.0), torch.full_like(x, 9.0)
        b_ref, b_k = torch.empty_like(x), torch.empty_like(x)
        requant_grid_ref(x, p_ref, b_ref, scale, ok, a, b, lo, hi, stochastic)
        requant_grid_(x, p_k, b_k, scale, ok, a, b, lo, hi, stochastic, backend="triton")
        assert torch.equal(p_k.view(torch.int32), p_ref.view(torch.int32))
        assert torch.equal(b_k, p_k)


@pytest.mark.parametrize("stochastic", [False, True])
def test_reference_equals_the_lowbit_encoder(stochastic):
    x = _case(500)
    scale = torch.tensor(0.37)
    a, b = stream_key(5, 11, 2)
    p = torch.empty_like(x)
    requant_grid_ref(x, p, None, scale, torch.tensor(True), torch.tensor(a), torch.tensor(b), -8, 7, stochastic)
    u = uniform(x.numel(), 5, 11, 2) if stochastic else None
    assert torch.equal(p, quantize(x, "int4", scale, "stochastic" if stochastic else "nearest", u))
