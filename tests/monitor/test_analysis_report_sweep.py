"""Offline analysis, run reports and sweeps: real tiny models, run directories written by the real trainer, real
subprocesses and scripts."""

import argparse
import json
import math
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import tiny_model, trainer_jobs
from megagate.analysis import analyze, report
from megagate.commands import analyze as analyze_cmd
from megagate.errors import ConfigError, MegagateError
from megagate.files import write_atomic
from megagate.grid import local as grid_local
from megagate.grid import slurm as grid_slurm
from megagate.grid import trials as grid
from megagate.monitor import diagnostics, runfiles

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    assert matplotlib.image.imread(str(path)).shape[0] > 100
    assert not list(path.parent.glob(".*.png")), "temporary files left behind"


# --- analyze -----------------------------------------------------------------------------------------------------
def test_analyze_model_table_and_plots(megatron_world, tmp_path):
    model = tiny_model.build("g1-elementwise", seed=0)
    tokens = tiny_model.text_tokens(2, 32)
    table = analyze.analyze_model(model, tokens, tmp_path)
    diags = diagnostics.collect(model, tokens)
    lines = table.splitlines()
    assert lines[0].split() == ["layer", "gate_score", "sparsity(<0.1)", "F-Attn", "Sink(T=32)", "M-Act", "max_logit"]
    row1 = lines[3].split()
    assert row1[0] == "1" and float(row1[3]) == pytest.approx(diags[1].f_attn, abs=5e-4)
    assert float(row1[1]) == pytest.approx(diags[1].gate_score_mean, abs=5e-4)
    assert lines[-1].split()[0] == "all"
    assert float(lines[-1].split()[3]) == pytest.approx((diags[0].f_attn + diags[1].f_attn) / 2, abs=5e-4)
    for name in ("first_token_attention", "gate_scores", "max_activation", "attention_map"):
        assert_png(tmp_path / f"{name}.png")


def test_analyze_command_refuses_a_folder_that_is_no_checkpoint(tmp_path):
    parser = argparse.ArgumentParser()
    analyze_cmd.add_arguments(parser)
    (tmp_path / "folder").mkdir()
    args = parser.parse_args([str(tmp_path / "folder"), "--out", str(tmp_path / "a")])
    with pytest.raises(MegagateError, match="has no readable megagate.json"):
        analyze_cmd.run(args)
    with pytest.raises(MegagateError, match="no such file"):
        analyze_cmd.run(parser.parse_args([str(tmp_path), "--text", str(tmp_path / "missing.txt")]))
    assert analyze_cmd.text_batch(list(range(10)), 4, 3).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


# --- report over real run directories ---------------------------------------------------------------------------
def trainer_run(preset: str, fault_step: int | None = None) -> list[str]:
    """60 trainer steps at LR 3e-3, seed 0, the spike monitor in warn mode, one diagnostics probe at the end."""
    section = {
        "spike": {"action": "warn"},
        "diagnostics": {"interval": 60},
        "faults": [{"step": fault_step, "kind": "scale_loss", "factor": 10}] if fault_step else [],
    }
    return [
        *trainer_jobs.TINY,
        "train.train_steps=60",
        "logging.tensorboard=false",
        "train.lr=0.003",
        "seed=0",
        f"model.gate.preset={preset}",
        "monitor=" + json.dumps(section),
    ]


@pytest.fixture(scope="module")
def report_runs(tmp_path_factory):
    """Two run directories written by `megagate train`: G1 with a loss spike injected at step 45, and the baseline."""
    demo = trainer_jobs.demo_data(tmp_path_factory)
    jobs = {"g1_lr0.003": trainer_run("g1-elementwise", fault_step=45), "base_lr0.003": trainer_run("baseline")}
    runs = trainer_jobs.run_jobs(tmp_path_factory, demo, jobs)
    for name, run in runs.items():
        assert run.rc == 0, f"{name}: {run.log[-3000:]}"
    return runs


