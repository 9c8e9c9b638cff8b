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
