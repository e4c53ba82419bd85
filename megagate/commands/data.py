"""`megagate data inspect PREFIX`: counts, length histogram and a decoded sample of an indexed dataset.
`megagate data synth --out DIR`: the synthetic BOS corpus of megagate.data.synthetic (where a sink forms on a CPU)."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from megagate.errors import MegagateError, require


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    i = sub.add_parser("inspect", help="documents, tokens, length histogram and a decoded sample of PREFIX(.bin/.idx)")
    i.add_argument(
        "prefix",
        help="dataset prefix (PREFIX.bin and PREFIX.idx), or a sharded run's PREFIX.units/ or its manifest.json",
    )
    i.add_argument(
        "--tokenizer", "-t", default=None, help="tokenizer to decode with (default: the one named in PREFIX.meta.json)"
    )
    i.add_argument("--document", type=int, default=0, help="index of the document to decode (default 0)")
    i.add_argument("--max-chars", type=int, default=600, help="characters of the decoded sample to print")
    i.add_argument("--json", action="store_true", help="print the statistics as JSON")
    s = sub.add_parser(
        "synth",
        help="write a synthetic corpus: BOS + i.i.d. Zipf tokens (+ backcopy triggers) per document, and its tokenizer",
    )
    s.add_argument("--out", required=True, help="folder for tokenizer.json and bos_text_document.bin/.idx")
    s.add_argument("--documents", type=int, default=4096, help="number of documents (default 4096)")
    s.add_argument("--length", type=int, default=64, help="tokens per document, BOS included (= train.seq_length)")
    s.add_argument("--vocab", type=int, default=64, help="vocabulary size: BOS, triggers, ordinary tokens (default 64)")
    s.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the body tokens (0: uniform; default 1)")
    s.add_argument("--triggers", type=int, default=0, help="trigger tokens followed by a backcopy (default 0: i.i.d.)")
    s.add_argument("--trigger-rate", type=float, default=0.1, help="chance of a trigger at a body position (0.1)")
    s.add_argument("--seed", type=int, default=0, help="random seed (same arguments, same bytes)")


def length_histogram(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """(low, high, count) per power-of-two bucket of document length in tokens."""
    if lengths.size == 0:
        return []
    top = int(np.ceil(np.log2(max(2, int(lengths.max()) + 1))))
    edges = [0] + [2**k for k in range(top + 1)]
    counts, _ = np.histogram(lengths, bins=np.asarray(edges) + 0.5)
    return [(edges[k] + 1, edges[k + 1], int(c)) for k, c in enumerate(counts) if c]


def inspect_prefix(prefix: str, tokenizer: str | None = None, document: int = 0, max_chars: int = 600) -> dict:
    from megagate.data.indexed import read_document, strip_suffix, validate

    prefix = strip_suffix(prefix)
    require(max_chars >= 0, f"--max-chars {max_chars}: must be >= 0", MegagateError)
    if os.path.isdir(prefix) and not os.path.exists(prefix + ".idx"):
        raise MegagateError(f"{prefix}: a folder, not a dataset prefix (give PREFIX for PREFIX.bin and PREFIX.idx)")
    meta_path = prefix + ".meta.json"
    meta = _read_meta(meta_path)
    tok = None
    tok_path = tokenizer or meta.get("tokenizer")
    if tok_path:
        from megagate.data.tokenizer import load_tokenizer

        if not os.path.exists(tok_path):
            raise MegagateError(
                f"tokenizer {tok_path!r} (from {meta_path if not tokenizer else '--tokenizer'}) does not exist; pass --tokenizer"
            )
        tok = load_tokenizer(tok_path, engine="hf", tiktoken_pattern=meta.get("tiktoken_pattern", "cl100k"))
    info = validate(prefix, vocab_size=tok.vocab_size if tok else None)
    lengths = info.pop("lengths").astype(np.int64)
    stats = {
        "prefix": prefix,
        "dtype": info["dtype"].name,
        "documents": info["documents"],
        "sequences": info["sequences"],
        "tokens": info["tokens"],
        "bin_bytes": os.path.getsize(prefix + ".bin"),
        "length_min": int(lengths.min()) if lengths.size else 0,
        "length_mean": float(lengths.mean()) if lengths.size else 0.0,
        "length_median": float(np.median(lengths)) if lengths.size else 0.0,
        "length_max": int(lengths.max()) if lengths.size else 0,
        "histogram": length_histogram(lengths),
        "tokenizer": tok_path,
    }
    if info["sequences"]:
        require(
            0 <= document < info["sequences"],
            f"--document {document}: the dataset has documents 0..{info['sequences'] - 1}",
            MegagateError,
        )
        ids = read_document(prefix, document)
        stats["sample_document"] = document
        stats["sample_ids"] = [int(x) for x in ids[:32]]
        if tok is not None:
            stats["sample_text"] = tok.decode(ids)[:max_chars]
            if tok.eod is not None:
                stats["documents_ending_in_eod"] = _count_ending(prefix, info["dtype"], lengths, tok.eod)
    return stats


def _read_meta(path: str) -> dict:
    """The dataset's `.meta.json` written by `megagate preprocess` ({} if absent); one line naming it if damaged."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MegagateError(f"{path}: not a JSON metadata file ({exc}); delete it or pass --tokenizer") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("tokenizer", ""), str):
        raise MegagateError(f"{path}: not the metadata `megagate preprocess` writes; delete it or pass --tokenizer")
    return meta


