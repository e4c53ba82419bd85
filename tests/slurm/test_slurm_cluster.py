"""Jobs on the real local Slurm cluster (2 nodes x 2 tasks, gloo): ranks, warning signal, killed rank, failure loops."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from helpers.slurm_harness import REPO, STAND_IN

pytestmark = pytest.mark.slurm


def expected_weight(steps: int) -> int:
    """The stand-in's final weight for an uninterrupted run: every step adds sum over ranks of (rank + 1 + step)."""
    return sum(10 + 4 * s for s in range(steps))


def records(out: Path) -> dict[tuple[int, int], dict]:
    """(restart, rank) -> what that rank wrote at the end of that attempt."""
    found = {}
    for path in out.glob("rank*-attempt*.json"):
        data = json.loads(path.read_text())
        found[(data["restart"], data["rank"])] = data
    return found


def wait_progress(out: Path, step: int, timeout: float = 60) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads((out / "progress.json").read_text())["step"] >= step:
                return time.monotonic()
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"the stand-in did not reach step {step} in {timeout} s")


def test_two_nodes_four_ranks(slurm, tmp_path: Path) -> None:
    """(a) srun starts one task per rank; megagate.distributed.launch resolves ranks and nodes; gloo all-reduces across nodes."""
    req = slurm.request("allreduce", venv=str(REPO / ".venv"), python="python")
    job = slurm.submit(req, tmp_path, [f"out={tmp_path}", "steps=4", "step_time=0"])
    info = slurm.wait(job)
    log = slurm.log(tmp_path, req, job)
    assert info["JobState"] == "COMPLETED", log
    assert info["Restarts"] == "0"
    got = records(tmp_path)
    assert sorted(got) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    by_rank = [got[(0, r)] for r in range(4)]
    assert [(d["rank"], d["node_rank"], d["slurm_nodeid"], d["local_rank"]) for d in by_rank] == [
        (0, 0, "0", 0),
        (1, 0, "0", 1),
        (2, 1, "1", 0),
        (3, 1, "1", 1),
    ]
    assert {d["world_size"] for d in by_rank} == {4}
    assert {d["source"] for d in by_rank} == {"srun"}
    assert all(d["sums"] == [10, 14, 18, 22] for d in by_rank)  # sum of (rank + 1 + step) over 4 ranks
    assert {d["weight"] for d in by_rank} == {expected_weight(4)}
    assert "megagate-slurm: training step finished (exit 0)" in log


def test_warning_signal_checkpoints_and_requeues(slurm, tmp_path: Path) -> None:
    """(b) USR1 to the batch shell -> forwarded to the ranks -> checkpoint, exit 0 -> requeue -> resume -> finish."""
    steps = 15
    req = slurm.request("warn")
    job = slurm.submit(req, tmp_path, [f"out={tmp_path}", f"steps={steps}", "step_time=0.2"])
    wait_progress(tmp_path, 3)
    t0 = time.monotonic()
    # What --signal=B:USR1@N delivers, without waiting for slurmctld's ~30 s timer.
    slurm.cluster.run("scancel", "--batch", "--signal=USR1", str(job))
    slurm.wait(job, until=("PENDING",), release=False)
    requeued_after = time.monotonic() - t0
    info = slurm.wait(job)
    log = slurm.log(tmp_path, req, job)
    assert info["JobState"] == "COMPLETED", log
    assert info["Restarts"] == "1"
    got = records(tmp_path)
    assert sorted(got) == [(a, r) for a in (0, 1) for r in range(4)]
    first, second = got[(0, 0)], got[(1, 0)]
    assert first["signalled"] and not second["signalled"]
    assert 3 <= first["end_step"] < steps
    assert second["start_step"] == first["end_step"]  # resumed from the checkpoint, nothing replayed or skipped
    assert {got[(1, r)]["weight"] for r in range(4)} == {expected_weight(steps)}
    assert first["master_port"] != second["master_port"]  # a requeued attempt rendezvouses on a fresh port
    assert "caught SIGUSR1" in log and "checkpointed and exited after the warning signal" in log
    assert "requeueing job" in log and log.count("training step finished (exit 0)") == 1
    assert requeued_after < 15, f"signal -> requeued took {requeued_after:.1f} s"
    print(f"signal -> job requeued (PENDING): {requeued_after:.1f} s")


def test_killed_rank_fails_step_and_job_resumes(slurm, tmp_path: Path) -> None:
    """(c) rank 2 is SIGKILLed at step 4 on the first attempt: the step fails, the job requeues and resumes."""
    steps = 10
    req = slurm.request("killrank")
    job = slurm.submit(
        req, tmp_path, [f"out={tmp_path}", f"steps={steps}", "step_time=0.05", "kill_rank=2", "kill_step=4"]
    )
    info = slurm.wait(job)
    log = slurm.log(tmp_path, req, job)
    assert info["JobState"] == "COMPLETED", log
    assert info["Restarts"] == "1"
    assert "task 2: Killed" in log  # srun saw the rank die ...
    assert (
        "step failed (exit code" in log and "Killed); requeueing job" in log
    )  # ... and --kill-on-bad-exit ended the step
    got = records(tmp_path)
    assert sorted(got) == [(1, r) for r in range(4)]  # the first attempt never finished on any rank
    assert {got[(1, r)]["start_step"] for r in range(4)} == {4}  # resumed from the last checkpoint (steps 0-3 done)
    assert {got[(1, r)]["weight"] for r in range(4)} == {expected_weight(steps)}  # = the uninterrupted run


