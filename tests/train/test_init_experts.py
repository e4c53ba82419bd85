"""Initialisation and checkpoints for every MoE expert implementation: SequentialMLP, TorchGroupedMLP, TEGroupedMLP.

Every expert must start from the values of its GLOBAL index whatever the EP size and the implementation, and a
checkpoint written with the grouped experts under EP=2 must load under EP=1, grouped or sequential; the grouped
experts compute the same token losses under EP 2 and 8 and TP 2 x EP 2. One spawn of 8 gloo processes checks it all
on a 1-layer, 8-expert model; TEGroupedMLP's names (TE is not installed here) are checked as the pure name mapping
they go through. A trainer run with perf.moe_grouped_gemm=true matches the default run's losses.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from helpers import distributed
from megagate.model import gate as gates
from megagate.model import init
from megagate.model.model_config import ParallelConfig
from megagate.model.presets import model_preset

WORLD = 8


def test_te_grouped_names_map_to_the_sequential_global_expert():
    # TEGroupedMLP (TE GroupedLinear): experts.linear_fc{1,2}.weight<local i>, bias<local i>; 4 local experts
    name = init.global_expert_name
    assert name("decoder.layers.3.mlp.experts.linear_fc1.weight2", 1, 4) == (
        "decoder.layers.3.mlp.experts.local_experts.6.linear_fc1.weight"
    )
    assert name("decoder.layers.3.mlp.experts.linear_fc2.weight0", 3, 4) == (
        "decoder.layers.3.mlp.experts.local_experts.12.linear_fc2.weight"
    )
    assert name("decoder.layers.0.mlp.experts.linear_fc1.bias11", 0, 16) == (
        "decoder.layers.0.mlp.experts.local_experts.11.linear_fc1.bias"
    )
    # SequentialMLP / TorchGroupedMLP: local index -> global index
    assert name("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight", 2, 4) == (
        "decoder.layers.1.mlp.experts.local_experts.11.linear_fc2.weight"
    )
    for unchanged in ("decoder.layers.1.mlp.router.weight", "decoder.layers.1.mlp.shared_experts.linear_fc1.weight"):
        assert name(unchanged, 5, 4) == unchanged
    with pytest.raises(ValueError, match="moe_single_grouped_weight"):
        name("decoder.layers.0.mlp.experts.linear_fc1.weight", 0, 4)
    # the same expert gets the same full tensor under either name, and fc2 its depth-scaled std
    te = name("decoder.layers.0.mlp.experts.linear_fc2.weight1", 1, 2)
    seq = name("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", 1, 2)
    assert te == seq and init.rule_for(te).init == "normal_scaled"
    fc2 = init.initial_value(te, (256, 512), seed=3, std=0.02, num_layers=8)
    assert abs(fc2.std().item() - 0.02 / 4) < 2e-4  # σ/√(2L), L = 8
    other = name("decoder.layers.0.mlp.experts.linear_fc2.weight1", 0, 2)  # local 1 on EP rank 0: expert 1
    assert other != te and not torch.equal(fc2, init.initial_value(other, (256, 512), 3, 0.02, 8))


def _model_config():
    return model_preset("tiny-moe", gate=gates.preset("g1-elementwise"), num_layers=1, num_experts=WORLD)


def _full_model(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of the full model (TP = PP = 1): the expert weights gathered over EP, by global index."""
    from megatron.core import parallel_state

    group, ep = parallel_state.get_expert_model_parallel_group(), parallel_state.get_expert_model_parallel_world_size()
    local = WORLD // ep
    full = {}
    for name, p in model.named_parameters():
        match = re.match(r"^(.*local_experts\.)(\d+)(\..*)$", name)
        if not match:
            full[name] = p.detach().clone()
            continue
        parts = [torch.empty_like(p) for _ in range(ep)]
        torch.distributed.all_gather(parts, p.detach().contiguous(), group=group)
        for r, part in enumerate(parts):
            full[f"{match.group(1)}{r * local + int(match.group(2))}{match.group(3)}"] = part
    return full


def _build(ep: int, grouped: bool, seed: int, tp: int = 1) -> torch.nn.Module:
    from megatron.core import parallel_state

    from megagate.distributed.parallel import initialize_model_parallel
    from megagate.model.build import build_gpt_model, transformer_config
    from megagate.model.experts import TorchGroupedMLP

    parallel_state.destroy_model_parallel()
    mc = _model_config()
    parallel = ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    initialize_model_parallel(parallel, seed=5)
    model = build_gpt_model(mc, transformer_config(mc, parallel, moe_grouped_gemm=grouped))
    experts = model.decoder.layers[0].mlp.experts
    assert isinstance(experts, TorchGroupedMLP) == grouped and experts.num_local_experts == WORLD // ep
    init.initialize([model], seed, mc.init_method_std, mc.num_layers)
    return model


