"""Mixed preprocessing inputs from the real-text corpus: a Parquet file of several row groups, a JSONL.zst and a
JSONL, each document a paragraph of the stdlib's docstrings and sources (megagate.data.corpus)."""

from __future__ import annotations

import json
from pathlib import Path

from megagate.data.corpus import build_documents


def paragraphs(max_bytes: int) -> list[str]:
    """The corpus cut at blank lines: many documents of real text (a few tokens to a few thousand)."""
    out = []
    for doc in build_documents(max_bytes):
        out += [p for p in doc["text"].split("\n\n") if p.strip()]
    return out


def write_mixed(folder: Path, texts: list[str], row_group_rows: int = 64) -> list[Path]:
    """a.parquet (text column plus an int column), b.jsonl.zst, c.jsonl: a third of `texts` each, in that order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    folder.mkdir(parents=True, exist_ok=True)
    n = len(texts) // 3
    a, b, c = texts[:n], texts[n : 2 * n], texts[2 * n :]
    pq.write_table(
        pa.table({"id": list(range(len(a))), "text": a}), folder / "a.parquet", row_group_size=row_group_rows
    )
    lines = "".join(json.dumps({"text": t}) + "\n" for t in b).encode()
    (folder / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(lines))
    (folder / "c.jsonl").write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(c)))
    return [folder / "a.parquet", folder / "b.jsonl.zst", folder / "c.jsonl"]
