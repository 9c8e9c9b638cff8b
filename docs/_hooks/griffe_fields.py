"""Griffe extension (mkdocs.yml, mkdocstrings ``extensions``): the API reference shows what a field means.

The reference is made by inspecting the imported package (``force_inspection``), and inspection sees a
dataclass field only as its default value: ``epochs = 10`` would be documented with ``int``'s own
docstring ("int([x]) -> integer"). For every attribute whose docstring is only its value's type's,
this extension drops it; for the fields of a dataclass it puts the docstring written under the
field in the source (and adds the fields inspection skips: those whose default is ``None`` or that
have none), and it
takes off the class docstring the "Attributes:" section that ``@settings`` adds for ``help()`` (the
fields are listed as members here).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Any

import griffe


def _field_docs(cls: type) -> dict[str, str]:
    """``{field: the string literal under it}`` from the source of ``cls`` (as
    ``torchloom._settings.field_docs``; kept here so that the docs build reads the inspected
    class itself, whichever copy of the package the hooks imported)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:] + [None]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


class FieldDocs(griffe.Extension):
    def on_attribute_instance(self, *, node: Any, attr: griffe.Attribute, agent: Any, **kwargs: Any) -> None:
        obj = getattr(node, "obj", None)
        plain = type(obj).__module__ == "builtins" and not callable(obj) and not inspect.ismodule(obj)
        if attr.docstring is None or obj is None or not plain:
            return  # (only plain values: numbers, strings, tuples, dicts, ...)
        own = type(obj).__dict__.get("__doc__")
        if isinstance(own, str) and attr.docstring.value.strip() == inspect.cleandoc(own).strip():
            attr.docstring = None

    def on_class_members(self, *, node: Any, cls: griffe.Class, agent: Any, **kwargs: Any) -> None:
        obj = getattr(node, "obj", None)
        if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
            return
        docs = _field_docs(obj)
        for f in dataclasses.fields(obj):
            member = cls.members.get(f.name)
            if member is None:  # inspection skips a field whose default is None, or that has none: made here
                value = repr(f.default) if f.default is not dataclasses.MISSING else None
                member = griffe.Attribute(f.name, value=value, lineno=None)
                member.labels.add("class-attribute")
                cls.set_member(f.name, member)
            if f.name in docs and not member.is_alias:
                member.docstring = griffe.Docstring(docs[f.name], parent=member)
        if cls.docstring is not None and "\nAttributes:\n" in cls.docstring.value:
            cls.docstring = griffe.Docstring(cls.docstring.value.split("\nAttributes:\n")[0].rstrip(), parent=cls)
