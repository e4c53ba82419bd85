"""Where this rank is: its step and phase, as the trainer marks them (the watchdog's and the straggler report's input).

The trainer calls `enter(phase, step)` at each phase boundary. That is the hot path: a clock read and a few attribute
writes, no I/O, no collective, no host sync. The watchdog thread reads `snapshot()` about once a second and writes it
to the run folder (megagate.health.channel); nothing else leaves the process.

Per rank it keeps the step times of the last steps (their median sizes the watchdog's limits), the duration of the
last save / load / evaluation, and, for each of the last steps, the seconds in `forward_backward` (compute) and in
`grad_sync` (waiting for the other ranks in megatron's gradient reduction) and the whole step's time: the straggler
and slowdown reports' input.

Listeners (fault injection: a hang, a slow rank) may be registered for phase entries; none are in a normal run.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

STEP_HISTORY = 20  # steps whose times size the limits
TIMED_HISTORY = 64  # steps whose compute and wait times a progress record carries (the straggler report's input)
TIMED_PHASES = ("save", "load", "evaluation")  # limits from their own previous duration
# a save's duration runs from its start to its checkpoint being complete (a background write included): the
# checkpointer reports it (`record`), not the phase's visits
RECORDED_PHASES = ("save",)

Listener = Callable[[str, int], None]  # (phase entered, step)


@dataclass(frozen=True)
class Snapshot:
    """A consistent copy of the tracker's state (for the watchdog thread)."""

    phase: str
    step: int  # the step being trained (the step of the phase)
    since: float  # time.monotonic() when the phase began
    steps_done: int  # steps completed in this launch
    start_step: int  # the step this launch resumed from (0 for a fresh run)
    recent_step_s: float  # median duration of the recent steps (0 before the first)
    last_s: dict  # phase -> duration of its last completed occurrence (save, load, evaluation)
    counts: dict  # phase -> its completed occurrences in this launch (save, load, evaluation)
    recent: tuple  # (step, compute s, wait s) of the last timed steps: forward_backward, grad_sync
    totals: tuple = ()  # (step, seconds) of the last completed steps: data start to the update applied
    arrivals: tuple = ()  # (step, time.time()) of the last steps' entries into grad_sync: who came last


class Progress:
    """This process's phase tracker (one per process: `PROGRESS`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # only for the reader's consistent copy; enter() takes it briefly
        self._listeners: list[Listener] = []
        self.reset()

    def reset(self) -> None:
        """A new run in this process (the listeners stay: their owners remove them)."""
        self.phase, self.step, self.since = "setup", 0, time.monotonic()
        self.start_step = 0
        self.stage = 0  # this rank's pipeline stage (the straggler report compares ranks of one stage)
        self.steps_done = 0
        self._step_began: float | None = None
        self._step_times: deque[float] = deque(maxlen=STEP_HISTORY)
        self._last: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._compute = 0.0  # this step's forward_backward time so far
        self._recent: deque[tuple[int, float, float]] = deque(maxlen=TIMED_HISTORY)
        self._totals: deque[tuple[int, float]] = deque(maxlen=TIMED_HISTORY)
        self._arrivals: deque[tuple[int, float]] = deque(maxlen=TIMED_HISTORY)

    # --- the trainer's side (hot path) -----------------------------------------------------------------------------
    def enter(self, phase: str, step: int | None = None) -> None:
        """The main thread begins `phase` (of `step`; default: the current step)."""
        now = time.monotonic()
        with self._lock:
            spent = now - self.since
            previous = self.phase
            if previous == "forward_backward":
                self._compute = spent
            if phase == "grad_sync":  # wall clock: compared across ranks (hosts' clocks agree to a few ms)
                self._arrivals.append((self.step if step is None else step, time.time()))
            elif previous == "grad_sync":
                self._recent.append((self.step, self._compute, spent))
            elif previous in TIMED_PHASES and previous not in RECORDED_PHASES:
                self._last[previous] = spent
                self._counts[previous] = self._counts.get(previous, 0) + 1
            if step is not None:
                self.step = step
            self.phase, self.since = phase, now
        for listener in self._listeners:
            listener(phase, self.step)

    def step_started(self, step: int) -> None:
        """A new step begins (its data phase): closes the previous step's time."""
        self._step_began = time.monotonic()
        self.enter("data", step)

    def step_finished(self) -> None:
        """The step's update is applied: the step counts from here, whatever follows it (callbacks, a save)."""
        now = time.monotonic()
        if self._step_began is not None:
            self._step_times.append(now - self._step_began)
            self._totals.append((self.step, now - self._step_began))
            self.steps_done += 1
            self._step_began = None
        self.enter("after_step")

    def record(self, phase: str, seconds: float) -> None:
        """A completed occurrence of `phase` that its owner timed (a checkpoint: save start to complete)."""
        with self._lock:
            self._last[phase] = seconds
            self._counts[phase] = self._counts.get(phase, 0) + 1

    def resumed_at(self, step: int) -> None:
        self.start_step = self.step = step

    # --- readers ---------------------------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        with self._lock:
            times = list(self._step_times)
            return Snapshot(
                phase=self.phase,
                step=self.step,
                since=self.since,
                steps_done=self.steps_done,
                start_step=self.start_step,
                recent_step_s=statistics.median(times) if times else 0.0,
                last_s=dict(self._last),
                counts=dict(self._counts),
                recent=tuple(self._recent),
                totals=tuple(self._totals),
                arrivals=tuple(self._arrivals),
            )

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)


PROGRESS = Progress()


def enter(phase: str, step: int | None = None) -> None:
    """Mark a phase of this process (PROGRESS.enter)."""
    PROGRESS.enter(phase, step)


@contextlib.contextmanager
def within(phase: str) -> Iterator[None]:
    """Enter `phase` for the block, then return to the phase before it (a save or an evaluation between steps)."""
    previous = PROGRESS.phase
    PROGRESS.enter(phase)
    try:
        yield
    finally:
        PROGRESS.enter(previous)


def marking(phase: str, fn: Callable, then: str | None = None) -> Callable:
    """`fn` wrapped so that calling it enters `phase` (and `then` when it returns): e.g. megatron's
    finalize_model_grads as the grad_sync phase."""

    def wrapped(*args, **kwargs):
        PROGRESS.enter(phase)
        try:
            return fn(*args, **kwargs)
        finally:
            if then is not None:
                PROGRESS.enter(then)

    wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapped
