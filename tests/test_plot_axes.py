"""Each plot of `analyze`, `report`, `eval` and the frontier report, rendered from the data of a tiny run, read back
axis by axis: whole-number layer ticks, plain labels on a narrow or base-2 range (no `8x10^-1`, no `2^9`), a
legend entry for every series drawn, legible text.

The figures are the real ones: `plotting.save` is wrapped to read each figure (drawn, so the tick labels are the
rendered ones) before it is written as usual.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from megagate.analysis import plotting
from megagate.cli import main
from megagate.files import write_atomic
from megagate.frontier import state as state_mod
from megagate.frontier.rule import TrialOutcome
from megagate.frontier.spec import FrontierSpec
from megagate.frontier.state import FrontierState, Trial
from megagate.monitor import runfiles
from megagate.monitor.diagnostics import LayerDiagnostics

STEPS = 20


@pytest.fixture
def figures(monkeypatch) -> dict[str, list[dict]]:
    """name of each PNG written -> per axes: scales, tick labels, legend texts and font size, title size."""
    seen: dict[str, list[dict]] = {}
    real = plotting.save

    def reading_save(fig, path):
        fig.canvas.draw()
        axes = []
        for ax in fig.axes:
            legend = ax.get_legend()
            axes.append(
                {
                    "xscale": ax.get_xscale(),
                    "yscale": ax.get_yscale(),
                    "xticks": shown(ax, "x"),
                    "xvalues": [v for v in ax.get_xticks() if min(ax.get_xlim()) <= v <= max(ax.get_xlim())],
                    "yticks": shown(ax, "y"),
                    "legend": [t.get_text() for t in legend.get_texts()] if legend else [],
                    "legend_size": legend.get_texts()[0].get_fontsize() if legend and legend.get_texts() else None,
                    "title_size": ax.title.get_fontsize(),
                    "series": ax.get_legend_handles_labels()[1],  # every labelled line, scatter, bar
                }
            )
        seen[Path(path).name] = axes
        return real(fig, path)

    monkeypatch.setattr(plotting, "save", reading_save)
    return seen


def shown(ax, axis: str) -> list[str]:
    """The major tick labels inside the axis' view (matplotlib also labels ticks just outside it)."""
    low, high = sorted(getattr(ax, f"get_{axis}lim")())
    labels = getattr(ax, f"get_{axis}ticklabels")()
    at = getattr(ax, f"get_{axis}ticks")()
    return [t.get_text() for v, t in zip(at, labels, strict=True) if t.get_text() and low <= v <= high]


def plain(label: str) -> bool:
    """A tick label written as a plain number (matplotlib's minus sign included), not a power of ten."""
    return (
        "^" not in label
        and "times" not in label
        and float(label.replace("\u2212", "-")) == float(label.replace("\u2212", "-"))
    )


def test_analyze_plots(figures, tmp_path: Path) -> None:
    from megagate.analysis.analyze import write_plots

    # a 2-layer model with 4 heads: the narrow M-Act range of a tiny model (0.80-0.87)
    diags = [
        LayerDiagnostics(
            layer=i,
            f_attn=0.3 + 0.1 * i,
            m_act=0.80 + 0.07 * i,
            max_logit=2.0,
            gate_score_mean=0.4,
            gate_hist_edges=[k / 4 for k in range(5)],
            gate_hist_counts=[1.0, 3.0, 2.0, 1.0],
            f_attn_per_head=[0.2, 0.3, 0.4, 0.5],
        )
        for i in range(2)
    ]
    write_plots(diags, tmp_path)
    (f_attn,) = figures["first_token_attention.png"]
    assert f_attn["xticks"] == ["0", "1"]  # whole layers only (was -0.25 ... 1.25)
    assert sorted(f_attn["legend"]) == ["mean over heads", "one head"] == sorted(f_attn["series"])  # dots too
    (m_act,) = figures["max_activation.png"]
    assert m_act["xticks"] == ["0", "1"] and m_act["yscale"] == "linear"  # 0.80-0.87: no log axis
    assert len(m_act["yticks"]) >= 3 and all(plain(t) for t in m_act["yticks"])
    # a range over decades stays log, labelled as plain numbers
    figures.clear()
    write_plots([LayerDiagnostics(layer=i, f_attn=0.5, m_act=10.0**i, max_logit=1.0) for i in range(4)], tmp_path)
    (m_act,) = figures["max_activation.png"]
    assert m_act["yscale"] == "log" and {"1", "10", "100", "1000"} <= set(m_act["yticks"]), m_act["yticks"]
    assert m_act["xticks"] == ["0", "1", "2", "3"]


