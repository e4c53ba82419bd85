"""`megagate plan CONFIG --nodes N [--gpus-per-node G] [--gpu NAME | --profile FILE] [--json] [--search]`."""

from __future__ import annotations

import argparse
import json
import math

from megagate import config_reader
from megagate.plan import GPUS
from megagate.plan.core import DEFAULT_FRAGMENTATION, DEFAULT_MARGIN_GB, plan

HELP = "per-GPU memory and step time of a config on N nodes (--search: the fitting layouts, fastest first)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML training config")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides (values parsed as YAML)")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (8; 4 on GB200 trays)")
    parser.add_argument(
        "--gpu", default=None, help=f"GPU of the datasheet profile (default h100-sxm): {', '.join(GPUS)}"
    )
    parser.add_argument(
        "--profile", default=None, help="a device profile from `megagate calibrate` (replaces --gpu's datasheet one)"
    )
    parser.add_argument("--routing-imbalance", type=float, default=1.0, help="MoE: busiest expert rank / mean (>= 1)")
    parser.add_argument("--margin-gb", type=float, default=DEFAULT_MARGIN_GB, help="fixed workspace margin")
    parser.add_argument("--fragmentation", type=float, default=DEFAULT_FRAGMENTATION, help="share of activations")
    parser.add_argument("--intra-node-gbs", type=float, default=None, help="NVLink GB/s per GPU (device default)")
    parser.add_argument("--inter-node-gbs", type=float, default=None, help="network GB/s per GPU (device default)")
    parser.add_argument("--search", action="store_true", help="rank every fitting layout by estimated step time")
    parser.add_argument("--top", type=int, default=15, help="layouts shown by --search")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (docs/planning.md lists the keys)")


def _positive(flag: str, value: float | None) -> None:
    from megagate.errors import ConfigError

    if value is not None and not (0 < value < math.inf):
        raise ConfigError(f"{flag} {value}: must be a positive finite number")


def run(args: argparse.Namespace) -> int:
    from megagate.errors import ConfigError

    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ConfigError(f"--nodes ({args.nodes}) and --gpus-per-node ({args.gpus_per_node}) must be >= 1")
    for flag, value in (("--margin-gb", args.margin_gb), ("--fragmentation", args.fragmentation)):
        if not value >= 0 or value == math.inf:
            raise ConfigError(f"{flag} {value}: must be a finite number >= 0")
    _positive("--intra-node-gbs", args.intra_node_gbs)
    _positive("--inter-node-gbs", args.inter_node_gbs)
    if not 1 <= args.routing_imbalance < math.inf:
        raise ConfigError(f"--routing-imbalance {args.routing_imbalance}: must be >= 1 (1: balanced routing)")
    if args.top < 1:
        raise ConfigError(f"--top {args.top}: must be >= 1")
    if args.profile is not None:
        from megagate.plan import profile as profile_mod

        device = profile_mod.load(args.profile)  # replaces --gpu's datasheet (the GPU acceptance script passes both)
    else:
        from megagate.plan.devices import gpu_spec

        device = gpu_spec(args.gpu or "h100-sxm")  # the unknown-GPU refusal before the config is read
    cfg = config_reader.load(args.config, args.overrides, environment=False)  # planned away from the data
    if args.profile is not None:
        try:
            device.check_precision(cfg.train.precision)
        except ConfigError as exc:
            raise ConfigError(f"--profile {args.profile!r}: {exc}") from None
    world = args.nodes * args.gpus_per_node
    kwargs = dict(
        gpus_per_node=args.gpus_per_node,
        margin_gb=args.margin_gb,
        fragmentation=args.fragmentation,
        intra_gbs=args.intra_node_gbs,
        inter_gbs=args.inter_node_gbs,
        routing_imbalance=args.routing_imbalance,
    )
    if args.search:
        from megagate.plan.search import format_search, search, why_nothing_fits

        misses: list = []
        cands = search(cfg, world, device, misses=misses, **kwargs)
        why = None if cands else why_nothing_fits(misses, world)
        if args.json:
            print(
                json.dumps(
                    {
                        "search": [
                            {
                                "layout": c.label,
                                "step_s": c.plan.time.total,
                                "tokens_per_s_per_gpu": c.plan.tokens_per_s_per_gpu,
                                "peak_gb": c.plan.peak.total / 1e9,
                                "limited_by": c.limited_by(),
                            }
                            for c in cands[: args.top]
                        ],
                        "fitting_layouts": len(cands),
                        "best": cands[0].plan.to_dict() if cands else None,
                        **({"nothing_fits": why} if why else {}),
                    },
                    indent=1,
                )
            )
        else:
            print(format_search(cands, args.top) + (f": {why}" if why else ""))
            if cands:
                print("\nbest:\n" + cands[0].plan.table())
        return 0 if cands else 1
    result = plan(cfg, world, device, **kwargs)
    print(json.dumps(result.to_dict(), indent=1) if args.json else result.table())
    return 0
