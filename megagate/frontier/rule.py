"""What "healthy" means for the frontier search: a trial's verdict and an LR point's status over seeds. Pure.

A trial (variant, LR, seed) is **healthy** when all of these hold:

1. it ran all its steps: not stopped early (diverged, loss above its start after warm-up, clearly worse than the
   best trial at a rung, too many loss spikes) and not aborted by the spike monitor;
2. it did not diverge (the project's definition: no non-finite loss, final loss not above the first);
3. at most `max_loss_spikes` loss spikes (spike-monitor events on the loss) after warm-up;
4. its final validation loss is within `delta` nats of the reference: by default the variant's best (the lowest
   final validation loss of the variant's trials that pass 1-3, any LR, any seed), or a fixed `reference` in nats.
   The best moves with the trials that happen to exist (the luckiest seed sets it); a fixed reference does not, so
   a trial's verdict is the same in a search, in a grid and in any round.

An LR point is **healthy** when at least `min_healthy_seeds` of its seeds are (default: all of them) and
**unhealthy** once more than `seeds - min_healthy_seeds` are not; in between it is undecided (more seeds needed).
With `decisive` (nats), a point is also decided by the seeds run so far when every one of them is on the same side
of the threshold by more than that margin (a sequential test: the remaining seeds are skipped where the seed spread
could not change the answer).
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

    delta: float = 0.5  # nats above the reference final validation loss
    max_loss_spikes: int = 0  # loss spikes allowed after warm-up
    min_healthy_seeds: int | None = None  # None: every seed
    reference: float | None = None  # nats; None: the variant's best trial
    decisive: float | None = None  # nats from the threshold that decide a point on the seeds run so far

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
        for flag, value in (("--reference", self.reference), ("--decisive", self.decisive)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"{flag} {value!r} must be a number of nats")
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"{flag} {value!r} must be a finite number of nats")
        if self.reference is not None and self.reference + self.delta <= 0:
            raise ConfigError(
                f"--reference {self.reference:g} + --delta {self.delta:g} can never pass: a validation loss is > 0; "
                "give a reference above 0 nats"
            )
        if self.decisive is not None and self.decisive < 0:
            raise ConfigError(f"--decisive {self.decisive:g} must be >= 0 nats (omit it: every seed is run)")
        m = self.min_healthy_seeds
        if m is not None and not 1 <= m <= seeds:
            raise ConfigError(
                f"--min-healthy-seeds {m} can never pass with {seeds} seed(s): give 1..{seeds}"
                if m > seeds
                else f"--min-healthy-seeds {m} must be at least 1"
            )

    def required(self, seeds: int) -> int:
        return seeds if self.min_healthy_seeds is None else self.min_healthy_seeds

    def threshold(self, best: float | None) -> float | None:
        """The highest final validation loss that passes (None: no reference yet)."""
        if self.reference is not None:
            return self.reference + self.delta
        return None if best is None else best + self.delta

    def describe(self) -> str:
        seeds = (
            "all its seeds are" if self.min_healthy_seeds is None else f"at least {self.min_healthy_seeds} seeds are"
        )
        ref = "the variant's best" if self.reference is None else f"the fixed reference {self.reference:g}"
        text = (
            f"healthy = ran every step (no early stop, no monitor abort), not diverged, <= {self.max_loss_spikes} "
            f"loss spikes after warm-up, final validation loss <= {ref} + {self.delta:g} nats; "
            f"an LR is healthy when {seeds}"
        )
        if self.decisive is not None:
            text += (
                f" (or, before the other seeds run, when every seed run there is more than {self.decisive:g} nats "
                "on the same side of the threshold)"
            )
        return text


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
    """(HEALTHY or UNHEALTHY, why) for one trial, against the rule's reference (the variant's best by default)."""
    if not outcome.completed:
        return UNHEALTHY, outcome.reason or f"stopped at step {outcome.steps}"
    if outcome.diverged:
        return UNHEALTHY, "diverged"
    if outcome.loss_spikes > rule.max_loss_spikes:
        return UNHEALTHY, f"{outcome.loss_spikes} loss spikes after warm-up > {rule.max_loss_spikes}"
    if outcome.valid_loss is None or not math.isfinite(outcome.valid_loss):
        return UNHEALTHY, "no final validation loss"
    limit = rule.threshold(best)
    if limit is not None and outcome.valid_loss > limit:
        ref = f"best {best:.4f}" if rule.reference is None else f"reference {rule.reference:g}"
        return UNHEALTHY, f"final validation loss {outcome.valid_loss:.4f} > {ref} + delta {rule.delta:g}"
    return HEALTHY, f"final validation loss {outcome.valid_loss:.4f}"


@dataclass(frozen=True)
class PointStatus:
    """An LR point over its seeds: `decided` is HEALTHY/UNHEALTHY/None; `leaning` the provisional side."""

    decided: str | None
    leaning: str | None  # None: no seed run yet
    passes: int
    fails: int
    decisive: bool = False  # decided by `HealthRule.decisive` before the seeds the count needs


def decisive_side(losses: Iterable[float | None], threshold: float | None, rule: HealthRule) -> str | None:
    """HEALTHY/UNHEALTHY when every seed run at a point is more than `rule.decisive` nats on that side of the
    threshold (a trial without a final validation loss counts as decisively unhealthy); else None."""
    if rule.decisive is None or threshold is None:
        return None
    losses = list(losses)
    if losses and all(x is not None and x <= threshold - rule.decisive for x in losses):
        return HEALTHY
    if losses and all(x is None or x > threshold + rule.decisive for x in losses):
        return UNHEALTHY
    return None


def point_status(verdicts: Mapping[int, str], seeds: int, rule: HealthRule, decisive: str | None = None) -> PointStatus:
    """Status of one LR from the verdicts of the seeds run there (seed -> HEALTHY/UNHEALTHY); `decisive`: the side
    every seed run there is decisively on (`decisive_side`), which decides the point without the other seeds."""
    passes = sum(v == HEALTHY for v in verdicts.values())
    fails = len(verdicts) - passes
    need = rule.required(seeds)
    decided = HEALTHY if passes >= need else UNHEALTHY if fails > seeds - need else None
    early = decided is None and ((decisive == HEALTHY and fails == 0) or (decisive == UNHEALTHY and passes == 0))
    if early:
        decided = decisive
    leaning = None if not verdicts else decided or (HEALTHY if passes > fails else UNHEALTHY)
    return PointStatus(decided, leaning, passes, fails, early)


__all__ = [
    "HEALTHY",
    "UNHEALTHY",
    "HealthRule",
    "PointStatus",
    "TrialOutcome",
    "best_loss",
    "decisive_side",
    "point_status",
    "verdict",
]
