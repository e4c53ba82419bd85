"""Our G1-elementwise sigmoid gate equals megatron-core's own `attention_output_gate=True`, and layouts convert."""

import dataclasses

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import build_module

from helpers import reference
from megagate.model import gate as gates
from megagate.model import qkv_layout as layout
from megagate.model.build import transformer_config
from megagate.model.presets import model_preset
from megagate.model.spec import gated_layer_spec

SEQ, BATCH = 9, 2


def test_g1_elementwise_equals_megatron_output_gate(megatron_world):
    model = model_preset("tiny", gate=gates.preset("g1-elementwise"))
    config = transformer_config(model)
    ours = build_module(gated_layer_spec(config, model.gate).submodules.self_attention, config=config, layer_number=1)
    mcore_config = dataclasses.replace(config, attention_output_gate=True)
    mcore_spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    theirs = build_module(mcore_spec.submodules.self_attention, config=mcore_config, layer_number=1)

    n, g, d = model.num_attention_heads, model.num_query_groups, model.head_dim
    # megatron's own (randomly initialised) weights, converted into our layout by the tested conversion
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.3 * torch.randn_like(p))
    converted = dict(theirs.state_dict())
    converted["linear_qkv.weight"] = layout.from_megatron_output_gate(converted["linear_qkv.weight"], n, g, d)
    ours.load_state_dict(converted)
    # for G1 elementwise the two layouts coincide: the conversion is the identity permutation
    torch.testing.assert_close(ours.linear_qkv.weight, theirs.linear_qkv.weight, rtol=0, atol=0)

    x = torch.randn(SEQ, BATCH, model.hidden_size)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ours, _ = ours(x_ours, None)
    out_theirs, _ = theirs(x_theirs, None)
    torch.testing.assert_close(out_ours, out_theirs, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out_ours)
    out_ours.backward(grad)
    out_theirs.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, atol=1e-5, rtol=1e-5)
    theirs_grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        expected = theirs_grads[name].grad
        if name == "linear_qkv.weight":
            expected = layout.from_megatron_output_gate(expected, n, g, d)
        torch.testing.assert_close(p.grad, expected, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_conversions_round_trip_and_name_every_row():
    n, g, d, h = 8, 2, 4, 6
    w = torch.randn(n * d * 2 + 2 * g * d, h)
    to_mc = layout.to_megatron_output_gate(w, n, g, d)
    torch.testing.assert_close(layout.from_megatron_output_gate(to_mc, n, g, d), w, rtol=0, atol=0)
    keys = layout.QkvLayout(n, g, d, q_gate_width=d).row_keys()
    assert len(set(keys)) == len(keys) == w.shape[0]


def test_qwen3_next_conversion_matches_reference_fusion():
    """HF Qwen3-Next q_proj (per head [q | gate]), k_proj, v_proj → our fused linear_qkv."""
    n, g, d, h = 4, 2, 16, 64
    gate = gates.preset("g1-elementwise")
    w = {k: v.detach() for k, v in reference.make_weights(gate, h, n, g, d, seed=5).items()}
    q_proj = torch.cat([torch.cat([w["q"][i], w["g"][i]]) for i in range(n)])  # [2·n·d, h]
    k_proj, v_proj = w["k"].reshape(g * d, h), w["v"].reshape(g * d, h)
    fused = layout.from_qwen3_next(q_proj, k_proj, v_proj, n, g, d)
    torch.testing.assert_close(fused, reference.fuse_qkv(w, gate, n, g), rtol=0, atol=0)


def test_local_layout_shards_whole_groups():
    """Each TP rank's contiguous block of rows holds whole groups: q, gate, k, v of the same heads."""
    full = layout.qkv_layout(gates.preset("g2-headwise"), 8, 4, 4)
    local = full.local(2)
    keys = full.row_keys()
    rank1 = keys[local.rows : 2 * local.rows]
    assert {k[1] for k in rank1 if k[0] in ("k", "v", "kv_gate")} == {2, 3}
    assert {k[1] for k in rank1 if k[0] == "q"} == {4, 5, 6, 7}
    assert full.gate_rows == 4  # one headwise score per KV head
