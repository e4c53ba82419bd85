"""`monitor.early_stop` in the real trainer (`megagate train`, the tiny model, one child process for both runs): a
rung decides the run at exactly its step; a control file written by another process stops it at the next step
boundary. Either way the run ends cleanly (exit 0) with the reason in summary.json, its logs up to the stop, and a
checkpoint of that step; the loss is not stopped by a rung it passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import trainer_jobs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, session_demo_dir: Path) -> dict[str, trainer_jobs.Run]:
    control = tmp_path_factory.mktemp("control") / "stop.json"
    control.write_text(json.dumps({"stop": "the operator needs the machine"}))  # there before the first step
    base = [*trainer_jobs.TINY, "train.train_steps=20", "logging.tensorboard=false", "checkpoint.interval=0"]
    jobs = {
        # rung 6 passes (any loss is below 100 + 0), rung 10 cannot: the mean of steps 8-10 is above 0 + 0.5
        "rung": [*base, "monitor.early_stop.rungs=[[6,100.0],[10,0.0]]", "monitor.early_stop.window=3"],
        "control": [*base, f"monitor.early_stop.control_file={control}"],
    }
    return trainer_jobs.run_jobs(tmp_path_factory, session_demo_dir, jobs)


def test_a_rung_decides_the_run_at_its_step(runs) -> None:
    run = runs["rung"]
    assert run.rc == 0, run.log[-3000:]
    summary = run.summary()
    losses = [r["loss"] for r in run.train_records()]
    assert [r["step"] for r in run.train_records()] == list(range(1, 11))  # logs kept up to the stop
    mean = sum(losses[7:10]) / 3
    assert summary["early_stop"] == {
        "rule": "rung",
        "step": 10,
        "reason": f"successive halving at step 10: mean loss {mean:.4g} > best 0 + margin 0.5",
    }
    assert summary["stopped"] == summary["early_stop"]["reason"] and summary["steps"] == 10
    assert summary["final_loss"] == pytest.approx(losses[-1])
    assert (run.dir / "checkpoints" / "iter_0000010").is_dir()
    assert "the run is over (summary.json says why)" in run.log


def test_a_control_file_stops_the_run_from_outside(runs) -> None:
    run = runs["control"]
    assert run.rc == 0, run.log[-3000:]
    summary = run.summary()
    assert summary["early_stop"] == {
        "rule": "control",
        "step": 0,
        "reason": "stopped from outside: the operator needs the machine",
    }
    assert summary["steps"] == 0 and run.train_records() == []
