"""`megagate frontier`: each gate variant's largest stable learning rate, found adaptively (megagate.frontier).

    megagate frontier --config C --variants baseline,g1-elementwise --lr-range 1e-2:1 --seeds 0,1,2 \\
        --resolution 0.25 --out runs/frontier [key=value ...]            # local: a process pool
    megagate frontier ... --slurm --gpus-per-node 8 --partition gpu      # Slurm: chained job arrays
    megagate frontier --resume runs/frontier                             # continue (what the driver jobs run)
    megagate report runs/frontier [runs/sweep] --out REPORT              # the report (side by side with a grid)

Rerunning the same command resumes: finished trials are not run again. Everything is checked before anything is
written or submitted (bad input: one line, exit 2).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from megagate.errors import ConfigError, MegagateError
from megagate.frontier import driver
from megagate.frontier import state as state_mod
from megagate.frontier.rule import HealthRule
from megagate.frontier.spec import EarlyStopSpec, FrontierSpec, resolve, validate


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _range(text: str) -> tuple[float, float]:
    parts = text.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        return float(parts[0]), float(parts[1])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LOW:HIGH (two learning rates, e.g. 1e-2:1)") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="the base training config (YAML)")
    parser.add_argument("--variants", default="baseline,g1-elementwise", help="gate presets, comma-separated")
    parser.add_argument("--lr-range", type=_range, help="LOW:HIGH, the bounds of the search (log-LR)")
    parser.add_argument("--seeds", type=_ints, default=[0], help="seeds, e.g. 0,1,2 (default 0)")
    parser.add_argument("--out", default="runs/frontier", help="the search's folder (state, trials, report)")
    parser.add_argument("--resume", metavar="OUT", help="continue the search in OUT (its settings are stored there)")
    s = parser.add_argument_group("search")
    s.add_argument("--coarse", type=int, default=2, help="log-spaced LRs of the first bracket, ends included (2)")
    s.add_argument("--resolution", type=float, default=0.25, help="bisect until the bracket is <= this (decades)")
    s.add_argument(
        "--schedule",
        default="wide",
        help="wide: coarse points and seeds at once (fewer rounds); thrifty: the top and the seeds only when needed, "
        "one seed per round (fewer trial-steps)",
    )
    s.add_argument("--budget", type=int, default=None, help="stop launching rounds after this many trial-steps")
    s.add_argument("--max-attempts", type=int, default=3, help="launches of a trial failing for non-stability reasons")
    h = parser.add_argument_group("health rule")
    h.add_argument("--delta", type=float, default=0.5, help="final valid loss within this of the reference (0.5)")
    h.add_argument(
        "--reference", type=float, default=None, help="a fixed reference loss in nats (default: the variant's best)"
    )
    h.add_argument(
        "--decisive", type=float, default=None, help="decide an LR on fewer seeds when this far from the threshold"
    )
    h.add_argument("--max-loss-spikes", type=int, default=0, help="loss spikes allowed after warm-up (0)")
    h.add_argument("--min-healthy-seeds", type=int, default=None, help="seeds that must be healthy (default: all)")
    e = parser.add_argument_group("early stopping")
    e.add_argument(
        "--margin", type=float, default=None, help="nats above the best trial at a rung (default: 2 x delta)"
    )
    e.add_argument("--eta", type=float, default=2.0, help="rungs at T/eta, T/eta^2, ... (default 2)")
    e.add_argument("--window", type=int, default=10, help="steps averaged at a rung (default 10)")
    e.add_argument("--no-early-stop", action="store_true", help="run every trial to its last step")
    lo = parser.add_argument_group("local")
    lo.add_argument("--workers", type=int, default=None, help="trials at once (default: GPUs, else cores/threads)")
    lo.add_argument("--threads", type=int, default=1, help="CPU threads per trial (OMP_NUM_THREADS, default 1)")
    parser.add_argument(
        "--python", default=sys.executable, help="the python (and so the megagate) the trials run (default: this one)"
    )
    sl = parser.add_argument_group("slurm")
    sl.add_argument("--slurm", action="store_true", help="run each round as a job array, chained by driver jobs")
    sl.add_argument("--nodes", type=int, default=1, help="nodes per trial")
    sl.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (0: a CPU job)")
    sl.add_argument("--tasks-per-node", type=int, default=None, help="ranks per node of a CPU job")
    sl.add_argument("--time", default="04:00:00", help="time limit per trial")
    sl.add_argument("--driver-time", default="00:30:00", help="time limit of a driver job")
    sl.add_argument("--partition")
    sl.add_argument("--account")
    sl.add_argument("--qos")
    sl.add_argument("--job-name", default="frontier")
    sl.add_argument("--max-parallel", type=int, default=None, help="array tasks running at once")
    sl.add_argument("--venv", default=None)
    sl.add_argument("--master-addr", default=None)
    sl.add_argument("--signal-lead", type=int, default=300, help="SIGUSR1 this long before a trial's time limit")
    sl.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment of the trials")
    parser.add_argument("--dry-run", action="store_true", help="check and print the first round; run nothing")
    parser.add_argument("overrides", nargs="*", help="key=value overrides applied to every trial")


def _spec(args: argparse.Namespace) -> FrontierSpec:
    if not args.config or args.lr_range is None:
        raise ConfigError("give --config and --lr-range LOW:HIGH (or --resume OUT to continue a search)")
    delta = args.delta
    spec = FrontierSpec(
        config=args.config,
        variants=tuple(v.strip() for v in args.variants.split(",") if v.strip()),
        lo=args.lr_range[0],
        hi=args.lr_range[1],
        seeds=tuple(args.seeds),
        coarse=args.coarse,
        resolution=args.resolution,
        schedule=args.schedule,
        rule=HealthRule(delta, args.max_loss_spikes, args.min_healthy_seeds, args.reference, args.decisive),
        early=EarlyStopSpec(
            # a training-loss gap at a rung overstates the final validation gap (measured 1.3-1.9x on the CPU
            # study's grid between steps 100 and 250): "clearly worse" is twice the tolerance
            margin=2 * delta if args.margin is None else args.margin,
            eta=args.eta,
            window=args.window,
            enabled=not args.no_early_stop,
        ),
        overrides=tuple(args.overrides),
        budget=args.budget,
        max_attempts=args.max_attempts,
    )
    validate(spec)
    return spec


def _backend(args: argparse.Namespace) -> dict:
    if not args.slurm:
        if args.workers is not None and args.workers < 1:
            raise ConfigError(f"--workers {args.workers} must be >= 1")
        if args.threads < 1:
            raise ConfigError(f"--threads {args.threads} must be >= 1")
        if not os.access(args.python, os.X_OK) or os.path.isdir(args.python):
            raise ConfigError(f"--python {args.python}: not an executable file")
        return {"kind": "local", "workers": args.workers, "threads": args.threads, "python": args.python}
    from megagate.frontier import slurm
    from megagate.slurm import SlurmRequest
    from megagate.slurm.request import parse_time_limit

    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--env {item!r} is not KEY=VALUE")
        env[key] = value
    if args.max_parallel is not None and args.max_parallel < 1:
        raise ConfigError(f"--max-parallel {args.max_parallel} must be >= 1")
    parse_time_limit(args.driver_time)
    request = SlurmRequest(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tasks_per_node=args.tasks_per_node,
        time=args.time,
        partition=args.partition,
        account=args.account,
        qos=args.qos,
        job_name=args.job_name,
        python=args.python,
        venv=args.venv,
        master_addr=args.master_addr,
        signal_lead_s=args.signal_lead,
        env=env,
    )
    return slurm.backend_record(request, args.max_parallel, args.driver_time)


def _same_spec(old: FrontierSpec, new: FrontierSpec, out: Path) -> None:
    a, b = old.to_dict(), new.to_dict()
    for key in a:
        if a[key] != b[key]:
            raise ConfigError(
                f"{out} holds a frontier search with {key}={a[key]!r}, not {b[key]!r}: resume it with the same "
                "settings (or --resume), or choose another --out"
            )


def _start(args: argparse.Namespace) -> Path:
    """Check everything, then create (or reopen) the search's state. Nothing is written before the checks pass."""
    spec = _spec(args)
    backend = _backend(args)
    from megagate.files import refuse_own_input

    refuse_own_input(args.out, [("--config", args.config)])
    out = Path(args.out)
    world = 1
    if backend["kind"] == "slurm":  # each array task runs nodes x ranks per node
        from megagate.frontier.slurm import request_from

        world = request_from(backend).world_size
    spec = resolve(spec, out, world)
    if backend["kind"] == "slurm" and not args.dry_run:
        from megagate.frontier.slurm import check_sbatch

        check_sbatch()
    existing = state_mod.load(out)
    if existing is not None:
        _same_spec(existing.spec, spec, out)
        if existing.backend.get("kind") != backend["kind"]:
            raise ConfigError(f"{out} runs on {existing.backend.get('kind')}, not {backend['kind']}: resume it there")
        return out
    if args.dry_run:
        state = state_mod.FrontierState(spec, backend)
        names, _ = driver.next_round(state)
        print(f"rungs at steps {spec.rungs() or '(none)'}; round 1 ({len(names)} trials):")
        for name in names:
            t = state.trials[name]
            argv = spec.trial_overrides(t.variant, t.lr, t.seed, out / name)
            print(shlex.join(["megagate", "train", "--config", spec.config, *argv]))
        return out
    from megagate.files import check_writable_dir

    check_writable_dir(out, "--out")
    state_mod.save(out, state_mod.FrontierState(spec, backend))
    return out


