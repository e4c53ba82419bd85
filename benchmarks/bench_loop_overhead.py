"""What `megagate train` costs per step over a minimal hand-written loop on the same megatron model.

    .venv/bin/python benchmarks/bench_loop_overhead.py [--shapes tiny hidden256] [--rounds 4] [--windows 4]
                                                       [--clock wall|cpu]

Each round runs, in an order alternating every round, two processes on the same config (examples/tiny_cpu.yaml
and the overrides of the shape; evaluation off, no checkpoint but the final one):

  megagate  `python -m megagate train ...`: the whole trainer (megatron's schedule, DDP, DistributedOptimizer,
            every default callback: stop checks, metrics, spike monitor (warn), checkpoint cadence);
  plain     the minimal megatron loop of this file (`--worker plain`): the same GPTModel built by megagate's
            set-up (same weights, same loss function), the same data loader read synchronously, a Python loop
            over the micro-batches with `loss.backward()`, torch.nn.utils.clip_grad_norm_, torch.optim.AdamW
            (megatron's weight-decay groups) and megatron's OptimizerParamScheduler (same LR schedule).

Both read the loss on the host every `--interval` steps (megagate: its logging interval) and time windows of that
many steps, ended by that read: the window's mean step time, data loading included (`--clock wall`, the default:
megagate's own `step_time`, evaluations and saves left out). `--clock cpu` times the main thread's CPU time instead
(the trainer then runs as `megagate train` runs it, `train(resolve(cfg, 1))` with every default callback, plus one
that reads the clock): other processes on a shared machine move it much less, and work on other threads (megagate's
data prefetch) is not counted, so it measures the critical path of an otherwise idle machine. The first `--warmup`
windows of each process are not counted. Reported per shape: each process's median window, and the paired
ratio megagate / plain per round (the two processes of a round ran within seconds of each other, so a machine
that gets busier or quieter moves both alike): its median and its min..max over the rounds. The load average
before and after is printed: on a shared machine, read the spread, not only the median.
No assertions: this prints figures; README.md and docs/architecture.md keep the ones measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFIG = str(REPO / "examples" / "tiny_cpu.yaml")
SHAPES = {
    "tiny": [],  # the demo's model: 2 layers, hidden 64, 4/2 heads x 16; 16 x 128 tokens per step
    "hidden256": [
        "model.hidden_size=256",
        "model.num_attention_heads=8",
        "model.num_query_groups=4",
        "model.head_dim=32",
        "model.ffn_hidden_size=768",
    ],
}


def run_overrides(shape: str, steps: int, interval: int, out: str, data_dir: str) -> list[str]:
    """The config both processes of a round train (examples/tiny_cpu.yaml + these)."""
    return [
        *SHAPES[shape],
        f"train.train_steps={steps}",
        "train.eval_interval=0",
        "train.eval_iters=1",
        "checkpoint.interval=0",
        f"logging.interval={interval}",
        "logging.tensorboard=false",
        f"data.demo_dir={data_dir}",
        f"output.dir={out}",
    ]


# --- the plain loop --------------------------------------------------------------------------------------------
class PlainLoop:
    """The minimal megatron loop: megagate's model and data set-up, then torch's loop (inside a megatron world)."""

    def __init__(self, cfg) -> None:
        import torch

        from megagate.model_factory import build_model
        from megagate.run_setup import resolve
        from megagate.train import components

        t, setup = cfg.train, resolve(cfg, 1)
        self.cfg, self.n = cfg, setup.layout.num_microbatches
        self.model = build_model(setup)[0]  # the trainer's model, built and initialised by the trainer's factory
        train_data, _, _ = components.build_data(cfg, setup.layout)
        self.data = components.loader(cfg, train_data, 0)
        params = list(self.model.named_parameters())
        decay = [p for name, p in params if p.ndim > 1 and not name.endswith(".bias")]
        no_decay = [p for name, p in params if not (p.ndim > 1 and not name.endswith(".bias"))]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay}, {"params": no_decay, "wd_mult": 0.0}],
            lr=t.lr,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps,
            weight_decay=t.weight_decay,
        )
        self.scheduler = components.lr_scheduler(cfg, self.optimizer)  # the trainer's own schedule
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"

    def step(self):
        """One step; the loss as a device tensor (read only when logged)."""
        import torch

        t = self.cfg.train
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for _ in range(self.n):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in next(self.data).items()}
            per_token = self.model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [b, s]
            mask = batch["loss_mask"].float()
            loss = (per_token.float() * mask).sum() / mask.sum().clamp(min=1) / self.n
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.clip_grad)
        self.optimizer.step()
        self.scheduler.step(increment=t.global_batch_size)
        return total


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}  # cpu: the main thread's CPU time


def plain_loop(overrides: list[str], result: str, clock: str) -> None:
    """Time the plain loop; writes {"windows": [mean step seconds of each window], "losses": [...]}."""
    from megagate import config_reader
    from megagate.distributed import megatron_cpu, parallel

    cfg = config_reader.load(CONFIG, overrides)
    megatron_cpu.install()
    now = CLOCKS[clock]
    with parallel.single_process(cfg.parallel, cfg.seed):
        loop = PlainLoop(cfg)
        interval = cfg.logging.interval
        windows, losses = [], []
        start = now()
        for step in range(1, cfg.train.train_steps + 1):
            total = loop.step()
            if step % interval == 0:
                losses.append(total.item())  # the host read of a logging step
                end = now()
                windows.append((end - start) / interval)
                start = end
    Path(result).write_text(json.dumps({"windows": windows, "losses": losses}))


def megagate_cpu_loop(overrides: list[str], result: str) -> None:
    """The trainer as `megagate train` runs it (train(resolve(cfg, 1)): every default callback) with one more
    callback that reads the main thread's CPU time at the end of every logging step."""
    from megagate import config_reader
    from megagate.distributed import parallel
    from megagate.run_setup import resolve
    from megagate.train.callbacks import Callback
    from megagate.train.trainer import train

    cfg = config_reader.load(CONFIG, overrides)
    windows: list[float] = []
    marks: list[float] = []

    class CpuWindows(Callback):  # priority 0: after MetricsLogger's read of the logging step
        def on_start(self, trainer) -> None:
            marks.append(time.thread_time())

        def post_step(self, trainer, output) -> None:
            if output.step % cfg.logging.interval == 0:
                marks.append(time.thread_time())
                windows.append((marks[-1] - marks[-2]) / cfg.logging.interval)

    with tempfile.TemporaryDirectory() as tmp:
        parallel.init_distributed(0, 1, os.path.join(tmp, "rendezvous"), backend="gloo")
        try:
            train(resolve(cfg, 1), extra_callbacks=[CpuWindows()])
        finally:
            parallel.destroy()
    Path(result).write_text(json.dumps({"windows": windows}))


