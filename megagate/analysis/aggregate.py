"""What a multi-seed stability report needs beyond one run: run identity, curve spikes, and seed aggregation.

Run identity. A run belongs to a *sweep*, the nearest folder above its run directory holding `sweep.json` (written by
`megagate sweep`), else its parent folder; and to a *setting*, the config keys whose values differ between the runs
being reported, except the sweep grid's own keys (GRID_KEYS: learning rate, seed, gate, output folder), e.g.
`model.qk_layernorm=false`. Runs of different sweeps or settings are never averaged together.

Curve spikes (`curve_spikes`): an offline judgement of "a natural loss spike" from the logged training curve alone.
A logged loss is *above* when it exceeds the median of the previous `window` accepted logged losses by more than
max(k · σ, δ) nats, σ = 1.4826 · MAD of those losses (the MAD's normal-equivalent standard deviation). Defaults:
window 20, k 6, δ 0.3 nats, at least 5 accepted losses before anything is judged (high-LR runs spike in the warm-up;
a history of 10 would not see the 7.4 -> 10.9 jump at logged steps 6-8 of the CPU science runs at LR 1). A run of
consecutive above points is ONE spike (its first step is the spike's step); above points are not accepted into the
history, so a spike does not raise its own baseline and a loss that jumps and stays up is one spike to the end. A
non-finite loss is always above: a diverged run's NaN/Inf tail counts once. δ is the floor that keeps a flat,
low-noise curve from turning batch noise into spikes: the logged losses of clean CPU runs (8-16 x 128 tokens per
step) move by ~0.05-0.15 nats between logged steps, and 0.3 nats above the recent median is a jump one sees on the
plot. On the first CPU science runs (LR 1e-2..1, 300 steps) these defaults flag the LR-1 warm-up jumps and one
+1.0 nat blip, and nothing on the runs at LR <= 0.1.

Monitor vs curve (`match_events`): the spike monitor's events (events.jsonl, any metric: a grad-norm event with a
flat loss is a false positive against the loss curve) against the curve spikes.
A curve spike is a true positive when an event lies within ±tolerance steps of it (of its first..last above step),
else a miss; events near no curve spike are false positives, counted as clusters (events less than tolerance steps
apart are one detection: the monitor may fire on several consecutive steps of one blip). The tolerance should be at
least the logging interval (the curve only has the logged steps); the report uses max(tolerance, logging.interval).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megagate.errors import MegagateError
from megagate.monitor.runfiles import read_json

SWEEP_FILE = "sweep.json"
# the grid's own keys: they define the groups' variant / lr / seed (or are per run), never their setting
GRID_KEYS = ("train.lr", "seed", "output.dir")
MAD_TO_SIGMA = 1.4826
UNSET = "unset"


# --- run identity ------------------------------------------------------------------------------------------------
def find_sweep_dir(run_dir: str | Path) -> Path | None:
    """The nearest folder above `run_dir` that holds sweep.json (None if none does)."""
    for parent in Path(run_dir).resolve().parents:
        if (parent / SWEEP_FILE).is_file():
            return parent
    return None


def sweep_labels(dirs: Iterable[Path]) -> dict[Path, str]:
    """A short unique label per sweep folder: its name, or as many trailing path parts as tell them apart."""
    dirs = sorted(set(dirs))
    labels: dict[Path, str] = {}
    for d in dirs:
        for depth in range(1, len(d.parts) + 1):
            label = "/".join(d.parts[-depth:])
            if sum(1 for other in dirs if "/".join(other.parts[-depth:]) == label) == 1:
                break
        labels[d] = label
    return labels


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> leaf value of a nested mapping (lists stay values)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def is_grid_key(key: str) -> bool:
    # monitor.early_stop: a frontier trial's rungs come from the trials before it, not from the setting
    return key in GRID_KEYS or key.startswith(("model.gate", "monitor.early_stop"))


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return str(value)


def settings(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per config, the label of what distinguishes it: `key=value` for every non-grid key whose value differs
    between the configs (a key absent from a config shows as `key=unset`), comma-joined in key order; '-' if none."""
    flats = [flatten(c) for c in configs]
    keys = sorted({k for f in flats for k in f if not is_grid_key(k)})
    differing = [k for k in keys if len({_shown(f[k]) if k in f else UNSET for f in flats}) > 1]
    return [",".join(f"{k}={_shown(f[k]) if k in f else UNSET}" for k in differing) or "-" for f in flats]


def identify(results: Sequence[Any]) -> None:
    """Set each run's sweep label (sweep.json folder, else the parent folder; unique short names) and setting
    (settings over all the runs reported)."""
    dirs = {id(r): Path(r.sweep_dir) if r.sweep_dir else Path(r.run_dir).resolve().parent for r in results}
    labels = sweep_labels(dirs.values())
    for r, setting in zip(results, settings([r.config for r in results])):
        r.sweep, r.setting = labels[dirs[id(r)]], setting


