"""The settings classes (issue 33 items 3 and 5): every field of every public config is documented
where users look (a docstring under the field, read by mkdocstrings and IDEs, and ``help()``'s
Attributes section); every config checks what it can when it is built, names the closest field for a
mistyped keyword, and takes NumPy scalars as Python numbers."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import pydoc

import numpy as np
import pytest
import torch

import torchloom
from torchloom import TargetPropConfig, TrainingConfig, TweenConfig, train
from torchloom._settings import field_docs


def _public_configs() -> list[type]:
    """Every dataclass named ``*Config`` that torchloom or one of its public subpackages exports."""
    found: dict[str, type] = {}
    for module in (torchloom, torchloom.optim, torchloom.observers, torchloom.interop, torchloom.layers):
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and name.endswith("Config"):
                found[name] = obj
    return list(found.values())


def test_the_public_configs_are_found():
    assert {c.__name__ for c in _public_configs()} >= {"TrainingConfig", "TargetPropConfig", "TweenConfig"}


@pytest.mark.parametrize("cls", _public_configs(), ids=lambda c: c.__name__)
def test_every_field_has_a_documented_meaning(cls):
    docs = field_docs(cls)
    missing = [f.name for f in dataclasses.fields(cls) if len(docs.get(f.name, "").split()) < 3]
    assert not missing, (
        f"{cls.__name__}: field(s) {missing} have no docstring; write what each means as a string literal on "
        "the line(s) right under the field (see TrainingConfig in torchloom/engine/config.py)"
    )
    # help() shows them: the class docstring's Attributes section names every field with its meaning
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    section = text[text.index("Attributes:"):]
    for f in dataclasses.fields(cls):
        first_words = " ".join(docs[f.name].split()[:3])
        assert f"{f.name}: {first_words}" in " ".join(section.split()), f"{cls.__name__}.{f.name} is not in help()'s Attributes"


@pytest.mark.parametrize("name", [n for n in torchloom.schedules.SCHEDULES], ids=str)
def test_every_schedule_field_has_a_documented_meaning(name):
    cls = torchloom.schedules.SCHEDULES[name]
    docs = field_docs(cls)
    missing = [f.name for f in dataclasses.fields(cls) if len(docs.get(f.name, "").split()) < 3]
    assert not missing, f"schedules.{name}: field(s) {missing} have no docstring under them"


def test_the_field_doc_reader_sees_a_missing_docstring():
    @dataclasses.dataclass
    class Demo:
        documented: int = 1
        """What it means, in words."""
        undocumented: int = 2  # a comment is not a docstring

    assert field_docs(Demo) == {"documented": "What it means, in words."}


@pytest.mark.parametrize("cls", _public_configs(), ids=lambda c: c.__name__)
def test_an_unknown_keyword_is_refused_with_the_valid_fields(cls):
    names = ", ".join(f.name for f in dataclasses.fields(cls))
    with pytest.raises(TypeError) as e:
        cls(no_such_setting=1)
    assert str(e.value) == f"{cls.__name__}: unknown setting 'no_such_setting'; valid fields: {names}"
    assert inspect.signature(cls).parameters.keys() == {f.name for f in dataclasses.fields(cls)}  # IDEs see the fields


@pytest.mark.parametrize(
    "cls,given,meant",
    [
        (TrainingConfig, "lr", "'learning_rate'"),
        (TrainingConfig, "max_epochs", "'epochs'"),
        (TrainingConfig, "learning_rat", "'learning_rate'"),
        (TrainingConfig, "callbacks", "'observers'"),
        (TrainingConfig, "weight_decay", "optimizer_options={'weight_decay': ...}"),
        (TargetPropConfig, "lr", "'learning_rate'"),
        (TweenConfig, "lr", "'base_rate'"),
        (TweenConfig, "momentum", "'momentum_decay'"),
    ],
)
def test_a_mistyped_keyword_names_the_closest_field(cls, given, meant):
    names = ", ".join(f.name for f in dataclasses.fields(cls))
    with pytest.raises(TypeError) as e:
        cls(**{given: 0.1})
    assert str(e.value) == f"{cls.__name__}: unknown setting {given!r}; did you mean {meant}? valid fields: {names}"


def test_train_overrides_name_the_closest_field_too():
    names = ", ".join(f.name for f in dataclasses.fields(TrainingConfig))
    with pytest.raises(TypeError) as e:
        train(torchloom.Network(torchloom.Dense(2, 1)), [(torch.zeros(1, 2), torch.zeros(1, 1))], lr=0.1)
    assert str(e.value) == f"train(): unknown setting 'lr'; did you mean 'learning_rate'? valid fields: {names}"


def test_metrics_and_scheduler_are_checked_when_the_config_is_built():
    with pytest.raises(ValueError) as e:
        TrainingConfig(metrics=["acc"])
    assert str(e.value) == (
        "TrainingConfig: metrics: unknown metric name 'acc'; valid names: 'accuracy', 'binary_accuracy', 'mse', "
        "'mae', 'rmse' (did you mean 'accuracy'?)"
    )
    with pytest.raises(TypeError) as e:
        TrainingConfig(scheduler="cosine")
    assert str(e.value) == (
        "TrainingConfig: scheduler must be None, a schedule lr(step) (torchloom.schedules: constant, linear_decay, "
        "cosine_annealing, cosine_warm_restarts, exponential_decay, step_decay, polynomial_decay, warmup; or any "
        "callable), an LRScheduler class or functools.partial of one (e.g. functools.partial("
        "torch.optim.lr_scheduler.ReduceLROnPlateau, patience=2)) or an LRScheduler instance, got 'cosine' "
        "(did you mean torchloom.schedules.cosine_annealing(...)?)"
    )
    with pytest.raises(TypeError) as e:
        TrainingConfig(observers=[object()])
    assert str(e.value).startswith("TrainingConfig: observers: observer object has none of the hooks on_train_begin")
    # the forms that work stay accepted
    TrainingConfig(metrics=["accuracy", "mae"], scheduler=torchloom.schedules.cosine_annealing(0.1, 0.001, 100))
    TrainingConfig(scheduler=functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=2))
    TrainingConfig(scheduler=lambda step: 0.1)


def test_numpy_scalars_are_taken_as_python_numbers():
    cfg = TrainingConfig(
        epochs=np.int64(5), learning_rate=np.float32(0.25), gradient_clip=np.float64(1.5), device_id=np.int32(0),
        seed=np.int64(3), batch_size=np.int16(8), divergence_factor=np.float32(4.0), verbose=np.int64(2),
    )
    values = {k: getattr(cfg, k) for k in ("epochs", "learning_rate", "gradient_clip", "device_id", "seed", "batch_size", "divergence_factor", "verbose")}
    assert values == {"epochs": 5, "learning_rate": 0.25, "gradient_clip": 1.5, "device_id": 0, "seed": 3, "batch_size": 8,
                      "divergence_factor": 4.0, "verbose": 2}
    assert [type(v) for v in values.values()] == [int, float, float, int, int, int, float, int]
    tp = TargetPropConfig(learning_rate=np.float32(0.5), momentum=np.float64(0.5), gate_threshold=np.float32(0.25))
    assert (type(tp.learning_rate), type(tp.momentum), tp.gate_threshold) == (float, float, 0.25)
    tw = TweenConfig(base_rate=np.float32(0.5), momentum_decay=np.float16(0.5), explosion_limit=np.int64(4))
    assert (tw.base_rate, tw.momentum_decay, tw.explosion_limit, type(tw.explosion_limit)) == (0.5, 0.5, 4, int)
    # a NumPy value that is out of range is still refused, naming the field
    with pytest.raises(ValueError, match=r"^TrainingConfig: learning_rate must be a finite number > 0 or None \(not set: 0\.01 for an optimizer given by name, "
                       r"TargetProp's / Tweening's automatic rate\), got -0\.5$"):
        TrainingConfig(learning_rate=np.float32(-0.5))
    with pytest.raises(ValueError, match=r"^TweenConfig: momentum_decay must be a finite number in \[0\.0, 1\.0\), got 1\.5$"):
        TweenConfig(momentum_decay=np.float64(1.5))


def test_the_api_reference_shows_each_fields_docstring():
    """The docs build's griffe extension (docs/_hooks/griffe_fields.py) gives every field of a config
    the docstring written under it, not its default value's type's ("int([x]) -> integer")."""
    griffe = pytest.importorskip("griffe")
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "docs" / "_hooks" / "griffe_fields.py"
    spec = importlib.util.spec_from_file_location("griffe_fields", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    extensions = griffe.load_extensions(module.FieldDocs())
    for cls, where in ((TrainingConfig, "torchloom.engine.config"), (TweenConfig, "torchloom.methods.tween_rules")):
        documented = griffe.inspect(where, extensions=extensions)[cls.__name__]  # as the docs build: by inspection
        for f in dataclasses.fields(cls):
            member = documented.members.get(f.name)
            assert member is not None and member.docstring is not None, f"{cls.__name__}.{f.name} has no entry in the API reference"
            assert member.docstring.value == field_docs(cls)[f.name]
        assert "Attributes:" not in documented.docstring.value  # listed as members there, not twice
