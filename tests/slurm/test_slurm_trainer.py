"""The real trainer (`megagate train`) on the real local Slurm cluster, submitted with `megagate submit`.

2 nodes x 2 tasks = 4 ranks, TP=2 x DP=2 over gloo, the tiny gated model on the demo corpus, 12 steps (global batch
8, micro batch 2, sequence 64), a checkpoint every 3 steps. References outside Slurm: the same run's 4 ranks on one
host with torchrun's variables (forked from the preloaded server, as the hang tests' references are: those tests find
torchrun's ranks bit-identical to them) and a single-process run (TP=1, DP=1), built once per module.

- an uninterrupted Slurm job's losses and final weights equal the 4 local ranks' exactly (and the single process's
  closely);
- in one job: a rank SIGKILLed mid-run fails the step, the job requeues and resumes from the latest checkpoint; the
  resumed launch then gets the warning signal (USR1 to the batch shell), checkpoints and exits 0, the job requeues
  again, resumes exactly there and finishes with the uninterrupted run's losses (replayed steps logged once) and
  bit-identical final weights and optimizer state;
- `scancel --signal=USR1 --full` (every process of the job, as preemption is delivered) after the first checkpoint:
  stop checkpoint, requeue, exact resume.
Plus (no cluster needed): `megagate submit` resolves `model.preset` to the trainer's expert count for the EP checks.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helpers.slurm_harness import REPO
from helpers.tiny_runs import no_stragglers
from helpers.trainer_runs import (
    CHECKPOINT_INTERVAL,
    CONFIG,
    STEPS,
    checkpoint_tensors,
    final_checkpoint,
    kill_rank,
    launches,
    losses,
    overrides,
    train_local,
    train_records,
    wait_lines,
)

SLURM_TIMEOUT = 300


@dataclass(frozen=True)
class Reference:
    demo_dir: Path
    single: Path  # one process, TP=1
    ranks: Path  # 4 ranks on this host, TP=2 x DP=2

    def losses(self) -> dict[int, float]:
        return losses(self.ranks)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, session_demo_dir) -> Reference:
    """The uninterrupted runs outside Slurm, on the session's demo corpus."""
    root = tmp_path_factory.mktemp("trainer-ref")
    ref = Reference(session_demo_dir, root / "single", root / "ranks")
    t_single = train_local(ref.demo_dir, ref.single, nproc=1)
    t_ranks = train_local(ref.demo_dir, ref.ranks, nproc=4)
    print(f"reference runs: single process {t_single:.1f} s, 4 ranks {t_ranks:.1f} s")
    return ref


