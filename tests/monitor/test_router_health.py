"""MoE router health (megagate.monitor.router) on a real tiny megatron MoE model: the hooks' tokens per expert and
entropy against what the test captures from the router itself, evaluation forwards not counted, and the health
numbers of known counts."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import tiny_model
from megagate.monitor import router


def test_health_of_known_counts():
    sums = torch.zeros(3, 4 + 2, dtype=torch.float64)
    sums[0, :4] = torch.tensor([10.0, 0.0, 5.0, 5.0])  # mean 5, max 10, one dead expert
    sums[2, :4] = torch.tensor([4.0, 4.0, 4.0, 4.0])  # balanced
    sums[2, router.ENTROPY], sums[2, router.TOKENS] = 1.5, 2.0
    stats = router.health(sums, layers=[0, 2])  # layer 1 is dense
    assert stats["layers"]["0"] == {"tokens": 20, "max_over_mean": 2.0, "dead": 1, "entropy": None}
    assert stats["layers"]["2"] == {"tokens": 16, "max_over_mean": 1.0, "dead": 0, "entropy": 0.75}
    assert stats["max_over_mean"] == 2.0 and stats["dead"] == 1 and stats["spread"] == pytest.approx(0.5)
    assert router.scalars(stats)["router/layer_02/entropy"] == 0.75 and "router/layer_00/entropy" not in router.scalars(
        stats
    )


def test_hooks_count_training_tokens_and_the_entropy(megatron_world):
    from megagate.model import gate as gates
    from megagate.model import init
    from megagate.model.build import build_gpt_model, transformer_config
    from megagate.model.presets import model_preset

    mc = model_preset("tiny-moe", gate=gates.preset("g1-elementwise"))  # 2 layers, 4 experts, top 2
    model = build_gpt_model(mc, transformer_config(mc))
    init.initialize([model], 0, mc.init_method_std, mc.num_layers)
    model.train()
    found = router.routers([model])
    assert [layer for layer, _ in found] == [0, 1]
    captured: dict[int, list] = {0: [], 1: []}
    handles = [
        r.register_forward_hook(lambda m, a, out, i=i: captured[i].append((a[0].detach(), out[1].detach())))
        for i, r in found
    ]
    counts = router.RouterCounts([model], num_layers=2, num_experts=4)
    counts.entropy_next = True
    tokens = tiny_model.text_tokens(2, 16)
    position_ids = torch.arange(16).expand(2, -1)
    model(tokens, position_ids, None, labels=tokens).float().mean().backward()
    with torch.no_grad():  # an evaluation forward: not counted
        model(tokens, position_ids, None)
    sums = counts.take()
    for handle in handles:
        handle.remove()
    counts.close()
    for layer, module in found:
        (inputs, routing_map), _ = captured[layer]  # the training forward, then the evaluation one
        assert sums[layer, :4].tolist() == routing_map.sum(dim=0).double().tolist()
        assert float(sums[layer, :4].sum()) == 2 * 16 * 2  # every token to its top 2
        p = torch.softmax((inputs.reshape(-1, 64).double() @ module.weight.double().T), dim=-1)
        entropy = -(p * p.log()).sum(-1) / math.log(4)
        assert float(sums[layer, router.ENTROPY]) == pytest.approx(float(entropy.sum()), rel=1e-5)
        assert float(sums[layer, router.TOKENS]) == 32
    assert float(counts.take().abs().sum()) == 0.0  # the window restarted