def test_same_failure_stops_instead_of_looping(slurm, tmp_path: Path) -> None:
    """(d) rank 1 exits 3 at step 2 every time: after max_same_failures identical failures the job stops, saying so.

    Its gloo peers fail too (exit 1, or Terminated by --kill-on-bad-exit) in a racy order; the failure is still
    recognised as the same one, and the checkpoint it restarted from (the progress file) is part of it.
    """
    req = slurm.request("failloop", max_same_failures=2, max_restarts=5, progress_file=str(tmp_path / "ckpt.json"))
    job = slurm.submit(req, tmp_path, [f"out={tmp_path}", "steps=10", "step_time=0", "fail_rank=1", "fail_step=2"])
    info = slurm.wait(job)
    log = slurm.log(tmp_path, req, job)
    assert info["JobState"] == "FAILED", log
    assert info["Restarts"] == "1", log  # two attempts, then it stopped: not 5 restarts
    assert info["ExitCode"] == "1:0"
    key = 'no progress past checkpoint {"step": 2, "weight": 24}'
    assert f"megagate-slurm: giving up: the training step failed 2 times the same way ({key}; last: " in log
    attempts = (tmp_path / "runs" / "failloop" / "slurm-state" / f"job-{job}.attempts").read_text().splitlines()
    assert [line.split("\t")[:3] for line in attempts] == [["0", "143", key], ["1", "143", key]]


def test_same_reason_stops_without_progress_file(slurm, tmp_path: Path) -> None:
    """Without a progress file the failures compare by srun's reason (a torch-free program: only srun's view matters)."""
    req = slurm.request("samereason", max_same_failures=2, max_restarts=5)
    crash = "import os, sys, time; sys.exit(7) if os.environ['SLURM_PROCID'] == '3' else time.sleep(60)"
    job = slurm.submit(req, tmp_path, [], program=["-c", crash])
    info = slurm.wait(job)
    log = slurm.log(tmp_path, req, job)
    assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("FAILED", "1", "1:0"), log
    assert log.count("task 3: Exited with exit code 7") == 2
    assert (
        "megagate-slurm: giving up: the training step failed 2 times the same way (Exited with exit code 7); "
        "not requeueing"
    ) in log


def test_restart_limit(slurm, tmp_path: Path) -> None:
    """With max_restarts=0 a failed step is not requeued at all (a torch-free program: only srun's view matters)."""
    req = slurm.request("nolimit", max_restarts=0)
    crash = "import os, sys, time; sys.exit(7) if os.environ['SLURM_PROCID'] == '3' else time.sleep(60)"
    job = slurm.submit(req, tmp_path, [], program=["-c", crash])
    info = slurm.wait(job)
    log = slurm.log(tmp_path, req, job)
    assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("FAILED", "0", "1:0"), log
    assert "task 3: Exited with exit code 7" in log
    assert (
        "megagate-slurm: giving up: step failed (exit code 143: Exited with exit code 7), and the job already "
        "restarted 0 times (max_restarts=0); not requeueing"
    ) in log


def test_torchrun_launcher_signal_and_resume(slurm, tmp_path: Path) -> None:
    """The torchrun-per-node variant: rdzv across both nodes, the warning reaches the workers as TERM, resume."""
    steps = 20
    req = slurm.request("torchrun")
    job = slurm.submit(req, tmp_path, [f"out={tmp_path}", f"steps={steps}", "step_time=0.2"], launcher="torchrun")
    wait_progress(tmp_path, 3, timeout=90)
    slurm.cluster.run("scancel", "--batch", "--signal=USR1", str(job))
    info = slurm.wait(job, timeout=180)
    log = slurm.log(tmp_path, req, job)
    assert info["JobState"] == "COMPLETED", log
    assert info["Restarts"] == "1"
    got = records(tmp_path)
    assert sorted(got) == [(a, r) for a in (0, 1) for r in range(4)]
    assert {got[(0, r)]["source"] for r in range(4)} == {"torchrun"}
    assert got[(1, 0)]["start_step"] == got[(0, 0)]["end_step"] < steps
    assert {got[(1, r)]["weight"] for r in range(4)} == {expected_weight(steps)}
    assert "forwarding SIGTERM to the training step" in log


