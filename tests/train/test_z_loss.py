"""PaLM's z-loss on the LM head (`train.z_loss_coeff`): the term against a float64 reference with the loss mask, its
gradient, TP 2 against TP 1 over gloo, and real training runs whose TensorBoard files hold it (and coeff 0 none)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import distributed, forked
from helpers import tiny_runs as T
from megagate.model.loss import ZLoss, local_cross_entropy, vocab_parallel_logsumexp
from megagate.train.trainer import _loss_func

COEFF = 3e-2


def _logits_and_mask(s: int = 6, b: int = 3, v: int = 40) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits [s, b, v], labels [b, s] and a loss mask [b, s] whose masked tokens have far larger log Z: a term that
    ignored the mask (or averaged over all tokens) would be far off."""
    gen = torch.Generator().manual_seed(7)
    logits = 3.0 * torch.randn(s, b, v, generator=gen)
    mask = torch.ones(b, s)
    mask[0, :2] = 0.0
    mask[2, 4] = 0.0
    logits[:2, 0] += 20.0  # the masked tokens: log Z about 20 larger
    logits[4, 2] += 20.0
    labels = torch.randint(0, v, (b, s), generator=gen)
    return logits, labels, mask


def _reference(logits: torch.Tensor, mask: torch.Tensor, coeff: float) -> torch.Tensor:
    """coeff * mean over the unmasked tokens of logsumexp(logits)^2, in float64."""
    lse = torch.logsumexp(logits.double(), dim=-1).t()  # [b, s]
    m = mask.double()
    return coeff * (lse.square() * m).sum() / m.sum()


def test_z_loss_term_equals_the_float64_reference_with_the_mask():
    logits, labels, mask = _logits_and_mask()
    head = ZLoss(local_cross_entropy, COEFF, None)
    loss, reported = _loss_func(mask, head, head(labels, logits))
    expected = _reference(logits, mask, COEFF)
    assert reported["z loss"].item() == pytest.approx(expected.item(), rel=1e-6)
    unmasked = _reference(logits, torch.ones_like(mask), COEFF)
    assert abs(unmasked.item() - expected.item()) > 0.1 * expected.item()  # the mask matters in this batch
    # "lm loss" is the cross-entropy alone, bit-identical to the loss function without z-loss; the loss
    # back-propagated is their sum; the term is taken once
    plain, plain_reported = _loss_func(mask, None, local_cross_entropy(labels, logits))
    assert torch.equal(reported["lm loss"], plain_reported["lm loss"]) and "z loss" not in plain_reported
    assert torch.equal(plain, plain_reported["lm loss"])
    assert loss.item() == pytest.approx((plain + reported["z loss"]).item(), rel=1e-7)
    assert head.take() is None


def test_z_loss_gradient_is_the_float64_one():
    """d/dlogits of coeff * mean(lse^2) = coeff * 2 lse softmax(logits) / tokens on unmasked tokens, 0 on masked."""
    logits, labels, mask = _logits_and_mask()
    leaf = logits.clone().requires_grad_(True)
    head = ZLoss(lambda _labels, x: torch.zeros(x.shape[1], x.shape[0]), COEFF, None)  # the z term alone
    loss, _ = _loss_func(mask, head, head(labels, leaf))
    loss.backward()
    ref_leaf = logits.double().requires_grad_(True)
    _reference(ref_leaf, mask, COEFF).backward()
    assert torch.allclose(leaf.grad.double(), ref_leaf.grad, rtol=1e-5, atol=1e-9)
    assert leaf.grad[:2, 0].abs().max().item() == 0.0 and leaf.grad[4, 2].abs().max().item() == 0.0
    lse = torch.logsumexp(logits.double(), -1, keepdim=True)
    closed = COEFF * 2 * lse * torch.softmax(logits.double(), -1) * mask.t().double().unsqueeze(-1) / mask.sum()
    assert torch.allclose(leaf.grad.double(), closed, rtol=1e-5, atol=1e-9)


