"""The single-pass step guard of the CUDA backprop step: ``sgd_probe_`` (the gradients' squares and
the update's NaN/±Inf check, in one read, before the update) and the step guard's ``update_flag``.

References are independent of the code under test: ``torch.optim.SGD`` on copies says whether the
update would write a non-finite value, float64 torch gives ``Σ g²``."""

from __future__ import annotations

import math

import pytest
import torch

from torchloom.kernels._triton import interpreter_enabled, triton_available
from torchloom.kernels.sgd import sgd_probe_, sgd_update_
from torchloom.kernels.step_guard import NAN_GRAD, NAN_LOSS, NAN_WEIGHTS, NOT_RUN, OK, step_guard_

KERNEL = pytest.mark.skipif(not (triton_available() and (interpreter_enabled() or torch.cuda.is_available())), reason="needs Triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference", pytest.param("triton", marks=KERNEL)]
CONFIGS = {
    "plain": dict(),
    "weight_decay": dict(weight_decay=0.05),
    "momentum_first_step": dict(momentum=0.9, dampening=0.3),
    "momentum": dict(momentum=0.9, dampening=0.3),
    "nesterov": dict(momentum=0.8, nesterov=True, weight_decay=0.01),
    "value_clip": dict(momentum=0.5, clip_value=0.5),
}


def _torch_sgd_nonfinite(w, g, buf, lr, cfg) -> bool:
    """torch.optim.SGD's update on float64 copies (the clip applied to the gradient first): whether a
    weight or momentum value comes out NaN/±Inf in float32."""
    p = torch.nn.Parameter(w.double().clone())
    grad = g.double().clone()
    if cfg.get("clip_value", 0) > 0:
        grad = grad.clamp(-cfg["clip_value"], cfg["clip_value"])
    p.grad = grad
    torch_cfg = {k: v for k, v in cfg.items() if k != "clip_value"}
    opt = torch.optim.SGD([p], lr=lr, **torch_cfg)
    if buf is not None:
        opt.state[p]["momentum_buffer"] = buf.double().clone()
    opt.step()
    values = [p.detach().float()]
    if cfg.get("momentum", 0):
        values.append(opt.state[p]["momentum_buffer"].float())
    return not all(bool(torch.isfinite(v).all()) for v in values)


