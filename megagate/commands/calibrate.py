"""`megagate calibrate [--out FILE] [--budget-s S] [--ranks N]`: measure this machine, write a device profile."""

from __future__ import annotations

import argparse
import math
import os

HELP = "measure this machine (GEMMs, attention, bandwidth, collectives, the trainer's overheads) into a device profile"
MIN_BUDGET_S = 20.0  # below this the sections' shares are too short to fit a curve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="device_profile.json", help="the profile to write (JSON, atomically)")
    parser.add_argument("--budget-s", type=float, default=110.0, help="time budget in seconds (default 110)")
    parser.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="local ranks of the collective measurement (default: 2 on CPU, the GPUs)",
    )


def run(args: argparse.Namespace) -> int:
    from megagate.errors import ConfigError

    if not (0 < args.budget_s < math.inf):
        raise ConfigError(f"--budget-s {args.budget_s}: must be a positive number of seconds")
    if args.budget_s < MIN_BUDGET_S:
        raise ConfigError(f"--budget-s {args.budget_s}: calibration needs at least {MIN_BUDGET_S:.0f} seconds")
    if args.ranks is not None and args.ranks < 1:
        raise ConfigError(f"--ranks {args.ranks}: must be >= 1")
    if not args.out:
        raise ConfigError("--out '' is empty: give a file name for the profile")
    if os.path.isdir(args.out):
        raise ConfigError(f"--out {args.out!r} is a folder; give a file name for the profile")
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        raise ConfigError(f"--out {args.out!r}: folder {folder!r} does not exist")
    import torch

    from megagate.calibrate.core import calibrate
    from megagate.plan import profile as profile_mod

    ranks = args.ranks or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    result = calibrate(args.budget_s, ranks)
    profile_mod.save(result, args.out)
    print(
        f"device profile of {result.name} written to {args.out} (plan with: megagate plan CONFIG --profile {args.out})"
    )
    return 0
