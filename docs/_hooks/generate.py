"""MkDocs hook (mkdocs.yml ``hooks:``): pages and figures made from the code at every build.

* ``api/kernels.md``: one ``::: torchloom.kernels.<name>`` block per public kernel module, so a new
  kernel shows up in the API reference without anyone editing a page.
* ``img/tweening-fault.png``: Neural Tweening on scikit-learn's digits with a fault injected mid-run
  (the last layer's weights multiplied by 50): loss, mean gap (with its running baseline) and
  adaptive rate per step, explosions marked. Drawn from a real run of the current code, so the picture always shows what the code does.

Both are added to the build in memory (``File.generated``); nothing is written into ``docs/``.
The figure run takes about a second (a 64-32-10 network, a few hundred small steps, one thread).

And two checks that keep the API reference complete as the code changes:

* a public function that shares its name with the submodule it lives in (``torchloom.layers.dense``
  is both) is hidden from mkdocstrings by the submodule: ``on_page_markdown`` adds a block for it
  under its full path;
* ``on_post_build`` checks that every name in the ``__all__`` of every documented module has an entry
  on its page, and logs a warning (an error under ``mkdocs build --strict``) for each that has none.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import logging
import pathlib
import re
import types

from mkdocs.structure.files import File, Files

ROOT = pathlib.Path(__file__).resolve().parents[2]
log = logging.getLogger("mkdocs.hooks.api_reference")
_DIRECTIVE = re.compile(r"^::: ([\w.]+)[ \t]*$", re.M)

# The Tweening figure's run: digits, 64-32-10, batch 32, fault at FAULT_STEP (weights of layer
# FAULT_LAYER × FAULT_FACTOR), STEPS steps in all. docs/tweening.md describes the same run.
BATCH = 32
STEPS = 300
FAULT_STEP = 120
FAULT_LAYER = 1
FAULT_FACTOR = 50.0


def kernels_page() -> str:
    """``api/kernels.md``: every public module of ``torchloom/kernels``, in name order."""
    names = sorted(p.stem for p in (ROOT / "torchloom" / "kernels").glob("*.py") if not p.stem.startswith("_"))
    blocks = "\n\n".join(f"::: torchloom.kernels.{n}" for n in names)
    return (
        "# torchloom.kernels\n\n"
        "Fused Triton kernels, each beside a plain-PyTorch reference of the same math (the `*_ref`\n"
        "functions). On CUDA tensors the Triton kernel runs; on the CPU, or without Triton, the reference.\n"
        "Kernel modules are imported on first use: `import torchloom` never imports Triton.\n\n"
        f"{blocks}\n"
    )


def tween_fault_run() -> dict:
    """Run the figure's Tweening session and return its per-step histories."""
    import torch
    from sklearn.datasets import load_digits

    from torchloom import Dense, Network, TweenConfig, TweenState

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        digits = load_digits()
        x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
        y = torch.tensor(digits.target)
        net = Network(Dense(64, 32, "relu"), Dense(32, 10))
        state = TweenState(net, TweenConfig())
        starts = list(range(0, len(x) - BATCH + 1, BATCH))
        baseline = []
        for step in range(STEPS):
            if step == FAULT_STEP:
                with torch.no_grad():
                    net[FAULT_LAYER].weight.mul_(FAULT_FACTOR)
            i = starts[step % len(starts)]
            state.tween_step(net, x[i : i + BATCH], y[i : i + BATCH])
            baseline.append(getattr(state, "gap_baseline", None))
    finally:
        torch.set_num_threads(threads)
    counts = state.explosion_history
    explosions = [k for k in range(len(counts)) if counts[k] > (counts[k - 1] if k else 0)]
    return {
        "loss": state.loss_history,
        "gap": state.gap_history,
        "baseline": baseline if None not in baseline else None,
        "rate": state.rate_history,
        "explosions": explosions,
        "base_rate": state.config.rate_for(BATCH),  # the default (None): 0.03 at batches of 32
    }


