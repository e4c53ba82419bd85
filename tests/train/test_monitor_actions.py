"""The spike monitor's actions, fault injection and live diagnostics through the real trainer (`megagate train`).

Each injected fault must be detected at exactly its step and the configured action carried out on real weights:

    skip        nan_grad at step 12        the update is dropped: weights after 12 == weights after 11
    rollback    loss x 10 at step 17       step 15's checkpoint is restored, batch 17 dropped, the run completes
    lr_backoff  loss x 10 at step 14       LR x 0.5 for steps 14..18, the schedule's LR before and after
    abort       loss x 10 at step 12       exit 2, one error line, checkpoint of step 12, summary diverged

plus a clean 200-step run without any event at the default thresholds, diagnostics every 5 steps (JSONL and
TensorBoard) and `megagate analyze` on a trained checkpoint.

The 30-step runs share one trainer configuration; they differ only in `monitor.spike.action`, the fault and the
checkpoint interval, so each is compared with the clean run step by step. They run in children forked from the
preloaded server, two at a time (helpers.trainer_jobs: `megagate.cli.main(["train", ...])` for each, cached for the
session: tests/monitor/test_spike.py reuses clean200); the abort run is a fresh `python -m megagate train` process
(its exit code and its stderr, interpreter start-up included, are what it tests) started at the same time.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import trainer_jobs

# The module's runs take ~40 s of CPU (about 1 minute on 2 idle cores, 2+ minutes on a loaded machine).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny_cpu.yaml"
STEPS = 30
K_SKIP, K_ROLLBACK, K_BACKOFF, K_ABORT = 12, 17, 14, 12
BACKOFF_FACTOR, BACKOFF_STEPS = 0.5, 5
DIAG_INTERVAL = 5
BASE = trainer_jobs.TINY  # train_steps 30, seq 64, one micro-batch of 8, warm-up 3, logging every step
DIST_VARS = trainer_jobs.DIST_VARS


def monitor(action: str, faults: list[dict] | None = None, **spike: Any) -> str:
    """A `monitor=` override: the shared spike settings (min_history 8) + action, diagnostics every 5, faults."""
    section = {
        "spike": {"min_history": 8, "action": action, **spike},
        "diagnostics": {"interval": DIAG_INTERVAL},
        "faults": faults or [],
    }
    return "monitor=" + json.dumps(section)  # JSON is YAML


def train_args(out: Path, demo_dir: Path, *overrides: str) -> list[str]:
    return ["--config", str(CONFIG), *overrides, f"data.demo_dir={demo_dir}", f"output.dir={out}"]


SCENARIOS: dict[str, list[str]] = {
    "clean": [*BASE, monitor("warn"), "checkpoint.interval=5"],
    "skip": [
        *BASE,
        monitor("skip", [{"step": K_SKIP, "kind": "nan_grad"}]),
        "checkpoint.interval=1",
        "checkpoint.keep_last=100",
    ],
    "rollback": [
        *BASE,
        monitor("rollback", [{"step": K_ROLLBACK, "kind": "scale_loss", "factor": 10}]),
        "checkpoint.interval=5",
        "checkpoint.keep_last=100",
    ],
    "lr_backoff": [
        *BASE,
        monitor(
            "lr_backoff",
            [{"step": K_BACKOFF, "kind": "scale_loss", "factor": 10}],
            lr_backoff_factor=BACKOFF_FACTOR,
            lr_backoff_steps=BACKOFF_STEPS,
        ),
    ],
    # the default monitor (spike: warn at the default thresholds), 200 steps of seq 64 x batch 8
    "clean200": trainer_jobs.CLEAN_200,
}


# --- running -------------------------------------------------------------------------------------------------------
def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, session_demo_dir: Path) -> dict[str, Any]:
    """Run dirs of the 30-step scenarios (+ 'abort': the CompletedProcess-like result of the abort run)."""
    base = tmp_path_factory.mktemp("monitor-actions")
    abort_args = train_args(
        base / "abort",
        session_demo_dir,
        *BASE,
        "logging.tensorboard=false",
        monitor("abort", [{"step": K_ABORT, "kind": "scale_loss", "factor": 10}]),
    )
    start = time.perf_counter()
    abort = subprocess.Popen(
        [sys.executable, "-m", "megagate", "train", *abort_args],
        cwd=ROOT,
        env=_child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    jobs = trainer_jobs.run_jobs(tmp_path_factory, session_demo_dir, SCENARIOS)
    stdout, stderr = abort.communicate(timeout=600)
    result: dict[str, Any] = {
        "abort": subprocess.CompletedProcess(abort.args, abort.returncode, stdout, stderr),
        "abort_dir": base / "abort",
        "seconds": time.perf_counter() - start,
    }
    for name, job in jobs.items():
        assert job.rc == 0, f"scenario {name} failed: rc {job.rc}\n{job.log[-4000:]}"
        result[name] = job.dir
        result[f"{name}_log"] = job.log
    return result


# --- reading run files ---------------------------------------------------------------------------------------------
def train_records(run_dir: Path) -> dict[int, dict]:
    """step -> the last train record of that step in metrics.jsonl (a rollback replays steps)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["split"] == "train":
            out[record["step"]] = record
    return out


