"""The Trainer's callbacks: the interface (`Callback`) and the built-in ones `megagate train` runs.

base.py      Callback: the hooks and their order
metrics.py   MetricsLogger (config.yaml, metrics.jsonl, TensorBoard, console), RunSummary (summary.json)
cadence.py   StopChecks (signals, wall time, exit_after_steps), Evaluation, Checkpointing
monitor.py   FaultInjection, SpikeMonitoring (skip / rollback / lr_backoff / abort), LiveDiagnostics
early_stop.py EarlyStopping (monitor.early_stop: end a decided run with its reason)
profiling.py ManualGC, Profiling (the perf section: perf.manual_gc_interval, perf.profile)
router.py    RouterHealth (MoE models: tokens per expert, dead experts, router entropy)
health.py    StragglerReport (the straggler section; the hang watchdog runs beside the trainer: megagate.health)
"""

from __future__ import annotations

from megagate.run_setup import RunSetup
from megagate.train.callbacks.base import Callback
from megagate.train.callbacks.cadence import Checkpointing, Evaluation, StopChecks, evaluate
from megagate.train.callbacks.early_stop import EarlyStopping
from megagate.train.callbacks.health import StragglerReport
from megagate.train.callbacks.metrics import MetricsLogger, RunSummary
from megagate.train.callbacks.monitor import FaultInjection, LiveDiagnostics, SpikeMonitoring
from megagate.train.callbacks.profiling import ManualGC, Profiling, perf_callbacks
from megagate.train.callbacks.router import RouterHealth


def default_callbacks(setup: RunSetup) -> list[Callback]:
    """The callbacks of `megagate train` for a run set-up. Their order is each class's `priority` (the trainer sorts):
    StopChecks 100, MetricsLogger 90, FaultInjection 80, SpikeMonitoring 70, EarlyStopping 65, LiveDiagnostics 60,
    RouterHealth 57 (MoE models), StragglerReport 55, ManualGC 50, Profiling 40, Evaluation 30, Checkpointing 20,
    RunSummary 10; each class says why in its docstring."""
    cfg = setup.cfg
    m = cfg.monitor
    callbacks: list[Callback] = [StopChecks(), MetricsLogger()]
    if m.faults:
        callbacks.append(FaultInjection(m.faults, cfg.output.dir))
    if m.spike.enabled:
        callbacks.append(SpikeMonitoring(m.spike, flag_steps=m.early_stop.enabled))
    if m.early_stop.enabled:  # after the spike monitor: it counts that step's loss spikes
        callbacks.append(EarlyStopping(m.early_stop, cfg.train.warmup_steps))
    if m.diagnostics.interval:
        d = m.diagnostics
        callbacks.append(LiveDiagnostics(d.interval, d.sink_epsilon, d.sink_length, d.update_ratio))
    if cfg.model.is_moe:
        callbacks.append(RouterHealth())
    if cfg.straggler.enabled:
        callbacks.append(StragglerReport(cfg.straggler))
    return callbacks + perf_callbacks(setup) + [Evaluation(), Checkpointing(), RunSummary()]


__all__ = [
    "Callback",
    "Checkpointing",
    "EarlyStopping",
    "Evaluation",
    "FaultInjection",
    "LiveDiagnostics",
    "ManualGC",
    "MetricsLogger",
    "Profiling",
    "RouterHealth",
    "RunSummary",
    "SpikeMonitoring",
    "StopChecks",
    "StragglerReport",
    "default_callbacks",
    "evaluate",
]
