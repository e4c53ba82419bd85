"""A trial's run directory, read by the driver: its outcome, its curve at the rung steps, and a retry's clean start.

The outcome is decided only by summary.json, which the trainer writes when a run completed, was stopped early
(`early_stop`: the rule, the step, the reason) or was aborted by the spike monitor (`aborted`). A run without one
was killed, preempted or timed out, or crashed: not a result of the stability experiment, so it is retried — from
its latest checkpoint when it has one (a stop signal checkpoints), else from scratch, with the partial attempt moved
to OUT/attempts/<name>.<n> (its logs kept, out of `megagate report`'s way).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from megagate.frontier.rule import TrialOutcome
from megagate.monitor import runfiles
from megagate.monitor.early_stop import trailing_mean

ATTEMPTS_DIR = "attempts"
LOGS_DIR = "logs"


def loss_spikes_after(run_dir: Path, warmup_steps: int) -> int:
    """Steps after warm-up at which the spike monitor flagged the loss (events.jsonl)."""
    steps = {
        int(e["step"])
        for e in runfiles.read_jsonl(run_dir / runfiles.EVENTS)
        if e.get("metric") == "loss" and int(e.get("step", 0)) > warmup_steps
    }
    return len(steps)


def read_outcome(run_dir: str | os.PathLike, train_steps: int, warmup_steps: int) -> TrialOutcome | None:
    """The trial's outcome, or None when it is not decided (no summary.json, or one short of the last step
    without a stop: an attempt of another length)."""
    run_dir = Path(run_dir)
    summary = runfiles.read_json(run_dir / runfiles.SUMMARY)
    if summary is None:
        return None
    steps = int(summary.get("steps") or 0)
    valid = summary.get("final_valid_loss")
    valid = None if valid is None else float(valid)
    spikes = loss_spikes_after(run_dir, warmup_steps)
    diverged = bool(summary.get("diverged"))
    if summary.get("aborted"):
        return TrialOutcome(steps, False, "abort", f"aborted by the spike monitor at step {steps}", valid, spikes, True)
    early = summary.get("early_stop")
    if isinstance(early, dict):
        rule = str(early.get("rule", "control"))
        return TrialOutcome(steps, False, rule, str(early.get("reason", "")), valid, spikes, diverged)
    if steps < train_steps:
        return None
    return TrialOutcome(steps, True, None, "", valid, spikes, diverged)


def replayed_loss_spikes(run_dir: str | os.PathLike, warmup_steps: int) -> int | None:
    """Loss spikes after warm-up that this code's spike monitor (with the run's own monitor.spike settings) finds
    on the run's logged curve — how a grid logged by an older monitor is judged like the frontier's trials. None
    when the log skips steps (the monitor cannot be replayed)."""
    from megagate.monitor.spike import SpikeMonitor, SpikeMonitorConfig

    run_dir = Path(run_dir)
    rows = runfiles.train_metrics(runfiles.read_jsonl(run_dir / runfiles.METRICS))
    steps = [int(r["step"]) for r in rows]
    if not rows or steps != list(range(steps[0], steps[0] + len(steps))):
        return None
    settings = runfiles.lookup(runfiles.read_config(run_dir), "monitor.spike") or {}
    monitor = SpikeMonitor(SpikeMonitorConfig.from_dict({**settings, "action": "warn"}))
    spikes = 0
    for row, step in zip(rows, steps):
        metrics = {m: float(row[m]) for m in monitor.config.metrics if row.get(m) is not None}
        events = monitor.observe(step, metrics)
        spikes += step > warmup_steps and any(e.metric == "loss" for e in events)
    return spikes


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of the train lines of metrics.jsonl, in step order."""
    rows = runfiles.train_metrics(runfiles.read_jsonl(run_dir / runfiles.METRICS))
    return sorted((int(r["step"]), float(r["loss"])) for r in rows if "loss" in r and "step" in r)


def rung_means(run_dir: str | os.PathLike, rungs: Sequence[int], window: int) -> dict[int, float]:
    """The run's mean loss over the `window` logged steps up to each rung step (the measure a rung compares)."""
    curve = train_losses(Path(run_dir))
    out = {}
    for rung in rungs:
        upto = [loss for step, loss in curve if step <= rung]
        if upto and curve[-1][0] >= rung:
            value = trailing_mean(upto, window)
            if math.isfinite(value):
                out[rung] = value
    return out


def last_step(run_dir: str | os.PathLike) -> int:
    """The last step an attempt logged (0 if none): its compute, when it is discarded."""
    curve = train_losses(Path(run_dir))
    return curve[-1][0] if curve else 0


def checkpoint_step(run_dir: str | os.PathLike) -> int | None:
    """The step of the trial's newest checkpoint folder (checkpoints/iter_NNNNNNN), None without one."""
    ckpt = Path(run_dir) / "checkpoints"
    steps = [int(p.name[5:]) for p in ckpt.glob("iter_*") if p.is_dir() and p.name[5:].isdigit()]
    return max(steps) if steps else None


def prepare_retry(out_dir: str | os.PathLike, name: str, attempt: int) -> tuple[str, int]:
    """Make the trial's directory ready for another launch: keep it when it has a checkpoint (the trainer resumes),
    else move it to OUT/attempts/<name>.<attempt>. Returns (what was done, steps discarded)."""
    run_dir = Path(out_dir) / name
    if not run_dir.exists():
        return "not started", 0
    resume = checkpoint_step(run_dir)
    if resume is not None:  # the steps logged after the checkpoint run again
        return f"resumes from its checkpoint of step {resume}", max(0, last_step(run_dir) - resume)
    lost = last_step(run_dir)
    target = Path(out_dir) / ATTEMPTS_DIR / f"{name}.{attempt}"
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(run_dir, target)
    return f"restarts from scratch (attempt moved to {target})", lost


__all__ = ["checkpoint_step", "last_step", "prepare_retry", "read_outcome", "rung_means", "train_losses"]
