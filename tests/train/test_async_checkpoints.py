"""Asynchronous checkpoint saves (checkpoint.async_save): the shards are written by a forked process while training
goes on; the manifest, the rename and keep_last come at finalisation.

One single-process run: checkpoints every 2 steps written in the background; the writer of step 8's save hangs (an
injected `hang` in phase `write`), the trainer trains on, and is SIGKILLed while that write is pending. The writer
dies with it, step 8's folder stays a temporary one that nothing loads, and the rerun resumes from step 6's
background-written checkpoint and ends bit-identical to an uninterrupted synchronous run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import fault_runs as F
from helpers import tiny_runs as T
from megagate import checkpoint as ckpt

pytestmark = pytest.mark.slow
ASYNC = [
    "checkpoint.interval=2",
    "checkpoint.keep_last=3",
    "checkpoint.async_save=true",
    "checkpoint.async_check_interval=1",
]


def test_sigkill_during_a_background_write_then_resume_from_a_background_checkpoint(tmp_path, session_demo_dir):
    reference = tmp_path / "reference"
    T.run_train(reference, session_demo_dir, "checkpoint.interval=2", "checkpoint.async_save=false")
    out = tmp_path / "run"
    args = ["--config", str(T.CONFIG), *T.BASE, f"data.demo_dir={session_demo_dir}", f"output.dir={out}", *ASYNC]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megagate",
            "train",
            *args,
            "monitor.faults=[{step: 8, kind: hang, rank: 0, phase: write}]",
        ],
        cwd=T.ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        while not F.events(out, "fault") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the writer of step 8 records the fault, then blocks
        assert F.events(out, "fault") and proc.poll() is None
        writers = {pid for pid in F.live_processes(str(out)) if pid != proc.pid}
        assert writers, "the background writer (a forked trainer) is running"
        time.sleep(1.0)  # the trainer trains on meanwhile
        proc.kill()
        log, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while F.live_processes(str(out)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert F.live_processes(str(out)) == {}  # the writer died with the trainer (PR_SET_PDEATHSIG)
    assert "saving checkpoint" in log and "written in the background" in log
    root = out / "checkpoints"
    assert [p.name for _, p in ckpt.complete_checkpoints(root)] == ["iter_0000002", "iter_0000004", "iter_0000006"]
    pending = root / ".iter_0000008.tmp"
    assert pending.is_dir() and not (pending / ckpt.MANIFEST).exists()  # never taken for a checkpoint
    assert ckpt.verify(root / "iter_0000006", collective=False) is None
    manifest = json.loads((root / "iter_0000006" / ckpt.MANIFEST).read_text())
    assert "__0_0.distcp" in manifest["files"] and not any(n.startswith(".crc") for n in manifest["files"])
    rerun = T.run_train(out, session_demo_dir, *ASYNC)
    assert "resumed from" in rerun.stdout and "iter_0000006 at step 6" in rerun.stdout, rerun.stdout[-3000:]
    assert T.losses(out) == T.losses(reference)  # bit-identical, each step once
    ours = T.checkpoint_tensors(root / "iter_0000012", tmp_path)
    theirs = T.checkpoint_tensors(reference / "checkpoints" / "iter_0000012", tmp_path)
    assert ours.keys() == theirs.keys() and len(ours) >= 9
    assert all((ours[k] == theirs[k]).all() for k in ours)
    assert not list(root.glob(".iter_*.tmp"))  # the next save removed the abandoned one
