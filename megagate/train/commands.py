"""Sub-commands contributed by the trainer (registered by megagate/cli.py)."""

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("megagate.train.cli", "train a gated GPT from a YAML config (torchrun, srun or a single process)"),
}
