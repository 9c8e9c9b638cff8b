"""The package's shape: no import circle anywhere in torchloom/, the engine imports no method, and
torchloom changes nothing of other libraries or of the process (SPEC §15, "Methods as plug-ins").

The import graph is read from the source with ``ast``: every ``import`` / ``from ... import``
statement, at module level or inside a function (a lazy import still ties two modules together).
``from pkg import name`` counts as an edge to ``pkg.name`` when that is a module, else to ``pkg``;
importing ``a.b.c`` also runs the ``__init__`` of ``a.b`` unless the importer lives inside it, so that
edge is counted too.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "torchloom"


def _module_name(path: pathlib.Path) -> str:
    parts = ["torchloom", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_package(name: str, modules: dict[str, pathlib.Path]) -> bool:
    return modules[name].name == "__init__.py"


def _resolve(importer: str, level: int, module: str | None, modules: dict[str, pathlib.Path]) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not _is_package(importer, modules):
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([module] if module else [])])


def import_graph() -> dict[str, set[str]]:
    """``{module: modules it imports}`` for every module of torchloom (torchloom's own only)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, node.level, node.module, modules)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                if not (target == "torchloom" or target.startswith("torchloom.")):
                    continue
                parts = target.split(".")
                for k in range(2, len(parts) + 1):  # the packages on the way run their __init__
                    step = ".".join(parts[:k])
                    inside = name == step or name.startswith(step + ".")
                    if step in modules and step != name and (not inside or k == len(parts)):
                        graph[name].add(step)
                if target == "torchloom" and name != "torchloom":
                    graph[name].add("torchloom")
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_reader_sees_circles_it_is_shown():
    # the reader itself: a made-up graph with one circle and one clean chain
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    graph = import_graph()
    # and it reads real edges: lazy imports inside functions and package __init__s included
    assert "torchloom.engine.loop" in graph["torchloom.engine.train"]
    assert "torchloom.kernels.grad_norm" in graph["torchloom.methods.backprop"]  # a lazy import
    assert "torchloom.engine" in graph["torchloom.methods.backprop"]  # engine/__init__ runs first


def test_no_import_circle_anywhere_in_torchloom():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_engine_imports_no_method():
    graph = import_graph()
    engine = {m: deps for m, deps in graph.items() if m == "torchloom.engine" or m.startswith("torchloom.engine.")}
    assert engine, "no engine package"
    bad = {m: sorted(d for d in deps if d.startswith(("torchloom.methods", "torchloom.trainers")) or d == "torchloom")
           for m, deps in engine.items()}
    assert not {m: d for m, d in bad.items() if d}


def test_every_module_of_a_method_stays_small():
    # "a method is its math": each rule's module (config, state, host and device step) stays readable
    sizes = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "methods").glob("*.py")}
    assert sizes and max(sizes.values()) <= 600, sizes


_GUEST = r"""
import inspect, os, sys, types, warnings
import torch
import torch._dynamo  # (it wraps torch.manual_seed itself when first imported: torch's own doing)
try:
    import triton, triton.runtime.jit, triton.runtime.cache  # noqa: F401
except ImportError:
    pass

def snapshot():
    seen = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or name.startswith("torchloom") or not isinstance(mod, types.ModuleType):
            continue
        for attr, value in list(vars(mod).items()):
            if callable(value) or isinstance(value, types.ModuleType):
                seen[(name, attr)] = id(value)
    return seen

def settings():
    return (sys.getswitchinterval(), torch.get_default_dtype(), list(warnings.filters), sys.getrecursionlimit(),
            torch.get_num_threads(), torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
            torch.is_grad_enabled(), dict(os.environ))

before, before_settings = snapshot(), settings()
import pkgutil, importlib, torchloom
for info in pkgutil.walk_packages(torchloom.__path__, "torchloom."):
    importlib.import_module(info.name)   # every module, the Triton kernels included
from torchloom import Dense, Network, TrainingConfig, train
x = torch.randn(64, 6); y = (x[:, 0] > 0).long()
for method in ("backprop", "target_prop", "tween"):
    net = Network(Dense(6, 8, "relu"), Dense(8, 2))
    loss = "mse" if method == "target_prop" else "cross_entropy"
    train(net, (x, y), TrainingConfig(method=method, epochs=2, batch_size=16, loss_type=loss, verbose=0))
after, after_settings = snapshot(), settings()
changed = sorted(f"{m}.{a}" for (m, a), i in before.items() if after.get((m, a), i) != i)
assert not changed, changed
assert after_settings == before_settings, [(a, b) for a, b in zip(before_settings, after_settings) if a != b]
print("ok")
"""


def test_torchloom_patches_no_library_and_changes_no_process_setting():
    out = subprocess.run([sys.executable, "-c", _GUEST], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
