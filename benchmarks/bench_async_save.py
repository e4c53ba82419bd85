"""How long a checkpoint save blocks the step loop: synchronous vs asynchronous (checkpoint.async_save), in one run.

    .venv/bin/python benchmarks/bench_async_save.py [--rounds 4] [--steps-after 6] [--hidden 768 --layers 6]

One process (a gloo world of one), the trainer's own components (megatron GPTModel, DDP, DistributedOptimizer, the
demo data) at a size whose checkpoint takes seconds to write here (hidden 768 x 6 layers: ~55M parameters, ~0.8 GB
with Adam's state), the trainer's own `save_checkpoint`. Rounds alternate sync and async saves (the first save of
each kind is untimed: megatron's writer process imports torch at its first save). Per save:
  * stall: the time the step loop is blocked by the save — for a synchronous save the call; for an asynchronous one
    the call (planning, copying nothing on CPU, forking the writer) plus every `poll()` of the steps after it
    (the finalisation: megatron's metadata, the manifest, the rename) and a final `wait()` if the writer is still
    busy when the round ends;
  * the median step time of the `--steps-after` steps after the save against the steps before it (on CPU the
    forked writer shares the memory copy-on-write: the first update after the fork copies the pages it writes).
Printed: each save, the medians, and the ratio sync stall / async stall. No assertions: figures only.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_train import build, quiet_stdout, timed_step  # noqa: E402


def one_round(trainer, data, background: bool, steps_after: int) -> dict:
    before = [timed_step(trainer, data) for _ in range(3)]
    start = time.perf_counter()
    trainer.save_checkpoint(background=background)
    stall = time.perf_counter() - start
    after = []
    for _ in range(steps_after):
        after.append(timed_step(trainer, data))
        t = time.perf_counter()
        trainer.checkpointer.poll()
        stall += time.perf_counter() - t
    t = time.perf_counter()
    pending = trainer.checkpointer.pending
    trainer.checkpointer.wait()
    stall += time.perf_counter() - t
    return {"stall": stall, "before": statistics.median(before), "after": statistics.median(after), "late": pending}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="timed saves of each kind")
    parser.add_argument("--steps-after", type=int, default=6, help="steps between a save and the next")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--data-dir", default="runs/demo-data", help="cache of the demo corpus and tokenizer")
    args = parser.parse_args()

    import torch

    from megagate import console
    from megagate.checkpoint import complete_checkpoints
    from megagate.distributed import children, parallel
    from megagate.model.counts import parameter_counts

    console.install()  # the CLI's console: megatron's known notices filtered
    model = [
        f"model.hidden_size={args.hidden}",
        f"model.num_layers={args.layers}",
        f"model.num_attention_heads={args.hidden // 64}",
        f"model.num_query_groups={max(1, args.hidden // 256)}",
        "model.head_dim=64",
        f"model.ffn_hidden_size={args.hidden * 3}",
        "checkpoint.async_check_interval=1",
        "checkpoint.keep_last=2",
    ]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} rounds of each kind")
    with tempfile.TemporaryDirectory() as out, contextlib.ExitStack() as stack:
        with quiet_stdout():
            stack.enter_context(parallel.single_process())
        children.install_checkpoint_writer_queue()
        children.install_fork_hook()
        stack.callback(children.shutdown)
        trainer, data = build("g1-elementwise", model, out, args.data_dir)
        cfg = trainer.cfg
        print(
            f"model: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, "
            f"{parameter_counts(cfg.model)['total']:,} parameters"
        )
        for _ in range(2):
            timed_step(trainer, data)
        for background in (False, True):  # untimed: the writer process's first save imports torch
            one_round(trainer, data, background, 2)
        size = sum(
            f.stat().st_size for _, p in complete_checkpoints(trainer.checkpointer.root)[-1:] for f in p.iterdir()
        )
        print(f"checkpoint size: {size / 2**30:.2f} GiB\n")
        rows: dict[str, list[dict]] = {"sync": [], "async": []}
        print(f"{'round':>5s} {'kind':>5s} {'stall s':>8s} {'step before ms':>15s} {'step after ms':>14s}")
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for background in order:
                kind = "async" if background else "sync"
                row = one_round(trainer, data, background, args.steps_after)
                rows[kind].append(row)
                late = " (writer still busy at the next save: waited)" if row["late"] else ""
                print(
                    f"{r:>5d} {kind:>5s} {row['stall']:>8.2f} {row['before'] * 1e3:>15.0f} "
                    f"{row['after'] * 1e3:>14.0f}{late}"
                )
        med = {k: statistics.median(x["stall"] for x in v) for k, v in rows.items()}
        after = {k: statistics.median(x["after"] / x["before"] for x in v) for k, v in rows.items()}
        print(
            f"\nmedian stall per save: sync {med['sync']:.2f} s, async {med['async']:.2f} s -> "
            f"ratio sync/async {med['sync'] / med['async']:.1f}x"
        )
        print(
            f"steps after a save / steps before (median): sync {after['sync']:.2f}, async {after['async']:.2f} "
            "(async: the copy-on-write pages of the forked writer)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
