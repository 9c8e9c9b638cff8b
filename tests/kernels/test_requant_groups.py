"""The fused low-bit update of all grid groups (``kernels/requant_groups.py``): the two kernels
against their torch reference, bit for bit, and the reference against ``torchloom.lowbit``'s own
functions (``scale_for``, ``uniform``, ``quantize``) as the engine's torch path uses them."""

from __future__ import annotations

import pytest
import torch

from torchloom.kernels.requant_groups import MODE_CLIP, MODE_MAX, MODE_MEAN, grid_layout, requant_groups_, requant_groups_ref
from torchloom.lowbit import quantize, scale_for, uniform
from torchloom.lowbit.codec import _CLIP_RATIOS

RATIOS = torch.tensor(_CLIP_RATIOS)
# int8 over two parameters (one of a prime size), int4 with the clipping search on every 2nd value
# (a sample of 50 of 131 values: stride 131 // 50), ternary (mean scale) over two parameters, uint4 with a fixed scale
SPECS = [
    dict(numels=[300, 7], indices=[0, 1], lo=-128, hi=127, qmax=127, mode=MODE_MAX, fixed=False),
    dict(numels=[131], indices=[2], lo=-8, hi=7, qmax=7, mode=MODE_CLIP, fixed=False, sample=50),
    dict(numels=[64, 5], indices=[3, 5], lo=-1, hi=1, qmax=1, mode=MODE_MEAN, fixed=False),
    dict(numels=[40], indices=[6], lo=0, hi=15, qmax=15, mode=MODE_CLIP, fixed=True, sample=4096),
]
DTYPES = ["int8", "int4", "ternary", "uint4"]


def _buffers(n, seed, dyadic=True):
    """Master, parameters, "before" and scales; dyadic values (multiples of 1/64 below 4), whose
    sums are exact in any order, so the kernels' block sums equal torch's bit for bit."""
    g = torch.Generator().manual_seed(seed)
    if dyadic:
        m, p, b = (torch.randint(-256, 256, (n,), generator=g, device="cpu") / 64.0 for _ in range(3))
    else:
        m, p, b = (torch.randn(n, generator=g, device="cpu") for _ in range(3))
    return m, p, b, torch.tensor([0.5, 0.25, 0.125, 0.0625], device="cpu")


def _run(fn, layout, bufs, master, step, status, stochastic, advance, **kw):
    m, p, b, s = (t.clone().to(torch.get_default_device()) for t in bufs)
    step = torch.tensor(step, device=p.device)
    st = None if status is None else torch.tensor(status, dtype=torch.int32, device=p.device)
    fn(layout, m if master else None, p, b, s, step, st, stochastic, advance, **kw)
    return m.cpu(), p.cpu(), b.cpu(), s.cpu(), int(step)


@pytest.mark.parametrize("stochastic,master,status,advance", [
    (False, True, None, False), (True, True, None, False), (True, True, 0, True), (False, False, 0, True),
    (True, True, 2, True), (True, False, 3, True),
])
def test_kernels_equal_the_reference_bit_for_bit(cuda_default_device, stochastic, master, status, advance):
    dev = torch.get_default_device()
    bufs = _buffers(sum(sum(s["numels"]) for s in SPECS), seed=status or 0)
    ref = _run(requant_groups_ref, grid_layout(SPECS, 5, RATIOS, dev, block=32), bufs, master, 11, status, stochastic, advance)
    ker = _run(requant_groups_, grid_layout(SPECS, 5, RATIOS, dev, block=32), bufs, master, 11, status, stochastic, advance,
               backend="triton")
    for name, a, b in zip("MPBS", ref[:4], ker[:4]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name
    assert ref[4] == ker[4] == (11 + (status != 3) if advance else 11)
    if status not in (None, 0):  # a refused step: master, parameters (B := P) and scales as they were
        assert torch.equal(ker[2], bufs[1]) and torch.equal(ker[3], bufs[3])
        assert torch.equal(ker[0], bufs[0])
    else:
        assert not torch.equal(ker[3], bufs[3][:4]) and not torch.equal(ker[2], bufs[1])


def test_kernels_match_the_reference_on_random_values(cuda_default_device):
    """Non-dyadic values: the mean scale's sum and the clipping errors are summed in another order,
    so only float32 rounding of those sums may differ."""
    dev = torch.get_default_device()
    bufs = _buffers(sum(sum(s["numels"]) for s in SPECS), seed=4, dyadic=False)
    ref = _run(requant_groups_ref, grid_layout(SPECS, 5, RATIOS, dev), bufs, True, 7, 0, True, True)
    ker = _run(requant_groups_, grid_layout(SPECS, 5, RATIOS, dev), bufs, True, 7, 0, True, True, backend="triton")
    torch.testing.assert_close(ker[3], ref[3], rtol=1e-6, atol=0)
    assert torch.equal(ker[0], ref[0])
    assert (ker[2] != ref[2]).float().mean() < 0.01


@pytest.mark.parametrize("stochastic", [False, True])
def test_reference_equals_the_lowbit_functions(stochastic, monkeypatch):
    """Group by group, what ``LowBitWeights``' torch path computes: the master takes P − B, the scale
    is ``scale_for`` of the group's master, the draws ``uniform(numel, seed, step, index)``."""
    monkeypatch.setattr("torchloom.lowbit.codec._CLIP_SAMPLE", 50)  # the int4 group's sample
    bufs = _buffers(sum(sum(s["numels"]) for s in SPECS), seed=2)
    layout = grid_layout(SPECS, 5, RATIOS, "cpu")
    m, _, b, s, _ = _run(requant_groups_ref, layout, bufs, True, 11, None, stochastic, False)
    want_m = bufs[0] + (bufs[1] - bufs[2])
    assert torch.equal(m, want_m)
    for gi, (spec, grp, dtype) in enumerate(zip(SPECS, layout.groups, DTYPES)):
        x = want_m[grp["start"]: grp["start"] + grp["n"]]
        scale = bufs[3][gi] if spec["fixed"] else scale_for(x, dtype)
        assert torch.equal(s[gi], scale), dtype
        for off, numel, index in grp["params"]:
            u = uniform(numel, 5, 11, index) if stochastic else None
            want = quantize(want_m[off:off + numel], dtype, scale, "stochastic" if stochastic else "nearest", u)
            assert torch.equal(b[off:off + numel].view(torch.int32), want.view(torch.int32)), (dtype, index)
