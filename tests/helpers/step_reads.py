"""Trainer runs that count, per step, the host reads the trainer makes (megagate.train.step_values.HostReads) and,
on a GPU, the synchronising CUDA calls (torch.cuda.set_sync_debug_mode); optionally a stop signal sent by one rank
after a given step. Workers for helpers.distributed.run (one spawned process per rank, gloo)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny_cpu.yaml"
# 10 steps of seq 64 x 8 sequences as 2 micro-batches, a line every 4 steps, no evaluation but the final one
BASE = [
    "train.train_steps=10",
    "train.seq_length=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.warmup_steps=2",
    "train.eval_interval=0",
    "train.eval_iters=1",
    "logging.interval=4",
    "logging.tensorboard=false",
    "checkpoint.interval=0",
]


def _callbacks(signal_at: tuple[int, int] | None) -> tuple[list, dict]:
    from megagate.train.callbacks import Callback, SpikeMonitoring
    from megagate.train.step_values import cuda_syncs

    seen: dict[str, Any] = {"reads": [], "syncs": [], "signal": None, "stop": None, "monitor": None}

    class CountReads(Callback):
        """Last in the list: the reads of a whole step, every hook of every callback included; the time the stop
        was decided (StopChecks runs before it in on_step_start); the spike monitor's state at the end."""

        def __init__(self) -> None:
            self.before = 0
            self._syncs: Any = None
            self._found: list[str] = []

        def on_start(self, trainer: Any) -> None:
            self.before = trainer.reads.count

        def on_step_start(self, trainer: Any, step: int) -> None:
            if trainer.stop_reason is not None and seen["stop"] is None:
                seen["stop"] = (step - 1, time.monotonic())
                return
            self._syncs = cuda_syncs()
            self._found = self._syncs.__enter__()

        def post_step(self, trainer: Any, output: Any) -> None:
            self._syncs.__exit__(None, None, None)
            self._syncs = None
            seen["syncs"].append((output.step, len(self._found)))
            seen["reads"].append((output.step, trainer.reads.count - self.before))
            self.before = trainer.reads.count

        def on_end(self, trainer: Any) -> None:
            if self._syncs is not None:
                self._syncs.__exit__(None, None, None)
            monitor = trainer.callback(SpikeMonitoring)
            seen["monitor"] = None if monitor is None else monitor.monitor.state_dict()

    class SignalAt(Callback):
        """Rank `rank` sends itself SIGUSR1 at the end of step `step` (what Slurm's warning does to one task)."""

        def post_step(self, trainer: Any, output: Any) -> None:
            import torch

            step, rank = signal_at
            if output.step == step and torch.distributed.get_rank() == rank:
                seen["signal"] = (step, time.monotonic())
                os.kill(os.getpid(), signal.SIGUSR1)

    return ([SignalAt()] if signal_at else []) + [CountReads()], seen


def worker(rank: int, world: int, runs: dict[str, list[str]], out: str, demo_dir: str) -> dict:
    """Train each run (overrides of BASE; a `signal_at=STEP,RANK` item sends that rank SIGUSR1 after that step) in
    this process; per run: [(step, reads)], [(step, CUDA syncs)], the summary, the spike monitor's final state,
    the step after which the run stopped and the seconds from the signal to that decision."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    from megagate import config_reader
    from megagate.run_setup import resolve
    from megagate.train.trainer import train

    results = {}
    for name, items in runs.items():
        signals = [x for x in items if x.startswith("signal_at=")]
        overrides = [x for x in items if x not in signals]
        signal_at = tuple(int(v) for v in signals[0].split("=")[1].split(",")) if signals else None
        cfg = config_reader.load(
            str(CONFIG), [*BASE, *overrides, f"data.demo_dir={demo_dir}", f"output.dir={out}/{name}"]
        )
        extra, seen = _callbacks(signal_at)
        summary = train(resolve(cfg, world), extra_callbacks=extra)
        parallel_state.destroy_model_parallel()
        stop = seen["stop"]
        results[name] = {
            "reads": seen["reads"],
            "syncs": seen["syncs"],
            "summary": summary,
            "monitor": seen["monitor"],
            "stopped_after": None if stop is None else stop[0],
            "latency": None if stop is None or seen["signal"] is None else stop[1] - seen["signal"][1],
        }
    return results
