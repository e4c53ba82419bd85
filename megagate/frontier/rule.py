"""What "healthy" means for the frontier search: a trial's verdict and an LR point's status over seeds. Pure.

A trial (variant, LR, seed) is **healthy** when all of these hold:

1. it ran all its steps: not stopped early (diverged, loss above its start after warm-up, clearly worse than the
   best trial at a rung, too many loss spikes) and not aborted by the spike monitor;
2. it did not diverge (the project's definition: no non-finite loss, final loss not above the first);
3. at most `max_loss_spikes` loss spikes (spike-monitor events on the loss) after warm-up;
4. its final validation loss is within `delta` nats of the variant's best: the lowest final validation loss of the
   variant's trials that pass 1-3 (any LR, any seed).

An LR point is **healthy** when at least `min_healthy_seeds` of its seeds are (default: all of them) and
**unhealthy** once more than `seeds - min_healthy_seeds` are not; in between it is undecided (more seeds needed).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from megagate.errors import ConfigError

HEALTHY, UNHEALTHY = "healthy", "unhealthy"


@dataclass(frozen=True)
class HealthRule:
    """The stated rule; `validate` refuses one that no trial could ever pass."""

    delta: float = 0.5  # nats above the variant's best final validation loss
    max_loss_spikes: int = 0  # loss spikes allowed after warm-up
    min_healthy_seeds: int | None = None  # None: every seed

    def validate(self, seeds: int) -> None:
        """ConfigError naming the value when the rule can never pass (or is not a number)."""
        if not isinstance(self.delta, (int, float)) or not math.isfinite(self.delta):
            raise ConfigError(f"--delta {self.delta!r} must be a finite number of nats")
        if self.delta < 0:
            raise ConfigError(
                f"--delta {self.delta:g} can never pass: not even the variant's best trial is within {self.delta:g} "
                "nats of itself; give a delta >= 0"
            )
        if self.max_loss_spikes < 0:
            raise ConfigError(
                f"--max-loss-spikes {self.max_loss_spikes} can never pass: a trial has at least 0 spikes; give >= 0"
            )
        m = self.min_healthy_seeds
        if m is not None and not 1 <= m <= seeds:
            raise ConfigError(
                f"--min-healthy-seeds {m} can never pass with {seeds} seed(s): give 1..{seeds}"
                if m > seeds
                else f"--min-healthy-seeds {m} must be at least 1"
            )

    def required(self, seeds: int) -> int:
        return seeds if self.min_healthy_seeds is None else self.min_healthy_seeds

    def describe(self) -> str:
        seeds = (
            "all its seeds are" if self.min_healthy_seeds is None else f"at least {self.min_healthy_seeds} seeds are"
        )
        return (
            f"healthy = ran every step (no early stop, no monitor abort), not diverged, <= {self.max_loss_spikes} "
            f"loss spikes after warm-up, final validation loss <= the variant's best + {self.delta:g} nats; "
            f"an LR is healthy when {seeds}"
        )


@dataclass(frozen=True)
class TrialOutcome:
    """What a finished trial showed (read from its run directory by megagate.frontier.trials)."""

    steps: int  # steps it ran
    completed: bool  # ran every step without an early stop or an abort
    stop_rule: str | None = None  # the early-stop rule, or "abort" (spike monitor), when not completed
    reason: str = ""  # why it stopped
    valid_loss: float | None = None  # final validation loss
    loss_spikes: int = 0  # loss spike events after warm-up
    diverged: bool = False

    @property
    def passes_absolute(self) -> bool:
        """Conditions 1-2 (3 is checked against the rule)."""
        return self.completed and not self.diverged and self.valid_loss is not None and math.isfinite(self.valid_loss)


def best_loss(outcomes: Iterable[TrialOutcome], rule: HealthRule) -> float | None:
    """The variant's best: the lowest final validation loss among trials passing conditions 1-3."""
    losses = [o.valid_loss for o in outcomes if o.passes_absolute and o.loss_spikes <= rule.max_loss_spikes]
    return min(losses) if losses else None


def verdict(outcome: TrialOutcome, best: float | None, rule: HealthRule) -> tuple[str, str]:
    """(HEALTHY or UNHEALTHY, why) for one trial, against the variant's best."""
    if not outcome.completed:
        return UNHEALTHY, outcome.reason or f"stopped at step {outcome.steps}"
    if outcome.diverged:
        return UNHEALTHY, "diverged"
    if outcome.loss_spikes > rule.max_loss_spikes:
        return UNHEALTHY, f"{outcome.loss_spikes} loss spikes after warm-up > {rule.max_loss_spikes}"
    if outcome.valid_loss is None or not math.isfinite(outcome.valid_loss):
        return UNHEALTHY, "no final validation loss"
    if best is not None and outcome.valid_loss > best + rule.delta:
        return UNHEALTHY, (f"final validation loss {outcome.valid_loss:.4f} > best {best:.4f} + delta {rule.delta:g}")
    return HEALTHY, f"final validation loss {outcome.valid_loss:.4f}"


@dataclass(frozen=True)
class PointStatus:
    """An LR point over its seeds: `decided` is HEALTHY/UNHEALTHY/None; `leaning` the provisional side."""

    decided: str | None
    leaning: str | None  # None: no seed run yet
    passes: int
    fails: int


def point_status(verdicts: Mapping[int, str], seeds: int, rule: HealthRule) -> PointStatus:
    """Status of one LR from the verdicts of the seeds run there (seed -> HEALTHY/UNHEALTHY)."""
    passes = sum(v == HEALTHY for v in verdicts.values())
    fails = len(verdicts) - passes
    need = rule.required(seeds)
    decided = HEALTHY if passes >= need else UNHEALTHY if fails > seeds - need else None
    leaning = None if not verdicts else decided or (HEALTHY if passes > fails else UNHEALTHY)
    return PointStatus(decided, leaning, passes, fails)


__all__ = [
    "HEALTHY",
    "UNHEALTHY",
    "HealthRule",
    "PointStatus",
    "TrialOutcome",
    "best_loss",
    "point_status",
    "verdict",
]
