"""Stop signals the way Slurm sends them (and a terminal's Ctrl-C): to every process of the trainer's process group.

After the first checkpoint the trainer has children (megatron's checkpoint-writer Manager, its resource tracker).
A SIGTERM/SIGUSR1 to the whole group used to kill the Manager, so the stop save failed (BrokenPipeError, rc 1) and
the rerun restarted from the previous checkpoint; a SIGKILLed trainer left the Manager behind. Real trainer runs
(`python -m megagate train`, started in a new session so the group is the trainer and its children only).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import tiny_runs as T

pytestmark = pytest.mark.slow
INTERVAL = ["checkpoint.interval=4"]


@pytest.fixture(scope="module")
def reference(reference_run) -> Path:
    """The uninterrupted 12-step run every interrupted run is compared with (conftest's; it saves only at step 12:
    checkpoints do not change the trajectory, tests/train/test_trainer.py compares such runs bitwise)."""
    return reference_run


def start(out: Path, demo_dir: Path, *overrides: str) -> subprocess.Popen:
    args = ["--config", str(T.CONFIG), *T.BASE, f"data.demo_dir={demo_dir}", f"output.dir={out}", *overrides]
    return subprocess.Popen(
        [sys.executable, "-m", "megagate", "train", *args],
        cwd=T.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # its own process group, as a Slurm step's processes are
    )


def group_members(pgid: int) -> dict[int, str]:
    """pid -> command line of the live (non-zombie) processes of process group `pgid`."""
    members = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members[int(entry)] = cmd
    return members


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert path.exists(), f"{path} never appeared (rc {proc.poll()})"


def no_orphans(pgid: int, grace: float = 5.0) -> dict[int, str]:
    """The group's survivors after a short grace period (death signals and pipe EOFs take a moment)."""
    deadline = time.monotonic() + grace
    left = group_members(pgid)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = group_members(pgid)
    for pid in left:  # do not leak them into the rest of the session
        os.kill(pid, signal.SIGKILL)
    return left


def assert_same_final_weights(out: Path, reference: Path, tmp: Path) -> None:
    ours = T.checkpoint_tensors(out / "checkpoints" / "iter_0000012", tmp)
    theirs = T.checkpoint_tensors(reference / "checkpoints" / "iter_0000012", tmp)
    assert ours.keys() == theirs.keys() and len(ours) >= 9
    for key in ours:
        assert (ours[key] == theirs[key]).all(), key


def metric_steps(out: Path) -> list[int]:
    import json

    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["split"] == "train"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT], ids=["SIGTERM", "SIGUSR1", "SIGINT"])
def test_process_group_signal_saves_stop_checkpoint_and_resumes_exactly(sig, reference, tmp_path, session_demo_dir):
    proc = start(tmp_path, session_demo_dir, *INTERVAL)
    pgid = os.getpgid(proc.pid)
    wait_for(tmp_path / "checkpoints" / "iter_0000004", proc)  # the writer's Manager exists from here on
    assert len(group_members(pgid)) >= 2, group_members(pgid)  # the trainer is not alone in its group
    os.killpg(pgid, sig)  # what Slurm does: every process of the step
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    assert "Traceback" not in output and "BrokenPipeError" not in output and "KeyboardInterrupt" not in output
    if sig == signal.SIGINT:  # Ctrl-C: said what happens and how to abort
        assert "interrupt: checkpointing at the next step boundary, then exiting (press Ctrl-C again" in output
    stopped = int(re.search(r"stopped at step (\d+) \(signal\)", output).group(1))
    assert 4 <= stopped < 12
    assert (tmp_path / "checkpoints" / f"iter_{stopped:07d}").is_dir()  # the stop checkpoint was written
    assert not list((tmp_path / "checkpoints").glob(".iter_*.tmp"))
    assert no_orphans(pgid) == {}
    rerun = T.run_train(tmp_path, session_demo_dir, *INTERVAL)
    assert f"at step {stopped} " in rerun.stdout and f"iter_{stopped:07d}" in rerun.stdout, rerun.stdout[-2000:]
    assert metric_steps(tmp_path) == list(range(1, 13))  # each step once: no step retrained
    assert T.losses(tmp_path) == T.losses(reference)  # bitwise equal floats
    assert_same_final_weights(tmp_path, reference, tmp_path)


def catches(pid: int, signum: int) -> bool:
    """Has process `pid` installed a handler for `signum` (SigCgt in /proc/<pid>/status)?"""
    with open(f"/proc/{pid}/status") as status:
        caught = next(int(line.split()[1], 16) for line in status if line.startswith("SigCgt:"))
    return bool(caught >> (signum - 1) & 1)


