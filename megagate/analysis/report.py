"""`megagate report RUNS...`: aggregate run directories into tables, aggregate.json and PNG plots.

Per-run table: run, variant, lr, seed, steps, final loss, validation ppl, spikes (monitor events), diverged, F-Attn,
M-Act, gate score (the diagnostics of the last probe: F-Attn and gate score averaged over layers, M-Act the maximum
over layers), curve spikes (megagate.analysis.aggregate's offline judgement) with the monitor's tp/fp/miss against
them, and what identifies the run: its sweep (the folder with sweep.json above it, else its parent folder) and its
setting (the non-grid config keys that differ between the reported runs).
Per-group table (and aggregate.json): the runs of one (sweep, setting, variant, lr) aggregated over seeds.
Plots: megagate.analysis.report_plots.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megagate.analysis import aggregate, precursors, report_plots
from megagate.analysis.health_report import health_section
from megagate.analysis.replay import replay_events
from megagate.console import cell
from megagate.console import table as render_table
from megagate.errors import MegagateError
from megagate.files import write_atomic
from megagate.monitor import runfiles
from megagate.monitor.spike import SpikeMonitorConfig


@dataclass
class RunResult:
    name: str
    run_dir: str
    variant: str
    lr: float | None
    seed: int | None
    steps: int
    final_loss: float
    valid_ppl: float | None
    num_spikes: int
    diverged: bool
    f_attn: float | None = None
    m_act: float | None = None
    gate_score: float | None = None
    sink_1: float | None = None  # Gu et al.'s Sink^eps_1 at the last probe (mean over layers; None: not logged)
    spike_score: float | None = None  # SpikeScore of the loss, percent (summary.json; None: not recorded)
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, train loss)
    spike_steps: list[int] = field(default_factory=list)
    valid_loss: float | None = None
    config: dict[str, Any] = field(default_factory=dict)
    seq_length: int | None = None
    logging_interval: int = 1
    # per probe step: {"step", "f_attn" (mean over layers), "m_act" (max), "gate_score" (mean, None without a gate)}
    diagnostics: list[dict[str, Any]] = field(default_factory=list)
    sweep_dir: str | None = None  # the folder with sweep.json above the run (None: no sweep.json found)
    sweep: str = ""  # the sweep's label (set by `identify`)
    setting: str = "-"  # what distinguishes the run's config from the others reported (set by `identify`)
    curve_spikes: list[aggregate.CurveSpike] = field(default_factory=list)
    spike_match: aggregate.SpikeMatch = aggregate.SpikeMatch(0, 0, 0, (), ())

    @property
    def label(self) -> str:
        return f"{self.sweep}/{self.name}" if self.sweep else self.name


def load_run(
    run_dir: str | Path,
    rule: aggregate.SpikeRule = aggregate.DEFAULT_RULE,
    tolerance: int = aggregate.DEFAULT_TOLERANCE,
    replay: SpikeMonitorConfig | None = None,
) -> RunResult:
    """Read one run directory (runfiles schema); missing optional files leave their columns empty.

    The curve spikes are judged by `rule` and matched with the monitor's events within max(`tolerance`, the run's
    logging.interval) steps. `sweep` and `setting` need all runs of a report: `identify` sets them. With `replay`,
    the monitor's events are those of a monitor with these settings replayed over the logged curve (not events.jsonl).
    """
    run_dir = Path(run_dir)
    config = runfiles.read_config(run_dir)
    metrics = runfiles.read_jsonl(run_dir / runfiles.METRICS)
    train = [r for r in runfiles.train_metrics(metrics) if "loss" in r]
    valid = runfiles.valid_metrics(metrics)
    summary = runfiles.read_json(run_dir / runfiles.SUMMARY) or {}
    events = runfiles.read_jsonl(run_dir / runfiles.EVENTS)
    if not train and not summary:
        raise MegagateError(
            f"{run_dir}: no {runfiles.METRICS} train lines and no {runfiles.SUMMARY}: not a run directory"
        )
    metrics_path, summary_path = run_dir / runfiles.METRICS, run_dir / runfiles.SUMMARY
    curve = [
        (_number(r.get("step"), int, metrics_path, "step"), _number(r["loss"], float, metrics_path, "loss"))
        for r in train
    ]
    if "final_loss" in summary:
        final_loss = _number(summary["final_loss"], float, summary_path, "final_loss")
    else:
        final_loss = curve[-1][1] if curve else math.nan
    if "steps" in summary:
        _number(summary["steps"], int, summary_path, "steps")
    if "diverged" in summary:
        diverged = bool(summary["diverged"])
    else:  # a run without a summary (crashed or still running): judge from its curve
        losses = [loss for _, loss in curve]
        diverged = runfiles.is_diverged(
            losses[0] if losses else None, final_loss, any_nonfinite=any(not math.isfinite(x) for x in losses)
        )
    valid_ppl = valid_loss = None
    if summary.get("final_valid_loss") is not None:
        valid_loss = _number(summary["final_valid_loss"], float, summary_path, "final_valid_loss")
    elif valid and valid[-1].get("loss") is not None:
        valid_loss = _number(valid[-1]["loss"], float, metrics_path, "valid loss")
    if valid:
        last = valid[-1]
        key = "ppl" if "ppl" in last else "loss"
        value = _number(last.get(key), float, metrics_path, f"valid {key}")
        valid_ppl = value if key == "ppl" else math.exp(min(value, 709.0))  # exp overflows past 709
    if replay is None:
        spike_steps = {_number(e.get("step"), int, run_dir / runfiles.EVENTS, "step") for e in events}
    else:
        spike_steps = set(replay_events(train, replay, str(metrics_path)))
    result = RunResult(
        name=run_dir.name,
        run_dir=str(run_dir),
        variant=runfiles.gate_label(config),
        lr=_float(runfiles.lookup(config, "train.lr")),
        seed=_int(runfiles.lookup(config, "seed")),
        steps=int(summary.get("steps", curve[-1][0] if curve else 0)),
        final_loss=final_loss,
        valid_ppl=valid_ppl,
        num_spikes=len(spike_steps),
        diverged=diverged,
        curve=curve,
        spike_steps=sorted(spike_steps),
        valid_loss=valid_loss,
        config=config,
        seq_length=_int(runfiles.lookup(config, "train.seq_length")),
        logging_interval=_int(runfiles.lookup(config, "logging.interval")) or 1,
    )
    sweep_dir = aggregate.find_sweep_dir(run_dir)
    result.sweep_dir = None if sweep_dir is None else str(sweep_dir)
    result.diagnostics = _probe_steps(run_dir / runfiles.DIAGNOSTICS)
    if result.diagnostics:
        last = result.diagnostics[-1]
        result.f_attn, result.m_act, result.gate_score = last["f_attn"], last["m_act"], last["gate_score"]
        result.sink_1 = last["sink_1"]
    score = (summary.get("spike_score") or {}).get("loss") or {}
    if score.get("percent") is not None:
        result.spike_score = _number(score["percent"], float, summary_path, "spike_score.loss.percent")
    result.curve_spikes = aggregate.curve_spikes(curve, rule)
    result.spike_match = aggregate.match_events(
        result.curve_spikes, result.spike_steps, max(tolerance, result.logging_interval)
    )
    return result


def _probe_steps(path: Path) -> list[dict[str, Any]]:
    """diagnostics.jsonl reduced over layers per probe step, in step order: F-Attn and gate score the mean over
    layers, M-Act the maximum."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for d in runfiles.read_jsonl(path):
        by_step.setdefault(_number(d.get("step"), int, path, "step"), []).append(d)
    probes = []
    for step, layers in sorted(by_step.items()):
        gates = [
            _number(d["gate_score_mean"], float, path, "gate_score_mean")
            for d in layers
            if d.get("gate_score_mean") is not None
        ]
        f_attn = [_number(d.get("f_attn"), float, path, "f_attn") for d in layers]
        sparsity = [float(d["gate_sparsity"]) for d in layers if d.get("gate_sparsity") is not None]
        sinks = [_number(d["sink"], float, path, "sink") for d in layers if d.get("sink") is not None]
        probes.append(
            {
                "step": step,
                "f_attn": statistics.fmean(f_attn),
                "f_attn_max_layer": max(f_attn),  # the paper's single-layer sink (one baseline layer: 83 %)
                "m_act": max(_number(d.get("m_act"), float, path, "m_act") for d in layers),
                "gate_score": statistics.fmean(gates) if gates else None,
                "gate_sparsity": statistics.fmean(sparsity) if sparsity else None,
                # Gu et al.'s Sink^eps_1: the mean over layers (each layer has the same heads and samples)
                "sink_1": statistics.fmean(sinks) if len(sinks) == len(layers) else None,
            }
        )
    return probes


