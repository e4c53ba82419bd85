"""A stuck rank under torchrun (4 ranks over gloo): the watchdog ends the job within its limit, names the rank,
its host and its phase, leaves every rank's stacks, and the rerun resumes and ends bit-identical.

One run, launched four times (the rank faults fire once per run, as a transient fault would): launch 1 hangs rank 2
in forward_backward at step 5, launch 2 (resumed at 4) hangs rank 0 (the store's host) in the optimizer at step 7,
launch 3 (resumed at 6) hangs rank 3 in the save of step 10 (its second save: the first of a launch gets the
warm-up limit), launch 4 (resumed at 8) finishes. Every logged loss and the final weights equal an uninterrupted
run's. A rank stopped with SIGSTOP (it cannot dump its stack) is named by the others and killed (2 ranks).

A 2-rank copy of this run hung the same phases; the one case it had that the 4-rank run lacked, rank 0 hanging, is
the 4-rank run's second launch, so the copy is merged into it."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from helpers import fault_runs as F
from helpers import tiny_runs as T
from megagate.health import watchdog

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
INTERVAL = ["checkpoint.interval=2", "checkpoint.keep_last=3"]
NPROC = 4
# (rank, phase, step, the checkpoint the next launch resumes from), one hang per launch
HANGS = [(2, "forward_backward", 5, 4), (0, "optimizer", 7, 6), (3, "save", 10, 8)]


def faults() -> str:
    items = [f"{{step: {s}, kind: hang, rank: {r}, phase: {p}}}" for r, p, s, _ in HANGS]
    return f"monitor.faults=[{', '.join(items)}]"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, session_demo_dir) -> Path:
    """The uninterrupted run (same checkpoint cadence and watchdog, no faults): the ranks forked from the preloaded
    server (helpers.forked; their losses and weights are what torchrun's ranks compute), with the straggler window
    and its no-straggler check (tiny_runs.run_train)."""
    path = tmp_path_factory.mktemp("hang-reference")
    T.run_train(path, session_demo_dir, *INTERVAL, *F.WATCHDOG, nproc=NPROC, timeout=900)
    return path


def check_hang_launch(out: Path, launch: F.Launch, nproc: int, rank: int, phase: str, step: int) -> float:
    """One hung launch: exit code, the diagnosis, the stacks, the timing; returns seconds from hang to exit."""
    assert launch.rc != 0 and f"exitcode  : {watchdog.HANG_EXIT_CODE}" in launch.log, launch.log[-4000:]
    folder = F.launches(out)[-1]
    diagnosis = json.loads((folder / "diagnosis.json").read_text())
    host = watchdog.host_name()
    assert diagnosis["ranks"] == [rank] and diagnosis["hosts"] == [host], diagnosis
    line = diagnosis["line"]
    assert line.startswith(f"hang: rank {rank} ({host}) did not arrive: {phase} of step {step} for "), line
    assert "busy in megagate/monitor/process_faults.py" in line, line
    assert sorted(diagnosis["waiting"]) == sorted(set(range(nproc)) - {rank}), diagnosis  # the others wait
    assert f"megagate train: error: {line}" in launch.log  # one line on the console
    assert launch.log.count("Traceback (most recent call last)") == 1  # torchrun's own ChildFailedError only
    for r in range(nproc):  # every rank dumped its stacks (the hung one too: a thread of it still runs)
        stacks = (folder / f"stacks-rank{r:05d}.txt").read_text()
        assert "Thread 0x" in stacks and "megagate/health/watchdog.py" in stacks, stacks[:500]
    hung = (folder / f"stacks-rank{rank:05d}.txt").read_text()
    assert "process_faults.py" in hung and "_hang" in hung
    fault = [e for e in F.events(out, "fault") if e["fault"]["step"] == step][-1]
    assert (fault["rank"], fault["fault"]["phase"]) == (rank, phase)
    hang_record = json.loads((folder / "hang.json").read_text())
    elapsed = launch.workers_ended - fault["time"]
    assert elapsed <= hang_record["limit"] + F.EXIT_MARGIN_S, (elapsed, hang_record)
    assert F.live_processes(str(out)) == {}  # no rank, writer or launcher left
    return elapsed


def test_hangs_end_the_job_with_a_diagnosis_and_the_rerun_ends_bit_identical(reference, tmp_path, session_demo_dir):
    out = tmp_path / "run"
    timings = []
    for rank, phase, step, resume_at in HANGS:
        launch = F.torchrun(out, session_demo_dir, NPROC, *INTERVAL, *F.WATCHDOG, faults())
        timings.append(check_hang_launch(out, launch, NPROC, rank, phase, step))
        latest = sorted(p.name for p in (out / "checkpoints").glob("iter_*"))[-1]
        assert latest == f"iter_{resume_at:07d}", latest
    final = F.torchrun(out, session_demo_dir, NPROC, *INTERVAL, *F.WATCHDOG, faults())
    assert final.rc == 0, final.log[-4000:]
    assert "resumed from" in final.log and f"iter_{HANGS[-1][3]:07d} at step" in final.log
    assert T.losses(out) == T.losses(reference)  # every step logged once, bit-identical
    ours = T.checkpoint_tensors(out / "checkpoints" / "iter_0000012", tmp_path)
    theirs = T.checkpoint_tensors(reference / "checkpoints" / "iter_0000012", tmp_path)
    assert ours.keys() == theirs.keys() and len(ours) >= 9
    assert all((ours[k] == theirs[k]).all() for k in ours)
    print(f"{NPROC} ranks: hang to exit {', '.join(f'{t:.1f} s' for t in timings)}")


def test_a_sigstopped_rank_is_named_and_killed(tmp_path, session_demo_dir):
    """SIGSTOP on rank 1 (it cannot dump): rank 0 names it as not responding, kills it, and the job ends."""
    import subprocess
    import sys

    out = tmp_path / "run"
    args = ["--config", str(T.CONFIG), *T.BASE, f"data.demo_dir={session_demo_dir}", f"output.dir={out}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "megagate"]
        + ["train", *args, *INTERVAL, *F.WATCHDOG, "train.train_steps=400"],
        cwd=T.ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        record = None
        while time.monotonic() < deadline and proc.poll() is None:
            folders = F.launches(out)
            path = folders[-1] / "rank00001.json" if folders else None
            if path is not None and path.exists():
                record = json.loads(path.read_text())
                if record["step"] >= 4:
                    break
            time.sleep(0.05)
        assert record is not None and proc.poll() is None
        os.kill(record["pid"], signal.SIGSTOP)
        stopped = time.time()
        log, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ended = time.time()
    folder = F.launches(out)[-1]
    diagnosis = json.loads((folder / "diagnosis.json").read_text())
    assert diagnosis["ranks"] == [1], diagnosis
    assert "rank 1 (" in diagnosis["line"] and "not responding (stopped or frozen, no stack)" in diagnosis["line"]
    assert (folder / "stacks-rank00000.txt").exists() and not (folder / "stacks-rank00001.txt").exists()
    assert f"killed rank 1 ({watchdog.host_name()}) (pid {record['pid']})" in log
    hang = json.loads((folder / "hang.json").read_text())
    assert ended - stopped <= hang["limit"] + F.EXIT_MARGIN_S + 5, (ended - stopped, hang)
    assert F.live_processes(str(out)) == {}
