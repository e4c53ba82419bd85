"""`megagate sweep`: expand learning rates × gate variants × seeds from one config; run locally or as a Slurm array.

Each grid point is one training run with `key=value` overrides on the same config and its own run directory
(`OUT/<variant>_lr<lr>_s<seed>`), which the trainer fills with the runfiles schema and `megagate report` reads.
Every point is read and checked by the trainer's own loader and layout rules before anything runs or is rendered.
"""

from __future__ import annotations

import argparse
import itertools
import math
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megagate.errors import ConfigError, MegagateError
from megagate.yamlfile import load_mapping

TRAIN_COMMAND = (sys.executable, "-m", "megagate", "train")


@dataclass(frozen=True)
class RunSpec:
    """One grid point: its name, its config overrides (`key=value`), and its run directory."""

    name: str
    overrides: tuple[str, ...]
    run_dir: str

    def argv(self, config_path: str) -> list[str]:
        """Arguments after the train command: the config, the overrides, the output directory."""
        return ["--config", str(config_path), *self.overrides, f"output.dir={self.run_dir}"]


def _lr_label(lr: float) -> str:
    return f"{lr:g}".replace("+", "")


def expand_grid(
    base_overrides: Sequence[str],
    lrs: Sequence[float],
    variants: Sequence[str],
    seeds: Sequence[int],
    out_dir: str = "runs/sweep",
) -> list[RunSpec]:
    """The grid in a fixed order (variant, lr, seed); the grid's own keys override any in `base_overrides`."""
    from megagate.model import gate as gates

    if not lrs or not variants or not seeds:
        raise ConfigError(f"sweep grid is empty: lrs={list(lrs)}, variants={list(variants)}, seeds={list(seeds)}")
    for lr in lrs:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
            raise ConfigError(f"sweep learning rate {lr!r} must be a positive finite number")
    for variant in variants:
        if variant not in gates.PRESETS:
            raise ConfigError(f"sweep variant {variant!r} is not a gate preset; presets: {', '.join(gates.PRESETS)}")
    for override in base_overrides:
        if "=" not in override:
            raise ConfigError(f"override {override!r} is not key=value")
    grid_keys = {"train.lr", "model.gate.preset", "seed", "output.dir"}
    base = [o for o in base_overrides if o.split("=", 1)[0] not in grid_keys]
    names: set[str] = set()
    specs = []
    for variant, lr, seed in itertools.product(variants, lrs, seeds):
        name = f"{variant}_lr{_lr_label(lr)}_s{seed}"
        if name in names:
            raise ConfigError(f"sweep grid has a duplicate point {name!r} (repeated lr, variant or seed)")
        names.add(name)
        overrides = (*base, f"train.lr={lr!r}", f"model.gate.preset={variant}", f"seed={int(seed)}")
        specs.append(RunSpec(name, overrides, str(Path(out_dir) / name)))
    return specs


def check_grid(specs: Sequence[RunSpec], config_path: str, world_size: int = 1) -> None:
    """Read every grid point with the trainer's loader and check its layout on `world_size` ranks.

    A ConfigError names the first bad point: the grid's own keys (variant, learning rate) can clash with the base.
    """
    from megagate import config_reader, run_config

    for spec in specs:
        try:
            cfg = config_reader.load(config_path, [*spec.overrides, f"output.dir={spec.run_dir}"])
            run_config.layout(cfg, world_size)
        except ConfigError as exc:
            raise ConfigError(f"sweep point {spec.name}: {exc}") from None


SWEEP_FILE = "sweep.json"  # megagate.analysis.aggregate.SWEEP_FILE: how `report` tells which sweep a run is in


def write_sweep_file(
    out_dir: str | Path,
    config_path: str,
    base_overrides: Sequence[str],
    lrs: Sequence[float],
    variants: Sequence[str],
    seeds: Sequence[int],
    specs: Sequence[RunSpec],
) -> Path:
    """OUT/sweep.json (atomically): the config, the base overrides, the grid and its run names. `megagate report`
    groups the runs under this folder as one sweep; a later sweep into the same folder (more variants or LRs) writes
    its own grid and keeps the earlier ones under "earlier", oldest first."""
    from megagate.monitor import runfiles

    path = Path(out_dir) / SWEEP_FILE
    record: dict = {
        "config": str(config_path),
        "overrides": list(base_overrides),
        "grid": {"lrs": [float(x) for x in lrs], "variants": list(variants), "seeds": [int(x) for x in seeds]},
        "runs": [spec.name for spec in specs],
    }
    try:
        previous = runfiles.read_json(path)
    except MegagateError:  # an unreadable file is replaced, not fatal: it only labels the folder
        previous = None
    if previous:
        earlier = previous.pop("earlier", [])
        record["earlier"] = [*(earlier if isinstance(earlier, list) else []), previous]
    runfiles.write_json(path, record)
    return path


def run_local(
    specs: Sequence[RunSpec], config_path: str, command: Sequence[str] = TRAIN_COMMAND, keep_going: bool = True
) -> dict[str, int]:
    """Run each spec in turn (`command` + spec.argv); return name -> exit status.

    A diverged run that aborts (non-zero exit) is a result of a stability sweep, not a failure of the sweep:
    with `keep_going` the remaining runs still execute.
    """
    results: dict[str, int] = {}
    for i, spec in enumerate(specs, start=1):
        Path(spec.run_dir).mkdir(parents=True, exist_ok=True)
        print(f"[sweep {i}/{len(specs)}] {spec.name}", flush=True)
        status = subprocess.run([*command, *spec.argv(config_path)]).returncode
        results[spec.name] = status
        if status != 0:
            print(f"[sweep] {spec.name} exited with status {status}", file=sys.stderr, flush=True)
            if not keep_going:
                break
    return results


def slurm_array(specs: Sequence[RunSpec], config_path: str, request: SlurmRequest, launcher: str = "srun") -> str:  # noqa: F821
    """An sbatch script running the grid as a job array (task i = specs[i]), via megagate.slurm's renderer."""
    import dataclasses

    from megagate.slurm import render_batch_script

    if request.array is None:
        request = dataclasses.replace(request, array=f"0-{len(specs) - 1}")
    sweep = [[*spec.overrides, f"output.dir={spec.run_dir}"] for spec in specs]
    header = "\n".join([f"config: {config_path}", *(f"array task {i}: {spec.name}" for i, spec in enumerate(specs))])
    return render_batch_script(
        request, ["-m", "megagate", "train", "--config", str(config_path)], launcher, sweep=sweep, header=header
    )


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
        from megagate.slurm import submit, write_script

        script = slurm_array(specs, args.config, request)
        if args.script:
            write_script(script, args.script)
            print(f"wrote {args.script} ({len(specs)} array tasks)")
            return 0
        job = submit(request, script)
        print(f"submitted job array {job} ({len(specs)} runs under {args.out})")
        return 0
    results = run_local(specs, args.config)
    failed = [name for name, status in results.items() if status]
    print(
        f"[sweep] {len(results) - len(failed)}/{len(results)} runs exited 0"
        + (f"; non-zero: {', '.join(failed)}" if failed else "")
    )
    return 0


__all__ = ["RunSpec", "check_grid", "expand_grid", "run_local", "slurm_array", "write_sweep_file"]