def _count_ending(prefix: str, dtype, lengths: np.ndarray, eod: int) -> int:
    # last token of every document, read straight from the memory map
    ends = np.cumsum(lengths) - 1
    tokens = np.memmap(prefix + ".bin", mode="r", dtype=dtype)
    return int(np.count_nonzero(tokens[ends] == eod))


def inspect_units(path: str) -> dict:
    """A sharded run's units: documents and tokens of each, every done unit's `.idx` checked against its `.bin`."""
    from pathlib import Path

    from megagate.data import units as U
    from megagate.data.indexed import validate

    udir = Path(path).parent if path.endswith(U.MANIFEST) else Path(path)
    manifest = U.read_manifest(udir)
    done = U.done_units(udir, manifest)
    rows = []
    for unit in manifest["units"]:
        row = {"unit": unit["id"], "task": unit["task"], "input_bytes": unit["bytes"], "done": unit["id"] in done}
        if row["done"]:
            for key in manifest["settings"]["keys"]:
                info = validate(f"{U.unit_prefix(udir, unit['id'])}_{key}_document")  # one line naming a bad file
                row.setdefault("documents", info["documents"])
                row["tokens"] = row.get("tokens", 0) + info["tokens"]
        rows.append(row)
    return {
        "units_dir": str(udir),
        "tasks": manifest["tasks"],
        "units": rows,
        "missing": [r["unit"] for r in rows if not r["done"]],
    }


def _run_units(args: argparse.Namespace) -> int:
    stats = inspect_units(args.prefix)
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    rows = stats["units"]
    print(
        f"units     {stats['units_dir']}: {len(rows)} units in {stats['tasks']} tasks, {len(stats['missing'])} not done"
    )
    print(f"{'unit':>6} {'task':>5} {'input MB':>10} {'documents':>11} {'tokens':>13}")
    for r in rows:
        docs = f"{r['documents']:,}" if r["done"] else "not done"
        toks = f"{r['tokens']:,}" if r["done"] else ""
        print(f"{r['unit']:>6} {r['task']:>5} {r['input_bytes'] / 1e6:>10.1f} {docs:>11} {toks:>13}")
    done = [r for r in rows if r["done"]]
    print(
        f"total  {sum(r['documents'] for r in done):,} documents, {sum(r['tokens'] for r in done):,} tokens in {len(done)} done units (every .idx matches its .bin)"
    )
    return 0


def _run_synth(args: argparse.Namespace) -> int:
    from megagate.data.synthetic import write_bos_corpus

    tokenizer, prefix = write_bos_corpus(
        args.out, args.documents, args.length, args.vocab, args.zipf, args.triggers, args.trigger_rate, args.seed
    )
    print(f"wrote {prefix}.bin/.idx ({args.documents:,} documents x {args.length} tokens, BOS first) and {tokenizer}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "synth":
        return _run_synth(args)
    if args.prefix.rstrip("/").endswith((".units", "manifest.json")):
        return _run_units(args)
    stats = inspect_prefix(args.prefix, args.tokenizer, args.document, args.max_chars)
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(f"dataset   {stats['prefix']}.bin/.idx ({stats['bin_bytes']:,} bytes, tokens stored as {stats['dtype']})")
    print(f"documents {stats['documents']:,}   tokens {stats['tokens']:,}")
    print(
        f"length    min {stats['length_min']:,}  median {stats['length_median']:,.0f}  mean {stats['length_mean']:,.1f}  max {stats['length_max']:,}"
    )
    if "documents_ending_in_eod" in stats:
        print(
            f"eod       {stats['documents_ending_in_eod']:,} of {stats['documents']:,} documents end with the end-of-document token"
        )
    print("length histogram (tokens per document):")
    top = max((c for _, _, c in stats["histogram"]), default=1)
    for lo, hi, c in stats["histogram"]:
        print(f"  {lo:>9,}-{hi:<9,} {c:>9,} {'#' * max(1, round(40 * c / top))}")
    if "sample_document" in stats:
        print(f"document {stats['sample_document']}: first ids {stats['sample_ids'][:16]}")
        if "sample_text" in stats:
            print("decoded:")
            print(stats["sample_text"])
        else:
            print("(no tokenizer known: pass --tokenizer to decode)")
    return 0
