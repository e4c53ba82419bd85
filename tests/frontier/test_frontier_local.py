"""A real frontier search on this machine (`megagate frontier`, the local pool, real `megagate train` trials of the
tiny model, 30 steps), interrupted twice on the way:

1. a trial is SIGKILLed mid-run (a non-stability failure: node failure, OOM killer): the driver retries it from
   scratch, keeps the killed attempt's logs under attempts/, and never counts it as unstable;
2. the driver itself is SIGKILLed mid-round, after one trial of the round finished and while the next runs: the
   running trial checkpoints and stops (it gets SIGTERM when the driver dies), and a rerun of the same command
   finishes the search without running the finished trial again (the stopped one resumes from its checkpoint).

Then: the search's trials are exactly those the pure planner asks for from the recorded outcomes (nothing repeated
or extra: the frontier an uninterrupted search finds with these deterministic trials), the trial at the top of the
range was stopped early with its reason in summary.json and stays decided when rerun, and `megagate report` reads
the folder. One search shared by the tests of this module.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import trainer_jobs
from megagate.frontier import state as state_mod
from megagate.frontier.rule import HealthRule
from megagate.frontier.search import plan_variant
from megagate.monitor import runfiles

# ~3 min on a quiet 2-core machine; the timeout leaves room for a loaded one
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny_cpu.yaml"
TINY = [*trainer_jobs.TINY, "logging.tensorboard=false", "checkpoint.interval=0"]  # the monitor tests' runs
VARIANT = "g1-elementwise"
ANCHOR, TOP = f"{VARIANT}_lr0.01_s0", f"{VARIANT}_lr1_s0"
SEED1, SEED2 = f"{VARIANT}_lr0.01_s1", f"{VARIANT}_lr0.01_s2"


@dataclass
class Search:
    out: Path
    argv: list[str]
    env: dict
    first_log: str
    rerun_log: str
    seed1_summary_mtime: float


def _command(out: Path, demo_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "megagate",
        "frontier",
        "--config",
        str(CONFIG),
        "--variants",
        VARIANT,
        "--lr-range",
        "1e-2:1",
        "--seeds",
        "0,1,2",
        "--resolution",
        "2",  # the coarse bracket (0.01, 1) is already at resolution: anchor, top, then the seeds at h
        "--workers",
        "1",
        "--out",
        str(out),
        *TINY,
        f"data.demo_dir={demo_dir}",
    ]


def _state(out: Path) -> dict:
    try:
        return json.loads((out / state_mod.STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _wait(what: str, condition, proc: subprocess.Popen, timeout: float = 900) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the driver exited ({proc.returncode}) before {what}:\n{proc.stdout.read()}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _pid(out: Path, name: str) -> int | None:
    for rnd in reversed(_state(out).get("rounds", [])):
        if name in rnd.get("pids", {}):
            return rnd["pids"][name]
    return None


def _train_lines(run_dir: Path) -> int:
    return len(runfiles.train_metrics(runfiles.read_jsonl(run_dir / runfiles.METRICS)))


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie of the dead driver: gone for our purpose
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.fixture(scope="module")
def search(tmp_path_factory) -> Search:
    from megagate.data.demo import prepare_demo_data

    demo_dir = tmp_path_factory.getbasetemp() / "megagate-demo-data"  # shared with the other test packages
    prepare_demo_data(demo_dir, 2048, 1_500_000)
    out = tmp_path_factory.mktemp("frontier") / "out"
    argv = _command(out, demo_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    driver = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # 1. kill the anchor trial once it has trained a step
        pid = _wait(
            "the anchor's first step", lambda: _pid(out, ANCHOR) if _train_lines(out / ANCHOR) else None, driver
        )
        os.kill(pid, signal.SIGKILL)
        # 2. kill the driver in the confirmation round: seed 1 finished, seed 2 running (one worker: in turn)
        _wait(
            "seed 1 finished, seed 2 training",
            lambda: (out / SEED1 / "summary.json").exists() and _train_lines(out / SEED2) >= 1 and _pid(out, SEED2),
            driver,
        )
        seed2 = _pid(out, SEED2)
        driver.kill()
        first_log = driver.communicate(timeout=60)[0]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    _wait_gone = time.monotonic() + 120
    while not _gone(seed2) and time.monotonic() < _wait_gone:  # it checkpoints and exits on the SIGTERM
        time.sleep(0.2)
    assert _gone(seed2), "the running trial outlived its driver"
    assert not (out / SEED2 / "summary.json").exists()  # stopped, not decided
    mtime = (out / SEED1 / "summary.json").stat().st_mtime
    rerun = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    return Search(out, argv, env, first_log, rerun.stdout, mtime)


def test_failures_retried_and_resume_repeats_no_finished_trial(search):
    state = state_mod.load(search.out)
    assert state.done and state.stop_reason is None
    trials = state.trials
    assert sorted(trials) == sorted([ANCHOR, TOP, SEED1, SEED2])
    anchor = trials[ANCHOR]
    # the SIGKILLed attempt: one failure (not a stability outcome), retried from scratch, its logs kept
    assert (anchor.attempts, anchor.failures, anchor.status) == (2, 1, "done") and anchor.outcome.completed
    assert "exit code -9" in anchor.history[0] and "not a stability outcome" in anchor.history[0]
    kept = search.out / "attempts" / f"{ANCHOR}.1"
    assert _train_lines(kept) >= 1 and not (kept / "summary.json").exists()
    assert anchor.lost_steps == _train_lines(kept)
    # the finished trial of the interrupted round was not run again: one attempt, its summary untouched
    assert trials[SEED1].attempts == 1
    assert (search.out / SEED1 / "summary.json").stat().st_mtime == search.seed1_summary_mtime
    # the trial running when the driver died: relaunched without a failure charged, resumed from its checkpoint
    seed2 = trials[SEED2]
    assert (seed2.attempts, seed2.failures) == (2, 0) and seed2.outcome.completed
    assert seed2.history == [f"round {seed2.round - 1}: interrupted with the driver"]
    log = (search.out / "logs" / f"{SEED2}.log").read_text()
    assert "resumed from" in log and "iter_" in log
    steps = [r["step"] for r in runfiles.train_metrics(runfiles.read_jsonl(search.out / SEED2 / "metrics.jsonl"))]
    assert steps == list(range(1, 31))  # each step logged once across the two launches
    assert [t.attempts for t in trials.values()].count(1) == 2  # TOP and SEED1: one launch each


def test_the_search_is_what_the_planner_asks_for(search):
    """Replayed from nothing with the recorded outcomes, the planner asks for exactly these trials, in these
    phases, and ends with the same bracket: the interruptions changed nothing but the retried launches."""
    state = state_mod.load(search.out)
    spec = state.spec
    outcomes = {(t.lr, t.seed): t.outcome for t in state.trials.values()}
    seen, phases = {}, []
    while True:
        plan = plan_variant(spec.lo, spec.hi, spec.coarse, spec.resolution, spec.seeds, HealthRule(), seen)
        if plan.done:
            break
        phases.append(plan.phase)
        seen.update({key: outcomes[key] for key in plan.requests})
    assert seen.keys() == outcomes.keys()
    assert phases == ["anchor", "coarse", "confirm"]
    assert (plan.bracket.healthy, plan.bracket.unhealthy) == (0.01, 1.0)
    rounds = [r["trials"] for r in state.rounds]
    assert rounds == [[ANCHOR], [ANCHOR], [TOP], [SEED1, SEED2], [SEED2]]
    # round 3's trial was given the anchor's curve as its rung reference (the rung of T=30, eta 2: step 15)
    assert state.rounds[2]["rungs"][VARIANT][0][0] == 15


def test_the_top_trial_stopped_early_with_its_reason_and_stays_decided(search):
    top = search.out / TOP
    summary = runfiles.read_json(top / "summary.json")
    assert summary["early_stop"]["rule"] in ("above_start", "rung", "nonfinite", "loss_spikes")
    assert summary["steps"] == summary["early_stop"]["step"] < 30
    assert summary["stopped"] == summary["early_stop"]["reason"]
    assert _train_lines(top) == summary["steps"]  # the logs are kept up to the stop
    state = state_mod.load(search.out)
    assert state.trials[TOP].outcome.stop_rule == summary["early_stop"]["rule"]
    # rerun by hand with its own overrides: a decided run does not train on
    overrides = state.rounds[2]["overrides"][TOP]
    rerun = subprocess.run(
        [sys.executable, "-m", "megagate", "train", "--config", str(CONFIG), *overrides],
        cwd=ROOT,
        env=search.env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert "already decided" in rerun.stdout + rerun.stderr
    assert runfiles.read_json(top / "summary.json") == summary
    assert _train_lines(top) == summary["steps"]


def test_report_reads_the_frontier_folder(search, tmp_path, capsys):
    from megagate.cli import main

    assert main(["report", str(search.out), "--out", str(tmp_path / "r")]) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith(f"{VARIANT}  0.01 "))
    assert "[0.01, 1)" in row and "3/3 healthy" in row and "0/1 healthy" in row and row.endswith("done")
    state = state_mod.load(search.out)
    # compute: what ran (the killed attempt's steps included) against 2 LRs x 3 seeds x 30 steps
    assert f"compute: {state.spent:,} trial-steps (4 trials, 1 stopped early) against 180 for the full grid" in text
    record = runfiles.read_json(tmp_path / "r" / "frontier_report.json")
    assert record["variants"][VARIANT]["bracket"] == [0.01, 1.0]
    assert (tmp_path / "r" / "frontier_lr.png").stat().st_size > 10_000
    assert (search.out / "frontier.txt").read_text().startswith("frontier search in")
