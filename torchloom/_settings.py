"""What every settings dataclass (``TrainingConfig``, ``TargetPropConfig``, ``TweenConfig``) shares:
a hint for a mistyped keyword, NumPy scalars taken as Python numbers, and the documented meaning of
each field.

* ``@settings(aliases)`` makes ``Config(lr=0.1)`` a ``TypeError`` that names the closest valid field
  ("did you mean 'learning_rate'?"), from a table of the names other libraries use (``aliases``) or
  by spelling, and lists the valid fields. It also gives ``help(Config)`` an "Attributes" section
  built from the field docstrings (below), so the meanings show where users look.
* ``python_numbers(obj)`` turns every field holding a NumPy scalar (``np.float32(0.01)``,
  ``np.int64(5)``) into the Python ``float`` / ``int`` of the same value, before the checks.
* ``field_docs(cls)``: ``{field: meaning}`` read from the class source, where each field is followed
  by its docstring (the string literal on the next line, as mkdocstrings and IDEs read it). Read on
  demand (``help()``, the docs), never at import: parsing the source costs tens of milliseconds.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import numbers
import textwrap
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

__all__ = ["settings", "python_numbers", "field_docs", "closest", "unknown_setting"]

T = TypeVar("T")


def closest(name: str, valid: Iterable[str], aliases: Mapping[str, str] | None = None) -> str | None:
    """The valid name ``name`` most likely meant: an alias's target, a valid name it starts or that
    starts it, else the nearest spelling (``difflib``, ratio >= 0.6); ``None`` when nothing is close."""
    valid = list(valid)
    key = str(name).lower()
    if aliases and aliases.get(key) in valid:
        return aliases[key]
    if key in valid:
        return key
    prefixed = [v for v in valid if v.startswith(key) or key.startswith(v)]
    if len(key) >= 2 and prefixed:
        return prefixed[0]
    found = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    return found[0] if found else None


def unknown_setting(owner: str, name: str, valid: Iterable[str], aliases: Mapping[str, str] | None = None) -> str:
    """The message for an unknown keyword ``name`` of ``owner``: the closest field, then every field."""
    valid = list(valid)
    guess = closest(name, valid, aliases)
    if guess == "optimizer_options":
        hint = f" did you mean optimizer_options={{{name!r}: ...}}?"
    else:
        hint = f" did you mean {guess!r}?" if guess else ""
    return f"{owner}: unknown setting {name!r};{hint} valid fields: {', '.join(valid)}"


def python_numbers(obj: Any) -> None:
    """Every field of the dataclass ``obj`` that holds a NumPy (or other non-builtin) real scalar is
    set to the Python ``int`` (integral types) or ``float`` of its value; bools are left alone."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if type(v) in (bool, int, float) or isinstance(v, bool) or not isinstance(v, numbers.Real):
            continue  # (np.float64 is a float subclass: converted too)
        setattr(obj, f.name, int(v) if isinstance(v, numbers.Integral) else float(v))


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """``{field: its docstring}`` for the annotated fields of ``cls`` (and its dataclass bases) that
    are followed by a string literal in the source; a field without one is absent."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for stmt, nxt in zip(body, body[1:] + [None]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _attributes_section(cls: type) -> str:
    """An "Attributes:" section (Google style) of every field and its meaning."""
    docs = field_docs(cls)
    lines = ["", "Attributes:"]
    for f in dataclasses.fields(cls):
        meaning = " ".join(docs.get(f.name, "").split())
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        shown = "" if default is dataclasses.MISSING else f" Default: ``{default!r}``."
        lines.append(f"    {f.name}: {meaning}{shown}")
    return "\n".join(lines)


class _Doc:
    """A class's ``__doc__`` with its "Attributes:" section, made on first read (reading the field
    docstrings parses the class's source, which ``import torchloom`` should not pay for): ``type``
    calls the ``__get__`` of a descriptor stored as ``__doc__``, so ``help()``, ``inspect.getdoc``
    and ``Config.__doc__`` all see the full text."""

    def __init__(self, cls: type, doc: str) -> None:
        self.cls, self.doc, self.text = cls, doc, None

    def __get__(self, obj: Any, owner: type | None = None) -> str:
        if self.text is None:
            self.text = (inspect.cleandoc(self.doc) + "\n" + _attributes_section(self.cls)).strip()
        return self.text


def settings(aliases: Mapping[str, str] | None = None) -> Callable[[type[T]], type[T]]:
    """Class decorator for a settings dataclass (put it above ``@dataclass``): an unknown keyword is
    a ``TypeError`` naming the closest field (``unknown_setting``), and the class docstring gains an
    "Attributes:" section listing each field's documented meaning and default (what ``help()``
    shows; mkdocstrings shows the field docstrings themselves)."""
    table = {k.lower(): v for k, v in (aliases or {}).items()}

    def wrap(cls: type[T]) -> type[T]:
        init = cls.__init__
        names = [f.name for f in dataclasses.fields(cls) if f.init]

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            for key in kwargs:
                if key not in names:
                    raise TypeError(unknown_setting(cls.__name__, key, names, table))
            init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[method-assign]
        cls.__doc__ = _Doc(cls, cls.__doc__ or "")  # type: ignore[assignment]
        return cls

    return wrap
