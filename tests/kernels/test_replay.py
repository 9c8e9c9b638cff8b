"""``kernels._replay``: an opaque recurrent operator's call recorded once and replayed for later calls
with the same key (allocations, fills, copies and kernel launches on the new addresses, without its
Python). Each replayed result is compared bitwise with the operator's Python run on the same inputs,
on new values every call (a replay that reused a stale buffer or address would fail). On CPU the
kernels run through Triton's interpreter and a replay passes them views; on CUDA it passes addresses
to the kept compiled kernels (``_launch``)."""

from __future__ import annotations

import pytest
import torch

import importlib

from torchloom.kernels import _launch, _replay
from torchloom.kernels import recurrent as K

R = importlib.import_module("torchloom.layers.rnn")  # the module (the package exports its ``rnn`` function)

pytestmark = pytest.mark.usefixtures("cuda_default_device")

B, T, I, H = 3, 5, 7, 16
BACKEND = None if torch.cuda.is_available() else "triton"  # CPU: the interpreter, asked for


@pytest.fixture
def fp32_matmul_products(monkeypatch):
    """The products through ``fp32_matmul`` (replayable: kernel launches), as on a GPU where PyTorch's
    RNN and cuBLAS switches disagree (the default); cuBLAS products are not replayed."""
    monkeypatch.setattr(K, "gemm_precision", lambda a, b, backend: "ieee")


def _weights(dtype=torch.float32):
    w_ih, w_hh, b = torch.randn(H, I) * 0.4, torch.randn(H, H) * 0.3, torch.randn(H) * 0.3
    return w_ih.to(dtype), w_hh.to(dtype), b.to(dtype)


def _equal(got, want):
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    return len(got) == len(want) and all(g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w)
                                         for g, w in zip(got, want))


def _counts():
    return _replay.program_count()


def _grads_on_kernels(g_pre, x, hidden, w_ih):
    """The backward's products on ``fp32_matmul``'s kernels (asked for on CPU, where the operator's
    ``_recurrent_grads_eager``, which runs as ``backend=None``, multiplies with PyTorch)."""
    return R.recurrent_grads(g_pre, x, hidden, w_ih, True, True, BACKEND)


def _count_python(monkeypatch, *names) -> dict:
    """Wrap ``K.<name>`` (an operator's Python, looked up when the operator runs) to count its runs."""
    counts = dict.fromkeys(names, 0)
    for name in names:
        fn = getattr(K, name)

        def counted(*args, _fn=fn, _name=name):
            counts[_name] += 1
            return _fn(*args)

        monkeypatch.setattr(K, name, counted)
    return counts


def test_rnn_operators_replay_bitwise(fp32_matmul_products, monkeypatch):
    w_ih, w_hh, b = _weights()
    direct = K.rnn_projected_forward, K._rnn_loop_backward
    runs = _count_python(monkeypatch, "rnn_projected_forward", "_rnn_loop_backward")
    before = _counts()
    outputs = []
    for call in range(3):  # record, then replay twice, each on new values
        x = torch.randn(B, T, I)
        x2, gy = x.view(B * T, I), torch.randn(B, T, H)
        pre, hidden = K._rnn_forward_eager(x2, w_ih.t(), b, w_hh, B, T, BACKEND)
        assert _equal((pre, hidden), direct[0](x2, w_ih.t(), b, w_hh, B, T, BACKEND))
        g_pre = K._rnn_loop_backward_eager(gy, w_hh, hidden, BACKEND)
        assert _equal(g_pre, direct[1](gy, w_hh, hidden, BACKEND))
        for has_bias, needs_input_grad in ((True, True), (False, False)):  # absent results: empty tensors
            got = R._recurrent_grads_eager(g_pre, x, hidden, w_ih, has_bias, needs_input_grad)
            assert _equal(got, R._recurrent_grads_tensors(g_pre, x, hidden, w_ih, has_bias, needs_input_grad))
        got = _replay.run(("test-grads",), _grads_on_kernels, (g_pre, x, hidden, w_ih))
        assert _equal(got, _grads_on_kernels(g_pre, x, hidden, w_ih))
        outputs.append((pre, hidden, g_pre))
    assert runs == {"rnn_projected_forward": 1, "_rnn_loop_backward": 1}  # recorded once, then replayed
    replayable, unreplayable = (a - b_ for a, b_ in zip(_counts(), before))
    # forward, backward loop and the kernels' products; the operator's products on CPU are PyTorch's
    assert (replayable, unreplayable) == ((5, 0) if torch.cuda.is_available() else (3, 2))
    # every call's results are its own tensors, never an earlier call's buffers
    ptrs = [t.data_ptr() for out in outputs for t in out]
    assert len(set(ptrs)) == len(ptrs)


