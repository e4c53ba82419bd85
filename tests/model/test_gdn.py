"""The Gated DeltaNet layer on CPU (megatron-core's GatedDeltaNet through megagate.model.gdn) and the layer pattern.

The torch path: megatron's chunked delta rule equals transformers' token-by-token recurrence (an independent
formulation of the same rule) over several chunks and a ragged tail; `torch_l2norm` equals the fla-aligned l2norm of
transformers. The pattern and the GDN sizes are refused in one line where megatron would assert or build something
else; parameter counts of a hybrid (a Qwen3-Next-80B-A3B slice with all its widths) equal the meta-device build.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

from megagate.errors import ConfigError
from megagate.model import gate as gates
from megagate.model import hybrid
from megagate.model.build import meta_parameter_count
from megagate.model.counts import parameter_counts
from megagate.model.gdn import kernel_name, torch_l2norm
from megagate.model.presets import model_preset

modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


@pytest.mark.parametrize("seq", [40, 150])  # one partial chunk; two full chunks of 64 and a ragged tail
def test_chunked_delta_rule_equals_the_recurrence(seq):
    gen = torch.Generator().manual_seed(seq)
    b, h, dk, dv = 2, 3, 16, 24
    q, k = (torch_l2norm(torch.randn(b, seq, h, dk, generator=gen)) for _ in range(2))
    v = torch.randn(b, seq, h, dv, generator=gen)
    g = -torch.rand(b, seq, h, generator=gen) * 2.0  # log-decays in (-2, 0)
    beta = torch.rand(b, seq, h, generator=gen)
    chunked, _ = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta)
    recurrent, _ = modeling.torch_recurrent_gated_delta_rule(q, k, v, g, beta, None, False)
    assert chunked.shape == (b, seq, h, dv)
    assert (chunked - recurrent).abs().max().item() < 1e-5
    assert chunked.abs().max().item() > 0.1  # a real output, not a vanishing one


def test_torch_l2norm_is_transformers_l2norm():
    x = torch.randn(5, 7, 16, generator=torch.Generator().manual_seed(0)) * 3
    assert torch.equal(torch_l2norm(x), modeling.l2norm(x, dim=-1, eps=1e-6))
    assert kernel_name() in ("fla", "torch")


def test_interval_and_layer_types():
    assert hybrid.interval_pattern(8, 4) == "GGG*GGG*"
    assert hybrid.pattern_from_layer_types(["linear_attention", "full_attention"]) == "G*"
    m = model_preset("tiny-hybrid")
    assert hybrid.layer_types(m) == ["linear_attention"] * 3 + ["full_attention"] and hybrid.attention_layers(m) == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(layer_pattern="GGX*"), "model.layer_pattern='GGX*' has unknown symbols ['X']"),
        (dict(layer_pattern="GG*"), "has 3 symbols but model.num_layers is 4"),
        (dict(linear_num_value_heads=3), "model.linear_num_value_heads (3) must be a multiple of"),
        (dict(linear_key_head_dim=0), "model.linear_key_head_dim=0 must be a positive integer"),
        (dict(moe_shared_expert_gate=True, moe_shared_expert_intermediate_size=0), "needs model.moe_shared_expert_int"),
        (dict(num_experts=0, moe_router_topk=0, moe_shared_expert_gate=False), "a shared expert needs num_experts > 0"),
    ],
)
def test_bad_hybrid_fields_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        model_preset("tiny-hybrid", **overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_gdn_parallel_refusals():
    m = model_preset("tiny-hybrid")  # 2 key heads
    hybrid.check_gdn_parallel(m, 2, 1)
    with pytest.raises(ConfigError, match=r"linear_num_key_heads \(2\) must be divisible by .*size \(4\)"):
        hybrid.check_gdn_parallel(m, 4, 1)
    with pytest.raises(ConfigError, match="context_parallel_size=2"):
        hybrid.check_gdn_parallel(m, 1, 2)
    hybrid.check_gdn_parallel(model_preset("tiny"), 4, 2)  # no GDN layer: nothing to check here


def test_qwen3_next_80b_counts(megatron_world):
    """The full preset's analytic counts are the published 80B total / A3B (3.25 B active without the embeddings);
    a 4-layer slice with every width of the preset (512 experts) counts exactly what megatron builds."""
    full = model_preset("qwen3-next-80b-a3b", gate=gates.preset("g1-elementwise"))
    counts = parameter_counts(full)
    assert counts["total"] == 79_674_391_296 and counts["active"] == 3_874_929_408
    assert 3.2e9 < counts["active"] - counts["embedding"] < 3.3e9
    piece = model_preset("qwen3-next-80b-a3b", gate=gates.preset("g1-elementwise"), num_layers=4, layer_pattern="GGG*")
    assert meta_parameter_count(piece) == parameter_counts(piece)["total"]


def test_benchmark_quick_runs(megatron_world):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gdn_layer.py"
    spec = importlib.util.spec_from_file_location("bench_gdn_layer", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_gdn_layer", module)
    spec.loader.exec_module(module)
    medians = module.run(module.QUICK_SEQS, 1)
    assert set(medians) == {"attention", "gdn"} and all(t > 0 for by in medians.values() for t in by.values())
    assert "GDN / attention" in module.report(medians)
