"""A deterministic real-text corpus built from files every CPython install has — no download.

Documents come from three sources, interleaved so that prose and code stay balanced by bytes:

- prose: the docstrings of each stdlib module (module, class and function docstrings, parsed with `ast`,
  so nothing is imported or executed), one document per module;
- code: the stdlib `.py` source files themselves, one document per file;
- licenses: the texts under `/usr/share/common-licenses` when that folder exists (Debian/Ubuntu).

Order is fixed (sorted paths) and the selection depends only on the Python installation and `max_bytes`, so
two runs on the same machine produce byte-identical corpora.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from megagate.errors import require
from megagate.files import atomic_path

# Test suites and GUI demos are large and repetitive; leaving them out keeps the mix closer to real text.
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo", "ensurepip"}
_MAX_FILE_BYTES = 96_000  # one huge file should not dominate a small corpus
_LICENSE_DIR = Path("/usr/share/common-licenses")


def stdlib_sources() -> list[Path]:
    """The stdlib `.py` files, sorted by path relative to the stdlib root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in filenames:
            if name.endswith(".py"):
                files.append(Path(dirpath) / name)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_text(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if not data or len(data) > _MAX_FILE_BYTES:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def module_docstrings(source: str) -> str | None:
    """All docstrings of one module's source (module, classes, functions), separated by blank lines."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 40:  # skip one-word stubs like "Return self."
                parts.append(doc)
    return "\n\n".join(parts) if parts else None


def _prose() -> Iterator[dict]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_sources():
        text = _read_text(path)
        docs = module_docstrings(text) if text else None
        if docs:
            yield {"id": f"doc:{path.relative_to(root).as_posix()}", "source": "docstring", "text": docs}


def _code() -> Iterator[dict]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_sources():
        text = _read_text(path)
        if text and text.strip():
            yield {"id": f"code:{path.relative_to(root).as_posix()}", "source": "code", "text": text}


def _licenses() -> list[dict]:
    if not _LICENSE_DIR.is_dir():
        return []
    out = []
    for path in sorted(_LICENSE_DIR.iterdir()):
        if path.is_file() and not path.is_symlink():
            text = _read_text(path)
            if text and text.strip():
                out.append({"id": f"license:{path.name}", "source": "license", "text": text})
    return out


def iter_documents(max_bytes: int | None = None) -> Iterator[dict]:
    """Yield `{"id", "source", "text"}` documents until `max_bytes` of UTF-8 text (None: everything).

    Prose (docstrings and licenses) and code alternate by byte count so any prefix of the corpus is a
    roughly even mix of English and Python.
    """
    require(max_bytes is None or max_bytes > 0, f"max_bytes={max_bytes!r}: must be a positive byte count or None")
    # Generators: a small corpus only reads (and parses) the files it needs.
    streams = {"prose": itertools.chain(_licenses(), _prose()), "code": _code()}
    sizes = {"prose": 0, "code": 0}
    total = 0
    while streams:
        kind = min(streams, key=lambda k: (sizes[k], k))  # the source that is behind in bytes goes next
        doc = next(streams[kind], None)
        if doc is None:
            del streams[kind]
            continue
        n = len(doc["text"].encode("utf-8"))
        sizes[kind] += n
        total += n
        yield doc
        if max_bytes is not None and total >= max_bytes:
            return


def build_documents(max_bytes: int | None = None) -> list[dict]:
    """The corpus as a list (see `iter_documents`)."""
    return list(iter_documents(max_bytes))


def write_jsonl(docs, path: str | os.PathLike, keys: tuple[str, ...] | None = None) -> Path:
    """Write documents as JSONL atomically (temp name, then rename); `keys` selects fields (default: all)."""
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for doc in docs:
            row = doc if keys is None else {k: doc[k] for k in keys}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def build_demo_corpus(out_dir: str | os.PathLike, max_bytes: int = 2_000_000) -> Path:
    """Write the corpus (up to `max_bytes` of text) to `out_dir/corpus-<max_bytes>.jsonl`; reuse it if present."""
    path = Path(out_dir) / f"corpus-{max_bytes}.jsonl"
    if not path.exists():
        write_jsonl(iter_documents(max_bytes), path)
    return path
