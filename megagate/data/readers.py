"""Streaming input readers: JSONL, JSONL.gz, plain text (whole file or one line per document), folders.

The reader runs in the main process and only cuts raw bytes into `Chunk`s (a few MB, with file and line
numbers); decoding, JSON parsing and validation happen in the workers (`parse_chunk`), so the main process is
never the bottleneck and memory stays bounded by (chunk size x chunks in flight) whatever the input size.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megagate.errors import MegagateError, require

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text", ".md")
TEXT_MODES = ("file", "line")
ALLOWED = ", ".join(s + z for s in JSONL_SUFFIXES + TEXT_SUFFIXES for z in ("", ".gz"))


def input_kind(path: Path) -> str:
    """'jsonl' or 'text' from the file name (a trailing .gz is allowed)."""
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    raise MegagateError(f"input {str(path)!r}: unsupported file type (allowed: {ALLOWED})")


def expand_inputs(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Files in a fixed order: given files as listed, folders expanded recursively in sorted order."""
    require(len(paths) > 0, "no input given (pass JSONL, JSONL.gz or text files, or folders)", MegagateError)
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(
                (q for q in p.rglob("*") if q.is_file() and not q.name.startswith(".")),
                key=lambda q: q.relative_to(p).as_posix(),
            )
            found = [q for q in found if _supported(q)]
            require(
                bool(found), f"input folder {str(p)!r} holds no supported files (allowed: {ALLOWED})", MegagateError
            )
            out += found
        elif p.is_file():
            input_kind(p)  # raises on unsupported types
            out.append(p)
        else:
            raise MegagateError(f"input {str(p)!r}: no such file or folder")
    return out


def _supported(p: Path) -> bool:
    try:
        input_kind(p)
        return True
    except MegagateError:
        return False


@dataclass
class Chunk:
    """Raw records of one file: JSONL lines, text lines, or whole text files (`line0` = 0)."""

    seq: int  # position in the stream: results are written in this order
    file: str
    kind: str  # 'jsonl' | 'line' | 'file'
    line0: int  # line number of records[0] (1-based); for 'file' chunks each record is its own file
    records: list[bytes] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # for 'file' chunks: the file of each record
    nbytes: int = 0


class _Opened:
    """A binary line stream with the on-disk position (for ETA on compressed inputs)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.raw = open(path, "rb")
        self.stream = gzip.GzipFile(fileobj=self.raw, mode="rb") if path.name.lower().endswith(".gz") else self.raw

    def disk_pos(self) -> int:
        return self.raw.tell()

    def close(self) -> None:
        self.stream.close()
        self.raw.close()


def iter_chunks(
    files: Sequence[Path], text_mode: str = "file", chunk_bytes: int = 1 << 20, on_progress=None
) -> Iterator[Chunk]:
    """Cut the inputs into chunks of about `chunk_bytes`; `on_progress(disk_bytes_done)` after each chunk."""
    require(text_mode in TEXT_MODES, f"text mode {text_mode!r}: allowed values are {', '.join(TEXT_MODES)}")
    seq = 0
    done_disk = 0
    pending: Chunk | None = None  # whole-file text records batch across files
    for path in files:
        kind = input_kind(path)
        size = path.stat().st_size
        f = _Opened(path)
        try:
            if kind == "text" and text_mode == "file":
                data = _read_all(f)
                if pending is None:
                    pending = Chunk(seq, str(path), "file", 0)
                    seq += 1
                pending.records.append(data)
                pending.files.append(str(path))
                pending.nbytes += len(data)
                if pending.nbytes >= chunk_bytes:
                    yield pending
                    pending = None
            else:
                if pending is not None:
                    yield pending
                    pending = None
                rec_kind = "jsonl" if kind == "jsonl" else "line"
                lineno = 1
                chunk = Chunk(seq, str(path), rec_kind, lineno)
                try:
                    for line in f.stream:
                        chunk.records.append(line)
                        chunk.nbytes += len(line)
                        lineno += 1
                        if chunk.nbytes >= chunk_bytes:
                            seq += 1
                            yield chunk
                            if on_progress:
                                on_progress(done_disk + f.disk_pos())
                            chunk = Chunk(seq, str(path), rec_kind, lineno)
                except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as exc:
                    raise MegagateError(
                        f"{path}: unreadable or truncated compressed input after line {lineno - 1} ({exc})"
                    ) from None
                if chunk.records:
                    seq += 1
                    yield chunk
        finally:
            f.close()
        done_disk += size
        if on_progress:
            on_progress(done_disk)
    if pending is not None:
        yield pending


def _read_all(f: _Opened) -> bytes:
    try:
        return f.stream.read()
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as exc:
        raise MegagateError(f"{f.path}: unreadable or truncated compressed input ({exc})") from None


@dataclass
class BadLine:
    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


def parse_chunk(chunk: Chunk, keys: Sequence[str]) -> tuple[list[list[str]], list[BadLine], int]:
    """Decode and validate a chunk: texts per key (aligned across keys), bad records, blank lines skipped.

    A JSONL record is used only if every key is present, a string, and not blank — so the per-key outputs
    stay aligned document for document.
    """
    texts: list[list[str]] = [[] for _ in keys]
    bad: list[BadLine] = []
    blank = 0
    for i, raw in enumerate(chunk.records):
        file = chunk.files[i] if chunk.kind == "file" else chunk.file
        line = 1 if chunk.kind == "file" else chunk.line0 + i
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            if chunk.kind == "file":
                line = raw.count(b"\n", 0, exc.start) + 1
            bad.append(BadLine(file, line, f"not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})"))
            continue
        if chunk.kind == "jsonl":
            if not text.strip():
                blank += 1
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                bad.append(BadLine(file, line, f"invalid JSON ({exc.msg} at column {exc.colno})"))
                continue
            if not isinstance(row, dict):
                bad.append(BadLine(file, line, f"not a JSON object (a {type(row).__name__})"))
                continue
            values = []
            for key in keys:
                if key not in row:
                    bad.append(BadLine(file, line, f"missing key {key!r} (keys: {', '.join(list(row)[:8])})"))
                    break
                v = row[key]
                if not isinstance(v, str):
                    bad.append(BadLine(file, line, f"key {key!r} is {type(v).__name__}, expected a string"))
                    break
                if not v.strip():
                    bad.append(BadLine(file, line, f"empty text in key {key!r}"))
                    break
                values.append(v)
            else:
                for t, v in zip(texts, values):
                    t.append(v)
        else:
            if chunk.kind == "line":
                text = text.rstrip("\r\n") if text.endswith("\n") else text
                if not text.strip():
                    blank += 1
                    continue
            elif not text.strip():
                bad.append(BadLine(file, line, "empty text"))
                continue
            texts[0].append(text)
    return texts, bad, blank