@pytest.mark.slow  # two 60-step trainer runs: ~30 s on 2 cores
def test_report_aggregates_real_runs(report_runs, tmp_path):
    sweep_dir = tmp_path / "sweep"
    for name, run in report_runs.items():  # a sweep folder: one run directory per point, named by the point
        shutil.copytree(run.dir, sweep_dir / name, ignore=shutil.ignore_patterns("checkpoints", "data_cache"))
    # a diverged run: NaN loss from step 5, no summary (it crashed)
    bad = sweep_dir / "base_lr1"
    bad.mkdir()
    write_atomic(bad / runfiles.CONFIG, "seed: 0\ntrain: {lr: 1.0}\nmodel: {gate: {preset: baseline}}\n")
    for step in range(1, 8):
        runfiles.write_metrics(
            bad, step, "train", loss=6.0 if step < 5 else math.nan, lr=1.0, grad_norm=1.0, tokens_per_s=1.0
        )
    text = report.report([sweep_dir], tmp_path / "out")
    per_run = text.split("\n\n")[0]  # then the table over seeds
    rows = {line.split()[0]: line.split() for line in per_run.splitlines()[2:]}
    assert set(rows) == {"g1_lr0.003", "base_lr0.003", "base_lr1"}
    g1 = report.load_run(sweep_dir / "g1_lr0.003")
    assert g1.num_spikes == 1 and g1.spike_steps == [45] and g1.variant == "g1-elementwise" and g1.lr == 0.003
    assert g1.gate_score is not None and 0 < g1.gate_score < 1 and not g1.diverged
    # the scale_loss fault multiplies the loss the monitor and backward see, not the logged loss: the logged curve has
    # no spike (the offline judgement finds none), so against the curve the monitor's event at 45 is a false positive
    assert g1.curve_spikes == [] and (g1.spike_match.tp, g1.spike_match.fp, g1.spike_match.false_events) == (
        0,
        1,
        (45,),
    )
    base = report.load_run(sweep_dir / "base_lr0.003")
    assert base.curve_spikes == [] and base.spike_match.fp == base.num_spikes == 0  # the clean run: nothing either way
    assert rows["g1_lr0.003"][14:17] == ["0", "0/1/0", "sweep"]  # curve_spikes, tp/fp/miss, the sweep (parent) folder
    diag = runfiles.read_jsonl(sweep_dir / "g1_lr0.003" / runfiles.DIAGNOSTICS)
    assert g1.f_attn == pytest.approx(sum(d["f_attn"] for d in diag) / 2)
    assert g1.m_act == max(d["m_act"] for d in diag)
    summary = runfiles.read_json(sweep_dir / "g1_lr0.003" / runfiles.SUMMARY)
    assert rows["g1_lr0.003"][5] == f"{summary['final_loss']:.4g}" and rows["g1_lr0.003"][7] == "1"
    assert rows["base_lr0.003"][13] == "-"  # no gate score for the baseline
    assert rows["base_lr1"][9] == "yes" and report.load_run(bad).diverged
    # Gu et al.'s Sink_1 at the last probe: the mean over layers of diagnostics.jsonl's sink
    assert g1.sink_1 == pytest.approx(sum(d["sink"] for d in diag) / 2)
    assert rows["g1_lr0.003"][11] == f"{g1.sink_1:.3f}"
    # 60 steps < the SpikeScore's 128-step look-back: nothing judged yet, the column says so
    assert summary["spike_score"]["loss"] == {"percent": None, "spikes": 0, "judged": 0}
    assert g1.spike_score is None and rows["g1_lr0.003"][8] == "-"
    for name in ("loss_curves", "final_loss_vs_lr", "lr_sensitivity", "diagnostics_over_training"):
        assert_png(tmp_path / "out" / f"{name}.png")
    assert (tmp_path / "out" / "report.txt").read_text().strip() == text
    with pytest.raises(MegagateError, match="neither a run directory"):
        report.report([tmp_path / "out"])


def test_runfiles_roundtrip_nonfinite_and_torn_line(tmp_path):
    path = tmp_path / "m.jsonl"
    runfiles.append_jsonl(path, {"step": 1, "loss": math.inf, "x": [math.nan]})
    with open(path, "a") as f:
        f.write('{"step": 2, "lo')  # a writer killed mid-line
    (rec,) = runfiles.read_jsonl(path)
    assert rec["loss"] == math.inf and math.isnan(rec["x"][0])
    assert json.loads(path.read_text().splitlines()[0])["loss"] == "inf"
    assert (
        runfiles.is_diverged(6.0, 7.0)
        and not runfiles.is_diverged(6.0, 2.0)
        and runfiles.is_diverged(6.0, 2.0, aborted=True)
    )


