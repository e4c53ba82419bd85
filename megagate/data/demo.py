"""One call from nothing to a trainable dataset: real-text corpus -> BPE tokenizer -> indexed prefix, cached.

    tokenizer_path, data_prefix = prepare_demo_data("runs/demo", vocab_size=4096, max_bytes=2_000_000)

Outputs live under `work_dir/data-v<vocab>-b<bytes>/`; a second call with the same arguments reuses them
(after checking the files), so demos and tests pay the few seconds once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megagate.data.corpus import build_demo_corpus, iter_documents
from megagate.data.indexed import validate
from megagate.data.preprocess import TokenizerSpec, output_prefix_for, preprocess
from megagate.data.tokenizer import train_bpe
from megagate.errors import MegagateError


def demo_paths(work_dir: str | os.PathLike, vocab_size: int = 4096, max_bytes: int = 2_000_000) -> tuple[str, str]:
    """(tokenizer.json path, data prefix) of the demo data of these arguments, built or not (nothing is built)."""
    root = Path(work_dir) / f"data-v{vocab_size}-b{max_bytes}"
    return str(root / "tokenizer.json"), output_prefix_for(str(root / "corpus"), "text")


def run_tokenizer(data: Any) -> str | None:
    """The tokenizer file a run's `data:` section names (the demo's for a data.demo run without a blend; None for
    mock data), whether or not it is on this machine: a tool reading a finished run never builds one."""
    if data.demo and not data.blend:
        return demo_paths(data.demo_dir, data.demo_vocab_size, data.demo_max_bytes)[0]
    return data.tokenizer


def prepare_demo_data(
    work_dir: str | os.PathLike,
    vocab_size: int = 4096,
    max_bytes: int = 2_000_000,
    engine: str = "auto",
    workers: int | None = 0,
    progress: bool = False,
) -> tuple[str, str]:
    """Return (tokenizer.json path, data prefix); builds them unless a valid cached copy exists."""
    tokenizer, prefix = demo_paths(work_dir, vocab_size, max_bytes)
    tok_path, root = Path(tokenizer), Path(tokenizer).parent
    if not tok_path.exists():
        train_bpe((d["text"] for d in iter_documents(max_bytes)), tok_path, vocab_size=vocab_size)
    try:
        validate(prefix)
        return str(tok_path), prefix
    except MegagateError:
        pass  # missing or damaged: rebuild below
    corpus = build_demo_corpus(root, max_bytes)
    preprocess(
        [corpus],
        str(root / "corpus"),
        TokenizerSpec(str(tok_path), engine=engine),
        workers=workers,
        overwrite=True,
        progress=progress,
    )
    return str(tok_path), prefix
