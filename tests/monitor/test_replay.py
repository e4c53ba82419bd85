"""`megagate report --replay-monitor`: the spike monitor re-run over a logged curve with other settings."""

from __future__ import annotations

import math

import pytest

from megagate.analysis.replay import parse_settings, replay_events
from megagate.cli import main
from megagate.errors import ConfigError, MegagateError
from megagate.files import write_atomic
from megagate.monitor import runfiles

STEPS = 80


def rows(spike_at: int = 50, height: float = 3.0, skip: int | None = None) -> list[dict]:
    """A falling, slightly noisy loss with one spike, grad norm flat with the same noise."""
    out = []
    for step in range(1, STEPS + 1):
        if step == skip:
            continue
        noise = 0.01 * ((step * 7919) % 13 - 6)
        loss = 6.0 - 0.01 * step + noise + (height if step == spike_at else 0.0)
        out.append({"step": step, "split": "train", "loss": loss, "grad_norm": 1.0 + noise})
    return out


def test_settings_parse_onto_the_defaults_and_bad_ones_are_one_line():
    cfg = parse_settings("min_history=5, threshold=6,metric_thresholds.grad_norm=9")
    assert (cfg.min_history, cfg.threshold, cfg.metric_thresholds, cfg.action) == (5, 6, {"grad_norm": 9}, "warn")
    assert parse_settings("").to_dict() == parse_settings("action=warn").to_dict()
    for text, match in [
        ("min_history", "is not key=value"),
        ("window.loss=3", "only metric_thresholds, abs_ceiling, direction, transform, early_rise take a .metric"),
        ("action=rollback", "only warn replays exactly"),
        ("min_history=500", r"--replay-monitor: monitor.spike.min_history \(500\) must be <= monitor.spike.window"),
        ("colour=red", "monitor.spike.colour is not a known key"),
    ]:
        with pytest.raises(ConfigError, match=match):
            parse_settings(text)


def test_replay_flags_the_spike_once_armed():
    assert replay_events(rows(), parse_settings(""), "run") == [50]  # z of a +3 nat rise over ~0.05 noise
    # before min_history 20: the warm-up rule (a rise of more than 20 % over the median) catches it
    assert replay_events(rows(spike_at=15), parse_settings(""), "run") == [15]
    assert replay_events(rows(spike_at=15), parse_settings("early_rise={}"), "run") == []  # without it: not armed
    assert replay_events(rows(spike_at=15, height=1.0), parse_settings(""), "run") == []  # +1 nat: under 20 %
    assert replay_events(rows(spike_at=15, height=1.0), parse_settings("early_rise.loss=0.1"), "run") == [15]
    assert replay_events(rows(spike_at=15), parse_settings("early_rise={},min_history=5"), "run") == [15]
    assert replay_events(rows(spike_at=3), parse_settings(""), "run") == []  # 2 values: too few even for it
    assert replay_events(rows(height=0.2), parse_settings("threshold=1000"), "run") == []
    nan = rows()
    nan[59]["loss"] = math.nan
    assert replay_events(nan, parse_settings("min_history=100,early_rise={}"), "run") == [60]  # non-finite: always
    with pytest.raises(MegagateError, match=r"run: the log skips steps \(at step 31; logging.interval > 1\?\)"):
        replay_events(rows(skip=30), parse_settings(""), "run")


def test_report_command_replays(tmp_path, capsys):
    run = tmp_path / "sweep" / "baseline_lr1_s0"
    run.mkdir(parents=True)
    write_atomic(run / runfiles.CONFIG, "seed: 0\ntrain: {lr: 1.0}\nmodel: {gate: {preset: baseline}}\n")
    for r in rows(spike_at=25):
        runfiles.write_metrics(run, r["step"], "train", loss=r["loss"], grad_norm=r["grad_norm"], lr=1.0)
    assert main(["report", str(tmp_path / "sweep")]) == 0
    logged = capsys.readouterr().out
    assert (
        main(["report", str(tmp_path / "sweep"), "--replay-monitor", "min_history=5", "--out", str(tmp_path / "o")])
        == 0
    )
    replayed = capsys.readouterr().out
    # no events.jsonl: as logged 0 events, 1 curve spike missed; replayed with min_history 5: detected
    assert " 0/0/1 " in logged.splitlines()[2] + " " and " 1/0/0 " in replayed.splitlines()[2] + " "
    assert "monitor events replayed over the logged curves" in replayed
    record = runfiles.read_json(tmp_path / "o" / "aggregate.json")
    assert record["definitions"]["monitor_events"]["replayed_with"]["min_history"] == 5
    assert record["runs"][0]["event_steps"] == [25]
    assert main(["report", str(tmp_path / "sweep"), "--replay-monitor", "action=skip"]) == 2
    assert "only warn replays exactly" in capsys.readouterr().err


def test_the_warmup_rule_measurement_counts_recall_before_and_after(tmp_path, monkeypatch):
    """tests/monitor/measure_warmup_rule.py (docs/monitoring.md §1.3) on two logged runs: a spike in the warm-up
    (step 12) is missed without the warm-up rule and caught with the defaults; the later one (step 50) by both."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).with_name("measure_warmup_rule.py")
    spec = importlib.util.spec_from_file_location("measure_warmup_rule", path)
    measure = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, measure)  # its dataclass looks its module up there
    spec.loader.exec_module(measure)
    for spike_at in (12, 50):
        run = tmp_path / "sweep" / f"baseline_lr1_s{spike_at}"
        run.mkdir(parents=True)
        write_atomic(
            run / runfiles.CONFIG, f"seed: {spike_at}\ntrain: {{lr: 1.0}}\nmodel: {{gate: {{preset: baseline}}}}\n"
        )
        for r in rows(spike_at=spike_at):
            runfiles.write_metrics(run, r["step"], "train", loss=r["loss"], grad_norm=r["grad_norm"], lr=1.0)
    text = measure.main([str(tmp_path / "sweep")]).splitlines()
    assert text[0] == f"2 runs under {tmp_path / 'sweep'}"
    assert text[3] == "| before (no warm-up rule) | 1 of 2 | 0 of 1 | 1 of 1 | 0 | 1 |", text
    assert text[4] == "| after (defaults) | 2 of 2 | 1 of 1 | 1 of 1 | 0 | 2 |", text
