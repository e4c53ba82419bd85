"""Streaming input readers: JSONL and text (plain, .gz, .zst; a text file is one document or one per line),
Parquet (one string column per key, a row group at a time), folders and glob patterns.

The reader runs in the main process and only cuts raw bytes into `Chunk`s (a few MB, with file and line
numbers); decoding, JSON parsing and validation happen in the workers (`parse_chunk`), so the main process is
never the bottleneck and memory stays bounded by (chunk size x chunks in flight) whatever the input size.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megagate.data.formats import (
    ALLOWED,
    READ_ERRORS,
    Opened,
    check_columns,
    input_kind,
    iter_row_group_columns,
    open_parquet,
    row_group_bytes,
)
from megagate.errors import MegagateError, require

TEXT_MODES = ("file", "line")
__all__ = ["ALLOWED", "TEXT_MODES", "BadLine", "Chunk", "Piece", "expand_inputs", "input_kind", "iter_chunks"]


def expand_inputs(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Files in a fixed order: given files as listed, folders expanded recursively and glob patterns (``*``, ``?``,
    ``[...]``, ``**``) expanded, each in sorted order."""
    require(len(paths) > 0, f"no input given (pass files, folders or glob patterns: {ALLOWED})", MegagateError)
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
        elif any(c in str(raw) for c in "*?["):
            found = [Path(q) for q in sorted(glob.glob(str(raw), recursive=True)) if os.path.isfile(q)]
            found = [q for q in found if _supported(q)]
            require(
                bool(found),
                f"input pattern {str(raw)!r} matches no supported files (allowed: {ALLOWED})",
                MegagateError,
            )
            out += found
        else:
            raise MegagateError(f"input {str(p)!r}: no such file or folder")
    return out


def _supported(p: Path) -> bool:
    try:
        input_kind(p)
        return True
    except MegagateError:
        return False


@dataclass(frozen=True)
class Piece:
    """A part of one input: the whole file, or row groups `[rg_start, rg_stop)` of a Parquet file."""

    path: Path
    rg_start: int | None = None
    rg_stop: int | None = None


@dataclass
class Chunk:
    """Raw records of one file: JSONL lines, text lines, whole text files (`line0` = 0) or Parquet column values."""

    seq: int  # position in the stream: results are written in this order
    file: str
    kind: str  # 'jsonl' | 'line' | 'file' | 'parquet'
    line0: int  # line (or Parquet row) number of records[0] (1-based); for 'file' chunks each record is its own file
    records: list = field(default_factory=list)  # bytes, or for 'parquet' one list of values per column
    files: list[str] = field(default_factory=list)  # for 'file' chunks: the file of each record
    nbytes: int = 0
    disk_done: int = 0  # Parquet: compressed bytes of the piece's row groups read so far (for the progress line)


def iter_chunks(
    files: Sequence[Path | Piece],
    text_mode: str = "file",
    chunk_bytes: int = 1 << 20,
    on_progress=None,
    columns: Sequence[str] = ("text",),
) -> Iterator[Chunk]:
    """Cut the inputs into chunks of about `chunk_bytes`; `on_progress(disk_bytes_done)` after each chunk.

    `columns`: the Parquet columns read (one per JSON key)."""
    require(text_mode in TEXT_MODES, f"text mode {text_mode!r}: allowed values are {', '.join(TEXT_MODES)}")
    seq = 0
    done_disk = 0
    pending: Chunk | None = None  # whole-file text records batch across files
    for item in files:
        piece = item if isinstance(item, Piece) else Piece(Path(item))
        path = piece.path
        kind = input_kind(path)
        if kind == "parquet":
            if pending is not None:
                yield pending
                pending = None
            for chunk in _parquet_chunks(piece, columns, chunk_bytes, seq):
                seq = chunk.seq + 1
                yield chunk
                if on_progress:
                    on_progress(done_disk + chunk.disk_done)
            done_disk += piece_disk_bytes(piece)
            if on_progress:
                on_progress(done_disk)
            continue
        size = path.stat().st_size
        f = Opened(path)
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
                except READ_ERRORS as exc:
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


def piece_disk_bytes(piece: Piece) -> int:
    """Bytes on disk a piece stands for: the file, or its row groups' compressed bytes."""
    if piece.rg_start is None:
        return piece.path.stat().st_size
    sizes = row_group_bytes(open_parquet(piece.path))
    return sum(sizes[piece.rg_start : piece.rg_stop])


def _parquet_chunks(piece: Piece, columns: Sequence[str], chunk_bytes: int, seq: int) -> Iterator[Chunk]:
    pf = open_parquet(piece.path)
    check_columns(piece.path, pf, columns)
    md = pf.metadata
    start = piece.rg_start or 0
    stop = md.num_row_groups if piece.rg_stop is None else piece.rg_stop
    row0 = 1 + sum(md.row_group(g).num_rows for g in range(start))
    sizes = row_group_bytes(pf)
    disk = 0
    chunk = Chunk(seq, str(piece.path), "parquet", row0, [[] for _ in columns])
    for g, values in iter_row_group_columns(piece.path, pf, columns, start, stop):
        disk += sizes[g]
        n = len(values[0])
        for i in range(0, n, 4096):  # a few thousand rows at a time keep the chunk near its size
            part = [v[i : i + 4096] for v in values]
            for col, vals in zip(chunk.records, part):
                col += vals
            chunk.nbytes += sum(len(s) for s in part[0] if s)
            if chunk.nbytes >= chunk_bytes:
                chunk.disk_done = disk
                yield chunk
                row0 += len(chunk.records[0])
                chunk = Chunk(chunk.seq + 1, str(piece.path), "parquet", row0, [[] for _ in columns])
    if chunk.records[0]:
        chunk.disk_done = disk
        yield chunk


def _read_all(f: Opened) -> bytes:
    try:
        return f.stream.read()
    except READ_ERRORS as exc:
        raise MegagateError(f"{f.path}: unreadable or truncated compressed input ({exc})") from None


@dataclass
class BadLine:
    file: str
    line: int
    reason: str
    row: bool = False  # a Parquet row number rather than a line number

    def __str__(self) -> str:
        return f"{self.file} row {self.line}: {self.reason}" if self.row else f"{self.file}:{self.line}: {self.reason}"


def parse_chunk(chunk: Chunk, keys: Sequence[str]) -> tuple[list[list[str]], list[BadLine], int]:
    """Decode and validate a chunk: texts per key (aligned across keys), bad records, blank lines skipped.

    A JSONL record is used only if every key is present, a string, and not blank — so the per-key outputs
    stay aligned document for document.
    """
    if chunk.kind == "parquet":
        return _parse_columns(chunk, keys)
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


def _parse_columns(chunk: Chunk, keys: Sequence[str]) -> tuple[list[list[str]], list[BadLine], int]:
    """A Parquet chunk's rows: kept when every column holds non-blank text (nulls and blanks are bad records)."""
    texts: list[list[str]] = [[] for _ in keys]
    bad: list[BadLine] = []
    for i, row in enumerate(zip(*chunk.records)):
        for key, v in zip(keys, row):
            if v is None:
                bad.append(BadLine(chunk.file, chunk.line0 + i, f"null in column {key!r}", row=True))
                break
            if not v.strip():
                bad.append(BadLine(chunk.file, chunk.line0 + i, f"empty text in column {key!r}", row=True))
                break
        else:
            for t, v in zip(texts, row):
                t.append(v)
    return texts, bad, 0