def _run_local(out: Path, state: state_mod.FrontierState) -> None:
    from megagate.grid.local import default_workers, run_pool

    backend = state.backend
    threads = backend.get("threads") or 1
    workers, gpus = default_workers(threads)
    workers = backend.get("workers") or workers
    print(f"[frontier] local pool: {workers} worker(s), {threads} thread(s) each" + (f", GPUs {gpus}" if gpus else ""))

    def launch(st: state_mod.FrontierState, rnd: dict) -> None:
        rnd["pids"] = {}

        def started(name: str, pid: int) -> None:
            rnd["pids"][name] = pid
            state_mod.save(out, st)

        jobs = [
            (n, [*driver.python_command(backend.get("python")), "--config", st.spec.config, *rnd["overrides"][n]])
            for n in rnd["trials"]
        ]
        rnd["exit_codes"] = run_pool(jobs, out / "logs", workers, threads, gpus[:workers], on_start=started)
        state_mod.save(out, st)

    interrupted = state.open_round is not None  # the previous driver died mid-round
    while not driver.advance(out, launch, interrupted):
        interrupted = False


def _run_slurm(out: Path, state: state_mod.FrontierState) -> None:
    from megagate.frontier import slurm

    running = slurm.round_running(state)
    if running is not None:
        print(f"[frontier] round {len(state.rounds)} is still running (job {running}); its driver job continues")
        return

    def launch(st: state_mod.FrontierState, rnd: dict) -> None:
        slurm.submit_round(st, out, rnd)
        state_mod.save(out, st)

    driver.advance(out, launch, interrupted=False)


def run(args: argparse.Namespace) -> int:
    from megagate.frontier.report import write_report
    from megagate.train import runlock

    if args.resume:
        if args.config or args.lr_range:
            raise ConfigError("--resume OUT continues a search with its stored settings: give no --config/--lr-range")
        out = Path(args.resume)
        if state_mod.load(out) is None:
            raise MegagateError(f"--resume {out}: no {state_mod.STATE_FILE} there (start the search with --config)")
    else:
        out = _start(args)
        if args.dry_run:
            return 0
    lock = runlock.acquire(out, "frontier --out")  # one driver at a time
    try:
        state = state_mod.load(out)
        if not state.done:
            (_run_slurm if state.backend["kind"] == "slurm" else _run_local)(out, state)
        state = state_mod.load(out)
        if state.done:
            print(write_report(out, dest=out))
            print(f"[frontier] report: {out}/frontier.txt, frontier_report.json, frontier_lr.png")
    finally:
        lock.release()
    return 0


__all__ = ["add_arguments", "run"]