def _losses(model: torch.nn.Module) -> torch.Tensor:
    """[b, s] token losses on the same tokens on every rank (so EP and TP groups all see one batch)."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 512, (2, 9), generator=gen)
    positions = torch.arange(8).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        return model(ids[:, :-1].contiguous(), positions, None, labels=ids[:, 1:].contiguous())


def _layouts_worker(rank: int, world: int, ckpt: str) -> dict | None:
    from megatron.core import dist_checkpointing

    fulls, losses = {}, {}
    for ep, grouped in ((1, False), (2, True), (8, True), (8, False)):
        model = _build(ep, grouped, seed=1)
        fulls[(ep, grouped)] = _full_model(model)
        losses[(ep, grouped, 1)] = _losses(model)
        if (ep, grouped) == (2, True):
            with torch.no_grad():  # trained-looking weights: a load must bring these, not the seed's values
                for _, p in sorted(model.named_parameters()):
                    p.mul_(1.5).add_(0.01)
            saved = _full_model(model)
            if rank == 0:
                os.makedirs(ckpt)
            torch.distributed.barrier()
            dist_checkpointing.save(model.sharded_state_dict(), ckpt)
    # grouped experts with the FFN sharded over (expert) TP = 2 and 4 experts per EP rank: the same function.
    # In eval mode: megatron refuses MoE + TP without sequence parallelism in training, and the local backend's
    # norms refuse sequence parallelism
    losses[(2, True, 2)] = _losses(_build(2, True, seed=1, tp=2).eval())
    loaded = {}
    for grouped in (False, True):  # EP=1 (DP=8), from another seed
        model = _build(1, grouped, seed=2)
        before = _full_model(model)
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt))
        loaded[grouped] = (before, _full_model(model))
    return {"fulls": fulls, "losses": losses, "saved": saved, "loaded": loaded} if rank == 0 else None


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_init_and_checkpoints_across_ep_sizes_and_implementations(tmp_path):
    result = distributed.run(_layouts_worker, WORLD, tmp_path, str(tmp_path / "ckpt"))[0]
    fulls = result["fulls"]
    reference = fulls[(1, False)]  # SequentialMLP, EP=1
    assert sum(".local_experts." in n for n in reference) == 2 * WORLD
    for layout, full in fulls.items():
        assert full.keys() == reference.keys(), layout
        for name, value in reference.items():
            assert torch.equal(full[name], value), (layout, name)
    losses = result["losses"]
    for layout, loss in losses.items():  # forward under EP 2 / 8 and TP 2 x EP 2, grouped and sequential
        torch.testing.assert_close(loss, losses[(1, False, 1)], rtol=0, atol=1e-5, msg=str(layout))
    # the experts differ from each other (each got its own global index's values)
    fc1 = [reference[f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in range(WORLD)]
    assert all(not torch.equal(fc1[0], other) for other in fc1[1:])
    saved = result["saved"]
    for grouped, (before, after) in result["loaded"].items():
        assert not torch.equal(
            before["decoder.layers.0.mlp.experts.local_experts.5.linear_fc2.weight"],
            saved["decoder.layers.0.mlp.experts.local_experts.5.linear_fc2.weight"],
        )
        assert after.keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(after[name], value), (grouped, name)


@pytest.mark.slow
def test_trainer_with_grouped_experts_matches_sequential(tmp_path, session_demo_dir):
    """`megagate train` on the tiny MoE preset with perf.moe_grouped_gemm=true (torch grouped experts on the local
    backend) gives the losses of the default SequentialMLP run, step by step."""
    from helpers import tiny_runs as T

    moe = ["model.preset=tiny-moe", "model.vocab_size=2048", "train.train_steps=6"]
    T.run_train(tmp_path / "sequential", session_demo_dir, *moe)
    grouped = T.run_train(tmp_path / "grouped", session_demo_dir, *moe, "perf.moe_grouped_gemm=true")
    # the run's config has the setting (the spec's choice of TorchGroupedMLP for it: tests/model/test_grouped_experts)
    assert re.search(r"moe_grouped_gemm:\s*true", (tmp_path / "grouped" / "config.yaml").read_text())
    assert "per-expert GEMMs" not in grouped.stdout + grouped.stderr  # widths 64: the grouped kernel, no fallback
    seq, grp = T.losses(tmp_path / "sequential"), T.losses(tmp_path / "grouped")
    assert sorted(seq) == sorted(grp) == list(range(1, 7))
    for step in seq:
        assert abs(seq[step] - grp[step]) < 2e-4, (step, seq[step], grp[step])
