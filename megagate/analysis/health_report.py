"""The cluster-health section of `megagate report`: what each run's health.jsonl recorded (megagate.health.channel).

One line per event, per run: straggler reports (rank, host, how much slower or how often last, the window), job
slowdowns, hangs (the diagnosis),
failures of one rank (rank, host, phase, error), and the faults a drill injected.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from megagate.health import channel


def _describe(event: dict) -> str:
    kind = event.get("kind")
    if kind in ("straggler", "slowdown") and event.get("line"):  # intermittent stragglers, slowdowns: their line
        return f"step {event.get('step')}: {event['line'].split(': ', 1)[-1]}"
    if kind == "straggler":
        return (
            f"step {event.get('step')}: rank {event.get('rank')} ({event.get('host')}) computes "
            f"{float(event.get('ratio', 0)):.2f}x as long as the others (fastest step "
            f"{float(event.get('compute_s', 0)) * 1e3:.0f} vs {float(event.get('median_s', 0)) * 1e3:.0f} ms) for "
            f"{event.get('windows')} windows"
        )
    if kind == "hang":
        return str(event.get("line", "?"))
    if kind == "failure":
        return (
            f"rank {event.get('rank')} ({event.get('host')}) failed in {event.get('phase')} of step "
            f"{event.get('step')}: {event.get('error')}"
        )
    if kind == "fault":
        fault = event.get("fault") or {}
        return f"injected {fault.get('kind')} on rank {event.get('rank')} ({event.get('host')}) at step {event.get('step')}"
    return str(event)


def health_section(run_dirs: Sequence[str | Path], names: Sequence[str]) -> str:
    """The section's text ("" when no run recorded a health event)."""
    rows = []
    for run_dir, name in zip(run_dirs, names):
        for event in channel.read_events(run_dir):
            rows.append(f"  {name}  {event.get('kind', '?'):<9}  {_describe(event)}")
    if not rows:
        return ""
    return (
        "\n\ncluster health (health.jsonl: stragglers, slowdowns, hangs, one-rank failures, injected faults):\n"
        + "\n".join(rows)
    )
