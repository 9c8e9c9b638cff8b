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