# --- the rounds ------------------------------------------------------------------------------------------------
def child_env(threads: int) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    return env


def run_megagate(overrides: list[str], out: str, env: dict[str, str], clock: str) -> list[float]:
    """`megagate train`; the step_time of its logged steps (the mean over each logging interval). With the cpu
    clock, the trainer in a worker that reads its main thread's CPU time."""
    if clock == "cpu":
        result = os.path.join(out + ".json")
        return _worker(["--worker-megagate", result, "--", *overrides], result, env)
    cmd = [sys.executable, "-m", "megagate", "train", "--config", CONFIG, *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time"] for r in records if r["split"] == "train"]


def run_plain(overrides: list[str], tmp: str, env: dict[str, str], clock: str) -> list[float]:
    result = os.path.join(tmp, "plain.json")
    return _worker(["--worker", result, "--clock", clock, "--", *overrides], result, env)


def _worker(args: list[str], result: str, env: dict[str, str]) -> list[float]:
    proc = subprocess.run([sys.executable, __file__, *args], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{args[0]} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads(Path(result).read_text())["windows"]


def bench_shape(shape: str, args: argparse.Namespace, tmp: str) -> dict[str, list[float]]:
    steps = args.interval * (args.warmup + args.windows)
    env = child_env(args.threads)
    medians: dict[str, list[float]] = {"megagate": [], "plain": []}
    for r in range(args.rounds):
        order = ["megagate", "plain"] if r % 2 == 0 else ["plain", "megagate"]
        for kind in order:
            out = os.path.join(tmp, f"{shape}-{kind}-{r}")
            over = run_overrides(shape, steps, args.interval, out, args.data_dir)
            if kind == "megagate":
                windows = run_megagate(over, out, env, args.clock)
            else:
                windows = run_plain(over, tmp, env, args.clock)
            if len(windows) != args.warmup + args.windows:
                raise SystemExit(f"{kind}: {len(windows)} timed windows, expected {args.warmup + args.windows}")
            medians[kind].append(statistics.median(windows[args.warmup :]))
        ratio = medians["megagate"][-1] / medians["plain"][-1]
        print(
            f"  round {r + 1}: megagate {medians['megagate'][-1] * 1e3:7.2f} ms/step, "
            f"plain {medians['plain'][-1] * 1e3:7.2f} ms/step, ratio {ratio:.3f}",
            flush=True,
        )
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=4, help="paired rounds per shape (2 processes each)")
    parser.add_argument("--interval", type=int, default=10, help="steps per timed window (the logging interval)")
    parser.add_argument("--windows", type=int, default=4, help="timed windows per process")
    parser.add_argument("--warmup", type=int, default=1, help="windows per process not counted")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of both processes")
    parser.add_argument("--data-dir", default=str(REPO / "runs" / "demo-data"), help="demo corpus cache")
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="wall: elapsed time of `megagate train` itself; cpu: the main thread's CPU time (less moved by other "
        "processes on a shared machine; work on other threads, megagate's data prefetch, is not counted)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run the plain loop, write this file
    parser.add_argument("--worker-megagate", help=argparse.SUPPRESS)  # internal: the trainer on the cpu clock
    args, rest = parser.parse_known_args()
    if args.worker or args.worker_megagate:
        overrides = [a for a in rest if a != "--"]
        if args.worker:
            plain_loop(overrides, args.worker, args.clock)
        else:
            megagate_cpu_loop(overrides, args.worker_megagate)
        return 0
    if args.rounds < 1 or args.windows < 1 or args.interval < 1 or args.warmup < 0:
        parser.error("--rounds, --windows and --interval must be >= 1, --warmup >= 0")
    from megagate.data.demo import prepare_demo_data

    prepare_demo_data(args.data_dir, 2048, 1_500_000)  # examples/tiny_cpu.yaml's corpus, built before timing
    load = os.getloadavg()
    print(
        f"{args.rounds} paired rounds per shape; {args.windows} windows of {args.interval} steps per process after "
        f"{args.warmup} warm-up window(s); {args.clock} clock; OMP_NUM_THREADS={args.threads}; {os.cpu_count()} CPUs, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            print(f"== {shape}", flush=True)
            medians = bench_shape(shape, args, tmp)
            ratios = [a / b for a, b in zip(medians["megagate"], medians["plain"])]
            rows.append((shape, medians, ratios))
    load = os.getloadavg()
    print(f"\nload average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    header = f"{'shape':10s} {'megagate ms/step':>17s} {'plain ms/step':>14s} {'paired ratio (min..max)':>24s}"
    print(header + "\n" + "-" * len(header))
    for shape, medians, ratios in rows:
        print(
            f"{shape:10s} {statistics.median(medians['megagate']) * 1e3:>17.2f} "
            f"{statistics.median(medians['plain']) * 1e3:>14.2f} "
            f"{statistics.median(ratios):>12.3f} ({min(ratios):.3f}..{max(ratios):.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
