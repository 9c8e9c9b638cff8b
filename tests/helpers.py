"""Shared test helpers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Independent references for the activations of SPEC §2: torch's own functions.
ACTIVATION_REFERENCE = {
    "relu": torch.relu,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.01),
    "relu2": lambda x: torch.relu(x) ** 2,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="none"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "linear": lambda x: x.clone(),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, name: str, rtol: float, atol: float) -> None:
    """``torch.testing.assert_close`` whose message names the tensor and the first mismatching index."""
    actual = torch.as_tensor(actual)
    expected = torch.as_tensor(expected)
    assert actual.shape == expected.shape, f"{name}: shape {list(actual.shape)} != expected {list(expected.shape)}"
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    bad = ~torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=False)
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{a.numel()} elements differ (rtol={rtol}, atol={atol}); first at "
            f"index {idx}: got {a[idx].item()!r}, expected {e[idx].item()!r}; max abs diff "
            f"{(a - e).abs().max().item():.3e}"
        )
