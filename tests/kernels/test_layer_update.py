"""The fused pieces of TargetProp's / Tween's device steps (kernels/layer_update.py): the Triton
kernels (interpreter on CPU, native on CUDA) against independent torch computations."""

import pytest
import torch

from torchloom.kernels.layer_update import momentum_update_flat_, pair_stats


@pytest.mark.parametrize("n,n_extra", [(1, 0), (255, 255), (257, 100), (4099, 5000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pair_stats(cuda_default_device, n, n_extra, dtype):
    g = torch.Generator(device="cpu").manual_seed(n)
    dev = torch.get_default_device()
    f = torch.randn(n, generator=g, dtype=dtype, device="cpu").to(dev)
    t = torch.randn(n, generator=g, dtype=dtype, device="cpu").to(dev)
    e = torch.randn(n_extra, generator=g, dtype=dtype, device="cpu").to(dev) if n_extra else None
    got = pair_stats(f, t, e, backend="triton").double().cpu()
    f64, t64 = f.double().cpu(), t.double().cpu()
    want = torch.tensor([(f64 * t64).sum(), (f64 * f64).sum(), (t64 * t64).sum(), ((f64 - t64) ** 2).sum(),
                         (e.double().cpu() ** 2).sum() if e is not None else 0.0], dtype=torch.float64, device="cpu")
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * n)


@pytest.mark.parametrize("sizes", [[5], [3, 1, 300], [257, 0, 31, 1000]])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_momentum_update_flat(cuda_default_device, sizes, backend):
    g = torch.Generator(device="cpu").manual_seed(sum(sizes))
    dev = torch.get_default_device()
    n = sum(sizes)
    p0, v0, gr = (torch.randn(n, generator=g, device="cpu").to(dev) for _ in range(3))
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    L = len(sizes)
    a = torch.rand(L, generator=g, dtype=torch.float64, device="cpu").to(dev)
    c = torch.randn(L, generator=g, dtype=torch.float64, device="cpu").to(dev)
    apply = torch.tensor([i % 2 == 0 for i in range(L)], device=dev)
    p, v = p0.clone(), v0.clone()
    momentum_update_flat_(p, v, gr, bounds, a, c, apply, backend=backend)
    for layer in range(L):  # independent per-segment computation
        lo, hi = bounds[layer], bounds[layer + 1]
        if apply[layer]:
            want_v = (a[layer] * v0[lo:hi].double() + c[layer] * gr[lo:hi].double()).float()
            want_p = p0[lo:hi] + want_v
        else:
            want_v, want_p = v0[lo:hi], p0[lo:hi]
        torch.testing.assert_close(v[lo:hi], want_v, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(p[lo:hi], want_p, rtol=1e-6, atol=1e-6)


def test_momentum_update_rejects_mismatched_buffers():
    with pytest.raises(ValueError, match="must hold the 5 elements"):
        momentum_update_flat_(torch.zeros(4), torch.zeros(4), torch.zeros(4), [0, 5], torch.ones(1), torch.ones(1), torch.ones(1))
