"""The cluster faults of `monitor.faults` (hang, slow_rank, fail_save, fail_load) carried out in this process.

`arm(faults, run_dir, rank, host)` makes them active for this rank (the FaultInjection callback does, before the
run resumes: a load fault must be armed by then); `disarm()` at the end. They act at two kinds of points:

- phase entries (megagate.health.progress listeners): a `hang` blocks the main thread for good when this rank
  enters the fault's phase at its step (time.sleep: to the watchdog the rank is busy, not waiting in a collective);
  a `slow_rank` sleeps at the start of each forward-backward for (factor - 1) x its recent median compute time,
  so this rank computes `factor` times as long and the others wait for it in the gradient reduction (a launch's
  first step has no recent compute time and runs at full speed);
- the checkpoint's file I/O (`checkpoint_io("write" | "read", step)`, called by megagate.train's checkpointer in
  the writer, a background process for an asynchronous save, and before a read): `fail_save` / `fail_load` raise
  OSError(EIO), what a failing disk or mount gives; a hang with phase `write` blocks the writer.

A rank fault fires once per run: when it fires it is recorded in the run's health.jsonl (kind `fault`), and a later
launch of the run skips it (a requeued job resumes past a transient fault). A host fault fires in every launch.
"""

from __future__ import annotations

import errno
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from megagate.health import channel, progress
from megagate.monitor.faults import CLUSTER_KINDS, Fault

_active: ProcessFaults | None = None


class ProcessFaults:
    def __init__(self, faults: Sequence[Fault], run_dir: str | os.PathLike, rank: int, host: str) -> None:
        self.run_dir, self.rank, self.host = Path(run_dir), rank, host
        fired = [e.get("fault") for e in channel.read_events(run_dir, "fault") if e.get("rank") == rank]
        self.faults = [
            f
            for f in faults
            if f.kind in CLUSTER_KINDS
            and (f.rank == rank or (f.rank is None and f.host == host))
            and not (f.rank is not None and f.to_dict() in fired)
        ]
        self._fired: set[int] = set()
        self._fb_started = 0.0
        self._compute: deque[float] = deque(maxlen=5)  # this rank's recent compute times (a slow rank's base)

    def _take(self, kind: str, step: int, phase: str | None = None, any_step: bool = False) -> Fault | None:
        for i, f in enumerate(self.faults):
            if f.kind != kind or i in self._fired or (phase is not None and f.phase != phase):
                continue
            if f.kind == "slow_rank":
                if step >= f.step:
                    return f  # every step from `step` on, never "fired"
                continue
            if f.step == step or (any_step and f.step == 0):
                self._fired.add(i)
                channel.append_event(
                    self.run_dir,
                    {
                        "kind": "fault",
                        "fault": f.to_dict(),
                        "rank": self.rank,
                        "host": self.host,
                        "step": step,
                        "time": time.time(),
                    },
                )
                return f
        return None

    # --- phase entries (the trainer's main thread) ---------------------------------------------------------------
    def on_phase(self, phase: str, step: int) -> None:
        if phase == "forward_backward":
            slow = self._take("slow_rank", step)
            if slow is not None and self._compute:  # inside the compute phase, before the gradient reduction
                # the median of its recent steps: a base that follows the machine's load as the real compute does
                # (the fastest step alone would shrink the slowdown on a loaded machine, and one descheduled step
                # cannot move the median)
                time.sleep((slow.factor - 1) * statistics.median(self._compute))
            self._fb_started = time.monotonic()
        elif phase == "grad_sync" and self._fb_started:
            self._compute.append(time.monotonic() - self._fb_started)  # this step's compute, without the sleep
        if self._take("hang", step, phase) is not None:
            self._hang(phase, step)

    def _hang(self, phase: str, step: int) -> None:
        if phase != "write":  # the writer may be a forked process: no stream locks from another thread there
            print(
                f"megagate fault injection: rank {self.rank} ({self.host}) hangs in {phase} of step {step}",
                file=sys.stderr,
                flush=True,
            )
        while True:  # until the watchdog (or the launcher) ends the process
            time.sleep(3600)

    # --- checkpoint file I/O -------------------------------------------------------------------------------------
    def checkpoint_io(self, kind: str, step: int, path: str) -> None:
        if kind == "write":
            if self._take("hang", step, "write") is not None:
                self._hang("write", step)
            failing = self._take("fail_save", step)
        else:
            failing = self._take("fail_load", step, any_step=True)
        if failing is not None:
            raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (injected {failing.kind} on rank {self.rank})", path)


def arm(faults: Sequence[Fault], run_dir: str | os.PathLike, rank: int, host: str) -> ProcessFaults | None:
    """Activate this rank's cluster faults (None when it has none)."""
    global _active
    disarm()
    armed = ProcessFaults(faults, run_dir, rank, host)
    if not armed.faults:
        return None
    _active = armed
    progress.PROGRESS.add_listener(armed.on_phase)
    return armed


def disarm() -> None:
    global _active
    if _active is not None:
        progress.PROGRESS.remove_listener(_active.on_phase)
        _active = None


def checkpoint_io(kind: str, step: int, path: str | os.PathLike) -> None:
    """The checkpointer's injection point before it writes (`write`) or reads (`read`) a checkpoint's files: a
    no-op unless a fail_save / fail_load / write hang is armed for this rank and step."""
    if _active is not None:
        _active.checkpoint_io(kind, step, str(path))
