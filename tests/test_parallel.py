"""TP=2, PP=2 and EP=2 equal the single-process model, over gloo with 2 real processes."""

import pytest

from helpers import distributed, parallel_workers
from megagate.model import gate as gates

pytestmark = pytest.mark.distributed
ATTENTION_VARIANTS = list(gates.PRESETS)


# presets per process pair: the 28 builds of one pair slow down as they go (290 s in one pair on 2 cores, 23 s in
# four pairs of 7), so each chunk gets a fresh pair
CHUNK = 7


@pytest.mark.slow  # ~25 s: every preset at TP 1 and 2 (pp2/ep2 below stay fast)
def test_tp2_equals_tp1_for_every_variant(tmp_path):
    chunks = [ATTENTION_VARIANTS[i : i + CHUNK] for i in range(0, len(ATTENTION_VARIANTS), CHUNK)]
    results = [{} for _ in range(2)]
    for i, chunk in enumerate(chunks):
        (tmp_path / str(i)).mkdir()
        for rank, rank_result in enumerate(distributed.run(parallel_workers.tp_worker, 2, tmp_path / str(i), chunk)):
            results[rank].update(rank_result)
    for rank_result in results:
        assert set(rank_result) == set(ATTENTION_VARIANTS)
        for variant, diff in rank_result.items():
            assert diff["loss"] < 1e-5, (variant, diff)
            assert diff["grad"] < 1e-5 * max(1.0, diff["grad_scale"]), (variant, diff)
            assert diff["checkpoint"] == [], (variant, diff)  # TP-sharded gate parameters split as the table says


PP_EP_VARIANTS = ["g1-elementwise", "g2-headwise", "g1-elementwise-head-shared"]


def test_pp2_schedule_equals_pp1(tmp_path):
    results = distributed.run(parallel_workers.pp_worker, 2, tmp_path, PP_EP_VARIANTS, 4)
    for variant in PP_EP_VARIANTS:
        first, last = sorted((r[variant] for r in results), key=lambda r: r["stage"])
        assert last["num_losses"] == 4 and first["num_losses"] == 0
        assert last["loss"] < 1e-5, (variant, last)
        assert first["grad"] < 1e-5 and last["grad"] < 1e-5, (variant, first, last)
        assert len(set(first["ref_losses"])) == 4  # four different micro-batches really went through


def test_uneven_pp2_split_equals_pp1(tmp_path):
    """megatron's uneven split (parallel.num_layers_in_first_pipeline_stage: 1 of 4 layers on stage 0, 3 on stage 1)
    trains as the single-process model does: the stages hold those layers, the losses and gradients agree."""
    split = {"num_layers_in_first_pipeline_stage": 1}
    results = distributed.run(parallel_workers.pp_worker, 2, tmp_path, PP_EP_VARIANTS[:1], 4, split)
    first, last = sorted((r[PP_EP_VARIANTS[0]] for r in results), key=lambda r: r["stage"])
    assert (first["layers"], last["layers"]) == (1, 3)
    assert last["num_losses"] == 4 and last["loss"] < 1e-5, last
    assert first["grad"] < 1e-5 and last["grad"] < 1e-5, (first, last)


def test_ep2_moe_equals_ep1(tmp_path):
    results = distributed.run(parallel_workers.ep_worker, 2, tmp_path, PP_EP_VARIANTS)
    for rank_result in results:
        for variant, r in rank_result.items():
            assert r["expert_params"] > 0
            assert r["loss"] < 1e-5, (variant, r)
            assert r["grad"] < 1e-5, (variant, r)