def submit(
    slurm,
    workdir: Path,
    job_name: str,
    out: Path,
    demo_dir: Path,
    monkeypatch,
    capsys,
    extra: tuple[str, ...] = (),
    nodes: int = 2,
) -> int:
    """`megagate submit` (the CLI entry point, in this process) for the shared run on 2 nodes x 2 CPU tasks
    (`extra`: more overrides; `nodes`: 1 for a TP=2 job on one node)."""
    from megagate import cli

    for key in ("SLURM_CONF", "PYTHONPATH", "PATH"):
        monkeypatch.setenv(key, slurm.env[key])
    monkeypatch.chdir(workdir)
    rc = cli.main(
        [
            "submit",
            str(CONFIG),
            *overrides(demo_dir, out),
            *extra,
            "--nodes",
            str(nodes),
            "--gpus-per-node",
            "0",
            "--tasks-per-node",
            "2",
            "--time",
            "10:00",
            "--signal-lead",
            "60",
            "--master-addr",
            "127.0.0.1",
            "--python",
            sys.executable,
            "--env",
            "GLOO_SOCKET_IFNAME=lo",
            "--job-name",
            job_name,
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert f"# layout: TP=2 PP=1 CP=1 DP={nodes} world={2 * nodes}" in captured.out
    assert captured.out.count(" -m megagate train --config ") == 1
    return int(captured.err.strip().rsplit(" ", 1)[1])


def job_log(workdir: Path, job_name: str, job: int) -> str:
    path = workdir / "logs" / f"{job_name}-{job}.out"
    return path.read_text() if path.exists() else ""


def assert_same_final_state(out: Path, reference: Path) -> int:
    """Every tensor of the final checkpoints (model weights and Adam state) is bit-identical; returns the count."""
    no_stragglers(out)  # a job without a slow rank reports none (its ranks are compared every 4 steps)
    got, want = checkpoint_tensors(final_checkpoint(out)), checkpoint_tensors(final_checkpoint(reference))
    assert sorted(got) == sorted(want)
    model_keys = [k for k in got if k.startswith(("embedding.", "decoder.", "output_layer."))]
    assert "embedding.word_embeddings.weight" in model_keys and len(model_keys) >= 8
    differ = [k for k in got if not torch.equal(got[k], want[k])]
    assert not differ, {k: float((got[k] - want[k]).abs().max()) for k in differ}
    return len(got)


@pytest.mark.slurm
def test_trainer_slurm_job_matches_the_local_ranks(
    slurm, reference: Reference, tmp_path: Path, monkeypatch, capsys
) -> None:
    """(1) `megagate submit` -> 4 ranks on 2 nodes train to completion; loss curve and weights = the local ranks'."""
    out = tmp_path / "run"
    t0 = time.monotonic()
    job = submit(slurm, tmp_path, "plain", out, reference.demo_dir, monkeypatch, capsys)
    info = slurm.wait(job, timeout=SLURM_TIMEOUT)
    elapsed = time.monotonic() - t0
    log = job_log(tmp_path, "plain", job)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "0"), log[-4000:]
    assert info["NodeList"] == "node[1-2]" and info["NumTasks"] == "4"
    assert "megagate-slurm: training step finished (exit 0)" in log
    got, want = losses(out), reference.losses()
    assert got == want, {s: got[s] - want[s] for s in got if got[s] != want[s]}  # bit-identical floats
    assert want[STEPS] < want[1] - 0.3  # it trained (7.63 -> 7.20 measured)
    single = losses(reference.single)  # TP=1 x DP=1: other reduction orders, the same model and data
    assert max(abs(single[s] - got[s]) for s in got) < 1e-4
    n = assert_same_final_state(out, reference.ranks)
    w_got, w_single = checkpoint_tensors(final_checkpoint(out)), checkpoint_tensors(final_checkpoint(reference.single))
    assert max(float((w_got[k] - w_single[k]).abs().max()) for k in w_got if k.startswith("decoder.")) < 1e-5
    print(f"slurm job {job}: {elapsed:.1f} s from submit to COMPLETED; {STEPS} losses and {n} tensors bit-identical")


@pytest.mark.slurm
def test_trainer_killed_rank_and_warning_signal_resume(
    slurm, reference: Reference, tmp_path: Path, monkeypatch, capsys
) -> None:
    """(2) + (3) in one job (one launch less: each costs ~20-40 s of imports and setup on 2 cores).

    Launch 1: rank 2 is SIGKILLed after step 5 -> the step fails -> requeue. Launch 2 resumes from the latest
    checkpoint; once it logged a step, USR1 to the batch shell -> checkpoint, exit 0 -> requeue. Launch 3 resumes
    exactly there and finishes. Every logged loss (replayed steps too) and the final weights and Adam state are
    bit-identical to the uninterrupted run's.
    """
    out = tmp_path / "run"
    t0 = time.monotonic()
    job = submit(slurm, tmp_path, "faults", out, reference.demo_dir, monkeypatch, capsys)
    seen = wait_lines(out, 5)
    kill_rank(f"output.dir={out}", 2)
    slurm.wait(job, until=("PENDING",), release=False, timeout=60)  # the failed step was requeued
    t_requeued = time.monotonic() - t0
    killed_at = len(train_records(out))
    slurm.wait(job, until=("RUNNING",), timeout=60)
    resumed_seen = wait_lines(out, killed_at + 1)
    slurm.cluster.run("scancel", "--batch", "--signal=USR1", str(job))
    info = slurm.wait(job, timeout=SLURM_TIMEOUT)
    elapsed = time.monotonic() - t0
    log = job_log(tmp_path, "faults", job)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "2"), log[-4000:]
    assert "task 2: Killed" in log  # srun saw the rank die
    # the step failed, and the batch script's reason is the survivors' one line (issue 42), not srun's signal
    assert re.search(r"step failed \(exit code \d+: peer lost: rank 2 \(\S+\) vanished .*\); requeueing job", log), log
    assert "caught SIGUSR1" in log and "checkpointed and exited after the warning signal" in log
    assert log.count("requeueing job") == 2 and log.count("training step finished (exit 0)") == 1
    resumes = [
        (int(a), int(b))
        for a, b in re.findall(rf"resumed from {re.escape(str(out))}/checkpoints/iter_(\d{{7}}) at step (\d+) ", log)
    ]
    stops = [int(s) for s in re.findall(r"stopped at step (\d+) \(signal\)", log)]
    assert len(resumes) == 2 and all(a == b for a, b in resumes) and len(stops) == 1, (resumes, stops)
    (resumed, _), (resumed2, _) = resumes
    stopped = stops[0]
    assert resumed2 == stopped  # the warned launch resumes exactly where it stopped
    first, second, third = launches(out, [resumed, stopped])
    assert seen <= killed_at < STEPS
    # the killed launch resumes from its latest checkpoint (one being saved at the kill may be lost); what the killed
    # launch logged after it is replaced by the resumed launch's lines (each step is in metrics.jsonl once)
    assert resumed % CHECKPOINT_INTERVAL == 0 and killed_at - CHECKPOINT_INTERVAL <= resumed <= killed_at
    assert [s for s, _ in first] == list(range(1, resumed + 1))
    assert resumed_seen <= stopped < STEPS and [s for s, _ in second] == list(range(resumed + 1, stopped + 1))
    assert [s for s, _ in third] == list(range(stopped + 1, STEPS + 1))
    want = reference.losses()
    logged = first + second + third
    assert logged == [(s, want[s]) for s in range(1, STEPS + 1)]  # bit-identical, each step once
    n = assert_same_final_state(out, reference.ranks)
    print(
        f"rank 2 killed after step {killed_at} (requeued {t_requeued:.1f} s after submit), resumed at {resumed}; "
        f"USR1 after step {resumed_seen}, stopped at {stopped}, resumed, finished: {elapsed:.1f} s submit -> "
        f"COMPLETED; {len(logged)} losses and {n} tensors bit-identical"
    )


