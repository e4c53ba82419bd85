"""Loss / gradient-norm spike detection: a pure, deterministic monitor the training loop calls once per step.

Detection, per watched metric (the global value after the data-parallel reduction, identical on every rank):

* a non-finite value (NaN/Inf) is always an event;
* a value above the metric's absolute ceiling (`abs_ceiling`) is an event;
* before `min_history` accepted values exist (the warm-up, where high-LR runs spike most), a metric with an
  `early_rise` entry is judged from `early_min_history` values on: an event when the value exceeds the median of
  its accepted values by more than early_rise x |median| (a relative rise: 0.2 = 20 %, about 1.5 nats at the
  initial loss of a 2,048-token vocabulary; in log space early_rise itself, a ratio). Too few values for a noise
  scale, so the rule is a floor on the rise, not a z-score;
* otherwise, once `min_history` accepted values exist, the robust z-score ``(value - center) / scale`` is compared
  with `threshold`: center = median of the last `center_window` accepted values, scale = the robust noise level
  (1.4826 · median |successive difference| / √2) over the last `window` accepted values (see `robust_baseline`).
  Only upward deviations count by default (a loss or gradient norm that drops is not an instability).
  The scale has a floor (`rel_floor` · |center|) so a flat plateau with a tiny MAD does not turn noise into spikes.
* A metric can be watched in log space (`transform`, default for grad_norm): gradient norms are right-skewed, their
  natural outliers are multiplicative, so a ratio to the median is the meaningful deviation. In log space the floor
  is `rel_floor` itself (a relative change); `baseline` is still reported on the metric's own scale.

Defaults were chosen on the curves of an earlier byte-level test loop (largest clean robust z 3.7 for the loss,
9.5 for log grad-norm, hence threshold 8 and 12 for grad_norm) and re-measured on 16 clean 200-step runs of the
trainer (docs/monitoring.md §1.2): largest clean z 5.1 (loss) and 25 (log grad-norm; two natural single-batch
grad-norm outliers of 5-8x the median, with a flat loss, are reported at the defaults).

A value that raises an event is *not* added to the history, so a spike does not poison its own baseline.

The monitor holds two kinds of state: the rolling history (restored with a checkpoint, so a resumed run behaves as if
uninterrupted) and a ledger of rollbacks and skipped data windows that must survive a rollback to an older
checkpoint (`restore_after_rollback`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megagate.errors import MegagateError
from megagate.monitor.spike_config import (  # re-exported: the settings' historical home
    ACTIONS,
    DIRECTIONS,
    PER_METRIC,
    SEVERITY,
    TRANSFORMS,
    SpikeMonitorConfig,
    validate,
)

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution × 1.4826 = its standard deviation
STATE_VERSION = 1


class SpikeAbort(MegagateError):
    """Raised (by the trainer, after checkpointing) when the monitor's action is `abort`."""


