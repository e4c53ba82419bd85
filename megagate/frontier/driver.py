"""The frontier driver: harvest the last round, plan the next from every outcome so far, launch it; until done.

One `advance` is one such step. Locally the driver loops, running each round in a process pool; on Slurm each
round is a job array and the next `advance` runs in a driver job that depends on it (megagate.frontier.slurm), so
the search goes on without a terminal. The state is written (atomically) before anything is launched and after
every harvest, so an interruption at any point loses at most the trials that were running: a rerun of the same
command (or `megagate frontier --resume OUT`) harvests what finished and relaunches only the rest.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from megagate.errors import MegagateError
from megagate.frontier import state as state_mod
from megagate.frontier import trials as trials_mod
from megagate.frontier.search import Plan
from megagate.frontier.state import FrontierState, Trial

Log = Callable[[str], None]


def _print(msg: str) -> None:
    print(f"[frontier] {msg}", flush=True)


def harvest(state: FrontierState, out: Path, interrupted: bool, log: Log = _print) -> None:
    """Read the outcomes of the open round's trials and close it. A trial without a decision is retried (a
    non-stability failure: never counted as unstable); `interrupted`: the driver itself died mid-round, so the
    trials it was running are relaunched without charging them a failure."""
    rnd = state.open_round
    if rnd is None:
        return
    spec = state.spec
    for name in rnd["trials"]:
        trial = state.trials[name]
        if trial.status != "pending":
            continue
        outcome = trials_mod.read_outcome(out / name, spec.train_steps, spec.warmup_steps)
        if outcome is not None:
            trial.status, trial.outcome = "done", outcome
            if outcome.completed:
                trial.rung_means = trials_mod.rung_means(out / name, spec.rungs(), spec.early.window)
            continue
        if interrupted:
            trial.history.append(f"round {rnd['index']}: interrupted with the driver")
            continue
        trial.failures += 1
        code = rnd.get("exit_codes", {}).get(name)
        why = "no summary.json" + ("" if code is None else f", exit code {code}")
        trial.history.append(f"round {rnd['index']}: ended without a decision ({why}): not a stability outcome")
        if trial.failures >= spec.max_attempts:
            trial.status = "lost"
            log(f"{name}: failed {trial.failures} times without a decision; given up (not counted as unstable)")
        else:
            log(f"{name}: ended without a decision ({why}); it will be retried")
    rnd["finished"] = state_mod.now()


def variant_plans(state: FrontierState) -> dict[str, Plan]:
    """The search's plan for every variant from the decided trials (pure: megagate.frontier.search)."""
    spec = state.spec
    plans = {}
    for variant in spec.variants:
        outcomes = {(t.lr, t.seed): t.outcome for _, t in state.of_variant(variant) if t.status == "done"}
        plans[variant] = spec.plan(outcomes)
    return plans


def rung_reference(state: FrontierState, variant: str) -> list[tuple[int, float]]:
    """(step, best mean loss) at each rung over the variant's trials that ran every step without diverging."""
    best: dict[int, float] = {}
    for _, t in state.of_variant(variant):
        if t.status == "done" and t.outcome is not None and t.outcome.completed and not t.outcome.diverged:
            for step, value in t.rung_means.items():
                best[step] = min(best.get(step, value), value)
    return sorted(best.items())


def next_round(state: FrontierState) -> tuple[list[str], dict[str, str]]:
    """Names of the trials to launch next (retries first), and per variant why it has nothing to launch."""
    spec = state.spec
    launch = [n for n, t in state.trials.items() if t.status == "pending"]  # retries of the closed round
    waiting: dict[str, str] = {}
    for variant, plan in variant_plans(state).items():
        if any(t.status == "pending" for _, t in state.of_variant(variant)):
            waiting[variant] = "a trial is being retried"
            continue
        if plan.done:
            waiting[variant] = "done"
            continue
        for lr, seed in plan.requests:
            name = spec.trial_name(variant, lr, seed)
            trial = state.trials.get(name)
            if trial is not None and trial.status == "lost":
                waiting[variant] = f"stuck: {name} was lost (failed {trial.failures} times for non-stability reasons)"
                break
            state.trials[name] = Trial(variant, lr, seed)
            launch.append(name)
    return launch, waiting


def open_round(state: FrontierState, out: Path, names: list[str], log: Log = _print) -> dict:
    """Record a new round (before launching it) with each trial's overrides; prepare retried trials' folders."""
    spec = state.spec
    index = len(state.rounds) + 1
    rungs = {v: rung_reference(state, v) for v in spec.variants}
    overrides = {}
    for name in names:
        trial = state.trials[name]
        if trial.attempts:  # a relaunch: resume from the checkpoint, or start over with the attempt put aside
            what, lost = trials_mod.prepare_retry(out, name, trial.attempts)
            trial.lost_steps += lost
            log(f"{name}: relaunched (attempt {trial.attempts + 1}); {what}")
        trial.attempts += 1
        trial.round = index
        overrides[name] = spec.trial_overrides(trial.variant, trial.lr, trial.seed, out / name, rungs[trial.variant])
    rnd = {"index": index, "trials": names, "overrides": overrides, "started": state_mod.now(), "finished": None}
    rnd["rungs"] = {v: [[s, x] for s, x in r] for v, r in rungs.items() if r}
    state.rounds.append(rnd)
    return rnd


def advance(out: Path, launcher: Callable[[FrontierState, dict], None], interrupted: bool, log: Log = _print) -> bool:
    """One driver step on the state in `out`: harvest, plan, launch a round (or finish). True when the search is over.

    `launcher(state, round)` starts the round's trials (the state is already saved); it may save the state again.
    """
    state = state_mod.load(out)
    if state is None:
        raise MegagateError(f"{out}: no {state_mod.STATE_FILE}; start the search with `megagate frontier --config ...`")
    if state.done:
        return True
    harvest(state, out, interrupted, log)
    spec = state.spec
    if spec.budget is not None and state.spent >= spec.budget:
        state.done, state.stop_reason = True, f"budget of {spec.budget} trial-steps spent ({state.spent})"
    else:
        names, waiting = next_round(state)
        if not names:
            state.done = True
            stuck = {v: why for v, why in waiting.items() if why != "done"}
            state.stop_reason = "; ".join(f"{v}: {why}" for v, why in stuck.items()) or None
    if state.done:
        state_mod.save(out, state)
        log(
            f"search over after {len(state.rounds)} rounds, {state.spent} trial-steps"
            + (f" ({state.stop_reason})" if state.stop_reason else "")
        )
        return True
    rnd = open_round(state, out, names, log)
    state_mod.save(out, state)
    log(f"round {rnd['index']}: {len(names)} trial(s): {', '.join(names)}")
    launcher(state, rnd)
    return False


def python_command(python: str | None = None) -> list[str]:
    """How a trial's `megagate train` is started: `python` (default this interpreter) and the megagate it imports —
    its own installed one: -P keeps `-m` from putting the working directory (another checkout, say) first."""
    return [python or sys.executable, "-P", "-m", "megagate", "train"]


__all__ = ["advance", "harvest", "next_round", "open_round", "rung_reference", "variant_plans"]
