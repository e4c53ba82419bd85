"""The spike monitor's warm-up rule judged on logged runs (docs/monitoring.md §1.3): recall of the curve spikes in
and after the warm-up, and events not at a curve spike, with the monitor replayed over the same logged curves
before (no warm-up rule: `early_rise={}`) and after (the defaults), plus any other settings given.

    .venv/bin/python tests/monitor/measure_warmup_rule.py RUN_FOLDER... [--settings "early_rise.loss=0.05" ...]

The folders are those of docs/science.md's study (runs/science/qk-off, runs/science/qk-on: every step logged).
Curve spikes are megagate report's (megagate.analysis.aggregate.curve_spikes); "warm-up" means first step <= 20 (the
defaults' min_history: where the monitor had no rule before).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from megagate.analysis.replay import parse_settings
from megagate.analysis.report import find_runs, load_run

WARMUP = 20
SETTINGS = {"before (no warm-up rule)": "early_rise={}", "after (defaults)": ""}


@dataclass
class Tally:
    runs: int = 0
    spikes_warmup: int = 0
    spikes_later: int = 0
    found_warmup: int = 0
    found_later: int = 0
    false_events: int = 0  # clusters of events near no curve spike
    events: int = 0  # event steps

    @property
    def found(self) -> int:
        return self.found_warmup + self.found_later

    @property
    def spikes(self) -> int:
        return self.spikes_warmup + self.spikes_later


def measure(folders: Sequence[str], settings: str) -> Tally:
    """Replay the monitor with `settings` over every run under `folders` and count against the curve spikes."""
    config = parse_settings(settings)
    tally = Tally()
    for run_dir in find_runs(folders):
        run = load_run(run_dir, replay=config)
        tally.runs += 1
        tally.events += len(run.spike_steps)
        tally.false_events += run.spike_match.fp
        for spike, hit in zip(run.curve_spikes, run.spike_match.detected):
            early = spike.step <= WARMUP
            tally.spikes_warmup += early
            tally.spikes_later += not early
            tally.found_warmup += early and hit
            tally.found_later += (not early) and hit
    return tally


def table(rows: dict[str, Tally]) -> str:
    lines = [
        "| replayed monitor | detected (of all) | warm-up (of) | later (of) | events not at a curve spike | events |",
        "|---|---|---|---|---|---|",
    ]
    for name, t in rows.items():
        lines.append(
            f"| {name} | {t.found} of {t.spikes} | {t.found_warmup} of {t.spikes_warmup} | "
            f"{t.found_later} of {t.spikes_later} | {t.false_events} | {t.events} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--settings", action="append", default=[], help="more --replay-monitor settings to judge")
    args = parser.parse_args(argv)
    chosen = {**SETTINGS, **{s: s for s in args.settings}}
    rows = {name: measure(args.folders, settings) for name, settings in chosen.items()}
    runs = next(iter(rows.values())).runs
    text = f"{runs} runs under {', '.join(args.folders)}\n" + table(rows)
    print(text)
    return text


if __name__ == "__main__":
    main()