@dataclass(frozen=True)
class SpikeEvent:
    """One detected anomaly; `action` is what the trainer must do (may be escalated beyond the configured one)."""

    step: int
    metric: str
    value: float
    baseline: float | None  # the robust center of the accepted history, metric scale (None before any history)
    score: float | None  # robust z-score (inf for non-finite values; None when no baseline yet)
    action: str
    reason: str  # "non-finite" | "ceiling" | "robust-z" (+ ", escalated: ...")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (non-finite floats become the strings 'nan', 'inf', '-inf')."""
        return {k: _json_float(v) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


@dataclass(frozen=True)
class RollbackPlan:
    """What a rollback does: restore the checkpoint of `restore_step`, drop the batches of steps [skip_first, skip_last]."""

    restore_step: int
    skip_first: int
    skip_last: int


def worst_action(events: Iterable[SpikeEvent]) -> str | None:
    """The most severe action among `events` (None if there are none): one step gets one action."""
    actions = [e.action for e in events]
    return max(actions, key=SEVERITY.__getitem__) if actions else None


def robust_baseline(
    values: Sequence[float], rel_floor: float, absolute_floor: bool = False, center_window: int = 20
) -> tuple[float, float]:
    """(center, scale) of an accepted history, oldest first.

    center = median of the last `center_window` values (tracks a trending loss without chasing single values);
    scale = 1.4826 · median |successive difference| / √2 over all `values`: the noise of a stationary series, but
    unlike the MAD around the median it is not inflated by the trend of a falling loss (measured: with the plain
    MAD a loss × 1.5 spike was invisible mid-training). Floored by rel_floor · |center| (or rel_floor itself for
    log-space values) and a tiny constant, so a flat plateau never divides by ~0.
    """
    xs = list(values)
    center = _median(sorted(xs[-center_window:]))
    diffs = sorted(abs(b - a) for a, b in zip(xs[:-1], xs[1:]))
    noise = MAD_TO_SIGMA * _median(diffs) / math.sqrt(2) if diffs else 0.0
    floor = rel_floor if absolute_floor else rel_floor * abs(center)
    return center, max(noise, floor, 1e-12)


def _log(x: float) -> float:
    """log for log-space metrics; 0 or negative values (a zero grad norm) map to -inf, which is never an upward spike."""
    return math.log(x) if x > 0 else -math.inf


def _median(sorted_xs: list[float]) -> float:
    n = len(sorted_xs)
    mid = n // 2
    return sorted_xs[mid] if n % 2 else 0.5 * (sorted_xs[mid - 1] + sorted_xs[mid])


class SpikeMonitor:
    """Deterministic spike detector; call `observe` once per step, before the optimizer update is applied."""

    def __init__(self, config: SpikeMonitorConfig | None = None) -> None:
        self.config = config or SpikeMonitorConfig()
        self._history: dict[str, deque[float]] = {m: deque(maxlen=self.config.window) for m in self.config.metrics}
        self._last_step: int | None = None
        self._consecutive = 0  # consecutive steps with an event
        self._backoff = (0, -1)  # lr_backoff active for steps in [first, last]
        # Ledger: survives rollbacks (restore_after_rollback keeps it).
        self._rollbacks: list[dict[str, int]] = []  # {"event_step", "restore_step", "skip_first", "skip_last"}
        self._num_events = 0

    # --- detection ----------------------------------------------------------------------------------------------
    def observe(self, step: int, metrics: Mapping[str, float]) -> list[SpikeEvent]:
        """Check this step's watched metrics; return its events (empty when all is well).

        Metrics that are not watched are ignored; a watched metric missing from `metrics` is not checked this step.
        """
        cfg = self.config
        if not cfg.enabled:
            return []
        events: list[SpikeEvent] = []
        accepted: list[tuple[str, float]] = []
        for metric in cfg.metrics:
            if metric not in metrics:
                continue
            value = float(metrics[metric])
            event = self._check(step, metric, value)
            if event is None:
                accepted.append((metric, value))
            else:
                events.append(event)
        # A spike step contributes nothing to any baseline: its other metrics belong to the same bad update.
        if not events:
            for metric, value in accepted:
                self._accept(metric, value)
            self._consecutive = 0
        else:
            self._consecutive += 1
            events = self._decide(step, events)
            self._num_events += len(events)
            if events[0].action == "lr_backoff":
                first, last = self._backoff
                first = first if first <= step <= last + 1 else step  # a spike during a backoff extends it
                self._backoff = (first, max(last, step + cfg.lr_backoff_steps - 1))
        self._last_step = step
        return events

    def _check(self, step: int, metric: str, value: float) -> SpikeEvent | None:
        cfg = self.config
        history = self._history[metric]
        log = cfg.transform.get(metric, "none") == "log"
        baseline = score = None
        if history:
            center, scale = robust_baseline(history, cfg.rel_floor, absolute_floor=log, center_window=cfg.center_window)
            baseline = math.exp(center) if log else center
            x = _log(value) if log else value
            if math.isfinite(x):
                score = (x - center) / scale
        if not math.isfinite(value):
            return SpikeEvent(step, metric, value, baseline, math.inf, cfg.action, "non-finite")
        ceiling = cfg.abs_ceiling.get(metric)
        if ceiling is not None and value > ceiling:
            return SpikeEvent(step, metric, value, baseline, score, cfg.action, f"ceiling {ceiling:g}")
        rise = cfg.early_rise.get(metric)
        if rise is not None and cfg.early_min_history <= len(history) < cfg.min_history and score is not None:
            x = _log(value) if log else value
            if x - center > rise * (1.0 if log else abs(center)):
                return SpikeEvent(step, metric, value, baseline, score, cfg.action, f"warm-up rise > {rise:g}")
        if score is not None and len(history) >= cfg.min_history:
            threshold = cfg.metric_thresholds.get(metric, cfg.threshold)
            deviation = score if cfg.direction.get(metric, "up") == "up" else abs(score)
            if deviation > threshold:
                space = "log " if log else ""
                return SpikeEvent(step, metric, value, baseline, score, cfg.action, f"robust {space}z > {threshold:g}")
        return None

    def _accept(self, metric: str, value: float) -> None:
        log = self.config.transform.get(metric, "none") == "log"
        x = _log(value) if log else value
        if math.isfinite(x):  # a zero grad norm (log = -inf) would break the median/MAD
            self._history[metric].append(x)

    def _decide(self, step: int, events: list[SpikeEvent]) -> list[SpikeEvent]:
        """Apply escalation: too many rollbacks or too many consecutive events turn the action into abort."""
        cfg = self.config
        escalate = None
        if cfg.action in ("skip", "lr_backoff", "rollback") and self._consecutive > cfg.max_consecutive:
            escalate = f"escalated: {self._consecutive} consecutive spike steps > max_consecutive {cfg.max_consecutive}"
        elif cfg.action == "rollback" and len(self._rollbacks) >= cfg.max_rollbacks:
            escalate = f"escalated: {len(self._rollbacks)} rollbacks already = max_rollbacks {cfg.max_rollbacks}"
        if escalate is None:
            return events
        return [dataclasses.replace(e, action="abort", reason=f"{e.reason}, {escalate}") for e in events]

    # --- actions ------------------------------------------------------------------------------------------------
    def lr_scale(self, step: int) -> float:
        """LR multiplier for the update of `step` (lr_backoff_factor while a backoff is active, else 1)."""
        first, last = self._backoff
        return self.config.lr_backoff_factor if first <= step <= last else 1.0

    def rollback_plan(self, event_step: int, checkpoint_step: int) -> RollbackPlan:
        """Plan a rollback to the checkpoint of `checkpoint_step` after a spike at `event_step`.

        The skipped window is the spike batch and up to rollback_skip_steps-1 batches before it, never reaching
        back to the checkpoint's own batches.
        """
        if checkpoint_step >= event_step:
            raise MegagateError(
                f"rollback needs a checkpoint before the spike: checkpoint step {checkpoint_step} >= spike step {event_step}"
            )
        first = max(checkpoint_step + 1, event_step - self.config.rollback_skip_steps + 1)
        return RollbackPlan(restore_step=checkpoint_step, skip_first=first, skip_last=event_step)

    def restore_after_rollback(self, checkpoint_state: Mapping[str, Any], plan: RollbackPlan, event_step: int) -> None:
        """Load the monitor state saved in the restored checkpoint, keeping the rollback ledger (and adding `plan`)."""
        ledger = list(self._rollbacks) + [
            {
                "event_step": event_step,
                "restore_step": plan.restore_step,
                "skip_first": plan.skip_first,
                "skip_last": plan.skip_last,
            }
        ]
        num_events = self._num_events
        self.load_state_dict(checkpoint_state)
        self._rollbacks = ledger
        self._num_events = num_events

    def skipped_windows(self) -> list[tuple[int, int]]:
        """Inclusive [first, last] batch windows dropped by rollbacks so far."""
        return [(r["skip_first"], r["skip_last"]) for r in self._rollbacks]

    def data_index(self, step: int) -> int:
        """Index of the batch training step `step` consumes (== step without rollbacks).

        Batches are numbered by the step that would consume them in an uninterrupted run. A rollback whose window
        is [first, last] (in step numbers) shifts every step >= first by the window's length: the run keeps its
        step count and reads past the dropped batches, so the data keeps moving forward.
        """
        return step + sum(last - first + 1 for first, last in self.skipped_windows() if step >= first)

    @property
    def num_events(self) -> int:
        return self._num_events

    @property
    def num_rollbacks(self) -> int:
        return len(self._rollbacks)

    # --- checkpointing ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable state: put it in the training checkpoint."""
        return {
            "version": STATE_VERSION,
            "window": self.config.window,
            "history": {m: list(h) for m, h in self._history.items()},
            "last_step": self._last_step,
            "consecutive": self._consecutive,
            "backoff": list(self._backoff),
            "rollbacks": [dict(r) for r in self._rollbacks],
            "num_events": self._num_events,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()` output; watched metrics absent from it start with an empty history."""
        if state.get("version") != STATE_VERSION:
            raise MegagateError(f"spike monitor state version {state.get('version')!r} is not {STATE_VERSION}")
        window = self.config.window
        saved = state.get("history", {})
        # A changed window keeps the most recent values that fit.
        self._history = {m: deque((float(v) for v in saved.get(m, [])), maxlen=window) for m in self.config.metrics}
        self._last_step = state.get("last_step")
        self._consecutive = int(state.get("consecutive", 0))
        first, last = state.get("backoff", (0, -1))
        self._backoff = (int(first), int(last))
        self._rollbacks = [dict(r) for r in state.get("rollbacks", [])]
        self._num_events = int(state.get("num_events", 0))


__all__ = [
    "ACTIONS",
    "DIRECTIONS",
    "PER_METRIC",
    "SEVERITY",
    "TRANSFORMS",
    "validate",
    "RollbackPlan",
    "SpikeAbort",
    "SpikeEvent",
    "SpikeMonitor",
    "SpikeMonitorConfig",
    "robust_baseline",
    "worst_action",
]
