"""`megagate export CHECKPOINT --out DIR`: a checkpoint (any TP/PP/EP/VPP layout) as a Hugging Face folder."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint (iter_NNNNNNN), a checkpoint root or a run folder")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write (must not exist or be empty)")
    parser.add_argument(
        "--format",
        default=None,
        help="qwen3, qwen3_moe, qwen3_next, paper, qwen3_5 or qwen3_5_moe (default: the format an import came in, "
        "else the natural one for the model's gate variant)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        help="float32 (default: the trained values exactly) or bfloat16 (rounds every tensor)",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default: 5GB)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out folder")


def run(args: argparse.Namespace) -> int:
    from megagate.files import refuse_own_input
    from megagate.interop.hf_io import export_checkpoint

    refuse_own_input(args.out, [("checkpoint", args.checkpoint)], replaces=True)  # --force must not eat the input

    export_checkpoint(
        args.checkpoint,
        args.out,
        args.format,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        force=args.force,
    )
    return 0