def tween_fault_figure() -> bytes:
    """The PNG of ``tween_fault_run()``: three panels sharing the step axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = tween_fault_run()
    steps = range(len(run["loss"]))
    fig, axes = plt.subplots(3, 1, figsize=(7.5, 6.5), sharex=True, constrained_layout=True)
    panels = [
        ("loss", "batch loss (before the update)", "log"),
        ("gap", "mean gap over the layers", "log"),
        ("rate", "adaptive rate", "log"),
    ]
    for ax, (key, label, scale) in zip(axes, panels):
        ax.plot(steps, run[key], lw=1.0, color="tab:blue")
        ax.set_ylabel(label, fontsize=8)
        ax.set_yscale(scale)
        ax.axvline(FAULT_STEP, color="tab:red", lw=1.0, ls="--")
        for k in run["explosions"]:
            ax.axvline(k, color="tab:orange", lw=0.6, alpha=0.6)
        ax.grid(True, which="major", alpha=0.3)
    axes[2].axhline(run["base_rate"], color="gray", lw=0.8, ls=":")
    if run["baseline"] is not None:
        axes[1].plot(steps, run["baseline"], lw=1.0, color="tab:green", label="gap baseline")
        axes[1].legend(fontsize=7, loc="upper left")
    axes[0].set_title(
        f"Neural Tweening, digits 64-32-10, batch {BATCH}: layer {FAULT_LAYER}'s weights ×{FAULT_FACTOR:g} at step "
        f"{FAULT_STEP} (red);\n{len(run['explosions'])} explosion(s) detected (orange); dotted: base_rate",
        fontsize=9,
    )
    axes[2].set_xlabel("step")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _public(module_name: str) -> dict[str, object]:
    """``{name: object}`` for every name of the module's ``__all__`` (what ``import *`` gives)."""
    module = importlib.import_module(module_name)
    return {name: getattr(module, name) for name in getattr(module, "__all__", ())}


def _shadowed(module_name: str) -> list[str]:
    """Full paths of the public functions/classes whose name is also a submodule of ``module_name``."""
    if not hasattr(importlib.import_module(module_name), "__path__"):
        return []  # a plain module has no submodules
    out = []
    for name, obj in _public(module_name).items():
        if isinstance(obj, types.ModuleType) or not hasattr(obj, "__qualname__"):
            continue
        if importlib.util.find_spec(f"{module_name}.{name}") is not None:
            out.append(f"{obj.__module__}.{obj.__qualname__}")
    return out


def on_page_markdown(markdown: str, page, config, files) -> str:
    if not page.file.src_uri.startswith("api/"):
        return markdown
    extra = [path for module in _DIRECTIVE.findall(markdown) for path in _shadowed(module)]
    if not extra:
        return markdown
    blocks = "\n\n".join(f"::: {path}\n    options:\n      show_root_full_path: true" for path in extra)
    return (
        markdown
        + "\n\n## Functions named like their module\n\nThese public functions share their name with the"
        + " submodule that defines them, so they are listed here under their full path.\n\n"
        + blocks
        + "\n"
    )


def on_post_build(config) -> None:
    site = pathlib.Path(config["site_dir"])
    for md in sorted((pathlib.Path(config["docs_dir"]) / "api").glob("*.md")):
        _check_page(site / "api" / md.stem / "index.html", md.read_text(encoding="utf-8"))
    _check_page(site / "api" / "kernels" / "index.html", kernels_page())


def _check_page(html_path: pathlib.Path, markdown: str) -> None:
    html = html_path.read_text(encoding="utf-8")
    ids = set(re.findall(r'id="([\w.]+)"', html))
    for module in _DIRECTIVE.findall(markdown):
        try:
            public = _public(module)
        except ImportError:  # a directive for a single object, not a module
            continue
        shadowed = set(_shadowed(module))
        for name, obj in public.items():
            if isinstance(obj, types.ModuleType):
                continue  # a subpackage: documented on its own page
            wanted = {f"{module}.{name}"}
            if hasattr(obj, "__qualname__"):
                full = f"{obj.__module__}.{obj.__qualname__}"
                if full in shadowed:
                    wanted = {full}
            if not wanted & ids:
                log.warning(f"API reference: {module}.{name} (in __all__) has no entry on {html_path.parent.name}'s page")


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "api/kernels.md", content=kernels_page()))
    files.append(File.generated(config, "img/tweening-fault.png", content=tween_fault_figure()))
    return files
