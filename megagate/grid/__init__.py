"""Grid runs: the trials of a variant x LR x seed grid (`trials`), run on this machine (`local`: one after another, or
a pool sized to it) or as one Slurm job array through megagate.slurm's render and submit (`slurm`). Used by
`megagate sweep` and `megagate frontier`; nothing below the commands imports it (torchtitan's rule for experiment
drivers)."""
