"""The trainer end to end on CPU: real text, real megatron schedules/DDP/DistributedOptimizer/dist_checkpointing.

Determinism, exact resume, resharding TP=2 -> TP=1, a crash during a checkpoint save, and the parallel layouts
(TP=2, PP=2, DP=2 with the distributed optimizer, EP=2 MoE) against the single-process run.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import tiny_runs as T

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_dir(session_demo_dir):
    return session_demo_dir


@pytest.fixture(scope="module")
def reference(reference_run):
    """The uninterrupted single-process run every other run is compared with (conftest's, shared by the session)."""
    return reference_run


def test_loss_decreases_and_run_files(reference):
    curve = T.losses(reference)
    assert sorted(curve) == list(range(1, 13))
    assert curve[12] < curve[1] - 0.1  # learns on real text
    assert 7.0 < curve[1] < 8.2  # ~ln(2048) at initialisation
    assert (reference / "summary.json").exists() and (reference / "config.yaml").exists()


def test_save_final_false_leaves_no_checkpoint(tmp_path, demo_dir):
    """checkpoint.save_final=false: neither a stopped nor a completed launch writes one (interval 0), and a rerun
    starts over (nothing to resume from); what it logged says so."""
    off = "checkpoint.save_final=false"
    stopped = T.run_train(tmp_path, demo_dir, off, "train.exit_after_steps=3")
    assert "stopped at step 3 (exit_after_steps=3); no checkpoint at the end (checkpoint.save_final=false)" in (
        stopped.stdout
    )
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
    completed = T.run_train(tmp_path, demo_dir, off, "train.train_steps=4")
    assert "resumed from" not in completed.stdout and "validation at step 4" in completed.stdout
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_same_seed_same_trajectory(reference, tmp_path, demo_dir):
    T.run_train(tmp_path, demo_dir)
    assert T.losses(tmp_path) == T.losses(reference)  # bitwise equal floats


def test_stop_and_resume_is_bitwise_identical(reference, tmp_path, demo_dir):
    """Stopped at step 9 and resumed: the losses and weights of the uninterrupted run, and its summary: divergence
    is judged against the run's first loss (carried by the checkpoint), not the resumed launch's first (step 10's,
    which the final loss of step 12 exceeds in this run)."""
    first = T.run_train(tmp_path, demo_dir, "train.exit_after_steps=9", fresh=True)  # a new interpreter's start-up
    assert "stopped at step 9" in first.stdout
    second = T.run_train(tmp_path, demo_dir)
    assert "resumed from" in second.stdout and "at step 9" in second.stdout
    ref_losses = T.losses(reference)
    assert ref_losses[12] > ref_losses[10]  # what would make the resumed launch look diverged by its own start
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["diverged"] is False and summary == json.loads((reference / "summary.json").read_text())
    # a quiet console: a fresh CPU run (a new interpreter: megatron's import-time notices too) and a resume (forked:
    # the notices of loading a checkpoint) print only megagate's lines (megagate.console filters the known
    # third-party notices; test_finished_run_rerun_changes_nothing shows them with MEGAGATE_VERBOSE=1)
    assert T.foreign_console_lines(first) == [] and T.foreign_console_lines(second) == []
    assert T.losses(tmp_path) == T.losses(reference)
    ours = T.checkpoint_tensors(tmp_path / "checkpoints" / "iter_0000012", tmp_path)
    theirs = T.checkpoint_tensors(reference / "checkpoints" / "iter_0000012", tmp_path)
    assert ours.keys() == theirs.keys() and len(ours) >= 9
    for key in ours:
        assert (ours[key] == theirs[key]).all(), key


def test_kill_during_checkpoint_save_keeps_last_good(reference, tmp_path, demo_dir):
    """SIGKILL while step 8's checkpoint is being written: step 4's stays loadable and the rerun resumes from it."""
    args = [
        "--config",
        str(T.CONFIG),
        *T.BASE,
        f"data.demo_dir={demo_dir}",
        f"output.dir={tmp_path}",
        "checkpoint.interval=4",
        "logging.tensorboard=true",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "megagate", "train", *args],
        cwd=T.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    partial = tmp_path / "checkpoints" / ".iter_0000008.tmp"
    deadline = time.time() + 300
    while not partial.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert partial.exists(), "the save of step 8 was never seen"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    from megagate import checkpoint

    assert checkpoint.latest(tmp_path / "checkpoints").name == "iter_0000004"
    assert not (tmp_path / "checkpoints" / "iter_0000008").exists()
    rerun = T.run_train(tmp_path, demo_dir, "checkpoint.interval=4", "logging.tensorboard=true")
    assert "resumed from" in rerun.stdout and "iter_0000004" in rerun.stdout
    assert T.losses(tmp_path) == T.losses(reference)
    # steps 5-8 were logged by the killed launch and again by the resumed one: each is in metrics.jsonl once
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, 13))
    assert "records after step 4 that the resumed steps log again" in rerun.stdout
    # TensorBoard too (the resumed launch's writer purges what the killed one wrote after step 4)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [e.step for e in scalars] == list(range(1, 13))
    assert [e.value for e in scalars] == pytest.approx([T.losses(reference)[s] for s in range(1, 13)], rel=1e-6)
    assert not partial.exists()  # the stale partial save is cleaned up by the next save


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name, overrides",
    [
        ("tp2", ["parallel.tensor_model_parallel_size=2"]),
        ("pp2", ["parallel.pipeline_model_parallel_size=2"]),
        ("dp2", ["train.use_distributed_optimizer=true"]),
    ],
)
def test_parallel_layouts_match_single_process(reference, tmp_path, demo_dir, name, overrides):
    T.run_train(tmp_path, demo_dir, *overrides, nproc=2)
    ours, theirs = T.losses(tmp_path), T.losses(reference)
    assert sorted(ours) == sorted(theirs)
    for step in theirs:
        assert abs(ours[step] - theirs[step]) < 2e-4, (name, step, ours[step], theirs[step])


