"""megagate.health's pure parts and its files: config refusals, phase tracking, limits, the hang diagnosis, straggler
windows, the side channel, stack classification; the cluster fault kinds' validation and injection points."""

from __future__ import annotations

import errno
import json
import threading
import time

import pytest

from megagate.errors import ConfigError
from megagate.health import channel, progress, stacks
from megagate.health.config import DEFAULT_FLOORS, StragglerConfig, WatchdogConfig
from megagate.health.diagnosis import diagnose, lost_a_peer
from megagate.health.progress import Progress, Snapshot
from megagate.health.straggler import StragglerDetector
from megagate.health.watchdog import limit
from megagate.monitor import process_faults
from megagate.monitor.faults import Fault


# --- config ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "values, message",
    [
        ({"floor_s": {"forward": 5}}, "watchdog.floor_s.forward is not a phase with a limit; phases: setup, load,"),
        ({"floor_s": {"save": -1}}, "watchdog.floor_s.save=-1.0 must be a positive number"),
        ({"floor_s": {"save": "long"}}, "watchdog.floor_s.save='long' must be a number of seconds"),
        ({"step_multiple": 0}, "watchdog.step_multiple=0.0 must be a positive number"),
        ({"heartbeat_s": 4, "floor_s": {"data": 5}}, "watchdog.heartbeat_s=4 is too long for the shortest phase"),
        ({"warmup_steps": -1}, "watchdog.warmup_steps=-1 must be a non-negative integer"),
        ({"enabled": "yes"}, "watchdog.enabled='yes' must be true or false"),
        ({"limit": 3}, "watchdog.limit is not a known key; allowed: enabled, floor_s, grace_s, heartbeat_s,"),
    ],
)
def test_watchdog_config_refusals(values, message):
    with pytest.raises(ConfigError) as info:
        WatchdogConfig.from_dict(values)
    assert str(info.value).startswith(message), str(info.value)


def test_straggler_config_refusals_and_defaults():
    assert StragglerConfig.from_dict(None) == StragglerConfig(True, 20, 0.25, 3)
    for values, message in [
        ({"interval": 0}, "straggler.interval=0 must be a positive number of steps"),
        ({"margin": -0.1}, "straggler.margin=-0.1 must be a positive number"),
        ({"windows": 0}, "straggler.windows=0 must be a positive integer"),
    ]:
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            StragglerConfig.from_dict(values)


# --- limits ---------------------------------------------------------------------------------------------------------
def snap(phase: str, step: int, **kw) -> Snapshot:
    base = dict(since=0.0, steps_done=step, start_step=0, recent_step_s=0.0, last_s={}, counts={}, recent=())
    return Snapshot(phase=phase, step=step, **{**base, **kw})


def test_limits_follow_step_time_with_floors_and_warmup():
    cfg = WatchdogConfig(floor_s={"forward_backward": 5, "save": 8}, warmup_steps=2, warmup_s=100, step_multiple=10)
    assert limit(cfg, snap("setup", 0)) == 1200  # setup's default floor (> warm-up here)
    assert limit(cfg, snap("forward_backward", 2)) == 100  # a warm-up step
    assert limit(cfg, snap("forward_backward", 3, recent_step_s=0.2)) == 5  # the floor
    assert limit(cfg, snap("forward_backward", 3, recent_step_s=2.0)) == 20  # 10 x the recent step time
    assert limit(cfg, snap("forward_backward", 5, start_step=4)) == 100  # the first step after a resume
    assert limit(cfg, snap("save", 30)) == 100  # the first save of a launch: warm-up
    assert limit(cfg, snap("save", 30, last_s={"save": 30.0}, counts={"save": 1})) == 8  # later saves: the floor
    assert limit(cfg, snap("save", 30, last_s={"save": 3.0}, counts={"save": 2})) == 30  # or 10 x the previous
    # (not the first save's: it warmed up)
    assert limit(cfg, snap("data", 9, recent_step_s=1.0)) == max(DEFAULT_FLOORS["data"], 10)
    assert limit(cfg, snap("end", 9)) is None


