"""Fused small-batch Dense kernels vs their references (Triton interpreter on CPU, native on CUDA)."""

import pytest
import torch

from helpers import assert_close
from torchloom.kernels._triton import triton_available
from torchloom.kernels.dense_small import ACT_CODES, dense_small_backward, dense_small_backward_ref
from torchloom.layers.activations import get_activation

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("act", list(ACT_CODES))
@pytest.mark.parametrize("m,k,n", [(1, 7, 10), (5, 130, 37), (16, 64, 33), (21, 17, 5), (130, 9, 40)])
def test_backward_matches_reference(act, m, k, n):
    x = torch.randn(m, k, device=DEVICE)
    w = torch.randn(n, k, device=DEVICE) / k**0.5
    b = torch.randn(n, device=DEVICE)
    g = torch.randn(m, n, device=DEVICE)
    rpre = torch.addmm(b, x, w.t())
    dx, dw, db = dense_small_backward(g, rpre, x, w, act, True, True, backend="triton")
    rdx, rdw, rdb = dense_small_backward_ref(g, rpre, x, w, act, True, True)
    assert_close(dx, rdx, name="dx", rtol=1e-5, atol=1e-5)
    assert_close(dw, rdw, name="dW", rtol=1e-5, atol=1e-5)
    assert_close(db, rdb, name="db", rtol=1e-5, atol=1e-5)


def test_reference_equals_the_layer_math_in_float64():
    """The kernel's reference is the Dense backward of SPEC §3 with the activations of SPEC §2."""
    x = torch.randn(3, 6, dtype=torch.float64)
    w = torch.randn(4, 6, dtype=torch.float64)
    g = torch.randn(3, 4, dtype=torch.float64)
    for act in ACT_CODES:
        a = get_activation(act)
        pre = x @ w.t()
        dx, dw, db = dense_small_backward_ref(g, pre, x, w, act, False, True)
        gp = a.grad(g, pre)
        assert_close(dw, gp.t() @ x, name=f"{act} dW", rtol=1e-12, atol=1e-12)
        assert_close(dx, gp @ w, name=f"{act} dx", rtol=1e-12, atol=1e-12)
        assert db is None


def test_no_bias_no_dx():
    x = torch.randn(2, 9, device=DEVICE)
    w = torch.randn(3, 9, device=DEVICE)
    g = torch.randn(2, 3, device=DEVICE)
    pre = x @ w.t()
    dx, dw, db = dense_small_backward(g, pre, x, w, "tanh", False, False, backend="triton")
    assert dx is None and db is None
    assert_close(dw, dense_small_backward_ref(g, pre, x, w, "tanh", False, False)[1], name="dW", rtol=1e-5, atol=1e-5)
