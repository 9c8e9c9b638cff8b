"""Counter-based draws: an independent pure-Python lowbias32 (plain multiplication mod 2^32), the
same bits on every call, device and step form, and uniform."""

from __future__ import annotations

import pytest
import torch

from torchloom.lowbit.rng import stream_key, uniform, uniform_bits

M = 0xFFFFFFFF


def _mix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M
    x ^= x >> 15
    x = (x * 0x846CA68B) & M
    return x ^ (x >> 16)


def _draw(seed: int, step: int, index: int, i: int) -> int:
    k = _mix(_mix((seed & M) ^ 0x9E3779B9) ^ (seed >> 32))
    k = _mix((step & M) ^ k)
    k = _mix(((step >> 32) & M) ^ k)
    a = _mix(k ^ (index & M))
    b = _mix(a ^ 0x85EBCA6B)
    h = _mix(((i & M) + a) & M)
    return _mix(h ^ b ^ (i >> 32)) >> 8


def test_bits_equal_a_pure_python_reference():
    got = uniform_bits(50, seed=2 ** 40 + 5, step=123456, index=7).tolist()
    assert got == [_draw(2 ** 40 + 5, 123456, 7, i) for i in range(50)]


def test_same_bits_every_call_and_for_a_device_step_counter():
    a = uniform_bits(1000, 3, 9, 2)
    assert torch.equal(a, uniform_bits(1000, 3, 9, 2))
    assert stream_key(3, torch.tensor(9), 2)[0].item() == stream_key(3, 9, 2)[0]
    assert torch.equal(uniform_bits(10, 3, 9, 2), a[:10])  # a draw depends on its position only
    for other in (uniform_bits(1000, 4, 9, 2), uniform_bits(1000, 3, 10, 2), uniform_bits(1000, 3, 9, 3)):
        assert (other != a).float().mean() > 0.99


def test_uniform_mean_and_histogram():
    u = uniform(1_000_000, 0, 0, 0)
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.double().mean()) - 0.5) < 3 * (1 / 12 / 1e6) ** 0.5
    counts = torch.histc(u, bins=64, min=0, max=1)
    chi2 = float(((counts - 1e6 / 64) ** 2 / (1e6 / 64)).sum())
    assert chi2 < 120  # 63 degrees of freedom: p < 1e-5 above this


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_same_bits_on_gpu():
    assert torch.equal(uniform_bits(4097, 1, 2, 3, "cuda").cpu(), uniform_bits(4097, 1, 2, 3))
