"""One run per output directory (megagate.train.runlock): flock held by rank 0, O_EXCL + liveness where flock is
unavailable, and the real trainer refusing a second run on a busy output.dir (exit 2, one line naming the holder).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import tiny_runs as T
from megagate.errors import MegagateError
from megagate.train import runlock

HOLD = (
    "import sys, time; from megagate.train import runlock; "
    "runlock.acquire(sys.argv[1]); print('locked', flush=True); time.sleep(600)"
)


def dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def hold_in_other_process(directory: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_lock_refuses_while_held_and_names_the_holder(tmp_path):
    holder = hold_in_other_process(tmp_path)
    try:
        with pytest.raises(MegagateError) as err:
            runlock.acquire(tmp_path)
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith(f"output.dir {str(tmp_path)!r} is in use by another run (host {socket.gethostname()}")
        assert f"pid {holder.pid}, since " in message and message.endswith("; wait for it or choose another output.dir")
    finally:
        holder.kill()
        holder.wait()
    # SIGKILL released it (the kernel drops flocks of a dead process): the file stays, it no longer blocks
    assert (tmp_path / runlock.LOCK_NAME).exists()
    lock = runlock.acquire(tmp_path)
    assert json.loads((tmp_path / runlock.LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_stale_lock_file_of_a_dead_pid_does_not_block(tmp_path):
    stale = {"host": socket.gethostname(), "pid": dead_pid(), "since": "yesterday", "command": "megagate train"}
    for use_flock in (True, False):
        (tmp_path / runlock.LOCK_NAME).write_text(json.dumps(stale))
        lock = runlock.acquire(tmp_path, use_flock=use_flock)
        assert json.loads((tmp_path / runlock.LOCK_NAME).read_text())["pid"] == os.getpid()
        lock.release()
    assert not (tmp_path / runlock.LOCK_NAME).exists()  # the O_EXCL lock removes its file on release


def test_exclusive_file_fallback_refuses_a_live_holder(tmp_path):
    """Without flock (some NFS): the O_EXCL file of a live process on this host, or of any other host, refuses."""
    first = runlock.acquire(tmp_path, use_flock=False)
    with pytest.raises(MegagateError, match=rf"in use by another run \(host [^,]+, pid {os.getpid()}, since "):
        runlock.acquire(tmp_path, use_flock=False)
    first.release()
    # a pid reused by another process is not the holder: the recorded process start time differs
    reused = {**runlock.holder_record(), "proc_start": "1"}
    (tmp_path / runlock.LOCK_NAME).write_text(json.dumps(reused))
    runlock.acquire(tmp_path, use_flock=False).release()
    other = {"host": "elsewhere-node", "pid": 4242, "since": "10:00"}
    (tmp_path / runlock.LOCK_NAME).write_text(json.dumps(other))
    with pytest.raises(MegagateError) as err:
        runlock.acquire(tmp_path, use_flock=False)
    assert "(host elsewhere-node, pid 4242, since 10:00)" in str(err.value)
    assert f"remove {tmp_path / runlock.LOCK_NAME}" in str(err.value)


def test_checkpoint_dir_outside_output_dir_is_locked_too(tmp_path):
    out, ckpt = tmp_path / "run", tmp_path / "shared-ckpt"
    holder = hold_in_other_process(ckpt)
    try:
        with pytest.raises(MegagateError, match=r"^checkpoint.dir .*shared-ckpt' is in use by another run"):
            runlock.lock_run_dirs(out, ckpt)
        runlock.acquire(out).release()  # the refused call left output.dir unlocked
        inside = runlock.lock_run_dirs(out, out / "checkpoints")  # inside output.dir: one lock
        assert len(inside) == 1 and not (out / "checkpoints" / runlock.LOCK_NAME).exists()
        runlock.release_all(inside)
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("value", ["0", "-2"])
def test_dry_run_world_size_must_be_positive(value, capsys):
    from megagate import cli

    rc = cli.main(["train", "--config", str(T.CONFIG), "--dry-run", "--world-size", value])
    captured = capsys.readouterr()
    assert (rc, captured.out) == (2, "")
    assert captured.err == f"megagate train: error: --world-size {value}: must be a positive number of processes\n"


@pytest.mark.slow
def test_second_run_on_busy_output_dir_refuses_first_finishes(tmp_path, session_demo_dir):
    """Two trainers on one output.dir: the second exits 2 with one line naming the first's host and pid; the first
    trains on undisturbed (each step logged once) until it is stopped (SIGTERM: checkpoint, exit 0). Its step count
    is far more than it can finish while the second starts, however fast the steps are."""
    args = ["--config", str(T.CONFIG), *T.BASE, f"data.demo_dir={session_demo_dir}", f"output.dir={tmp_path}"]
    first = subprocess.Popen(
        [sys.executable, "-m", "megagate", "train", *args, "train.train_steps=100000"],
        cwd=T.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        lock_file = tmp_path / runlock.LOCK_NAME
        deadline = time.monotonic() + 300
        metrics = tmp_path / "metrics.jsonl"
        while first.poll() is None and time.monotonic() < deadline:  # the first holds the lock and has trained
            if lock_file.exists() and f'"pid": {first.pid},' in lock_file.read_text():
                if metrics.exists() and metrics.read_text().endswith("\n"):
                    break
            time.sleep(0.05)
        second = T.run_train(tmp_path, session_demo_dir, "train.train_steps=30", check=False)
        assert first.poll() is None, "the first run ended before the second was refused: the test proves nothing"
        assert second.returncode == 2, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if line.startswith("megagate train: error:")]
        assert errors == [
            f"megagate train: error: output.dir {str(tmp_path)!r} is in use by another run "
            f"(host {socket.gethostname()}, pid {first.pid}, since {json.loads(lock_file.read_text())['since']}); "
            f"wait for it or choose another output.dir"
        ], second.stderr[-3000:]
        assert "step " not in second.stdout
        assert first.poll() is None, "the first run ended on its own"
        first.send_signal(signal.SIGTERM)
        output, _ = first.communicate(timeout=300)
        assert first.returncode == 0 and "stopped at step" in output, output[-3000:]
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGKILL)
            first.wait()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["split"] == "train"]
    assert steps and steps == list(range(1, len(steps) + 1))