def write_run(folder: Path, variant: str, lr: float, seed: int, valid: float) -> None:
    run = folder / f"{variant}_lr{lr:g}_s{seed}"
    run.mkdir(parents=True)
    write_atomic(
        run / runfiles.CONFIG,
        f"seed: {seed}\ntrain: {{lr: {lr}, train_steps: {STEPS}, warmup_steps: 2}}\n"
        f"model: {{gate: {{preset: {variant}}}}}\n",
    )
    for step in range(1, STEPS + 1):
        runfiles.write_metrics(run, step, "train", loss=7.0 - 2.0 * step / STEPS + 0.1 * lr, grad_norm=1.0, lr=lr)
    runfiles.write_summary(run, STEPS, 5.0, valid, False)


def test_report_and_frontier_plots(figures, tmp_path: Path, capsys) -> None:
    grid = tmp_path / "grid"
    for variant in ("baseline", "g1-elementwise"):
        for lr in (0.01, 0.1):
            write_run(grid, variant, lr, 0, 5.0 + lr)
    assert main(["report", str(grid), "--out", str(tmp_path / "r")]) == 0
    (curves,) = figures["loss_curves.png"]
    assert len(curves["legend"]) == 4 and curves["legend_size"] >= 8  # one entry per run, legible
    for name in ("final_loss_vs_lr.png", "lr_sensitivity.png"):
        for ax in figures[name]:
            assert sorted(ax["legend"]) == ["baseline", "g1-elementwise"], (name, ax["legend"])

    spec = FrontierSpec(
        config="c.yaml", variants=("baseline",), lo=0.01, hi=1.0, seeds=(0,), resolution=0.5, train_steps=STEPS
    )
    state = FrontierState(spec, {"kind": "local"}, done=True)
    for lr, outcome in (
        (0.01, TrialOutcome(STEPS, True, valid_loss=5.0)),
        (0.1, TrialOutcome(STEPS, True, valid_loss=5.1)),
        (1.0, TrialOutcome(5, False, "rung", "worse at step 5")),
    ):
        name = spec.trial_name("baseline", lr, 0)
        state.trials[name] = Trial("baseline", lr, 0, status="done", attempts=1, round=1, outcome=outcome)
    state.rounds = [{"index": 1, "trials": list(state.trials), "finished": "x"}]
    out = tmp_path / "frontier"
    out.mkdir()
    state_mod.save(out, state)
    capsys.readouterr()
    assert main(["report", str(out), "--out", str(tmp_path / "f")]) == 0
    (frontier,) = figures["frontier_lr.png"]
    # every marker drawn is named as drawn (unhealthy trials stopped early are crosses, not open circles)
    assert frontier["legend"] == ["completed, healthy", "completed, unhealthy", "stopped early (reason beside it)"]
    assert frontier["legend_size"] >= 8 and frontier["title_size"] >= 10


def test_eval_plot_ticks_are_the_lengths(figures, tmp_path: Path) -> None:
    from megagate.evaluate import output

    rows = [{"data": "valid", "seq_length": n, "ppl": 30.0 + n / 64} for n in (128, 256, 512)]
    results = {"data": ["valid"], "checkpoints": [{"name": "g1", "train_seq_length": 256, "results": rows}]}
    output.plot(results, tmp_path / "ppl_vs_length.png")
    (ax,) = figures["ppl_vs_length.png"]
    assert ax["xticks"] == ["128", "256", "512"]  # not 2^7 ... 2^9
    assert ax["yscale"] == "linear" and all(plain(t) for t in ax["yticks"])
    assert ax["legend"] == ["g1"]
    assert math.isclose(ax["xvalues"][0], 128)
