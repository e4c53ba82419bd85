"""The trainer (`megagate train`): components (set-up), Trainer (the loop), callbacks, checkpoints, metrics, signals."""
