"""Quiet runs: a healthy CPU ``train()`` issues no warning at all, for every method, and an input on
another device than the model is a clear error (issue 33, item 8)."""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch

import torchloom
from torchloom import Dense, Network, TrainingConfig


def _net() -> Network:
    torch.manual_seed(0)
    return Network(Dense(4, 8, activation="tanh"), Dense(8, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(3)]


@pytest.mark.parametrize("method", ["backprop", "target_prop", "tween"])
@pytest.mark.parametrize("verbose", [1, 2])  # (0 prints nothing: a subset of both)
def test_a_healthy_cpu_run_issues_no_warning(method: str, verbose: int) -> None:
    data = _data()
    cfg = TrainingConfig(
        epochs=2, method=method, loss_type="cross_entropy", verbose=verbose, learning_rate=0.05,
        validation_data=data, metrics=["accuracy"], log_every_n_steps=2, scheduler=lambda s: 0.05,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning, whoever issues it, fails the run
        with contextlib.redirect_stdout(io.StringIO()):
            result = torchloom.train(_net(), data, cfg)
            torchloom.evaluate(result.model, data, loss_type="cross_entropy", metrics=["accuracy"])
            torchloom.predict(result.model, data[0][0])
            torchloom.summary(result.model, (1, 4))


def test_an_input_on_another_device_names_both_devices() -> None:
    net = _net()
    with pytest.raises(RuntimeError) as e:
        net(torch.zeros(2, 4, device="meta"))  # (no second device here: meta stands in for a GPU)
    assert str(e.value).startswith(
        "Network: the input is on meta but the model is on cpu (training with use_gpu=True or device= leaves the "
        "model there); move the input with x.to('cpu'), use torchloom.predict(net, x) (which moves each batch to "
        "the model), or bring the model back with net.cpu() ("
    )


@pytest.mark.cuda
def test_a_gpu_run_issues_no_warning_and_leaves_the_model_on_the_gpu() -> None:
    data = _data()
    net = _net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = torchloom.train(net, data, TrainingConfig(epochs=2, loss_type="cross_entropy", use_gpu=True, verbose=0))
    assert next(net.parameters()).device.type == "cuda" and result.model is net
    assert torchloom.predict(net, data[0][0]).device.type == "cuda"  # predict moves the batch to the model
    with pytest.raises(RuntimeError, match=r"^Network: the input is on cpu but the model is on cuda:0"):
        net(data[0][0])


@pytest.mark.cuda
def test_the_kernel_warm_up_threads_issue_no_cublas_warning(tmp_path, monkeypatch) -> None:
    """A second run of the same model loads its PyTorch kernels on helper threads (engine/op_warm.py);
    each makes the device current first, so cuBLAS finds a context (it warned "no current CUDA
    context" before). ``record=True`` catches warnings of every thread."""
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(tmp_path))
    data = [(x.cuda(), y.cuda()) for x, y in _data()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the first notes its kernels, the second warms them on helper threads
            torchloom.train(_net(), data, TrainingConfig(epochs=2, loss_type="cross_entropy", use_gpu=True, verbose=0))
    assert [str(w.message) for w in caught] == []