def test_progress_times_phases_steps_and_listeners():
    p = Progress()
    seen = []
    p.add_listener(lambda phase, step: seen.append((phase, step)))
    p.resumed_at(4)
    p.step_started(5)
    p.enter("forward_backward")
    time.sleep(0.05)
    p.enter("grad_sync")
    time.sleep(0.02)
    p.enter("optimizer")
    p.step_finished()
    with_save = p.snapshot()
    assert (with_save.phase, with_save.step, with_save.start_step, with_save.steps_done) == ("after_step", 5, 4, 1)
    ((step, compute, wait),) = with_save.recent
    assert step == 5 and 0.05 <= compute < 0.5 and 0.02 <= wait < 0.5
    assert with_save.recent_step_s >= 0.07
    p.enter("save")
    time.sleep(0.01)
    p.enter("after_step")
    assert "save" not in p.snapshot().last_s  # a save is timed by the checkpointer, to its completion
    p.record("save", 2.5)
    assert p.snapshot().last_s["save"] == 2.5 and p.snapshot().counts["save"] == 1
    p.enter("evaluation")
    time.sleep(0.01)
    p.enter("after_step")
    assert p.snapshot().last_s["evaluation"] >= 0.01 and p.snapshot().counts["evaluation"] == 1
    assert seen == [("data", 5), ("forward_backward", 5), ("grad_sync", 5), ("optimizer", 5), ("after_step", 5)] + [
        ("save", 5),
        ("after_step", 5),
        ("evaluation", 5),
        ("after_step", 5),
    ]


def test_within_returns_to_the_phase_before():
    progress.PROGRESS.reset()
    progress.enter("after_step", 3)
    with progress.within("evaluation"):
        assert progress.PROGRESS.phase == "evaluation"
    assert (progress.PROGRESS.phase, progress.PROGRESS.step) == ("after_step", 3)
    wrapped = progress.marking("grad_sync", lambda x: progress.PROGRESS.phase + x)
    assert wrapped("!") == "grad_sync!"
    progress.PROGRESS.reset()


# --- the diagnosis --------------------------------------------------------------------------------------------------
def rec(
    rank,
    beat,
    phase="grad_sync",
    step=5,
    waiting=True,
    where="torch/distributed/distributed_c10d.py:2942 in all_reduce",
):
    return {
        "rank": rank,
        "host": f"node{rank // 2 + 1}",
        "beat": beat,
        "phase": phase,
        "step": step,
        "waiting": waiting,
        "where": where,
        "phase_age": 12.0,
    }


def test_diagnosis_names_the_busy_rank_and_where_the_others_wait():
    busy = rec(3, 9, "forward_backward", waiting=False, where="megagate/monitor/process_faults.py:89 in _hang")
    before = {0: rec(0, 1), 1: rec(1, 1), 2: rec(2, 1), 3: {**busy, "beat": 7}}
    after = {0: rec(0, 4), 1: rec(1, 4), 2: rec(2, 3), 3: busy}
    d = diagnose(before, after, 4, "/run/watchdog/x")
    assert d.culprits == (3,) and d.hosts == ("node2",) and d.waiting == (0, 1, 2)
    assert d.line == (
        "hang: rank 3 (node2) did not arrive: forward_backward of step 5 for 12 s, busy in "
        "megagate/monitor/process_faults.py:89 in _hang; ranks 0,1,2 wait in grad_sync of step 5 "
        "(torch/distributed/distributed_c10d.py:2942 in all_reduce); stacks in /run/watchdog/x"
    )


def test_diagnosis_of_a_stopped_rank_a_missing_rank_and_a_rank_behind():
    before = {0: rec(0, 1), 1: rec(1, 5, "optimizer")}
    d = diagnose(before, {0: rec(0, 3), 1: rec(1, 5, "optimizer")}, 3, "s")
    assert d.culprits == (1, 2) and d.waiting == (0,)
    assert (
        "rank 1 (node1) did not arrive: not responding (stopped or frozen, no stack), last seen in optimizer" in d.line
    )
    assert "rank 2 (?) did not arrive: no progress record in this launch" in d.line
    # everyone waits, in different places: the ones behind (an earlier step) did not arrive
    before = {0: rec(0, 1, step=7), 1: rec(1, 1, "data", step=6)}
    d = diagnose(before, {0: rec(0, 2, step=7), 1: rec(1, 2, "data", step=6)}, 2, "s")
    assert d.culprits == (1,) and "behind the others, waiting in data of step 6" in d.line and d.waiting == (0,)
    # nothing stands out: a collective that never completes
    before = {0: rec(0, 1), 1: rec(1, 1)}
    d = diagnose(before, {0: rec(0, 2), 1: rec(1, 2)}, 2, "s")
    assert d.culprits == () and d.line.startswith(
        "hang: no rank stands out: every rank waits for the others; ranks 0,1"
    )


# --- stragglers -----------------------------------------------------------------------------------------------------
def records(compute: dict, last: int, stage: dict | None = None, outlier: dict | None = None) -> dict:
    """Progress records of ranks whose steps 1..last took `compute[rank]` s (an `outlier` step {rank: step} 10x)."""
    out = {}
    for r, c in compute.items():
        steps = [
            [s, c * (10 if (outlier or {}).get(r) == s else 1), 0.3 - c if c < 0.3 else 0.01]
            for s in range(1, last + 1)
        ]
        out[r] = {"host": f"h{r}", "stage": (stage or {}).get(r, 0), "recent": steps[-64:]}
    return out


