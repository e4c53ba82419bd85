"""`megagate frontier` refuses bad input with one line and exit 2, before anything is written or submitted.

Each case runs through `megagate.cli.main` in this process; locally and with --slurm, where an `sbatch` first on
PATH records any call (it must never be called) — the refusals happen while the settings are checked.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from megagate.cli import main

ROOT = Path(__file__).resolve().parents[2]
BASE = str(ROOT / "examples" / "tiny_cpu.yaml")
FR = f"frontier --config {BASE} --variants baseline --out {{work}}/fr"
SLURM = "--slurm --gpus-per-node 0 --tasks-per-node 1 --time 10:00 --signal-lead 60"

CASES = [
    ("inverted-range", f"{FR} --lr-range 1:1e-2", "--lr-range 1:0.01 is inverted"),
    ("empty-range", f"{FR} --lr-range 1e-2:1e-2", "--lr-range 0.01:0.01 is empty"),
    ("range-not-numbers", f"{FR} --lr-range fast:slow", "'fast:slow' is not LOW:HIGH"),
    ("range-zero", f"{FR} --lr-range 0:1", "--lr-range low end 0.0 must be a positive"),
    ("zero-budget", f"{FR} --lr-range 1e-3:1 --budget 0", "--budget 0 must be a positive number of trial-steps"),
    ("unknown-variant", f"frontier --config {BASE} --variants g9 --lr-range 1e-3:1 --out {{work}}/fr", "'g9'"),
    ("never-pass-delta", f"{FR} --lr-range 1e-3:1 --delta -0.1", "--delta -0.1 can never pass"),
    ("never-pass-seeds", f"{FR} --lr-range 1e-3:1 --seeds 0 --min-healthy-seeds 2", "--min-healthy-seeds 2 can never"),
    ("never-pass-spikes", f"{FR} --lr-range 1e-3:1 --max-loss-spikes -1", "--max-loss-spikes -1 can never pass"),
    (
        "never-pass-exit-after",
        f"{FR} --lr-range 1e-3:1 train.exit_after_steps=3",
        "train.exit_after_steps=3 < train.train_steps=60",
    ),
    ("never-pass-reference", f"{FR} --lr-range 1e-3:1 --reference -1", "--reference -1 + --delta 0.5 can never pass"),
    ("negative-decisive", f"{FR} --lr-range 1e-3:1 --decisive -0.2", "--decisive -0.2 must be >= 0 nats"),
    ("margin-below-delta", f"{FR} --lr-range 1e-3:1 --margin 0.1", "--margin 0.1 is below --delta 0.5"),
    ("resolution-zero", f"{FR} --lr-range 1e-3:1 --resolution 0", "--resolution 0 must be a positive"),
    ("unknown-schedule", f"{FR} --lr-range 1e-3:1 --schedule fast", "--schedule 'fast' is not a schedule; give one"),
    ("owned-override", f"{FR} --lr-range 1e-3:1 train.lr=1", "train.lr is set per trial"),
    ("bad-override", f"{FR} --lr-range 1e-3:1 model.num_layers=0", "model.num_layers"),
    ("resume-missing", "frontier --resume {work}/none", "--resume {work}/none: no frontier.json"),
    ("no-range", f"frontier --config {BASE} --out {{work}}/fr", "give --config and --lr-range"),
]


@pytest.fixture
def recording_sbatch(tmp_path, monkeypatch) -> Path:
    """An `sbatch` first on PATH that records its arguments: a refusal must never reach it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "sbatch-calls"
    script = bin_dir / "sbatch"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho 1\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


@pytest.mark.parametrize("slurm", [False, True], ids=["local", "slurm"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_frontier_input_is_one_line_and_nothing_runs(case, slurm, tmp_path, capsys, monkeypatch, recording_sbatch):
    _, argv, message = case
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    args = argv.format(work=work).split() + (SLURM.split() if slurm and "--resume" not in argv else [])
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("megagate frontier: error: "), err
    assert message.format(work=work) in lines[0], lines[0]
    assert not list(work.rglob("*")), list(work.rglob("*"))  # no state, no trial folder, no script
    assert not recording_sbatch.exists()  # nothing submitted


def test_a_local_trial_python_that_cannot_run_is_refused(tmp_path, capsys, monkeypatch):
    """Locally the trials' interpreter is checked at once (on Slurm it is a path on the compute nodes)."""
    monkeypatch.chdir(tmp_path)
    rc = main([*f"{FR} --lr-range 1e-3:1 --python {tmp_path}".format(work=tmp_path).split()])
    err = capsys.readouterr().err
    assert rc == 2 and err == f"megagate frontier: error: --python {tmp_path}: not an executable file\n", err
    assert not (tmp_path / "fr").exists()


def test_dry_run_prints_round_one_and_writes_nothing(tmp_path, capsys, monkeypatch, recording_sbatch):
    tmp_path = tmp_path / "work"
    tmp_path.mkdir()
    monkeypatch.chdir(tmp_path)
    argv = f"frontier --config {BASE} --variants baseline,g1-elementwise --lr-range 1e-3:1 --seeds 0,1 --dry-run"
    assert main([*argv.split(), "--out", str(tmp_path / "fr"), *SLURM.split()]) == 0
    out = capsys.readouterr().out.splitlines()
    # T = 60 steps, warm-up 6, window 10: a rung at 30; 15 would average steps 6-15, one of them in the warm-up
    assert out[0] == "rungs at steps [30]; round 1 (2 trials):"
    assert out[1].startswith(f"megagate train --config {BASE} train.lr=0.001 model.gate.preset=baseline seed=0 ")
    assert "monitor.early_stop.margin=1.0" in out[1] and out[1].endswith(
        f"output.dir={tmp_path}/fr/baseline_lr0.001_s0"
    )
    assert "model.gate.preset=g1-elementwise" in out[2] and len(out) == 3
    # thrifty, fixed reference: both ends are assumptions, so round 1 is the middle of the range (10^-1.5)
    argv += " --schedule thrifty --reference 4.9"
    assert main([*argv.split(), "--out", str(tmp_path / "fr"), *SLURM.split()]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[4] for line in out[1:]] == ["train.lr=0.0316228"] * 2
    assert not list(tmp_path.rglob("*")) and not recording_sbatch.exists()


def test_slurm_trials_are_checked_on_the_arrays_world_size(tmp_path, capsys, monkeypatch, recording_sbatch):
    """A trial's layout is checked on the ranks one array task will have (nodes x tasks per node), not on one:
    tensor parallel 2 is refused locally and accepted on two ranks per task."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    argv = f"frontier --config {BASE} --variants baseline --lr-range 1e-3:1 --out {work}/fr --dry-run"
    tp2 = "parallel.tensor_model_parallel_size=2"
    assert main([*argv.split(), tp2]) == 2
    assert "world size 1 is not divisible by TP (2)" in capsys.readouterr().err
    slurm = SLURM.replace("--tasks-per-node 1", "--tasks-per-node 2")
    assert main([*argv.split(), *slurm.split(), tp2]) == 0, capsys.readouterr().err
    trial = capsys.readouterr().out.splitlines()[1]
    assert f" {tp2} train.lr=0.001 " in trial and trial.endswith(f"output.dir={work}/fr/baseline_lr0.001_s0")
    assert not list(work.rglob("*")) and not recording_sbatch.exists()
