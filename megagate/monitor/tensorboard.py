"""The one writer of recorded metrics to TensorBoard: numbers as scalars, text as text, `Histogram`s as raw
histograms. Callbacks record metrics through the trainer (`record_metric`); only the metrics logger holds a
`SummaryWriter` and calls `write`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Histogram:
    """A histogram already binned (`SummaryWriter.add_histogram_raw`'s arguments but the tag and step)."""

    min: float
    max: float
    num: int
    sum: float
    sum_squares: float
    bucket_limits: list[float]  # the bins' right edges
    bucket_counts: list[int]


Metric = float | str | Histogram


def write(writer: Any, step: int, metrics: Mapping[str, Metric]) -> None:
    """Every metric of `step` to the SummaryWriter `writer`."""
    for name, value in metrics.items():
        if isinstance(value, Histogram):
            writer.add_histogram_raw(name, **asdict(value), global_step=step)
        elif isinstance(value, str):
            writer.add_text(name, value, step)
        else:
            writer.add_scalar(name, value, step)
