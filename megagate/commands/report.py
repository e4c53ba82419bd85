"""`megagate report RUNS...`: per-run and per-group (over seeds) tables over run directories (loss, ppl, spikes,
divergence, F-Attn, M-Act, curve spikes vs the spike monitor), aggregate.json and plots."""

from __future__ import annotations

import argparse

from megagate.analysis.aggregate import DEFAULT_RULE, DEFAULT_TOLERANCE, SpikeRule
from megagate.analysis.replay import parse_settings
from megagate.analysis.report import report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="run directories, or folders of run directories (a sweep's --out)")
    parser.add_argument(
        "--out",
        default=None,
        help="write report.txt, aggregate.json, loss_curves.png, final_loss_vs_lr.png, lr_sensitivity.png and "
        "diagnostics_over_training.png here",
    )
    parser.add_argument(
        "--diag-lr",
        type=float,
        default=None,
        help="the LR shown in diagnostics_over_training.png (default: per sweep and setting, the largest LR "
        "at which no run diverged)",
    )
    parser.add_argument(
        "--spike-delta",
        type=float,
        default=DEFAULT_RULE.delta,
        help=f"curve spike: minimum rise over the median of the previous logged losses, nats (default {DEFAULT_RULE.delta})",
    )
    parser.add_argument(
        "--spike-k",
        type=float,
        default=DEFAULT_RULE.k,
        help=f"curve spike: rise in robust standard deviations of those losses (default {DEFAULT_RULE.k:g})",
    )
    parser.add_argument(
        "--spike-tolerance",
        type=int,
        default=DEFAULT_TOLERANCE,
        help="steps between a monitor event and a curve spike that still count as a detection "
        f"(default {DEFAULT_TOLERANCE}; at least the run's logging.interval)",
    )

    parser.add_argument(
        "--replay-monitor",
        default=None,
        metavar="KEY=VALUE,...",
        help="judge the runs with the spike monitor replayed over their logged curves with these monitor.spike "
        "settings (e.g. min_history=5,threshold=6; needs logging.interval 1) instead of the events they logged",
    )


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megagate.files import refuse_own_input

    if args.out is not None:
        refuse_own_input(args.out, [("run", r) for r in args.runs], replaces=getattr(args, "force", False))

    from megagate.frontier.report import frontier_dirs, write_report

    rule = SpikeRule(DEFAULT_RULE.window, DEFAULT_RULE.min_history, args.spike_k, args.spike_delta)
    replay = None if args.replay_monitor is None else parse_settings(args.replay_monitor)
    # a frontier search's folder (frontier.json): its report too, side by side with the grids given with it
    frontiers = frontier_dirs(args.runs)
    grids = [p for p in args.runs if Path(p) not in frontiers]
    runs = grids + [f for f in frontiers if any(f.glob("*/metrics.jsonl")) or any(f.glob("*/summary.json"))]
    if runs or not frontiers:
        print(report(runs, args.out, diag_lr=args.diag_lr, rule=rule, tolerance=args.spike_tolerance, replay=replay))
    for folder in frontiers:
        dest = None if args.out is None else Path(args.out) / (folder.name if len(frontiers) > 1 else "")
        print("\n" + write_report(folder, grids, dest))
    if args.out:
        print(f"report.txt, aggregate.json and plots written to {args.out}")
    return 0
