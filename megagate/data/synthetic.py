"""A synthetic corpus where the attention sink forms at CPU scale: every document is a BOS token followed by tokens
of a fixed distribution, written as a real megatron indexed dataset plus a word-level tokenizer.

    tokenizer, prefix = write_bos_corpus("runs/sink-data", documents=4096, length=64, vocab=64, triggers=2)

Each document is exactly `length` tokens: BOS (`<|endoftext|>`, id 0, the tokenizer's end-of-document token) and
`length - 1` body tokens. megatron's GPTDataset reads `seq_length + 1` tokens per sample from the concatenated
documents and starts sample i at token i * seq_length, so with `length == train.seq_length` every sample's input
is one whole document and position 0 of every sample is BOS (tests/data/test_synthetic.py checks this through the
trainer's own dataset builder).

The body is i.i.d. from a Zipf(`zipf`) distribution over the ordinary tokens (ids `1 + triggers` ..
`vocab - 1`), so the attention has nothing to read except where `triggers > 0`: a trigger token (ids 1 ..
`triggers`, each placed with probability `trigger_rate` at a body position >= 2) is followed by a copy of the token
before it (Guo et al. 2024's "bigram-backcopy" task, where a one-layer head is active at triggers and dumps its
attention on BOS everywhere else). Same arguments, same bytes (numpy's seeded generator).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from megagate.data.indexed import IndexedWriter, token_dtype
from megagate.errors import ConfigError

BOS_TOKEN = "<|endoftext|>"
BOS_ID = 0
PREFIX_NAME = "bos_text_document"


def check_settings(documents: int, length: int, vocab: int, zipf: float, triggers: int, trigger_rate: float) -> None:
    """One-line ConfigError for a setting that cannot make the corpus."""
    checks = [
        (documents >= 2, f"documents={documents}: need at least 2 (a train and a validation split)"),
        (length >= 4, f"length={length}: need at least 4 tokens (BOS and a body)"),
        (triggers >= 0, f"triggers={triggers}: must be >= 0"),
        (vocab >= triggers + 3, f"vocab={vocab}: need BOS, the {triggers} trigger(s) and at least 2 ordinary tokens"),
        (vocab <= 65536, f"vocab={vocab}: at most 65536 tokens"),
        (zipf >= 0, f"zipf={zipf}: the Zipf exponent must be >= 0 (0: uniform)"),
        (0 <= trigger_rate < 0.5, f"trigger_rate={trigger_rate}: must be in [0, 0.5)"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def body_distribution(vocab: int, triggers: int, zipf: float) -> np.ndarray:
    """Probabilities of the ordinary tokens (ids 1 + triggers .. vocab - 1): p(rank r) ∝ r^-zipf."""
    ranks = np.arange(1, vocab - triggers, dtype=np.float64)
    p = ranks**-zipf
    return p / p.sum()


def make_documents(
    documents: int,
    length: int,
    vocab: int,
    zipf: float = 1.0,
    triggers: int = 0,
    trigger_rate: float = 0.1,
    seed: int = 0,
) -> np.ndarray:
    """[documents, length] token ids: BOS, then the body (see the module docstring)."""
    check_settings(documents, length, vocab, zipf, triggers, trigger_rate)
    rng = np.random.default_rng(seed)
    first = 1 + triggers
    body = first + rng.choice(vocab - first, size=(documents, length - 1), p=body_distribution(vocab, triggers, zipf))
    if triggers:
        # position j of the body (document position j + 1): a trigger at j needs a token before it (j >= 1) and a
        # position after it (j <= length - 3); triggers never sit next to each other (the copy follows each one)
        for d in range(documents):
            j = 1
            while j <= length - 3:
                if rng.random() < trigger_rate:
                    body[d, j] = 1 + rng.integers(triggers)
                    body[d, j + 1] = body[d, j - 1]
                    j += 3
                else:
                    j += 1
    tokens = np.empty((documents, length), dtype=np.int64)
    tokens[:, 0] = BOS_ID
    tokens[:, 1:] = body
    return tokens


def tokenizer_json(vocab: int, triggers: int) -> dict:
    """An HF word-level tokenizer.json: BOS, the triggers `<trig{k}>`, the ordinary tokens `t{id}`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {BOS_TOKEN: BOS_ID}
    words.update({f"<trig{k}>": 1 + k for k in range(triggers)})
    words.update({f"t{i}": i for i in range(1 + triggers, vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([BOS_TOKEN])
    return json.loads(tok.to_str())


def write_bos_corpus(
    out_dir: str | os.PathLike,
    documents: int = 4096,
    length: int = 64,
    vocab: int = 64,
    zipf: float = 1.0,
    triggers: int = 0,
    trigger_rate: float = 0.1,
    seed: int = 0,
) -> tuple[str, str]:
    """Write `out_dir/tokenizer.json` and `out_dir/bos_text_document.bin/.idx/.meta.json`; (tokenizer, prefix)."""
    tokens = make_documents(documents, length, vocab, zipf, triggers, trigger_rate, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_path, prefix = out / "tokenizer.json", str(out / PREFIX_NAME)
    tmp = tok_path.with_name(f"tokenizer.json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(tokenizer_json(vocab, triggers)), encoding="utf-8")
    os.replace(tmp, tok_path)
    writer = IndexedWriter(prefix, token_dtype(vocab))
    try:
        writer.add_documents(tokens.reshape(-1), np.full(documents, length, dtype=np.int32))
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    settings = dict(documents=documents, length=length, vocab=vocab, zipf=zipf, triggers=triggers)
    settings.update(trigger_rate=trigger_rate, seed=seed)
    meta = {"tokenizer": str(tok_path), "synthetic": settings}
    Path(prefix + ".meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return str(tok_path), prefix