@pytest.mark.slurm
def test_trainer_full_job_usr1_saves_stop_checkpoint_and_resumes(
    slurm, reference: Reference, tmp_path: Path, monkeypatch, capsys
) -> None:
    """(4) `scancel --signal=USR1 --full` after the first checkpoint: USR1 reaches every process of the job (batch
    shell, srun, each rank and each rank's checkpoint-writer Manager), the way Slurm delivers preemption. The ranks
    save the stop checkpoint (the Managers ignore the signal; they used to die of it and the save failed with a
    BrokenPipeError), exit 0, the job requeues, resumes exactly at the stop and ends bit-identical to the
    uninterrupted run.
    """
    out = tmp_path / "run"
    t0 = time.monotonic()
    job = submit(slurm, tmp_path, "full", out, reference.demo_dir, monkeypatch, capsys)
    first_ckpt = out / "checkpoints" / f"iter_{CHECKPOINT_INTERVAL:07d}"
    deadline = time.monotonic() + SLURM_TIMEOUT
    while not first_ckpt.is_dir() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first_ckpt.is_dir(), job_log(tmp_path, "full", job)[-4000:]
    slurm.cluster.run("scancel", "--full", "--signal=USR1", str(job))
    info = slurm.wait(job, timeout=SLURM_TIMEOUT)
    elapsed = time.monotonic() - t0
    log = job_log(tmp_path, "full", job)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), log[-4000:]
    assert "BrokenPipeError" not in log and "Traceback" not in log
    assert "checkpointed and exited after the warning signal (step exit code 0)" in log
    stops = {int(s) for s in re.findall(r"stopped at step (\d+) \(signal\)", log)}
    resumes = {
        (int(a), int(b))
        for a, b in re.findall(rf"resumed from {re.escape(str(out))}/checkpoints/iter_(\d{{7}}) at step (\d+) ", log)
    }
    assert len(stops) == 1 and len(resumes) == 1, (stops, resumes)
    (stopped,), ((resumed, _),) = stops, resumes
    assert resumed == stopped and CHECKPOINT_INTERVAL <= stopped < STEPS  # resumed from the stop checkpoint
    first, second = launches(out, [stopped])
    assert [s for s, _ in first] == list(range(1, stopped + 1))  # nothing trained twice
    assert [s for s, _ in second] == list(range(stopped + 1, STEPS + 1))
    want = reference.losses()
    assert first + second == [(s, want[s]) for s in range(1, STEPS + 1)]  # bit-identical
    n = assert_same_final_state(out, reference.ranks)
    print(
        f"USR1 --full after step {CHECKPOINT_INTERVAL}'s checkpoint: stopped at {stopped}, resumed, finished in "
        f"{elapsed:.1f} s; {STEPS} losses and {n} tensors bit-identical"
    )


