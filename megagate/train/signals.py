"""Stop conditions: SIGTERM / SIGUSR1 (Slurm's warning, preemption), SIGINT (Ctrl-C) and a wall-time limit.

Handlers only set a flag; the loop asks `should_stop()` once per step, and every rank gets the same answer, so every
rank checkpoints and exits at the same step. In a world of one process the answer is the local flag, at once. With
more ranks the flags are combined by a MAX all-reduce over a CPU (gloo) group of their own, started without waiting
(`async_op`) and read at the next check: no check blocks on a collective or reads a device value, and the stop
comes one step later than the signal would stop a single process (docs/reliability.md: the measured latency).
The wall-time margin counts that step too.

SIGINT is a stop signal like SIGTERM: the first Ctrl-C checkpoints at the next step boundary and exits 0. A second
SIGINT aborts at once (exit 130, nothing saved; the previous checkpoint stays the one a rerun resumes from), even
when the main thread is blocked in a collective and Python cannot run its handler: the C-level handler writes every
signal's number into a wakeup pipe (`signal.set_wakeup_fd`), which a small thread reads (`install_early`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from megagate.distributed.utils import get_world_size

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
ABORT_EXIT_CODE = 128 + signal.SIGINT  # what a shell reports for a process killed by SIGINT
_early: int | None = None  # a stop signal that arrived before the loop's handlers existed
_interrupts = 0  # SIGINTs seen by the wakeup-pipe thread
_watching = False  # the wakeup pipe and its thread exist (once per process)


def _abort_on_second_interrupt(signum: int) -> None:
    global _interrupts
    if signum != signal.SIGINT:
        return
    _interrupts += 1
    if _interrupts == 1:
        print(
            "megagate: interrupt: checkpointing at the next step boundary, then exiting (press Ctrl-C again to "
            "abort at once, without a checkpoint)",
            file=sys.stderr,
            flush=True,
        )
    else:
        print("megagate: second interrupt: aborting now (nothing saved)", file=sys.stderr, flush=True)
        os._exit(ABORT_EXIT_CODE)


def _watch_wakeup_pipe(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return
        for signum in data:
            _abort_on_second_interrupt(signum)


def _reset_in_child() -> None:
    # a forked child (a checkpoint writer, a fork-started DataLoader worker) must not write its signals into the
    # trainer's pipe: the trainer would count the child's SIGINT as its own
    try:
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        pass


def install_early() -> None:
    """Catch stop signals from the first moment of a launch (set-up takes many seconds on big models); the loop's
    StopConditions picks up what arrived and stops at its first check, after a checkpoint. Also starts the thread
    that aborts on a second SIGINT (main thread only: Python installs handlers there)."""

    def record(signum: int, frame: object) -> None:
        global _early
        _early = signum

    global _early, _interrupts, _watching
    _early, _interrupts = None, 0
    for sig in STOP_SIGNALS:
        signal.signal(sig, record)
    if _watching:
        return
    _watching = True
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    os.register_at_fork(after_in_child=_reset_in_child)
    threading.Thread(target=_watch_wakeup_pipe, args=(read_fd,), name="megagate-interrupts", daemon=True).start()


class StopConditions:
    def __init__(self, wall_time_limit: float | None, install_handlers: bool = True) -> None:
        self.deadline = None if wall_time_limit is None else time.monotonic() + wall_time_limit
        self.received: int | None = _early
        self.reason: str | None = None
        self._previous = {}
        self._group = None  # the flags' gloo group (more than one rank), made at the first check
        self._pending = None  # (work, flag) of the all-reduce started at the previous check
        if install_handlers:
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            # a second Ctrl-C that Python handles before the wakeup-pipe thread does (or without that thread)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        self.received = signum

    @property
    def lag(self) -> int:
        """Steps between a check that sees a local flag and the stop it causes (0 for one process, else 1)."""
        return 0 if get_world_size() == 1 else 1

    def local(self, step_time: float = 0.0) -> int:
        """This rank's flag: 2 on a signal, 1 near the wall-time limit (within the steps until a stop), else 0."""
        if self.received is not None:
            return 2
        margin = (2 + self.lag) * step_time
        if self.deadline is not None and time.monotonic() + margin >= self.deadline:
            return 1
        return 0

    def should_stop(self, step_time: float = 0.0) -> bool:
        """True on every rank, at the same check, once any rank had a stop flag (one check late with several
        ranks: the answer is the all-reduce started at the previous check, which is started again now)."""
        import torch  # not at module level: install_early() runs before the seconds-long torch import

        value = self.local(step_time)
        if self.lag:
            first = self._group is None
            if first:
                self._group = torch.distributed.new_group(backend="gloo")
            decided = self._collect()
            if not decided:
                flag = torch.tensor([value], dtype=torch.int32)
                work = torch.distributed.all_reduce(
                    flag, op=torch.distributed.ReduceOp.MAX, group=self._group, async_op=True
                )
                self._pending = (work, flag)
                # the first check of a launch waits: a signal during set-up stops every rank before step 1
                decided = self._collect() if first else 0
            value = decided
        if value:
            self.reason = "signal" if value == 2 else "wall-time limit"
        return bool(value)

    def _collect(self, timeout: float | None = None) -> int:
        if self._pending is None:
            return 0
        work, flag = self._pending
        self._pending = None
        if timeout is None:
            work.wait()  # started a step ago: done by now unless a rank is a step behind
        else:
            import datetime

            work.wait(datetime.timedelta(seconds=timeout))
        return int(flag[0])  # a CPU tensor: no device read

    def close(self) -> None:
        """Finish the all-reduce started at the last check (every rank started one) and put the previous handlers
        back. After an error on this rank the others may never check again: the wait is bounded."""
        try:
            self._collect(timeout=60.0)
        except RuntimeError:
            pass  # a rank that failed before the last check; the error that ended the run is what matters
        self.restore()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
