"""bench/bench_layers.py's "torchloom compiled vs PyTorch compiled" table stays runnable: its CPU smoke
run (tiny shapes, the ``aot_eager`` backend) prints a row per layer and dtype with no graph break on
either side and no recompile after the first step."""

from __future__ import annotations

import importlib.util
import math
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
        assert cells[15:17] == ["0 / 0", "0 / 0"], row  # graph breaks, recompiles (torchloom / PyTorch)
        low, high = (float(q.rstrip("×")) for q in cells[6].split("–"))  # the pairs' ratio quartiles
        assert low <= high, row
        low, high = (float(q.rstrip("×")) for q in cells[7].split("–"))  # the median's 95 % interval
        assert low <= float(cells[5].rstrip("×")) <= high, row
        control, interval = cells[8].split(" [")  # PyTorch against a second copy of itself
        low, high = (float(q.rstrip("×]")) for q in interval.split("–"))
        assert low <= float(control.rstrip("×")) <= high, row
        assert cells[-1].startswith(("time ✓", "time =", "time ✗")), row
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

    timed = bench._paired("sleeps", step("A", 0.004), step("B", 0.001), torch.device("cpu"), 0.01)
    assert 2.0 < timed.ratio < 6.0 and timed.q1 <= timed.ratio <= timed.q3, timed
    assert timed.low <= timed.ratio <= timed.high and timed.low > 1.0, timed  # A is slower at 95 %
    assert bench.time_verdict(timed).startswith("time ✗"), timed
    assert 2.0 < timed.ours / timed.theirs < 6.0, timed
    # One step per block here (target 0.01 s for 128 blocks of 4 ms steps); after the warm-up (3 steps of
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
    """bench/bench_compiled_host.py: a row per layer with both sides timed, the median inside its interval,
    and both guard trees found."""
    path = BENCH.parent / "bench_compiled_host.py"
    spec = importlib.util.spec_from_file_location("bench_compiled_host", path)
    bench = importlib.util.module_from_spec(spec)
    threads = torch.get_num_threads()
    try:
        spec.loader.exec_module(bench)
        assert bench.main(["--only", "Dense", "--rounds", "6", "--block", "0.002"]) == 0
    finally:
        torch.set_num_threads(threads)  # the script runs single-threaded
        torch._dynamo.reset()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| Dense")]
    assert len(rows) == 1, rows
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert float(cells[2]) > 0 and float(cells[3]) > 0 and float(cells[4].rstrip("×")) > 0, rows
    low, high = (float(q.rstrip("×")) for q in cells[6].split("–"))  # the median's 95 % interval
    assert low <= float(cells[4].rstrip("×")) <= high, rows
    for guards in cells[7:9]:  # "leaf + accessor" counts, both sides
        leaf, nodes = (int(v) for v in guards.split(" + "))
        assert leaf > 0 and nodes > 0, rows


def _bench():
    spec = importlib.util.spec_from_file_location("bench_layers_interval", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize("n", [6, 16, 20, 31, 32, 48])
def test_median_interval_is_the_sign_test_interval(n):
    """The order statistics k and n + 1 − k, k from SciPy's binomial distribution (an independent reference):
    the largest k with P(Binomial(n, ½) ≤ k − 1) ≤ 2.5 %."""
    binom = pytest.importorskip("scipy.stats").binom
    k = max(j for j in range(1, n // 2 + 1) if binom.cdf(j - 1, n, 0.5) <= 0.025)
    values = [float(v) for v in torch.randperm(n) + 1]  # 1 … n, shuffled
    assert _bench().median_interval(values) == (float(k), float(n + 1 - k))


def test_median_interval_covers_the_median_at_least_95_percent_of_the_time():
    """Drawn 4,000 times from a skewed distribution (exponential, median ln 2), the interval of 32 values
    holds the true median in ≥ 95 % of draws (the sign test's interval at n = 32 is 98 %), and misses on
    both sides."""
    bench = _bench()
    g = torch.Generator().manual_seed(0)
    draws = torch.empty(4000, 32).exponential_(generator=g).tolist()
    true = math.log(2)
    below = above = 0
    for values in draws:
        low, high = bench.median_interval(values)
        below += high < true
        above += low > true
    assert (below + above) / len(draws) <= 0.05, (below, above)
    assert below > 0 and above > 0, (below, above)


def test_time_verdict_reads_the_ratio_and_its_interval():
    bench = _bench()
    P = bench.Paired
    assert bench.time_verdict(P(1, 1, 0.99, 0.97, 1.02, 0.98, 1.01)) == "time ✓"
    assert bench.time_verdict(P(1, 1, 1.01, 0.97, 1.04, 0.99, 1.03)).startswith("time =")
    assert bench.time_verdict(P(1, 1, 1.03, 1.01, 1.05, 1.005, 1.04)).startswith("time ✗")
    assert bench.time_verdict(bench._NAN_PAIRED) == "time —"
    nan = float("nan")
    assert bench.time_verdict(P(1, 1, 1.01, 0.97, 1.04, nan, nan)).startswith("time — (too few pairs")


def test_median_interval_of_too_few_values_is_none():
    """Below 6 values no pair of order statistics covers the median with 95 %: nan, not (min, max)."""
    bench = _bench()
    for values in ([], [1.0], [1.0, 2.0, 3.0, 4.0, 5.0]):
        low, high = bench.median_interval(values)
        assert math.isnan(low) and math.isnan(high), values
