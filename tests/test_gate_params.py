"""The gate-parameter table: its entries, and that it alone decides what GatedSelfAttention builds and init sets."""

import pytest
import torch
from megatron.core.transformer.spec_utils import build_module

from megagate.errors import ConfigError
from megagate.model import gate as gates
from megagate.model import init, qkv_layout
from megagate.model.build import build_gpt_model, transformer_config
from megagate.model.gate_params import GateParam, gate_parameter_count, gate_parameters
from megagate.model.presets import model_preset
from megagate.model.spec import check_gate_compatible, gated_layer_spec

H, N, G, D = 64, 4, 2, 16  # the tiny model: 4 query heads in 2 KV groups of head_dim 16


def rows(gate):
    return [
        (p.name, p.shape, p.tp_axis, p.init, p.role, p.sequence_parallel_grad)
        for p in gate_parameters(gate, H, N, G, D)
    ]


FUSED, II = ("normal", "qkv_rows", False), ("zeros", "logits")  # fused rows; input-independent logits
CASES = [
    (gates.preset("baseline"), []),
    (gates.preset("sdpa-silu"), []),
    (gates.preset("sandwich-norm"), []),
    # fused into linear_qkv: np·w (G1/G4) or ng·w (G2/G3) rows of width h, sharded with the heads
    (gates.preset("g1-elementwise"), [("linear_qkv.weight", (64, 64), 0, *FUSED)]),
    (gates.preset("g1-headwise"), [("linear_qkv.weight", (4, 64), 0, *FUSED)]),
    (gates.preset("g2-headwise"), [("linear_qkv.weight", (2, 64), 0, *FUSED)]),
    (gates.preset("g3-elementwise"), [("linear_qkv.weight", (32, 64), 0, *FUSED)]),
    # one replicated projection for all heads; under SP its gradient is a partial sum
    (
        gates.preset("g1-elementwise-head-shared"),
        [("shared_gate_weight", (16, 64), None, "normal", "projection", True)],
    ),
    (gates.preset("g1-headwise-head-shared"), [("shared_gate_weight", (1, 64), None, "normal", "projection", True)]),
    # input-independent: zero logits shaped like the scores
    (gates.preset("g1-input-independent"), [("gate_param", (4, 16), 0, *II, False)]),
    (gates.preset("g1-headwise-input-independent"), [("gate_param", (4, 1), 0, *II, False)]),
    (gates.GateConfig(position="g3", input="input_independent"), [("gate_param", (2, 16), 0, *II, False)]),
    (gates.GateConfig(input="input_independent", sharing="head_shared"), [("gate_param", (1, 16), None, *II, False)]),
    # G5 at the hidden width, replicated; each rank gates its own sequence chunk under SP
    (gates.preset("g5-elementwise"), [("output_gate_weight", (64, 64), None, "normal", "projection", True)]),
    (gates.GateConfig(position="g5", input="input_independent"), [("gate_param", (1, 64), None, *II, True)]),
    (gates.preset("sdpa-rmsnorm"), [("sdpa_norm_weight", (4, 16), 0, "ones", "sdpa_norm", False)]),
    (
        gates.GateConfig(position="g2", granularity="headwise", sdpa_norm="rmsnorm"),
        [("linear_qkv.weight", (2, 64), 0, *FUSED), ("sdpa_norm_weight", (4, 16), 0, "ones", "sdpa_norm", False)],
    ),
]


@pytest.mark.parametrize("gate, expected", CASES, ids=[gate.describe() for gate, _ in CASES])
def test_table_entries(gate, expected):
    assert rows(gate) == expected
    assert gate_parameter_count(gate, H, N, G, D) == sum(torch.Size(shape).numel() for _, shape, *_ in expected)


def test_entry_derived_fields():
    fused = GateParam("linear_qkv.weight", (64, 64), 0, "normal", "qkv_rows")
    assert fused.in_linear_qkv and fused.checkpoint_axis is None  # linear_qkv's own sharded_state_dict splits it
    head = GateParam("gate_param", (4, 16), 0, "zeros", "logits")
    assert not head.in_linear_qkv and head.checkpoint_axis == 0 and head.local_shape(2) == (2, 16)
    shared = GateParam("shared_gate_weight", (16, 64), None, "normal", "projection", True)
    assert shared.checkpoint_axis is None and shared.local_shape(2) == (16, 64) and shared.numel == 1024
    with pytest.raises(ValueError, match="init='uniform' is not one of zeros, ones, normal"):
        GateParam("x", (2,), None, "uniform", "logits")
    with pytest.raises(ValueError, match="tp_axis=2 is not an axis of"):
        GateParam("x", (2, 3), 2, "zeros", "logits")


@pytest.mark.parametrize("variant", list(gates.PRESETS))
def test_module_builds_exactly_the_table(megatron_world, variant):
    gate = gates.preset(variant)
    model = model_preset("tiny", gate=gate)
    config = transformer_config(model)
    attn = build_module(gated_layer_spec(config, gate).submodules.self_attention, config=config, layer_number=1)
    table = gate_parameters(gate, H, N, G, D)
    assert attn.gate_params == tuple(table)
    own = dict(attn.named_parameters(recurse=False))
    assert sorted(own) == sorted(e.name for e in table if not e.in_linear_qkv)
    for entry in table:
        if entry.in_linear_qkv:
            assert attn.linear_qkv.weight.shape == (D * (N + 2 * G) + entry.shape[0], H)
            continue
        param = own[entry.name]
        assert tuple(param.shape) == entry.shape
        assert getattr(param, "tensor_model_parallel", False) == (entry.tp_axis is not None)
        if entry.tp_axis is not None:
            assert param.partition_dim == entry.tp_axis
        expected = {"zeros": torch.zeros(entry.shape), "ones": torch.ones(entry.shape)}.get(entry.init)
        if expected is not None:
            assert torch.equal(param, expected)
    baseline = build_module(
        gated_layer_spec(config, gates.preset("baseline")).submodules.self_attention, config=config, layer_number=1
    )
    added = sum(p.numel() for p in attn.parameters()) - sum(p.numel() for p in baseline.parameters())
    assert added == gate_parameter_count(gate, H, N, G, D)