def all_train_steps(run_dir: Path) -> list[int]:
    return [
        r["step"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if r["split"] == "train"
    ]


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def checkpoint_tensors(path: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a dist_checkpointing checkpoint (model and optimizer state), read with torch DCP."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp / f"{path.parent.parent.name}-{path.name}.pt"
    dcp_to_torch_save(str(path), str(target))
    state = torch.load(target, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def model_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if not k.startswith("optimizer")}


# --- the actions ---------------------------------------------------------------------------------------------------
def test_clean_reference_has_no_events_and_learns(runs: dict) -> None:
    clean = train_records(runs["clean"])
    assert sorted(clean) == list(range(1, STEPS + 1))
    assert events(runs["clean"]) == []  # min_history 8 does not turn the falling loss into events
    assert clean[STEPS]["loss"] < clean[1]["loss"] - 0.5
    assert summary(runs["clean"])["diverged"] is False


def test_skip_nan_grad_keeps_weights_bit_identical(runs: dict, tmp_path: Path) -> None:
    run = runs["skip"]
    evs = events(run)
    assert {(e["step"], e["action"]) for e in evs} == {(K_SKIP, "skip")}
    assert any(e["metric"] == "grad_norm" and e["reason"] == "non-finite" for e in evs)
    records, clean = train_records(run), train_records(runs["clean"])
    assert records[K_SKIP]["skipped"] == 1.0 and all(r["skipped"] == 0.0 for s, r in records.items() if s != K_SKIP)
    assert str(records[K_SKIP]["grad_norm"]).lower() == "nan"  # non-finite values are strings in the JSONL
    # identical to the clean run until the skipped step, different after it
    assert [records[s]["loss"] for s in range(1, K_SKIP + 1)] == [clean[s]["loss"] for s in range(1, K_SKIP + 1)]
    assert records[K_SKIP + 1]["loss"] != clean[K_SKIP + 1]["loss"]
    ckpts = run / "checkpoints"
    before, at, after = (
        checkpoint_tensors(ckpts / f"iter_{s:07d}", tmp_path) for s in (K_SKIP - 1, K_SKIP, K_SKIP + 1)
    )
    assert before.keys() == at.keys() and len(model_tensors(at)) >= 9
    for key in at:  # model weights and Adam moments: nothing applied at the skipped step
        assert torch.equal(before[key], at[key]), key
    changed = [k for k in model_tensors(at) if not torch.equal(at[k], after[k])]
    assert len(changed) == len(model_tensors(at))  # the next step updates every weight again
    assert summary(run) == {**summary(run), "steps": STEPS, "diverged": False}


def test_rollback_restores_checkpoint_and_drops_the_batch(runs: dict) -> None:
    run, log = runs["rollback"], runs["rollback_log"]
    evs = events(run)
    assert {(e["step"], e["action"]) for e in evs} == {(K_ROLLBACK, "rollback")}
    assert any(e["metric"] == "loss" and e["value"] > 5 * e["baseline"] for e in evs)
    restore = K_ROLLBACK // 5 * 5
    assert f"rollback: spike at step {K_ROLLBACK}; restored step {restore} from" in log
    assert f"dropping batches {K_ROLLBACK}-{K_ROLLBACK}" in log
    # steps restore+1 .. K-1 were trained twice (before the spike and after the restore), K only once
    steps = all_train_steps(run)
    assert steps == list(range(1, K_ROLLBACK)) + list(range(restore + 1, STEPS + 1))
    s = summary(run)
    assert s["steps"] == STEPS and s["diverged"] is False and s["spikes"] == 1
    records, clean = train_records(run), train_records(runs["clean"])
    # the replay after the restore is bit-identical to the clean run up to the spike step (same batches, RNG) ...
    assert [records[i]["loss"] for i in range(1, K_ROLLBACK)] == [clean[i]["loss"] for i in range(1, K_ROLLBACK)]
    # ... and differs from the spike step on: step K trains on batch K+1
    assert all(records[i]["loss"] != clean[i]["loss"] for i in range(K_ROLLBACK, STEPS + 1))
    # the restored LR schedule goes on by step (megatron's scheduler load adds step counts: reset before a restore)
    assert [records[i]["lr"] for i in range(1, STEPS + 1)] == [clean[i]["lr"] for i in range(1, STEPS + 1)]
    assert (run / "checkpoints" / f"iter_{STEPS:07d}").is_dir()


def test_lr_backoff_scales_the_lr_of_the_following_steps(runs: dict) -> None:
    run = runs["lr_backoff"]
    assert [(e["step"], e["action"]) for e in events(run)] == [(K_BACKOFF, "lr_backoff")]
    records, clean = train_records(run), train_records(runs["clean"])
    ratios = {s: records[s]["lr"] / clean[s]["lr"] for s in range(2, STEPS + 1)}  # step 1's LR is 0 (warmup)
    backoff = range(K_BACKOFF, K_BACKOFF + BACKOFF_STEPS)
    for step, ratio in ratios.items():
        assert ratio == pytest.approx(BACKOFF_FACTOR if step in backoff else 1.0, rel=1e-12), step
    assert [records[s]["loss"] for s in range(1, K_BACKOFF + 1)] == [clean[s]["loss"] for s in range(1, K_BACKOFF + 1)]
    assert records[K_BACKOFF + 1]["loss"] != clean[K_BACKOFF + 1]["loss"]
    assert summary(run)["steps"] == STEPS and summary(run)["diverged"] is False


def test_abort_exits_with_one_line_and_a_checkpoint(runs: dict) -> None:
    proc, run = runs["abort"], runs["abort_dir"]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("megagate train: error:")]
    assert len(errors) == 1 and f"aborted by the spike monitor at step {K_ABORT}" in errors[0], proc.stderr[-3000:]
    assert [(e["step"], e["action"]) for e in events(run)] == [(K_ABORT, "abort")]
    from megagate import checkpoint

    latest = checkpoint.latest(run / "checkpoints")
    assert latest is not None and latest.name == f"iter_{K_ABORT:07d}"
    assert checkpoint.read_meta(latest)["step"] == K_ABORT
    s = summary(run)
    assert s["diverged"] is True and s["steps"] == K_ABORT and s.get("aborted") is True
    assert max(train_records(run)) == K_ABORT  # the aborted step is logged (its loss is what tripped the monitor)


# --- diagnostics ---------------------------------------------------------------------------------------------------
def test_live_diagnostics_jsonl_and_tensorboard(runs: dict) -> None:
    run = runs["clean"]
    records = [json.loads(line) for line in (run / "diagnostics.jsonl").read_text().splitlines()]
    expected_steps = list(range(DIAG_INTERVAL, STEPS + 1, DIAG_INTERVAL))
    assert sorted({(r["step"], r["layer"]) for r in records}) == [
        (s, layer) for s in expected_steps for layer in (0, 1)
    ]
    for r in records:
        assert 0.0 < r["gate_score_mean"] < 1.0 and 0.0 <= r["gate_sparsity"] <= 1.0
        assert 0.0 < r["f_attn"] < 1.0
        assert r["m_act"] > 0 and math.isfinite(r["max_logit"])
        assert 0.0 <= r["sink"] <= 1.0 and r["sink_length"] == 64  # Gu et al.'s T = 64 = train.seq_length here
    # the probe batch is fixed, the model trains: the statistics move between probes
    by_step = {s: [r for r in records if r["step"] == s and r["layer"] == 0][0] for s in expected_steps}
    assert by_step[5]["m_act"] != by_step[STEPS]["m_act"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("diag/f_attn", "diag/sink", "diag/gate_score", "diag/m_act", "diag/max_logit", "diag/layer_01/f_attn"):
        assert tag in tags, sorted(tags)
        assert [e.step for e in acc.Scalars(tag)] == expected_steps
    m_act = {e.step: e.value for e in acc.Scalars("diag/m_act")}
    top = {s: max(r["m_act"] for r in records if r["step"] == s) for s in expected_steps}
    assert m_act == pytest.approx(top, rel=1e-6)
    # summary.json: the last probe's model-level values (Sink^0.3_1 beside F-Attn, the precursors)
    last = summary(run)["diagnostics"]
    assert last["step"] == STEPS and last["m_act"] == pytest.approx(top[STEPS], rel=1e-6)
    layers = [r for r in records if r["step"] == STEPS]
    assert last["sink"] == pytest.approx(sum(r["sink"] for r in layers) / len(layers))
    assert last["max_logit"] == max(r["max_logit"] for r in layers) and last["update_ratio_max"] > 0
    for tag in (
        "precursor/update_ratio",
        "precursor/max_logit",
        "precursor/log_z_max",
        "precursor/layer_01/update_ratio",
    ):
        assert [e.step for e in acc.Scalars(tag)] == expected_steps, tag


def test_update_ratio_precursor_equals_the_checkpoints(runs: dict, tmp_path: Path) -> None:
    """precursors.jsonl's per-layer update RMS / weight RMS at the probe steps 10 and 15 of the skip run (checkpoints
    every step) equals ||w_s - w_(s-1)|| / ||w_(s-1)|| computed from its checkpoints; log Z and max logit are there."""
    run = runs["skip"]
    records = {r["step"]: r for r in map(json.loads, (run / "precursors.jsonl").read_text().splitlines())}
    assert sorted(records) == list(range(DIAG_INTERVAL, STEPS + 1, DIAG_INTERVAL))
    for step in (10, 15):
        before, after = (
            model_tensors(checkpoint_tensors(run / "checkpoints" / f"iter_{s:07d}", tmp_path)) for s in (step - 1, step)
        )
        sums: dict[str, list[float]] = {}
        for key, w in before.items():
            if not w.is_floating_point() or "_extra_state" in key:
                continue
            # dist_checkpointing stacks the layers' tensors on a leading axis: decoder.layers.<name> [L, ...]
            parts = enumerate(zip(w, after[key])) if key.startswith("decoder.layers.") else [("other", (w, after[key]))]
            for group, (old, new) in parts:
                acc = sums.setdefault(str(group), [0.0, 0.0])
                acc[0] += float((new.double() - old.double()).square().sum())
                acc[1] += float(old.double().square().sum())
        expected = {k: math.sqrt(u / w) for k, (u, w) in sums.items()}
        assert records[step]["update_ratio"] == pytest.approx(expected, rel=1e-6), step
        assert records[step]["update_ratio_max"] == max(expected.values())
        assert math.isfinite(records[step]["log_z_mean"]) and records[step]["log_z_max"] >= records[step]["log_z_mean"]
        assert math.isfinite(records[step]["max_logit"])


# --- clean long run ------------------------------------------------------------------------------------------------
def test_clean_200_steps_raise_no_spike_event(runs: dict) -> None:
    """200 tiny steps (seq 64, batch 8) at the default monitor settings: no event."""
    run = runs["clean200"]
    records = train_records(run)
    assert sorted(records) == list(range(1, 201))
    assert not (run / "events.jsonl").exists() or (run / "events.jsonl").read_text() == ""
    assert summary(run)["spikes"] == 0 and summary(run)["diverged"] is False
    assert records[200]["loss"] < records[1]["loss"] - 1.5  # it trained (7.6 -> ~5.x)
