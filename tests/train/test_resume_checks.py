"""What a resume must keep and what it may change (megagate.train.resume), on real configs and megatron's scheduler."""

from __future__ import annotations

import math

import pytest
import torch

from megagate import checkpoint as ckpt
from megagate import config_reader, run_config
from megagate.errors import MegagateError
from megagate.train import resume

BASE = {"model": {"preset": "tiny", "gate": "g1-elementwise"}, "data": {"mock": True}}


def cfg(**sections) -> run_config.TrainConfig:
    data = {k: dict(v) for k, v in BASE.items()}
    for key, value in sections.items():
        data.setdefault(key, {}).update(value) if isinstance(value, dict) else data.__setitem__(key, value)
    return config_reader.from_dict(data)


def meta_of(c: run_config.TrainConfig, step: int = 6, consumed: int = 48, **extra) -> dict:
    return {
        "step": step,
        "consumed_samples": consumed,
        "architecture": ckpt.architecture(c),
        "data_order": resume.data_order(c, None),
        "schedule": resume.schedule(c),
        "layout": {"tp": 1, "pp": 1, "ep": 1, "dp": 1, "cp": 1, "vpp": None},
        **extra,
    }


def test_same_config_resumes():
    c = cfg()
    resume.check_compatible(meta_of(c), c)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"model": {"gate": "baseline"}}, "model.gate.position 'g1' -> 'none'"),
        ({"model": {"gate": "g1-headwise"}}, "model.gate.granularity 'elementwise' -> 'headwise'"),
        ({"model": {"num_layers": 4}}, "model.num_layers 2 -> 4"),
        ({"model": {"vocab_size": 4096}}, "model.vocab_size"),
        ({"model": {"qk_layernorm": False}}, "model.qk_layernorm True -> False"),
        ({"train": {"seq_length": 64}}, "train.seq_length 128 -> 64"),
        ({"seed": 7}, "seed 1234 -> 7"),
        ({"data": {"split": "900,99,1"}}, "data.split '969,30,1' -> '900,99,1'"),
    ],
)
def test_what_must_match_is_named_in_one_line(change, named):
    saved, now = cfg(), cfg(**change)
    with pytest.raises(MegagateError) as err:
        resume.check_compatible(meta_of(saved), now, path="runs/x/checkpoints/iter_0000006")
    message = str(err.value)
    assert "\n" not in message and named in message and "iter_0000006" in message, message


def test_what_may_change_is_accepted():
    saved = cfg()
    # the layout (resharded), the schedule, the batch, the z-loss and the rotary base may change between launches
    now = cfg(
        parallel={"tensor_model_parallel_size": 2},
        train={"global_batch_size": 32, "train_steps": 200, "lr": 3e-4, "z_loss_coeff": 1e-4},
        model={"rotary_base": 10000},
    )
    resume.check_compatible(meta_of(saved), now)


