"""Training step time of baseline vs gated attention, with the trainer's own components, in one process.

    .venv/bin/python benchmarks/bench_train.py [--rounds 10] [--steps-per-round 5] [--warmup 3] [--models tiny larger]

Every variant is built with `megagate.train.components.build_components` from examples/tiny_cpu.yaml (megatron
GPTModel, DDP, DistributedOptimizer, demo data) and stepped with `Trainer.train_step` (no callbacks: the model's
step, not the monitor's policy), exactly as `megagate train` steps it. Timing:
  * warm-up steps per variant are run first and not timed (allocator, autograd graph caches, first-touch pages);
  * then rounds: each round steps every variant `--steps-per-round` times, in an order rotated every round, so that a
    machine that gets busier or quieter affects all variants alike;
  * data loading is outside the timed region (batches are fetched before each step);
  * reported: median step time, its interquartile range, tokens/s at the median, the ratio of medians
    gated/baseline, and the paired ratio: the median (and min..max) over rounds of the ratio of that round's
    median step times (robust to drift, since the variants of a round ran within seconds of each other).
No assertions: this prints figures; docs/demo.md keeps the ones measured.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFIG = str(REPO / "examples" / "tiny_cpu.yaml")
MODELS = {
    "tiny": [],  # the demo's model: 2 layers, hidden 64, 4/2 heads x 16
    "larger": [
        "model.hidden_size=256",
        "model.num_attention_heads=8",
        "model.num_query_groups=4",
        "model.head_dim=32",
        "model.ffn_hidden_size=768",
    ],
}


def quantiles(values: list[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile)."""
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[1], q[2]


@contextlib.contextmanager
def quiet_stdout():
    """Silence file descriptor 1: gloo prints a line per process group from C++, ~30 per model built."""
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def build(variant: str, model_overrides: list[str], out: str, data_dir: str):
    """(Trainer without callbacks, its training data) for one variant (parallel state re-initialised: megatron keeps
    one global set)."""
    from megatron.core import parallel_state

    from megagate import config_reader
    from megagate.run_setup import resolve
    from megagate.train import components
    from megagate.train.trainer import Trainer

    overrides = [
        f"model.gate.preset={variant}",
        f"output.dir={out}/{variant}",
        f"data.demo_dir={data_dir}",
        "train.train_steps=100000",
        *model_overrides,
    ]
    cfg = config_reader.load(CONFIG, overrides)
    parallel_state.destroy_model_parallel()
    with quiet_stdout():
        parts = components.build_components(resolve(cfg, 1))
    return Trainer(parts, callbacks=[]), components.loader(cfg, parts.train_data, 0)


def timed_step(trainer, data) -> float:
    microbatches = [next(data) for _ in range(trainer.layout.num_microbatches)]
    start = time.perf_counter()
    trainer.train_step(microbatches)
    return time.perf_counter() - start


def bench_model(name: str, variants: list[str], args: argparse.Namespace, out: str) -> None:
    from megagate.model.counts import parameter_counts

    runs = {v: build(v, MODELS[name], out, args.data_dir) for v in variants}
    first = runs[variants[0]][0].cfg
    tokens_per_step = first.train.global_batch_size * first.train.seq_length
    m = first.model
    print(
        f"\n== {name}: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads}/"
        f"{m.num_query_groups} x {m.head_dim}; {tokens_per_step} tokens/step "
        f"({first.train.global_batch_size} x {first.train.seq_length}, "
        f"micro-batch {first.train.micro_batch_size})"
    )

    def step(v: str) -> float:
        return timed_step(*runs[v])

    for v in variants:
        for _ in range(args.warmup):
            step(v)
    times: dict[str, list[list[float]]] = {v: [] for v in variants}  # per variant, per round
    for r in range(args.rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for v in order:
            times[v].append([step(v) for _ in range(args.steps_per_round)])

    base = variants[0]
    base_median = statistics.median(t for rnd in times[base] for t in rnd)
    header = (
        f"{'variant':16s} {'params':>10s} {'FFN':>5s} {'ms/step':>8s} {'IQR ms':>13s} {'tokens/s':>9s} "
        f"{'ratio':>6s} {'paired ratio (min..max)':>23s}"
    )
    print(header + "\n" + "-" * len(header))
    for v in variants:
        cfg = runs[v][0].cfg
        flat = [t for rnd in times[v] for t in rnd]
        q1, med, q3 = quantiles(flat)
        per_round = [statistics.median(a) / statistics.median(b) for a, b in zip(times[v], times[base])]
        paired = (
            "-" if v == base else (f"{statistics.median(per_round):.3f} ({min(per_round):.2f}..{max(per_round):.2f})")
        )
        print(
            f"{v:16s} {parameter_counts(cfg.model)['total']:>10,} {cfg.model.effective_ffn_hidden_size:>5d} "
            f"{med * 1e3:>8.1f} {q1 * 1e3:>6.1f}-{q3 * 1e3:<6.1f} {tokens_per_step / med:>9,.0f} "
            f"{med / base_median:>6.3f} {paired:>23s}"
        )
    print(
        f"({args.rounds} rounds x {args.steps_per_round} timed steps per variant after {args.warmup} warm-up steps; "
        f"ratio = median step time / {base}'s; "
        f"paired: per round)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["baseline", "g1-elementwise", "g1-headwise"],
        help="gate presets; the first is the reference of the ratios",
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps-per-round", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--data-dir", default="runs/demo-data", help="cache of the demo corpus and tokenizer")
    args = parser.parse_args()
    if args.rounds * args.steps_per_round < 2:
        parser.error("need at least 2 timed steps per variant (--rounds x --steps-per-round) for quartiles")

    import torch

    from megagate import console
    from megagate.distributed import parallel

    console.install()  # the CLI's console: megatron's known notices (once per model built) filtered
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as out, contextlib.ExitStack() as stack:
        with quiet_stdout():
            stack.enter_context(parallel.single_process())
        for name in args.models:
            bench_model(name, args.variants, args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
