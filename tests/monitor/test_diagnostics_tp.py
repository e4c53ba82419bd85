"""The probe's TP reductions through real runs: `megagate train` with the diagnostics on, once in one process and
once with tensor parallelism 2 (two gloo ranks, heads and the vocabulary split), logs the same F-Attn, Sink, max
logit, log Z and per-layer update ratio (measured: to ~1e-7; asserted to 1e-5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import tiny_runs as T

pytestmark = pytest.mark.distributed
PROBE = ["monitor.diagnostics.interval=3", "train.train_steps=6"]


def records(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def test_tp2_probe_equals_one_process(tmp_path: Path, session_demo_dir: Path) -> None:
    T.run_train(tmp_path / "tp1", session_demo_dir, *PROBE)
    T.run_train(tmp_path / "tp2", session_demo_dir, *PROBE, "parallel.tensor_model_parallel_size=2", nproc=2)
    one, two = (records(tmp_path / d, "diagnostics.jsonl") for d in ("tp1", "tp2"))
    assert (
        [(r["step"], r["layer"]) for r in one]
        == [(r["step"], r["layer"]) for r in two]
        == [
            (3, 0),
            (3, 1),
            (6, 0),
            (6, 1),
        ]
    )
    for a, b in zip(one, two):
        for key in ("f_attn", "max_logit", "m_act", "gate_score_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
        assert a["sink"] == b["sink"] and a["sink_length"] == b["sink_length"] == 64  # shares of whole pairs
    one, two = (records(tmp_path / d, "precursors.jsonl") for d in ("tp1", "tp2"))
    assert [r["step"] for r in one] == [r["step"] for r in two] == [3, 6]
    for a, b in zip(one, two):
        assert a["log_z_mean"] == pytest.approx(b["log_z_mean"], rel=1e-5)  # the vocabulary's two shards combined
        assert a["log_z_max"] == pytest.approx(b["log_z_max"], rel=1e-5)
        assert sorted(a["update_ratio"]) == sorted(b["update_ratio"]) == ["0", "1", "other"]
        for layer, value in a["update_ratio"].items():  # TP shards add up, replicated norms count once
            assert b["update_ratio"][layer] == pytest.approx(value, rel=1e-5), layer
