"""`megagate preprocess`: inputs -> `<output-prefix>_<key>_document.{bin,idx}` (see megagate.data.preprocess).

One process by default; sharded (megagate.data.shards) with `--plan-only`, `--unit`, `--task-id`, `--merge`,
`--sharded` (plan, every missing unit, merge: resumable, on this machine) or `--slurm` (a job array + a merge job).
Each mode computes a record first and renders it second (`render_*`), so tests and tools can read the records.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys

from megagate.errors import MegagateError

MODES = ("plan_only", "unit", "task_id", "merge", "sharded", "slurm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input",
        "-i",
        nargs="+",
        required=True,
        help="JSONL / text files (plain, .gz, .zst), Parquet files, folders of them, or glob patterns",
    )
    parser.add_argument("--output-prefix", "-o", required=True, help="outputs are <prefix>_<key>_document.bin/.idx")
    parser.add_argument(
        "--tokenizer", "-t", required=True, help="tokenizer.json, SentencePiece .model or tiktoken BPE file"
    )
    parser.add_argument("--engine", default="auto", help="for tokenizer.json: auto | fast | hf (default auto)")
    parser.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="JSON keys (Parquet: columns) to tokenize, one dataset each (default: text)",
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
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs (and another manifest)")
    parser.add_argument("--no-progress", action="store_true", help="no progress line")
    g = parser.add_argument_group("sharded runs (work units in <prefix>.units/, merged into the single-run bytes)")
    g.add_argument("--plan-only", action="store_true", help="write the manifest, print the units and an ETA")
    g.add_argument("--unit", type=int, default=None, help="process unit K of the manifest")
    g.add_argument("--task-id", default=None, help="process the units of task K (`env`: $SLURM_ARRAY_TASK_ID)")
    g.add_argument("--merge", action="store_true", help="merge every unit (all must be done)")
    g.add_argument(
        "--blend", action="store_true", help="with --merge/--sharded/--slurm: no merged file, a blend of the units"
    )
    g.add_argument("--sharded", action="store_true", help="plan, process the missing units, merge: on this machine")
    g.add_argument("--slurm", action="store_true", help="submit the missing units as a job array and a merge job")
    g.add_argument("--tasks", type=int, default=None, help="tasks of the plan (default: one per unit)")
    g.add_argument("--unit-mb", type=float, default=512.0, help="target input size of a unit in MB (default 512)")
    g.add_argument("--slurm-time", default="04:00:00", help="--slurm: time limit of each task (default 04:00:00)")
    g.add_argument("--slurm-partition", default=None, help="--slurm: partition")
    g.add_argument("--slurm-account", default=None, help="--slurm: account")
    g.add_argument("--slurm-max-parallel", type=int, default=None, help="--slurm: tasks running at once (%%N)")
    g.add_argument("--dry-run", action="store_true", help="--slurm: write the scripts, submit nothing")


def _options(args: argparse.Namespace):
    from megagate.data.preprocess import TokenizerSpec, check_options

    if not math.isfinite(args.chunk_mb) or args.chunk_mb <= 0:
        raise MegagateError(f"--chunk-mb {args.chunk_mb}: must be a positive number of megabytes")
    from megagate.files import refuse_own_input

    # an output file must not be an input file or the tokenizer (--overwrite would replace what is being read)
    inputs = [("--input", p) for p in args.input if os.path.isfile(p)] + [("--tokenizer", args.tokenizer)]
    for key in args.json_keys:
        for suffix in (".bin", ".idx"):
            refuse_own_input(f"{args.output_prefix}_{key}_document{suffix}", inputs, flag="--output-prefix")
    spec = TokenizerSpec(args.tokenizer, args.engine, args.eod_token, None, args.tiktoken_pattern)
    opts = check_options(
        args.json_keys, args.append_eod, args.workers, args.text_mode, args.bad_lines, int(args.chunk_mb * (1 << 20))
    )
    return spec, opts


def run(args: argparse.Namespace) -> int:
    modes = [m for m in MODES if getattr(args, m) is not None and getattr(args, m) is not False]
    if len(modes) > 1:
        flags = " and ".join("--" + m.replace("_", "-") for m in modes)
        raise MegagateError(f"{flags}: choose one of --plan-only, --unit, --task-id, --merge, --sharded, --slurm")
    main_pid = os.getpid()

    def on_sigterm(signum, frame) -> None:
        # SIGTERM (Slurm, kill) unwinds like Ctrl-C in this process, so temporary files are removed; a forked
        # worker that has not yet installed its own handler just exits.
        if os.getpid() != main_pid:
            os._exit(128 + signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        lines = _dispatch(args, modes[0] if modes else None)
    except KeyboardInterrupt:
        raise MegagateError("interrupted; temporary files removed, no output written") from None
    finally:
        signal.signal(signal.SIGTERM, previous)  # callers running us in-process keep their own handling
    for stream, line in lines:
        print(line, file=sys.stderr if stream == "err" else sys.stdout)
    return 0


def _dispatch(args: argparse.Namespace, mode: str | None) -> list[tuple[str, str]]:
    from megagate.commands import preprocess_units as units
    from megagate.data.preprocess import preprocess

    spec, opts = _options(args)
    if mode is None:
        res = preprocess(
            args.input,
            args.output_prefix,
            spec,
            keys=opts.keys,
            append_eod=opts.append_eod,
            workers=opts.workers,
            text_mode=opts.text_mode,
            bad_lines=opts.bad_lines,
            chunk_bytes=opts.chunk_bytes,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
        return render_result(res)
    return units.run_mode(args, mode, spec, opts)


def render_result(res) -> list[tuple[str, str]]:
    """The lines of a finished run: (stream, text) pairs."""
    rate = res.total_tokens / max(res.seconds, 1e-9)
    mbs = res.text_bytes / max(res.seconds, 1e-9) / 1e6
    lines = [
        (
            "out",
            f"engine {res.engine}: {res.documents:,} documents, {res.total_tokens:,} tokens in {res.seconds:.1f} s "
            f"({rate:,.0f} tokens/s, {mbs:.1f} MB/s)",
        )
    ]
    if res.bad_lines:
        detail = ", ".join(f"{n} {r}" for r, n in sorted(res.bad_by_reason.items()))
        lines.append(("err", f"skipped {res.bad_lines:,} bad records ({detail})"))
    for key, prefix in res.prefixes.items():
        lines.append(("out", f"{key}: {prefix}.bin / .idx ({res.tokens[key]:,} tokens)"))
    return lines
