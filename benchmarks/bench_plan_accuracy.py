"""The planner's predicted step time against published NVIDIA runs, and against `megagate train`'s measured one on
this machine, in one run.

    .venv/bin/python benchmarks/bench_plan_accuracy.py [--rounds 2] [--steps 40] [--warmup 5] [--budget-s 90]
                                                       [--threads 1] [--held-out-only]

First (a few seconds, no training) two tables of published NVIDIA runs on their GPUs, per row the planner's
tokens/s per GPU against the published one and |error|, then the median and worst: megagate/plan/published_runs.yaml
(the `fit` rows the GPU constants are fitted on and its `held-out` rows) and benchmarks/held_out_runs.yaml (a second
table gathered apart, nothing fitted on it; each row's NVIDIA release beside it). `--held-out-only` prints the second
table alone and stops; `--rounds 0` prints both and stops.

Then the CPU part:
Each round: `megagate calibrate` writes a device profile of this machine (measured now), then every configuration
below is trained with `megagate train` (a real process, `torchrun --nproc-per-node 2` for the TP=2 one, mock data)
and planned with `megagate plan --profile` on that round's profile. Measured = the median of the step times the
trainer logs (metrics.jsonl `step_time`, one line every 5 steps, each the mean of its 5) after the warm-up steps;
predicted = the plan's step seconds. The lines are 5 steps apart, as the shipped CPU config logs: a line reads the
loss and, for a MoE model, megatron's per-layer MoE statistics (a collective), ~40 ms per line for the MoE runs
here, which a line every step would add to every step — a cost of the logging interval the planner does not model. Rounds
interleave calibration and training, so a machine shared with other work loads both alike; the load average is
printed beside every figure, and the share of its threads' time each process got (its CPU time over its wall time
x threads: 1 on a quiet machine) with the error of the figures normalised by it — on a machine shared with other
work the load moves between the calibration and each training run, and that column takes it out. Calibration and training run with `--threads` threads per process (OMP_NUM_THREADS;
torchrun's ranks too): 1 by default, because on a machine shared with other work a 2-thread OpenMP region waits for
its descheduled second thread and turns every figure into noise; on a quiet machine `--threads 2` plans the
default single-process run. No assertions: it prints predicted vs measured side by side, and the error.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LOG_INTERVAL = 5  # steps per logged line (see the module docstring)
BASE = [
    "model.preset=tiny",
    "model.num_layers=2",
    "model.hidden_size=128",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.head_dim=32",
    "model.ffn_hidden_size=384",
    "model.vocab_size=2048",
    "model.max_sequence_length=256",
    "data.demo=false",
    "data.mock=true",
    "train.eval_interval=0",
    "train.eval_iters=1",
    "checkpoint.interval=0",
    f"logging.interval={LOG_INTERVAL}",
    "logging.tensorboard=false",
]
MOE = ["model.preset=tiny-moe", "model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=128"]
# name -> (ranks, overrides): dense and MoE, baseline and G1, sequence 128 and 256, micro-batch 4 and 2, TP 2
CONFIGS: dict[str, tuple[int, list[str]]] = {
    "dense baseline s128 mbs4": (1, ["model.gate.preset=baseline", "train.seq_length=128", "train.micro_batch_size=4"]),
    "dense G1 s128 mbs4": (1, ["model.gate.preset=g1-elementwise", "train.seq_length=128", "train.micro_batch_size=4"]),
    "dense G1 s256 mbs2": (1, ["model.gate.preset=g1-elementwise", "train.seq_length=256", "train.micro_batch_size=2"]),
    "MoE baseline s128 mbs4": (
        1,
        [*MOE, "model.gate.preset=baseline", "train.seq_length=128", "train.micro_batch_size=4"],
    ),
    "MoE G1 s256 mbs2": (
        1,
        [*MOE, "model.gate.preset=g1-elementwise", "train.seq_length=256", "train.micro_batch_size=2"],
    ),
    "dense G1 s128 mbs4 TP2": (
        2,
        [
            "model.gate.preset=g1-elementwise",
            "train.seq_length=128",
            "train.micro_batch_size=4",
            "parallel.tensor_model_parallel_size=2",  # no SP: megatron's CPU (torch) norms refuse it
        ],
    ),
}
GLOBAL_BATCH = 8  # per step: 2 micro-batches of 4, or 4 of 2


def load() -> str:
    one, five = os.getloadavg()[:2]
    return f"load {one:.1f}/{five:.1f}"


def overrides(name: str, steps: int, out: str) -> tuple[int, list[str]]:
    ranks, extra = CONFIGS[name]
    return ranks, [*BASE, *extra, f"train.global_batch_size={GLOBAL_BATCH}", f"train.train_steps={steps}",
                   f"output.dir={out}"]  # fmt: skip


def environment(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


class Failed(RuntimeError):
    """A calibration or training subprocess that exited non-zero (the message ends with its stderr's tail)."""


def run_quietly(cmd: list[str], threads: int) -> None:
    """Run `cmd` with its output kept back; on failure raise `Failed` with the last lines of its stderr."""
    proc = subprocess.run(
        cmd, cwd=REPO, env=environment(threads), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise Failed(f"{' '.join(cmd[1:4])} ... exited {proc.returncode}: {tail}")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def train(name: str, steps: int, warmup: int, work: str, threads: int) -> tuple[float, float]:
    """(median logged step seconds after `warmup` steps, the share of its threads' time the run got) of a real
    `megagate train`."""
    out = f"{work}/{name.replace(' ', '_')}-{time.time_ns()}"
    ranks, over = overrides(name, steps, out)
    config = str(REPO / "examples" / "tiny_cpu.yaml")
    if ranks == 1:
        cmd = [sys.executable, "-m", "megagate", "train", "--config", config, *over]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "megagate", "train", "--config", config, *over]  # fmt: skip
    cpu, start = children_cpu(), time.perf_counter()
    run_quietly(cmd, threads)
    share = (children_cpu() - cpu) / ((time.perf_counter() - start) * ranks * threads)
    times = []
    with open(f"{out}/metrics.jsonl", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if record.get("split") == "train" and "step_time" in record:
                times.append(float(record["step_time"]))
    lines = -(-warmup // LOG_INTERVAL)  # the lines whose steps include warm-up ones
    return statistics.median(times[lines:]), min(1.0, share)


def predict(name: str, profile_path: str, steps: int) -> float:
    from megagate import config_reader
    from megagate.plan import plan
    from megagate.plan import profile as profile_mod

    ranks, over = overrides(name, steps, "unused")
    cfg = config_reader.load(str(REPO / "examples" / "tiny_cpu.yaml"), over, environment=False)
    return plan(cfg, ranks, profile_mod.load(profile_path), gpus_per_node=ranks).time.total


def published_table(path: Path, title: str) -> dict[str, dict[str, float]]:
    """Print every run of `path` (a published-runs file) as predicted vs published tokens/s per GPU with |error|,
    then each use's median and worst; return that summary (use -> runs, median, worst)."""
    from megagate.plan import published as P

    runs = P.load_runs(path)
    errs = P.errors(runs)
    print(f"\n{title} ({path.relative_to(REPO)})")
    print(
        f"{'run':50s} {'release':>10s} {'use':>9s} {'layout':>24s} {'published':>10s} {'predicted':>10s} {'|error|':>8s}"
    )
    for r in runs:
        w = r.workload
        predicted = P.tokens_per_s_per_gpu(r, P.predict(r))
        layout = f"{P.describe(w)} mbs{w.micro_batch}"
        release = str(r.entry.get("release", r.id.split("-")[1] if r.id.startswith(("bridge", "nemo")) else "-"))
        print(f"{r.id:50s} {release:>10s} {r.use:>9s} {layout:>24s} {r.tokens_per_s_per_gpu:10,.0f} {predicted:10,.0f} "
              f"{abs(errs[r.id]):8.1%}  ({errs[r.id]:+.1%})")  # fmt: skip
    uses = sorted({r.use for r in runs}, key=("fit", "held-out").index)
    out = {}
    for use in uses:
        values = [abs(errs[r.id]) for r in runs if r.use == use]
        out[use] = {"runs": len(values), "median": statistics.median(values), "worst": max(values)}
        print(f"{use}: {len(values)} runs, median |error| {out[use]['median']:.1%}, worst {out[use]['worst']:.1%}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median (whole logged lines)")
    parser.add_argument("--budget-s", type=float, default=90.0, help="calibration budget per round")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--threads", type=int, default=1, help="threads per process (OMP_NUM_THREADS)")
    parser.add_argument(
        "--held-out-only", action="store_true", help="print the second held-out table of published runs and stop"
    )
    args = parser.parse_args()
    from megagate.plan import published as P

    if not args.held_out_only:
        published_table(P.DATA, "published runs: fit and held-out rows")
    published_table(P.HELD_OUT, "second held-out table: gathered apart, nothing fitted on it")
    if args.held_out_only or args.rounds == 0:
        return 0
    import torch

    print(f"torch {torch.__version__}, {args.threads} threads per process, {os.cpu_count()} CPUs; {load()}")
    rows: dict[str, list[tuple[float, float, float]]] = {n: [] for n in args.configs}
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            profile = f"{work}/profile-{r}.json"
            start = time.perf_counter()
            try:
                cmd = [
                    sys.executable,
                    "-m",
                    "megagate",
                    "calibrate",
                    "--out",
                    profile,
                    "--budget-s",
                    str(args.budget_s),
                ]
                run_quietly(cmd, args.threads)
            except Failed as e:  # a round without a profile is said and skipped; the other rounds still count
                print(f"round {r + 1}: calibration failed, round skipped: {e}")
                continue
            with open(profile, encoding="utf-8") as f:
                calibrated_share = json.load(f)["samples"]["cpu_share"]
            print(
                f"round {r + 1}: calibrated in {time.perf_counter() - start:.0f} s, with {calibrated_share:.0%} of "
                f"its threads' time ({load()})"
            )
            order = args.configs[r % len(args.configs) :] + args.configs[: r % len(args.configs)]
            for name in order:
                try:
                    measured, share = train(name, args.steps, args.warmup, work, args.threads)
                except Failed as e:
                    print(f"  {name:26s} training failed, left out of this round: {e}")
                    continue
                predicted = predict(name, profile, args.steps)
                # load-normalised: each figure times the share of its threads' time its process got
                normalised = predicted * calibrated_share / (measured * share) - 1
                rows[name].append((predicted, measured, normalised))
                print(f"  {name:26s} predicted {predicted * 1e3:8.1f} ms  measured {measured * 1e3:8.1f} ms  "
                      f"error {predicted / measured - 1:+7.1%}  (the run got {share:.0%} of its threads' time; "
                      f"load-normalised error {normalised:+7.1%}; {load()})")  # fmt: skip
    print(
        f"\n{'configuration':26s} {'predicted ms':>13s} {'measured ms':>12s} {'error':>8s} {'normalised':>11s}"
        "   (medians over rounds)"
    )
    within = normal_within = 0
    for name, values in rows.items():
        if not values:
            print(f"{name:26s} {'not measured':>13s}")
            continue
        p = statistics.median(v[0] for v in values)
        m = statistics.median(v[1] for v in values)
        n = statistics.median(v[2] for v in values)
        within += abs(p / m - 1) <= 0.20
        normal_within += abs(n) <= 0.20
        print(f"{name:26s} {p * 1e3:13.1f} {m * 1e3:12.1f} {p / m - 1:+8.1%} {n:+11.1%}")
    print(f"{within} of {len(rows)} configurations within 20 % ({normal_within} load-normalised) ({load()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
