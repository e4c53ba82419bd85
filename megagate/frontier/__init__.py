"""The stability frontier: per gate variant, the largest learning rate at which training stays healthy, found by an
adaptive search (coarse bracket, then bisection in log-LR over several seeds) whose trials stop as soon as their
outcome is decided, run locally or as chained Slurm job arrays, resumable at any point.

rule.py     HealthRule (what "healthy" means), TrialOutcome, the verdict of a trial and the status of an LR point
search.py   the pure search: which trials to run next from the outcomes so far, and the bracket it ends with
spec.py     FrontierSpec (the command's settings, validated: a rule that can never pass is refused), trial names,
            the overrides of a trial (its early-stop rungs from the trials already run)
trials.py   a trial's run directory: its outcome (summary.json, metrics, events), retries, rung references
state.py    frontier.json: the durable state (spec, trials, rounds), written atomically; the driver lock
driver.py   one driver step: harvest the last round, plan, launch the next (local pool or Slurm), until done
local.py    the local process pool (`megagate train` per trial, sized to the machine)
slurm.py    a round as a job array and the next driver as a job that depends on it (no terminal needed)
report.py   the frontier report: bracket per variant, seeds, compute against the full grid (and a grid run side by side)
plot.py     frontier_lr.png: loss vs LR per variant with the frontier marked
"""
