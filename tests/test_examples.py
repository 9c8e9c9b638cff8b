"""The examples run and reach what they promise (each with its own small budget)."""

import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name.replace(".py", ""), EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_celsius_to_fahrenheit_learns_the_formula(capsys):
    w, b = load_example("01_celsius_to_fahrenheit.py").main(verbose=True)
    assert abs(w - 1.8) < 0.01 and abs(b - 32) < 0.1
    assert "learned: F = 1.8000·C + 32.0" in capsys.readouterr().out


def test_digits_example_exceeds_90_percent():
    pytest.importorskip("sklearn")
    accuracy = load_example("02_digits.py").main(verbose=False)
    assert accuracy > 0.90


def test_layers_example():
    pytest.importorskip("sklearn")
    conv_acc, seq_acc = load_example("05_layers.py").main(verbose=False)
    assert conv_acc > 0.9 and seq_acc > 0.9


def test_target_prop_example():
    pytest.importorskip("sklearn")
    results = load_example("03_target_prop.py").main(epochs=30, verbose=False)
    assert results["TargetProp, chain rule, cross-entropy (lr 0.1)"] >= 0.95
    assert results["TargetProp, pure, MSE (lr 0.032)"] > 0.85


def test_tweening_example():
    pytest.importorskip("sklearn")
    results = load_example("04_tweening.py").main()
    assert results["tween"] >= 0.95 and results["backprop"] >= 0.95


@pytest.mark.parametrize("method", ["backprop", "tween"])
def test_validation_and_resume_example(method):
    pytest.importorskip("sklearn")
    out = load_example("06_validation_and_resume.py").main(method=method, epochs=6, verbose=False)
    assert out["resume_exact"] == 1.0  # 3 epochs + resume for 3 equals 6 in one run, bit for bit
    assert out["val_accuracy"] > 0.9 and out["predicted"] == pytest.approx(out["val_accuracy"])


def test_custom_method_example():
    pytest.importorskip("sklearn")
    out = load_example("08_custom_method.py").main(epochs=6, verbose=False)
    assert out["resume_exact"] == 1.0  # half the epochs + resume equals the whole run, bit for bit
    assert out["val_accuracy"] > 0.85
