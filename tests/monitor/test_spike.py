"""Spike monitor: configuration, robust statistics, and real training curves of the trainer (`megagate train` on
real demo text): no false positives, exact-step detection of injected faults, and the actions carried out by the
real monitor callback inside the real Trainer (skip, rollback, abort).

The curves are two clean 200-step runs (seq 64 x batch 8): G1 at the config's LR 3e-3 (the same run as
tests/train/test_monitor_actions.py's clean200, trained once per session) and the baseline at LR 1e-2, seed 1.
Measured on them: the largest clean robust z is 3.0 / 4.2 (loss) and 7.1 / 2.9 (log grad-norm) against the
thresholds 8 / 12; loss x 10 scores >= 289, grad-norm x 50 >= 36.
"""

import json
import math

import pytest
import torch

from helpers import trainer_jobs
from megagate.errors import ConfigError, MegagateError
from megagate.monitor import runfiles, tensorboard
from megagate.monitor.events import EventLog
from megagate.monitor.faults import Fault, FaultInjector
from megagate.monitor.settings import MonitorConfig
from megagate.monitor.spike import (
    SpikeMonitor,
    SpikeMonitorConfig,
    robust_baseline,
    worst_action,
)

# the tests on trainer runs are marked slow: ~60 s of runs on 2 cores (less when test_monitor_actions ran first)

STEPS = 200
K_SKIP, K_ROLLBACK, K_ABORT = 25, 27, 40
LIVE = [*trainer_jobs.TINY, "train.train_steps=40", "logging.tensorboard=false"]


def monitor(action, faults, **spike):
    return "monitor=" + json.dumps({"spike": {"action": action, **spike}, "faults": faults})