# --- curve spikes ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpikeRule:
    """The curve-spike judgement's parameters (module docstring)."""

    window: int = 20
    min_history: int = 5
    k: float = 6.0
    delta: float = 0.3

    def __post_init__(self) -> None:
        if not (1 <= self.min_history <= self.window):
            raise MegagateError(f"curve spike min_history {self.min_history} must be in 1..window ({self.window})")
        if not (math.isfinite(self.k) and self.k >= 0):
            raise MegagateError(f"curve spike k {self.k} must be a finite number >= 0 (robust standard deviations)")
        if not (math.isfinite(self.delta) and self.delta > 0):
            raise MegagateError(f"curve spike delta {self.delta} must be a finite number > 0 (nats)")


@dataclass(frozen=True)
class CurveSpike:
    """One spike of a training curve: first and last above step, the largest excess over the median (inf when a
    loss was non-finite), and whether it ends the curve non-finite."""

    step: int
    last_step: int
    excess: float
    nonfinite: bool


def curve_spikes(curve: Sequence[tuple[int, float]], rule: SpikeRule = SpikeRule()) -> list[CurveSpike]:
    """The spikes of a logged training curve [(step, loss)] in step order (module docstring for the rule)."""
    history: list[float] = []
    spikes: list[CurveSpike] = []
    open_: dict[str, Any] | None = None  # the spike being extended: first/last step, excess, non-finite

    def close() -> None:
        nonlocal open_
        if open_ is not None:
            spikes.append(CurveSpike(open_["step"], open_["last"], open_["excess"], open_["nonfinite"]))
            open_ = None

    for step, loss in curve:
        if math.isfinite(loss) and len(history) < rule.min_history:
            history.append(loss)
            continue
        if math.isfinite(loss):
            ref = history[-rule.window :]
            center = statistics.median(ref)
            sigma = MAD_TO_SIGMA * statistics.median(abs(x - center) for x in ref)
            excess = loss - center
            above = excess > max(rule.k * sigma, rule.delta)
        else:
            excess, above = math.inf, True
        if not above:
            close()
            history.append(loss)
            continue
        if open_ is None:
            open_ = {"step": step, "last": step, "excess": excess, "nonfinite": False}
        open_["last"], open_["excess"] = step, max(open_["excess"], excess)
        open_["nonfinite"] = not math.isfinite(loss)  # a spike that recovers to a finite loss is not a NaN tail
    close()
    return spikes


@dataclass(frozen=True)
class SpikeMatch:
    """Curve spikes against the monitor's event steps: true positives, misses, false-positive clusters."""

    tp: int
    misses: int
    fp: int
    detected: tuple[bool, ...]  # per curve spike
    false_events: tuple[int, ...]  # the first event step of each false-positive cluster


def match_events(spikes: Sequence[CurveSpike], event_steps: Iterable[int], tolerance: int) -> SpikeMatch:
    """Match monitor events to curve spikes within ±`tolerance` steps (module docstring)."""
    if tolerance < 0:
        raise MegagateError(f"spike tolerance {tolerance} must be >= 0 steps")
    events = sorted(set(event_steps))
    detected = tuple(any(s.step - tolerance <= e <= s.last_step + tolerance for e in events) for s in spikes)
    unmatched = [e for e in events if not any(s.step - tolerance <= e <= s.last_step + tolerance for s in spikes)]
    clusters: list[int] = []
    previous = None
    for e in unmatched:
        if previous is None or e - previous > tolerance:
            clusters.append(e)
        previous = e
    tp = sum(detected)
    return SpikeMatch(tp, len(spikes) - tp, len(clusters), detected, tuple(clusters))


DEFAULT_RULE = SpikeRule()
DEFAULT_TOLERANCE = 10  # steps; the report uses max(this, the run's logging.interval)


