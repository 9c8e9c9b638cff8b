"""Fixtures for the kernel tests."""

import pytest
import torch

from torchloom.kernels._triton import interpreter_enabled, triton_available


@pytest.fixture
def cuda_default_device():
    """For tests that run Triton kernels on tensors they create: without a GPU the kernels run through
    Triton's interpreter on CPU tensors; on a GPU machine (where the interpreter is off) the same
    tensors are created on CUDA instead. Skips when Triton (or, on CPU, its interpreter) is missing."""
    if not triton_available():
        pytest.skip("needs triton")
    if torch.cuda.is_available():
        torch.set_default_device("cuda")
        yield
        torch.set_default_device("cpu")
    else:
        if not interpreter_enabled():
            pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1) without a GPU")
        yield
