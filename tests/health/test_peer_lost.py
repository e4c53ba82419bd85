"""A rank that vanished (killed without a word) is named in one line by every survivor, which exits with
PEER_LOST_EXIT_CODE: the watchdog's `peer_lost` on a real launch folder, with a real killed process as the lost rank
(tests/health/test_drills.py has the same under torchrun)."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from pathlib import Path

from megagate.health import channel
from megagate.health.config import WatchdogConfig
from megagate.health.watchdog import PEER_LOST_EXIT_CODE, Watchdog, _process_start

LAUNCH = "20250101-000000-aa"
GLOO = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")


def write(path: Path, data: dict) -> None:
    """A progress record as the watchdog leaves it (a whole file; the tests write before anyone reads)."""
    path.write_text(json.dumps(data))


def record(rank: int, pid: int, step: int, phase: str, beat: int = 1, host: str | None = None) -> dict:
    here = socket.gethostname()
    return {"rank": rank, "host": host or here, "pid": pid, "pid_host": host or here, "beat": beat,
            "pid_start": _process_start(pid), "phase": phase, "step": step}  # fmt: skip


def test_a_killed_rank_on_this_host_is_named_by_every_survivor(tmp_path, capsys):
    victim = subprocess.Popen(["sleep", "60"])
    lost_rank = record(1, victim.pid, 17, "forward_backward")
    victim.kill()
    victim.wait()
    cfg = WatchdogConfig(heartbeat_s=0.1)
    dogs = [Watchdog(cfg, tmp_path, r, 3, LAUNCH) for r in (0, 2)]
    dogs[0].channel.create()
    write(dogs[0].channel.record_path(1), lost_rank)
    for dog in dogs:
        write(dog.channel.record_path(dog.rank), record(dog.rank, 1, 17, "grad_sync"))
    assert dogs[0].peer_lost(ValueError("bad value"), None) is None  # this rank's own error: not a lost peer
    assert [dog.peer_lost(GLOO, "run/checkpoints/iter_0000016") for dog in dogs] == [PEER_LOST_EXIT_CODE] * 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    host = socket.gethostname()
    assert (
        lines
        == [
            f"megagate train: error: peer lost: rank 1 ({host}) vanished in forward_backward of step 17: killed by a "
            "signal (the launcher's summary names it; SIGKILL is often the kernel's OOM killer); the job stops; a rerun "
            "resumes from run/checkpoints/iter_0000016"
        ]
        * 2
    )
    (event,) = channel.read_events(tmp_path, "peer_lost")
    assert event["ranks"] == [1] and event["detected_by"] == 0 and event["hosts"] == [host]


def test_a_rank_on_another_host_is_named_when_its_record_stops(tmp_path, capsys):
    cfg = WatchdogConfig(heartbeat_s=0.1)
    dog = Watchdog(cfg, tmp_path, 0, 2, LAUNCH)
    dog.channel.create()
    write(dog.channel.record_path(1), record(1, 999999, 9, "optimizer", host="node7"))
    started = time.monotonic()
    assert dog.peer_lost(GLOO, None) == PEER_LOST_EXIT_CODE
    assert time.monotonic() - started >= 2.5 * cfg.heartbeat_s  # it read the records twice, heartbeats apart
    assert capsys.readouterr().err.strip() == (
        "megagate train: error: peer lost: rank 1 (node7) vanished in optimizer of step 9: its progress record "
        "stopped changing (its process or node is gone); the job stops; no checkpoint yet: a rerun starts from scratch"
    )


def test_a_rank_still_exiting_when_the_error_arrives_is_named_as_killed(tmp_path, capsys):
    """A killed process closes its sockets before /proc shows it gone: the survivor's error can arrive while the
    victim's pid still looks alive. It is looked at again while the records settle (CI saw this race under load)."""
    victim = subprocess.Popen(["sleep", "60"])
    cfg = WatchdogConfig(heartbeat_s=1.0)
    dog = Watchdog(cfg, tmp_path, 0, 2, LAUNCH)
    dog.channel.create()
    write(dog.channel.record_path(1), record(1, victim.pid, 5, "forward_backward"))
    killer = threading.Timer(0.4, lambda: (victim.kill(), victim.wait()))
    killer.start()
    started = time.monotonic()
    assert dog.peer_lost(GLOO, None) == PEER_LOST_EXIT_CODE
    killer.join()
    assert time.monotonic() - started < 2.0  # it stopped waiting once the pid was gone
    assert "vanished in forward_backward of step 5: killed by a signal" in capsys.readouterr().err
