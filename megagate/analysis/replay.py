"""Replay the spike monitor over a run's logged curve with other settings: what would it have flagged?

The monitor is a pure function of the per-step (loss, grad_norm) series, so a run logged at every step
(`logging.interval: 1`) can be re-judged offline with any `monitor.spike` settings — e.g. to see whether a lower
`min_history` catches warm-up spikes without false positives on clean runs — without training again. Only `warn`
replays exactly: skip / rollback / lr_backoff would have changed the run after the first event.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from megagate.errors import ConfigError, MegagateError
from megagate.monitor.spike import SpikeMonitor, SpikeMonitorConfig

MAPPING_FIELDS = ("metric_thresholds", "abs_ceiling", "direction", "transform", "early_rise")


def parse_settings(text: str) -> SpikeMonitorConfig:
    """`key=value,key=value` (monitor.spike keys; `metric_thresholds.grad_norm=8` for per-metric ones) on top of
    the defaults; values are YAML scalars. One-line ConfigError for a malformed item or a setting the monitor refuses."""
    values: dict[str, Any] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--replay-monitor item {item!r} is not key=value")
        key, value = key.strip(), yaml.safe_load(raw)
        head, dot, metric = key.partition(".")
        if dot:
            if head not in MAPPING_FIELDS:
                raise ConfigError(f"--replay-monitor key {key!r}: only {', '.join(MAPPING_FIELDS)} take a .metric")
            default = SpikeMonitorConfig().to_dict().get(head) or {}
            values.setdefault(head, dict(default))[metric] = value
        else:
            values[key] = value
    if values.get("action", "warn") != "warn":
        raise ConfigError(
            f"--replay-monitor action={values['action']!r}: only warn replays exactly (other actions change the run)"
        )
    try:
        return SpikeMonitorConfig.from_dict(values)
    except ConfigError as exc:
        raise ConfigError(f"--replay-monitor: {exc}") from None


def replay_events(rows: Sequence[Mapping[str, Any]], config: SpikeMonitorConfig, where: str) -> list[int]:
    """Steps at which `config`'s monitor raises an event over `rows` (a run's train metrics, one per step).

    MegagateError when the log is not every step: the monitor saw each step, a sparser log cannot stand in for it.
    """
    if not rows:
        return []
    steps = [int(r["step"]) for r in rows]
    if steps != list(range(steps[0], steps[0] + len(steps))):
        gap = next(b for a, b in zip(steps, steps[1:]) if b != a + 1)
        raise MegagateError(
            f"{where}: the log skips steps (at step {gap}; logging.interval > 1?), so the monitor cannot be replayed"
        )
    monitor = SpikeMonitor(config)
    flagged = []
    for row in rows:
        metrics = {m: float(row[m]) for m in config.metrics if row.get(m) is not None}
        if monitor.observe(int(row["step"]), metrics):
            flagged.append(int(row["step"]))
    return flagged