@pytest.mark.distributed
def test_ep2_moe_matches_ep1(tmp_path, demo_dir):
    moe = [
        "model.preset=tiny-moe",
        "model.vocab_size=2048",
        "model.moe_aux_loss_coeff=0.0",
        "model.moe_z_loss_coeff=0.0",
    ]
    T.run_train(tmp_path / "ep1", demo_dir, *moe)
    T.run_train(tmp_path / "ep2", demo_dir, *moe, "parallel.expert_model_parallel_size=2", nproc=2)
    ep1, ep2 = T.losses(tmp_path / "ep1"), T.losses(tmp_path / "ep2")
    assert ep1[12] < ep1[1] - 0.1
    for step in ep1:
        assert abs(ep1[step] - ep2[step]) < 2e-4, (step, ep1[step], ep2[step])
    # router health (summary.json, the last logging window = step 12): the world all-reduce of EP 2 counts what
    # EP 1 counts, every token of the step routed to its top 2 of 4 experts in both layers
    import json

    r1, r2 = (json.loads((tmp_path / d / "summary.json").read_text())["router"] for d in ("ep1", "ep2"))
    assert sorted(r1["window"]["layers"]) == ["0", "1"]
    for layer, v in r1["window"]["layers"].items():
        assert v["tokens"] == r2["window"]["layers"][layer]["tokens"] == 8 * 64 * 2
        # a near-tie in the top 2 may route a token differently (the losses agree to 2e-4, not bit for bit)
        assert v["max_over_mean"] == pytest.approx(r2["window"]["layers"][layer]["max_over_mean"], abs=0.05)
        assert 0 < v["entropy"] <= 1
    assert r1["dead_whole_run"] == r2["dead_whole_run"]


@pytest.mark.distributed
def test_checkpoint_saved_with_tp2_resumes_with_tp1(reference, tmp_path, demo_dir):
    # a TP change on resume needs the fully reshardable optimizer format (the default, dp_reshardable, is refused)
    fully = "checkpoint.optimizer_format=fully_reshardable"
    T.run_train(tmp_path, demo_dir, "parallel.tensor_model_parallel_size=2", "train.exit_after_steps=6", fully, nproc=2)
    resumed = T.run_train(tmp_path, demo_dir, fully)
    assert "resharded from" in resumed.stdout
    ours, theirs = T.losses(tmp_path), T.losses(reference)
    for step in range(7, 13):
        assert abs(ours[step] - theirs[step]) < 2e-4, (step, ours[step], theirs[step])


