"""Test-suite set-up.

Without a GPU, Triton kernels run through Triton's CPU interpreter: ``TRITON_INTERPRET=1`` must be
set before any kernel module is imported, so it is set here, first. With a GPU the kernels run
natively on CUDA tensors (the GPU-only tests skip cleanly without one).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_and_one_thread():
    """Every test starts from the same random state and depends on no other test's. The tensors here
    are tiny: one intra-op thread avoids OpenMP hand-offs that made small ops 10-20x slower on a
    2-core machine."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
