"""`megagate analyze CHECKPOINT`: per-layer gate / attention-sink / massive-activation diagnostics, with PNG plots."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from megagate.analysis.analyze import SAMPLE_TEXT, analyze_model
from megagate.errors import MegagateError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        help="a training checkpoint (iter_NNNNNNN, checkpoint root or run folder), or a Hugging Face folder "
        "(config.json of a qwen3 / qwen3_moe / qwen3_next / paper model, safetensors, tokenizer.json)",
    )
    parser.add_argument("--text", default=None, help="a UTF-8 text file to probe with (default: a built-in paragraph)")
    parser.add_argument(
        "--out",
        default=None,
        help="folder for the PNG plots and table.txt (default: <run>/analysis, the run folder of the checkpoint; "
        "<folder>/analysis for a Hugging Face folder)",
    )
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: 256)")
    parser.add_argument("--batch", type=int, default=4, help="sequences (consecutive windows of the text; default 4)")


def run_folder(source: str | Path) -> Path:
    """The run folder of the checkpoint `source` names (an iter_NNNNNNN folder, a checkpoint root, a run folder): the
    folder above its checkpoint root when that root is the run's `checkpoints/`, else the root itself (a
    `checkpoint.dir` of its own, an imported checkpoint). A Hugging Face folder is its own."""
    from megagate import checkpoint as ckpt
    from megagate.interop.hf_folder import is_hf_folder

    if is_hf_folder(source):
        return Path(source)
    path = ckpt.resolve(source)
    root = path.parent if re.fullmatch(r"iter_\d{7}", path.name) else path
    return root.parent if root.name == "checkpoints" else root


def read_paths(sources: Sequence[str]) -> list[str]:
    """What a command reading these checkpoints must not write into: each one's checkpoint folder (a run folder's
    newest iter_NNNNNNN, so `<run>/analysis` stays allowed), or the path as given when it is none (an HF folder)."""
    from megagate import checkpoint as ckpt

    paths = []
    for source in sources:
        try:
            paths.append(str(ckpt.resolve(source)))
        except MegagateError:
            paths.append(source)
    return paths


def default_out(sources: Sequence[str], what: str) -> str:
    """`<run>/<what>` for checkpoints of one run; a one-line refusal for several runs (no folder is theirs)."""
    runs = {run_folder(s).resolve(): run_folder(s) for s in sources}
    if len(runs) > 1:
        raise MegagateError(
            f"the checkpoints are of {len(runs)} runs ({', '.join(map(str, runs.values()))}): give --out FOLDER"
        )
    return str(next(iter(runs.values())) / what)


def text_batch(ids: Sequence[int], seq_len: int, batch: int) -> torch.Tensor:
    """Up to `batch` consecutive windows of `seq_len` tokens; a short text gives one shorter sequence."""
    if len(ids) < 2:
        raise MegagateError(f"the text has {len(ids)} token(s); at least 2 are needed")
    if len(ids) < seq_len:
        return torch.tensor([list(ids)], dtype=torch.long)
    n = max(1, min(batch, len(ids) // seq_len))
    return torch.tensor([list(ids[i * seq_len : (i + 1) * seq_len]) for i in range(n)], dtype=torch.long)


def load_model_for_analysis(
    source: str | Path, need_tokenizer: bool = True
) -> tuple[torch.nn.Module, Callable[[str], list[int]] | None]:
    """(the whole model in eval mode, text -> token ids) from a trainer checkpoint (any layout: the model factory
    reshards it into one TP = PP = 1 module in this process; the optimizer state is not read). The encoder is the
    run's own tokenizer (None without one when `need_tokenizer` is False)."""
    from megagate.data.demo import run_tokenizer
    from megagate.data.tokenizer import load_tokenizer
    from megagate.model_factory import load_whole_model, read_checkpoint

    path, _, cfg = read_checkpoint(source)
    tokenizer_path = run_tokenizer(cfg.data)  # before the model: a missing tokenizer fails fast
    tokenizer = None
    if tokenizer_path is None and need_tokenizer:
        raise MegagateError(f"checkpoint {str(path)!r}: the run has no tokenizer (mock data?) to encode text with")
    if tokenizer_path is not None and (need_tokenizer or Path(tokenizer_path).exists()):
        if not Path(tokenizer_path).exists():
            raise MegagateError(f"checkpoint {str(path)!r}: the run's tokenizer {tokenizer_path!r} is not here")
        tokenizer = load_tokenizer(tokenizer_path)
    model, *_ = load_whole_model(path)
    return model, None if tokenizer is None else (lambda text: [int(i) for i in tokenizer.encode(text)])


def run(args: argparse.Namespace) -> int:
    from megagate.files import refuse_own_input

    inputs = [("checkpoint", p) for p in read_paths([args.checkpoint])] + [("--text", args.text)]
    if args.out is not None:  # the default, <run>/analysis, is beside the checkpoints
        refuse_own_input(args.out, inputs, replaces=getattr(args, "force", False))
    if args.seq_len < 2 or args.batch < 1:
        raise MegagateError(f"--seq-len {args.seq_len} must be >= 2 and --batch {args.batch} >= 1")
    if args.text is not None and not Path(args.text).is_file():
        raise MegagateError(f"--text {args.text}: no such file")
    text = Path(args.text).read_text(encoding="utf-8") if args.text else SAMPLE_TEXT
    from megagate.interop.hf_folder import is_hf_folder
    from megagate.interop.hf_io import load_hf_for_analysis

    # a Hugging Face folder is imported in memory (nothing is written next to it)
    load = load_hf_for_analysis if is_hf_folder(args.checkpoint) else load_model_for_analysis
    model, encode = load(args.checkpoint)
    if args.out is None:
        args.out = default_out([args.checkpoint], "analysis")
    tokens = text_batch(encode(text), args.seq_len, args.batch)
    device = next(model.parameters()).device
    table = analyze_model(model, tokens.to(device), args.out)
    from megagate.files import write_atomic

    write_atomic(Path(args.out) / "table.txt", table + "\n")
    print(table)
    print(f"plots written to {args.out}")
    return 0
