"""Spike-event sink: one JSONL line per event (runfiles.EVENTS) and, optionally, its TensorBoard metrics."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from megagate.monitor import runfiles
from megagate.monitor.spike import ACTIONS, SEVERITY, SpikeEvent


class EventLog:
    """Writes spike events; call `write(events)` on the rank that logs (all ranks see the same events)."""

    def __init__(self, path: str | os.PathLike, record: Callable[[int, dict[str, Any]], None] | None = None) -> None:
        """`path`: the events JSONL file; `record(step, metrics)`: where the TensorBoard metrics of an event go (the
        trainer's `record_metric`; None: nowhere)."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.record = record

    def write(self, events: Iterable[SpikeEvent], samples: Mapping[int, tuple[int, int]] | None = None) -> None:
        """`samples`: step -> [first, end) global sample positions of its batch, written as the event's "samples"
        (the ids of the samples in the spiking batch)."""
        for event in events:
            record = event.to_dict()
            if samples is not None and event.step in samples:
                record["samples"] = list(samples[event.step])
            runfiles.append_jsonl(self.path, record)
            if self.record is not None:
                self.record(event.step, metrics(event))

    def read(self) -> list[dict[str, Any]]:
        return runfiles.read_jsonl(self.path)


def metrics(event: SpikeEvent) -> dict[str, Any]:
    """The event's TensorBoard metrics: one scalar series per metric, the spiking value (clamped to something
    plottable) and the action code, so spikes show up as points on the same step axis as the loss curve."""
    step, m = event.step, event.metric
    out: dict[str, Any] = {f"spike/{m}/value": event.value if _finite(event.value) else float("nan")}
    if event.baseline is not None:
        out[f"spike/{m}/baseline"] = event.baseline
    if event.score is not None:
        out[f"spike/{m}/score"] = event.score if _finite(event.score) else 1e9
    out[f"spike/{m}/action"] = float(SEVERITY[event.action])
    out["spike/events"] = f"step {step}: {m}={event.value:g} ({event.reason}) -> {event.action}"
    return out


def _finite(x: float) -> bool:
    return x == x and x not in (float("inf"), float("-inf"))


ACTION_CODES = {a: SEVERITY[a] for a in ACTIONS}  # the TensorBoard 'spike/<metric>/action' values
