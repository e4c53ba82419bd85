"""Code that only a GPU machine runs still names things that exist.

The GPU tests skip without CUDA before their bodies run, and the acceptance's parts import megagate inside their
functions, so a module or function renamed elsewhere would first fail on the GPU machine, in its one short window.
Here every `from X import Y` of megagate, the tests' helpers and the acceptance's own modules in those files is
resolved for real, wherever it stands (inside functions too), and every `alias.attribute` read off an imported
megagate module is looked up.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted([*(ROOT / "tests" / "gpu").glob("*.py"), *(ROOT / "tools" / "acceptance").glob("*.py")])
FILES.append(ROOT / "tools" / "gpu_acceptance.py")
OURS = ("megagate", "helpers", "tools")


def references(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) of every import of our code in `path`, and (line, module, attribute) of every
    attribute read off a module imported by name (`from megagate.model import gate as gates` ... `gates.preset`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[int, str, str | None]] = []
    aliases: dict[str, str] = {}  # local name -> dotted module, where the imported name is a module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS and not node.level:
            for alias in node.names:
                found.append((node.lineno, node.module, alias.name))
                candidate = f"{node.module}.{alias.name}"
                if importlib.util.find_spec(node.module) and _is_module(candidate):
                    aliases[alias.asname or alias.name] = candidate
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in OURS:
                    found.append((node.lineno, alias.name, None))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            found.append((node.lineno, aliases[node.value.id], node.attr))
    return found


def _is_module(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except (ImportError, ValueError):
        return False


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_resolves(path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))  # the GPU tests import `helpers` from tests/
    monkeypatch.syspath_prepend(str(ROOT))
    missing = []
    for line, module, name in references(path):
        try:
            imported = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{path.name}:{line}: {module}: {exc}")
            continue
        if name is not None and not hasattr(imported, name) and not _is_module(f"{module}.{name}"):
            missing.append(f"{path.name}:{line}: {module} has no {name!r}")
    assert not missing, "\n".join(missing)
