"""The fused backward of the feedback rules (``kernels/feedback.py``) against float64 products written
here from the rules' equations (Triton's interpreter on CPU, native on CUDA)."""

import pytest
import torch

from torchloom.kernels._triton import triton_available
from torchloom.layers.activations import get_activation

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "triton" if DEVICE == "cpu" else None


def _fb():
    from torchloom.kernels import feedback

    return feedback


def _r(*shape, g):
    return torch.randn(*shape, generator=g).to(DEVICE)


def _gp(g, pre, act):  # gPre = g ⊙ f'(pre), float64, from the activation's own derivative
    return get_activation(act).grad(g.double().cpu(), pre.double().cpu())


@pytest.mark.parametrize("act", ["linear", "relu", "tanh", "sigmoid"])
@pytest.mark.parametrize("m", [1, 7, 20])
def test_product_is_gpre_times_b_or_its_scaled_sign(act, m):
    fb, g = _fb(), torch.Generator().manual_seed(m)
    grad, pre, b = _r(m, 10, g=g), _r(m, 10, g=g), _r(10, 70, g=g)
    b[0, :3] = 0.0  # sign(0) = 0
    got = fb.feedback_product(grad, pre, b, act, backend=BACKEND)
    torch.testing.assert_close(got.double().cpu(), _gp(grad, pre, act) @ b.double().cpu(), rtol=1e-5, atol=1e-5)
    norm = b.abs().sum().reshape(1)
    got = fb.feedback_product(grad, pre, b, act, scale=norm, scale_mul=1 / b.numel(), backend=BACKEND)
    want = _gp(grad, pre, act) @ (torch.sign(b.double().cpu()) * b.double().abs().mean().cpu())
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 5, 33])
def test_gradient_jobs_from_strided_slices_in_launches_of_three(m):
    """Four layers' dW = gPreᵀ x and db = Σ gPre, their output gradients column slices of one matrix
    (DFA's ``e [B_1 | …]``), written into the given buffers."""
    fb, g = _fb(), torch.Generator().manual_seed(m)
    big = _r(m, 97, g=g)
    spec = [(0, 40, 33, "relu", True), (40, 80, 70, "tanh", False), (80, 90, 5, "linear", True), (90, 97, 3, "sigmoid", True)]
    jobs, want = [], []
    for lo, hi, k, act, bias in spec:
        pre, x = _r(m, hi - lo, g=g), _r(m, k, g=g)
        dw_out = torch.full((hi - lo, k), float("nan"), device=DEVICE)
        jobs.append((big[:, lo:hi], pre, x, act, bias, dw_out, None))
        gp = _gp(big[:, lo:hi], pre, act)
        want.append((gp.t() @ x.double().cpu(), gp.sum(0) if bias else None))
    got = fb.dense_grads(jobs, backend=BACKEND)
    for (dw, db), (rw, rb), job in zip(got, want, jobs):
        assert dw.data_ptr() == job[5].data_ptr()
        torch.testing.assert_close(dw.double().cpu(), rw, rtol=1e-5, atol=1e-5)
        assert (db is None) == (rb is None)
        if rb is not None:
            torch.testing.assert_close(db.double().cpu(), rb, rtol=1e-5, atol=1e-5)


def test_dense_backward_with_sign_feedback_is_one_layer_of_sign_symmetry():
    fb, g = _fb(), torch.Generator().manual_seed(0)
    grad, x, w = _r(3, 6, g=g), _r(3, 9, g=g), _r(6, 9, g=g)
    pre = x @ w.t()
    dx, dw, db = fb.dense_backward_fb(grad, pre, x, w, "tanh", True, w.abs().sum().reshape(1), 1 / w.numel(), backend=BACKEND)
    gp = _gp(grad, pre, "tanh")
    w64 = w.double().cpu()
    torch.testing.assert_close(dx.double().cpu(), gp @ (torch.sign(w64) * w64.abs().mean()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double().cpu(), gp.t() @ x.double().cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db.double().cpu(), gp.sum(0), rtol=1e-5, atol=1e-5)