@pytest.mark.parametrize("contiguous", [True, False], ids=["proj", "strided-proj"])
def test_lstm_operators_replay_bitwise(contiguous, monkeypatch):
    """The LSTM's loops, whose forward writes the pre-activations into ``proj`` (an input): in place,
    or, for a strided ``proj``, into a contiguous copy written back (a clone and a ``copy_``)."""
    w_hh = torch.randn(4 * H, H) * 0.3
    direct = K._lstm_loop, K._lstm_loop_backward
    runs = _count_python(monkeypatch, "_lstm_loop", "_lstm_loop_backward")
    for call in range(3):
        proj = torch.randn(B, T, 4 * H) if contiguous else torch.randn(T, B, 4 * H).transpose(0, 1)
        expected_pre = proj.clone()
        cell_want, hidden_want = direct[0](expected_pre, w_hh, BACKEND)
        cell, hidden = K._lstm_loop_eager(proj, w_hh, BACKEND)  # writes the pre-activations into proj
        assert _equal((proj, cell, hidden), (expected_pre, cell_want, hidden_want))
        gy = torch.randn(B, T, H)
        assert _equal(K._lstm_loop_backward_eager(gy, proj, cell, w_hh, BACKEND), direct[1](gy, proj, cell, w_hh, BACKEND))
    assert runs == {"_lstm_loop": 1, "_lstm_loop_backward": 1}


def test_results_nothing_recorded_wrote_are_not_replayed():
    """A result written other than by a recorded launch, fill or copy (as a Triton launch not made
    through ``_launch.launch`` would be on a GPU, where it runs no ATen operator: emulated by a write
    through NumPy) is never replayed: the Python runs every call."""
    calls = []

    def body(x):
        calls.append(1)
        out = torch.empty(4, device="cpu")  # NumPy: host tensors, whatever the default device
        out.numpy()[:] = x.numpy() * 2  # no ATen operator: unseen by the recording
        return out

    for value in (1.0, 2.0, 3.0):
        x = torch.full((4,), value, device="cpu")
        assert torch.equal(_replay.run(("test-unseen-write",), body, (x,)), x * 2)
    assert len(calls) == 3


def test_layouts_and_switches_are_part_of_the_key(fp32_matmul_products):
    """A misaligned input view and a changed switch record their own programs, and replay correctly."""
    w_ih, w_hh, b = _weights()
    x2 = torch.randn(B * T, I)
    K._rnn_forward_eager(x2, w_ih.t(), b, w_hh, B, T, BACKEND)
    n = _counts()[0]
    for call in range(2):
        shifted = torch.randn(B * T * I + 1)[1:].view(B * T, I)  # 4 bytes past an allocation's start
        assert _equal(K._rnn_forward_eager(shifted, w_ih.t(), b, w_hh, B, T, BACKEND),
                      K.rnn_projected_forward(shifted, w_ih.t(), b, w_hh, B, T, BACKEND))
    assert _counts()[0] == n + 1
    key = K.replay_key("rnn_forward")
    old = K._RNN_W_RESIDENT
    K._RNN_W_RESIDENT = not old
    try:
        assert K.replay_key("rnn_forward") != key
    finally:
        K._RNN_W_RESIDENT = old
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = not previous
    try:
        assert K.replay_key("rnn_forward") != key
    finally:
        torch.backends.cudnn.allow_tf32 = previous


def test_flipping_a_switch_records_anew(fp32_matmul_products, monkeypatch):
    """A switch the operator's Python reads (here whether the loop holds W_hh's slice in registers,
    a constant of its kernel) changes the key: after a flip the Python runs and records again (one
    recording per setting, counted), and each call equals its own Python run, flipping back and forth.
    (The two settings give equal bits here, so the count is what catches a switch missing from the key.)"""
    w_ih, w_hh, b = _weights()
    direct = K.rnn_projected_forward
    runs = _count_python(monkeypatch, "rnn_projected_forward")
    before = _counts()
    for resident in (True, False, True, False, True):
        monkeypatch.setattr(K, "_RNN_W_RESIDENT", resident)
        x2 = torch.randn(B * T, I)
        assert _equal(K._rnn_forward_eager(x2, w_ih.t(), b, w_hh, B, T, BACKEND), direct(x2, w_ih.t(), b, w_hh, B, T, BACKEND))
    assert runs == {"rnn_projected_forward": 2}  # one recording per setting
    assert tuple(a - b_ for a, b_ in zip(_counts(), before)) == (2, 0)


def test_calls_it_cannot_reproduce_run_their_python():
    """A call running an operator the recording does not reproduce (a cuBLAS product), or reading a
    tensor it neither received nor allocated, is never replayed: its Python runs every time."""
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    calls = []

    def product(a, b):
        calls.append(1)
        return torch.mm(a, b)

    for _ in range(3):
        a = torch.randn(4, 3)
        assert torch.equal(_replay.run(("test-mm",), product, (a, b)), torch.mm(a, b))
    assert len(calls) == 3 and _counts()[1] >= 1
    held = torch.randn(6)
    calls.clear()

    def fill_from_held(x):
        calls.append(1)
        out = torch.empty(6)
        out.copy_(held)  # a tensor from outside the call
        return out

    for value in (1.0, 2.0):
        held.fill_(value)
        assert torch.equal(_replay.run(("test-held",), fill_from_held, (torch.zeros(1),)), held)
    assert len(calls) == 2


