"""`megagate import HF_DIR --out CHECKPOINT`: a Hugging Face folder as a megagate checkpoint (the `import` command;
the module is not named `import`, a Python keyword)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", help="a Hugging Face model folder (config.json + safetensors weights)")
    parser.add_argument("--out", required=True, help="the checkpoint root to write (must not exist or be empty)")
    parser.add_argument("--format", default=None, help="the format config.json must describe (default: any)")
    parser.add_argument(
        "--config",
        default=None,
        help="a training YAML whose train/data/parallel/seed sections go into the saved config",
    )
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out folder")


def run(args: argparse.Namespace) -> int:
    from megagate.files import refuse_own_input
    from megagate.interop.hf_io import import_hf

    refuse_own_input(args.out, [("folder", args.hf_dir), ("--config", args.config)], replaces=True)

    import_hf(args.hf_dir, args.out, args.format, config=args.config, force=args.force)
    return 0
