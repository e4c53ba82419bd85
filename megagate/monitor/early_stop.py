"""Early stopping: end a run as soon as its outcome is decided, with the reason (config section `monitor.early_stop`).

A pure, deterministic rule the trainer's `EarlyStopping` callback (megagate.train.callbacks.early_stop) feeds once
per step with the global training loss and whether the spike monitor flagged that loss. Rules (each off unless set):

* `nonfinite`: the first non-finite loss stops the run (diverged);
* `above_start`: after warm-up, the mean of the last `window` losses (all after warm-up) above the run's first loss
  stops it;
* `max_loss_spikes: k`: the (k+1)-th loss spike event after warm-up stops it (a rule that allows k spikes is
  already broken);
* `rungs: [[step, best], ...]` with `margin`: successive halving against a reference — at each rung step the mean
  of the last `window` losses above `best + margin` (the best trial of the same variant at that step, measured the
  same way) stops the run: it is clearly worse than a trial that was already run;
* `control_file`: a JSON file the callback reads at every step boundary; `{"stop": "why"}` stops the run there
  (a way for another process to end a run cleanly, with a reason).

An early stop is a *final* stop: the trainer writes summary.json with `stopped` (the reason) and `early_stop`
(`rule`, `step`, `reason`), keeps every log, and exits 0 — unlike a signal or wall-time stop, which a rerun resumes.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megagate.errors import ConfigError
from megagate.sections import as_mapping, refuse_unknown

RULES = ("nonfinite", "above_start", "loss_spikes", "rung", "control")


@dataclass(frozen=True)
class EarlyStopConfig:
    """`monitor.early_stop`: which rules end a run early (all off by default)."""

    nonfinite: bool = False
    above_start: bool = False
    max_loss_spikes: int | None = None
    rungs: tuple[tuple[int, float], ...] = ()  # (step, reference loss), ascending steps
    margin: float = 0.5  # nats above the reference at a rung
    window: int = 10  # losses averaged for above_start and the rungs
    control_file: str | None = None

    def __post_init__(self) -> None:
        p = "monitor.early_stop"
        for name in ("nonfinite", "above_start"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{p}.{name}={getattr(self, name)!r} must be true or false")
        k = self.max_loss_spikes
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ConfigError(f"{p}.max_loss_spikes={k!r} must be a non-negative integer (or null: off)")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ConfigError(f"{p}.window={self.window!r} must be a positive integer")
        m = self.margin
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m < 0:
            raise ConfigError(f"{p}.margin={m!r} must be a non-negative number of nats")
        if self.control_file is not None and (not isinstance(self.control_file, str) or not self.control_file):
            raise ConfigError(f"{p}.control_file={self.control_file!r} must be a file path")
        steps = [s for s, _ in self.rungs]
        if steps != sorted(set(steps)):
            raise ConfigError(f"{p}.rungs steps {steps} must be strictly increasing")

    @classmethod
    def from_dict(cls, values: Any) -> EarlyStopConfig:
        """From the config mapping; `rungs` is a list of [step, loss] pairs."""
        values = as_mapping(values, "monitor.early_stop")
        refuse_unknown(values, [f.name for f in dataclasses.fields(cls)], "monitor.early_stop")
        if "rungs" in values:
            values["rungs"] = _rungs(values["rungs"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rungs"] = [[s, v] for s, v in self.rungs]
        return d

    @property
    def enabled(self) -> bool:
        return bool(
            self.nonfinite or self.above_start or self.max_loss_spikes is not None or self.rungs or self.control_file
        )


def _rungs(value: Any) -> tuple[tuple[int, float], ...]:
    bad = ConfigError(f"monitor.early_stop.rungs={value!r} must be a list of [step, loss] pairs")
    if not isinstance(value, (list, tuple)):
        raise bad
    rungs = []
    for item in value:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise bad
        step, loss = item
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise bad
        if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
            raise bad
        rungs.append((step, float(loss)))
    return tuple(rungs)


@dataclass(frozen=True)
class StopDecision:
    """Why a run ends early: the rule (one of RULES), the step it was decided at, and a sentence."""

    rule: str
    step: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def trailing_mean(losses: list[float], window: int) -> float:
    """Mean of the last `window` values (all of them when fewer): the smoothing of above_start and the rungs."""
    tail = losses[-window:]
    return sum(tail) / len(tail)


class EarlyStopRule:
    """The decision procedure; `observe` once per step (in step order), state in `state_dict` for resumes."""

    def __init__(self, config: EarlyStopConfig, warmup_steps: int) -> None:
        self.config = config
        self.warmup_steps = warmup_steps
        self.first_loss: float | None = None
        self.recent: deque[float] = deque(maxlen=config.window)
        self.loss_spikes = 0  # loss spike events after warm-up

    def observe(self, step: int, loss: float, loss_spike: bool = False) -> StopDecision | None:
        """This step's decision: None to go on, else why the run is decided."""
        cfg = self.config
        if not math.isfinite(loss):
            if cfg.nonfinite:
                return StopDecision("nonfinite", step, f"diverged: non-finite loss {loss} at step {step}")
            return None  # a NaN in the window would make every later mean NaN
        if self.first_loss is None:
            self.first_loss = loss
        self.recent.append(loss)
        after_warmup = step > self.warmup_steps
        if after_warmup and loss_spike:
            self.loss_spikes += 1
            k = cfg.max_loss_spikes
            if k is not None and self.loss_spikes > k:
                return StopDecision(
                    "loss_spikes", step, f"{self.loss_spikes} loss spikes after warm-up > max_loss_spikes {k}"
                )
        mean = sum(self.recent) / len(self.recent)
        judged = step >= self.warmup_steps + cfg.window  # the whole window after warm-up
        if cfg.above_start and judged and mean > self.first_loss:
            return StopDecision(
                "above_start",
                step,
                f"loss above its starting value after warm-up: mean of the last {len(self.recent)} steps "
                f"{mean:.4g} > first loss {self.first_loss:.4g}",
            )
        for rung, best in cfg.rungs:
            if rung == step and mean > best + cfg.margin:
                return StopDecision(
                    "rung",
                    step,
                    f"successive halving at step {step}: mean loss {mean:.4g} > best {best:.4g} + margin "
                    f"{cfg.margin:g}",
                )
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"first_loss": self.first_loss, "recent": list(self.recent), "loss_spikes": self.loss_spikes}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        first = state.get("first_loss")
        self.first_loss = None if first is None else float(first)
        self.recent = deque((float(x) for x in state.get("recent", [])), maxlen=self.config.window)
        self.loss_spikes = int(state.get("loss_spikes", 0))


__all__ = ["RULES", "EarlyStopConfig", "EarlyStopRule", "StopDecision", "trailing_mean"]
