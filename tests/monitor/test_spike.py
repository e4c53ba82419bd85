"""Spike monitor: no false positives on real loss curves, exact-step detection of injected faults, actions, resume."""

import json
import math

import pytest
import torch
from helpers import tiny_train

from megagate.errors import ConfigError, MegagateError
from megagate.monitor import runfiles
from megagate.monitor.events import EventLog
from megagate.monitor.faults import Fault, FaultInjector
from megagate.monitor.spike import (
    SpikeMonitor,
    SpikeMonitorConfig,
    robust_baseline,
    worst_action,
)

STEPS = 300


@pytest.fixture(scope="module")
def clean_runs(megatron_world):
    """Real curves: a gated and a baseline tiny GPT, 300 steps each, on byte-level stdlib text."""
    return {
        "g1-elementwise@3e-3": tiny_train.train(STEPS, lr=3e-3, preset="g1-elementwise", seed=0),
        "baseline@1e-2": tiny_train.train(STEPS, lr=1e-2, preset="baseline", seed=1),
    }


def replay(run, config=None, fault=None):
    """Feed a recorded run through a fresh monitor; `fault(step, metrics)` may alter one step's metrics."""
    monitor = SpikeMonitor(config or SpikeMonitorConfig())
    events = []
    for step, (loss, gn) in enumerate(zip(run.losses, run.grad_norms), start=1):
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
    with pytest.raises(ConfigError, match=r"monitor.spike.windw is not a spike-monitor field"):
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
def test_clean_runs_raise_no_event(clean_runs):
    for name, run in clean_runs.items():
        assert len(run.losses) == STEPS and tiny_train.finite(run.losses)
        assert run.losses[-1] < run.losses[0] - 2.0, f"{name} did not learn: {run.losses[0]} -> {run.losses[-1]}"
        _, events = replay(run)
        assert events == [], f"{name}: false positives {events}"


@pytest.mark.parametrize("kind", ["loss_x10", "loss_nan", "grad_nan", "grad_x50", "loss_inf"])
@pytest.mark.parametrize("at", [60, 180, 290])
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

    for name, run in clean_runs.items():
        _, events = replay(run, SpikeMonitorConfig(action="rollback"), fault)
        assert [(e.step, e.action) for e in events] == [(at, "rollback")], f"{name}: {events}"
        metric = "loss" if kind.startswith("loss") else "grad_norm"
        assert events[0].metric == metric
        if "nan" in kind or "inf" in kind:
            assert events[0].reason == "non-finite" and events[0].score == math.inf
        else:
            assert events[0].score > 12 and events[0].baseline is not None


def test_spike_does_not_poison_the_baseline(clean_runs):
    run = clean_runs["g1-elementwise@3e-3"]
    at = 150
    clean_monitor, _ = replay(run)
    spiked_monitor, events = replay(run, fault=lambda s, m: {**m, "loss": m["loss"] * 10} if s == at else m)
    assert [e.step for e in events] == [at]
    # the spike step contributed nothing: both histories are the clean run minus step `at`
    clean_hist = clean_monitor.state_dict()["history"]["loss"]
    spiked_hist = spiked_monitor.state_dict()["history"]["loss"]
    expected = [x for i, x in enumerate(run.losses, start=1) if i != at][-100:]
    assert spiked_hist == pytest.approx(expected)
    assert clean_hist == pytest.approx(run.losses[-100:])


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
    cfg = SpikeMonitorConfig(metrics=("loss",), action="lr_backoff", lr_backoff_factor=0.25, lr_backoff_steps=5,
                             max_consecutive=2)  # fmt: skip
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


