"""SpikeScore: the share of steps whose value jumps more than `sigmas` standard deviations above the mean of the
`lookback` values before it — the literature's unit for "how spiky was this run", beside megagate's robust-z events.

Definition implemented (one definition, so scores of different runs and trainers compare):

    a step t is judged once `lookback` earlier finite values exist;
    it is a spike when  x_t > mean(x_{t-lookback} .. x_{t-1}) + sigmas * std(x_{t-lookback} .. x_{t-1})
    (population std), or when x_t is not finite;
    SpikeScore = 100 * spikes / judged steps  (a percentage; over the whole run, or over the last `window` judged).

Unlike megagate's detector (megagate.monitor.spike) every finite value enters the rolling window, spikes included:
the score is a property of the curve, not a decision. The form follows the spike score the OLMo 2 report
(arXiv:2501.00656) and OLMo-core's trainer plot for loss and gradient norm; the defaults (6 sigma above the mean of
the previous 128 values) are the ones megagate's issue 39 names. Check them against the source you compare with
before putting two numbers side by side: the score depends on both parameters.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from megagate.errors import MegagateError

SIGMAS = 6.0
LOOKBACK = 128
WINDOW = 1000  # judged steps the windowed score covers (TensorBoard's `spike_score/<metric>/window`)
STATE_VERSION = 1


class SpikeScore:
    """Rolling SpikeScore of one metric; `observe(value)` once per step, in step order."""

    def __init__(
        self, sigmas: float = SIGMAS, lookback: int = LOOKBACK, window: int = WINDOW, name: str = "metric"
    ) -> None:
        if not (isinstance(sigmas, (int, float)) and math.isfinite(sigmas) and sigmas > 0):
            raise MegagateError(f"spike score sigmas={sigmas!r} must be a positive number")
        for key, value in (("lookback", lookback), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise MegagateError(f"spike score {key}={value!r} must be an integer >= 2")
        self.name = name
        self.sigmas = float(sigmas)
        self.lookback = lookback
        self._previous: deque[float] = deque(maxlen=lookback)
        self._recent: deque[bool] = deque(maxlen=window)  # the flags of the last `window` judged steps
        self.judged = 0
        self.spikes = 0
        self._sum = self._squares = 0.0
        self._since_exact = 0

    def observe(self, value: float) -> bool | None:
        """Judge one step's value: True (a spike), False, or None (fewer than `lookback` values before it).

        The window's mean and std come from running sums (O(1) a step: this runs on every step of every run),
        recomputed exactly every `lookback` values so that rounding cannot accumulate."""
        value = float(value)
        flag = None
        window = self._previous
        if len(window) == window.maxlen:
            n = len(window)
            mean = self._sum / n
            std = math.sqrt(max(self._squares / n - mean * mean, 0.0))
            flag = not math.isfinite(value) or value > mean + self.sigmas * std
            self.judged += 1
            self.spikes += flag
            self._recent.append(flag)
        if math.isfinite(value):
            if len(window) == window.maxlen:
                old = window[0]
                self._sum -= old
                self._squares -= old * old
            window.append(value)
            self._sum += value
            self._squares += value * value
            self._since_exact += 1
            if self._since_exact >= window.maxlen:
                self._exact_sums()
        return flag

    def _exact_sums(self) -> None:
        self._sum = math.fsum(self._previous)
        self._squares = math.fsum(x * x for x in self._previous)
        self._since_exact = 0

    def score(self) -> float:
        """Percentage of judged steps that spiked over the whole run (NaN before any step was judged)."""
        return 100.0 * self.spikes / self.judged if self.judged else math.nan

    def window_score(self) -> float:
        """Percentage over the last `window` judged steps (NaN before any)."""
        return 100.0 * sum(self._recent) / len(self._recent) if self._recent else math.nan

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "previous": list(self._previous),
            "recent": [int(f) for f in self._recent],
            "judged": self.judged,
            "spikes": self.spikes,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise MegagateError(f"spike score state version {state.get('version')!r} is not {STATE_VERSION}")
        self._previous = deque((float(v) for v in state["previous"]), maxlen=self._previous.maxlen)
        self._recent = deque((bool(f) for f in state["recent"]), maxlen=self._recent.maxlen)
        self.judged, self.spikes = int(state["judged"]), int(state["spikes"])
        self._exact_sums()


class SpikeScores:
    """One SpikeScore per metric (the spike monitor's loss and grad_norm)."""

    def __init__(self, metrics: Sequence[str], **settings: Any) -> None:
        self.scores = {m: SpikeScore(name=m, **settings) for m in metrics}

    def observe(self, values: Mapping[str, float]) -> None:
        for metric, score in self.scores.items():
            if metric in values:
                score.observe(values[metric])

    def scalars(self) -> dict[str, float]:
        """TensorBoard tags -> values: `spike_score/<metric>` (whole run) and `spike_score/<metric>/window`."""
        out: dict[str, float] = {}
        for metric, score in self.scores.items():
            if score.judged:
                out[f"spike_score/{metric}"] = score.score()
                out[f"spike_score/{metric}/window"] = score.window_score()
        return out

    def summary(self) -> dict[str, Any]:
        """The summary.json entry: per metric the whole-run percentage, spikes and judged steps, and the definition."""
        first = next(iter(self.scores.values()), None)
        return {
            "definition": (
                f"percent of steps > mean + {first.sigmas:g} std of the previous {first.lookback}" if first else ""
            ),
            **{
                m: {"percent": s.score() if s.judged else None, "spikes": s.spikes, "judged": s.judged}
                for m, s in self.scores.items()
            },
        }

    def state_dict(self) -> dict[str, Any]:
        return {m: s.state_dict() for m, s in self.scores.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for metric, score in self.scores.items():
            if metric in state:
                score.load_state_dict(state[metric])
