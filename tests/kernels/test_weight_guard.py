"""The weight check after an update (kernels/weight_guard.py): the Triton kernels (through the
interpreter on CPU, natively on CUDA) against the torch-op reference, on odd sizes and every kind of
non-finite value, several tensors at once."""

import pytest
import torch

from torchloom.kernels.weight_guard import NAN_WEIGHTS, nonfinite_flag_, restore_if_flagged_

SIZES = [1, 255, 257, 4099]


def _run(backend, live, backup, status0):
    live = [t.clone() for t in live]
    flag = torch.zeros((), dtype=torch.int32, device=live[0].device)
    status = torch.tensor(status0, dtype=torch.int32, device=live[0].device)
    nonfinite_flag_(live, flag, backend=backend)
    restore_if_flagged_(live, backup, flag, status, backend=backend)
    return live, int(flag), int(status)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("status0", [0, 2])
def test_kernel_matches_reference(cuda_default_device, n, bad, status0):
    g = torch.Generator(device="cpu").manual_seed(n)
    live = [torch.randn(n, generator=g, device="cpu").to(torch.get_default_device()), torch.randn(3 * n + 1, generator=g, device="cpu").to(torch.get_default_device())]
    backup = [torch.randn_like(t) for t in live]
    if bad is not None:
        live[1][(7 * n) % live[1].numel()] = bad
    got = _run("triton", live, backup, status0)
    want = _run("reference", live, backup, status0)
    assert got[1] == want[1] == (bad is not None)
    assert got[2] == want[2] == (NAN_WEIGHTS if bad is not None and status0 == 0 else status0)
    for a, b, orig, bk in zip(got[0], want[0], live, backup):
        assert torch.equal(a, b)
        assert torch.equal(a, bk if bad is not None else orig)


def test_flag_is_never_lowered():
    flag = torch.ones((), dtype=torch.int32)
    nonfinite_flag_([torch.zeros(5)], flag, backend="reference")
    assert int(flag) == 1


def test_update_guard_restores_memory_seen_through_new_view_objects():
    """A flat buffer's view is a new object at every call: the guard must treat it as the memory it
    saved (restore it), never as state the update created (which it would zero)."""
    from torchloom.engine.guards import UpdateGuard

    buf = torch.randn(10)
    before = buf.clone()
    guard = UpdateGuard(lambda: [buf[:]])
    guard.save()
    buf[3] = float("inf")
    flag = guard.restore_if_nonfinite_(torch.zeros((), dtype=torch.int32))
    assert int(flag) == 1 and torch.equal(buf, before)
    guard.save()
    buf[5] = float("nan")
    assert not guard.check_or_restore() and torch.equal(buf, before)
