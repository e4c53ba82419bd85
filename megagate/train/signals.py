"""Stop conditions: SIGTERM / SIGUSR1 (Slurm's warning, preemption), SIGINT (Ctrl-C) and a wall-time limit.

Handlers only set a flag; the loop asks `should_stop()` once per step, which agrees across all ranks (a MAX
all-reduce), so every rank checkpoints and exits at the same step.

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
        if install_handlers:
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            # a second Ctrl-C that Python handles before the wakeup-pipe thread does (or without that thread)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        self.received = signum

    def should_stop(self, step_time: float = 0.0) -> bool:
        """True on every rank if any rank got a stop signal or would pass the wall-time limit within a step."""
        local = 0
        if self.received is not None:
            local = 2
        elif self.deadline is not None and time.monotonic() + 2 * step_time >= self.deadline:
            local = 1
        import torch  # not at module level: install_early() runs before the seconds-long torch import

        flag = torch.tensor([local], dtype=torch.int32)
        if torch.distributed.is_initialized():
            if torch.cuda.is_available():
                flag = flag.cuda()
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        value = int(flag.item())
        if value:
            self.reason = "signal" if value == 2 else "wall-time limit"
        return bool(value)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