JOBS = {
    "g1-elementwise@3e-3": trainer_jobs.CLEAN_200,
    "baseline@1e-2": [*trainer_jobs.CLEAN_200, "model.gate.preset=baseline", "train.lr=0.01", "seed=1"],
    # the default thresholds (min_history 20) with the action under test
    "skip": [*LIVE, monitor("skip", [{"step": K_SKIP, "kind": "nan_grad"}])],
    "rollback": [
        *LIVE,
        monitor("rollback", [{"step": K_ROLLBACK, "kind": "scale_loss", "factor": 10}], rollback_skip_steps=2),
        "checkpoint.interval=10",
        "checkpoint.keep_last=10",
    ],
    "abort": [*LIVE, "train.train_steps=50", monitor("abort", [{"step": K_ABORT, "kind": "corrupt_batch"}])],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    demo = trainer_jobs.demo_data(tmp_path_factory)
    return trainer_jobs.run_jobs(tmp_path_factory, demo, JOBS, snapshots={"skip": [K_SKIP - 1, K_SKIP, K_SKIP + 1]})


@pytest.fixture(scope="module")
def clean_runs(runs):
    """name -> (losses, grad norms) per step of the two clean curves."""
    curves = {}
    for name in ("g1-elementwise@3e-3", "baseline@1e-2"):
        run = runs[name]
        assert run.rc == 0, run.log[-3000:]
        records = run.train_records()
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        curves[name] = ([r["loss"] for r in records], [r["grad_norm"] for r in records])
    return curves


def replay(curve, config=None, fault=None):
    """Feed a recorded run through a fresh monitor; `fault(step, metrics)` may alter one step's metrics."""
    monitor = SpikeMonitor(config or SpikeMonitorConfig())
    events = []
    for step, (loss, gn) in enumerate(zip(*curve), start=1):
        metrics = {"loss": loss, "grad_norm": gn}
        if fault is not None:
            metrics = fault(step, metrics)
        events += monitor.observe(step, metrics)
    return monitor, events


# --- configuration ----------------------------------------------------------------------------------------------
def test_config_errors_name_the_value():
    with pytest.raises(ConfigError, match=r"action='explode' is not one of warn, skip, rollback, lr_backoff, abort"):
        SpikeMonitorConfig(action="explode")
    with pytest.raises(ConfigError, match=r"window=0 must be a positive integer"):
        SpikeMonitorConfig(window=0)
    with pytest.raises(ConfigError, match=r"min_history \(50\) must be <= monitor.spike.window \(10\)"):
        SpikeMonitorConfig(window=10, min_history=50)
    with pytest.raises(ConfigError, match=r"lr_backoff_factor=2 must be in \(0, 1\]"):
        SpikeMonitorConfig(lr_backoff_factor=2)
    with pytest.raises(ConfigError, match=r"abs_ceiling has 'ppl', which is not a watched metric"):
        SpikeMonitorConfig(abs_ceiling={"ppl": 1.0})
    with pytest.raises(ConfigError, match=r"monitor.spike.windw is not a known key; allowed: abs_ceiling, action"):
        SpikeMonitorConfig.from_dict({"windw": 3})
    cfg = SpikeMonitorConfig.from_dict({"metrics": "loss", "action": "skip"})
    assert cfg.metrics == ("loss",) and cfg.action == "skip"
    assert SpikeMonitorConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_robust_baseline_ignores_trend_and_outliers():
    # a line falling by 1.0 over the window with noise ±0.02: the MAD around the median would be ~0.25 (the trend);
    # the successive-difference scale sees the noise: |diffs| are 0.03 (50 of them) and 0.05 (49) -> median 0.03
    xs = [10 - 0.01 * i + (0.02 if i % 2 else -0.02) for i in range(100)]
    center, scale = robust_baseline(xs, rel_floor=0.0)
    assert center == pytest.approx(statistics_median(xs[-20:]))
    assert scale == pytest.approx(1.4826 * 0.03 / math.sqrt(2), rel=1e-6)
    mad = statistics_median([abs(x - statistics_median(xs)) for x in xs])
    assert mad > 0.2
    # the floor applies on a flat plateau
    assert robust_baseline([2.0] * 30, rel_floor=0.01)[1] == pytest.approx(0.02)


def statistics_median(xs):
    import statistics

    return statistics.median(xs)


# --- real curves ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_clean_runs_raise_no_event(runs, clean_runs):
    for name, (losses, grad_norms) in clean_runs.items():
        assert all(math.isfinite(x) for x in losses + grad_norms)
        assert losses[-1] < losses[0] - 1.5, f"{name} did not learn: {losses[0]} -> {losses[-1]}"  # 7.6 -> 5.9
        assert runs[name].events() == [] and runs[name].summary()["spikes"] == 0  # live, in the trainer
        _, events = replay((losses, grad_norms))
        assert events == [], f"{name}: false positives {events}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["loss_x10", "loss_nan", "grad_nan", "grad_x50", "loss_inf"])
@pytest.mark.parametrize("at", [50, 120, 190])
def test_injected_fault_detected_at_exact_step(clean_runs, kind, at):
    def fault(step, m):
        if step != at:
            return m
        m = dict(m)
        if kind == "loss_x10":
            m["loss"] *= 10
        elif kind == "loss_nan":
            m["loss"] = math.nan
        elif kind == "loss_inf":
            m["loss"] = math.inf
        elif kind == "grad_nan":
            m["grad_norm"] = math.nan
        else:
            m["grad_norm"] *= 50
        return m

    for name, curve in clean_runs.items():
        _, events = replay(curve, SpikeMonitorConfig(action="rollback"), fault)
        assert [(e.step, e.action) for e in events] == [(at, "rollback")], f"{name}: {events}"
        metric = "loss" if kind.startswith("loss") else "grad_norm"
        assert events[0].metric == metric
        if "nan" in kind or "inf" in kind:
            assert events[0].reason == "non-finite" and events[0].score == math.inf
        else:
            assert events[0].score > 12 and events[0].baseline is not None


@pytest.mark.slow
def test_spike_does_not_poison_the_baseline(clean_runs):
    losses, grad_norms = clean_runs["g1-elementwise@3e-3"]
    at = 150
    clean_monitor, _ = replay((losses, grad_norms))
    spiked_monitor, events = replay(
        (losses, grad_norms), fault=lambda s, m: {**m, "loss": m["loss"] * 10} if s == at else m
    )
    assert [e.step for e in events] == [at]
    # the spike step contributed nothing: both histories are the clean run minus step `at`
    clean_hist = clean_monitor.state_dict()["history"]["loss"]
    spiked_hist = spiked_monitor.state_dict()["history"]["loss"]
    expected = [x for i, x in enumerate(losses, start=1) if i != at][-100:]
    assert spiked_hist == pytest.approx(expected)
    assert clean_hist == pytest.approx(losses[-100:])


def test_ceiling_and_direction():
    cfg = SpikeMonitorConfig(abs_ceiling={"loss": 5.0}, direction={"loss": "both"}, metrics=("loss",))
    monitor = SpikeMonitor(cfg)
    # the ceiling fires even before min_history
    assert [e.reason for e in monitor.observe(1, {"loss": 6.0})] == ["ceiling 5"]
    for step in range(2, 40):
        assert monitor.observe(step, {"loss": 3.0 + 0.01 * (step % 3)}) == []
    # a collapse of the loss is an event only with direction "both"
    (event,) = monitor.observe(40, {"loss": 1.0})
    assert event.score < -8
    up_only = SpikeMonitor(SpikeMonitorConfig(metrics=("loss",)))
    for step in range(1, 40):
        up_only.observe(step, {"loss": 3.0 + 0.01 * (step % 3)})
    assert up_only.observe(40, {"loss": 1.0}) == []


# --- actions ----------------------------------------------------------------------------------------------------
def test_lr_backoff_window_and_escalation():
    cfg = SpikeMonitorConfig(
        metrics=("loss",), action="lr_backoff", lr_backoff_factor=0.25, lr_backoff_steps=5, max_consecutive=2
    )
    monitor = SpikeMonitor(cfg)
    for step in range(1, 31):
        monitor.observe(step, {"loss": 2.0 + 0.01 * (step % 2)})
    (event,) = monitor.observe(31, {"loss": 20.0})
    assert event.action == "lr_backoff"
    assert [monitor.lr_scale(s) for s in range(30, 37)] == [1.0, 0.25, 0.25, 0.25, 0.25, 0.25, 1.0]
    # three spike steps in a row exceed max_consecutive=2: the third escalates to abort
    assert [e.action for e in monitor.observe(32, {"loss": 20.0})] == ["lr_backoff"]
    (third,) = monitor.observe(33, {"loss": math.nan})
    assert third.action == "abort" and "max_consecutive 2" in third.reason
    assert worst_action([event, third]) == "abort"


def test_rollback_plan_data_index_and_ledger():
    cfg = SpikeMonitorConfig(metrics=("loss",), action="rollback", rollback_skip_steps=3, max_rollbacks=2)
    monitor = SpikeMonitor(cfg)
    with pytest.raises(MegagateError, match="checkpoint step 50 >= spike step 50"):
        monitor.rollback_plan(50, 50)
    plan = monitor.rollback_plan(57, 50)
    assert (plan.restore_step, plan.skip_first, plan.skip_last) == (50, 55, 57)
    assert monitor.rollback_plan(52, 50).skip_first == 51  # never reaches back into the checkpoint's batches
    ckpt_state = monitor.state_dict()
    monitor.restore_after_rollback(ckpt_state, plan, 57)
    # steps before the window read their own batches; from 55 on the run reads past batches 55..57
    assert [monitor.data_index(s) for s in (54, 55, 56, 60)] == [54, 58, 59, 63]
    # the ledger survives a later restore of an old checkpoint
    monitor.restore_after_rollback(ckpt_state, monitor.rollback_plan(61, 50), 61)
    assert monitor.skipped_windows() == [(55, 57), (59, 61)]
    assert monitor.data_index(59) == 59 + 3 + 3
    for step in range(51, 80):
        monitor.observe(step, {"loss": 2.0 + 0.01 * (step % 2)})
    (event,) = monitor.observe(80, {"loss": math.inf})
    assert event.action == "abort" and "max_rollbacks 2" in event.reason


@pytest.mark.slow
def test_resume_from_state_dict_is_as_if_uninterrupted(clean_runs):
    losses, grad_norms = clean_runs["baseline@1e-2"]
    cfg = SpikeMonitorConfig(action="lr_backoff", lr_backoff_steps=30)

    def metrics(step):
        return {"loss": losses[step - 1] * (10 if step in (130, 180) else 1), "grad_norm": grad_norms[step - 1]}

    whole = SpikeMonitor(cfg)
    whole_events = [e for s in range(1, STEPS + 1) for e in whole.observe(s, metrics(s))]
    first = SpikeMonitor(cfg)
    events = [e for s in range(1, 151) for e in first.observe(s, metrics(s))]
    saved = json.loads(json.dumps(first.state_dict()))  # through JSON, as the trainer's checkpoint holds it
    second = SpikeMonitor(cfg)
    second.load_state_dict(saved)
    assert second.lr_scale(151) == 0.5  # the backoff started at 130 is still active after the resume
    events += [e for s in range(151, STEPS + 1) for e in second.observe(s, metrics(s))]
    assert [e.step for e in whole_events] == [130, 180]
    assert events == whole_events
    assert second.state_dict() == whole.state_dict()


# --- the actions, carried out by the trainer's SpikeMonitoring callback on real weights ---------------------------
@pytest.mark.slow
def test_skip_leaves_weights_unchanged(runs):
    run = runs["skip"]
    assert run.rc == 0, run.log[-3000:]
    assert [(e["step"], e["metric"], e["action"]) for e in run.events()] == [(K_SKIP, "grad_norm", "skip")]
    # a test callback (helpers.trainer_jobs.WeightSnapshots) saved every parameter after steps K-1, K, K+1
    before, at, after = (run.snapshot(s) for s in (K_SKIP - 1, K_SKIP, K_SKIP + 1))
    assert before.keys() == at.keys() and len(at) >= 9
    for name in before:
        assert torch.equal(before[name], at[name]), f"{name} changed by the skipped step"
    assert all(not torch.equal(at[n], after[n]) for n in at), "training did not continue after the skip"
    records = run.by_step()
    assert sorted(records) == list(range(1, 41)) and all(math.isfinite(records[s]["loss"]) for s in records)
    assert [s for s, r in records.items() if r["skipped"]] == [K_SKIP]


@pytest.mark.slow
def test_rollback_restores_and_skips_the_window(runs):
    run = runs["rollback"]
    assert run.rc == 0, run.log[-3000:]
    # the trainer's scale_loss scales the loss the monitor judges, not the gradients: one loss event
    assert [(e["step"], e["metric"], e["action"]) for e in run.events()] == [(K_ROLLBACK, "loss", "rollback")]
    assert f"rollback: spike at step {K_ROLLBACK}; restored step 20 from" in run.log
    assert f"dropping batches {K_ROLLBACK - 1}-{K_ROLLBACK}" in run.log  # rollback_skip_steps=2
    lines = run.train_records()
    steps = [r["step"] for r in lines]
    assert steps == list(range(1, K_ROLLBACK)) + list(range(21, 41))  # back to 20, then all steps to the end
    first, replayed = lines[20 : K_ROLLBACK - 1], lines[K_ROLLBACK - 1 :]
    # steps 21..25 read the same batches with the restored weights, optimizer and RNG: bit-identical losses;
    # step 26 reads batch 28 (batches 26 and 27 are dropped), so its loss differs
    assert [r["loss"] for r in first[:5]] == [r["loss"] for r in replayed[:5]]
    assert first[5]["step"] == replayed[5]["step"] == 26 and first[5]["loss"] != replayed[5]["loss"]
    from megagate import checkpoint

    meta = checkpoint.read_meta(checkpoint.latest(run.dir / "checkpoints"))
    assert meta["step"] == 40 and meta["x_monitor"]["rollbacks"] == [
        {"event_step": K_ROLLBACK, "restore_step": 20, "skip_first": K_ROLLBACK - 1, "skip_last": K_ROLLBACK}
    ]
    s = run.summary()
    assert s["steps"] == 40 and s["spikes"] == 1 and s["diverged"] is False


@pytest.mark.slow
def test_abort_saves_and_stops_with_an_error(runs):
    run = runs["abort"]
    # a batch of uniformly random text (tokens and labels) at step K: the loss jumps above ln(2048) = 7.62
    assert run.rc == 2 and f"training aborted by the spike monitor at step {K_ABORT}" in run.error, run.log[-2000:]
    events = run.events()
    assert {e["step"] for e in events} == {K_ABORT} and events[0]["metric"] == "loss"
    assert events[0]["value"] > math.log(2048) > events[0]["baseline"] + 0.5
    assert max(run.by_step()) == K_ABORT
    from megagate import checkpoint

    assert checkpoint.latest(run.dir / "checkpoints").name == f"iter_{K_ABORT:07d}"
    s = run.summary()
    assert s["aborted"] is True and s["diverged"] is True and s["steps"] == K_ABORT


def test_faults_validate():
    with pytest.raises(
        ConfigError, match="kind='melt' is not one of corrupt_batch, scale_loss, scale_lr, nan_grad, hang, slow_rank"
    ):
        Fault(3, "melt")
    inj = FaultInjector([Fault.from_dict({"step": 5, "kind": "scale_lr", "factor": 100.0})])
    assert inj.lr_scale(5) == 100.0 and inj.lr_scale(6) == 1.0 and inj.lr_scale(5) == 1.0  # fires once
    batch = {
        "tokens": torch.arange(12).view(2, 6),
        "labels": torch.arange(1, 13).view(2, 6),
        "loss_mask": torch.ones(2, 6),
    }
    inj = FaultInjector([Fault(7, "corrupt_batch")])
    assert inj.batches(6, [batch], 50)[0]["tokens"] is batch["tokens"]
    (bad,) = inj.batches(7, [batch], 50)
    # random text: labels are the next tokens of the same random sequence; other entries untouched
    assert torch.equal(bad["tokens"][:, 1:], bad["labels"][:, :-1]) and not torch.equal(bad["tokens"], batch["tokens"])
    assert bad["tokens"].max() < 50 and bad["loss_mask"] is batch["loss_mask"]


@pytest.mark.parametrize(
    "section, message",
    [
        ({"spike": {"treshold": 3}}, "monitor.spike.treshold is not a known key; allowed: abs_ceiling, action,"),
        ({"spikes": {}}, "monitor.spikes is not a known key; allowed: diagnostics, early_stop, faults, spike"),
        (
            {"faults": [{"step": 3, "kind": "nan_grad", "strength": 2}]},
            "monitor.faults[0].strength is not a known key; allowed: factor, host, kind, phase, rank, step",
        ),
        (
            {"faults": [{"step": 3, "kind": "nan_grad"}, {"step": 4, "kind": "melt"}]},
            "monitor.faults[1].kind='melt' is not one of corrupt_batch, scale_loss, scale_lr, nan_grad, hang",
        ),
        ({"faults": [{"kind": "nan_grad"}]}, "monitor.faults[0] needs a step"),
        ({"faults": {"step": 3}}, "monitor.faults must be a list of {step, kind, factor} mappings"),
        ({"diagnostics": {"every": 5}}, "monitor.diagnostics.every is not a known key; allowed: interval"),
        ({"diagnostics": {"interval": -1}}, "monitor.diagnostics.interval=-1 must be a non-negative integer"),
        (
            {"spike": {"transform": {"gradnorm": "log"}}},
            "monitor.spike.transform has 'gradnorm', which is not a watched",
        ),
        ({"spike": {"abs_ceiling": 3}}, "monitor.spike.abs_ceiling=3 must be a mapping of metric -> value"),
        ({"spike": {"enabled": "yes"}}, "monitor.spike.enabled='yes' must be true or false"),
        ("warn", "monitor must be a mapping, not 'warn'"),
    ],
)
def test_monitor_config_refuses_unknown_keys_at_every_level(section, message):
    with pytest.raises(ConfigError) as info:
        MonitorConfig.from_dict(section)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_monitor_config_defaults_and_typed_values():
    assert MonitorConfig.from_dict(None) == MonitorConfig.from_dict({}) == MonitorConfig()
    cfg = MonitorConfig.from_dict(
        {
            "spike": {"action": "skip", "metrics": ["loss"]},
            "diagnostics": {"interval": 5},
            "faults": [{"step": 3, "kind": "scale_loss", "factor": 10}],
        }
    )
    assert cfg.spike.action == "skip" and cfg.spike.metrics == ("loss",) and cfg.diagnostics.interval == 5
    assert cfg.faults == (Fault(3, "scale_loss", 10.0),)


# --- event log --------------------------------------------------------------------------------------------------
def test_event_log_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    monitor = SpikeMonitor(SpikeMonitorConfig(action="warn"))
    writer = SummaryWriter(str(tmp_path / "tb"))
    log = EventLog(tmp_path / "events.jsonl", lambda step, metrics: tensorboard.write(writer, step, metrics))
    for step in range(1, 40):
        log.write(monitor.observe(step, {"loss": 3.0 + 0.02 * (step % 3), "grad_norm": 1.0 + 0.05 * (step % 2)}))
    log.write(monitor.observe(40, {"loss": 30.0, "grad_norm": math.nan}))
    writer.close()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert len(lines) == 2
    records = [json.loads(line) for line in lines]  # strict JSON: NaN is the string "nan"
    assert set(records[0]) == set(runfiles.EVENT_KEYS)
    assert records[0]["metric"] == "loss" and records[0]["value"] == 30.0 and records[0]["action"] == "warn"
    assert records[0]["baseline"] == pytest.approx(3.02)
    assert records[1]["value"] == "nan" and records[1]["reason"] == "non-finite"
    assert math.isnan(log.read()[1]["value"])
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    (value,) = acc.Scalars("spike/loss/value")
    assert (value.step, value.value) == (40, 30.0)
    (score,) = acc.Scalars("spike/loss/score")
    assert score.value == pytest.approx(records[0]["score"], rel=1e-5)


@pytest.mark.slow
def test_replayed_monitor_equals_the_trainers_events(runs):
    """`megagate report --replay-monitor` replays the monitor over the logged curve: at the trainer's own settings it
    must give exactly the steps the trainer flagged (clean runs, and a run whose skipped step was NaN)."""
    from megagate.analysis.replay import parse_settings, replay_events

    flagged = 0
    for name in ("g1-elementwise@3e-3", "baseline@1e-2", "skip"):
        run = runs[name]
        rows = [r for r in run.train_records() if "loss" in r]
        logged = sorted({e["step"] for e in run.events()})
        settings = "" if name != "skip" else "min_history=20"
        assert replay_events(rows, parse_settings(settings), str(run.dir)) == logged, name
        flagged += len(logged)
    assert flagged >= 1  # the skip run's NaN gradient at least
    # a monitor that never arms its z-scores keeps only the non-finite events
    skip_rows = [r for r in runs["skip"].train_records() if "loss" in r]
    assert replay_events(skip_rows, parse_settings("min_history=100"), "skip") == [K_SKIP]