def test_logsumexp_of_one_shard_is_torch_logsumexp():
    logits, _, _ = _logits_and_mask()
    assert torch.allclose(vocab_parallel_logsumexp(logits, None), torch.logsumexp(logits, -1), rtol=0, atol=1e-5)


def test_step_log_reads_the_z_loss_in_the_same_one_read(megatron_world):
    """The z-loss terms of pending steps come back with their losses and norms in one host read; steps without one
    (coeff 0) read as before."""
    from megagate.train.step_values import HostReads, StepLog

    reads = HostReads()
    log = StepLog(reads)
    for step in (1, 2, 3):
        log.add(step, torch.tensor(7.0 + step, dtype=torch.float64), 0.5 * step, torch.tensor(0.01 * step).double())
    read = log.flush()
    assert reads.count == 1
    assert [(s, v.loss, v.grad_norm, v.z_loss) for s, v in read] == [
        (1, 8.0, 0.5, pytest.approx(0.01)),
        (2, 9.0, 1.0, pytest.approx(0.02)),
        (3, 10.0, 1.5, pytest.approx(0.03)),
    ]
    log.add(4, torch.tensor(6.0, dtype=torch.float64), 2.0)
    assert log.values(4).z_loss is None and (log.values(4).loss, log.values(4).grad_norm) == (6.0, 2.0)
    assert reads.count == 2


@pytest.mark.distributed
def test_tp2_z_loss_equals_tp1(tmp_path):
    """TP 2 (megatron's vocab-parallel cross-entropy, log Z over the two vocabulary shards) gives TP 1's loss,
    cross-entropy, z-loss term and gradients (TP 1: torch's cross-entropy) to float32 rounding."""
    from helpers.z_loss_workers import tp_z_loss_worker

    for r in distributed.run(tp_z_loss_worker, 2, tmp_path):
        assert 2 * r["vocab_shard"] == r["vocab"], r  # each rank holds half the vocabulary's logits
        assert r["tp1_z"] == pytest.approx(r["reference"], rel=1e-6), r
        assert r["tp2_z"] == pytest.approx(r["tp1_z"], rel=1e-6), r
        assert r["tp2_ce"] == pytest.approx(r["tp1_ce"], rel=1e-6), r
        assert r["loss"] < 1e-5 and r["sum"] < 1e-6, r
        assert r["grad"] < 1e-5 * max(1.0, r["grad_scale"]), r
        print(f"TP2 vs TP1: |Δz| {abs(r['tp2_z'] - r['tp1_z']):.2e}, |Δloss| {r['loss']:.2e}, grad {r['grad']:.2e}")


# --- real training runs: TensorBoard --------------------------------------------------------------------------------
RUN = [
    "data.mock=true",
    "data.demo=false",
    "train.train_steps=3",
    "train.warmup_steps=1",
    "train.seq_length=64",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.eval_interval=0",
    "train.eval_iters=1",
    "logging.interval=1",
    "logging.tensorboard=true",
    "checkpoint.interval=0",
    "checkpoint.save_final=false",
]


