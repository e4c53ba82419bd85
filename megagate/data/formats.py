"""Input formats of `megagate preprocess`: what a file is from its name, and streaming openers for each kind.

JSONL and text may be plain, `.gz` or `.zst` (zstandard, several frames allowed); Parquet files are read a row group
at a time (pyarrow), one chosen string column per JSON key. Every opener keeps memory bounded by a read block or a
row group, whatever the file's size, and every damaged file is one line naming the file and where it broke.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from megagate.errors import MegagateError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text", ".md")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSIONS = ("", ".gz", ".zst")
ALLOWED = ", ".join([s + z for s in JSONL_SUFFIXES + TEXT_SUFFIXES for z in COMPRESSIONS] + list(PARQUET_SUFFIXES))
_READ_BLOCK = 1 << 20  # compressed bytes read at a time from a .zst file


def input_kind(path: Path) -> str:
    """'jsonl', 'text' or 'parquet' from the file name (a trailing .gz or .zst is allowed on jsonl and text)."""
    name = path.name.lower()
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    for z in (".gz", ".zst"):
        if name.endswith(z):
            name = name[: -len(z)]
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    raise MegagateError(f"input {str(path)!r}: unsupported file type (allowed: {ALLOWED})")


class ZstLines:
    """Lines of a zstandard file, decompressed a block at a time; a truncated or corrupt stream raises
    MegagateError naming the compressed byte offset (zstandard's stream reader stops silently at a cut)."""

    def __init__(self, raw) -> None:
        import zstandard

        self.raw = raw
        self._zstd = zstandard
        self._dctx = zstandard.ZstdDecompressor()

    def _blocks(self) -> Iterator[bytes]:
        dobj = self._dctx.decompressobj()
        started = False  # a frame has begun and not yet ended
        while True:
            data = self.raw.read(_READ_BLOCK)
            if not data:
                break
            while data:
                try:
                    out = dobj.decompress(data)
                except self._zstd.ZstdError as exc:
                    raise MegagateError(
                        f"{self.raw.name}: corrupt zstd stream near compressed byte {self.raw.tell() - len(data)} ({exc})"
                    ) from None
                started = True
                if out:
                    yield out
                if dobj.eof:  # a frame ended: the rest of the block belongs to the next frame
                    data = dobj.unused_data
                    dobj = self._dctx.decompressobj()
                    started = bool(data)
                else:
                    data = b""
        if started and not dobj.eof:
            raise MegagateError(
                f"{self.raw.name}: truncated zstd stream: it ends inside a frame at compressed byte {self.raw.tell()}"
            )

    def __iter__(self) -> Iterator[bytes]:
        rest = b""
        for block in self._blocks():
            lines = (rest + block).split(b"\n")
            rest = lines.pop()
            for line in lines:
                yield line + b"\n"
        if rest:
            yield rest

    def read(self) -> bytes:
        return b"".join(self._blocks())

    def close(self) -> None:
        pass


class Opened:
    """A binary line stream of a JSONL or text file (plain, gzip or zstd) with the on-disk position (for ETA)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.raw = open(path, "rb")
        name = path.name.lower()
        if name.endswith(".gz"):
            self.stream = gzip.GzipFile(fileobj=self.raw, mode="rb")
        elif name.endswith(".zst"):
            self.stream = ZstLines(self.raw)
        else:
            self.stream = self.raw

    def disk_pos(self) -> int:
        return self.raw.tell()

    def close(self) -> None:
        self.stream.close()
        self.raw.close()


READ_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error, OSError)


# ---------------------------------------------------------------- Parquet
def open_parquet(path: Path):
    """pyarrow's ParquetFile, or one line naming the file when its footer is unreadable."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise MegagateError(f"{path}: not a readable Parquet file ({exc})") from None


def check_columns(path: Path, pf, columns: Sequence[str]) -> None:
    """Every column exists and holds strings (nested and non-string columns are refused in one line)."""
    import pyarrow as pa

    schema = pf.schema_arrow
    for col in columns:
        if col not in schema.names:
            raise MegagateError(f"{path}: no column {col!r} (columns: {', '.join(schema.names[:12])})")
        typ = schema.field(col).type
        if pa.types.is_nested(typ):
            raise MegagateError(f"{path}: column {col!r} is nested ({typ}); a text column must hold strings")
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_string_view(typ)):
            raise MegagateError(f"{path}: column {col!r} is {typ}, expected a string column")


def iter_row_group_columns(
    path: Path, pf, columns: Sequence[str], start: int, stop: int
) -> Iterator[tuple[int, list[list]]]:
    """(row group, [values of each column]) for row groups start..stop-1, one row group in memory at a time."""
    import pyarrow as pa

    for g in range(start, stop):
        try:
            # one thread: tokenizing, not decoding, is the bottleneck (and pyarrow stays idle when workers fork)
            table = pf.read_row_group(g, columns=list(columns), use_threads=False)
        except (pa.ArrowException, OSError) as exc:
            raise MegagateError(f"{path}: row group {g} is unreadable ({exc})") from None
        yield g, [table.column(c).to_pylist() for c in columns]


def row_group_bytes(pf) -> list[int]:
    """Compressed bytes of each row group (for cutting units and for the progress line)."""
    md = pf.metadata
    return [
        sum(md.row_group(g).column(c).total_compressed_size for c in range(md.num_columns))
        for g in range(md.num_row_groups)
    ]
