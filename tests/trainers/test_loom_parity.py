"""Parity with real Loom (welvet = Loom v0.80's own binding): same weights and batches, same numbers.

``train()`` with ``bias=False`` Dense layers, SGD and ``"mse"`` / ``"crossentropy"`` must reproduce
Loom ``poly.Train``'s loss history (rtol 1e-6) and final weights (atol 1e-6). Skips without welvet.
"""

import numpy as np
import pytest
import torch

from loom_oracle import LoomDense, welvet
from torchloom import Dense, Network, TrainingConfig, train

pytestmark = [
    pytest.mark.loom,
    pytest.mark.skipif(welvet is None, reason="needs Loom's Python binding welvet (pip install welvet==0.80.0)"),
]

NETWORKS = {
    "relu-sigmoid": ([12, 10, 4], ["relu", "sigmoid"]),
    "tanh-silu-linear": ([6, 16, 9, 3], ["tanh", "silu", "linear"]),
    "leaky-relu-tanh-sigmoid": ([20, 24, 8, 11, 5], ["leaky_relu", "relu", "tanh", "sigmoid"]),
}


def _data(sizes, n_batches, batch, seed, probs_target=False):
    rng = np.random.RandomState(seed)
    x = rng.randn(n_batches, batch, sizes[0]).astype(np.float32)
    if probs_target:
        labels = rng.randint(0, sizes[-1], size=(n_batches, batch))
        y = np.eye(sizes[-1], dtype=np.float32)[labels]
    else:
        y = rng.rand(n_batches, batch, sizes[-1]).astype(np.float32)
    return x, y


def _run_both(sizes, acts, *, epochs, lr, loss_type="mse", clip=0.0, seed=0, probs_target=False):
    torch.manual_seed(seed)
    net = Network(*[Dense(sizes[i], sizes[i + 1], acts[i], bias=False) for i in range(len(acts))])
    x, y = _data(sizes, n_batches=5, batch=8, seed=seed + 1, probs_target=probs_target)
    loom = LoomDense(sizes, acts, [layer.weight.detach().numpy() for layer in net])
    try:
        assert all(np.array_equal(a, layer.weight.detach().numpy()) for a, layer in zip(loom.weights(), net))
        loom_hist = loom.train(x, y, epochs=epochs, learning_rate=lr, loss_type=loss_type, gradient_clip=clip)
        loom_w = loom.weights()
    finally:
        loom.close()
    cfg = TrainingConfig(epochs=epochs, learning_rate=lr, loss_type=loss_type, gradient_clip=clip, clip_mode="value", verbose=False)
    result = train(net, [(torch.from_numpy(a), torch.from_numpy(b)) for a, b in zip(x, y)], cfg)
    return loom_hist, loom_w, result, net


@pytest.mark.parametrize("name", list(NETWORKS))
def test_mse_sgd_matches_loom(name):
    sizes, acts = NETWORKS[name]
    loom_hist, loom_w, result, net = _run_both(sizes, acts, epochs=8, lr=0.05)
    assert len(loom_hist) == 8
    assert loom_hist[-1] < loom_hist[0]  # Loom really trained
    np.testing.assert_allclose(result.loss_history, loom_hist, rtol=1e-6, atol=0)
    for i, (lw, layer) in enumerate(zip(loom_w, net)):
        np.testing.assert_allclose(layer.weight.detach().numpy(), lw, atol=1e-6, rtol=0, err_msg=f"layer {i}")


def test_value_clipping_matches_loom():
    sizes, acts = NETWORKS["relu-sigmoid"]
    loom_hist, loom_w, result, net = _run_both(sizes, acts, epochs=6, lr=0.5, clip=0.002, seed=3)
    # the clip is active: without it Loom's weights move further
    _, unclipped_w, _, _ = _run_both(sizes, acts, epochs=6, lr=0.5, clip=0.0, seed=3)
    assert max(np.abs(a - b).max() for a, b in zip(loom_w, unclipped_w)) > 1e-3
    np.testing.assert_allclose(result.loss_history, loom_hist, rtol=1e-6, atol=0)
    for i, (lw, layer) in enumerate(zip(loom_w, net)):
        np.testing.assert_allclose(layer.weight.detach().numpy(), lw, atol=1e-6, rtol=0, err_msg=f"layer {i}")


def test_crossentropy_on_probabilities_matches_loom():
    sizes, acts = [10, 12, 4], ["tanh", "sigmoid"]
    loom_hist, loom_w, result, net = _run_both(sizes, acts, epochs=6, lr=0.5, loss_type="crossentropy", seed=5, probs_target=True)
    assert loom_hist[-1] < loom_hist[0]
    np.testing.assert_allclose(result.loss_history, loom_hist, rtol=1e-6, atol=0)
    for i, (lw, layer) in enumerate(zip(loom_w, net)):
        np.testing.assert_allclose(layer.weight.detach().numpy(), lw, atol=1e-6, rtol=0, err_msg=f"layer {i}")


def test_loom_ignores_the_cross_entropy_spelling_torchloom_trains_with_it():
    """SPEC §4/§13: Loom poly silently learns nothing for "cross_entropy"; torchloom implements it."""
    sizes, acts = [10, 12, 4], ["tanh", "linear"]
    loom_hist, loom_w, result, net = _run_both(sizes, acts, epochs=4, lr=0.5, loss_type="cross_entropy", seed=7, probs_target=True)
    assert loom_hist == [0.0] * 4
    assert result.loss_history[-1] < result.loss_history[0]