# --- sweep -------------------------------------------------------------------------------------------------------
def test_expand_grid():
    specs = grid.expand_grid(
        ["train.steps=10", "train.lr=9"], [1e-3, 4e-3], ["baseline", "g1-elementwise"], [0, 1], out_dir="runs/s"
    )
    assert len(specs) == 8
    assert specs[0].name == "baseline_lr0.001_s0" and specs[0].run_dir == "runs/s/baseline_lr0.001_s0"
    assert specs[0].overrides == ("train.steps=10", "train.lr=0.001", "model.gate.preset=baseline", "seed=0")
    assert specs[-1].argv("c.yaml") == [
        "--config",
        "c.yaml",
        "train.steps=10",
        "train.lr=0.004",
        "model.gate.preset=g1-elementwise",
        "seed=1",
        "output.dir=runs/s/g1-elementwise_lr0.004_s1",
    ]
    with pytest.raises(ConfigError, match="sweep variant 'g9' is not a gate preset"):
        grid.expand_grid([], [1e-3], ["g9"], [0])
    with pytest.raises(ConfigError, match="duplicate point"):
        grid.expand_grid([], [1e-3, 1e-3], ["baseline"], [0])
    with pytest.raises(ConfigError, match="sweep learning rate -1"):
        grid.expand_grid([], [-1], ["baseline"], [0])


STAND_IN_TRAINER = textwrap.dedent('''
    """Stands in for `megagate train` until the trainer exists: parses the argv contract, writes run files."""
    import math, sys
    from megagate.files import write_atomic
    from megagate.monitor import runfiles
    args = sys.argv[1:]
    assert args[0] == "--config"
    kv = dict(a.split("=", 1) for a in args[2:])
    out, lr, seed = kv["output.dir"], float(kv["train.lr"]), int(kv["seed"])
    write_atomic(out + "/config.yaml", f"seed: {seed}\\ntrain: {{lr: {lr}}}\\nmodel: {{gate: {{preset: {kv['model.gate.preset']}}}}}\\n")
    loss = 2.0 + lr * 100 + seed * 0.01
    for step in range(1, 4):
        runfiles.write_metrics(out, step, "train", loss=loss + 3 - step, lr=lr, grad_norm=1.0, tokens_per_s=1.0)
    diverged = lr > 0.05
    runfiles.write_summary(out, 3, math.nan if diverged else loss, None, diverged)
    sys.exit(3 if diverged else 0)
''')


def test_run_local_and_report(tmp_path):
    script = tmp_path / "train_stand_in.py"
    script.write_text(STAND_IN_TRAINER)
    specs = grid.expand_grid([], [1e-3, 0.1], ["baseline", "g1-elementwise"], [0], out_dir=str(tmp_path / "runs"))
    results = grid_local.run_local(specs, "base.yaml", command=[sys.executable, str(script)])
    assert results == {
        "baseline_lr0.001_s0": 0,
        "baseline_lr0.1_s0": 3,
        "g1-elementwise_lr0.001_s0": 0,
        "g1-elementwise_lr0.1_s0": 3,
    }
    loaded = {r.name: r for r in map(report.load_run, report.find_runs([tmp_path / "runs"]))}
    assert loaded["baseline_lr0.001_s0"].final_loss == pytest.approx(2.1) and loaded["baseline_lr0.1_s0"].diverged
    report.report([tmp_path / "runs"], tmp_path / "rep")
    assert_png(tmp_path / "rep" / "final_loss_vs_lr.png")


def test_slurm_array_script(tmp_path):
    from megagate.slurm import SlurmRequest

    specs = grid.expand_grid([], [1e-3, 8e-3], ["baseline", "g1-elementwise"], [0], out_dir="runs/s")
    tasks = [(spec.name, [*spec.overrides, f"output.dir={spec.run_dir}"]) for spec in specs]
    _, script = grid_slurm.array_script(
        SlurmRequest(nodes=1, gpus_per_node=8, job_name="sw"), "cfg.yaml", tasks, "config: cfg.yaml"
    )
    assert "#SBATCH --array=0-3" in script
    assert "# array task 3: g1-elementwise_lr0.008_s0" in script
    assert "-m megagate train --config cfg.yaml" in script
    assert (
        "3) SWEEP_ARGS=(train.lr=0.008 model.gate.preset=g1-elementwise seed=0 output.dir=runs/s/g1-elementwise_lr0.008_s0)"
        in script
    )
    path = tmp_path / "sweep.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
