"""Cluster-fault runs for tests: `megagate train` under torchrun with injected hangs, slow ranks and failed I/O, and
readers for what the watchdog leaves in the run folder (megagate.health.channel).

(A uniquely named module, like trainer_runs.py, so it does not clash with other folders' helpers.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from helpers import tiny_runs as T
from megagate.health import channel

# Watchdog limits a test can wait out: 5 s for the phases of a step (a tiny step takes 0.1-1 s here), 10 s for a
# save (0.2-0.5 s here), the warm-up (first steps, first save: megatron's writer process imports torch, 15-20 s on
# the loaded 2-core test machine) 60 s.
WATCHDOG = [
    "watchdog.floor_s={data: 5, forward_backward: 5, grad_sync: 5, optimizer: 5, after_step: 5, save: 10}",
    "watchdog.warmup_steps=1",
    "watchdog.warmup_s=60",
    "watchdog.heartbeat_s=1",
    "watchdog.grace_s=10",
]
# the settle (2.5 heartbeats + 0.5 s), a heartbeat of detection delay and the processes' exit, plus slack for the
# loaded test machine (2 cores shared by up to 8 agents: load averages of 60-140 measured)
EXIT_MARGIN_S = 4.0 + 11.0


@dataclass(frozen=True)
class Launch:
    rc: int
    log: str
    started: float  # time.time()
    ended: float  # torchrun ended
    workers_ended: float  # the last time a training process of the run (a rank or its writer) was seen alive


def torchrun(out: Path, demo_dir: Path, nproc: int, *overrides: str, timeout: float = 900) -> Launch:
    """One launch of the tiny run under `torchrun --standalone` (its own process group, killed if it overstays)."""
    args = ["--config", str(T.CONFIG), *T.BASE, f"data.demo_dir={demo_dir}", f"output.dir={out}", *overrides]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    started = time.time()
    marker = f"output.dir={out}"
    seen = {"last": started}
    done = threading.Event()

    def watch() -> None:  # when did the ranks (not torchrun, which outlives them) end?
        while not done.is_set():
            if any("torch.distributed.run" not in cmd for cmd in live_processes(marker).values()):
                seen["last"] = time.time()
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    proc = subprocess.Popen(
        [*cmd, "-m", "megagate", "train", *args],
        cwd=T.ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise AssertionError(f"torchrun did not end in {timeout} s:\n{log[-4000:]}") from None
    finally:
        done.set()
        watcher.join()
    return Launch(proc.returncode, log, started, time.time(), seen["last"])


def launches(out: Path) -> list[Path]:
    """The watchdog's launch folders of a run, oldest first."""
    root = out / channel.WATCHDOG_DIR
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def record(folder: Path, rank: int) -> dict:
    """A rank's last progress record in a launch folder (its step, phase, recent compute/wait times)."""
    return channel.Channel(folder.parent.parent, folder.name, rank).records()[rank]


def events(out: Path, kind: str) -> list[dict]:
    return channel.read_events(out, kind)


def live_processes(marker: str) -> dict[int, str]:
    """pid -> command line of the live processes whose command line contains `marker` (e.g. the output dir)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state not in ("Z", "X"):
            found[int(entry.name)] = cmd
    return found
