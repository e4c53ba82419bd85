"""What one training step does, counted (independent of the machine's load): `megagate train`'s loop against the
minimal megatron loop of bench_loop_overhead.py, on the same config.

    .venv/bin/python benchmarks/count_step_work.py [--shapes tiny hidden256] [--steps 10] [--warmup 3]

One process. The trainer runs as `megagate train` runs it (`megagate.train.trainer.train`: every default callback,
logging every `--interval` steps) with one more callback that counts from the start of step warmup+1 to the end of
step warmup+steps on the main thread: the aten operations dispatched (all, `copy_`, vector norms, collectives,
`_local_scalar_dense` = element reads on the host), then over as many more steps the Python function calls
(cProfile); the trainer's own host reads (`trainer.reads`, where it has them). The plain loop is counted over the
same steps. Per step, averaged.
Work moved off the main thread (the data prefetch thread) is not counted: it is off the step's critical path.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import os
import sys
import tempfile
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from bench_loop_overhead import CONFIG, SHAPES, PlainLoop, run_overrides  # noqa: E402
from bench_train import quiet_stdout  # noqa: E402

COLLECTIVES = ("allreduce_", "reduce_scatter_tensor_coalesced_", "allgather_into_tensor_coalesced_", "_allgather_base_")


class Count:
    """Counts aten operations and Python calls between start() and stop() (main thread)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        ops: collections.Counter = collections.Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops[func.overloadpacket.__name__] += 1
                return func(*args, **(kwargs or {}))

        self.ops, self.mode, self.profile = ops, Mode(), cProfile.Profile()
        self.calls = 0

    def start(self, what: str) -> None:
        """Count "ops" or "calls" (not both at once: the dispatch mode's own Python calls would be counted)."""
        self.what = what
        if what == "ops":
            self.mode.__enter__()
        else:
            self.profile.enable()

    def stop(self) -> None:
        if self.what == "ops":
            self.mode.__exit__(None, None, None)
        else:
            import pstats

            self.profile.disable()
            self.calls = pstats.Stats(self.profile).total_calls

    def per_step(self, steps: int, reads: int | None) -> dict[str, float | None]:
        return {
            "aten ops": sum(self.ops.values()) / steps,
            "copy_": self.ops["copy_"] / steps,
            "vector norms": (self.ops["linalg_vector_norm"] + self.ops["_foreach_norm"]) / steps,
            "collectives": sum(self.ops[c] for c in COLLECTIVES) / steps,
            "host element reads": self.ops["_local_scalar_dense"] / steps,
            "trainer host reads": None if reads is None else reads / steps,
            "Python calls": self.calls / steps,
        }


def windows(first: int, steps: int) -> dict[int, tuple[str, int]]:
    """step -> (what to count from its start, its last step): operations first, then Python calls."""
    return {first: ("ops", first + steps - 1), first + steps: ("calls", first + 2 * steps - 1)}


def count_megagate(cfg, first: int, steps: int) -> dict[str, float | None]:
    from megagate.run_setup import resolve
    from megagate.train.callbacks import Callback
    from megagate.train.trainer import train

    count, plan = Count(), windows(first, steps)
    reads: list[int] = []  # the trainer's read count at the two ends (a trainer without `reads`: none)
    ends = {last: what for what, last in plan.values()}

    class Counting(Callback):
        def on_step_start(self, trainer, step: int) -> None:
            if step in plan:
                if step == first and hasattr(trainer, "reads"):
                    reads.append(trainer.reads.count)
                count.start(plan[step][0])

        def post_step(self, trainer, output) -> None:
            if output.step in ends:
                count.stop()
                if ends[output.step] == "ops" and hasattr(trainer, "reads"):
                    reads.append(trainer.reads.count)

    with quiet_stdout():
        train(resolve(cfg, 1), extra_callbacks=[Counting()])
    return count.per_step(steps, reads[1] - reads[0] if len(reads) == 2 else None)


def count_plain(cfg, first: int, steps: int) -> dict[str, float | None]:
    loop, count, plan = PlainLoop(cfg), Count(), windows(first, steps)
    ends = {last for _, last in plan.values()}
    for step in range(1, first + 2 * steps):
        if step in plan:
            count.start(plan[step][0])
        total = loop.step()
        if step % cfg.logging.interval == 0:
            total.item()  # the logging step's read, as in the timed loop
        if step in ends:
            count.stop()
    return count.per_step(steps, None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=10, help="steps counted")
    parser.add_argument("--warmup", type=int, default=3, help="steps before counting")
    parser.add_argument("--interval", type=int, default=10, help="logging interval of both loops")
    parser.add_argument("--data-dir", default=str(REPO / "runs" / "demo-data"), help="demo corpus cache")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    from megagate import config_reader
    from megagate.distributed import parallel

    first, last = args.warmup + 1, args.warmup + 2 * args.steps  # operations, then Python calls
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            over = run_overrides(shape, last, args.interval, os.path.join(tmp, shape), args.data_dir)
            cfg = config_reader.load(CONFIG, over)
            with quiet_stdout():
                parallel.init_distributed(0, 1, os.path.join(tmp, f"rdv-{shape}"), backend="gloo")
            try:
                ours = count_megagate(cfg, first, args.steps)
                parallel_state.destroy_model_parallel()
                with contextlib.ExitStack() as stack:
                    with quiet_stdout():
                        parallel.initialize_model_parallel(cfg.parallel, cfg.seed)
                    stack.callback(parallel_state.destroy_model_parallel)
                    plain = count_plain(cfg, first, args.steps)
            finally:
                parallel.destroy()
            rows[shape] = (ours, plain)
    print(
        f"per step: operations over steps {first}-{first + args.steps - 1}, Python calls over the {args.steps} after; "
        f"logging every {args.interval} steps; main thread only"
    )
    for shape, (ours, plain) in rows.items():
        print(f"\n== {shape}\n{'':22s} {'megagate':>10s} {'plain':>10s}")
        for key in ours:
            a, b = ours[key], plain[key]
            fa = "-" if a is None else f"{a:10.1f}"
            fb = "-" if b is None else f"{b:10.1f}"
            print(f"{key:22s} {fa:>10s} {fb:>10s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