def test_straggler_reported_after_consecutive_slow_windows_against_the_others_of_its_stage():
    det = StragglerDetector(margin=0.25, windows=2)
    base = {0: 0.10, 1: 0.15, 2: 0.10, 3: 0.10}  # rank 1 is 1.5x; ranks 2, 3 are another pipeline stage
    stages = {0: 0, 1: 0, 2: 1, 3: 1}
    first = det.observe(records(base, 4, stages))
    assert first.step == 4 and first.reports == ()
    assert first.ratios[1] == pytest.approx(1.5) and first.ratios[0] == pytest.approx(2 / 3)
    (report,) = det.observe(records(base, 8, stages)).reports
    assert (report.rank, report.host, report.windows, report.step) == (1, "h1", 2, 8)
    assert report.ratio == pytest.approx(1.5) and report.compute_s == pytest.approx(0.15)
    assert report.wait_s < report.others_wait_s  # the others wait for it
    assert report.line().startswith(
        "straggler: rank 1 (h1) computes 1.50x as long as the other ranks (fastest step 150 ms vs"
    )
    assert det.observe(records(base, 8, stages)).step == 0  # no new steps: no window
    assert det.observe(records(base, 12, stages)).reports == ()  # reported again only after 2 more windows
    assert len(det.observe(records(base, 16, stages)).reports) == 1
    even = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1}
    assert det.observe(records(even, 20, stages)).reports == () and det._streak[1] == 0  # back to normal


def test_windows_wait_for_every_rank_and_ignore_a_single_slow_step():
    det = StragglerDetector(margin=0.25, windows=1)
    lagging = records({0: 0.1, 1: 0.1}, 6)
    lagging[1]["recent"] = lagging[1]["recent"][:3]  # rank 1's record is a heartbeat behind: steps 1-3 only
    assert det.observe(lagging).step == 3
    # one step of rank 1 ten times as long (descheduled, a garbage collection): its fastest step does not move
    summary = det.observe(records({0: 0.1, 1: 0.1}, 9, outlier={1: 7}))
    assert summary.step == 9 and summary.reports == () and summary.ratios[1] == pytest.approx(1.0)
    assert det.observe(records({0: 0.1, 1: 0.12}, 12)).reports == ()  # 20 %: below the margin
    # a window shorter than min_steps (records lagging behind) waits for the next look
    det = StragglerDetector(margin=0.25, windows=1, min_steps=3)
    assert det.observe(records({0: 0.1, 1: 0.2}, 2)).step == 0
    (report,) = det.observe(records({0: 0.1, 1: 0.2}, 5)).reports
    assert report.step == 5 and report.ratio == pytest.approx(2.0)
    assert det.observe(records({0: 0.1, 1: 0.2}, 7)).step == 0  # steps 6-7: too few
    assert det.observe(records({0: 0.1, 1: 0.2}, 8)).step == 8


# --- the side channel and stacks ------------------------------------------------------------------------------------
def test_channel_records_hang_claim_failures_and_events(tmp_path, monkeypatch):
    a, b = channel.Channel(tmp_path, "20250101-000000-aa", 0), channel.Channel(tmp_path, "20250101-000000-aa", 1)
    a.create()
    a.write_record({"rank": 0, "beat": 1})
    b.write_record({"rank": 1, "beat": 7})
    assert {r: v["beat"] for r, v in a.records().items()} == {0: 1, 1: 7}
    assert a.claim_hang({"rank": 0}) and not b.claim_hang({"rank": 1}) and b.hang() == {"rank": 0}
    b.publish_failure({"rank": 1, "error": "OSError: disk"})
    assert a.events_seen() == (True, {1: {"rank": 1, "error": "OSError: disk"}}) and b.events_seen()[1] == {}
    channel.append_event(tmp_path, {"kind": "hang", "n": 1})
    channel.append_event(tmp_path, {"kind": "straggler", "n": 2})
    assert [e["n"] for e in channel.read_events(tmp_path, "straggler")] == [2]
    target = tmp_path / "state" / "job.failure"
    monkeypatch.setenv(channel.FAILURE_FILE_ENV, str(target))
    channel.write_failure_file("hang: rank 1\n(node2) did not arrive", ["node2", "node2"], "hang")
    assert target.read_text() == "kind=hang\nhosts=node2\nreason=hang: rank 1 (node2) did not arrive\n"
    for i in range(12):  # older launches are pruned, the newest KEEP_LAUNCHES stay
        (tmp_path / "watchdog" / f"20240101-0000{i:02d}-x").mkdir()
    a.prune()
    assert len(list((tmp_path / "watchdog").iterdir())) == channel.KEEP_LAUNCHES


