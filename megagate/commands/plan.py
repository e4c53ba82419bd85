"""`megagate plan CONFIG --nodes N --gpus-per-node G --gpu NAME [key=value ...] [--search]`."""

from __future__ import annotations

import argparse

from megagate import config_reader
from megagate.plan import DEVICES
from megagate.plan.core import DEFAULT_FRAGMENTATION, DEFAULT_MARGIN_GB, DEFAULT_MFU, plan

HELP = "per-GPU memory and step time of a config on N nodes (--search: the fitting layouts, fastest first)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML training config")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides (values parsed as YAML)")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu", default="h100-sxm", help=f"device: {', '.join(DEVICES)}")
    parser.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="assumed model FLOPs utilisation")
    parser.add_argument("--margin-gb", type=float, default=DEFAULT_MARGIN_GB, help="fixed workspace margin")
    parser.add_argument("--fragmentation", type=float, default=DEFAULT_FRAGMENTATION, help="share of activations")
    parser.add_argument("--intra-node-gbs", type=float, default=None, help="NVLink GB/s per GPU (device default)")
    parser.add_argument("--inter-node-gbs", type=float, default=None, help="IB GB/s per GPU (device default)")
    parser.add_argument("--search", action="store_true", help="rank every fitting layout by estimated step time")
    parser.add_argument("--top", type=int, default=15, help="layouts shown by --search")


def run(args: argparse.Namespace) -> int:
    from megagate.errors import ConfigError

    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ConfigError(f"--nodes ({args.nodes}) and --gpus-per-node ({args.gpus_per_node}) must be >= 1")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu {args.mfu}: the assumed utilisation must be in (0, 1]")
    for flag, value in (("--margin-gb", args.margin_gb), ("--fragmentation", args.fragmentation)):
        if not value >= 0 or value == float("inf"):
            raise ConfigError(f"{flag} {value}: must be a finite number >= 0")
    for flag, value in (("--intra-node-gbs", args.intra_node_gbs), ("--inter-node-gbs", args.inter_node_gbs)):
        if value is not None and not 0 < value < float("inf"):
            raise ConfigError(f"{flag} {value}: must be a positive bandwidth")
    if args.top < 1:
        raise ConfigError(f"--top {args.top}: must be >= 1")
    cfg = config_reader.load(args.config, args.overrides, environment=False)  # planned away from the data
    world = args.nodes * args.gpus_per_node
    kwargs = dict(
        gpus_per_node=args.gpus_per_node,
        mfu=args.mfu,
        margin_gb=args.margin_gb,
        fragmentation=args.fragmentation,
        intra_gbs=args.intra_node_gbs,
        inter_gbs=args.inter_node_gbs,
    )
    if args.search:
        from megagate.plan.search import format_search, search

        cands = search(cfg, world, args.gpu, **kwargs)
        print(format_search(cands, args.top))
        if cands:
            print("\nbest:\n" + cands[0].plan.table())
        return 0 if cands else 1
    result = plan(cfg, world, args.gpu, **kwargs)
    print(result.table())
    return 0