def _train(out: Path, *overrides: str, nproc: int = 1) -> tuple[dict[int, dict], dict[str, list]]:
    """A 3-step tiny CPU run; (its train records by step, its TensorBoard scalars: tag -> [(step, value)])."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = ["train", "--config", str(T.CONFIG), *RUN, f"output.dir={out}", *overrides]
    proc = forked.run_cli(args, env={**os.environ, "OMP_NUM_THREADS": "1"}, nproc=nproc, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    return {r["step"]: r for r in records if r["split"] == "train"}, scalars


@pytest.fixture(scope="module")
def z_run(tmp_path_factory) -> tuple[dict[int, dict], dict[str, list]]:
    """The 3-step run with train.z_loss_coeff=1e-3 in one process."""
    return _train(tmp_path_factory.mktemp("z") / "run", "train.z_loss_coeff=1e-3")


@pytest.mark.slow  # three tiny runs (~1 min of CPU)
def test_training_logs_the_z_loss_and_coeff_zero_changes_nothing(tmp_path, z_run):
    default, default_tb = _train(tmp_path / "default")
    zero, zero_tb = _train(tmp_path / "zero", "train.z_loss_coeff=0")
    z, z_tb = z_run
    # coeff 0 is the default run: the same losses and grad norms bit for bit, no z-loss scalar anywhere
    assert [(s, r["loss"], r["grad_norm"]) for s, r in zero.items()] == [
        (s, r["loss"], r["grad_norm"]) for s, r in default.items()
    ]
    for records, tb in ((default, default_tb), (zero, zero_tb)):
        assert not [t for t in tb if "z_loss" in t] and all("z_loss" not in r for r in records.values())
    # on: train/z_loss and train/loss_with_z_loss every step, the same numbers as metrics.jsonl
    assert [s for s, _ in z_tb["train/z_loss"]] == [1, 2, 3]
    for step, value in z_tb["train/z_loss"]:
        assert value == pytest.approx(z[step]["z_loss"], rel=1e-6)
        # the tiny model starts with near-uniform logits: log Z close to log(vocab)
        assert value == pytest.approx(1e-3 * torch.log(torch.tensor(2048.0)).item() ** 2, rel=0.05)
    for step, value in z_tb["train/loss_with_z_loss"]:
        assert value == pytest.approx(z[step]["loss"] + z[step]["z_loss"], rel=1e-6)
    # train/loss is the cross-entropy: steps 1 and 2 (the same weights: step 1's LR is 0 in warm-up) equal the
    # default run's; the z-loss gradient changes step 2's update, so step 3 differs
    assert (z[1]["loss"], z[2]["loss"]) == (default[1]["loss"], default[2]["loss"])
    assert z[3]["loss"] != default[3]["loss"]
    assert [v for _, v in z_tb["train/loss"]] == pytest.approx([z[s]["loss"] for s in (1, 2, 3)], rel=1e-6)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"])
def test_tp2_and_pp2_training_log_the_z_loss_of_one_process(tmp_path, z_run, layout):
    """Through the trainer: TP 2 (megatron's vocab-parallel cross-entropy, log Z over the shards) and PP 2 (the term
    on the last stage, shared along the pipeline) log the single-process run's z-loss and loss."""
    ours, tb = _train(tmp_path / "run", "train.z_loss_coeff=1e-3", layout, nproc=2)
    reference = z_run[0]
    assert [s for s, _ in tb["train/z_loss"]] == [1, 2, 3]
    for step, record in ours.items():
        assert record["z_loss"] == pytest.approx(reference[step]["z_loss"], rel=1e-6), (step, record)
        assert record["loss"] == pytest.approx(reference[step]["loss"], rel=1e-6), (step, record)


def test_dry_run_shows_the_z_loss_only_when_on(capsys):
    from megagate.cli import main

    base = ["train", "--dry-run", "--config", str(T.CONFIG), "data.mock=true", "data.demo=false"]
    assert main([*base, "train.z_loss_coeff=1e-4"]) == 0
    assert "z-loss 0.0001 (train/z_loss, not in train/loss)" in capsys.readouterr().out
    assert main(base) == 0
    assert "z-loss" not in capsys.readouterr().out


def test_dry_run_shows_a_softmax_sink_only_when_on(capsys):
    from megagate.cli import main

    base = ["train", "--dry-run", "--config", str(T.CONFIG), "data.mock=true", "data.demo=false"]
    assert main([*base, "model.softmax_type=learnable"]) == 0
    assert "softmax learnable (a sink in every softmax)" in capsys.readouterr().out
    assert main(base) == 0
    assert "softmax" not in capsys.readouterr().out.split("gate:")[1].splitlines()[0]
