"""Sub-commands contributed by the monitoring package (cli.py loads COMMANDS from here)."""

COMMANDS: dict[str, tuple[str, str]] = {
    "analyze": ("megagate.monitor.analyze",
                "per-layer gate / attention-sink / massive-activation diagnostics of a checkpoint, with PNG plots"),
    "sweep": ("megagate.monitor.sweep",
              "run a stability grid (learning rates x gate variants x seeds) locally or as a Slurm job array"),
    "report": ("megagate.monitor.report",
               "aggregate run directories into a table (loss, ppl, spikes, divergence, F-Attn, M-Act) and plots"),
}  # fmt: skip
