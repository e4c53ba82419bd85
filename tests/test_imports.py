"""The package's import graph: no cycles, and no module imports from a layer above its own.

Every `import megagate...` counts: at module level, inside a function (a lazy import is still a dependency) and
under `if TYPE_CHECKING:` (a type-only import still ties the two modules together: neither can be read, moved or
tested without the other).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megagate"

# Lowest first. A module may import from its own layer and the layers before it.
LAYERS: list[tuple[str, ...]] = [
    # the package root, errors, files, console and the rank helpers (torch only) may be imported by every layer
    ("megagate", "megagate.errors", "megagate.distributed.utils"),
    ("megagate.model",),
    ("megagate.distributed", "megagate.health"),
    ("megagate.data",),
    ("megagate.monitor",),  # live monitoring: the spike detector, faults, diagnostics, events, run files
    ("megagate.analysis",),  # offline analysis of models and run directories
    # the run config and what it resolves to: the typed tree, the machine, the perf settings, the rules, the reader
    (
        "megagate.run_config",
        "megagate.machine",
        "megagate.perf",
        "megagate.perf_rules",
        "megagate.config_rules",
        "megagate.config_reader",
    ),
    ("megagate.run_setup",),  # the config resolved once for a machine: RunSetup
    ("megagate.plan",),
    ("megagate.checkpoint",),  # the checkpoint format: naming, manifest, safe loading, the Checkpointer
    ("megagate.model_factory",),  # the one place models are built and loaded
    ("megagate.train",),
    ("megagate.calibrate",),  # measures kernels and the trainer's overheads into a megagate.plan profile
    ("megagate.evaluate",),
    # hf / hf_config / hf_weights import only megagate.model; hf_io reads and writes checkpoints
    ("megagate.interop",),
    ("megagate.slurm",),
    ("megagate.grid",),  # a grid's trials, run locally or as a Slurm array: megagate sweep and megagate frontier
    # the frontier search runs trials locally or as Slurm arrays (megagate.slurm) and reads runs (megagate.monitor)
    ("megagate.frontier",),
    ("megagate.commands", "megagate.cli", "megagate.__main__"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The megagate modules that `path` imports (a `from pkg import name` of a submodule names the submodule)."""
    return imports_in(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py", known)


def imports_in(source: str, me: str, is_package: bool, known: set[str]) -> set[str]:
    """The megagate modules that the source of module `me` imports, wherever the import statement stands."""
    found: set[str] = set()
    package = me if is_package else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "megagate")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if base.split(".")[0] != "megagate":
                continue
            subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
            found.update(subs or [base])
    return {m for m in found if m != me}


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS"
    return rank


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    # Package __init__ modules are imported implicitly with their submodules; edges to them carry no dependency.
    return {m: {d for d in imports_of(p, known) if d in known} for m, p in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
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
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_graph_sees_known_edges():
    edges = graph()
    # a lazy import inside a function, a `from package import submodule`, and a plain `import megagate.x` all count
    assert "megagate.model.gate" in edges["megagate.model.model_config"] | edges["megagate.model.presets"]
    assert "megagate.model.qkv_layout" in edges["megagate.model.attention"]
    assert any(d.startswith("megagate.train") for d in edges["megagate.commands.train"])
    assert len(edges) > 60


def test_type_only_and_lazy_imports_count():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from megagate.run_config import TrainConfig\n"
        "def f():\n    from megagate.model import gate\n"
    )
    known = {"megagate.run_config", "megagate.model", "megagate.model.gate"}
    assert imports_in(source, "megagate.perf", False, known) == {"megagate.run_config", "megagate.model.gate"}


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_no_imports_up_the_layers():
    upward = [
        f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
        for m, deps in sorted(graph().items())
        for d in sorted(deps)
        if layer_of(d) > layer_of(m)
    ]
    assert upward == []


def test_cycle_finder_finds_a_planted_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]


def test_no_module_over_450_lines():
    long = {m: n for m, p in modules().items() if (n := len(p.read_text(encoding="utf-8").splitlines())) > 450}
    assert long == {}


def test_models_are_built_by_the_factory_only():
    """megatron models are built in one place (megagate.model_factory, from a RunSetup); model.build holds the
    builders themselves (and a meta-device parameter count), run_setup the TransformerConfig of a set-up."""
    allowed = {
        "build_gpt_model": {"megagate.model.build", "megagate.model_factory"},
        "transformer_config": {"megagate.model.build", "megagate.run_setup"},
        "GPTModel": {"megagate.model.build"},
    }
    callers: dict[str, set[str]] = {name: set() for name in allowed}
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in allowed:
                callers[node.func.id].add(module)
    assert {name: sorted(found - allowed[name]) for name, found in callers.items()} == {n: [] for n in allowed}
    assert callers["build_gpt_model"] == allowed["build_gpt_model"]  # the check sees the real call sites