def test_resume_from_state_dict_is_as_if_uninterrupted(clean_runs):
    run = clean_runs["baseline@1e-2"]
    cfg = SpikeMonitorConfig(action="lr_backoff", lr_backoff_steps=30)

    def metrics(step):
        loss, gn = run.losses[step - 1], run.grad_norms[step - 1]
        return {"loss": loss * (10 if step in (140, 200) else 1), "grad_norm": gn}

    whole = SpikeMonitor(cfg)
    whole_events = [e for s in range(1, STEPS + 1) for e in whole.observe(s, metrics(s))]
    first = SpikeMonitor(cfg)
    events = [e for s in range(1, 151) for e in first.observe(s, metrics(s))]
    saved = json.loads(json.dumps(first.state_dict()))  # through JSON, as the trainer's checkpoint would
    second = SpikeMonitor(cfg)
    second.load_state_dict(saved)
    assert second.lr_scale(151) == 0.5  # the backoff started at 140 is still active after the resume
    events += [e for s in range(151, STEPS + 1) for e in second.observe(s, metrics(s))]
    assert [e.step for e in whole_events] == [140, 200]
    assert events == whole_events
    assert second.state_dict() == whole.state_dict()


# --- live runs: the actions carried out on real weights ----------------------------------------------------------
def test_skip_leaves_weights_unchanged(megatron_world):
    at = 40
    run = tiny_train.train(60, monitor=SpikeMonitor(SpikeMonitorConfig(action="skip")),
                           faults=FaultInjector([Fault(at, "nan_grad")]), snapshot_steps=(at - 1, at, at + 1))  # fmt: skip
    assert [(e.step, e.metric, e.action) for e in run.events] == [(at, "grad_norm", "skip")]
    before, after, next_ = run.snapshots[at - 1], run.snapshots[at], run.snapshots[at + 1]
    for name in before:
        assert torch.equal(before[name], after[name]), f"{name} changed by the skipped step"
    assert any(not torch.equal(after[n], next_[n]) for n in after), "training did not continue after the skip"
    assert len(run.losses) == 60 and tiny_train.finite(run.losses[at:])


def test_rollback_restores_and_completes(megatron_world):
    at, steps = 47, 70
    monitor = SpikeMonitor(SpikeMonitorConfig(action="rollback", rollback_skip_steps=2))
    run = tiny_train.train(steps, monitor=monitor, faults=FaultInjector([Fault(at, "scale_loss", 10.0)]),
                           checkpoint_every=10)  # fmt: skip
    # scaling the loss scales the gradient too: both metrics fire, at that step only
    assert [(e.step, e.metric, e.action) for e in run.events] == [(at, "loss", "rollback"), (at, "grad_norm", "rollback")]
    assert run.actions == {at: "rollback"}
    assert monitor.skipped_windows() == [(46, 47)] and monitor.num_rollbacks == 1
    # the run went back to step 40 and still completed all steps; the replayed steps 41..45 read the same data
    assert len(run.losses) == steps and tiny_train.finite(run.losses)
    assert run.losses[-1] < run.losses[0] - 1.0


def test_abort_stops_at_the_step(megatron_world):
    run = tiny_train.train(50, monitor=SpikeMonitor(SpikeMonitorConfig(action="abort")),
                           faults=FaultInjector([Fault(30, "corrupt_batch")]))  # fmt: skip
    # a batch of random bytes spikes the loss (and its gradient) at that step
    assert run.aborted_at == 30 and {e.step for e in run.events} == {30} and run.events[0].metric == "loss"
    assert run.events[0].value > 4.5  # random bytes: ~ln(256) nats, far above the learned ~3


def test_faults_validate():
    with pytest.raises(ConfigError, match="kind='melt' is not one of corrupt_batch, scale_loss, scale_lr, nan_grad"):
        Fault(3, "melt")
    inj = FaultInjector.from_config([{"step": 5, "kind": "scale_lr", "factor": 100.0}])
    assert inj.lr_scale(5) == 100.0 and inj.lr_scale(6) == 1.0


# --- event log --------------------------------------------------------------------------------------------------
def test_event_log_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    monitor = SpikeMonitor(SpikeMonitorConfig(action="warn"))
    writer = SummaryWriter(str(tmp_path / "tb"))
    log = EventLog(tmp_path / "events.jsonl", writer)
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