def test_one_tensor_parallel_check_everywhere(megatron_world):
    """megatron's rule, in one place: whole query heads per rank; KV groups a multiple or a divisor of TP."""
    heads = "num_attention_heads (12) must be divisible by tensor_model_parallel_size (8)"
    groups = "num_query_groups (3) must be a multiple or a divisor of tensor_model_parallel_size (2)"
    n, g = 12, 3
    config = transformer_config(model_preset("tiny", num_attention_heads=n, num_query_groups=g))
    layout = qkv_layout.qkv_layout(gates.GateConfig(), n, g, D)
    for tp, message in ((8, heads), (2, groups)):
        for check in (
            lambda tp=tp: qkv_layout.check_tensor_parallel(n, g, tp),
            lambda tp=tp: layout.local(tp),
            lambda tp=tp: check_gate_compatible(config, gates.GateConfig(), tp),
        ):
            with pytest.raises(ConfigError) as err:
                check()
            assert str(err.value) == message
    with pytest.raises(ConfigError) as err:
        qkv_layout.check_tensor_parallel(16, 8, 3, model="model.", parallel="parallel.")
    assert (
        str(err.value) == "model.num_attention_heads (16) must be divisible by parallel.tensor_model_parallel_size (3)"
    )
    qkv_layout.check_tensor_parallel(N, G, 2)
    # fewer groups than TP ranks (TP a multiple of them): megatron replicates each group over TP / groups ranks
    qkv_layout.check_tensor_parallel(N, G, 4)
    assert layout.local(6) == qkv_layout.QkvLayout(4, 1, D, q_gate_width=D) and layout.replicas(6) == 2


def test_init_takes_gate_values_from_the_table(megatron_world):
    model = model_preset("tiny", gate=gates.preset("g1-input-independent"))
    gpt = build_gpt_model(model, transformer_config(model))
    attn = gpt.decoder.layers[1].self_attention
    with torch.no_grad():
        attn.gate_param.fill_(3.0)
    init.initialize([gpt], seed=1, std=0.02, num_layers=2)
    assert torch.equal(attn.gate_param, torch.zeros(4, 16))
    # the table, not the parameter's name, decides: an entry that says "ones" gives ones
    (entry,) = attn.gate_params
    attn.gate_params = (GateParam(entry.name, entry.shape, entry.tp_axis, "ones", entry.role),)
    init.initialize([gpt], seed=1, std=0.02, num_layers=2)
    assert torch.equal(attn.gate_param, torch.ones(4, 16))
    assert torch.equal(gpt.decoder.layers[0].self_attention.gate_param, torch.zeros(4, 16))
    # a table whose shape disagrees with the built parameter is refused
    attn.gate_params = (GateParam(entry.name, (2, 16), 0, "zeros", entry.role),)
    message = r"'decoder.layers.1.self_attention.gate_param' is built \(4, 16\) but its table entry says \(2, 16\)"
    with pytest.raises(ValueError, match=message):
        init.initialize([gpt], seed=1, std=0.02, num_layers=2)


def test_init_values_follow_the_rules(megatron_world):
    model = model_preset("tiny", gate=gates.preset("g5-elementwise"))
    gpt = build_gpt_model(model, transformer_config(model))
    init.initialize([gpt], seed=7, std=0.02, num_layers=2)
    params = dict(gpt.named_parameters())
    assert torch.equal(params["decoder.layers.0.self_attention.q_layernorm.weight"], torch.ones(16))
    assert torch.equal(params["decoder.final_layernorm.weight"], torch.ones(64))
    # σ for the gate projection and input projections, σ/√(2L) = 0.01 for the sublayer output projections
    assert abs(params["decoder.layers.0.self_attention.output_gate_weight"].std().item() - 0.02) < 0.002
    assert abs(params["decoder.layers.0.mlp.linear_fc1.weight"].std().item() - 0.02) < 0.002
    assert abs(params["decoder.layers.1.self_attention.linear_proj.weight"].std().item() - 0.01) < 0.001
    # the same name and seed give the same tensor; another layer another one
    name = "decoder.layers.{}.self_attention.output_gate_weight"
    first, second = params[name.format(0)], params[name.format(1)]
    assert not torch.equal(first, second)
    assert torch.equal(first, init.initial_value(name.format(0), (64, 64), 7, 0.02, 2, attn_entry(gpt, 0)))
    assert (
        init.rule_for("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight").init == "ones"
    )  # TE's fused norm
    assert init.rule_for("decoder.layers.0.self_attention.linear_qkv.layer_norm_bias").init == "zeros"
    assert init.rule_for("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight").init == "normal_scaled"


def attn_entry(gpt, layer):
    (entry,) = gpt.decoder.layers[layer].self_attention.gate_params
    return entry


def test_a_parameter_no_rule_covers_is_an_error(megatron_world):
    model = model_preset("tiny", gate=gates.preset("g1-elementwise"))
    gpt = build_gpt_model(model, transformer_config(model))
    gpt.decoder.layers[0].self_attention.register_parameter("gate_scale", torch.nn.Parameter(torch.zeros(4, 16)))
    message = "no initialisation rule covers parameter 'decoder.layers.0.self_attention.gate_scale'"
    with pytest.raises(ValueError, match=message):
        init.initialize([gpt], seed=1, std=0.02, num_layers=2)
