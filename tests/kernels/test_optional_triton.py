"""Triton stays optional and lazy (SPEC §1): ``import torchloom`` never imports it, and without it
the losses, optimizers, gradient clipping and train() all run through their references."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from torchloom.kernels._triton import triton_available


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.skipif(not triton_available(), reason="checks that an installed Triton is not imported")
def test_import_torchloom_does_not_import_triton():
    proc = _run(
        """
        import sys
        import torchloom
        import torchloom.optim, torchloom.optim.optimizers, torchloom.optim.schedules, torchloom.engine.losses
        assert "triton" not in sys.modules, sorted(m for m in sys.modules if m.startswith("triton"))
        print("ok")
        """
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_everything_runs_on_references_without_triton():
    proc = _run(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError, as if not installed
        import copy
        import torch, torch.nn.functional as F
        import torchloom
        from torchloom.kernels import _triton
        from torchloom.kernels.grad_norm import clip_grad_norm_
        from torchloom.engine.losses import loss_and_grad
        from torchloom.optim.optimizers import SGD, AdamW, RMSprop
        from torchloom.layers.dense import Dense
        from torchloom.layers.network import Network

        assert not _triton.triton_available()
        try:
            _triton.use_triton(torch.ones(1), "triton")
            raise SystemExit("backend='triton' without Triton must raise")
        except RuntimeError as e:
            assert "not installed" in str(e)

        torch.manual_seed(0)
        o, y = torch.randn(4, 5), torch.randn(4, 5)
        loss, grad = loss_and_grad(o, y, "mse")
        assert torch.allclose(loss, F.mse_loss(o.double(), y.double()))
        labels = torch.randint(0, 5, (4,))
        loss, grad = loss_and_grad(o, labels, "cross_entropy")
        assert torch.allclose(loss, F.cross_entropy(o.double(), labels))
        p = torch.softmax(o, -1)
        loss, grad = loss_and_grad(p, torch.softmax(y, -1), "crossentropy")
        assert torch.isfinite(loss)

        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        x, t = torch.randn(8, 3), torch.randn(8, 2)
        for ours, theirs in [
            (lambda m: SGD(m.parameters(), lr=0.1, momentum=0.9), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)),
            (lambda m: AdamW([{"params": list(m.parameters())}], lr=0.01), lambda m: torch.optim.AdamW(m.parameters(), lr=0.01)),
            (lambda m: RMSprop(m.parameters(), lr=0.01, centered=True), lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, centered=True)),
        ]:
            a, b = copy.deepcopy(model), copy.deepcopy(model)
            oa, ob = ours(a), theirs(b)
            for _ in range(5):
                for m, opt in ((a, oa), (b, ob)):
                    opt.zero_grad()
                    F.mse_loss(m(x), t).backward()
                    clip_grad_norm_([q.grad for q in m.parameters()], 10.0)
                    opt.step()
            for pa, pb in zip(a.parameters(), b.parameters()):
                assert torch.allclose(pa, pb, rtol=1e-5, atol=1e-6)

        net = Network(Dense(3, 4, "tanh"), Dense(4, 2))
        result = torchloom.train(net, [(x, t)], epochs=3, optimizer="adamw", gradient_clip=1.0, verbose=False)
        assert result.loss_history[-1] < result.loss_history[0]
        assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules if sys.modules[m] is not None)
        print("ok")
        """
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_the_kernel_choice_traces_under_compile_without_a_warning(monkeypatch):
    """``use_triton`` (with ``triton_available``) and the recurrent loops' SM count run while
    ``torch.compile`` traces a CUDA layer: Dynamo must not trace through a ``functools.lru_cache``
    function there, which it warns every user about ("Dynamo detected a call to a
    `functools.lru_cache`-wrapped function"). Without a GPU the device's properties are stand-ins."""
    import types
    import warnings

    import torch

    from torchloom.kernels import _triton
    from torchloom.kernels import recurrent as K

    if not torch.cuda.is_available():
        # A stand-in only without a GPU: with one, Dynamo reads (and caches, past this test) the
        # device's real properties too, and a partial stand-in there broke every later compile.
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(multi_processor_count=7))
    _triton.sm_count.cache_clear()

    def fn(x):
        x = x * (2.0 if _triton.triton_available() else 1.0) + (1.0 if _triton.use_triton(x) else 0.0)
        return x * K._sm_count(0)

    torch._dynamo.reset()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = torch.compile(fn, fullgraph=True, backend="eager")(torch.ones(3))
        assert torch.equal(out, fn(torch.ones(3)))
    finally:
        _triton.sm_count.cache_clear()  # the stand-in's answer must not outlive the test
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message)[:120] for w in caught]
