"""Shared fixtures for the data tests: a small real corpus and tokenizers trained on it (once per session)."""

from __future__ import annotations

import os
import warnings

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
warnings.filterwarnings("ignore")

SMALL_BYTES = 300_000


@pytest.fixture(scope="session")
def small_docs() -> list[dict]:
    from megagate.data.corpus import build_documents

    return build_documents(SMALL_BYTES)


@pytest.fixture(scope="session")
def full_docs() -> list[dict]:
    from megagate.data.corpus import build_documents

    return build_documents(None)


@pytest.fixture(scope="session")
def small_tok(tmp_path_factory, small_docs) -> str:
    """A 2048-token byte-level BPE trained on the small corpus."""
    from megagate.data.tokenizer import train_bpe

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return str(train_bpe((d["text"] for d in small_docs), path, vocab_size=2048))


@pytest.fixture(scope="session")
def big_tok(tmp_path_factory, full_docs) -> str:
    """A 32k byte-level BPE trained on the whole corpus (the issue's benchmark vocabulary size)."""
    from megagate.data.tokenizer import train_bpe

    path = tmp_path_factory.mktemp("tok32k") / "tokenizer.json"
    return str(train_bpe((d["text"] for d in full_docs), path, vocab_size=32000))
