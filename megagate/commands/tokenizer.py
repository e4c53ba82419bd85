"""`megagate tokenizer train|verify`: train a byte-level BPE; check the fast engine against HF."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from megagate.errors import ConfigError, MegagateError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    t = sub.add_parser("train", help="train a byte-level BPE tokenizer.json from JSONL or text files")
    t.add_argument("--input", "-i", nargs="+", required=True, help="JSONL or text files (plain, .gz, .zst), or folders")
    t.add_argument("--output", "-o", required=True, help="tokenizer.json path, or a folder to hold one")
    t.add_argument("--vocab-size", type=int, default=32000)
    t.add_argument("--min-frequency", type=int, default=2)
    t.add_argument("--json-keys", nargs="+", default=["text"])
    t.add_argument(
        "--special-tokens",
        nargs="+",
        default=None,
        help="default: <|endoftext|> <|pad|> (the first is end-of-document)",
    )
    t.add_argument("--text-mode", default="file", help="plain-text inputs: file | line")
    v = sub.add_parser(
        "verify",
        help="encode the vocabulary, unicode probes and optional inputs with the fast and HF engines; compare ids",
    )
    v.add_argument("tokenizer", help="tokenizer.json")
    v.add_argument("--input", "-i", nargs="*", default=[], help="also compare on these JSONL/text inputs")
    v.add_argument("--json-keys", nargs="+", default=["text"])
    v.add_argument("--probe-step", type=int, default=1, help="probe every n-th code point (default 1: all)")


def iter_texts(
    inputs: Sequence[str], keys: Sequence[str], text_mode: str = "file", stats: dict | None = None
) -> Iterator[str]:
    """All valid texts of the inputs (every key), in input order; bad records are counted in `stats`."""
    from megagate.data.readers import expand_inputs, iter_chunks, parse_chunk

    for chunk in iter_chunks(expand_inputs(inputs), text_mode):
        texts, bad, _ = parse_chunk(chunk, keys if chunk.kind == "jsonl" else keys[:1])
        if stats is not None:
            stats["bad"] = stats.get("bad", 0) + len(bad)
            if bad and "first_bad" not in stats:
                stats["first_bad"] = str(bad[0])
        for per_key in zip(*texts):
            yield from per_key


def run(args: argparse.Namespace) -> int:
    if args.action == "train":
        return _train(args)
    return _verify(args)


SHORT_VOCAB = 0.5  # a trained vocabulary below this share of the one asked for is worth a warning


def _train(args) -> int:
    from megagate.data.tokenizer import EOD_TOKEN, PAD_TOKEN, NoTrainingText, train_bpe

    out = Path(args.output)
    if out.is_dir() or not out.suffix:
        out = out / "tokenizer.json"
    stats: dict = {}
    specials = args.special_tokens or [EOD_TOKEN, PAD_TOKEN]
    texts = iter_texts(args.input, args.json_keys, args.text_mode, stats)
    try:
        path = train_bpe(
            texts, out, vocab_size=args.vocab_size, min_frequency=args.min_frequency, special_tokens=specials
        )
    except NoTrainingText:
        first = f", first: {stats['first_bad']}" if stats.get("bad") else ""
        raise MegagateError(
            f"no valid texts in {', '.join(args.input)} ({stats.get('bad', 0)} bad records{first}); {out} not written"
        ) from None
    if stats.get("bad"):
        print(f"skipped {stats['bad']} bad records (first: {stats['first_bad']})", file=sys.stderr)
    from megagate.data.tokenizer import load_tokenizer

    tok = load_tokenizer(path, engine="auto")
    print(
        f"wrote {path}: {tok.vocab_size} tokens, end-of-document id {tok.eod}, padding id {tok.pad}, engine {tok.name}"
    )
    if tok.vocab_size < SHORT_VOCAB * args.vocab_size:
        # BPE stops when no pair occurs min_frequency times: a small corpus cannot fill a large vocabulary
        print(
            f"warning: {tok.vocab_size} tokens, far below --vocab-size {args.vocab_size}: the corpus has too few "
            f"repeated pairs (--min-frequency {args.min_frequency}); give more text or a smaller --vocab-size, and "
            f"set model.vocab_size >= {tok.vocab_size}",
            file=sys.stderr,
        )
    return 0


def _verify(args) -> int:
    import numpy as np

    from megagate.data.fast_bpe import FastBPE, UnsupportedVocabulary, verify_vocabulary
    from megagate.data.tokenizer import HFTokenizer

    try:
        fast = FastBPE.from_tokenizer_json(args.tokenizer)
    except UnsupportedVocabulary as exc:
        raise ConfigError(
            f"{args.tokenizer}: the fast engine cannot express this vocabulary ({exc}); the hf engine will be used"
        ) from None
    except (OSError, ValueError) as exc:  # missing, not JSON, or JSON of another shape
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise MegagateError(f"{args.tokenizer}: not a readable tokenizer.json ({reason})") from None
    bad = verify_vocabulary(args.tokenizer, fast, probe_step=max(1, args.probe_step))
    hf = HFTokenizer(args.tokenizer)
    n_docs = n_tok = 0
    if args.input:
        batch: list[str] = []
        for text in iter_texts(args.input, args.json_keys):
            batch.append(text)
            if len(batch) == 256:
                n_docs, n_tok = _compare(hf, fast, batch, bad, n_docs, n_tok, np)
                batch = []
        n_docs, n_tok = _compare(hf, fast, batch, bad, n_docs, n_tok, np)
    if bad:
        print(f"MISMATCH on {len(bad)} texts, first: {bad[0][:80]!r}")
        return 1
    print(f"fast engine matches HF: vocabulary entries, unicode probes and {n_docs:,} input texts ({n_tok:,} tokens)")
    return 0


def _compare(hf, fast, batch, bad, n_docs, n_tok, np):
    if not batch:
        return n_docs, n_tok
    for t, want, got in zip(batch, hf.encode_batch(batch), fast.encode_batch(batch)):
        if not np.array_equal(want, got):
            bad.append(t)
        n_tok += want.size
    return n_docs + len(batch), n_tok
