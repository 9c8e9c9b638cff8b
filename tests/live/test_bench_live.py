"""bench/bench_live.py stays runnable with tiny budgets, and builds Welvet's adaptv2 network."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_live.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_live", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_adaptv2_network_and_stream_follow_welvet():
    bench = _bench()
    gen = torch.Generator().manual_seed(1)
    task = bench.Adaptv2Task(gen)
    net = bench.dense_net(task.widths, gen, "cpu")
    shapes = [tuple(p.shape) for p in net.parameters()]
    assert shapes == [(32, 8), (32,), (64, 32), (64,), (64, 64), (64,), (64, 64), (64,), (32, 64), (32,), (4, 32), (4,)]
    for i, p in enumerate(net.parameters()):
        if p.dim() == 2:  # uniform in ±1/√fan_in
            assert p.abs().max() <= 1 / p.shape[1] ** 0.5
        else:
            assert torch.all(p == 0)
    x, y = task.draw(100)
    assert x.shape == (100, 8) and x.min() >= -1 and x.max() <= 1
    assert torch.equal(y, (x @ task.teacher.T).argmax(-1))


def test_tiny_run_prints_every_mode_and_welvets_board(capsys):
    args = ["adaptv2", "--clock", "free", "--samples-per-phase", "20", "--methods", "backprop",
            "--schedules", "sample,periodic", "--modes", "serial,overlap,stream", "--stream-k", "4"]
    assert _bench().main(args) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("free ")]
    assert [(r[1], r[2], r[3]) for r in rows] == [
        ("backprop", "sample", "serial"), ("backprop", "sample", "overlap"), ("backprop", "sample", "stream"),
        ("backprop", "periodic", "serial"), ("backprop", "periodic", "overlap"),
    ]
    assert "NormalBP              1762  63.7%  89.2    1001" in out


@pytest.mark.parametrize("bad", [["adaptv2", "--clock", "hourly"], ["mnist"]])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(SystemExit):
        _bench().main(bad)


def test_profile_script_runs_the_cuda_logic_on_the_cpu(capsys):
    """bench/profile_live.py (for the GPU) runs its every part on the CPU through EagerOps."""
    path = BENCH.parent / "profile_live.py"
    spec = importlib.util.spec_from_file_location("profile_live", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.main(["--device", "cpu", "--samples", "30", "--warmup", "5", "--stream-k", "4"]) == 0
    out = capsys.readouterr().out
    for piece in ("serve: input copy", "serve: graph replay", "serve: read-back", "update: [x|y] copy",
                  "update: graph replay", "bookkeeping"):
        assert piece in out
    assert out.count("samples/s") == 4 and "one forward per sample: True" in out
