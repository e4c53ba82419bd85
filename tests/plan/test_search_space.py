"""The layout search's space: virtual depths that megatron can split (evenly, or with the embedding and the loss
counted as layers) and TP sizes past the KV-group count (megatron's rule: groups a multiple or a divisor of TP)."""

from __future__ import annotations

from megagate.distributed.layout import stage_layers
from megagate.model.model_config import ParallelConfig
from megagate.plan import memory as mem
from megagate.plan.search import _pipeline_splits


def test_vp_depths_that_divide_the_split():
    # NVIDIA's layouts: Qwen3-235B-A22B PP 8 x VP 4 (94 + 2 = 96), Llama-3-70B PP 8 x VP 5 (80), 405B PP 8 x VP 8
    assert (4, True) in _pipeline_splits(94, 8) and (None, True) in _pipeline_splits(94, 8)
    assert (5, False) in _pipeline_splits(80, 8) and (3, False) not in _pipeline_splits(80, 8)
    assert (8, True) in _pipeline_splits(126, 8)
    assert _pipeline_splits(94, 1) == [(None, False)] and _pipeline_splits(8, 16) == []
    for layers, pp in ((94, 8), (80, 8), (126, 8), (48, 4)):
        for vpp, split in _pipeline_splits(layers, pp):
            parallel = ParallelConfig(
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp,
                account_for_embedding_in_pipeline_split=split,
                account_for_loss_in_pipeline_split=split,
            )
            grid = stage_layers(parallel, layers)  # the trainer accepts every one
            assert sum(map(sum, grid)) == layers


def test_fewer_kv_groups_than_tp_hold_one_whole_group_per_rank():
    from megagate.model import gate
    from megagate.model.presets import model_preset

    model = model_preset("tiny", gate.preset("baseline"), num_attention_heads=8, num_query_groups=2, head_dim=16)
    shape = mem.ActivationShape(64, 1, 4, True, 2)
    # TP 4 over 2 groups: each rank keeps 2 query heads and one whole KV group (not 2 // 4 = 0) after RoPE
    rotated = mem.selective_kept(model, shape) - mem.qkv_output_bytes(model, shape) - 4
    assert rotated == 2 * 64 * (2 + 1) * 16


def test_context_parallel_and_dispatchers_are_searched_where_they_apply():
    import copy

    from megagate import config_reader as C
    from megagate.plan.core import with_overrides
    from megagate.plan.search import _variants

    moe = {"preset": "tiny", "num_experts": 32, "moe_router_topk": 2, "moe_ffn_hidden_size": 64}
    short = C.from_dict({"model": copy.deepcopy(moe), "data": {"mock": True}}, environment=False)
    assert _variants(short, 8, 8) == [({"context_parallel_size": 1}, "")]  # EP inside the node, 128 tokens
    assert [s for _, s in _variants(short, 16, 8)] == ["", " flex"]  # EP leaves the node: DeepEP too
    long = with_overrides(short, seq_length=32768, max_sequence_length=32768, backend="te")
    assert [s for _, s in _variants(long, 1, 8)] == ["", " CP2", " CP4"]
    flex = with_overrides(short, moe_token_dispatcher_type="flex", context_parallel_size=2)
    assert flex.perf.moe_token_dispatcher_type == "flex" and flex.parallel.context_parallel_size == 2