def test_tokenizer_compared_by_content(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text('{"vocab": 1}')
    b.write_text('{"vocab": 2}')
    c = cfg()
    meta = {**meta_of(c), "data_order": resume.data_order(c, str(a))}
    resume.check_compatible(meta, c, tokenizer=str(a))
    moved = tmp_path / "moved.json"
    moved.write_text(a.read_text())
    resume.check_compatible(meta, c, tokenizer=str(moved))  # the same file elsewhere is the same tokenizer
    with pytest.raises(MegagateError, match="data.tokenizer"):
        resume.check_compatible(meta, c, tokenizer=str(b))


def test_dp_reshardable_checkpoint_refuses_a_tp_change():
    saved, now = cfg(), cfg(parallel={"tensor_model_parallel_size": 2})
    meta = {**meta_of(saved), "optimizer_format": "dp_reshardable"}
    with pytest.raises(MegagateError, match="tp 1 -> 2"):
        resume.check_compatible(meta, now)
    resume.check_compatible({**meta, "layout": {**meta["layout"], "dp": 4}}, saved)  # DP may change


def _scheduler(c: run_config.TrainConfig):
    """megatron's OptimizerParamScheduler exactly as the trainer builds it, on a one-parameter optimizer."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t, gbs = c.train, c.train.global_batch_size
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=t.lr)
    return OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.warmup_steps * gbs,
        lr_decay_steps=t.train_steps * gbs,
        lr_decay_style="cosine",
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=t.train_steps * gbs,
        wd_incr_style="constant",
    )


def _cosine(lr: float, min_lr: float, done: float, warmup: float, total: float) -> float:
    ratio = (done - warmup) / (total - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


def test_unchanged_schedule_is_left_exactly_as_saved():
    c = cfg(train={"global_batch_size": 8, "micro_batch_size": 4, "train_steps": 12, "warmup_steps": 2})
    sched = _scheduler(c)
    for _ in range(6):
        sched.step(increment=8)
    before = sched.state_dict()
    assert resume.reschedule(sched, meta_of(c, 6, 48), c) == []
    assert sched.state_dict() == before


def test_new_global_batch_size_keeps_the_position_and_ends_at_min_lr():
    old = cfg(train={"global_batch_size": 8, "micro_batch_size": 4, "train_steps": 12, "warmup_steps": 2})
    new = cfg(train={"global_batch_size": 16, "micro_batch_size": 4, "train_steps": 12, "warmup_steps": 2})
    sched = _scheduler(old)
    for _ in range(6):
        sched.step(increment=8)
    lr_at_6 = sched.get_lr(sched.optimizer.param_groups[0])
    assert lr_at_6 == pytest.approx(_cosine(1e-3, 1e-5, 48, 16, 96), rel=1e-12)
    changes = resume.reschedule(sched, meta_of(old, 6, 48), new)
    assert changes == ["train.global_batch_size 8 -> 16"]
    # the position (48 samples) is where it was; the cosine now spans the 6 remaining steps of 16 samples, so the
    # run still ends at min_lr after step 12 (megatron alone would keep decaying over 96 samples: min_lr at step 9)
    assert sched.num_steps == 48
    now = sched.get_lr(sched.optimizer.param_groups[0])
    assert now == pytest.approx(_cosine(1e-3, 1e-5, 48, 16, 48 + 6 * 16), rel=1e-12) and now > lr_at_6
    seen = []
    for _ in range(6):
        sched.step(increment=16)
        seen.append(sched.get_lr(sched.optimizer.param_groups[0]))
    assert seen[-1] == pytest.approx(1e-5, rel=1e-12)  # min_lr after step 12, not before
    assert seen[-2] > 1e-5 * 1.01
    assert seen == sorted(seen, reverse=True)


def test_longer_run_and_new_peak_lr_follow_the_config():
    old = cfg(train={"global_batch_size": 8, "micro_batch_size": 4, "train_steps": 12, "warmup_steps": 2})
    new = cfg(train={"global_batch_size": 8, "micro_batch_size": 4, "train_steps": 24, "warmup_steps": 2, "lr": 5e-4})
    sched = _scheduler(old)
    for _ in range(6):
        sched.step(increment=8)
    changes = resume.reschedule(sched, meta_of(old, 6, 48), new)
    assert set(changes) == {"train.train_steps 12 -> 24", "train.lr 0.001 -> 0.0005"}
    want = _cosine(5e-4, 1e-5, 48, 16, 24 * 8)
    assert sched.get_lr(sched.optimizer.param_groups[0]) == pytest.approx(want, rel=1e-12)
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12)  # applied to the next update


def test_order_digest_tells_same_from_reshuffled_data(session_demo_dir, tmp_path):
    """megatron's GPTDataset on the demo corpus: built for 96 or 144 samples (one epoch) it reads the same samples
    at position 48; built for more than an epoch it is reshuffled, and the digest says so."""
    from megagate.data.demo import prepare_demo_data
    from megagate.data.loader import build_datasets

    tokenizer, prefix = prepare_demo_data(session_demo_dir, 2048, 1_500_000)  # conftest's corpus

    def train_set(samples: int):
        return build_datasets(
            [prefix],
            tokenizer=tokenizer,
            seq_length=64,
            num_samples=(samples, 8, None),
            split="98,2,0",
            cache_dir=tmp_path / f"cache{samples}",
        )[0]

    small = train_set(96)
    saved = resume.order_digest(small, 48)
    assert saved["count"] == resume.ORDER_WINDOW and len(saved["sha256"]) == 64
    assert not resume.order_changed(saved, train_set(144))
    epoch = len(small)  # one epoch's samples (the dataset holds whole epochs)
    assert resume.order_changed(saved, train_set(epoch + 1))
