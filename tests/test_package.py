"""The public API: everything in __all__ exists, and importing torchloom is cheap and side-effect free."""

import subprocess
import sys

import torchloom


def test_all_names_exist():
    missing = [name for name in torchloom.__all__ if not hasattr(torchloom, name)]
    assert not missing
    assert len(set(torchloom.__all__)) == len(torchloom.__all__)


def test_import_pulls_in_neither_triton_nor_matplotlib_and_touches_no_gpu():
    code = (
        "import sys, torch\n"
        "import torchloom\n"
        "bad = [m for m in ('triton', 'matplotlib', 'sklearn', 'welvet', 'torch._dynamo') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
