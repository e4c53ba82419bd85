"""`megagate` command line: one sub-command per module, imported lazily so `--help` stays fast.

Each sub-command module exposes `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megagate.errors import MegagateError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("megagate.demo", "the CPU demo: real-text data, baseline vs gated tiny models trained with megagate train, loss-curve plot"),
    "variants": ("megagate.variants_cli", "list the gate presets and the paper's parameter counts"),
}


def register(name: str, module: str, help_text: str) -> None:
    """Add a sub-command (used by packages that contribute commands)."""
    COMMANDS[name] = (module, help_text)


def _load_optional_commands() -> None:
    # Sub-command packages built by other parts of the project register themselves here when present.
    for module in ("megagate.data.commands", "megagate.slurm.commands", "megagate.monitor.commands", "megagate.train.commands"):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                continue
            raise
        for name, (target, help_text) in getattr(mod, "COMMANDS", {}).items():
            register(name, target, help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megagate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(sp)
    return parser


def _quiet_optional_dependency_notices() -> None:
    # megatron and torch announce, at import, every optional accelerator library that is absent (TE, apex, CUDA);
    # that is expected on CPU machines and says nothing about the run.
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (is|are) not installed.*")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # Notices megatron 0.19 prints on every run about its own API transitions, not about the user's run.
    for message in ("full scope is deprecated", "MimoModelConfig is experimental", "The .grad attribute of a Tensor"):
        warnings.filterwarnings("ignore", message=f".*{message}.*")
    for name, text in (("megatron.core.distributed.distributed_data_parallel", "full_param_layout not provided"),
                       ("megatron.core.dist_checkpointing.strategies.torch", "async save is deprecated")):  # fmt: skip
        logging.getLogger(name).addFilter(lambda record, text=text: text not in record.getMessage())


def main(argv: list[str] | None = None) -> int:
    """Entry point: run a sub-command; user errors print one line and exit 2."""
    _quiet_optional_dependency_notices()
    _load_optional_commands()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Only import the chosen command's module (torch imports are slow), unless help is asked for.
    if argv and argv[0] in COMMANDS and not any(a in ("-h", "--help") for a in argv[:1]):
        module, help_text = COMMANDS[argv[0]]
        parser = argparse.ArgumentParser(prog=f"megagate {argv[0]}", description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(parser)
        args = parser.parse_args(argv[1:])
    else:
        args = build_parser().parse_args(argv)
        mod = importlib.import_module(args._module)
    try:
        return int(mod.run(args) or 0)
    except MegagateError as exc:
        print(f"megagate {argv[0] if argv else ''}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