@pytest.mark.distributed
def test_interleaved_pp_matches_single_process(tmp_path, demo_dir):
    """PP=2 x VPP=2 (megatron's interleaved schedule, 4 layers, tied embeddings) equals one process."""
    four = ["model.num_layers=4", "train.train_steps=6"]
    T.run_train(tmp_path / "single", demo_dir, *four)
    T.run_train(
        tmp_path / "vpp",
        demo_dir,
        *four,
        "parallel.pipeline_model_parallel_size=2",
        "parallel.virtual_pipeline_model_parallel_size=2",
        nproc=2,
    )
    single, vpp = T.losses(tmp_path / "single"), T.losses(tmp_path / "vpp")
    assert sorted(single) == sorted(vpp) == list(range(1, 7))
    for step in single:
        assert abs(single[step] - vpp[step]) < 2e-4, (step, single[step], vpp[step])


# --- what a resume keeps and may change (megagate.train.resume) ---------------------------------------------------
def _snapshot(run: Path) -> dict[str, bytes]:
    """Every file of a run directory, but the lock file (each launch writes its own holder into it)."""
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(Path(run).rglob("*"))
        if p.is_file() and p.name != ".megagate.lock"
    }


def test_finished_run_rerun_changes_nothing(reference, demo_dir):
    """A completed run started again (e.g. a requeued job) is a no-op: every file of the run stays byte-identical.
    Rerun with MEGAGATE_VERBOSE=1: the console shows the third-party notices megagate.console filters otherwise
    (those of a start-up and of loading a checkpoint), so the quiet-console checks above are not vacuous."""
    before = _snapshot(reference)
    rerun = T.run_train(reference, demo_dir, env={"MEGAGATE_VERBOSE": "1"}, fresh=True)  # import-time notices too
    assert "already complete at step 12; nothing to do" in rerun.stdout
    for notice in (
        "UserWarning: Apex is not installed. Falling back to Torch Norm",
        "FutureWarning: Please use DTensor instead and we are deprecating ShardedTensor.",
        "and md.size != obj.size()",  # the source line Python prints under torch's warning
    ):
        assert notice in rerun.stderr, notice
    assert "[Gloo] Rank 0 is connected to 0 peer ranks" in rerun.stdout
    after = _snapshot(reference)
    assert after.keys() == before.keys() and all(after[k] == before[k] for k in before)
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["diverged"] is False and summary["final_loss"] == T.losses(reference)[12]


def test_resume_with_another_gate_is_one_line(reference, tmp_path, demo_dir):
    """The reference's step-12 checkpoint under a baseline (ungated) config: refused in one line before loading."""
    proc = T.run_train(
        tmp_path, demo_dir, "model.gate=baseline", f"checkpoint.dir={reference / 'checkpoints'}", check=False
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and "cannot resume from" in lines[0] and "model.gate.position 'g1' -> 'none'" in lines[0]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_new_global_batch_size_from_a_step_on(reference, tmp_path, demo_dir):
    """6 steps at global batch 8, then 6 at 16: steps 1-6 as the reference, the data position (48 samples) read in
    the same order, the schedule recomputed for the remaining samples (LR decays to min_lr at step 12 exactly)."""
    first = T.run_train(tmp_path, demo_dir, "train.exit_after_steps=6")
    assert "stopped at step 6" in first.stdout
    second = T.run_train(tmp_path, demo_dir, "train.global_batch_size=16")
    assert "the schedule follows this config from step 7 on: train.global_batch_size 8 -> 16" in second.stdout
    assert "data order differs" not in second.stdout  # within the first epoch the order is the same
    ours, want = T.losses(tmp_path), T.losses(reference)
    assert sorted(ours) == list(range(1, 13)) and all(ours[s] == want[s] for s in range(1, 7))
    meta = json.loads((tmp_path / "checkpoints" / "iter_0000012" / "megagate.json").read_text())
    assert meta["consumed_samples"] == 48 + 6 * 16 and meta["scheduler"]["num_steps"] == 144
    assert meta["scheduler"]["lr_decay_steps"] == 144
    records = map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
    lrs = [r["lr"] for r in records if r["split"] == "train"]
    assert lrs[6:] == sorted(lrs[6:], reverse=True) and lrs[-1] > 1e-5  # the last update still above min_lr
