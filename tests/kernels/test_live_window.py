"""The fused live window (kernels/live_window.py): the kernel against its torch reference (Triton's
interpreter on CPU, native on CUDA), the reference against the live loop's own serve + learn, and
the device-resident stream taking the kernel."""

import math

import pytest
import torch

from helpers import assert_close
from torchloom import Dense, Network
from torchloom.kernels._triton import triton_available
from torchloom.kernels.live_window import ACT_CODES, kernel_settings, live_window_, live_window_ref, register_elements

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def layout(widths, acts, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    parts, meta, off = [], [], 0
    for i, act in enumerate(acts):
        w = torch.randn(widths[i + 1], widths[i], generator=g) / math.sqrt(widths[i])
        parts.append(w.reshape(-1))
        bo = -1
        if bias:
            parts.append(torch.randn(widths[i + 1], generator=g) * 0.1)
            bo = off + w.numel()
        meta.append((widths[i], widths[i + 1], off, bo, ACT_CODES[act]))
        off += w.numel() + (widths[i + 1] if bias else 0)
    return torch.cat(parts), meta


def both(flat, meta, xs, ts, lr, kernel=None):
    """(reference, kernel) results: predictions, weights, statuses."""
    k, out = xs.shape[0], ts.shape[1]
    f_ref, p_ref, s_ref = flat.clone(), torch.empty(k, out), torch.zeros(k, dtype=torch.int32)
    live_window_ref(xs, ts, f_ref, meta, lr, p_ref, s_ref)
    f = flat.clone().to(DEVICE)
    p, s = torch.empty(k, out, device=DEVICE), torch.zeros(k, dtype=torch.int32, device=DEVICE)
    live_window_(xs.to(DEVICE), ts.to(DEVICE), f, meta, lr, p, s, kernel=kernel)
    return (p_ref, f_ref, s_ref), (p.cpu(), f.cpu(), s.cpu())


def samples(k, width_in, width_out, seed=1):
    g = torch.Generator().manual_seed(seed)
    xs = torch.rand(k, width_in, generator=g) * 2 - 1
    return xs, torch.nn.functional.one_hot(torch.randint(0, width_out, (k,), generator=g), width_out).float()


KERNELS = ["registers", "global"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("acts,bias", [(("tanh", "sigmoid", "linear"), True), (("relu", "tanh", "tanh"), False)])
def test_kernel_matches_reference(acts, bias, kernel):
    """Odd widths (6, 10, 20, 4: padded to powers of two), every activation, with and without biases."""
    flat, meta = layout((6, 10, 20, 4), acts, bias)
    xs, ts = samples(6, 6, 4)
    (p0, f0, s0), (p1, f1, s1) = both(flat, meta, xs, ts, 0.1, kernel)
    assert_close(p1, p0, name="predictions", rtol=1e-5, atol=1e-6)
    assert_close(f1, f0, name="weights", rtol=1e-5, atol=1e-6)
    assert s0.tolist() == s1.tolist() == [0] * 6
    assert not torch.equal(f0, flat)


def test_register_kernel_on_adaptv2s_chain():
    """Welvet adaptv2's Dense 8→32→64→64→64→32→4 (tanh, linear head): the register kernel takes it
    (its padded weights fit), and 12 samples of it match the reference."""
    flat, meta = layout((8, 32, 64, 64, 64, 32, 4), ("tanh",) * 5 + ("linear",))
    assert kernel_settings(meta) == ("registers", 8) and register_elements(meta) == 12_672 + 260  # tiles + biases
    xs, ts = samples(12, 8, 4)
    (p0, f0, s0), (p1, f1, s1) = both(flat, meta, xs, ts, 0.05)
    assert_close(p1, p0, name="predictions", rtol=1e-5, atol=1e-6)
    assert_close(f1, f0, name="weights", rtol=1e-5, atol=1e-6)
    assert s0.tolist() == s1.tolist() == [0] * 12
    wide = layout((128, 128, 128, 4), ("tanh", "tanh", "linear"))[1]  # 33k padded weights: in memory
    assert kernel_settings(wide)[0] == "global"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy overflows, on purpose here
def test_kernel_statuses_match_reference(kernel):
    """A NaN sample: status 1, nothing written, every later update of the window skipped (3); a
    rate that overflows the weights: 4; a huge input whose squared gradient norm overflows: 2."""
    flat, meta = layout((6, 10, 4), ("tanh", "linear"))
    xs, ts = samples(5, 6, 4)
    xs[2] = float("nan")
    (p0, f0, s0), (p1, f1, s1) = both(flat, meta, xs, ts, 0.05, kernel)
    assert s0.tolist() == s1.tolist() == [0, 0, 1, 3, 3]
    assert_close(f1, f0, name="weights", rtol=1e-5, atol=1e-6)
    xs, ts = samples(2, 6, 4)
    (_, f0, s0), (_, f1, s1) = both(flat, meta, xs * 100, ts, 1e38, kernel)
    assert s0.tolist() == s1.tolist() == [4, 4] and torch.equal(f1, flat)
    flat, meta = layout((6, 5, 4), ("linear", "linear"))
    (_, f0, s0), (_, f1, s1) = both(flat, meta, torch.full((1, 6), 3e18), ts[:1], 0.05, kernel)
    assert s0.tolist() == s1.tolist() == [2] and torch.equal(f1, flat)


def test_register_kernel_checks_large_gradients_in_full():
    """A weight gradient whose square passes the register kernel's quick bound (2^126 / terms) but
    whose squared norm and update are finite: the full checks run, and the update is applied as the
    reference applies it (status 0), the next sample's too."""
    flat, meta = layout((6, 5, 4), ("linear", "linear"))
    big = 2.0**126 / (register_elements(meta) + 4)
    xs, ts = samples(2, 6, 4)
    xs[0] = xs[0] * 4e9
    grads = []  # the reference's weight gradients of sample 0, from autograd
    w = [flat[m[2] : m[2] + m[0] * m[1]].view(m[1], m[0]).clone().requires_grad_() for m in meta]
    b = [flat[m[3] : m[3] + m[1]].clone().requires_grad_() for m in meta]
    out = (xs[:1] @ w[0].t() + b[0]) @ w[1].t() + b[1]
    ((out - ts[:1]) ** 2).mean().backward()
    grads = torch.cat([t.grad.reshape(-1) for t in w + b])
    assert (grads * grads).max() > big and torch.isfinite((grads * grads).sum())
    (p0, f0, s0), (p1, f1, s1) = both(flat, meta, xs, ts, 1e-22, "registers")
    assert s0.tolist() == s1.tolist() == [0, 0] and not torch.equal(f0, flat)
    assert_close(p1, p0, name="predictions", rtol=1e-5, atol=1e-6)
    assert_close(f1, f0, name="weights", rtol=1e-5, atol=1e-6)


def test_reference_is_the_live_loops_serve_then_learn():
    """The reference (the kernel's test oracle) against the live loop's serve + learn with the
    method's own step (not the lean one), sample by sample."""
    from torchloom.live import LiveTrainer

    torch.manual_seed(3)
    net = Network(Dense(6, 10, activation="tanh"), Dense(10, 8, activation="relu"), Dense(8, 4))
    live = LiveTrainer(net, method="backprop", learning_rate=0.05, lean=False)
    params = list(live.model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    meta, off = [], 0
    for layer in net.layers:
        meta.append((layer.in_features, layer.out_features, off, off + layer.weight.numel(), ACT_CODES[layer.activation.name]))
        off += layer.weight.numel() + layer.out_features
    xs, ts = samples(10, 6, 4, seed=5)
    preds, status = torch.empty(10, 4), torch.zeros(10, dtype=torch.int32)
    live_window_ref(xs, ts, flat, meta, 0.05, preds, status)
    served = []
    for i in range(10):
        p, t = live.serve(xs[i])
        served.append(p)
        live.learn(t, int(ts[i].argmax()))
    assert_close(preds, torch.cat(served), name="predictions", rtol=1e-5, atol=1e-6)
    assert_close(flat, torch.cat([p.detach().reshape(-1) for p in params]), name="weights", rtol=1e-5, atol=1e-6)


def test_device_stream_takes_the_kernel_and_equals_serve_and_learn():
    from torchloom.live import LiveTrainer

    def net():
        torch.manual_seed(4)
        return Network(Dense(6, 12, activation="tanh"), Dense(12, 4))

    xs, ts = samples(16, 6, 4, seed=7)
    labels = ts.argmax(1)
    serial = LiveTrainer(net(), method="backprop")
    preds = []
    for i in range(16):
        p, t = serial.serve(xs[i])
        preds.append(p)
        serial.learn(t, int(labels[i]))
    live = LiveTrainer(net().to(DEVICE), method="backprop")
    live.engine.kernel_backend = "triton"  # the kernel through the interpreter on the CPU
    got = [live.stream_window(xs[k : k + 8].to(DEVICE), labels[k : k + 8].to(DEVICE)).cpu().clone() for k in (0, 8)]
    assert live._stream.fused is not None and live._stream.runner is None
    assert_close(torch.cat(got), torch.cat(preds), name="stream predictions", rtol=1e-5, atol=1e-6)
    for a, b in zip(live.model.parameters(), serial.model.parameters()):
        assert_close(a.cpu(), b, name="stream weights", rtol=1e-5, atol=1e-6)
    assert live.version == 16 and live.report(window_samples=8).trained_fraction == 1.0


_COMPILE = r"""
import sys
import time
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from torchloom.kernels.live_window import _live_window_regs_kernel, kernel_settings, register_constexprs

widths, meta, off = [8, 32, 64, 64, 64, 32, 4], [], 0  # adaptv2's chain, weights then biases per layer
for i in range(6):
    meta.append((widths[i], widths[i + 1], off, off + widths[i] * widths[i + 1], 5 if i < 5 else 0))
    off += widths[i] * widths[i + 1] + widths[i + 1]
ptr = {"x_ptr": "*fp32", "t_ptr": "*fp32", "w_ptr": "*fp32", "pred_ptr": "*fp32", "status_ptr": "*i32"}
regs = {**ptr, "lr": "fp32", "K": "i32", **{name: "constexpr" for name in register_constexprs(meta, True)}}
builds = [(_live_window_regs_kernel, regs, register_constexprs(meta, train), kernel_settings(meta, "registers")[1])
          for train in (True, False)]
for fn, sig, constexprs, warps in builds:
    t0 = time.time()
    try:
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps})
    except Exception as e:
        if "ptxas" in str(e).lower():
            print("no ptxas")
            sys.exit(0)
        raise
    assert compiled.asm["cubin"]
    print(fn.__name__, constexprs["TRAIN"], f"{time.time() - t0:.1f} s")
print("compiled")
"""


def test_kernel_compiles_for_hopper():
    """The interpreter does not compile: build the register kernel's two variants for sm_90 (adaptv2's
    6 layers, 64 wide) down to a cubin, without a GPU (a process with the interpreter off), so a GPU
    run does not meet a compile error first (the global kernel, unchanged since, ran on an H200)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.compiler")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    out = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    if "no ptxas" in out.stdout:
        pytest.skip("no ptxas beside this Triton")
    assert "compiled" in out.stdout, out.stdout


def test_unknown_kernel_is_refused_before_anything_runs():
    flat, meta = layout((6, 10, 4), ("tanh", "linear"))
    xs, ts = samples(2, 6, 4)
    f = flat.clone()
    with pytest.raises(ValueError, match=r"^live_window_: kernel must be 'registers', 'global' or None, got 'fast'$"):
        live_window_(xs, ts, f, meta, 0.1, torch.empty(2, 4), torch.zeros(2, dtype=torch.int32), kernel="fast")
    assert torch.equal(f, flat)