def test_main_thread_position_tells_waiting_from_busy(tmp_path):
    import datetime
    import socket

    import torch.distributed as dist

    seen = {}

    def watch(key):
        time.sleep(0.5)
        seen[key] = stacks.main_thread_position()

    t = threading.Thread(target=watch, args=("busy",))
    t.start()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # computing in Python
        sum(range(1000))
    t.join()
    assert seen["busy"][0] is False and "test_health_units.py" in seen["busy"][1]
    # waiting for another rank: a 2-rank rendezvous whose second rank never comes (torch's store rendezvous, not
    # init_process_group: the session's one-process megatron world may already hold the default group)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = threading.Thread(target=watch, args=("waiting",))
    t.start()
    with pytest.raises(Exception):  # noqa: B017 - torch's timeout error type varies by version
        next(dist.rendezvous(f"tcp://127.0.0.1:{port}", rank=0, world_size=2, timeout=datetime.timedelta(seconds=2)))
    t.join()
    assert seen["waiting"][0] is True and seen["waiting"][1].startswith("torch/distributed/"), seen
    stacks.dump(tmp_path / "s.txt", "header")
    text = (tmp_path / "s.txt").read_text()
    assert text.startswith("header\n") and "test_main_thread_position_tells_waiting_from_busy" in text


# --- cluster fault kinds --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fault, message",
    [
        ({"step": 3, "kind": "hang", "phase": "save"}, "(hang) needs a rank or a host"),
        ({"step": 3, "kind": "hang", "rank": 1, "phase": "forward"}, ".phase='forward' is not one of data,"),
        ({"step": 3, "kind": "slow_rank", "rank": 1, "factor": 0.5}, ".factor=0.5 must be > 1 for slow_rank"),
        ({"step": 3, "kind": "fail_save"}, "(fail_save) needs a rank"),
        ({"step": 3, "kind": "nan_grad", "rank": 1}, ".rank is for the cluster faults (hang, slow_rank,"),
        ({"step": 3, "kind": "fail_load", "rank": 1, "phase": "load"}, ".phase is for a hang, not fail_load"),
        ({"step": 3, "kind": "hang", "rank": -1, "phase": "save"}, ".rank=-1 must be a non-negative integer"),
    ],
)
def test_cluster_fault_refusals(fault, message):
    with pytest.raises(ConfigError) as info:
        Fault.from_dict(fault, "monitor.faults[0]")
    assert message in str(info.value), str(info.value)


def test_io_faults_fire_once_per_run_and_host_faults_every_launch(tmp_path):
    faults = [Fault(6, "fail_save", rank=1), Fault(0, "fail_load", rank=1), Fault(9, "fail_save", rank=0)]
    assert process_faults.arm(faults, tmp_path, rank=2, host="n1") is None  # nothing for rank 2
    process_faults.arm(faults, tmp_path, rank=1, host="n1")
    try:
        process_faults.checkpoint_io("write", 4, tmp_path / "x")  # not its step
        with pytest.raises(OSError) as info:
            process_faults.checkpoint_io("write", 6, tmp_path / "x")
        assert info.value.errno == errno.EIO and "injected fail_save on rank 1" in str(info.value)
        process_faults.checkpoint_io("write", 6, tmp_path / "x")  # fired: once
        with pytest.raises(OSError, match="injected fail_load"):
            process_faults.checkpoint_io("read", 8, tmp_path / "x")  # step 0: any checkpoint
    finally:
        process_faults.disarm()
    fired = channel.read_events(tmp_path, "fault")
    assert [(e["rank"], e["fault"]["kind"], e["step"]) for e in fired] == [(1, "fail_save", 6), (1, "fail_load", 8)]
    again = process_faults.arm(faults, tmp_path, rank=1, host="n1")  # a later launch: both fired in this run
    assert again is None
    host = process_faults.arm([Fault(2, "hang", host="n1", phase="save")], tmp_path, rank=5, host="n1")
    assert host is not None and len(host.faults) == 1
    process_faults.disarm()
    json.dumps(fired)


def test_a_vanished_peer_is_not_this_ranks_failure():
    """gloo's error on the ranks left when one was SIGKILLed: they do not claim the failure (srun names the dead rank)."""
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:46723: Connection reset by peer"
    )
    assert lost_a_peer(gloo)
    assert not lost_a_peer(OSError(28, "No space left on device"))
    assert not lost_a_peer(RuntimeError("rank 1 (node2): fail_save injected"))
