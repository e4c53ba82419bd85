"""Stop conditions: SIGTERM / SIGUSR1 (Slurm's warning, preemption) and a wall-time limit.

Handlers only set a flag; the loop asks `should_stop()` once per step, which agrees across all ranks (a MAX
all-reduce), so every rank checkpoints and exits at the same step.
"""

from __future__ import annotations

import signal
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_early: int | None = None  # a stop signal that arrived before the loop's handlers existed


def install_early() -> None:
    """Catch stop signals from the first moment of a launch (set-up takes many seconds on big models); the loop's
    StopConditions picks up what arrived and stops at its first check, after a checkpoint."""

    def record(signum: int, frame: object) -> None:
        global _early
        _early = signum

    for sig in STOP_SIGNALS:
        signal.signal(sig, record)


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
