"""Which precursor moved first (megagate.analysis.precursors): synthetic run folders with known answers, and the
sample ids of the spiking batch in a real run's events.jsonl."""

from __future__ import annotations

import json
import math

import pytest

from helpers import trainer_jobs
from megagate.analysis import precursors
from megagate.monitor import runfiles


def write_run(run_dir, ratio_jump_at=None, grad_jump_at=None, event_step=100):
    run_dir.mkdir()
    for step in range(10, 101, 10):  # probes every 10 steps, a little noise
        noise = 1 + 0.01 * ((step // 10) % 3)
        ratio = 1e-3 * noise * (5 if ratio_jump_at and step >= ratio_jump_at else 1)
        record = {"step": step, "update_ratio_max": ratio, "max_logit": 8.0 * noise, "log_z_max": 7.6 * noise}
        runfiles.append_jsonl(run_dir / runfiles.PRECURSORS, record)
    for step in range(1, 101):
        gn = (1 + 0.02 * (step % 5)) * (10 if grad_jump_at and step >= grad_jump_at else 1)
        runfiles.write_metrics(run_dir, step, "train", loss=5.0, lr=1e-3, grad_norm=gn, tokens_per_s=1.0)
    event = {"step": event_step, "metric": "loss", "value": 50.0, "baseline": 5.0, "score": 99.0}
    runfiles.append_jsonl(run_dir / runfiles.EVENTS, {**event, "action": "warn", "reason": "robust z > 8"})
    runfiles.append_jsonl(run_dir / runfiles.EVENTS, {**event, "metric": "grad_norm"})


def test_the_update_ratio_moved_twenty_steps_before_the_grad_norm_five(tmp_path):
    write_run(tmp_path / "run", ratio_jump_at=80, grad_jump_at=95)
    (tagged,) = precursors.tag_events(tmp_path / "run")
    assert tagged["step"] == 100 and tagged["metrics"] == ["loss", "grad_norm"]
    assert tagged["leads"] == {"update_ratio_max": 20, "max_logit": None, "log_z_max": None, "grad_norm": 5}
    assert (tagged["first"], tagged["lead_steps"]) == ("update_ratio_max", 20)
    text = precursors.section([tmp_path / "run"], ["g1"])
    assert "g1  step 100 (loss, grad_norm): first moved: update_ratio_max 20 steps before" in text


def test_none_moved_is_an_answer(tmp_path):
    write_run(tmp_path / "run")
    (tagged,) = precursors.tag_events(tmp_path / "run")
    assert tagged["first"] is None and tagged["lead_steps"] is None
    assert set(tagged["leads"].values()) == {None}
    assert "first moved: none" in precursors.section([tmp_path / "run"], ["r"])


def test_moved_at_needs_history_and_counts_non_finite():
    series = [(1, 1.0), (2, 1.01), (3, 9.0), (4, 1.0), (5, 1.02), (6, math.nan), (7, 1.0), (8, 3.0)]
    # step 3 has only 2 values before it (MIN_HISTORY 3): not judged; NaN always moved; 3.0 at step 8 is log(3)
    # = 1.1 over a ~0 median with the 5 % floor: moved
    assert precursors.moved_at(series, log=True) == [6, 8]
    assert precursors.leads(8, {"x": series}, horizon=1) == {"x": 0}  # step 6 is outside [7, 8]


@pytest.mark.slow
def test_events_carry_the_spiking_batch_sample_ids(tmp_path_factory):
    """A 30-step run with a NaN gradient at step 14 (skip: the data order is untouched): the event names the global
    samples [13 x 8, 14 x 8) of the batch that step read; the tagging finds the grad norm moved at the spike's own
    step (lead 0) and the probe precursors (every 5 steps) with too few probes before it to judge."""
    section = {
        "spike": {"min_history": 8, "action": "skip"},
        "diagnostics": {"interval": 5},
        "faults": [{"step": 14, "kind": "nan_grad"}],
    }
    job = [*trainer_jobs.TINY, "logging.tensorboard=false", "monitor=" + json.dumps(section)]
    run = trainer_jobs.run_jobs(tmp_path_factory, trainer_jobs.demo_data(tmp_path_factory), {"nan14": job})
    run = run["nan14"]
    assert run.rc == 0, run.log[-3000:]
    events = runfiles.read_jsonl(run.dir / runfiles.EVENTS)
    assert {e["step"] for e in events} == {14} and all(e["samples"] == [13 * 8, 14 * 8] for e in events)
    (tagged,) = precursors.tag_events(run.dir)
    assert tagged["samples"] == [104, 112] and tagged["leads"]["grad_norm"] == 0
    assert tagged["leads"]["update_ratio_max"] is None and tagged["first"] == "grad_norm"
