"""`megagate report RUNS...`: a table over run directories (loss, ppl, spikes, divergence, F-Attn, M-Act) and plots."""

from __future__ import annotations

import argparse

from megagate.monitor.report import report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="run directories, or folders of run directories (a sweep's --out)")
    parser.add_argument("--out", default=None, help="write loss_curves.png, final_loss_vs_lr.png, report.txt here")


def run(args: argparse.Namespace) -> int:
    print(report(args.runs, args.out))
    if args.out:
        print(f"plots written to {args.out}")
    return 0
