"""`megagate demo`: the real pipeline end to end on CPU, baseline vs gated attention, in a few minutes.

    demo data (stdlib text -> BPE -> indexed dataset) -> `megagate train` per variant (subprocesses, streamed)
    -> OUT/<variant>/{metrics.jsonl, tensorboard/, checkpoints/, summary.json} -> OUT/loss_curves.png + a table

Re-running continues: a variant whose summary.json already has the requested steps is not trained again, and an
interrupted one resumes from its last checkpoint (the trainer does that). `--fresh` starts over.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from megagate.errors import MegagateError
from megagate.monitor import runfiles

REPO = Path(__file__).resolve().parents[2]  # megagate/commands/demo.py -> the checkout
DEFAULT_CONFIG = REPO / "examples" / "tiny_cpu.yaml"
DEFAULT_VARIANTS = ("baseline", "g1-elementwise")
# 400 steps x 16 x 128 tokens: ~1 min per variant on 2 cores (measured: 2 variants, ~2.5 min in all; docs/demo.md)
DEFAULT_STEPS = 400
# console lines of the child that say nothing about the run (gloo: one per process group; megatron: API notices)
NOISE = re.compile(
    r"^(\[Gloo\] Rank \d+ is connected to|DistributedDataParallel: full_param_layout not provided"
    r"|MCore's async save is deprecated)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megagate.model import gate as gates

    parser.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"training steps per variant (default {DEFAULT_STEPS})"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(DEFAULT_VARIANTS),
        choices=list(gates.PRESETS),
        metavar="PRESET",
        help="gate presets to train (default: baseline g1-elementwise)",
    )
    parser.add_argument("--fresh", action="store_true", help="delete the variants' previous run directories first")
    parser.add_argument(
        "--config", default=str(DEFAULT_CONFIG), help="trainer config (default: examples/tiny_cpu.yaml)"
    )
    parser.add_argument("--data-dir", default="runs/demo-data", help="cache of the demo corpus and tokenizer")


def train_overrides(variant: str, run_dir: Path, steps: int, data_dir: str) -> list[str]:
    """The trainer overrides of one variant: the schedule scales with `steps` so curves have ~50 points."""
    return [
        f"model.gate.preset={variant}",
        f"output.dir={run_dir}",
        f"data.demo_dir={data_dir}",
        f"train.train_steps={steps}",
        f"train.warmup_steps={max(1, steps // 20)}",
        f"train.eval_interval={max(1, steps // 8)}",
        "train.eval_iters=4",
        f"logging.interval={max(1, steps // 50)}",
        "checkpoint.interval=100",  # a hard kill loses at most ~15 s; SIGINT/SIGTERM checkpoint on the spot
    ]


def check_reusable(run_dir: Path, steps: int) -> bool:
    """True if `run_dir` holds a finished run of `steps` steps; refuses a run of another length (needs --fresh)."""
    summary = runfiles.read_json(run_dir / runfiles.SUMMARY)
    if summary is not None and summary.get("steps") == steps:
        return True
    previous = (summary or {}).get("steps") or runfiles.lookup(runfiles.read_config(run_dir), "train.train_steps")
    if previous is not None and previous != steps:
        raise MegagateError(f"{run_dir} holds a {previous}-step run, not {steps}; pass --fresh or another --out")
    return False


def train_variant(cmd: list[str], variant: str, width: int) -> float:
    """Run the trainer, streaming its console with a `[variant]` prefix; returns the wall time in seconds.

    The child has its own session so that Ctrl-C reaches only the demo, which then asks the trainer to checkpoint
    and stop (SIGTERM) instead of killing it mid-step.
    """
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # `-m megagate` from any cwd
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
    env.setdefault("PYTHONWARNINGS", "ignore::UserWarning")  # megatron's deprecation chatter on every start
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    assert proc.stdout is not None

    def stream() -> None:
        for line in proc.stdout:
            if not NOISE.match(line):
                print(f"[{variant:>{width}}] {line.rstrip()}", flush=True)

    try:
        stream()
        code = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGTERM)  # the trainer finishes its step, checkpoints and exits
        stream()
        proc.wait()
        raise MegagateError(f"interrupted while training {variant}; run the same command to continue") from None
    if code != 0:
        raise MegagateError(f"training {variant} failed (exit code {code}); the command was: {' '.join(cmd)}")
    return time.perf_counter() - start


def summarize(variant: str, run_dir: Path, params: int, wall: float | None) -> dict[str, Any]:
    """One row of the table, from the run's files."""
    records = runfiles.read_jsonl(run_dir / runfiles.METRICS)
    train, valid = runfiles.train_metrics(records), runfiles.valid_metrics(records)
    if not train or not valid:
        raise MegagateError(f"{run_dir / runfiles.METRICS} has no train or validation lines")
    tail = train[-max(1, len(train) // 10) :]  # the last 10% of logged steps: one step's loss is noisy
    speeds = [r["tokens_per_s"] for r in train[1:] or train]  # the first logged step includes warm-up
    return {
        "variant": variant,
        "params": params,
        "train_loss": statistics.fmean(r["loss"] for r in tail),
        "valid_loss": valid[-1]["loss"],
        "valid_ppl": math.exp(min(valid[-1]["loss"], 50.0)),
        "tokens_per_s": statistics.median(speeds),
        "wall_s": wall,
    }


def table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'variant':16s} {'params':>9s} {'train loss':>10s} {'valid loss':>10s} {'valid ppl':>9s} "
        f"{'tokens/s':>9s} {'wall':>7s}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        wall = "-" if r["wall_s"] is None else f"{r['wall_s']:6.1f}s"
        lines.append(
            f"{r['variant']:16s} {r['params']:>9,} {r['train_loss']:>10.3f} {r['valid_loss']:>10.3f} "
            f"{r['valid_ppl']:>9.1f} {r['tokens_per_s']:>9,.0f} {wall:>7s}"
        )
    return "\n".join(lines)


def plot(out: Path, runs: dict[str, Path], steps: int) -> Path:
    """Train (thin) and validation (markers) loss of every variant in one figure, one colour per variant."""
    from megagate.analysis.plotting import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (variant, run_dir) in enumerate(runs.items()):
        records = runfiles.read_jsonl(run_dir / runfiles.METRICS)
        train, valid = runfiles.train_metrics(records), runfiles.valid_metrics(records)
        color = f"C{i}"
        ax.plot(
            [r["step"] for r in train],
            [r["loss"] for r in train],
            color=color,
            lw=1,
            alpha=0.6,
            label=f"{variant} train",
        )
        ax.plot(
            [r["step"] for r in valid],
            [r["loss"] for r in valid],
            color=color,
            lw=2,
            ls="--",
            marker="o",
            label=f"{variant} validation",
        )
    ax.set(
        xlabel="step",
        ylabel="cross-entropy loss (nats/token)",
        title=f"megagate demo: tiny GPT on Python stdlib text, {steps} steps: {' vs '.join(runs)}",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    return save(fig, out / "loss_curves.png")


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    from megagate import config_reader
    from megagate.data.demo import prepare_demo_data
    from megagate.model.counts import parameter_counts

    if args.steps < 2:
        raise MegagateError(f"--steps {args.steps}: need at least 2 steps to draw a loss curve")
    variants = list(dict.fromkeys(args.variants))
    out = Path(args.out)
    base = config_reader.load(args.config)  # fail on a bad config before building anything
    print(
        f"demo data: Python stdlib docstrings, code and licenses -> BPE {base.data.demo_vocab_size} tokens", flush=True
    )
    tokenizer, prefix = prepare_demo_data(args.data_dir, base.data.demo_vocab_size, base.data.demo_max_bytes)
    print(f"demo data: {prefix}.bin, tokenizer {tokenizer}", flush=True)

    width = max(len(v) for v in variants)
    rows, runs = [], {}
    previous = {r["variant"]: r for r in (runfiles.read_json(out / "demo.json") or {}).get("rows", [])}
    for variant in variants:
        run_dir = runs[variant] = out / variant
        if args.fresh and run_dir.exists():
            shutil.rmtree(run_dir)
        overrides = train_overrides(variant, run_dir, args.steps, args.data_dir)
        params = parameter_counts(config_reader.load(args.config, overrides).model)["total"]
        if check_reusable(run_dir, args.steps):
            print(f"[{variant:>{width}}] finished {args.steps}-step run found in {run_dir}; reusing it", flush=True)
            wall = previous.get(variant, {}).get("wall_s")
        else:
            cmd = [sys.executable, "-m", "megagate", "train", "--config", args.config, *overrides]
            print(f"[{variant:>{width}}] {' '.join(cmd[1:])}", flush=True)
            wall = train_variant(cmd, variant, width)
        rows.append(summarize(variant, run_dir, params, wall))

    png = plot(out, runs, args.steps)
    runfiles.write_json(out / "demo.json", {"steps": args.steps, "rows": rows})
    print(f"\n{table(rows)}\n")
    print("train loss: mean over the last 10% of logged steps; validation on the held-out 5% split after the last step")
    print(f"loss curves: {png}\nTensorBoard: tensorboard --logdir {out}")
    print(f"total time: {time.perf_counter() - started:.0f}s")
    return 0
