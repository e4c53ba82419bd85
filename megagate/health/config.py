"""The `watchdog` and `straggler` config sections, typed (defaults sized for a multi-node GPU job).

    watchdog:
      enabled: true
      step_multiple: 10        # a phase may run this many times the recent median step time (save, load and
                               # evaluation: their own previous duration) ...
      floor_s: {data: 300, ...}  # ... but never less than its floor (seconds; PHASES below, all optional)
      warmup_steps: 2          # the first steps of each launch (compilation, first collectives, allocator) ...
      warmup_s: 1200           # ... and the set-up before them get at least this long
      heartbeat_s: 1.0         # how often each rank writes its progress record (a background thread)
      grace_s: 10              # after a hang is detected: time for the other ranks to dump their stacks
    straggler:
      enabled: true
      interval: 20             # steps per window (the logging rank compares the ranks at the end of each)
      margin: 0.25             # a rank computing more than (1 + margin) x the median of the others ...
      windows: 3               # ... in this many consecutive windows is reported; so is a rank whose lateness makes
                               # the job's step more than (1 + margin) x the step without it ...
      late_share: 0.5          # ... when it holds more than this share of the time lost to late ranks

Every refusal is one `ConfigError` naming the key and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from megagate.errors import ConfigError
from megagate.sections import as_mapping, build_section

# The phases a rank reports (megagate.health.progress); each has its own floor.
PHASES = (
    "setup",  # process group up, model, optimizer and data being built
    "load",  # a checkpoint being read (resume, rollback)
    "data",  # before a step's forward: stop checks, next micro-batches, pre_step callbacks
    "forward_backward",  # megatron's schedule (forward and backward compute, pipeline sends)
    "grad_sync",  # megatron's gradient reduction at the end of the schedule, and the loss reduction
    "optimizer",  # grad norm, callbacks' decisions, the optimizer step (parameter gather)
    "after_step",  # post_step callbacks: metrics, logging
    "evaluation",  # validation
    "save",  # a checkpoint being written (synchronous part) or waited for
    "end",  # on_end and teardown: no limit
)
DEFAULT_FLOORS = {
    "setup": 1200.0,
    "load": 1200.0,
    "data": 300.0,
    "forward_backward": 300.0,
    "grad_sync": 300.0,
    "optimizer": 300.0,
    "after_step": 300.0,
    "evaluation": 600.0,
    # 15A2B's ~210 GB at a degraded file system's 0.2 GB/s takes ~18 minutes; still below the 30-minute collective
    # timeout (megagate.distributed.launch), which a real hang would otherwise wait out
    "save": 1200.0,
}


MIN_HEARTBEAT_S = 0.05


def _positive(value: float, path: str, allow_zero: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{path}={value!r} must be a positive number" + (" or 0" if allow_zero else ""))


@dataclass(frozen=True)
class WatchdogConfig:
    """`watchdog`: hang detection (megagate.health.watchdog)."""

    enabled: bool = True
    step_multiple: float = 10.0
    floor_s: dict = field(default_factory=dict)  # phase -> seconds, over DEFAULT_FLOORS
    warmup_steps: int = 2
    warmup_s: float = 1200.0
    heartbeat_s: float = 1.0
    grace_s: float = 10.0

    def __post_init__(self) -> None:
        _positive(self.step_multiple, "watchdog.step_multiple")
        for phase, seconds in self.floor_s.items():
            if phase not in DEFAULT_FLOORS:
                raise ConfigError(
                    f"watchdog.floor_s.{phase} is not a phase with a limit; phases: {', '.join(DEFAULT_FLOORS)}"
                )
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
                raise ConfigError(f"watchdog.floor_s.{phase}={seconds!r} must be a number of seconds")
            _positive(float(seconds), f"watchdog.floor_s.{phase}")
        if isinstance(self.warmup_steps, bool) or self.warmup_steps < 0:
            raise ConfigError(f"watchdog.warmup_steps={self.warmup_steps!r} must be a non-negative integer")
        _positive(self.warmup_s, "watchdog.warmup_s")
        _positive(self.heartbeat_s, "watchdog.heartbeat_s")
        if self.heartbeat_s < MIN_HEARTBEAT_S:  # each beat writes a file and lists a folder on a shared file system
            raise ConfigError(
                f"watchdog.heartbeat_s={self.heartbeat_s:g} is below {MIN_HEARTBEAT_S:g} s: the watchdog thread would "
                "busy-loop writing progress records"
            )
        _positive(self.grace_s, "watchdog.grace_s", allow_zero=True)
        smallest = min(self.floors.values())
        if self.heartbeat_s * 2 > smallest:
            raise ConfigError(
                f"watchdog.heartbeat_s={self.heartbeat_s:g} is too long for the shortest phase floor ({smallest:g} s): "
                "a rank must write at least two progress records within every limit"
            )

    @property
    def floors(self) -> dict[str, float]:
        """Every phase's floor in seconds (the defaults, overridden by floor_s)."""
        return {**DEFAULT_FLOORS, **{k: float(v) for k, v in self.floor_s.items()}}

    @classmethod
    def from_dict(cls, values: Any) -> WatchdogConfig:
        values = as_mapping(values, "watchdog")
        values["floor_s"] = dict(as_mapping(values.get("floor_s"), "watchdog.floor_s"))
        return build_section(cls, values, "watchdog")


@dataclass(frozen=True)
class StragglerConfig:
    """`straggler`: per-rank compute vs wait, compared every `interval` steps (megagate.health.straggler)."""

    enabled: bool = True
    interval: int = 20
    margin: float = 0.25
    windows: int = 3
    late_share: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.interval, bool) or self.interval < 1:
            raise ConfigError(f"straggler.interval={self.interval!r} must be a positive number of steps")
        _positive(self.margin, "straggler.margin")
        if isinstance(self.windows, bool) or self.windows < 1:
            raise ConfigError(f"straggler.windows={self.windows!r} must be a positive integer")
        if not (isinstance(self.late_share, (int, float)) and 0 <= self.late_share < 1):
            raise ConfigError(
                f"straggler.late_share={self.late_share!r} must be a share in [0, 1): a rank cannot hold more than "
                "all of the time lost to late ranks"
            )

    @classmethod
    def from_dict(cls, values: Any) -> StragglerConfig:
        return build_section(cls, values, "straggler")