# --- a stuck rank on the cluster (megagate.health.watchdog) ------------------------------------------------------
# short watchdog limits (tests/helpers/fault_runs.WATCHDOG) and a hang on rank 2 (node2) in step 5's forward-backward
HANG = ("monitor.faults=[{step: 5, kind: hang, rank: 2, phase: forward_backward}]",)


@pytest.mark.slurm
def test_trainer_hang_is_diagnosed_requeued_resumed_and_finishes(
    slurm, reference: Reference, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A rank that hangs: the watchdog ends the step (exit 75) with the diagnosis, the batch script records it as
    the reason and requeues; the job resumes from step 3's checkpoint and ends bit-identical to the local ranks' run."""
    from helpers.fault_runs import WATCHDOG

    out = tmp_path / "run"
    job = submit(slurm, tmp_path, "hang", out, reference.demo_dir, monkeypatch, capsys, (*WATCHDOG, *HANG))
    info = slurm.wait(job, timeout=SLURM_TIMEOUT)
    log = job_log(tmp_path, "hang", job)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), log[-4000:]
    reason = "hang: rank 2 (node2) did not arrive: forward_backward of step 5 for"
    assert f"megagate train: error: {reason}" in log  # the diagnosing rank's line
    assert re.search(
        rf"megagate-slurm: step failed \(exit code 75: {re.escape(reason)}.*\); requeueing job {job} ", log
    )
    resumes = re.findall(rf"resumed from {re.escape(str(out))}/checkpoints/iter_(\d{{7}}) at step (\d+) ", log)
    assert resumes == [("0000003", "3")], resumes
    assert len(list((out / "watchdog").iterdir())) == 2  # two launches; the first left every rank's stacks
    first = sorted((out / "watchdog").iterdir())[0]
    assert sorted(p.name for p in first.glob("stacks-rank*.txt")) == [f"stacks-rank{r:05d}.txt" for r in range(4)]
    assert losses(out) == reference.losses()  # bit-identical, each step once
    assert_same_final_state(out, reference.ranks)


@pytest.mark.slurm
@pytest.mark.slow
def test_trainer_repeated_hangs_on_one_node_exclude_it(
    slurm, reference: Reference, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A node where every launch hangs (a host fault): after exclude_after_hangs=2 hangs there the job is requeued
    without it (ExcNodeList), runs on the other node and finishes."""
    from helpers.fault_runs import WATCHDOG

    out = tmp_path / "run"
    bad = "monitor.faults=[{step: 5, kind: hang, host: node1, phase: forward_backward}]"
    job = submit(slurm, tmp_path, "badnode", out, reference.demo_dir, monkeypatch, capsys, (*WATCHDOG, bad), nodes=1)
    info = slurm.wait(job, timeout=2 * SLURM_TIMEOUT)
    log = job_log(tmp_path, "badnode", job)
    attempts = re.findall(r"megagate-slurm: job \d+ attempt (\d) \(restart \d of \d+\) on (node\d)", log)
    # requeued held, ExcNodeList set, released: the scheduler cannot start the job on node1 again in between
    assert "landed on excluded host" not in log, log
    assert attempts == [("1", "node1"), ("2", "node1"), ("3", "node2")], attempts
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "2"), log[-4000:]
    assert log.count("hang: rank 0 (node1) did not arrive") >= 2 or log.count("(node1) did not arrive") >= 2
    assert "megagate-slurm: excluding node1 from this job: 2 hangs there (exclude_after_hangs=2)" in log
    assert re.search(rf"requeueing job {job} \(restart 2 of 50\) excluding node1 at", log)
    assert info["ExcNodeList"] == "node1"
    assert "training step finished (exit 0)" in log and "resumed from" in log