def _number(value: Any, kind: type, path: Path, key: str) -> Any:
    """`value` as an int or float, or a one-line MegagateError naming the file, the key and the value."""
    whole = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer())
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not whole):
        shown = "missing" if value is None else repr(value)
        raise MegagateError(f"{path}: {key} {shown} is not {'an integer' if kind is int else 'a number'}")
    return kind(value)


def _float(x: Any) -> float | None:
    try:
        return None if x is None else float(x)
    except (TypeError, ValueError):
        return None


def _int(x: Any) -> int | None:
    try:
        return None if x is None else int(x)
    except (TypeError, ValueError):
        return None


def find_runs(paths: Sequence[str | Path]) -> list[Path]:
    """Run directories among `paths`: a path with metrics/summary is a run; otherwise its sub-directories that are."""
    runs: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise MegagateError(f"{p}: no such run directory")
        if _is_run(p):
            runs.append(p)
            continue
        children = sorted(c for c in p.iterdir() if c.is_dir() and _is_run(c))
        if not children:
            raise MegagateError(
                f"{p}: neither a run directory ({runfiles.METRICS}/{runfiles.SUMMARY}) nor a folder of them"
            )
        runs += children
    return runs


def _is_run(p: Path) -> bool:
    return (p / runfiles.METRICS).exists() or (p / runfiles.SUMMARY).exists()


