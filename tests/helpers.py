"""Shared test helpers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Independent references for the activations of SPEC §2: torch's own functions.
ACTIVATION_REFERENCE = {
    "relu": torch.relu,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.01),
    "relu2": lambda x: torch.relu(x) ** 2,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="none"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "linear": lambda x: x.clone(),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, name: str, rtol: float, atol: float) -> None:
    """``torch.testing.assert_close`` whose message names the tensor and the first mismatching index."""
    actual = torch.as_tensor(actual)
    expected = torch.as_tensor(expected)
    assert actual.shape == expected.shape, f"{name}: shape {list(actual.shape)} != expected {list(expected.shape)}"
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    bad = ~torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=False)
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{a.numel()} elements differ (rtol={rtol}, atol={atol}); first at "
            f"index {idx}: got {a[idx].item()!r}, expected {e[idx].item()!r}; max abs diff "
            f"{(a - e).abs().max().item():.3e}"
        )


def recurrent_truth(module_cls, x: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, b, g: torch.Tensor):
    """``module_cls`` (``nn.RNN`` / ``nn.LSTM``) in float64 with these weights (``bias_hh`` = 0) and
    autograd: the output ``[B, T, H]`` and the gradients of ``(output · g).sum()`` for the input,
    ``W_ih``, ``W_hh`` and the bias (when there is one)."""
    I, H = x.shape[-1], w_hh.shape[1]
    ref = module_cls(I, H, bias=b is not None, batch_first=True, dtype=torch.float64, device=x.device)
    with torch.no_grad():
        ref.weight_ih_l0.copy_(w_ih)
        ref.weight_hh_l0.copy_(w_hh)
        if b is not None:
            ref.bias_ih_l0.copy_(b)
            ref.bias_hh_l0.zero_()
    xr = x.double().requires_grad_()
    y, _ = ref(xr)
    params = [ref.weight_ih_l0, ref.weight_hh_l0] + ([ref.bias_ih_l0] if b is not None else [])
    return y.detach(), torch.autograd.grad(y, [xr, *params], g.double())


def fresh_interpreter_output(code: str, timeout_s: float = 120) -> str:
    """The last line ``code`` prints, run in a fresh Python interpreter that imports what this one does
    (for process-wide settings a test must not leave behind); its exit status must be 0."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a test's process group)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, tmp: str, world: int, scenarios, pg_timeout_s: float | None) -> None:
    """One spawned rank of ``spawn_ranks``: a gloo group on 127.0.0.1, ``scenarios(rank, tmp)``, a
    barrier (every rank done before any tears down: gloo aborts a peer mid-receive), and the result (or
    ``{"error": traceback}``) saved to ``tmp/rank{rank}.pt``."""
    import datetime
    import os
    import traceback

    import torch.distributed as dist

    torch.set_num_threads(1)
    kw = {} if pg_timeout_s is None else {"timeout": datetime.timedelta(seconds=pg_timeout_s)}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **kw)
    try:
        result = scenarios(rank, tmp)
        dist.barrier()
    except Exception:
        result = {"error": traceback.format_exc()}
    finally:
        torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
        dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown: gloo's C++ destructors sometimes aborted a finished rank's exit


def spawn_ranks(scenarios, world: int, tmp: str, timeout_s: float, pg_timeout_s: float | None = None) -> list:
    """Run ``scenarios(rank, tmp)`` (a module-level function) in ``world`` spawned processes, one
    gloo process group on a free port (``pg_timeout_s``: its collectives' timeout), wait at most
    ``timeout_s`` (then kill what is left and raise ``TimeoutError``), and return what each rank's
    ``scenarios`` returned; a rank that raised fails the test with its traceback."""
    import os
    import time

    import torch.multiprocessing as mp

    args = (free_port(), str(tmp), world, scenarios, pg_timeout_s)
    ctx = mp.start_processes(_rank_main, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {world} ranks did not finish in {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = [torch.load(os.path.join(str(tmp), f"rank{r}.pt"), weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    return results


def op_names():
    """A ``TorchDispatchMode`` that records the name of every aten op run inside it (``.names``): what a
    piece of code launches, counted without a GPU. ``with op_names() as ops: ...; ops.names``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpNames(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    return OpNames()


def refuse_loop_launches(monkeypatch, module, launcher: str) -> list:
    """Make ``module.<launcher>`` (a persistent loop kernel's launcher) fail as CUDA refusing the
    cooperative grid, with a fresh record of failed shapes; returns the list its calls are counted in."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("Triton Error [CUDA]: too many blocks in cooperative launch")

    monkeypatch.setattr(module, launcher, refuse)
    monkeypatch.setattr(module, "_failed", set())
    return calls
