"""The worked example of docs/gate_variants.md, read from the doc itself so that the doc and its test cannot drift.

Each registry block of the doc is a Python block whose first line is the registry's declaration, verbatim from its
file, followed by `# <file>`; the block's body holds the entries to add. `register` evaluates those entries in the
target module's namespace and installs a copy of the registry with them added.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "gate_variants.md"
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_HEADER = re.compile(r"^((\w+)(?::[^=]*)? = \{)  # (megagate/model/\w+\.py)$")


class Block(NamedTuple):
    path: str  # e.g. megagate/model/gate.py
    registry: str  # e.g. ACTIVATIONS
    declaration: str  # the registry's declaration line, as in `path`
    literal: str  # "{ ... }": a dict literal with the entries to add


def registry_blocks(doc: Path = DOC) -> list[Block]:
    """The doc's registry blocks, in order (other Python blocks are prose examples and are skipped)."""
    blocks = []
    for code in _FENCE.findall(doc.read_text(encoding="utf-8")):
        first, _, rest = code.partition("\n")
        match = _HEADER.match(first)
        if match:
            declaration, registry, path = match.groups()
            blocks.append(Block(path, registry, declaration, "{\n" + rest))
    return blocks


def module_of(block: Block) -> Any:
    return importlib.import_module(block.path[: -len(".py")].replace("/", "."))


def register(patch: Callable[[Any, str, Any], None] = setattr) -> dict[str, list[str]]:
    """Add the doc's entries to copies of the registries it names; returns {registry: the names added}.

    `patch` installs each copy: pytest's `monkeypatch.setattr` (undone after the test), or plain `setattr` in a
    worker process that ends with the test.
    """
    added: dict[str, list[str]] = {}
    for block in registry_blocks():
        module = module_of(block)
        entries = eval(block.literal, vars(module))  # noqa: S307 - the repository's own doc
        table = dict(getattr(module, block.registry))
        clash = sorted(set(entries) & set(table))
        if clash:
            raise AssertionError(f"{block.registry} already has {clash}: the doc's example is no longer an example")
        table.update(entries)
        patch(module, block.registry, table)
        added[f"{block.path}:{block.registry}"] = list(entries)
    return added