def test_sigterm_during_startup_exits_cleanly(reference, tmp_path, session_demo_dir):
    """SIGTERM to the group as soon as the launcher catches it (torch still importing): exit 0 before step 1,
    nothing saved. (Waiting for the handler rather than a fixed second: on a loaded machine the interpreter alone
    can take longer than that to start.)"""
    proc = start(tmp_path, session_demo_dir, *INTERVAL)
    pgid = os.getpgid(proc.pid)
    deadline = time.monotonic() + 120
    while not catches(proc.pid, signal.SIGTERM) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(pgid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    assert "Traceback" not in output
    assert "stopped at step 0 (signal)" in output
    assert "step      1/" not in output  # no step ran
    ckpt = tmp_path / "checkpoints"
    assert not ckpt.exists() or list(ckpt.iterdir()) == []  # no checkpoint, no half-written one
    assert no_orphans(pgid) == {}
    T.run_train(tmp_path, session_demo_dir, *INTERVAL)
    assert T.losses(tmp_path) == T.losses(reference)


def test_sigkilled_trainer_leaves_no_child(tmp_path, session_demo_dir):
    """SIGKILL to the trainer alone (an OOM kill): its Manager and resource tracker die with it."""
    proc = start(tmp_path, session_demo_dir, *INTERVAL)
    pgid = os.getpgid(proc.pid)
    wait_for(tmp_path / "checkpoints" / "iter_0000004", proc)
    children = {pid: cmd for pid, cmd in group_members(pgid).items() if pid != proc.pid}
    assert any("multiprocessing" in cmd for cmd in children.values()), children  # the writer's Manager
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert no_orphans(pgid) == {}


class _Dispositions:
    """A dataset whose samples are the worker's signal dispositions and parent-death signal (read in the worker)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict:
        import ctypes

        import torch

        death = ctypes.c_int(0)
        ctypes.CDLL(None).prctl(2, ctypes.byref(death), 0, 0, 0)  # PR_GET_PDEATHSIG
        ignored = [signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)]
        value = torch.tensor([*ignored, death.value], dtype=torch.long)
        return {"tokens": value, "labels": value, "loss_mask": value, "position_ids": value}


def test_data_loader_workers_ignore_stop_signals_and_die_with_the_trainer():
    """The trainer's loader (megagate.train.components.loader passes children.worker_init) in a real worker process."""
    import functools

    from megagate.data.loader import build_loader
    from megagate.distributed import children

    init = functools.partial(children.worker_init, os.getpid())
    batch = next(iter(build_loader(_Dispositions(), 2, num_workers=1, worker_init_fn=init)))
    assert batch["tokens"].tolist() == [[1, 1, 1, int(signal.SIGKILL)]] * 2


@pytest.mark.distributed
def test_second_sigint_aborts_at_once_even_inside_a_collective(tmp_path, session_demo_dir):
    """Ctrl-C twice on a rank blocked in a gloo all-reduce (its peer hangs): Python cannot run a handler until the
    collective returns, so the wakeup-pipe thread aborts it (exit 130) right after the second SIGINT."""
    import json

    from helpers import fault_runs as F

    args = ["checkpoint.interval=2", "monitor.faults=[{step: 3, kind: hang, rank: 1, phase: forward_backward}]"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "megagate"]
    cmd += ["train", "--config", str(T.CONFIG), *T.BASE, f"data.demo_dir={session_demo_dir}", f"output.dir={tmp_path}"]
    proc = subprocess.Popen(
        [*cmd, *args],
        cwd=T.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    try:
        deadline, record = time.monotonic() + 600, {}
        while time.monotonic() < deadline and proc.poll() is None:
            folders = F.launches(tmp_path)
            path = folders[-1] / "rank00000.json" if folders else None
            if path is not None and path.exists():
                record = json.loads(path.read_text())
                if record["step"] == 3 and record["waiting"] and record["phase"] == "grad_sync":
                    break
            time.sleep(0.05)
        assert record.get("waiting") and record["where"].startswith("torch/distributed/"), record
        pid = record["pid"]
        os.kill(pid, signal.SIGINT)
        time.sleep(1.0)
        assert Path(f"/proc/{pid}").exists()  # the first one only asks for a stop checkpoint
        os.kill(pid, signal.SIGINT)
        sent = time.monotonic()
        while Path(f"/proc/{pid}").exists() and time.monotonic() - sent < 10:
            stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}").exists() else ""
            if stat and stat.rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.02)
        aborted_in = time.monotonic() - sent
        # the peer hangs on purpose and takes SIGTERM as "save, then stop": torchrun would wait its 30 s close
        # timeout before killing it; that wait is torchrun's, not under test here. Killed only once torchrun has
        # reaped rank 0: a thread-group leader reads "Z" while its other threads still exit, and a peer killed then
        # is the first failure torchrun sees (its -9, not rank 0's 130, in the summary)
        reaped = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < reaped:
            time.sleep(0.02)
        with contextlib.suppress(ProcessLookupError):
            os.kill(F.record(F.launches(tmp_path)[-1], 1)["pid"], signal.SIGKILL)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert aborted_in < 2.0, aborted_in
    assert "megagate: second interrupt: aborting now (nothing saved)" in output
    assert "exitcode  : 130" in output, output[-3000:]
    assert no_orphans(proc.pid) == {}  # torchrun led its own process group
    from megagate import checkpoint as ckpt

    root = tmp_path / "checkpoints"  # the checkpoint of step 2 is the newest, intact
    assert [p.name for _, p in ckpt.complete_checkpoints(root)] == ["iter_0000002"]
    assert ckpt.verify(root / "iter_0000002", collective=False) is None
