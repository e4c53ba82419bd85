"""SpikeScore (megagate.monitor.spike_score) against an independent numpy computation of the same definition, on
synthetic curves with spikes at known steps and on the trainer's own clean 200-step run (its summary.json entry
recomputed from metrics.jsonl)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from helpers import trainer_jobs
from megagate.errors import MegagateError
from megagate.monitor.spike_score import LOOKBACK, SIGMAS, SpikeScore, SpikeScores


def reference_flags(values: np.ndarray, sigmas: float = SIGMAS, lookback: int = LOOKBACK) -> list[bool | None]:
    """The definition written out with numpy: the window is the last `lookback` finite values before each step."""
    flags: list[bool | None] = []
    finite: list[float] = []
    for x in values:
        if len(finite) < lookback:
            flags.append(None)
        else:
            window = np.asarray(finite[-lookback:])
            flags.append(bool(not np.isfinite(x) or x > window.mean() + sigmas * window.std()))
        if np.isfinite(x):
            finite.append(float(x))
    return flags


def test_known_spikes_on_a_noisy_falling_curve():
    rng = np.random.default_rng(0)
    steps = 600
    curve = 6.0 - 2.0 * np.arange(steps) / steps + 0.02 * rng.standard_normal(steps)
    spikes = [200, 350, 351, 500]
    curve[spikes] += 1.0  # 50 noise sigmas: a spike under any reading of the definition
    curve[420] = math.nan
    score = SpikeScore()
    flags = [score.observe(x) for x in curve]
    assert flags == reference_flags(curve)
    assert flags[:LOOKBACK] == [None] * LOOKBACK
    # 351 follows 350 inside the same window: 350 (kept in the window, spikes included) and the falling trend raise
    # the window's std to ~0.15, so 6 sigma (~0.9) hides 351's +1 over a mean ~0.2 above it: a property of the
    # definition, which the numpy reference shares
    assert [i for i, f in enumerate(flags) if f] == [200, 350, 420, 500]
    assert score.judged == steps - LOOKBACK
    assert score.spikes == 4
    assert score.score() == pytest.approx(100 * 4 / (steps - LOOKBACK))


def test_threshold_is_mean_plus_sigmas_population_std():
    previous = [0.0, 2.0] * 64  # mean 1, population std 1
    for value, expected in ((6.99, False), (7.01, True)):
        score = SpikeScore(sigmas=6, lookback=128)
        for x in previous:
            assert score.observe(x) is None
        assert score.observe(value) is expected


def test_window_score_and_state_roundtrip():
    rng = np.random.default_rng(1)
    curve = 1.0 + 0.01 * rng.standard_normal(400)
    curve[[150, 300]] += 1.0
    whole = SpikeScore(lookback=32, window=100)
    flags = [whole.observe(x) for x in curve]
    assert flags == reference_flags(curve, lookback=32)
    # the last 100 judged steps are 300..399: one spike
    assert whole.window_score() == pytest.approx(1.0)
    assert whole.score() == pytest.approx(100 * 2 / (400 - 32))
    first = SpikeScore(lookback=32, window=100)
    for x in curve[:220]:
        first.observe(x)
    resumed = SpikeScore(lookback=32, window=100)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [resumed.observe(x) for x in curve[220:]] == flags[220:]
    assert resumed.state_dict() == whole.state_dict()


def test_scores_per_metric_scalars_and_summary():
    scores = SpikeScores(("loss", "grad_norm"), lookback=4)
    for loss, gn in ((1, 1), (1.1, 2), (0.9, 1), (1, 2), (9, 1.5), (1, 1.4)):
        scores.observe({"loss": loss, "grad_norm": gn})
    s = scores.summary()
    assert s["loss"] == {"percent": 50.0, "spikes": 1, "judged": 2}
    assert s["grad_norm"] == {"percent": 0.0, "spikes": 0, "judged": 2}
    assert s["definition"] == "percent of steps > mean + 6 std of the previous 4"
    assert scores.scalars() == {
        "spike_score/loss": 50.0,
        "spike_score/loss/window": 50.0,
        "spike_score/grad_norm": 0.0,
        "spike_score/grad_norm/window": 0.0,
    }


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sigmas": 0}, "sigmas=0 must be a positive number"),
        ({"lookback": 1}, "lookback=1 must be an integer >= 2"),
        ({"window": 2.5}, "window=2.5 must be an integer >= 2"),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(MegagateError, match=message):
        SpikeScore(**kwargs)


@pytest.mark.slow
def test_trainer_summary_equals_the_score_recomputed_from_metrics(tmp_path_factory):
    """The clean 200-step run (shared with tests/train/test_monitor_actions.py): summary.json's spike_score is the
    definition applied to the logged loss and grad norm of every step."""
    demo = trainer_jobs.demo_data(tmp_path_factory)
    run = trainer_jobs.run_jobs(tmp_path_factory, demo, {"clean200": trainer_jobs.CLEAN_200})["clean200"]
    assert run.rc == 0, run.log[-3000:]
    records = run.train_records()
    summary = json.loads((run.dir / "summary.json").read_text())["spike_score"]
    for metric in ("loss", "grad_norm"):
        flags = reference_flags(np.asarray([r[metric] for r in records]))
        judged = [f for f in flags if f is not None]
        assert summary[metric]["judged"] == len(judged) == 200 - LOOKBACK
        assert summary[metric]["spikes"] == sum(judged)
        assert summary[metric]["percent"] == pytest.approx(100 * sum(judged) / len(judged))


@pytest.mark.slow
def test_injected_spike_is_counted_and_logged_to_tensorboard(tmp_path_factory):
    """140 steps, a loss x 10 injected at step 135 (after the 128-step look-back): summary.json counts it, and the
    score is the definition applied to the logged curve with that step's loss x 10 (the monitor judges the scaled
    loss; metrics.jsonl keeps the computed one); TensorBoard has spike_score/loss at the logging steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megagate.analysis import report

    fault = {"faults": [{"step": 135, "kind": "scale_loss", "factor": 10}]}
    job = [*trainer_jobs.TINY, "train.train_steps=140", "monitor=" + json.dumps(fault)]  # logging every step
    run = trainer_jobs.run_jobs(tmp_path_factory, trainer_jobs.demo_data(tmp_path_factory), {"spike140": job})
    run = run["spike140"]
    assert run.rc == 0, run.log[-3000:]
    records = {r["step"]: r for r in run.train_records()}
    losses = np.asarray([records[s]["loss"] * (10 if s == 135 else 1) for s in range(1, 141)])
    flags = reference_flags(losses)
    assert flags[134] is True
    summary = json.loads((run.dir / "summary.json").read_text())["spike_score"]["loss"]
    assert summary["judged"] == 140 - LOOKBACK and summary["spikes"] == sum(f for f in flags if f) >= 1
    assert report.load_run(run.dir).spike_score == pytest.approx(summary["percent"])
    acc = EventAccumulator(str(run.dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    logged = {e.step: e.value for e in acc.Scalars("spike_score/loss")}
    assert sorted(logged) == list(range(LOOKBACK + 1, 141))  # every logging step from the first judged one on
    for step, value in logged.items():  # the running percentage, step by step
        judged = flags[LOOKBACK:step]
        assert value == pytest.approx(100 * sum(judged) / len(judged)), step
    assert logged[135] > logged[134]
