"""`megagate preprocess`: inputs -> `<output-prefix>_<key>_document.{bin,idx}` (see megagate.data.preprocess)."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys

from megagate.errors import MegagateError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input", "-i", nargs="+", required=True, help="JSONL, JSONL.gz or text files, or folders of them"
    )
    parser.add_argument("--output-prefix", "-o", required=True, help="outputs are <prefix>_<key>_document.bin/.idx")
    parser.add_argument(
        "--tokenizer", "-t", required=True, help="tokenizer.json, SentencePiece .model or tiktoken BPE file"
    )
    parser.add_argument("--engine", default="auto", help="for tokenizer.json: auto | fast | hf (default auto)")
    parser.add_argument(
        "--json-keys", nargs="+", default=["text"], help="JSON keys to tokenize, one dataset each (default: text)"
    )
    parser.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end each document with the end-of-document token (default: on)",
    )
    parser.add_argument(
        "--workers", "-w", type=int, default=None, help="tokenizer processes (default: CPU count; 0: in this process)"
    )
    parser.add_argument(
        "--text-mode", default="file", help="plain-text inputs: file (one document per file) | line (one per line)"
    )
    parser.add_argument("--bad-lines", default="skip", help="skip (count and report) | error (stop, write nothing)")
    parser.add_argument(
        "--eod-token", default=None, help="end-of-document token text (default: <|endoftext|>, </s>, ...)"
    )
    parser.add_argument(
        "--tiktoken-pattern", default="cl100k", help="split regex for tiktoken files: gpt2 | cl100k | o200k | a regex"
    )
    parser.add_argument(
        "--chunk-mb", type=float, default=1.0, help="input chunk size handed to a worker (default 1 MB)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    parser.add_argument("--no-progress", action="store_true", help="no progress line")


def run(args: argparse.Namespace) -> int:
    from megagate.data.preprocess import TokenizerSpec, preprocess

    if not math.isfinite(args.chunk_mb) or args.chunk_mb <= 0:
        raise MegagateError(f"--chunk-mb {args.chunk_mb}: must be a positive number of megabytes")
    from megagate.files import refuse_own_input

    # an output file must not be an input file or the tokenizer (--overwrite would replace what is being read)
    inputs = [("--input", p) for p in args.input if os.path.isfile(p)] + [("--tokenizer", args.tokenizer)]
    for key in args.json_keys:
        for suffix in (".bin", ".idx"):
            refuse_own_input(f"{args.output_prefix}_{key}_document{suffix}", inputs, flag="--output-prefix")
    spec = TokenizerSpec(args.tokenizer, args.engine, args.eod_token, None, args.tiktoken_pattern)
    main_pid = os.getpid()

    def on_sigterm(signum, frame) -> None:
        # SIGTERM (Slurm, kill) unwinds like Ctrl-C in this process, so temporary files are removed; a forked
        # worker that has not yet installed its own handler just exits.
        if os.getpid() != main_pid:
            os._exit(128 + signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        res = preprocess(
            args.input,
            args.output_prefix,
            spec,
            keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            text_mode=args.text_mode,
            bad_lines=args.bad_lines,
            chunk_bytes=int(args.chunk_mb * (1 << 20)),
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    except KeyboardInterrupt:
        raise MegagateError("interrupted; temporary files removed, no output written") from None
    finally:
        signal.signal(signal.SIGTERM, previous)  # callers running us in-process keep their own handling
    rate = res.total_tokens / max(res.seconds, 1e-9)
    print(
        f"engine {res.engine}: {res.documents:,} documents, {res.total_tokens:,} tokens in {res.seconds:.1f} s ({rate:,.0f} tokens/s, {res.text_bytes / max(res.seconds, 1e-9) / 1e6:.1f} MB/s)"
    )
    if res.bad_lines:
        detail = ", ".join(f"{n} {r}" for r, n in sorted(res.bad_by_reason.items()))
        print(f"skipped {res.bad_lines:,} bad records ({detail})", file=sys.stderr)
    for key, prefix in res.prefixes.items():
        print(f"{key}: {prefix}.bin / .idx ({res.tokens[key]:,} tokens)")
    return 0