def test_megagate_submit_cli(slurm, tmp_path: Path, monkeypatch, capsys) -> None:
    """`megagate submit` end to end: config -> layout check -> script -> sbatch -> a finished 4-rank job."""
    from megagate import cli

    for key in ("SLURM_CONF", "PYTHONPATH", "PATH"):
        monkeypatch.setenv(key, slurm.env[key])
    monkeypatch.chdir(tmp_path)
    config = REPO / "slurm" / "examples" / "configs" / "tiny.yaml"
    # submit reads the config as the trainer does: the stand-in takes the trainer's keys for its output and steps
    rc = cli.main(
        [
            "submit",
            str(config),
            f"output.dir={tmp_path}",
            "train.train_steps=3",
            "train.warmup_steps=1",
            "--nodes",
            "2",
            "--gpus-per-node",
            "0",
            "--tasks-per-node",
            "2",
            "--time",
            "5:00",
            "--signal-lead",
            "60",
            "--master-addr",
            "127.0.0.1",
            "--python",
            sys.executable,
            "--command",
            str(STAND_IN),
            "--job-name",
            "cli",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "# layout: TP=2 PP=1 CP=1 DP=2 world=4" in captured.out
    job = int(captured.err.strip().rsplit(" ", 1)[1])
    assert captured.err.strip() == f"Submitted batch job {job}"
    info = slurm.wait(job)
    assert info["JobState"] == "COMPLETED", (tmp_path / "logs" / f"cli-{job}.out").read_text()
    got = records(tmp_path)
    assert sorted(got) == [(0, r) for r in range(4)]
    assert {got[(0, r)]["weight"] for r in range(4)} == {expected_weight(3)}
    scripts = list((tmp_path / "runs" / "cli" / "slurm").glob("cli-*.sbatch"))
    assert len(scripts) == 1 and scripts[0].read_text() == captured.out  # what ran is what was printed


def test_invalid_layout_is_not_submitted(slurm, tmp_path: Path, monkeypatch, capsys) -> None:
    """(e) TP x PP x CP not dividing nodes x GPUs, EP not dividing the experts or DP x CP: refused before sbatch."""
    from megagate import cli

    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    monkeypatch.chdir(tmp_path)
    before = slurm.job_ids()
    moe = str(REPO / "slurm" / "examples" / "configs" / "15a2b_moe.yaml")
    cases = [
        (
            [moe, "--nodes", "8", "--gpus-per-node", "8", "parallel.expert_model_parallel_size=6"],
            "parallel.expert_model_parallel_size (6) must divide model.num_experts (128)",
        ),
        (
            [moe, "--nodes", "3", "--gpus-per-node", "4", "parallel.pipeline_model_parallel_size=8"],
            "world size 12 is not divisible by TP (1) x PP (8) x CP (1) = 8",
        ),
        (
            [moe, "--nodes", "1", "--gpus-per-node", "4"],
            "parallel.expert_model_parallel_size (8) must divide DP (4) x CP (1) = 4: megatron's expert grid "
            "ETP (1) x EP (8) x PP (1) = 8 must divide world size 4",
        ),
    ]
    for argv, message in cases:
        assert cli.main(["submit", *argv]) == 2
        captured = capsys.readouterr()
        assert captured.err == f"megagate submit: error: {message}\n"
        assert captured.out == ""
    assert list(tmp_path.iterdir()) == []  # no script, no log folder
    assert slurm.job_ids() == before  # the controller never saw a job


@pytest.mark.slow
def test_sbatch_signal_timer(slurm, tmp_path: Path) -> None:
    """The real `#SBATCH --signal=B:USR1@20` of a 2-minute job: warned, checkpointed, requeued, finished.

    slurmctld sends the warning at its first periodic check (~30 s apart) once at most lead + 30 s remain,
    so here 70-100 s into an attempt: after the 4 ranks' start-up even on a slow, loaded machine (a 1-minute job,
    warned 10-40 s in, was warned there before its first step); the first attempt needs 110 s, so it is always
    cut short.
    """
    steps = 220
    req = slurm.request("timer", time="2", signal_lead_s=20)
    job = slurm.submit(
        req, tmp_path, [f"out={tmp_path}", f"steps={steps}", "step_time=0.5", "step_time_restarted=0.01"]
    )
    info = slurm.wait(job, timeout=420)
    log = slurm.log(tmp_path, req, job)
    assert info["JobState"] == "COMPLETED", log
    restarts = int(info["Restarts"])
    assert restarts >= 1 and log.count("caught SIGUSR1") == restarts
    got = records(tmp_path)
    assert sorted(got) == [(a, r) for a in range(restarts + 1) for r in range(4)]
    assert got[(0, 0)]["signalled"] and 0 < got[(0, 0)]["end_step"] < steps
    for a in range(restarts):  # each attempt resumed exactly where the previous one checkpointed
        assert got[(a + 1, 0)]["start_step"] == got[(a, 0)]["end_step"]
    assert {got[(restarts, r)]["weight"] for r in range(4)} == {expected_weight(steps)}
