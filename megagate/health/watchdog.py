"""The hang watchdog: a thread on every rank that publishes its progress and ends a hung job well before the
collective timeout, with every rank's stacks and one line naming the ranks the others wait for.

Once per `heartbeat_s` the thread writes this rank's record (step, phase, time in it, whether the main thread waits
for other ranks and where: megagate.health.stacks) and lists the launch folder (megagate.health.channel). When this
rank's phase has run past its limit (`limit`), or another rank declared a hang:

1. it dumps every thread's Python stack to stacks-rankNNNNN.txt (the main thread may be blocked in a collective:
   it has released the GIL, this thread runs);
2. the first rank to get there (it creates hang.json) waits a few heartbeats for the others to dump and to write
   fresh records, reads them twice, and writes the diagnosis (megagate.health.diagnosis): one line on stderr, in
   diagnosis.json, in health.jsonl and, under the Slurm batch script, in its failure file; ranks on its host that
   stopped responding (SIGSTOP) are killed;
3. every rank exits with HANG_EXIT_CODE (os._exit from this thread: the main thread cannot be unblocked): the
   others after the diagnosis is written (or `grace_s`), the diagnosing rank last. Under srun the first exit takes
   the step down; torchrun stops its remaining workers; the Slurm script requeues.

A rank whose run failed (an exception leaving `megagate train` mid-run) publishes a failure record
(`publish_failure`); the other ranks exit as soon as their thread sees it (PEER_EXIT_CODE, nothing printed: the
failing rank printed the one line), instead of waiting in a collective for a rank that is gone.

A rank that vanished without a word (SIGKILL, often the OOM killer; a lost node) breaks the others' collectives
("Connection closed by peer"). Each surviving rank then names it (`peer_lost`): a rank on this host whose process is
gone, or a rank whose record stopped changing; the first survivor to decide writes lost.json and every survivor
prints that one line, and exits with PEER_LOST_EXIT_CODE (not HANG_EXIT_CODE, not a failure of its own).

If the main thread holds the GIL while stuck (a C extension that never releases it), this thread cannot run: a
faulthandler timer, re-armed at every heartbeat, dumps the stacks to stderr and exits the process after the limit.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from megagate.distributed.utils import barrier, broadcast_object, get_rank, get_world_size, host_name
from megagate.health import stacks
from megagate.health.channel import Channel, append_event, describe, launch_name, write_failure_file
from megagate.health.config import WatchdogConfig
from megagate.health.diagnosis import diagnose, lost_a_peer
from megagate.health.lost import vanished_line
from megagate.health.progress import PROGRESS, TIMED_PHASES, Snapshot

HANG_EXIT_CODE = 75  # EX_TEMPFAIL: the job may succeed when rerun (requeued)
PEER_EXIT_CODE = 2  # another rank failed and printed why
PEER_LOST_EXIT_CODE = 76  # another rank's process vanished without a word (killed: SIGKILL, the OOM killer, a node)
BACKSTOP_MARGIN_S = 30.0


def limit(cfg: WatchdogConfig, snap: Snapshot) -> float | None:
    """Seconds the current phase may last (None: no limit)."""
    if snap.phase == "end":
        return None
    floors = cfg.floors
    first = False  # the first steps of a launch, and the first save / load / evaluation: warm-up (imports,
    if snap.phase in TIMED_PHASES:  # compilation, first collectives; a first save imports torch in megatron's
        done = snap.counts.get(snap.phase, 0)  # writer process), which also does not size the later limits
        first = done == 0
        reference = snap.last_s.get(snap.phase, 0.0) if done >= 2 else 0.0
    else:
        first = snap.step <= snap.start_step + cfg.warmup_steps
        reference = snap.recent_step_s
    seconds = max(floors.get(snap.phase, max(floors.values())), cfg.step_multiple * reference)
    if snap.phase == "setup" or first:
        seconds = max(seconds, cfg.warmup_s)
    return seconds


def _process_start(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _gone_here(records: dict, me: int) -> list[int]:
    """Ranks on this host whose process is gone (or is another process now)."""
    here = socket.gethostname()
    gone = []
    for rank, rec in sorted(records.items()):
        pid = rec.get("pid")
        if rank != me and rec.get("pid_host") == here and isinstance(pid, int):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                fields = []
            # gone, another process now, or dead and not yet reaped by its launcher (a zombie)
            if len(fields) < 20 or fields[19] != rec.get("pid_start") or fields[0] in ("Z", "X"):
                gone.append(rank)
    return gone


class Watchdog:
    """The watchdog thread of one rank (`start()` once the launch folder name is agreed, `stop()` at the end)."""

    def __init__(self, cfg: WatchdogConfig, run_dir: str | os.PathLike, rank: int, world_size: int, launch: str):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.run_dir = Path(run_dir)
        self.channel = Channel(run_dir, launch, rank)
        self.host = host_name()
        self._beat = 0
        self._state = "running"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- life cycle --------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.channel.create()
        if self.rank == 0:
            self.channel.prune()
        self._publish(PROGRESS.snapshot())
        self._thread = threading.Thread(target=self._run, name="megagate-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        global _current
        if _current is self:
            _current = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.cfg.heartbeat_s)
        with contextlib.suppress(Exception):
            faulthandler.cancel_dump_traceback_later()

    def stop_idle(self) -> None:
        """Stop after a launch that trained no step (the run was already complete): its launch folder goes too, so a
        rerun of a finished run leaves every file of the run as it was."""
        self.stop()
        with contextlib.suppress(OSError):
            self.channel.record_path(self.rank).unlink()
        barrier()  # every rank's record is gone before rank 0 removes the (then empty) folders
        if self.rank == 0:
            for folder in (self.channel.dir, self.channel.root):
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only if empty: an older launch's folder keeps the root

    def publish_failure(self, error: BaseException) -> None:
        """This rank is leaving mid-run with `error`: tell the other ranks (they exit) and the batch script."""
        snap = PROGRESS.snapshot()
        if snap.phase == "end" or self.world_size == 1:  # the run ended in agreement (an abort after the final
            return  # checkpoint), or there is nobody to tell: the CLI's line is the whole story
        if lost_a_peer(error):  # a rank died silently (SIGKILL, a lost node): srun / torchrun name it, not this one
            return
        message = (str(error).strip().splitlines() or [type(error).__name__])[0]
        record = {
            "rank": self.rank,
            "host": self.host,
            "phase": snap.phase,
            "step": snap.step,
            "error": f"{type(error).__name__}: {message}" if not message.startswith("rank ") else message,
            "time": time.time(),
        }
        with contextlib.suppress(OSError):
            self.channel.publish_failure(record)
            append_event(self.run_dir, {"kind": "failure", **record})
        write_failure_file(f"rank {self.rank} ({self.host}) failed: {record['error']}", [self.host], "failure")

    def collateral_exit(self) -> int | None:
        """The exit code when this rank's error only follows another rank's fault (None: it is this rank's own).

        A declared hang: the diagnosing rank's exit breaks the others' collectives (gloo: "Connection closed by
        peer"); they leave as the watchdog would, once their stacks are dumped. Another rank's failure: that rank
        printed the error line; this one exits without a second one.
        """
        hang, failed = self.channel.events_seen()
        if hang:
            deadline = time.monotonic() + self.cfg.grace_s + 2 * self.cfg.heartbeat_s
            while not self.channel.stacks_path(self.rank).exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            return HANG_EXIT_CODE
        return PEER_EXIT_CODE if failed else None

    def peer_lost(self, error: BaseException, resume_from: str | None) -> int | None:
        """PEER_LOST_EXIT_CODE after one line naming the rank that vanished, when `error` only says a peer is gone
        (None: this rank's own error). `resume_from`: the checkpoint a rerun starts from (None: from scratch)."""
        if not lost_a_peer(error) or self.world_size == 1:
            return None
        event = self.channel.lost()
        if event is None:
            before = self.channel.records()
            gone = _gone_here(before, self.rank)
            after = before
            if not gone:
                # on another host: a rank whose record stops changing over a few heartbeats. On this host too: a
                # killed process closes its sockets before /proc shows it exited, so its pid is checked again.
                settle = time.monotonic() + 2.5 * self.cfg.heartbeat_s + 0.5
                while time.monotonic() < settle and self.channel.lost() is None:
                    time.sleep(min(0.1, self.cfg.heartbeat_s / 4))
                    gone = _gone_here(before, self.rank)
                    if gone:
                        break
                after = self.channel.records()
            event = self.channel.lost()
            if event is None:
                line, ranks, hosts = vanished_line(before, after, gone, self.rank, self.world_size, resume_from)
                event = {"kind": "peer_lost", "detected_by": self.rank, "line": line, "ranks": ranks, "hosts": hosts}
                if self.channel.claim_lost(event):
                    with contextlib.suppress(OSError):
                        append_event(self.run_dir, {**event, "time": time.time(), "launch": self.channel.launch})
                    write_failure_file(line, hosts or [self.host], "peer_lost")
                event = self.channel.lost() or event
        print(f"megagate train: error: {event['line']}", file=sys.stderr, flush=True)
        return PEER_LOST_EXIT_CODE

    # --- the thread ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        reported = False
        while not self._stop.wait(self.cfg.heartbeat_s):
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - a broken watchdog must not end training
                if not reported:
                    print(f"megagate watchdog (rank {self.rank}): {type(exc).__name__}: {exc}", file=sys.stderr)
                    reported = True

    def _tick(self) -> None:
        snap = PROGRESS.snapshot()
        age = time.monotonic() - snap.since
        seconds = limit(self.cfg, snap)
        self._publish(snap)
        hang, failed = self.channel.events_seen()
        if failed and snap.phase != "end":
            os._exit(PEER_EXIT_CODE)
        if hang or (seconds is not None and age > seconds):
            self._hang(snap, age, seconds)
        self._arm_backstop(seconds, age)

    def _publish(self, snap: Snapshot) -> None:
        self._beat += 1
        waiting, where = stacks.main_thread_position()
        self.channel.write_record(
            {
                "launch": self.channel.launch,
                "rank": self.rank,
                "host": self.host,
                "pid": os.getpid(),
                "pid_host": socket.gethostname(),
                "pid_start": _process_start(os.getpid()),
                "beat": self._beat,
                "time": time.time(),
                "state": self._state,
                "phase": snap.phase,
                "step": snap.step,
                "phase_age": round(time.monotonic() - snap.since, 3),
                "limit": limit(self.cfg, snap),
                "waiting": waiting,
                "where": where,
                "stage": PROGRESS.stage,
                "steps_done": snap.steps_done,
                "recent": [[step, round(c, 6), round(w, 6)] for step, c, w in snap.recent],
                "totals": [[step, round(t, 6)] for step, t in snap.totals],
                "arrivals": [[step, round(t, 6)] for step, t in snap.arrivals],
                "last_s": snap.last_s,
            }
        )

    def _arm_backstop(self, seconds: float | None, age: float) -> None:
        if seconds is None:
            faulthandler.cancel_dump_traceback_later()
            return
        remaining = max(0.0, seconds - age) + self.cfg.grace_s + 5 * self.cfg.heartbeat_s + BACKSTOP_MARGIN_S
        faulthandler.dump_traceback_later(remaining, repeat=False, file=sys.stderr, exit=True)

    # --- a hang --------------------------------------------------------------------------------------------------
    def _hang(self, snap: Snapshot, age: float, seconds: float | None) -> None:
        faulthandler.cancel_dump_traceback_later()
        me = f"rank {self.rank} ({self.host})"
        header = f"megagate watchdog: {me}, {snap.phase} of step {snap.step} for {age:.1f} s"
        stacks.dump(self.channel.stacks_path(self.rank), header)
        self._state = "dumped"
        self._publish(snap)
        first = self.channel.claim_hang(
            {"rank": self.rank, "host": self.host, "phase": snap.phase, "step": snap.step, "age": age, "limit": seconds}
        )
        if not first:  # another rank diagnoses: wait for its line (so a launcher that kills the job on the first
            deadline = time.monotonic() + self.cfg.grace_s  # exit does not cut it off), then go
            while self.channel.diagnosis() is None and time.monotonic() < deadline:
                time.sleep(self.cfg.heartbeat_s)
                self._publish(PROGRESS.snapshot())
            os._exit(HANG_EXIT_CODE)
        print(
            f"megagate watchdog: {me} has been in {snap.phase} of step {snap.step} for {age:.0f} s (limit "
            f"{seconds or 0:.0f} s): dumping every rank's stacks to {self.channel.dir}",
            file=sys.stderr,
            flush=True,
        )
        before = self.channel.records()
        settle = time.monotonic() + 2.5 * self.cfg.heartbeat_s + 0.5
        while time.monotonic() < settle:
            time.sleep(self.cfg.heartbeat_s / 2)
            self._publish(PROGRESS.snapshot())
        after = self.channel.records()
        result = diagnose(before, after, self.world_size, str(self.channel.dir))
        record = {"kind": "hang", "detected_by": self.rank, "phase": snap.phase, "step": snap.step, **result.to_dict()}
        with contextlib.suppress(OSError):
            self.channel.write_diagnosis(record)
            append_event(self.run_dir, {**record, "time": time.time(), "launch": self.channel.launch})
        write_failure_file(result.line, list(result.hosts) or [self.host], "hang")
        print(f"megagate train: error: {result.line}", file=sys.stderr, flush=True)
        self._kill_stopped(after, result.culprits)
        os._exit(HANG_EXIT_CODE)

    def _kill_stopped(self, records: dict, culprits: tuple[int, ...]) -> None:
        """SIGKILL culprits on this host that stopped responding: nothing else would end a SIGSTOPped process."""
        for rank in culprits:
            rec = records.get(rank, {})
            pid = rec.get("pid")
            if rank == self.rank or rec.get("pid_host") != socket.gethostname() or not isinstance(pid, int):
                continue
            if rec.get("state") == "dumped" or _process_start(pid) != rec.get("pid_start"):
                continue  # it answered (it exits by itself), or the pid is another process now
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                print(f"megagate watchdog: killed {describe(rec)} (pid {pid}): it stopped responding", file=sys.stderr)


_current: Watchdog | None = None


def current() -> Watchdog | None:
    """The running watchdog of this process (None: not started, or disabled)."""
    return _current


def agreed_launch_name() -> str:
    """Rank 0's name for this launch's folder, on every rank (one broadcast at start-up, none later)."""
    return broadcast_object(launch_name(time.time(), os.urandom(3).hex()))


def start(cfg: WatchdogConfig, run_dir: str | os.PathLike) -> Watchdog | None:
    """The watchdog of this rank of an initialised process group (None when `watchdog.enabled` is false)."""
    if not cfg.enabled:
        return None
    rank, world = get_rank(), get_world_size()
    # setup's age counts from this run's start, not from the import of progress (a long-lived or forked process:
    # an API user's second run, a pre-loaded fork server's child)
    PROGRESS.reset()
    dog = Watchdog(cfg, run_dir, rank, world, agreed_launch_name())
    dog.start()
    global _current
    _current = dog
    return dog