# --- model.preset in `megagate submit` (no cluster) -----------------------------------------------------------------
def dry_run(monkeypatch, capsys, tmp_path: Path, argv: list[str]) -> tuple[int, str, str]:
    from megagate import cli

    monkeypatch.chdir(tmp_path)
    rc = cli.main(["submit", *argv, "--dry-run"])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_trainer_preset_sets_submit_expert_count(tmp_path: Path, monkeypatch, capsys) -> None:
    """The EP checks use the trainer's own model config: explicit model.num_experts, else the preset's, else dense."""
    from megagate.slurm import SlurmRequest, check_job

    config = tmp_path / "moe.yaml"
    config.write_text(
        "model:\n  preset: 15a2b-moe\nparallel:\n  expert_model_parallel_size: 8\n"
        "train: {micro_batch_size: 1, global_batch_size: 64}\ndata: {mock: true}\n"
    )
    request = SlurmRequest(nodes=8, gpus_per_node=8)
    cfg, lay = check_job(request, str(config), [])
    assert (cfg.model.num_experts, lay.ep, lay.expert_dp) == (128, 8, 8)
    tiny_moe = check_job(request, str(config), ["model.preset=tiny-moe", "parallel.expert_model_parallel_size=4"])[0]
    assert tiny_moe.model.num_experts == 4
    explicit = check_job(request, str(config), ["model.num_experts=64", "model.preset=tiny-moe"])[0]
    assert explicit.model.num_experts == 64  # explicit wins over the preset's
    assert check_job(SlurmRequest(nodes=1, gpus_per_node=1), str(CONFIG), [])[0].model.num_experts == 0  # tiny: dense

    rc, out, err = dry_run(monkeypatch, capsys, tmp_path, [str(config), "--nodes", "8", "--gpus-per-node", "8"])
    assert rc == 0, err
    assert "# layout: TP=1 PP=1 CP=1 DP=64 EP=8 ETP=1 expert-DP=8 experts=128 world=64" in out
    cases = [
        (
            [str(config), "--nodes", "8", "--gpus-per-node", "8", "parallel.expert_model_parallel_size=6"],
            "parallel.expert_model_parallel_size (6) must divide model.num_experts (128)",
        ),
        (
            [str(config), "--nodes", "8", "--gpus-per-node", "8", "model.preset=tiny-moe"],
            "parallel.expert_model_parallel_size (8) must divide model.num_experts (4)",
        ),
        (
            [str(CONFIG), "--nodes", "1", "--gpus-per-node", "2", "parallel.expert_model_parallel_size=2"],
            "parallel.expert_model_parallel_size (2) needs an MoE model (model.num_experts > 0)",
        ),
        (
            [str(config), "--nodes", "8", "--gpus-per-node", "8", "model.preset=nope"],
            "model preset 'nope' is unknown; known presets: 1.7b-28l, 1.7b-48l, 15a2b-moe, qwen3-next-80b-a3b, "
            "qwen3.5-27b, qwen3.5-35b-a3b, tiny, tiny-moe, tiny-hybrid",
        ),
    ]
    for argv, message in cases:
        rc, out, err = dry_run(monkeypatch, capsys, tmp_path, argv)
        assert (rc, out, err) == (2, "", f"megagate submit: error: {message}\n")
    example = REPO / "slurm" / "examples" / "configs" / "15a2b_moe.yaml"
    rc, out, err = dry_run(monkeypatch, capsys, tmp_path, [str(example), "--nodes", "8", "--gpus-per-node", "8"])
    assert rc == 0 and "experts=128 world=64" in out
