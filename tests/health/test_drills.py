"""Health drills on real processes (torchrun, gloo, real signals): a rank that stalls part of every second, a rank
killed mid-run (2 and 4 ranks), the logging rank stopped. Each asserts that megagate names the right rank.

The figures (time from the fault to the line, the reported shares) are printed for the closing notes; bounds here
only tell the report from its absence (load-dependent tolerances belong in benchmarks).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import fault_runs as F
from helpers import tiny_runs as T
from megagate.health import channel, watchdog

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


class Job:
    """A torchrun launch whose output is read as it comes (a long run would fill the pipe and block the ranks)."""

    def __init__(self, proc: subprocess.Popen, marker: str) -> None:
        self.proc, self.marker, self.lines = proc, marker, []
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        self._reader.start()

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> str:
        """The whole output once torchrun has ended."""
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=30)
        return "".join(self.lines)

    def end(self) -> None:
        """Stop what is left: torchrun and its ranks (they run in sessions of their own), the writers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the ranks stop at a step boundary and exit
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        for pid in F.live_processes(self.marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@contextlib.contextmanager
def launched(out: Path, demo_dir: Path, nproc: int, *overrides: str) -> Iterator[Job]:
    """`megagate train` under torchrun, in its own session; ended with its ranks if still running at the end."""
    args = ["--config", str(T.CONFIG), *T.BASE, f"data.demo_dir={demo_dir}", f"output.dir={out}", *overrides]
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "megagate"]
        + ["train", *args],
        cwd=T.ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    job = Job(proc, f"output.dir={out}")
    try:
        yield job
    finally:
        job.end()


def wait_for_step(proc: Job, out: Path, rank: int, step: int, timeout: float = 300) -> dict:
    """The rank's progress record once it trains `step` (the run still going)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        folders = F.launches(out)
        path = folders[-1] / f"rank{rank:05d}.json" if folders else None
        try:
            record = json.loads(path.read_text()) if path is not None else None
        except (OSError, ValueError):  # not written yet (records are renamed into place: never half a file)
            record = None
        if record is not None and record["step"] >= step:
            return record
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} did not reach step {step}: {proc.poll()}")


def test_a_rank_stalling_half_of_every_second_is_named_at_default_settings(tmp_path, session_demo_dir):
    """SIGSTOP for 0.45 s of every second on rank 1 (a noisy neighbour, host pauses): its fastest step stays normal,
    the others wait for it; reported naming rank 1 at the default straggler settings (interval 20, margin 0.25,
    3 windows), within 60 s of the first stall."""
    out = tmp_path / "run"
    with launched(out, session_demo_dir, 2, "train.train_steps=100000", "logging.interval=10") as proc:
        record = wait_for_step(proc, out, 1, 3)
        pid, stop = record["pid"], threading.Event()

        def duty_cycle() -> None:
            while not stop.is_set():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                time.sleep(0.45)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                stop.wait(0.55)

        stalled_at, stalled_step = time.time(), wait_for_step(proc, out, 0, 0)["step"]
        staller = threading.Thread(target=duty_cycle, daemon=True)
        staller.start()
        reports: list[dict] = []
        try:
            while time.time() < stalled_at + 120 and proc.poll() is None and not reports:
                reports = [r for r in F.events(out, "straggler") if r["step"] > stalled_step]
                time.sleep(0.2)
        finally:
            stop.set()
            staller.join()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        seen = time.time()
    assert reports, f"no straggler report in {seen - stalled_at:.0f} s"
    first = reports[0]
    steps = first["step"] - stalled_step
    print(
        f"duty-cycle drill: reported {seen - stalled_at:.1f} s ({steps} steps) after the first stall: {first.get('line')}"
    )
    # the first report names rank 1 (later ones on a machine loaded by other jobs may name a descheduled rank 0)
    assert (first["rank"], first["host"]) == (1, watchdog.host_name()), reports
    assert first["pattern"] == "intermittent" and first["ratio"] < 1.25, first  # the fastest step saw nothing
    assert first["blame"] > 0.5 and first["slowdown"] > 1.25, first
    assert seen - stalled_at < 60, (first, stalled_step, seen - stalled_at)


def peer_lost_lines(log: str) -> list[str]:
    return [
        line[line.index("megagate train: error:") :] for line in log.splitlines() if "megagate train: error:" in line
    ]


@pytest.mark.parametrize("nproc", [2, 4])
def test_a_killed_rank_is_named_in_one_line_by_every_survivor(tmp_path, session_demo_dir, nproc):
    """SIGKILL of rank 1 mid-run (what the OOM killer does): each surviving rank prints the same one line naming
    rank 1, its host, its step and phase and the checkpoint a rerun resumes from, and exits PEER_LOST_EXIT_CODE;
    no gloo traceback."""
    out = tmp_path / "run"
    overrides = ["train.train_steps=100000", "checkpoint.interval=2", "checkpoint.keep_last=1"]
    with launched(out, session_demo_dir, nproc, *overrides) as proc:
        record = wait_for_step(proc, out, 1, 4)
        os.kill(record["pid"], signal.SIGKILL)
        killed = time.time()
        log = proc.wait(timeout=120)
    ended = time.time()
    if os.environ.get("MEGAGATE_DRILL_LOG"):
        Path(os.environ["MEGAGATE_DRILL_LOG"]).write_text(log)
    lines = peer_lost_lines(log)
    print(f"killed rank of {nproc}: the job ended {ended - killed:.1f} s later; {lines[:1]}")
    host = watchdog.host_name()
    assert lines and all(line == lines[0] for line in lines), log[-4000:]
    line = lines[0]
    assert line.startswith(f"megagate train: error: peer lost: rank 1 ({host}) vanished in "), line
    assert "killed by a signal (the launcher's summary names it; SIGKILL is often the kernel's OOM killer)" in line
    assert "; the job stops; a rerun resumes from " in line and f"{out}/checkpoints/iter_" in line, line
    assert "Connection closed by peer" not in log and "Connection reset by peer" not in log, log[-4000:]
    (event,) = F.events(out, "peer_lost")
    assert event["ranks"] == [1] and event["hosts"] == [host], event
    lost = json.loads((F.launches(out)[-1] / channel.LOST).read_text())
    assert f"megagate train: error: {lost['line']}" == line
    assert f"exitcode  : {watchdog.PEER_LOST_EXIT_CODE}" in log or len(lines) == nproc - 1, log[-3000:]
    assert F.live_processes(str(out)) == {}


def test_the_stopped_logging_rank_is_named(tmp_path, session_demo_dir):
    """SIGSTOP on rank 0 (it logs, and hosts the store): rank 1 names it as not responding and the job ends."""
    out = tmp_path / "run"
    with launched(out, session_demo_dir, 2, *F.WATCHDOG, "train.train_steps=100000") as proc:
        record = wait_for_step(proc, out, 0, 4)
        os.kill(record["pid"], signal.SIGSTOP)
        stopped = time.time()
        try:
            log = proc.wait(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(record["pid"], signal.SIGCONT)
    ended = time.time()
    diagnosis = json.loads((F.launches(out)[-1] / "diagnosis.json").read_text())
    print(f"stopped rank 0: the job ended {ended - stopped:.1f} s later: {diagnosis['line']}")
    assert diagnosis["ranks"] == [0] and diagnosis["detected_by"] == 1, diagnosis
    assert f"rank 0 ({watchdog.host_name()}) did not arrive: not responding" in diagnosis["line"]
    assert f"megagate train: error: {diagnosis['line']}" in log
    assert F.live_processes(str(out)) == {}
