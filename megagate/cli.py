"""`megagate` command line: one table of sub-commands, each a module of `megagate.commands`.

Every command module has the same shape: `add_arguments(parser)` and `run(args) -> int`. Modules are imported only
when their command runs (torch and megatron imports take seconds), so `megagate --help` stays fast.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import sys
import typing
from types import ModuleType

from megagate import console
from megagate.errors import MegagateError
from megagate.sections import did_you_mean

# name -> one-line help; the module is megagate.commands.<name> (or _MODULES[name])
COMMANDS: dict[str, str] = {
    "train": "train a gated GPT from a YAML config (torchrun, srun or a single process)",
    "plan": "per-GPU memory and step time of a config on N nodes (--search: the fitting layouts, fastest first)",
    "calibrate": "measure this machine (GEMMs, attention, bandwidth, collectives, trainer overheads) into a device profile",
    "submit": "render and submit a Slurm batch job for a training config",
    "sweep": "run a stability grid (learning rates x gate variants x seeds) locally or as a Slurm job array",
    "frontier": "each variant's largest stable learning rate: adaptive search, early-stopped trials, local or Slurm",
    "report": "aggregate run directories into a table (loss, ppl, spikes, divergence, F-Attn, M-Act) and plots",
    "analyze": "per-layer gate / attention-sink / massive-activation diagnostics of a checkpoint, with PNG plots",
    "export": "write a checkpoint (any TP/PP/EP layout) as a Hugging Face folder (Qwen3 / Qwen3-MoE / Qwen3-Next / paper)",
    "import": "read a Hugging Face folder (Qwen3 / Qwen3-MoE / Qwen3-Next / paper) into a checkpoint to train or analyse",
    "eval": "perplexity of checkpoints per dataset, length and position (RoPE/YaRN overrides), F-Attn/M-Act, plot",
    "preprocess": "tokenize JSONL/Parquet/text into megatron .bin/.idx (parallel, streaming, atomic; sharded: Slurm array + merge)",
    "tokenizer": "train a byte-level BPE tokenizer, or check the fast engine against HF",
    "data": "inspect preprocessed datasets (documents, tokens, length histogram, decoded sample); synth a BOS corpus",
    "variants": "list the gate presets and the paper's parameter counts",
    "demo": "the CPU demo: real-text data, baseline vs gated tiny models trained with megagate train, loss-curve plot",
}

_MODULES = {"import": "import_hf"}  # a command whose name is a Python keyword


class _UsageError(Exception):
    """An argparse refusal (unknown flag, bad choice, wrong type), raised instead of argparse's usage + exit."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that refuses a bad command line with one line (`main` prints it), not usage text and SystemExit.

    Sub-parsers inherit the class (argparse builds them with the parent's type), so `data inspect` behaves alike.
    """

    def error(self, message: str) -> typing.NoReturn:
        raise _UsageError(f"{message}{_choice_hint(message)} (see {self.prog} --help)")


def _choice_hint(message: str) -> str:
    """argparse's "invalid choice: 'x' (choose from a, b)" with the closest choice (`sections.did_you_mean`)."""
    found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if found is None:
        return ""
    return did_you_mean(found[1], [c.strip().strip("'") for c in found[2].split(",")])


def os_error_message(exc: OSError) -> str | None:
    """One line for an expected operating-system error about a path the user gave (no permission, a file where a
    folder should be, disk full, read-only file system), or None for an OSError that is a bug (no errno or path)."""
    if exc.errno is None or exc.filename is None:
        return None
    text = exc.strerror or os.strerror(exc.errno)
    if exc.errno == errno.ENOSPC:
        text += " (free some space or write elsewhere)"
    names = [exc.filename] + ([exc.filename2] if getattr(exc, "filename2", None) else [])
    return f"{text}: " + " -> ".join(repr(os.fsdecode(n)) if not isinstance(n, int) else str(n) for n in names)


def command_module(name: str) -> ModuleType:
    """The module implementing command `name` (megagate.commands.<name>)."""
    return importlib.import_module(f"megagate.commands.{_MODULES.get(name, name)}")


def build_parser() -> argparse.ArgumentParser:
    """The full parser with every sub-command (imports every command module: for --help and tests)."""
    parser = argparse.ArgumentParser(prog="megagate", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--verbose",
        action="store_true",
        help=f"show the known third-party notices megagate.console filters (or set {console.VERBOSE_ENV}=1)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        command_module(name).add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: run a sub-command; user errors print one line and exit 2. `megagate --verbose COMMAND` shows
    the third-party notices megagate.console filters."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--verbose"]:
        argv = argv[1:]
        console.set_verbose()
    console.install()
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        hint = did_you_mean(argv[0], COMMANDS)
        print(f"megagate: error: {argv[0]!r} is not a command; commands: {', '.join(COMMANDS)}{hint}", file=sys.stderr)
        return 2
    if not argv or argv[0] not in COMMANDS:
        build_parser().parse_args(argv)  # prints help or the "invalid choice" error and exits
        return 2
    name = argv[0]
    argv = _attach_dash_values(argv)
    parser = OneLineParser(prog=f"megagate {name}", description=COMMANDS[name])
    module = command_module(name)
    module.add_arguments(parser)
    # intermixed: `submit CONFIG key=value --nodes 8 other=1` (overrides between flags) parses as one would expect;
    # argparse cannot intermix a command that has sub-commands of its own (`data inspect`)
    parse = parser.parse_args if parser._subparsers is not None else parser.parse_intermixed_args
    try:
        args = parse(argv[1:])
        return int(module.run(args) or 0)
    except (MegagateError, _UsageError) as exc:
        message = str(exc)
    except OSError as exc:
        message = os_error_message(exc)
        if message is None:  # not about a path the user gave: a bug, keep its traceback
            raise
    if "\n" in message or "\r" in message:  # one line whatever the message holds (a multi-line library message)
        message = " ".join(message.split())
    print(f"megagate {name}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())


# options whose value may be a negative size or number written with a unit ("-1GB"): argparse would read such a
# token as an unknown option and report a missing value, not the bad one
_VALUE_OPTIONS = ("--max-shard-size",)


def _attach_dash_values(argv: list[str]) -> list[str]:
    """`--max-shard-size -1GB` as `--max-shard-size=-1GB`, so the option's own check names the value."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if (
            argv[i] in _VALUE_OPTIONS
            and i + 1 < len(argv)
            and argv[i + 1].startswith("-")
            and argv[i + 1][1:2].isdigit()
        ):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out
