"""Test-suite set-up.

Without a GPU, Triton kernels run through Triton's CPU interpreter: ``TRITON_INTERPRET=1`` must be
set before any kernel module is imported, so it is set here, first. With a GPU the kernels run
natively on CUDA tensors (the GPU-only tests skip cleanly without one).
"""

import os
import re
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _version(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string: '3.7.0+git12' → (3, 7), '3.6rc1' → (3, 6)."""
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = re.match(r"\d*", piece).group()
        parts.append(int(digits or 0))
    return tuple(parts)


def pytest_sessionstart(session):
    """Triton's interpreter before 3.7 cannot run a kernel loop with a run-time bound under NumPy 2.4
    or later (``InterpreterError: TypeError('only 0-dimensional arrays can be converted to Python
    scalars')``, measured with Triton 3.6 and NumPy 2.4.6; Triton 3.7 and NumPy 2.3 are fine): every
    kernel test would fail with that error, so the suite stops at once and says why."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import numpy
        import triton
    except ImportError:
        return
    if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        pytest.exit(
            f"Triton {triton.__version__}'s CPU interpreter cannot run torchloom's kernels with NumPy {numpy.__version__} "
            "(loops with run-time bounds fail). Install triton>=3.7 or numpy<2.4, or uninstall triton to test the "
            "references only.", returncode=4,
        )


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


@pytest.fixture(autouse=True)
def _exact_recurrent_float32():
    """cuDNN's TF32 off around every test (the legacy switch: it sets every cuDNN op, so the settings
    stay consistent whichever API a test reads): on CUDA the recurrent loop kernels follow PyTorch's RNN
    switch, TF32 by default, and the tests compare them (and ``nn.RNN``/``nn.LSTM``) with exact
    references. The default itself is tested where the switch is (tests/kernels/test_rnn_persistent.py)."""
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(autouse=True)
def _fresh_replay_programs():
    """No recorded operator call (``kernels._replay``) carried from one test into the next: a test that
    patches a decision the key does not hold (``gemm_precision``, a launcher made to fail) must see its
    operators' Python run."""
    replay = sys.modules.get("torchloom.kernels._replay")
    if replay is not None:
        replay.clear_programs()
    yield


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
