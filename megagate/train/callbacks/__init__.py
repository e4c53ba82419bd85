"""The Trainer's callbacks: the interface (`Callback`) and the built-in ones `megagate train` runs.

base.py      Callback: the hooks and their order
metrics.py   MetricsLogger (config.yaml, metrics.jsonl, TensorBoard, console), RunSummary (summary.json)
cadence.py   StopChecks (signals, wall time, exit_after_steps), Evaluation, Checkpointing
monitor.py   FaultInjection, SpikeMonitoring (skip / rollback / lr_backoff / abort), LiveDiagnostics
profiling.py ManualGC, Profiling (the perf section: perf.manual_gc_interval, perf.profile)
health.py    StragglerReport (the straggler section; the hang watchdog runs beside the trainer: megagate.health)
"""

from __future__ import annotations

from megagate.run_config import TrainConfig
from megagate.train.callbacks.base import Callback
from megagate.train.callbacks.cadence import Checkpointing, Evaluation, StopChecks, evaluate
from megagate.train.callbacks.health import StragglerReport
from megagate.train.callbacks.metrics import MetricsLogger, RunSummary
from megagate.train.callbacks.monitor import FaultInjection, LiveDiagnostics, SpikeMonitoring
from megagate.train.callbacks.profiling import ManualGC, Profiling, perf_callbacks


def default_callbacks(cfg: TrainConfig) -> list[Callback]:
    """The callbacks of `megagate train`, in the order that matters:

    metrics before everything that logs through its writer; faults before the spike monitor (it judges the
    faulted loss; LR factors multiply in this order); evaluation before checkpointing (a checkpoint holds the state
    after an evaluation of the same step: the validation loader draws from the RNG) — except at the end, where
    Evaluation has the final checkpoint saved first, so a failing final validation loses nothing; the summary last
    (it reports the final validation).
    """
    m = cfg.monitor
    callbacks: list[Callback] = [StopChecks(), MetricsLogger()]
    if m.faults:
        callbacks.append(FaultInjection(m.faults, cfg.output.dir))
    if m.spike.enabled:
        callbacks.append(SpikeMonitoring(m.spike))
    if m.diagnostics.interval:
        callbacks.append(LiveDiagnostics(m.diagnostics.interval))
    if cfg.straggler.enabled:
        callbacks.append(StragglerReport(cfg.straggler))
    # the profiler's step ranges wrap only the step (before evaluation and checkpointing, which are not profiled)
    return callbacks + perf_callbacks(cfg) + [Evaluation(), Checkpointing(), RunSummary()]


__all__ = [
    "Callback",
    "Checkpointing",
    "Evaluation",
    "FaultInjection",
    "LiveDiagnostics",
    "ManualGC",
    "MetricsLogger",
    "Profiling",
    "RunSummary",
    "SpikeMonitoring",
    "StopChecks",
    "StragglerReport",
    "default_callbacks",
    "evaluate",
]
