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
    the first run's timeline with the batches' conversion in it, and the run still trains."""
    import os
    import subprocess

    script = BENCH.parent / "profile_start.py"
    env = {**os.environ, "PYTHONPATH": str(BENCH.parents[1]), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, str(script), "--method", "tween", "--batch", "64", "--samples", "256", "--epochs", "2", "--phases"],
        capture_output=True, text=True, timeout=300, env=env, check=True,
    ).stdout
    assert "start ms" in out and "(the run ends)" in out
    assert "BatchSource.__init__" in out and "Trainer._get_ready" in out
    losses = [float(v) for v in out.split("losses ")[1].splitlines()[0].split(", ")]
    assert len(losses) == 2 and all(v == v for v in losses)
    assert "first launches:" in out  # the launch table (Triton traced)
    quiet = subprocess.run(
        [sys.executable, str(script), "--method", "tween", "--batch", "64", "--samples", "256", "--epochs", "2", "--phases",
         "--no-launch-table"],
        capture_output=True, text=True, timeout=300, env=env, check=True,
    ).stdout
    assert "(the run ends)" in quiet and "first launches:" not in quiet
