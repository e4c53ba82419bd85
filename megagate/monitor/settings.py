"""The `monitor` config section, typed: the spike monitor, fault injection and live diagnostics.

    monitor:
      spike: {action: warn|skip|rollback|lr_backoff|abort, threshold: 8, ...}   # SpikeMonitorConfig
      faults: [{step: 30, kind: scale_loss, factor: 10}]                     # Fault (stability tests)
      diagnostics: {interval: 50, sink_epsilon: 0.3, sink_length: 64}     # every N steps on a fixed probe batch
      early_stop: {nonfinite: true, above_start: true, rungs: [[150, 5.4]]}  # EarlyStopConfig: end a decided run

`MonitorConfig.from_dict` refuses unknown keys at every level, and values of the wrong type, with a one-line
ConfigError naming the key and what is allowed, so a typo stops `megagate train --dry-run` before anything is
built. The trainer's callbacks (megagate.train.callbacks) carry the settings out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megagate.errors import ConfigError
from megagate.monitor.early_stop import EarlyStopConfig
from megagate.monitor.faults import Fault
from megagate.monitor.spike import SpikeMonitorConfig
from megagate.sections import as_mapping, refuse_unknown

SECTIONS = ("spike", "faults", "diagnostics", "early_stop")


@dataclass(frozen=True)
class DiagnosticsConfig:
    """Live diagnostics (`monitor.diagnostics`): gate scores, F-Attn, Sink^eps_1, M-Act, max logit on a fixed probe
    batch. The sink's eps and probe length T default to Gu et al.'s 0.3 and 64 (T: the probe's length when shorter;
    an explicit T longer than train.seq_length is refused by megagate.config_rules)."""

    interval: int = 0  # steps between probes (0: off)
    sink_epsilon: float = 0.3
    sink_length: int | None = None  # None: 64, or train.seq_length when shorter
    update_ratio: bool = True  # each layer's update RMS / weight RMS at the probe steps (one weight copy then)

    def __post_init__(self) -> None:
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 0:
            raise ConfigError(f"monitor.diagnostics.interval={self.interval!r} must be a non-negative integer")
        eps = self.sink_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ConfigError(f"monitor.diagnostics.sink_epsilon={eps!r} must be in (0, 1)")
        n = self.sink_length
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"monitor.diagnostics.sink_length={n!r} must be a positive integer (or null: 64)")

    @classmethod
    def from_dict(cls, values: Any) -> DiagnosticsConfig:
        values = as_mapping(values, "monitor.diagnostics")
        refuse_unknown(values, ["interval", "sink_epsilon", "sink_length", "update_ratio"], "monitor.diagnostics")
        if not isinstance(values.get("update_ratio", True), bool):
            raise ConfigError(f"monitor.diagnostics.update_ratio={values['update_ratio']!r} must be true or false")
        return cls(**values)


@dataclass(frozen=True)
class MonitorConfig:
    """The whole `monitor` section."""

    spike: SpikeMonitorConfig = field(default_factory=SpikeMonitorConfig)
    faults: tuple[Fault, ...] = ()
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)

    @classmethod
    def from_dict(cls, section: Any) -> MonitorConfig:
        """The typed section from the config mapping (None or {} gives the defaults: spike monitor in warn mode)."""
        section = as_mapping(section, "monitor")
        refuse_unknown(section, SECTIONS, "monitor")
        faults = section.get("faults")
        if faults is None:
            faults = []
        if not isinstance(faults, (list, tuple)):
            raise ConfigError(f"monitor.faults must be a list of {{step, kind, factor}} mappings, not {faults!r}")
        return cls(
            spike=SpikeMonitorConfig.from_dict(section.get("spike")),
            faults=tuple(Fault.from_dict(item, f"monitor.faults[{i}]") for i, item in enumerate(faults)),
            diagnostics=DiagnosticsConfig.from_dict(section.get("diagnostics")),
            early_stop=EarlyStopConfig.from_dict(section.get("early_stop")),
        )
