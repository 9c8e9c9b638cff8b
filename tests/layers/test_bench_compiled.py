"""bench/bench_layers.py's "torchloom compiled vs PyTorch compiled" table stays runnable: its CPU smoke
run (tiny shapes, the ``aot_eager`` backend) prints a row per layer and dtype with no graph break on
either side and no recompile after the first step."""

from __future__ import annotations

import importlib.util
import sys
import time
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
        assert cells[13:15] == ["0 / 0", "0 / 0"], row  # graph breaks, recompiles (torchloom / PyTorch)
        low, high = (float(q.rstrip("×")) for q in cells[6].split("–"))  # the pairs' ratio quartiles
        assert low <= high, row
        assert cells[3].replace(".", "").isdigit() and cells[4].replace(".", "").isdigit(), row  # both sides timed


def test_paired_timing_alternates_the_order_and_measures_the_ratio():
    """The pairs run A B B A, then B A A B, and so on; two steps that sleep 4 and 1 ms measure ~4×."""
    spec = importlib.util.spec_from_file_location("bench_layers_paired", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    calls = []

    def step(name, seconds):
        def run():
            calls.append(name)
            time.sleep(seconds)
        return run

    t, p, ratio, (q1, q3) = bench._paired("sleeps", step("A", 0.004), step("B", 0.001), torch.device("cpu"), 0.01)
    assert 2.0 < ratio < 6.0 and q1 <= ratio <= q3, (ratio, q1, q3)
    assert 2.0 < t / p < 6.0, (t, p)
    # One step per block here (target 0.01 s for 64 blocks of 4 ms steps); after the warm-up (3 steps of
    # A, then of B), runs of one side: A B B A | B A A B | A B B A ...
    runs = [[calls[0], 0]]
    for c in calls:
        if c == runs[-1][0]:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    assert runs[:2] == [["A", 3], ["B", 3]], runs[:2]
    assert runs[2:11] == [["A", 1], ["B", 2], ["A", 1], ["B", 1], ["A", 2], ["B", 1], ["A", 1], ["B", 2], ["A", 1]], runs[2:11]
    assert len(calls) == 6 + 4 * bench.PAIRS


def test_compiled_host_table_runs_and_counts_guards(capsys):
    """bench/bench_compiled_host.py: a row per layer with both sides timed and both guard trees found."""
    path = BENCH.parent / "bench_compiled_host.py"
    spec = importlib.util.spec_from_file_location("bench_compiled_host", path)
    bench = importlib.util.module_from_spec(spec)
    threads = torch.get_num_threads()
    try:
        spec.loader.exec_module(bench)
        assert bench.main(["--only", "Dense", "--rounds", "2", "--block", "0.002"]) == 0
    finally:
        torch.set_num_threads(threads)  # the script runs single-threaded
        torch._dynamo.reset()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| Dense")]
    assert len(rows) == 1, rows
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert float(cells[2]) > 0 and float(cells[3]) > 0 and float(cells[4].rstrip("×")) > 0, rows
    for guards in cells[6:8]:  # "leaf + accessor" counts, both sides
        leaf, nodes = (int(v) for v in guards.split(" + "))
        assert leaf > 0 and nodes > 0, rows
