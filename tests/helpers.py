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


def recurrent_truth(module_cls, x: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, b, g: torch.Tensor):
    """``module_cls`` (``nn.RNN`` / ``nn.LSTM``) in float64 with these weights (``bias_hh`` = 0) and
    autograd: the output ``[B, T, H]`` and the gradients of ``(output · g).sum()`` for the input,
    ``W_ih``, ``W_hh`` and the bias (when there is one)."""
    I, H = x.shape[-1], w_hh.shape[1]
    ref = module_cls(I, H, bias=b is not None, batch_first=True, dtype=torch.float64, device=x.device)
    with torch.no_grad():
        ref.weight_ih_l0.copy_(w_ih)
        ref.weight_hh_l0.copy_(w_hh)
        if b is not None:
            ref.bias_ih_l0.copy_(b)
            ref.bias_hh_l0.zero_()
    xr = x.double().requires_grad_()
    y, _ = ref(xr)
    params = [ref.weight_ih_l0, ref.weight_hh_l0] + ([ref.bias_ih_l0] if b is not None else [])
    return y.detach(), torch.autograd.grad(y, [xr, *params], g.double())
