"""Fixtures for the kernel tests."""

import pytest
import torch


@pytest.fixture
def cuda_default_device():
    """Without a GPU a kernel test runs its kernel through Triton's interpreter on CPU tensors; on a GPU
    machine (where the interpreter is off) the same tensors are created on CUDA instead."""
    if torch.cuda.is_available():
        torch.set_default_device("cuda")
        yield
        torch.set_default_device("cpu")
    else:
        yield
