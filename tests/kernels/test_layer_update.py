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


@pytest.mark.parametrize("overflow", [False, True])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_momentum_update_with_the_guards_copy_and_check(cuda_default_device, overflow, backend):
    """``backup``/``flag``: the old values land in the backup, the update is the plain one, and the
    flag rises exactly when a new value is NaN/±Inf (here: c·g overflows float32 in one segment);
    the weight guard's restore then brings back the old values."""
    from torchloom.kernels.weight_guard import restore_if_flagged_

    g = torch.Generator(device="cpu").manual_seed(3)
    dev = torch.get_default_device()
    sizes = [300, 5, 1030]
    n = sum(sizes)
    p0, v0, gr = (torch.randn(n, generator=g, device="cpu").to(dev) for _ in range(3))
    bounds = [0, 300, 305, n]
    a = torch.full((3,), 0.9, dtype=torch.float64, device=dev)
    c = torch.tensor([0.1, 1e39 if overflow else 0.2, -0.3], dtype=torch.float64, device=dev)
    apply = torch.ones(3, dtype=torch.int8, device=dev)
    plain_p, plain_v = p0.clone(), v0.clone()
    momentum_update_flat_(plain_p, plain_v, gr, bounds, a, c, apply, backend="reference")
    p, v = p0.clone(), v0.clone()
    bp, bv = torch.full_like(p, 7.0), torch.full_like(v, 7.0)
    flag = torch.zeros((), dtype=torch.int32, device=dev)
    momentum_update_flat_(p, v, gr, bounds, a, c, apply, backend=backend, backup=(bp, bv), flag=flag)
    assert torch.equal(bp, p0) and torch.equal(bv, v0)
    if not overflow:  # (past float32's range the kernel's float64 coefficients and the reference round differently)
        torch.testing.assert_close(p, plain_p, rtol=1e-6, atol=1e-6)
    assert int(flag) == int(overflow) == int(not (torch.isfinite(plain_p).all() and torch.isfinite(plain_v).all()))
    status = torch.zeros((), dtype=torch.int32, device=dev)
    restore_if_flagged_([p, v], [bp, bv], flag, status)
    if overflow:
        assert torch.equal(p, p0) and torch.equal(v, v0) and int(status) == 4
    else:
        assert int(status) == 0


def test_momentum_update_backup_needs_a_flag_and_the_right_size():
    z = torch.zeros(4)
    with pytest.raises(ValueError, match="go together"):
        momentum_update_flat_(z, z, z, [0, 4], torch.ones(1), torch.ones(1), torch.ones(1), backup=(z, z))
    with pytest.raises(ValueError, match="hold 4 elements"):
        momentum_update_flat_(z, z, z, [0, 4], torch.ones(1), torch.ones(1), torch.ones(1), backup=(torch.zeros(3), z),
                              flag=torch.zeros((), dtype=torch.int32))