# --- table -------------------------------------------------------------------------------------------------------
COLUMNS = (
    "run",
    "variant",
    "lr",
    "seed",
    "steps",
    "final_loss",
    "valid_ppl",
    "spikes",
    "SpikeScore",
    "diverged",
    "F-Attn",
    "Sink_1",
    "M-Act",
    "gate_score",
    "curve_spikes",
    "tp/fp/miss",
    "sweep",
    "setting",
)


def table(results: Sequence[RunResult]) -> str:
    """A fixed-width text table, one row per run."""
    rows = [list(COLUMNS)]
    for r in results:
        rows.append(
            [
                r.name,
                r.variant,
                cell(r.lr),
                cell(r.seed),
                cell(r.steps),
                cell(r.final_loss),
                cell(r.valid_ppl),
                cell(r.num_spikes),
                cell(r.spike_score, ".3g"),
                cell(r.diverged),
                cell(r.f_attn, ".3f"),
                cell(r.sink_1, ".3f"),
                cell(r.m_act, ".3g"),
                cell(r.gate_score, ".3f"),
                str(len(r.curve_spikes)),
                f"{r.spike_match.tp}/{r.spike_match.fp}/{r.spike_match.misses}",
                r.sweep or "-",
                r.setting,
            ]
        )
    return render_table(rows)


GROUP_COLUMNS = (
    "sweep",
    "variant",
    "lr",
    "n",
    "seeds",
    "final_loss",
    "valid_loss",
    "diverged",
    "event_runs",
    "curve_spikes",
    "tp/fp/miss",
    "SpikeScore",
    "F-Attn",
    "Sink_1",
    "M-Act",
    "gate_score",
    "setting",
)


def _pm(mean: float | None, std: float | None) -> str:
    if mean is None:
        return "-"
    return f"{mean:.4g}" + ("" if std is None else f"±{std:.2g}")


def group_table(groups: Sequence[aggregate.Group]) -> str:
    """A fixed-width text table, one row per (sweep, setting, variant, lr): losses mean±std over the runs that did
    not diverge, diverged k/n, runs with monitor events, curve spikes and the monitor's tp/fp/miss against them."""
    rows = [list(GROUP_COLUMNS)]
    for g in groups:
        rows.append(
            [
                g.sweep,
                g.variant,
                cell(g.lr),
                str(g.n),
                ",".join(cell(s) for s in g.seeds),
                _pm(g.final_loss_mean, g.final_loss_std),
                _pm(g.valid_loss_mean, g.valid_loss_std),
                f"{g.diverged}/{g.n}",
                f"{g.runs_with_events}/{g.n}",
                str(g.curve_spikes),
                f"{g.tp}/{g.fp}/{g.misses}",
                cell(g.spike_score, ".3g"),
                cell(g.f_attn, ".3f"),
                cell(g.sink_1, ".3f"),
                cell(g.m_act, ".3g"),
                cell(g.gate_score, ".3f"),
                g.setting,
            ]
        )
    return render_table(rows)


