"""`megagate report` over multi-seed sweeps: run identity (sweep, setting), seed aggregation, aggregate.json, plots;
and the offline curve-spike judgement against the spike monitor's events, on hand-made curves with known answers.

The run folders are written in the runfiles schema the way the trainer writes them: config.yaml is the example
config with the sweep point's overrides applied (megagate.config_reader.apply_overrides, dumped like the trainer's
MetricsLogger), metrics/events/diagnostics lines through runfiles' own writers, summary.json by write_summary,
sweep.json by `megagate sweep`'s own writer.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path

import pytest
import torch
import yaml

from megagate import cli
from megagate.analysis import aggregate, report
from megagate.analysis.aggregate import CurveSpike, SpikeRule, curve_spikes, match_events
from megagate.config_reader import apply_overrides
from megagate.errors import MegagateError
from megagate.files import write_atomic
from megagate.grid import trials as grid
from megagate.monitor import runfiles
from megagate.monitor.diagnostics import attention_logits, attention_stats
from megagate.yamlfile import load_mapping

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "science_cpu.yaml"  # qk_layernorm: false
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 60
LRS = (0.03, 0.1)
VARIANTS = ("baseline", "g1-elementwise")
SEEDS = (0, 1, 2)


# --- hand-made sweeps ------------------------------------------------------------------------------------------
def final_loss(qk: bool, variant: str, lr: float, seed: int) -> float:
    """Known final losses: QK-norm -0.3, the gate -0.2 (more at the high LR without QK-norm), seeds 0.01-0.04 apart."""
    loss = 5.0 - 0.3 * qk - 0.2 * (variant != "baseline") + (0.4 if lr == 0.1 and not qk else 0.0)
    loss -= 0.2 * (variant != "baseline") * (lr == 0.1 and not qk)
    return round(loss + [0.0, 0.01, 0.04][seed], 6)


def curve(final: float, seed: int) -> list[float]:
    """A decaying curve ending at `final` with ±0.01 batch noise (no spike by the default rule)."""
    losses = [final + 2.0 * math.exp(-step / 4) + (0.01 if (step + seed) % 2 else -0.01) for step in range(1, STEPS)]
    return [*losses, final]


# the stability events of sweep qk_off (no QK-norm) at LR 0.1: (variant, seed) -> what happens
SPIKE = ("baseline", 0)  # a natural spike of +1 nat at steps 30-32; the monitor fires at 31 (a true positive)
FALSE_ALARM = ("baseline", 1)  # the monitor fires at steps 50 and 51 on a flat curve (one false-positive cluster)
DIVERGED = ("baseline", 2)  # NaN from step 40, no summary loss; the monitor fires at 40 (a true positive)
MISSED = ("g1-elementwise", 1)  # a +0.8 nat spike at step 45 the monitor did not flag (a miss)


def diag(variant: str, seed: int, step: int) -> list[dict]:
    """Two layers' diagnostics at one probe step; layer 1 has the sink (F-Attn grows with the step)."""
    gate = None if variant == "baseline" else 0.4 + 0.01 * seed
    return [
        {"step": step, "layer": 0, "gate_score_mean": gate, "gate_sparsity": 0.1, "f_attn": 0.03, "m_act": 10.0},
        {
            "step": step,
            "layer": 1,
            "gate_score_mean": None if gate is None else gate + 0.1,
            "gate_sparsity": 0.2,
            "f_attn": 0.03 + step / 1000 + 0.01 * seed,
            "m_act": 100.0 * (seed + 1),
        },
    ]


def write_run(run_dir: Path, overrides: list[str], qk: bool, variant: str, lr: float, seed: int) -> None:
    raw = apply_overrides(load_mapping(CONFIG), overrides)
    write_atomic(run_dir / runfiles.CONFIG, yaml.safe_dump(raw, sort_keys=False))
    final = final_loss(qk, variant, lr, seed)
    losses = curve(final, seed)
    events: list[int] = []
    point = None if qk or lr != 0.1 else (variant, seed)
    if point == SPIKE:
        losses[29:32] = [x + 1.0 for x in losses[29:32]]
        events = [31]
    elif point == FALSE_ALARM:
        events = [50, 51]
    elif point == DIVERGED:
        losses[39:] = [math.nan] * (STEPS - 39)
        events = [40]
    elif point == MISSED:
        losses[44] += 0.8
    for step, loss in enumerate(losses, start=1):
        runfiles.write_metrics(run_dir, step, "train", loss=loss, lr=lr, grad_norm=1.0, tokens_per_s=1000.0)
    for step in events:
        runfiles.append_jsonl(
            run_dir / runfiles.EVENTS,
            {"step": step, "metric": "loss", "value": 9.0, "baseline": 5.0, "score": 12.0, "action": "warn"},
        )
    for step in (20, 40, 60):
        for record in diag(variant, seed, step):
            runfiles.append_jsonl(run_dir / runfiles.DIAGNOSTICS, record)
    diverged = point == DIVERGED
    runfiles.write_metrics(run_dir, STEPS, "valid", loss=math.nan if diverged else final + 0.1, ppl=1.0)
    runfiles.write_summary(
        run_dir, STEPS, math.nan if diverged else final, math.nan if diverged else final + 0.1, diverged
    )


