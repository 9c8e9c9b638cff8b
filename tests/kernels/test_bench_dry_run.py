"""bench/bench_kernels.py stays runnable: its --dry-run (interpreter correctness checks and the whole
table pipeline at tiny sizes on CPU) passes, and bad arguments are refused."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from torchloom.kernels._triton import interpreter_enabled, triton_available

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_kernels.py"

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not (triton_available() and interpreter_enabled()),
    reason="the dry run switches the interpreter on: run it only where the suite already uses it",
)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_dry_run_checks_every_kernel_and_writes_the_table(tmp_path, capsys):
    out = tmp_path / "table.md"
    assert _bench().main(["--dry-run", "--ops", "sgd,adamw", "--out", str(out)]) == 0
    text = out.read_text()
    for name in ("mse", "crossentropy (Loom)", "cross_entropy (labels)", "cross_entropy (soft)", "grad_norm", "sgd momentum", "adamw", "rmsprop momentum"):
        assert f"PASS  {name} " in text, name
    assert "FAIL" not in text and "ERROR" not in text and "error:" not in text
    assert "| adamw    | 16K  | torch fused" in text and "| sgd      | 4K   | torchloom" in text


def test_bad_arguments_are_refused():
    bench = _bench()
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--ops", "lion"])
