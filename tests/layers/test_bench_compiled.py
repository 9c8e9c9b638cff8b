"""bench/bench_layers.py's "torchloom compiled vs PyTorch compiled" table stays runnable: its CPU smoke
run (tiny shapes, the ``aot_eager`` backend) prints a row per layer and dtype with torchloom's graph
breaks (0) and no recompile after the first step."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_layers.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke runs on the CPU")
def test_compiled_table_smoke(capsys):
    spec = importlib.util.spec_from_file_location("bench_layers", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    try:
        assert bench.main(["--smoke", "--compiled", "--backend", "aot_eager", "--only", "Dense",
                           "--dtypes", "float32,bfloat16", "--target", "0.002"]) == 0
    finally:
        torch._dynamo.reset()
        sys.modules.pop(spec.name, None)
    out = capsys.readouterr().out
    table = out[out.index("The table again"):]
    rows = [line for line in table.splitlines() if line.startswith("| Dense")]
    assert len(rows) == 2, table
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[12:14] == ["0", "0 / 0"], row  # graph breaks, recompiles (torchloom / PyTorch)
        assert cells[3].replace(".", "").isdigit() and cells[4].replace(".", "").isdigit(), row  # both sides timed
