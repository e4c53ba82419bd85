"""The spike monitor's settings (config section `monitor.spike`): `SpikeMonitorConfig`, its actions and checks.

megagate.monitor.spike documents what each setting does to the detection; this module only types and checks them
(one-line ConfigError naming the key and what is allowed).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megagate.errors import ConfigError
from megagate.sections import read_fields

ACTIONS = ("warn", "skip", "rollback", "lr_backoff", "abort")
DIRECTIONS = ("up", "both")
TRANSFORMS = ("none", "log")
# Larger is more severe: when several metrics fire in one step the trainer takes the most severe action.
SEVERITY = {action: i for i, action in enumerate(ACTIONS)}
PER_METRIC = ("metric_thresholds", "abs_ceiling", "direction", "transform", "early_rise")  # metric -> setting


@dataclass(frozen=True)
class SpikeMonitorConfig:
    """Spike monitor settings (config section `monitor.spike`)."""

    enabled: bool = True
    metrics: tuple[str, ...] = ("loss", "grad_norm")
    window: int = 100  # accepted values the noise scale is computed over
    center_window: int = 20  # most recent accepted values whose median is the baseline
    threshold: float = 8.0  # robust z-score above which a value is a spike
    # per-metric override of `threshold`
    metric_thresholds: Mapping[str, float] = field(default_factory=lambda: {"grad_norm": 12.0})
    min_history: int = 20  # accepted values needed before z-scores are computed (NaN/ceiling always checked)
    # the warm-up rule before min_history: metric -> relative rise over the median of the accepted values
    early_rise: Mapping[str, float] = field(default_factory=lambda: {"loss": 0.2})
    early_min_history: int = 3  # accepted values the warm-up rule needs
    rel_floor: float = 0.01  # scale floor, as a fraction of |median| (plateaus with MAD ≈ 0)
    abs_ceiling: Mapping[str, float] = field(default_factory=dict)  # e.g. {"loss": 20.0, "grad_norm": 1e3}
    direction: Mapping[str, str] = field(default_factory=dict)  # metric -> "up" | "both" (default "up")
    transform: Mapping[str, str] = field(default_factory=lambda: {"grad_norm": "log"})  # metric -> "none" | "log"
    action: str = "warn"
    lr_backoff_factor: float = 0.5  # LR multiplier during a backoff
    lr_backoff_steps: int = 100  # steps a backoff lasts, starting at the event step
    rollback_skip_steps: int = 1  # batches to drop ending at the spike step (1 = only the offending batch)
    max_rollbacks: int = 3  # further rollbacks escalate to abort (no infinite rollback loop)
    max_consecutive: int = 20  # consecutive events with skip/lr_backoff/rollback escalate to abort

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> SpikeMonitorConfig:
        """Build from a config mapping (lists become tuples), naming unknown keys and values of the wrong type."""
        values = read_fields(cls, values, "monitor.spike", item="metric", scalars=False)
        watched = values.get("metrics", cls.metrics)
        for name in PER_METRIC:
            # A key must be a watched metric, or one the default names (grad_norm: harmless when not watched, and
            # what to_dict() writes back).
            default = next(f for f in dataclasses.fields(cls) if f.name == name).default_factory()
            extra = [m for m in values.get(name, ()) if m not in watched and m not in default]
            if extra:
                raise ConfigError(
                    f"monitor.spike.{name} has {extra[0]!r}, which is not a watched metric "
                    f"({', '.join(map(str, watched))})"
                )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["metrics"] = list(self.metrics)
        d["abs_ceiling"] = dict(self.abs_ceiling)
        d["direction"] = dict(self.direction)
        d["transform"] = dict(self.transform)
        d["metric_thresholds"] = dict(self.metric_thresholds)
        d["early_rise"] = dict(self.early_rise)
        return d


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"monitor.spike.{name}={value!r} must be a positive integer")


def validate(cfg: SpikeMonitorConfig) -> None:
    """Raise ConfigError naming the first invalid value."""
    if cfg.action not in ACTIONS:
        raise ConfigError(f"monitor.spike.action={cfg.action!r} is not one of {', '.join(ACTIONS)}")
    for name in (
        "window",
        "center_window",
        "min_history",
        "lr_backoff_steps",
        "rollback_skip_steps",
        "max_rollbacks",
        "max_consecutive",
        "early_min_history",
    ):
        _positive_int(name, getattr(cfg, name))
    if cfg.min_history > cfg.window:
        raise ConfigError(
            f"monitor.spike.min_history ({cfg.min_history}) must be <= monitor.spike.window ({cfg.window})"
        )
    if not isinstance(cfg.threshold, (int, float)) or not cfg.threshold > 0 or not math.isfinite(cfg.threshold):
        raise ConfigError(f"monitor.spike.threshold={cfg.threshold!r} must be a positive number")
    if not isinstance(cfg.rel_floor, (int, float)) or not 0 <= cfg.rel_floor < 1:
        raise ConfigError(f"monitor.spike.rel_floor={cfg.rel_floor!r} must be in [0, 1)")
    if not isinstance(cfg.lr_backoff_factor, (int, float)) or not 0 < cfg.lr_backoff_factor <= 1:
        raise ConfigError(f"monitor.spike.lr_backoff_factor={cfg.lr_backoff_factor!r} must be in (0, 1]")
    if not cfg.metrics or any(not isinstance(m, str) or not m for m in cfg.metrics):
        raise ConfigError(f"monitor.spike.metrics={list(cfg.metrics)!r} must be a non-empty list of metric names")
    for metric, ceiling in cfg.abs_ceiling.items():
        if metric not in cfg.metrics:
            raise ConfigError(
                f"monitor.spike.abs_ceiling has {metric!r}, which is not a watched metric ({', '.join(cfg.metrics)})"
            )
        if not isinstance(ceiling, (int, float)) or not math.isfinite(ceiling):
            raise ConfigError(f"monitor.spike.abs_ceiling.{metric}={ceiling!r} must be a finite number")
    for metric, transform in cfg.transform.items():
        if metric not in cfg.metrics:
            continue  # the default log transform of grad_norm is harmless when grad_norm is not watched
        if transform not in TRANSFORMS:
            raise ConfigError(f"monitor.spike.transform.{metric}={transform!r} is not one of {', '.join(TRANSFORMS)}")
    for metric, threshold in cfg.metric_thresholds.items():
        if metric not in cfg.metrics:
            continue  # like transform: the grad_norm default is harmless when grad_norm is not watched
        if not isinstance(threshold, (int, float)) or not threshold > 0 or not math.isfinite(threshold):
            raise ConfigError(f"monitor.spike.metric_thresholds.{metric}={threshold!r} must be a positive number")
    for metric, rise in cfg.early_rise.items():
        if metric not in cfg.metrics:
            continue  # like transform: the loss default is harmless when the loss is not watched
        if isinstance(rise, bool) or not isinstance(rise, (int, float)) or not math.isfinite(rise) or rise <= 0:
            raise ConfigError(f"monitor.spike.early_rise.{metric}={rise!r} must be a positive number")
    for metric, direction in cfg.direction.items():
        if metric not in cfg.metrics:
            raise ConfigError(
                f"monitor.spike.direction has {metric!r}, which is not a watched metric ({', '.join(cfg.metrics)})"
            )
        if direction not in DIRECTIONS:
            raise ConfigError(f"monitor.spike.direction.{metric}={direction!r} is not one of {', '.join(DIRECTIONS)}")


__all__ = ["ACTIONS", "DIRECTIONS", "PER_METRIC", "SEVERITY", "TRANSFORMS", "SpikeMonitorConfig", "validate"]