def write_sweep(out: Path, qk: bool) -> list[str]:
    """One sweep folder as `megagate sweep` lays it out: OUT/sweep.json and OUT/<variant>_lr<lr>_s<seed>."""
    base = [f"model.qk_layernorm={str(qk).lower()}"] if qk else []
    specs = grid.expand_grid(base, LRS, VARIANTS, SEEDS, out_dir=str(out))
    grid.write_sweep_file(out, str(CONFIG), base, LRS, VARIANTS, SEEDS, specs)
    for spec in specs:
        kv = dict(o.split("=", 1) for o in spec.overrides)
        write_run(
            Path(spec.run_dir),
            [*spec.overrides, f"output.dir={spec.run_dir}"],
            qk,
            kv["model.gate.preset"],
            float(kv["train.lr"]),
            int(kv["seed"]),
        )
    return [s.name for s in specs]


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("science")
    write_sweep(root / "qk_off", qk=False)
    write_sweep(root / "qk_on", qk=True)
    return root


def test_report_aggregates_seeds_and_keeps_sweeps_apart(sweeps, tmp_path, capsys):
    out = tmp_path / "report"
    rc = cli.main(["report", str(sweeps / "qk_off"), str(sweeps / "qk_on"), "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    data = runfiles.read_json(out / "aggregate.json")  # decodes the "inf"/"nan" strings
    groups = {(g["sweep"], g["variant"], g["lr"]): g for g in data["groups"]}
    # 2 sweeps x 2 variants x 2 LRs, never merged: each group holds exactly its sweep's three seeds
    assert len(groups) == 8 and all(g["n"] == 3 and g["seeds"] == [0, 1, 2] for g in groups.values())
    assert {g["setting"] for g in data["groups"] if g["sweep"] == "qk_off"} == {"model.qk_layernorm=false"}
    assert {g["setting"] for g in data["groups"] if g["sweep"] == "qk_on"} == {"model.qk_layernorm=true"}
    for (name, variant, lr), g in groups.items():
        qk = name == "qk_on"
        seeds = [s for s in SEEDS if not (not qk and lr == 0.1 and (variant, s) == DIVERGED)]
        losses = [final_loss(qk, variant, lr, s) for s in seeds]
        assert g["final_loss_mean"] == pytest.approx(statistics.fmean(losses), abs=1e-9), (name, variant, lr)
        assert g["final_loss_std"] == pytest.approx(statistics.stdev(losses), abs=1e-9)
        assert g["valid_loss_mean"] == pytest.approx(statistics.fmean(losses) + 0.1, abs=1e-9)
        assert g["valid_loss_std"] == pytest.approx(statistics.stdev(losses), abs=1e-9)
        assert g["diverged"] == 3 - len(seeds)
        # last probe (step 60): F-Attn mean over layers (0.03, 0.09 + 0.01 seed), M-Act max, gate mean over layers
        assert g["f_attn"] == pytest.approx(statistics.fmean((0.03 + 0.09 + 0.01 * s) / 2 for s in SEEDS))
        assert g["m_act"] == pytest.approx(200.0)
        if variant == "baseline":
            assert g["gate_score"] is None
        else:
            assert g["gate_score"] == pytest.approx(0.46)
    # the stability events: numbers that only come out right if the rule, the matching and the sums are right
    hot_base, hot_g1 = groups["qk_off", "baseline", 0.1], groups["qk_off", "g1-elementwise", 0.1]
    assert (hot_base["curve_spikes"], hot_base["tp"], hot_base["fp"], hot_base["misses"]) == (2, 2, 1, 0)
    assert (hot_base["runs_with_events"], hot_base["events"]) == (3, 4)
    assert (hot_g1["curve_spikes"], hot_g1["tp"], hot_g1["fp"], hot_g1["misses"]) == (1, 0, 0, 1)
    quiet = [g for k, g in groups.items() if k not in (("qk_off", "baseline", 0.1), ("qk_off", "g1-elementwise", 0.1))]
    assert all(g["curve_spikes"] == g["events"] == g["diverged"] == 0 for g in quiet)
    hot_base_mean = statistics.fmean([final_loss(False, "baseline", 0.1, s) for s in (0, 1)])
    assert hot_base_mean == pytest.approx(5.405)  # 5.4 and 5.41: the diverged seed (5.44 + NaN) is left out
    runs = {(r["sweep"], r["name"]): r for r in data["runs"]}
    spiky = runs["qk_off", "baseline_lr0.1_s0"]
    assert [(s["step"], s["last_step"]) for s in spiky["curve_spikes"]] == [(30, 32)]
    nan_tail = runs["qk_off", "baseline_lr0.1_s2"]["curve_spikes"]
    assert nan_tail == [{"step": 40, "last_step": 60, "excess": math.inf, "nonfinite": True}]
    assert runs["qk_off", "baseline_lr0.1_s1"]["false_event_steps"] == [50]
    assert data["definitions"]["uniform_f_attn"] == {"128": pytest.approx(0.0349067, abs=1e-7)}
    assert data["sweeps"]["qk_on"]["sweep_json"]["overrides"] == ["model.qk_layernorm=true"]
    assert data["sweeps"]["qk_on"]["sweep_json"]["grid"] == {
        "lrs": [0.03, 0.1],
        "variants": list(VARIANTS),
        "seeds": [0, 1, 2],
    }
    # the printed tables: rows that say what distinguishes them
    text = (out / "report.txt").read_text()
    assert printed.startswith(text.rstrip("\n"))
    per_run, per_group = text.split("\n\nover seeds, per (sweep, setting, variant, lr):\n")
    header = per_run.splitlines()[0].split()
    row = next(line.split() for line in per_run.splitlines() if line.startswith("baseline_lr0.1_s2 "))
    assert row[header.index("sweep")] == "qk_off" and row[header.index("setting")] == "model.qk_layernorm=false"
    assert row[header.index("diverged")] == "yes" and row[header.index("tp/fp/miss")] == "1/0/0"
    gheader = per_group.splitlines()[0].split()
    grow = next(
        line.split() for line in per_group.splitlines()[2:] if line.split()[:3] == ["qk_off", "baseline", "0.1"]
    )
    assert grow[gheader.index("final_loss")] == "5.405±0.0071" and grow[gheader.index("diverged")] == "1/3"
    assert grow[gheader.index("tp/fp/miss")] == "2/1/0" and grow[gheader.index("event_runs")] == "3/3"
    per_group, tagged = per_group.split("\n\nspike precursors")  # then, per spike event, what moved first
    assert len(per_group.splitlines()) == 2 + 8
    assert "qk_off/baseline_lr0.1_s2  step 40 (loss): first moved: none" in tagged  # these runs log no precursors
    for name in ("loss_curves", "final_loss_vs_lr", "lr_sensitivity", "diagnostics_over_training"):
        assert (out / f"{name}.png").read_bytes()[:8] == PNG_MAGIC, name
    assert not list(out.glob(".*"))  # no temporary files left


def test_same_config_in_two_folders_stays_two_groups(sweeps, tmp_path):
    """A copy of a sweep elsewhere (same folder name, same configs) is a second sweep: labelled apart, not merged."""
    for parent in ("a", "b"):
        shutil.copytree(sweeps / "qk_off", tmp_path / parent / "qk_off")
    text = report.report([tmp_path / "a" / "qk_off", tmp_path / "b" / "qk_off"], tmp_path / "out", diag_lr=0.03)
    data = runfiles.read_json(tmp_path / "out" / "aggregate.json")
    assert sorted({g["sweep"] for g in data["groups"]}) == ["a/qk_off", "b/qk_off"]
    assert {g["setting"] for g in data["groups"]} == {"-"}  # nothing but the folder tells them apart
    assert len(data["groups"]) == 8 and all(g["n"] == 3 for g in data["groups"])
    assert "a/qk_off" in text and "b/qk_off" in text
    with pytest.raises(MegagateError, match=r"--diag-lr 0.5 is not an LR of the runs; their LRs: 0.03, 0.1"):
        report.report([tmp_path / "a" / "qk_off"], tmp_path / "out2", diag_lr=0.5)
    assert not (tmp_path / "out2" / "loss_curves.png").exists()  # refused before anything is written
    assert cli.main(["report", str(tmp_path / "a"), "--spike-tolerance", "-1"]) == 2


def test_settings_and_sweep_labels():
    configs = [
        {"model": {"qk_layernorm": False, "gate": {"preset": "baseline"}}, "train": {"lr": 0.1}, "seed": 0},
        {"model": {"qk_layernorm": True, "gate": {"preset": "g1-elementwise"}}, "train": {"lr": 0.3}, "seed": 1},
        {"model": {"gate": {"preset": "baseline"}}, "train": {"lr": 0.1, "clip_grad": 1.0}, "seed": 2},
    ]
    assert aggregate.settings(configs) == [
        "model.qk_layernorm=false,train.clip_grad=unset",
        "model.qk_layernorm=true,train.clip_grad=unset",
        "model.qk_layernorm=unset,train.clip_grad=1.0",
    ]
    assert aggregate.settings(configs[:1] * 2) == ["-", "-"]
    labels = aggregate.sweep_labels([Path("/r/x/s1"), Path("/r/y/s1"), Path("/r/s2")])
    assert labels == {Path("/r/x/s1"): "x/s1", Path("/r/y/s1"): "y/s1", Path("/r/s2"): "s2"}
    assert aggregate.uniform_f_attn(2) == 0.5  # one query position after the first: it attends 1/2 to token 0
    # the reference is what the live diagnostics measure for uniform attention: equal (zero) logits, causal mask
    for length in (2, 17, 128):
        zeros = torch.zeros(length, 1, 2, 4)  # [sq, b, np, hn]: q·k = 0 everywhere
        stats = attention_stats(attention_logits(zeros, zeros, 1.0))
        measured = (stats["f_sum_per_head"] / stats["f_count_per_head"]).mean().item()
        assert aggregate.uniform_f_attn(length) == pytest.approx(measured, rel=1e-6), length
    assert aggregate.uniform_f_attn(128) == pytest.approx(0.0349067, abs=1e-7)


def test_sweep_command_writes_sweep_json(tmp_path):
    out = tmp_path / "sw"
    script = tmp_path / "sweep.sbatch"
    argv = ["sweep", "--config", str(CONFIG), "--lrs", "0.03,0.1", "--seeds", "0,1", "--out", str(out)]
    slurm = ["--slurm", "--gpus-per-node", "1", "--script", str(script)]
    assert cli.main([*argv, *slurm, "model.qk_layernorm=true"]) == 0
    info = json.loads((out / "sweep.json").read_text())
    assert info == {
        "config": str(CONFIG),
        "overrides": ["model.qk_layernorm=true"],
        "grid": {"lrs": [0.03, 0.1], "variants": ["baseline", "g1-elementwise"], "seeds": [0, 1]},
        "runs": [f"{v}_lr{lr}_s{s}" for v in VARIANTS for lr in ("0.03", "0.1") for s in (0, 1)],
    }
    assert aggregate.find_sweep_dir(out / "baseline_lr0.03_s0") == out.resolve()
    # a second sweep into the same folder (another variant) keeps the first grid under "earlier"
    assert cli.main([*argv, *slurm, "--variants", "g1-headwise"]) == 0
    again = json.loads((out / "sweep.json").read_text())
    assert again["grid"]["variants"] == ["g1-headwise"] and again["earlier"] == [info]
    assert cli.main([*argv[:-2], "--out", str(tmp_path / "dry"), "--dry-run"]) == 0
    assert not (tmp_path / "dry" / "sweep.json").exists()  # a dry run writes nothing


# --- curve spikes on hand-made curves ------------------------------------------------------------------------
def steps(losses: list[float]) -> list[tuple[int, float]]:
    return list(enumerate(losses, start=1))


NOISY = [5.0 + (0.05 if i % 2 else -0.05) for i in range(40)]  # MAD 0.05: k·σ = 6 · 0.074 = 0.44 > δ


def test_curve_spike_rule_on_known_curves():
    assert curve_spikes(steps(NOISY)) == []
    assert curve_spikes(steps([7.0 - 0.05 * i for i in range(60)])) == []  # training: falling loss is no spike
    # +1 nat at steps 21-23 (indices 20-22): one spike, first..last above step, excess over the median (5.0)
    jump = NOISY[:20] + [x + 1.0 for x in NOISY[20:23]] + NOISY[23:]
    (spike,) = curve_spikes(steps(jump))
    assert (spike.step, spike.last_step, spike.nonfinite) == (21, 23, False)
    assert spike.excess == pytest.approx(1.05)
    # the threshold is max(k·σ, δ): on NOISY k·σ = 0.445 decides, on a flat curve δ = 0.3
    for rise, expected in ((0.40, 0), (0.50, 1)):
        assert len(curve_spikes(steps(NOISY[:20] + [NOISY[20] + rise] + NOISY[21:]))) == expected, rise
    flat = [5.0] * 30
    for rise, expected in ((0.29, 0), (0.31, 1)):
        assert len(curve_spikes(steps(flat[:20] + [5.0 + rise] + flat[21:]))) == expected, rise
    # nothing is judged before min_history accepted losses
    assert curve_spikes(steps([5.0] * 4 + [9.0] + [5.0] * 20)) == []
    assert curve_spikes(steps([5.0] * 5 + [9.0] + [5.0] * 20)) == [CurveSpike(6, 6, 4.0, False)]
    # a non-finite tail is one spike, also when a finite spike runs into it
    nan_tail = NOISY[:30] + [math.nan] * 10
    assert curve_spikes(steps(nan_tail)) == [CurveSpike(31, 40, math.inf, True)]
    into_nan = NOISY[:30] + [8.0, 9.0] + [math.inf] * 3
    assert curve_spikes(steps(into_nan)) == [CurveSpike(31, 35, math.inf, True)]
    # a jump that stays up is one spike to the end (above points do not enter the median)
    assert curve_spikes(steps(NOISY[:25] + [7.0] * 30)) == [CurveSpike(26, 55, pytest.approx(2.0), False)]
    # two separate spikes
    two = NOISY[:20] + [6.5] + NOISY[21:30] + [6.5, 6.5] + NOISY[32:]
    assert [(s.step, s.last_step) for s in curve_spikes(steps(two))] == [(21, 21), (31, 32)]
    # a custom rule: δ 2 nats ignores the +1 nat jump
    assert curve_spikes(steps(jump), SpikeRule(delta=2.0)) == []
    with pytest.raises(MegagateError, match="min_history 30 must be in 1..window"):
        SpikeRule(min_history=30)
    with pytest.raises(MegagateError, match=r"^curve spike delta 0.0 must be a finite number > 0 \(nats\)$"):
        SpikeRule(delta=0.0)


def test_match_events_true_false_positives_and_misses():
    spikes = [CurveSpike(30, 32, 1.0, False), CurveSpike(100, 100, 1.0, False), CurveSpike(200, 260, math.inf, True)]
    # 27 = 30-3 and 35 = 32+3: inside the ±3 window; 96 = 100-4: outside; 150-152: one false cluster; 160: another
    match = match_events(spikes, [27, 35, 96, 150, 151, 152, 160, 205], tolerance=3)
    assert (match.tp, match.misses, match.fp) == (2, 1, 3)
    assert match.detected == (True, False, True)
    assert match.false_events == (96, 150, 160)
    assert match_events([], [5, 6, 7, 30], tolerance=3).fp == 2
    assert match_events(spikes, [], tolerance=3).misses == 3
    assert match_events(spikes[:1], [33], tolerance=0).tp == 0 and match_events(spikes[:1], [32], tolerance=0).tp == 1


def test_sink_summary_finds_when_first_token_attention_passes_uniform():
    uniform = aggregate.uniform_f_attn(128)  # (H_128 - 1) / 127
    assert uniform == pytest.approx(0.034907, abs=1e-6)
    probes = [
        {"step": 20, "f_attn": 0.02, "f_attn_max_layer": 0.03},
        {"step": 40, "f_attn": 0.03, "f_attn_max_layer": 0.09},  # one layer sinks first
        {"step": 60, "f_attn": 0.05, "f_attn_max_layer": 0.20},
    ]
    sink = aggregate.sink_summary(probes, 128)
    assert (sink["first_step_mean_above_uniform"], sink["first_step_any_layer_above_uniform"]) == (60, 40)
    assert sink["uniform_f_attn"] == uniform and [p["step"] for p in sink["probes"]] == [20, 40, 60]
    # a short probe has a higher uniform reference: 0.05 is below uniform at 16 tokens ((H_16 - 1)/15 = 0.1589)
    assert aggregate.sink_summary(probes, 16)["first_step_mean_above_uniform"] is None
    assert aggregate.sink_summary([], 128) is None and aggregate.sink_summary(probes, None) is None
