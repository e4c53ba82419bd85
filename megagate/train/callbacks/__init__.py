"""The Trainer's callbacks: the interface (`Callback`) and the built-in ones `megagate train` runs.

base.py      Callback: the hooks and their order
metrics.py   MetricsLogger (config.yaml, metrics.jsonl, TensorBoard, console), RunSummary (summary.json)
cadence.py   StopChecks (signals, wall time, exit_after_steps), Evaluation, Checkpointing
monitor.py   FaultInjection, SpikeMonitoring (skip / rollback / lr_backoff / abort), LiveDiagnostics
early_stop.py EarlyStopping (monitor.early_stop: end a decided run with its reason)
perf.py      ManualGC, Profiling (the perf section: perf.manual_gc_interval, perf.profile)
"""

from __future__ import annotations

from megagate.config import TrainConfig
from megagate.train.callbacks.base import Callback
from megagate.train.callbacks.cadence import Checkpointing, Evaluation, StopChecks, evaluate
from megagate.train.callbacks.early_stop import EarlyStopping
from megagate.train.callbacks.metrics import MetricsLogger, RunSummary
from megagate.train.callbacks.monitor import FaultInjection, LiveDiagnostics, SpikeMonitoring
from megagate.train.callbacks.perf import ManualGC, Profiling, perf_callbacks


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
        callbacks.append(FaultInjection(m.faults))
    if m.spike.enabled:
        callbacks.append(SpikeMonitoring(m.spike))
    if m.early_stop.enabled:  # after the spike monitor: it counts that step's loss spikes
        callbacks.append(EarlyStopping(m.early_stop, cfg.train.warmup_steps))
    if m.diagnostics.interval:
        callbacks.append(LiveDiagnostics(m.diagnostics.interval))
    # the profiler's step ranges wrap only the step (before evaluation and checkpointing, which are not profiled)
    return callbacks + perf_callbacks(cfg) + [Evaluation(), Checkpointing(), RunSummary()]


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
    "RunSummary",
    "SpikeMonitoring",
    "StopChecks",
    "default_callbacks",
    "evaluate",
]