# --- seed aggregation --------------------------------------------------------------------------------------------
def mean_std(values: Iterable[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n-1) of the finite values; (None, None) if none, std None for one."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


@dataclass
class Group:
    """The runs of one (sweep, setting, variant, lr), aggregated over seeds. Loss means and stds are over the runs
    that did not diverge; diagnostics (last probe) are means over the runs that have them."""

    sweep: str
    setting: str
    variant: str
    lr: float | None
    runs: list[str]
    seeds: list[int | None]
    n: int
    final_loss_mean: float | None
    final_loss_std: float | None
    valid_loss_mean: float | None
    valid_loss_std: float | None
    diverged: int
    runs_with_events: int
    events: int
    curve_spikes: int
    tp: int
    fp: int
    misses: int
    f_attn: float | None
    m_act: float | None
    gate_score: float | None
    sink_1: float | None = None  # Gu et al.'s Sink^eps_1, mean over the runs
    spike_score: float | None = None  # the loss's SpikeScore (percent), mean over the runs

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def group_runs(results: Sequence[Any]) -> list[Group]:
    """Aggregate report.RunResult-like objects by (sweep, setting, variant, lr), in that sort order."""
    buckets: dict[tuple, list[Any]] = {}
    for r in results:
        buckets.setdefault((r.sweep, r.setting, r.variant, r.lr), []).append(r)
    groups = []
    for (sweep, setting, variant, lr), runs in sorted(
        buckets.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], math.inf if kv[0][3] is None else kv[0][3])
    ):
        runs = sorted(runs, key=lambda r: (r.seed is None, r.seed or 0, r.name))
        ok = [r for r in runs if not r.diverged]
        loss_mean, loss_std = mean_std(r.final_loss for r in ok)
        valid_mean, valid_std = mean_std(r.valid_loss for r in ok)
        groups.append(
            Group(
                sweep=sweep,
                setting=setting,
                variant=variant,
                lr=lr,
                runs=[r.name for r in runs],
                seeds=[r.seed for r in runs],
                n=len(runs),
                final_loss_mean=loss_mean,
                final_loss_std=loss_std,
                valid_loss_mean=valid_mean,
                valid_loss_std=valid_std,
                diverged=sum(r.diverged for r in runs),
                runs_with_events=sum(1 for r in runs if r.num_spikes),
                events=sum(r.num_spikes for r in runs),
                curve_spikes=sum(len(r.curve_spikes) for r in runs),
                tp=sum(r.spike_match.tp for r in runs),
                fp=sum(r.spike_match.fp for r in runs),
                misses=sum(r.spike_match.misses for r in runs),
                f_attn=mean_std(r.f_attn for r in runs)[0],
                m_act=mean_std(r.m_act for r in runs)[0],
                gate_score=mean_std(r.gate_score for r in runs)[0],
                sink_1=mean_std(r.sink_1 for r in runs)[0],
                spike_score=mean_std(r.spike_score for r in runs)[0],
            )
        )
    return groups


def uniform_f_attn(length: int) -> float:
    """F-Attn of uniform causal attention over a probe of `length` tokens: the mean over query positions i >= 1 of
    1/(i+1), i.e. (H_L - 1) / (L - 1) with H_L the L-th harmonic number (0.0349 at L = 128)."""
    if length < 2:
        raise ValueError(f"probe length {length} must be >= 2")
    return (sum(1.0 / i for i in range(1, length + 1)) - 1.0) / (length - 1)


def sink_summary(probes: Sequence[Mapping[str, Any]], length: int | None) -> dict[str, Any] | None:
    """Where the attention sink appears over training, from the live diagnostics: the uniform reference for the
    probe length, the first probe step whose F-Attn (mean over layers) exceeds it and the one whose largest
    single-layer F-Attn does (None: never), and the whole trajectory (step, F-Attn, max layer, M-Act, gate score,
    gate sparsity)."""
    if not probes or not length or length < 2:
        return None
    uniform = uniform_f_attn(length)

    def first(key: str) -> int | None:
        return next((int(p["step"]) for p in probes if p.get(key) is not None and p[key] > uniform), None)

    return {
        "uniform_f_attn": uniform,
        "first_step_mean_above_uniform": first("f_attn"),
        "first_step_any_layer_above_uniform": first("f_attn_max_layer"),
        "probes": [dict(p) for p in probes],
    }


def record(results: Sequence[Any], groups: Sequence[Group], rule: SpikeRule, tolerance: int) -> dict[str, Any]:
    """json: the definitions used, the sweeps (with their sweep.json), the groups and the runs."""
    sweeps: dict[str, Any] = {}
    for r in results:
        if r.sweep not in sweeps:
            info = read_json(Path(r.sweep_dir) / SWEEP_FILE) if r.sweep_dir else None
            sweeps[r.sweep] = {"dir": r.sweep_dir or str(Path(r.run_dir).resolve().parent), "sweep_json": info}
    lengths = sorted({r.seq_length for r in results if r.seq_length and r.seq_length > 1})
    return {
        "definitions": {
            "std": "sample standard deviation (n-1) over the runs that did not diverge; null for one run",
            "curve_spike": asdict(rule),
            "spike_tolerance_steps": f"max({tolerance}, logging.interval)",
            "diagnostics": "last probe; F-Attn and gate score mean over layers, M-Act max over layers; mean over runs",
            "uniform_f_attn": {str(n): uniform_f_attn(n) for n in lengths},
        },
        "sweeps": sweeps,
        "groups": [g.as_dict() for g in groups],
        "runs": [
            {
                "name": r.name,
                "run_dir": r.run_dir,
                "sweep": r.sweep,
                "setting": r.setting,
                "variant": r.variant,
                "lr": r.lr,
                "seed": r.seed,
                "steps": r.steps,
                "final_loss": r.final_loss,
                "valid_loss": r.valid_loss,
                "diverged": r.diverged,
                "event_steps": r.spike_steps,
                "curve_spikes": [asdict(s) for s in r.curve_spikes],
                "tp": r.spike_match.tp,
                "fp": r.spike_match.fp,
                "misses": r.spike_match.misses,
                "false_event_steps": list(r.spike_match.false_events),
                "f_attn": r.f_attn,
                "m_act": r.m_act,
                "gate_score": r.gate_score,
                "sink_1": r.sink_1,
                "spike_score": r.spike_score,
                "sink": sink_summary(r.diagnostics, r.seq_length),
            }
            for r in results
        ],
    }
