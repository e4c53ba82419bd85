"""Part `calibrate`: `megagate calibrate`'s device profile of this machine, and the plan it gives.

Where the checkout has the command: it measures the machine (`megagate calibrate --out FILE`), the profile file
comes back in the result folder, and `megagate plan --profile FILE` predicts the training again from it. Where it
has not, the part is skipped and says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tools.acceptance import child
from tools.acceptance.plan_part import has_option, plan_figures


def budget_s(share_s: float, smoke: bool) -> float:
    """`megagate calibrate --budget-s` for a part's share: 60 s of the share left for start-up (torch, megatron, the
    CUDA context), the last trainer variant running past the budget, and the plan from the profile (a 120 s share
    measures for 60 s), never under calibrate's least; the smoke proves the plumbing, so it measures for the least."""
    from megagate.commands.calibrate import MIN_BUDGET_S

    return MIN_BUDGET_S if smoke else max(MIN_BUDGET_S, share_s - 60)


def body(args, record: child.Record) -> None:
    from megagate.cli import COMMANDS

    if "calibrate" not in COMMANDS:
        record.skip("megagate calibrate does not exist in this checkout")
        return
    profile = Path(args.profile)
    cmd = [sys.executable, "-m", "megagate", "calibrate", "--out", str(profile)]
    if has_option("calibrate", "--budget-s"):
        cmd += ["--budget-s", f"{budget_s(args.seconds, args.smoke):.0f}"]
    record.update(command=" ".join(cmd[2:]))
    proc = subprocess.run(cmd, timeout=max(10.0, args.seconds - 20), env=dict(os.environ))
    if proc.returncode != 0 or not profile.exists():
        record.fail(f"megagate calibrate exited {proc.returncode} without a profile at {profile}")
        return
    record.update(profile_bytes=profile.stat().st_size)
    if has_option("plan", "--profile"):
        record.update(plan_with_profile=plan_figures(str(args.config), args.set, args.gpu, str(profile)))


def options(p) -> None:
    p.add_argument("--config", required=True, help="the acceptance's YAML config")
    p.add_argument("--set", action="append", default=[], help="a config override key=value (repeatable)")
    p.add_argument("--gpu", default="h200", help="the planner's device name")
    p.add_argument("--profile", required=True, help="where the device profile goes")
    p.add_argument("--seconds", type=float, required=True, help="the part's share of the budget")


if __name__ == "__main__":
    child.main(__doc__.splitlines()[0], body, options)
