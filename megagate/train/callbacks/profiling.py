"""Performance callbacks: manual garbage collection and the torch profiler (the `perf` config section).

ManualGC   Python's collector off; `gc.collect()` on every rank at the same steps (perf.manual_gc_interval), so no
           rank stalls alone in a collection while the others wait for it in a collective
Profiling  a torch.profiler trace of global steps [start, end] on the chosen ranks (perf.profile), written to
           <profile dir>/rank<R>.steps<A>-<B>.pt.trace.json (Chrome trace; TensorBoard's profiler plugin reads the
           .pt.trace.json name), atomically; each step is a `megagate.step#N` range; NVTX ranges on GPU
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import torch

from megagate.distributed.utils import get_rank
from megagate.files import atomic_path
from megagate.run_config import ProfileSection
from megagate.run_setup import RunSetup
from megagate.train.callbacks.base import Callback, StepOutput, TrainerView

STEP_RANGE = "megagate.step#{}"  # the record_function name of one profiled step


class ManualGC(Callback):
    """Disable Python's collector for the run; collect every `interval` steps (Megatron-LM's --manual-gc)."""

    priority = 50

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._was_enabled = True

    def on_start(self, trainer: TrainerView) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()  # start clean: what set-up left behind

    def post_step(self, trainer: TrainerView, output: StepOutput) -> None:
        if output.step % self.interval == 0:
            gc.collect()

    def on_close(self, trainer: TrainerView) -> None:
        if self._was_enabled:
            gc.enable()


def trace_path(directory: str | os.PathLike, rank: int, steps: list[int]) -> Path:
    """Where rank `rank`'s trace of `steps` goes."""
    return Path(directory) / f"rank{rank}.steps{steps[0]}-{steps[1]}.pt.trace.json"


class Profiling(Callback):
    """torch.profiler over steps [start, end] on the ranks in `profile.ranks` (NVTX ranges as well if `nvtx`). Its
    step ranges wrap only the step: it comes before evaluation and checkpointing, which are not profiled."""

    priority = 40

    def __init__(self, profile: ProfileSection, directory: str, *, nvtx: bool) -> None:
        assert profile.steps is not None
        self.start, self.end = profile.steps
        self.ranks = set(profile.ranks)
        self.directory = directory
        self.nvtx = nvtx and torch.cuda.is_available()
        self._profiler: Any = None
        self._emit_nvtx: Any = None
        self._step_range: Any = None
        self._last_step = 0

    def on_step_start(self, trainer: TrainerView, step: int) -> None:
        self._close_step()  # a step a restore() dropped never reached post_step
        if step == self.start and self._profiler is None and get_rank() in self.ranks:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.__enter__()
            if self.nvtx:
                self._emit_nvtx = torch.autograd.profiler.emit_nvtx()
                self._emit_nvtx.__enter__()
        if self._profiler is not None and self.start <= step <= self.end:
            self._step_range = torch.profiler.record_function(STEP_RANGE.format(step))
            self._step_range.__enter__()
            if self.nvtx:
                torch.cuda.nvtx.range_push(STEP_RANGE.format(step))
            self._last_step = step

    def post_step(self, trainer: TrainerView, output: StepOutput) -> None:
        self._close_step()
        if self._profiler is not None and output.step >= self.end:
            self._finish()

    def on_close(self, trainer: TrainerView) -> None:
        # the run stopped inside the window: keep what was recorded
        self._close_step()
        if self._profiler is not None:
            self._finish()

    def _close_step(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
            if self.nvtx:
                torch.cuda.nvtx.range_pop()

    def _finish(self) -> None:
        if self.nvtx and self._emit_nvtx is not None:
            self._emit_nvtx.__exit__(None, None, None)
            self._emit_nvtx = None
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        path = trace_path(self.directory, get_rank(), [self.start, min(self.end, self._last_step)])
        with atomic_path(path) as tmp:  # export_chrome_trace writes a file by name
            profiler.export_chrome_trace(str(tmp))


def perf_callbacks(setup: RunSetup) -> list[Callback]:
    """The callbacks the perf section asks for on the run's machine (its resolved settings)."""
    cfg, perf = setup.cfg, setup.perf
    callbacks: list[Callback] = []
    if perf.manual_gc_interval:
        callbacks.append(ManualGC(perf.manual_gc_interval))
    profile = cfg.perf.profile
    if profile.steps is not None:
        directory = profile.dir or os.path.join(cfg.output.dir, "profile")
        callbacks.append(Profiling(profile, directory, nvtx=perf.profile_nvtx))
    return callbacks
