"""Every ```python block of README.md and docs/*.md runs as written, and the docs keep to their rules.

A block runs in a fresh namespace, in a temporary working directory (files it writes go there). A
first line ``# requires: cuda`` skips the block without a CUDA GPU; ``# requires: <module>`` (e.g.
``welvet``) skips it when that module cannot be imported. Blocks must be whole programs: a fragment
fails here, which is the point.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SOURCES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_REQUIRES = re.compile(r"#\s*requires:\s*(.+)")


def python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(first line number, source)`` of each ```python block of ``path``."""
    text = path.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _FENCE.finditer(text)]


BLOCKS = [
    pytest.param(code, id=f"{path.relative_to(ROOT)}:{line}")
    for path in SOURCES
    for line, code in python_blocks(path)
]


def _requirements(code: str) -> list[str]:
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    m = _REQUIRES.match(first.strip())
    return [r.strip() for r in m.group(1).split(",")] if m else []


def test_snippets_are_found():
    """The extraction itself works: the README and the guides hold python blocks."""
    files = {p.id.rsplit(":", 1)[0] for p in BLOCKS}
    assert "README.md" in files
    assert len(files) >= 5, files


@pytest.mark.parametrize("code", BLOCKS)
def test_snippet_runs(code, tmp_path, monkeypatch):
    for req in _requirements(code):
        if req == "cuda":
            if not torch.cuda.is_available():
                pytest.skip("needs a CUDA GPU")
        elif importlib.util.find_spec(req) is None:
            pytest.skip(f"needs {req}")
    monkeypatch.chdir(tmp_path)
    dtype = torch.get_default_dtype()
    try:
        exec(compile(code, "<snippet>", "exec"), {"__name__": "__main__"})
    finally:
        torch.set_default_dtype(dtype)


def test_api_reference_has_a_page_per_public_module():
    """Each public module of the package has its API page (docs/api/*.md, or the kernels page that
    docs/_hooks/generate.py generates from the kernel modules it finds)."""
    import torchloom

    pages = {p.stem for p in (DOCS / "api").glob("*.md")}
    wanted = {"torchloom", "layers", "optim", "schedules", "observers", "interop"}
    assert wanted <= pages, wanted - pages
    for page in wanted:
        module = "torchloom" if page == "torchloom" else f"torchloom.{page}"
        assert f"::: {module}\n" in (DOCS / "api" / f"{page}.md").read_text(encoding="utf-8")
    hook = (DOCS / "_hooks" / "generate.py").read_text(encoding="utf-8")
    assert "api/kernels.md" in hook and "::: torchloom.kernels." in hook
    assert "optim" in torchloom.__all__ and "schedules" in torchloom.__all__


def test_every_guide_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in DOCS.glob("*.md"):
        assert f" {page.name}" in nav, f"docs/{page.name} is not in mkdocs.yml's nav"


def test_guides_describe_every_config_field():
    """The settings tables of the guides name every field of the configs (a new field needs a row)."""
    import dataclasses

    from torchloom import TargetPropConfig, TrainingConfig, TweenConfig

    for cls, page in ((TrainingConfig, "training.md"), (TargetPropConfig, "target-prop.md"), (TweenConfig, "tweening.md")):
        text = (DOCS / page).read_text(encoding="utf-8")
        missing = [f.name for f in dataclasses.fields(cls) if f"`{f.name}`" not in text]
        assert not missing, f"docs/{page} does not describe {cls.__name__} field(s) {missing}"


def test_readme_links_the_guides_and_names_make_docs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/index.md)" in readme and "make docs" in readme
    assert (DOCS / "index.md").exists()


def test_no_spec_references_under_torchloom():
    """Docstrings stand on their own: nothing under torchloom/ points to the project's internal
    behavioural spec (state the formula or behaviour, or link a guide page under docs/)."""
    hits = []
    for path in sorted((ROOT / "torchloom").rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if "SPEC" in line:
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "\n".join(hits)
