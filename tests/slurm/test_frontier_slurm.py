"""A frontier search on the real local Slurm cluster: two rounds as job arrays chained by driver jobs, to its report.

`megagate frontier --slurm` (the CLI, in this process) checks everything, submits round 1 (the anchor trial) as a
job array and a driver job that depends on it, and returns. With no terminal involved from then on: the driver job
harvests round 1, plans and submits round 2 (the top of the range) and its own successor; that last driver finds
the bracket at resolution and writes the report. Trials are real `megagate train` runs of the tiny model (30 steps).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from helpers.trainer_jobs import TINY
from megagate.frontier import state as state_mod
from megagate.monitor import runfiles

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny_cpu.yaml"
VARIANT = "g1-elementwise"


def test_two_round_frontier_as_chained_arrays(slurm, tmp_path, tmp_path_factory, monkeypatch, capsys):
    from megagate import cli
    from megagate.data.demo import prepare_demo_data

    demo = tmp_path_factory.getbasetemp() / "megagate-demo-data"
    prepare_demo_data(demo, 2048, 1_500_000)
    for key in ("SLURM_CONF", "PYTHONPATH", "PATH"):
        monkeypatch.setenv(key, slurm.env[key])
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "fr"
    argv = ["frontier", "--config", str(CONFIG), "--variants", VARIANT, "--lr-range", "1e-2:1", "--seeds", "0"]
    argv += ["--resolution", "2", "--out", str(out), "--slurm", "--gpus-per-node", "0", "--tasks-per-node", "1"]
    argv += ["--time", "10:00", "--driver-time", "10:00", "--signal-lead", "60", "--master-addr", "127.0.0.1"]
    argv += ["--python", sys.executable, "--env", "GLOO_SOCKET_IFNAME=lo", "--job-name", "fr"]
    argv += [*TINY, "logging.tensorboard=false", "checkpoint.interval=0", f"data.demo_dir={demo}"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    first = state_mod.load(out).rounds[0]
    assert (
        f"round 1: job array {first['jobs']['array']} (1 trials), then driver job {first['jobs']['driver']}" in printed
    )

    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:  # the chain runs on its own; the test only watches the state file
        state = state_mod.load(out)
        if state.done and (out / "frontier.txt").exists():
            break
        time.sleep(1)
    assert state.done and (out / "frontier.txt").exists(), [p.read_text() for p in (out / "logs").glob("*.out")]
    assert [r["trials"] for r in state.rounds] == [[f"{VARIANT}_lr0.01_s0"], [f"{VARIANT}_lr1_s0"]]
    jobs = [r["jobs"] for r in state.rounds]
    for job in jobs:
        assert slurm.wait(job["array"])["JobState"] == "COMPLETED"
    # each driver ran after its round's array (afterany): the first submitted round 2 from inside its job
    for job in jobs:
        driver = slurm.wait(job["driver"])
        assert driver["JobState"] == "COMPLETED"
        assert driver["StartTime"] >= slurm.show(job["array"])["EndTime"]  # afterany: once the array had ended
    logs = {p.name: p.read_text() for p in (out / "logs").glob("*.out")}
    text1 = logs[f"driver-{jobs[0]['driver']}.out"]
    assert f"round 2: job array {jobs[1]['array']} (1 trials)" in text1
    text2 = logs[f"driver-{jobs[1]['driver']}.out"]
    assert "search over after 2 rounds" in text2 and "[0.01, 1)" in text2
    # the trials: the anchor ran every step, the top of the range was stopped early with its reason
    anchor = runfiles.read_json(out / f"{VARIANT}_lr0.01_s0" / "summary.json")
    top = runfiles.read_json(out / f"{VARIANT}_lr1_s0" / "summary.json")
    assert anchor["steps"] == 30 and "early_stop" not in anchor
    assert top["steps"] < 30 and top["stopped"] == top["early_stop"]["reason"]
    assert state.rounds[1]["rungs"][VARIANT][0][0] == 15  # round 2 was given round 1's curve as its reference
    # the report the last driver wrote, and `megagate report` on the folder
    report = (out / "frontier.txt").read_text()
    assert "done after 2 rounds" in report and f"{VARIANT}  0.01 " in report
    assert cli.main(["report", str(out)]) == 0
    assert "1/1 healthy" in capsys.readouterr().out
