"""Data-parallel low-bit training (CPU, gloo, 2 processes): the ranks draw the same stochastic-rounding
bits (keyed by seed, step and parameter, not by rank), so every rank holds the same weights, bit for
bit, and they lie on the dtype's grid."""

from __future__ import annotations


import torch

from torchloom import Dense, LowBitConfig, Network, TrainingConfig, train
from torchloom.lowbit import decode, encode
from helpers import spawn_ranks

WORLD = 2
SCENARIOS = {"int8-none": ("int8", dict(master="none")), "int4-fp32-stochastic": ("int4", dict(rounding="stochastic"))}


def _scenarios(rank, tmp):
    out = {}
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 4, (64,), generator=g)
    for name, (dtype, kw) in SCENARIOS.items():
        torch.manual_seed(0)
        net = Network(Dense(6, 12, "tanh"), Dense(12, 4))
        train(net, (x, y), TrainingConfig(epochs=2, batch_size=16, shuffle=True, seed=2, verbose=0, loss_type="cross_entropy",
                                          optimizer="momentum", learning_rate=0.1, weight_dtype=dtype, low_bit=LowBitConfig(**kw)))
        out[name] = ([p.detach().clone() for p in net.parameters()], [m.loom_lowbit["scale"].clone() for m in net.layers])
    return out


def test_every_rank_holds_the_same_bits(tmp_path):
    res = spawn_ranks(_scenarios, WORLD, tmp_path, 120)
    for name, (dtype, _) in SCENARIOS.items():
        (w0, s0), (w1, s1) = res[0][name], res[1][name]
        for a, b in zip(w0, w1):
            assert torch.equal(a, b), name
        for (w, s) in zip((w0[0], w0[2]), s0):
            assert torch.equal(decode(encode(w, dtype, s), dtype, s), w), name
