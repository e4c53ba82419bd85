"""The trainer: config, loop, checkpoints, metrics, stop conditions (`megagate train`)."""