def test_fills_and_copies_replay():
    """Allocations, a ``fill_`` through another dtype's view and a copy from an input, replayed."""
    calls = []

    def body(x):
        calls.append(1)
        flags = torch.empty(2, 3)
        flags.view(torch.int32).fill_(7)
        out = x.t().contiguous()  # a clone of a transposed input
        return flags, out

    for _ in range(3):
        x = torch.randn(3, 4)
        flags, out = _replay.run(("test-fill-copy",), body, (x,))
        assert torch.equal(flags.view(torch.int32), torch.full((2, 3), 7, dtype=torch.int32))
        assert torch.equal(out, x.t()) and out.is_contiguous()
    assert len(calls) == 1


def test_cpu_calls_never_ask_for_a_cuda_device(monkeypatch):
    """Where kept kernels are launched directly (a GPU's Triton), a call on CPU tensors still records
    and replays: the current CUDA device joins the key only for calls on CUDA tensors (asking for it
    fails on a machine without a GPU)."""
    monkeypatch.setattr(_launch, "_usable", [True])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("asked for the CUDA device"))
    calls = []

    def body(x):
        calls.append(1)
        return torch.empty(3, device="cpu").fill_(2.0), x.clone()

    for value in (1.0, 5.0):  # CPU tensors, also on a GPU machine (this module's default device is CUDA there)
        x = torch.full((2,), value, device="cpu")
        filled, copied = _replay.run(("test-cpu-key",), body, (x,))
        assert torch.equal(filled, torch.full((3,), 2.0, device="cpu")) and torch.equal(copied, x)
    assert len(calls) == 1


@pytest.mark.cuda
def test_kept_kernel_launch_matches_triton_launch():
    """``_launch.launch``'s direct launch of a kept compiled kernel gives Triton's own launch's bits,
    and a misaligned operand gets its own compiled kernel."""
    from torchloom.kernels import fp32_matmul as F

    assert _launch.direct_launch_usable()
    a, b = torch.randn(300, 70, device="cuda"), torch.randn(70, 50, device="cuda")
    shifted = torch.randn(300 * 70 + 1, device="cuda")[1:].view(300, 70)
    _launch.clear_cache()
    sizes = []
    for operand in (a, shifted, a):
        _launch._usable[:] = [False]
        try:
            want = F.mm(operand, b, "ieee")  # Triton's own launch
        finally:
            _launch._usable[:] = [True]
        first, second = F.mm(operand, b, "ieee"), F.mm(operand, b, "ieee")  # the second: a kept kernel
        assert torch.equal(first, want) and torch.equal(second, want)
        sizes.append(len(_launch._cache))
    assert sizes[1] > sizes[0] and sizes[2] == sizes[1]  # the misaligned operand: its own kernel; then none new


@pytest.mark.cuda
def test_compiled_rnn_step_replays_its_operators(monkeypatch):
    """A compiled float32 RNN step on the opaque operators (``USE_INDUCTOR_LOOPS`` off: the benchmark's
    A/B; by default Inductor launches the kernels itself), with PyTorch's default switches (cuDNN's
    RNN in TF32, cuBLAS exact: the products on ``fp32_matmul``): its three operator calls are
    recorded replayable (a compiled backward's operator sees ``reshape`` undecomposed), and every
    step's gradients equal the eager layer's, which runs the same kernels through its Python."""
    from torchloom.kernels import recurrent as K
    from torchloom.layers.rnn import RNN

    monkeypatch.setattr(K, "USE_INDUCTOR_LOOPS", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    torch._dynamo.reset()
    layer = RNN(32, 64).cuda()
    compiled = torch.compile(layer, fullgraph=True)
    before = _counts()
    for step in range(3):
        x = torch.randn(8, 16, 32, device="cuda", requires_grad=True)
        gy = torch.randn(8, 16, 64, device="cuda")
        grads = []
        for fn in (compiled, layer):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            fn(x).backward(gy)
            grads.append([x.grad, *(p.grad for p in layer.parameters())])
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert tuple(a - b for a, b in zip(_counts(), before)) == (3, 0)


def test_the_key_follows_fp32_matmuls_rounding_switch(monkeypatch):
    """``fp32_matmul._ROUND`` (a benchmark's A/B switch) is read when the key is built: a program
    recorded with one setting is not replayed under the other."""
    from torchloom.kernels import fp32_matmul

    key = K.replay_key("recurrent_grads")
    monkeypatch.setattr(fp32_matmul, "_ROUND", not fp32_matmul._ROUND)
    assert K.replay_key("recurrent_grads") != key
