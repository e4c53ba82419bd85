"""`megagate sweep`: expand learning rates × gate variants × seeds from one config; run locally or as a Slurm array.

The arguments only: the grid, its checks and its runs are megagate.grid's (`trials`, `local`, `slurm`), shared with
`megagate frontier`.
"""

from __future__ import annotations

import argparse
import shlex

from megagate.grid.trials import TRAIN_COMMAND, check_grid, expand_grid, write_sweep_file
from megagate.yamlfile import load_mapping


# --- command line ----------------------------------------------------------------------------------------------
def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the base training config (YAML)")
    parser.add_argument("--lrs", type=_floats, required=True, help="learning rates, e.g. 1e-3,4e-3,8e-3")
    parser.add_argument(
        "--variants",
        default="baseline,g1-elementwise",
        help="gate presets, comma-separated (default: baseline,g1-elementwise)",
    )
    parser.add_argument("--seeds", type=_ints, default=[0], help="seeds, e.g. 0,1,2 (default: 0)")
    parser.add_argument("--out", default="runs/sweep", help="parent directory of the run directories")
    parser.add_argument("--slurm", action="store_true", help="render (and submit) a Slurm job array instead")
    parser.add_argument("--script", default=None, help="with --slurm: write the script here and do not submit")
    parser.add_argument("--nodes", type=int, default=1, help="with --slurm: nodes per run")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="with --slurm: GPUs per node")
    parser.add_argument("--time", default="04:00:00", help="with --slurm: time limit per run")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--account", default=None)
    parser.add_argument("--max-parallel", type=int, default=None, help="with --slurm: array tasks running at once")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and their commands only")
    parser.add_argument("overrides", nargs="*", help="key=value overrides applied to every run")


def run(args: argparse.Namespace) -> int:

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    specs = expand_grid(args.overrides, args.lrs, variants, args.seeds, args.out)
    request = None
    if args.slurm:
        from megagate.slurm import SlurmRequest

        array = f"0-{len(specs) - 1}" + (f"%{args.max_parallel}" if args.max_parallel else "")
        request = SlurmRequest(
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            time=args.time,
            partition=args.partition,
            account=args.account,
            job_name="megagate-sweep",
            array=array,
        )
    load_mapping(args.config)  # a missing or broken file is one error, not one per grid point
    # local runs are single processes; each array task gets the request's nodes x GPUs ranks
    check_grid(specs, args.config, request.world_size if request is not None else 1)
    if args.dry_run:
        for spec in specs:
            print(shlex.join([*TRAIN_COMMAND[1:], *spec.argv(args.config)]))  # copy-pasteable, quoted
        return 0
    write_sweep_file(args.out, args.config, args.overrides, args.lrs, variants, args.seeds, specs)
    if request is not None:
        from megagate.grid.slurm import array_script
        from megagate.slurm import submit, write_script

        tasks = [(spec.name, [*spec.overrides, f"output.dir={spec.run_dir}"]) for spec in specs]
        _, script = array_script(request, args.config, tasks, f"config: {args.config}")
        if args.script:
            write_script(script, args.script)
            print(f"wrote {args.script} ({len(specs)} array tasks)")
            return 0
        job = submit(request, script)
        print(f"submitted job array {job} ({len(specs)} runs under {args.out})")
        return 0
    from megagate.grid.local import run_local

    results = run_local(specs, args.config)
    failed = [name for name, status in results.items() if status]
    print(
        f"[sweep] {len(results) - len(failed)}/{len(results)} runs exited 0"
        + (f"; non-zero: {', '.join(failed)}" if failed else "")
    )
    return 0
