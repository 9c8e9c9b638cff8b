"""bench/bench_trainers.py stays runnable: its --dry-run (the whole pipeline at toy sizes on the CPU)
prints both tables with every method."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_trainers.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU check; on a GPU run the benchmark itself")
def test_dry_run_prints_both_tables(capsys):
    spec = importlib.util.spec_from_file_location("bench_trainers", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for method in ("backprop", "tp chain", "tp pure", "tween"):
        assert f"| 4 | {method} |" in out
    assert "| 32 | backprop |" in out and "| 32 | tween |" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU check; on a GPU run the benchmark itself")
def test_dry_run_times_the_feedback_rules_steps(capsys):
    spec = importlib.util.spec_from_file_location("bench_trainers", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.main(["--dry-run", "--steps-only", "--methods", "dfa,fast proxy"]) == 0
    out = capsys.readouterr().out
    for method in ("backprop", "dfa", "fast proxy"):
        assert f"| 4 | {method} |" in out


def test_profile_start_phases_runs_and_times_the_start():
    """bench/profile_start.py --phases (in a process of its own: it wraps torchloom's functions) prints
    the first run's timeline with the batches' conversion in it, and the run still trains; with
    --no-launch-table, without the launch table. (The two processes run side by side: each is seconds
    of Python and torch start, and they share nothing.)"""
    import os
    import subprocess
    import time

    script = BENCH.parent / "profile_start.py"
    env = {**os.environ, "PYTHONPATH": str(BENCH.parents[1]), "CUDA_VISIBLE_DEVICES": ""}
    args = [sys.executable, str(script), "--method", "tween", "--batch", "64", "--samples", "256", "--epochs", "2", "--phases"]
    procs = [subprocess.Popen([*args, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for extra in ([], ["--no-launch-table"])]
    deadline = time.monotonic() + 300  # for both: they run side by side
    try:
        (out, err), (quiet, quiet_err) = (p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == 0, err[-3000:]
    assert procs[1].returncode == 0, quiet_err[-3000:]
    assert "start ms" in out and "(the run ends)" in out
    assert "BatchSource.__init__" in out and "Trainer._get_ready" in out
    losses = [float(v) for v in out.split("losses ")[1].splitlines()[0].split(", ")]
    assert len(losses) == 2 and all(v == v for v in losses)
    assert "first launches:" in out  # the launch table (Triton traced)
    assert "(the run ends)" in quiet and "first launches:" not in quiet


def test_whole_runs_prime_every_contender_before_the_timed_runs(monkeypatch, tmp_path):
    """The priming the dry run leaves out (each child is a Python start: seconds): every contender first
    runs once, untimed, for one epoch over two batches plus the ragged last batch, with the caches
    warm (no ``cold`` caches of its own), for every batch size before any timed run; then the timed
    runs, the contenders taking turns. The children are stood in for (the dry run starts real ones)."""
    import itertools
    import os
    import subprocess
    import tempfile

    spec = importlib.util.spec_from_file_location("bench_trainers", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    calls = []

    class Child:
        pid = returncode = 0

        def __init__(self, cmd, env, **kwargs):
            at = cmd.index("--one-run")
            calls.append((*cmd[at + 1 : at + 5], env.get("TORCHINDUCTOR_CACHE_DIR") != os.environ.get("TORCHINDUCTOR_CACHE_DIR")))

        def communicate(self, timeout):
            return "0.5\n", ""

    monkeypatch.setattr(subprocess, "Popen", Child)
    monkeypatch.setattr(os, "killpg", lambda pid, sig: None)
    names = itertools.count()
    monkeypatch.setattr(tempfile, "mkdtemp", lambda prefix="": str(tmp_path / f"{prefix}{next(names)}"))
    rows = module.whole_runs((32, 100), torch.device("cpu"), n_samples=250, epochs=3, methods=("backprop", "tween"), cold=True)
    contenders = ("eager", "compile", "backprop", "tween")
    priming = [(c, str(b), str(2 * b + 250 % b), "1", False) for b in (32, 100) for c in contenders]
    timed = [(c, str(b), "250", "3", True) for b in (32, 100) for c in contenders]
    assert calls == priming + timed
    assert [(r[0], r[1]) for r in rows] == [(32, "backprop"), (32, "tween"), (100, "backprop"), (100, "tween")]
    calls.clear()
    module.whole_runs((32,), torch.device("cpu"), n_samples=250, epochs=3, methods=("tween",), prime=False)
    assert calls == [("eager", "32", "250", "3", False), ("compile", "32", "250", "3", False), ("tween", "32", "250", "3", False)]
