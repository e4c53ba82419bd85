"""One call from nothing to a trainable dataset: real-text corpus -> BPE tokenizer -> indexed prefix, cached.

    tokenizer_path, data_prefix = prepare_demo_data("runs/demo", vocab_size=4096, max_bytes=2_000_000)

Outputs live under `work_dir/data-v<vocab>-b<bytes>/`; a second call with the same arguments reuses them
(after checking the files), so demos and tests pay the few seconds once.
"""

from __future__ import annotations

import os
from pathlib import Path

from megagate.data.corpus import build_demo_corpus, iter_documents
from megagate.data.indexed import validate
from megagate.data.preprocess import TokenizerSpec, output_prefix_for, preprocess
from megagate.data.tokenizer import train_bpe
from megagate.errors import MegagateError


def prepare_demo_data(
    work_dir: str | os.PathLike,
    vocab_size: int = 4096,
    max_bytes: int = 2_000_000,
    engine: str = "auto",
    workers: int | None = 0,
    progress: bool = False,
) -> tuple[str, str]:
    """Return (tokenizer.json path, data prefix); builds them unless a valid cached copy exists."""
    root = Path(work_dir) / f"data-v{vocab_size}-b{max_bytes}"
    tok_path = root / "tokenizer.json"
    prefix = output_prefix_for(str(root / "corpus"), "text")
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