def _same_bits(a, b) -> bool:
    """Bit for bit (NaN included)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _case(n, cfg, *, poison=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g)
    buf = None if (not cfg.get("momentum") or cfg is CONFIGS["momentum_first_step"]) else torch.randn(n, generator=g)
    lr = 0.1
    if poison == "nan_grad":
        grad[n // 2] = float("nan")
    elif poison == "inf_grad":
        grad[n - 1] = float("inf")
    elif poison == "overflow":  # finite weights and gradients, an update past float32's range
        w[n // 3], grad[n // 3], lr = 3e38, -1.0, 1e38
    return w.to(DEVICE), grad.to(DEVICE), None if buf is None else buf.to(DEVICE), lr


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("poison", [None, "nan_grad", "inf_grad", "overflow"])
@pytest.mark.parametrize("n", [7, 1024, 3001])
def test_probe_squares_and_flag_match_torch_and_change_nothing(backend, name, poison, n):
    cfg = CONFIGS[name]
    w, g, buf, lr = _case(n, cfg, poison=poison)
    w0, g0, buf0 = w.clone(), g.clone(), None if buf is None else buf.clone()
    flag = torch.zeros((), dtype=torch.int32, device=DEVICE)
    partials = sgd_probe_([w], [g], [buf], flag, lr=lr, backend=backend, **cfg)
    # nothing the probe reads is written
    assert _same_bits(w, w0) and _same_bits(g, g0)
    assert buf is None or _same_bits(buf, buf0)
    expected_sq = float((g0.double() ** 2).sum())
    got_sq = float(partials.double().sum())
    if math.isfinite(expected_sq):
        assert got_sq == pytest.approx(expected_sq, rel=1e-5)
    else:
        assert not math.isfinite(got_sq)
    if poison in ("nan_grad", "inf_grad") and cfg.get("clip_value", 0) > 0:
        # a clipped NaN/±Inf gradient: what the update would write depends on the clamp's NaN rule
        # (Triton's min/max drop a NaN where torch's clamp keeps it); the step is refused either way,
        # by the non-finite sum of squares checked above (the step guard's NAN_GRAD)
        return
    assert int(flag) == int(_torch_sgd_nonfinite(w0, g0, buf0, lr, cfg)), (name, poison)
    assert int(flag) == (poison is not None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_never_lowers_the_flag_and_takes_a_device_lr(backend):
    w, g, _, _ = _case(257, CONFIGS["plain"])
    flag = torch.ones((), dtype=torch.int32, device=DEVICE)
    sgd_probe_([w], [g], None, flag, lr=torch.tensor(0.1, device=DEVICE), backend=backend)
    assert int(flag) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_flags_exactly_what_the_update_would_write(backend):
    # the probe's verdict is the update's: at the edge of float32's range, for a learning-rate sweep,
    # "flag raised" is "the update (run here on a copy) writes a non-finite weight"
    w = torch.full((64,), 3.0e38, device=DEVICE)
    g = torch.linspace(-1.0, -0.1, 64, device=DEVICE)
    seen = set()
    for lr in (1e37, 4.0e37, 4.03e37, 4.1e37, 6e37, 3e38):  # 3e38 + lr·|g| crosses float32's max for some
        flag = torch.zeros((), dtype=torch.int32, device=DEVICE)
        sgd_probe_([w], [g], None, flag, lr=lr, backend=backend)
        updated = [w.clone()]
        sgd_update_(updated, [g], None, lr=lr, backend=backend)
        assert int(flag) == int(not bool(torch.isfinite(updated[0]).all())), lr
        seen.add(int(flag))
    assert seen == {0, 1}


def test_probe_checks_its_arguments():
    w, g = torch.zeros(3), torch.zeros(3)
    with pytest.raises(ValueError, match=r"sgd_probe_: flag must be a one-element int32 tensor on cpu"):
        sgd_probe_([w], [g], None, torch.zeros(()), lr=0.1)
    with pytest.raises(ValueError, match=r"sgd_probe_: momentum=0.9 needs momentum_buffers"):
        sgd_probe_([w], [g], None, torch.zeros((), dtype=torch.int32), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"sgd_probe_: params is empty"):
        sgd_probe_([], [], None, torch.zeros((), dtype=torch.int32), lr=0.1)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=KERNEL)])
@pytest.mark.parametrize("dead", [0, 1])
@pytest.mark.parametrize("loss", [0.5, float("nan")])
@pytest.mark.parametrize("sq", [4.0, float("inf")])
@pytest.mark.parametrize("raised", [0, 1])
def test_step_guard_update_flag_turns_only_an_ok_step_into_nan_weights(backend, dead, loss, sq, raised):
    t = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt, device=DEVICE)  # noqa: E731
    dead_t, flag = t(dead, torch.int32), torch.tensor(raised, dtype=torch.int32, device=DEVICE)
    step_loss, step_status, found_inf, scale = t(-7.0), t(-7, torch.int32), t(-7.0), t(-7.0)
    step_guard_(t(loss), t(sq), dead_t, step_loss, step_status, found_inf, scale, 0.0, backend=backend, update_flag=flag)
    if dead:
        want = NOT_RUN
    elif not math.isfinite(loss):
        want = NAN_LOSS
    elif not math.isfinite(sq):
        want = NAN_GRAD
    else:
        want = NAN_WEIGHTS if raised else OK
    assert int(step_status) == want
    assert float(found_inf) == float(want != OK)
    assert float(step_loss) == (loss if want == OK else 0.0)
    assert int(flag) == 0  # zeroed for the next step's probe


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_checks_the_value_as_stored_in_float16(backend):
    # 60000 - 10·(-1000) = 70000: finite in float32, past float16's largest value (65504)
    w = torch.full((5,), 60000.0, dtype=torch.float16, device=DEVICE)
    g = torch.tensor([-1.0, -1000.0, 0.0, 1.0, 2.0], dtype=torch.float16, device=DEVICE)
    flag = torch.zeros((), dtype=torch.int32, device=DEVICE)
    sgd_probe_([w], [g], None, flag, lr=10.0, backend=backend)
    updated = [w.clone()]
    sgd_update_(updated, [g], None, lr=10.0, backend=backend)
    assert not bool(torch.isfinite(updated[0]).all())  # the update would write an Inf ...
    assert int(flag) == 1  # ... and the probe says so


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", [None, 5, 65536 + 9, 2 * 65536 + 2])  # whole blocks (unmasked) and the tail
def test_whole_blocks_and_the_tail_are_all_seen(backend, where):
    # 2·65,536 + 3 elements: two whole blocks and a masked tail, on the GPU and in the interpreter
    from torchloom.kernels.weight_guard import nonfinite_flag_

    n = 2 * 65536 + 3
    g = torch.Generator().manual_seed(4)
    w = torch.randn(n, generator=g).to(DEVICE)
    grad = torch.randn(n, generator=g).to(DEVICE)
    buf = torch.randn(n, generator=g).to(DEVICE)
    if where is not None:  # there the weight overflows: 3.3e38 + 1e19 · 1e19 > 3.4e38
        w[where], grad[where], buf[where] = 3.3e38, -1e19, 0.0  # a finite gradient, a finite square (1e38)
    flag = torch.zeros((), dtype=torch.int32, device=DEVICE)
    partials = sgd_probe_([w], [grad], [buf], flag, lr=1e19, momentum=0.9, backend=backend)
    assert float(partials.double().sum()) == pytest.approx(float((grad.double() ** 2).sum()), rel=1e-5)
    assert int(flag) == int(_torch_sgd_nonfinite(w, grad, buf, 1e19, dict(momentum=0.9))) == (where is not None)
    ones = torch.ones(n, device=DEVICE)
    if where is not None:
        ones[where] = float("nan")
    flag.zero_()
    nonfinite_flag_([ones], flag, backend=backend)
    assert int(flag) == (where is not None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", [dict(), dict(momentum=0.5, dampening=0.5), dict(momentum=0.5, nesterov=True)])
def test_a_small_step_on_the_largest_weights_stays_finite_and_a_larger_one_is_caught(backend, cfg):
    # float32's largest value plus a step: finite up to half its spacing (2^103), Inf past it. Below
    # 2^102 the kernel does not read the weights at all (a step that small cannot overflow a finite
    # weight); above, it computes them. Either way its verdict is the update's.
    big = torch.finfo(torch.float32).max
    w = torch.tensor([big, -big, big, 1.0], device=DEVICE)
    g = torch.tensor([-1.0, 1.0, 1.0, 0.5], device=DEVICE)
    seen = set()
    for lr in (1e29, 1e30, 5e30, 6e30, 1.1e31, 2e31, 1e32):
        bufs = [torch.zeros(4, device=DEVICE)] if cfg.get("momentum") else None
        flag = torch.zeros((), dtype=torch.int32, device=DEVICE)
        sgd_probe_([w], [g], bufs and [bufs[0].clone()], flag, lr=lr, backend=backend, **cfg)
        updated = [w.clone()]
        sgd_update_(updated, [g], bufs, lr=lr, backend=backend, **cfg)
        assert int(flag) == int(not bool(torch.isfinite(updated[0]).all())), lr
        seen.add(int(flag))
    assert seen == {0, 1}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lr", [0.1, 1e31])  # a small step (weights not read) and a large one (read)
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_a_weight_already_non_finite_is_not_counted_but_a_new_one_is(backend, lr, wd):
    w = torch.tensor([float("nan"), float("inf"), 3.3e38, 2.0], device=DEVICE)
    g = torch.tensor([1.0, 1.0, -1e7, -1e-3], device=DEVICE)  # lr 1e31: 3.3e38 + 1e38 overflows
    flag = torch.zeros((), dtype=torch.int32, device=DEVICE)
    sgd_probe_([w], [g], None, flag, lr=lr, weight_decay=wd, backend=backend)
    updated = [w.clone()]
    sgd_update_(updated, [g], None, lr=lr, weight_decay=wd, backend=backend)
    made = bool((~torch.isfinite(updated[0]) & torch.isfinite(w)).any())  # a finite weight became non-finite
    assert made == (lr > 1)
    assert int(flag) == int(made)


def _ptx_vector_accesses(fn, signature: dict, constexprs: dict, pointers: int) -> tuple[int, int]:
    """``(128-bit loads, 128-bit stores)`` in the PTX of ``fn`` compiled for an H100 (sm_90), its
    first ``pointers`` arguments 16-byte aligned and ``n`` of no particular divisibility."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    src = ASTSource(
        fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in range(pointers)},
    )
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    return len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx)), len(re.findall(r"st\.global(?:\.\w+)*\.v4", ptx))


