"""The LSTM's Triton kernels inside the layer's time loop — the fused step kernels (gates + cell update,
forward and backward) and the persistent loop kernel (the whole loop in one launch; more of it in
``test_lstm_persistent.py``) — against ``nn.LSTM`` / autograd in float64, through Triton's
interpreter on CPU and natively on CUDA: odd hidden sizes (ragged blocks), one step, no bias, half
precision."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import assert_close, recurrent_truth
from torchloom.kernels import recurrent as K
from torchloom.layers.lstm import LSTMSaved, lstm_backward, lstm_forward

pytestmark = pytest.mark.usefixtures("cuda_default_device")


@pytest.fixture(params=["step-kernels", "loop-kernel"])
def lstm_loop(request, monkeypatch):
    """Each test twice: the per-step fused kernels, and the persistent loop kernel."""
    monkeypatch.setattr(K, "USE_PERSISTENT_LSTM", request.param == "loop-kernel")
    return request.param


def _truth(x, w_ih, w_hh, b, g):
    return recurrent_truth(nn.LSTM, x, w_ih, w_hh, b, g)


@pytest.mark.parametrize("shape", [(3, 6, 5, 33, True), (2, 1, 3, 7, True), (4, 4, 2, 16, False)],
                         ids=["B3T6I5H33", "B2T1I3H7", "B4T4I2H16-nobias"])
def test_layer_loop_on_the_kernels_matches_nn_lstm(shape, lstm_loop):
    B, T, I, H, bias = shape
    x = torch.randn(B, T, I)
    assert K.lstm_loop_uses_triton(x, B, H, "triton") == (lstm_loop == "loop-kernel")
    w_ih, w_hh = torch.randn(4 * H, I) * 0.8, torch.randn(4 * H, H) * 0.8
    b = torch.randn(4 * H) if bias else None
    g = torch.randn(B, T, H)
    y, saved = lstm_forward(x, w_ih, w_hh, b, backend="triton")
    y_truth, truth = _truth(x, w_ih, w_hh, b, g)
    assert_close(y, y_truth, name="hidden", rtol=1e-5, atol=1e-5)
    gx, (gw_ih, gw_hh, gb) = lstm_backward(g, saved, backend="triton")
    names = ("grad input", "grad weight_ih", "grad weight_hh", "grad bias")
    for name, got, want in zip(names, (gx, gw_ih, gw_hh, gb), truth):
        assert_close(got, want, name=name, rtol=1e-4, atol=1e-4)
    if not bias:
        assert gb is None
    # the reference step gives the same buffers
    y_ref, saved_ref = lstm_forward(x, w_ih, w_hh, b, backend="reference")
    assert_close(saved.cell, saved_ref.cell, name="cell vs reference", rtol=1e-5, atol=1e-6)
    assert_close(y, y_ref, name="hidden vs reference", rtol=1e-5, atol=1e-6)


def test_step_kernels_alone_match_reference():
    """One step in isolation, with strided (time-step view) operands and a carry."""
    B, T, H = 3, 2, 20
    pre = torch.randn(B, T, 4 * H) * 2
    c_prev = torch.randn(B, H)
    outs = [torch.empty(B, T, H) for _ in range(4)]
    K.lstm_cell(pre[:, 1], c_prev, outs[0][:, 1], outs[1][:, 1], backend="triton")
    K.lstm_cell_ref(pre[:, 1], c_prev, outs[2][:, 1], outs[3][:, 1])
    assert_close(outs[0][:, 1], outs[2][:, 1], name="c", rtol=1e-5, atol=1e-6)
    assert_close(outs[1][:, 1], outs[3][:, 1], name="h", rtol=1e-5, atol=1e-6)
    dh, kappa = torch.randn(B, H), torch.randn(B, H)
    g1, g2 = torch.empty(B, 4 * H), torch.empty(B, 4 * H)
    k1, k2 = kappa.clone(), kappa.clone()
    K.lstm_cell_backward(pre[:, 1], outs[2][:, 1], c_prev, dh, k1, g1, True, backend="triton")
    K.lstm_cell_backward_ref(pre[:, 1], outs[2][:, 1], c_prev, dh, k2, g2, True)
    assert_close(g1, g2, name="gPre", rtol=1e-5, atol=1e-6)
    assert_close(k1, k2, name="carry", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_within_dtype_tolerance(dtype, lstm_loop):
    """Half inputs and weights: error against the float64 truth at most twice that of nn.LSTM run in
    the same dtype, plus a small floor."""
    B, T, I, H = 2, 5, 4, 24
    x = torch.randn(B, T, I).to(dtype)
    w_ih, w_hh, b = (torch.randn(4 * H, I) * 0.5).to(dtype), (torch.randn(4 * H, H) * 0.3).to(dtype), torch.randn(4 * H).to(dtype)
    g = torch.randn(B, T, H).to(dtype)
    y, saved = lstm_forward(x, w_ih, w_hh, b, backend="triton")
    gx, grads = lstm_backward(g, saved, backend="triton")
    y64, truth = _truth(x.double(), w_ih.double(), w_hh.double(), b.double(), g.double())
    ref = nn.LSTM(I, H, batch_first=True, dtype=dtype if x.is_cuda else torch.float32, device=x.device)
    with torch.no_grad():
        ref.weight_ih_l0.copy_(w_ih), ref.weight_hh_l0.copy_(w_hh), ref.bias_ih_l0.copy_(b), ref.bias_hh_l0.zero_()
    xr = x.to(ref.weight_ih_l0.dtype).requires_grad_()
    yr, _ = ref(xr)
    low = (yr, *torch.autograd.grad(yr, [xr, ref.weight_ih_l0, ref.weight_hh_l0, ref.bias_ih_l0], g.to(yr.dtype)))
    for name, got, want, lo in zip(("hidden", "dx", "dW_ih", "dW_hh", "db"), (y, gx, *grads), (y64, *truth), low):
        assert got.dtype == dtype, name
        err = (got.double() - want).abs().max().item()
        lo_err = (lo.double() - want).abs().max().item()
        floor = 2 * torch.finfo(dtype).eps * want.abs().max().item()
        assert err <= 2 * lo_err + floor, f"{name}: error {err:.3e} vs nn.LSTM's {lo_err:.3e}"


@pytest.mark.parametrize("T", [1, 6])
def test_traced_lstm_loops_equal_autograd_in_float64(T):
    """The loops a compiled LSTM traces where the fused cell kernel would run
    (``lstm_forward_loop_unrolled`` / ``lstm_backward_loop_unrolled``: every step from fresh tensors, no
    write into a view) against ``nn.LSTM`` with autograd in float64: the hidden states, and with BPTT's
    products over ``gPre`` (``dx = gPre W_ih``, ``dW_ih = Σ gPreᵀ x``, ``dW_hh = Σ_{t≥1} gPre_tᵀ h_{t−1}``,
    ``db = Σ gPre``) every gradient."""
    torch.manual_seed(0)
    B, I, H = 3, 4, 5
    x = torch.randn(B, T, I, dtype=torch.float64)
    w_ih, w_hh = torch.randn(4 * H, I, dtype=torch.float64) * 0.5, torch.randn(4 * H, H, dtype=torch.float64) * 0.5
    b, g = torch.randn(4 * H, dtype=torch.float64) * 0.5, torch.randn(B, T, H, dtype=torch.float64)
    y_ref, (dx_ref, dw_ih_ref, dw_hh_ref, db_ref) = recurrent_truth(nn.LSTM, x, w_ih, w_hh, b, g)
    proj = (x.reshape(B * T, I) @ w_ih.t() + b).view(B, T, 4 * H)
    pre, cell, hidden = K.lstm_forward_loop_unrolled(proj, w_hh)
    assert_close(hidden, y_ref, name="hidden", rtol=1e-12, atol=1e-12)
    g_pre = K.lstm_backward_loop_unrolled(g, pre, cell, w_hh)
    g2 = g_pre.reshape(B * T, 4 * H)
    assert_close((g2 @ w_ih).view(B, T, I), dx_ref, name="dx", rtol=1e-12, atol=1e-12)
    assert_close(g2.t() @ x.reshape(B * T, I), dw_ih_ref, name="dW_ih", rtol=1e-12, atol=1e-12)
    dw_hh = g_pre[:, 1:].reshape(-1, 4 * H).t() @ hidden[:, :-1].reshape(-1, H)
    assert_close(dw_hh, dw_hh_ref, name="dW_hh", rtol=1e-12, atol=1e-12)
    assert_close(g2.sum(0), db_ref, name="db", rtol=1e-12, atol=1e-12)
