"""bench/bench_methods.py stays runnable: its --dry-run (digits, 1 seed, 1 epoch, two methods) prints the
table and the targets, a loss TargetProp refuses becomes a reported row, and bad arguments are refused."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn", reason="the dry run trains on scikit-learn's digits")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_methods.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_methods", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_dry_run_prints_the_table_and_the_targets(capsys):
    assert _bench().main(["--dry-run", "--markdown"]) == 0
    out = capsys.readouterr().out
    for method, rate in (("bp-sgdm", "0.01"), ("tween", "0.03")):
        for batch in (32, 256):
            assert f"| {method} | {batch} | {rate} | cross_entropy | " in out
    assert "refused" not in out
    assert "| Tween ≥ backprop SGD+mom − 1 point | " in out


def test_the_rates_are_the_methods_documented_defaults_at_its_batch_sizes():
    """Every method runs at its documented default: the rate TargetPropConfig() / TweenConfig() choose at
    batch 32 and 256 (their default rate is None: chosen from the batch size)."""
    from torchloom import TargetPropConfig, TweenConfig

    rates = _bench().RATES
    for batch in (32, 256):
        assert rates["tp-chain"] == TargetPropConfig().rate_for(batch) == 0.1
        assert rates["tp-pure"] == TargetPropConfig(use_chain_rule=False).rate_for(batch) == 0.05
        assert rates["tween"] == TweenConfig().rate_for(batch) == 0.03


def test_a_refused_loss_is_a_row_not_a_crash(capsys):
    assert _bench().main(["--dry-run", "--methods", "tp-chain", "--loss-tp-chain", "crossentropy", "--batch-sizes", "32"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("tp-chain"))
    assert "refused: TrainingConfig: loss_type='crossentropy' cannot be used with TargetProp" in row


def test_jobs_run_rows_in_worker_processes_with_the_same_results(capsys, monkeypatch):
    """``--jobs 2`` trains the rows in two spawned workers: the same seeds give the same accuracies."""
    monkeypatch.syspath_prepend(str(BENCH.parent))  # the spawned workers import bench_methods by name
    args = ["--dry-run", "--markdown", "--methods", "bp-sgdm", "--batch-sizes", "32,256", "--threads", "1"]
    assert _bench().main(args) == 0
    one = [line.split("|")[5] for line in capsys.readouterr().out.splitlines() if line.startswith("| bp-sgdm")]
    assert _bench().main([*args, "--jobs", "2"]) == 0
    two = [line.split("|")[5] for line in capsys.readouterr().out.splitlines() if line.startswith("| bp-sgdm")]
    assert len(one) == 2 and one == two


def test_a_methods_schedule_and_clip_reach_its_row(capsys):
    """``--schedule-tp-pure cosine --clip-tp-pure 1``: the row names them, and the run's rate is the cosine
    from the given rate to 0 over the epoch budget, once per epoch, with the clip on the averaged step."""
    bench = _bench()
    args = ["--dry-run", "--markdown", "--methods", "tp-pure", "--batch-sizes", "32", "--lr-tp-pure", "0.3",
            "--schedule-tp-pure", "cosine", "--clip-tp-pure", "1"]
    assert bench.main(args) == 0
    assert "| tp-pure | 32 | 0.3 cosine, clip 1 | cross_entropy | " in capsys.readouterr().out
    fields = bench.schedule_fields("cosine", 0.3, 10, 1.0)
    assert fields["scheduler_interval"] == "epoch" and fields["gradient_clip"] == 1.0
    for epoch in range(10):
        assert fields["scheduler"](epoch) == pytest.approx(0.15 * (1 + math.cos(math.pi * epoch / 10)), rel=1e-12)
    assert bench.schedule_fields("constant", 0.3, 10) == {}


@pytest.mark.parametrize("args", [["--methods", "lion"], ["--datasets", "cifar"], ["--seeds", "0"], ["--batch-sizes", "0"], ["--jobs", "0"],
                                  ["--clip-tp-pure", "-1"], ["--clip-tp-pure", "nan"], ["--schedule-tp-pure", "linear"]])
def test_bad_arguments_are_refused(args):
    with pytest.raises(SystemExit):
        _bench().main(["--dry-run", *args])