@dataclass(frozen=True)
class Collected:
    """The runs read, identified, sorted and grouped: the record the tables, plots and aggregate.json render."""

    results: list[RunResult]
    groups: list[aggregate.Group]


def collect(
    run_dirs: Sequence[str | Path],
    rule: aggregate.SpikeRule = aggregate.DEFAULT_RULE,
    tolerance: int = aggregate.DEFAULT_TOLERANCE,
    replay: SpikeMonitorConfig | None = None,
    diag_lr: float | None = None,
) -> Collected:
    """Read every run under `run_dirs` (sorted by sweep, setting, variant, LR, seed, name) and group them over
    seeds; `diag_lr` must be one of their LRs."""
    results = [load_run(p, rule, tolerance, replay) for p in find_runs(run_dirs)]
    aggregate.identify(results)
    results.sort(
        key=lambda r: (r.sweep, r.setting, r.variant, r.lr if r.lr is not None else math.inf, r.seed or 0, r.name)
    )
    if diag_lr is not None and not any(r.lr == diag_lr for r in results):
        lrs = ", ".join(cell(lr) for lr in sorted({r.lr for r in results if r.lr is not None}))
        raise MegagateError(f"--diag-lr {diag_lr:g} is not an LR of the runs; their LRs: {lrs}")
    return Collected(results, aggregate.group_runs(results))


def render_text(c: Collected, replay: SpikeMonitorConfig | None = None) -> str:
    """The per-run table, the per-group table, the cluster-health section and the spike precursors."""
    text = table(c.results) + "\n\nover seeds, per (sweep, setting, variant, lr):\n" + group_table(c.groups)
    if replay is not None:
        text += f"\n(monitor events replayed over the logged curves with monitor.spike = {replay.to_dict()})"
    run_dirs, labels = [r.run_dir for r in c.results], [r.label for r in c.results]
    return text + health_section(run_dirs, labels) + precursors.section(run_dirs, labels)


def write_outputs(
    c: Collected,
    text: str,
    out: Path,
    diag_lr: float | None,
    rule: aggregate.SpikeRule,
    tolerance: int,
    replay: SpikeMonitorConfig | None,
) -> None:
    """The plots, aggregate.json and report.txt (`text`) under `out`."""
    results = c.results
    report_plots.plot_loss_curves(results, out / "loss_curves.png")
    report_plots.plot_final_loss_vs_lr(results, out / "final_loss_vs_lr.png")
    report_plots.plot_lr_sensitivity(results, out / "lr_sensitivity.png")
    if diag_lr is not None:
        lrs_by_panel = {(r.sweep, r.setting): diag_lr for r in results}
    else:
        lrs_by_panel = report_plots.default_diag_lrs(results)
    if any(r.diagnostics for r in results):
        report_plots.plot_diagnostics_over_training(results, out / "diagnostics_over_training.png", lrs_by_panel)
    record = aggregate.record(results, c.groups, rule, tolerance)
    record["definitions"]["monitor_events"] = (
        "events.jsonl (as logged)" if replay is None else {"replayed_with": replay.to_dict()}
    )
    runfiles.write_json(out / "aggregate.json", record)
    write_atomic(out / "report.txt", text + "\n")


def report(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path | None = None,
    diag_lr: float | None = None,
    rule: aggregate.SpikeRule = aggregate.DEFAULT_RULE,
    tolerance: int = aggregate.DEFAULT_TOLERANCE,
    replay: SpikeMonitorConfig | None = None,
) -> str:
    """Load the runs, return the per-run and the per-group tables; with `out_dir`, also write the plots,
    report.txt and aggregate.json. `diag_lr`: the LR of diagnostics_over_training.png (default: per sweep and
    setting, the largest LR at which no run diverged). `replay`: judge the runs with these monitor settings replayed
    over their logged curves instead of the events they logged (`megagate.analysis.replay`)."""
    if tolerance < 0:
        raise MegagateError(f"--spike-tolerance {tolerance} must be >= 0 steps")
    if out_dir is not None:  # refuse an unusable --out before reading anything
        from megagate.files import check_writable_dir

        check_writable_dir(out_dir, "--out")
    collected = collect(run_dirs, rule, tolerance, replay, diag_lr)
    text = render_text(collected, replay)
    if out_dir is not None:
        write_outputs(collected, text, Path(out_dir), diag_lr, rule, tolerance, replay)
    return text