def _can_compile_for_cuda() -> bool:
    if interpreter_enabled():  # the kernels are interpreted functions then: nothing to compile
        return False
    try:
        import triton.backends.nvidia  # noqa: F401 - the CUDA backend, with its ptxas
    except ImportError:
        return False
    return triton_available()


@pytest.mark.skipif(not _can_compile_for_cuda(), reason="needs Triton's CUDA backend, interpreter off")
def test_update_and_probe_compile_to_vector_accesses_whatever_n():
    # 784-4096-4096-10 has 20,037,642 weights (not a multiple of 16): a mask "offs < n" on every
    # access kept the update from vectorising; whole blocks are unmasked now
    from torchloom.kernels.sgd import _sgd_kernel, _sgd_probe_kernel

    common = {"n": "i32", "momentum": "fp32", "one_minus_dampening": "fp32", "weight_decay": "fp32", "clip_value": "fp32"}
    flags = dict(BLOCK=1024, LR_ON_DEVICE=True, HAS_CLIP=False, HAS_WD=False, HAS_MOMENTUM=False, FIRST_STEP=False, NESTEROV=False)
    ptr = "*fp32"
    sgd_sig = {"w_ptr": ptr, "g_ptr": ptr, "v_ptr": ptr, "lr": ptr, "scale_ptr": ptr, "found_inf_ptr": ptr, **common,
               **{k: "constexpr" for k in ("BLOCK", "LR_ON_DEVICE", "HAS_SCALE", "HAS_FOUND_INF", *list(flags)[2:])}}
    loads, stores = _ptx_vector_accesses(_sgd_kernel, sgd_sig, {**flags, "HAS_SCALE": False, "HAS_FOUND_INF": True}, 6)
    assert loads >= 2 and stores >= 1  # w and g read, w written, 16 bytes at a time
    probe_sig = {"partial_ptr": ptr, "flag_ptr": "*i32", "w_ptr": ptr, "g_ptr": ptr, "v_ptr": ptr, "lr": ptr, **common,
                 "safe_step": "fp32", **{k: "constexpr" for k in flags}}
    loads, _ = _ptx_vector_accesses(_sgd_probe_kernel, probe_sig, flags, 6)
    assert loads >= 1
