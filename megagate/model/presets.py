"""The named models: the paper's Table 7 models plus tiny CPU models (`PRESETS`), and a `ModelConfig` from a preset
name with field overrides (`model_preset`, `from_dict`: a YAML config's `model:` section)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megagate.errors import ConfigError
from megagate.model.gate import GateConfig
from megagate.model.model_config import ModelConfig, check_fields
from megagate.sections import did_you_mean

# --- presets -------------------------------------------------------------------------------------------------------
QWEN_VOCAB = 151_936
QWEN35_VOCAB = 248_320

PRESETS: dict[str, dict[str, Any]] = {
    # The paper's Table 7.
    "1.7b-28l": dict(
        num_layers=28,
        hidden_size=2048,
        num_attention_heads=16,
        num_query_groups=8,
        head_dim=128,
        ffn_hidden_size=6144,
        vocab_size=QWEN_VOCAB,
        tie_embeddings=True,
    ),
    "1.7b-48l": dict(
        num_layers=48,
        hidden_size=1536,
        num_attention_heads=16,
        num_query_groups=8,
        head_dim=128,
        ffn_hidden_size=4608,
        vocab_size=QWEN_VOCAB,
        tie_embeddings=True,
    ),
    "15a2b-moe": dict(
        num_layers=24,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=4,
        head_dim=128,
        ffn_hidden_size=768,
        vocab_size=QWEN_VOCAB,
        tie_embeddings=False,
        num_experts=128,
        moe_router_topk=8,
        moe_ffn_hidden_size=768,
    ),
    # Qwen3-Next-80B-A3B's published shapes (its config.json; gate g1-elementwise, as the model has it): Gated
    # DeltaNet in three layers of four, 512 experts (top 10) with a gated shared expert. The MTP head is not built.
    # 79.67 B parameters, 3.87 B active per token (3.25 B without the two embeddings; published "80B, A3B").
    "qwen3-next-80b-a3b": dict(
        num_layers=48,
        hidden_size=2048,
        num_attention_heads=16,
        num_query_groups=2,
        head_dim=256,
        ffn_hidden_size=5120,
        vocab_size=QWEN_VOCAB,
        max_sequence_length=262_144,
        tie_embeddings=False,
        rotary_base=10_000_000,
        rotary_percent=0.25,
        norm_zero_centered=True,
        num_experts=512,
        moe_router_topk=10,
        moe_ffn_hidden_size=512,
        moe_shared_expert_intermediate_size=512,
        moe_shared_expert_gate=True,
        layer_pattern="GGG*" * 12,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    ),
    # Qwen3.5's published text-model shapes (the text_config of the released config.json files; gate g1-elementwise,
    # zero-centred norms, partial rotary 0.25 of 256 dims, RoPE theta 1e7, vocabulary 248,320 untied, Gated DeltaNet in
    # three layers of four). The vision encoder and the MTP head are not built (megagate imports the text model).
    # Qwen3.5-27B (dense): 64 layers, hidden 5120, 24 query heads in 4 KV groups, FFN 17,408, GDN 16 key / 48 value
    # heads of 128. 26.90 B parameters (published "27B", the whole vision-language model).
    "qwen3.5-27b": dict(
        num_layers=64,
        hidden_size=5120,
        num_attention_heads=24,
        num_query_groups=4,
        head_dim=256,
        ffn_hidden_size=17_408,
        match_baseline_params=False,  # the published FFN width, gate included
        vocab_size=QWEN35_VOCAB,
        max_sequence_length=262_144,
        tie_embeddings=False,
        rotary_base=10_000_000,
        rotary_percent=0.25,
        norm_zero_centered=True,
        layer_pattern="GGG*" * 16,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    ),
    # Qwen3.5-35B-A3B (MoE): 40 layers, hidden 2048, 16 query heads in 2 KV groups, GDN 16 key / 32 value heads of
    # 128, 256 experts of 512 (top 8, renormalised) + a gated shared expert of 512 in every layer. 34.66 B parameters,
    # 3.45 B active per token (published "35B in total and 3B activated", the whole vision-language model).
    "qwen3.5-35b-a3b": dict(
        num_layers=40,
        hidden_size=2048,
        num_attention_heads=16,
        num_query_groups=2,
        head_dim=256,
        ffn_hidden_size=512,
        vocab_size=QWEN35_VOCAB,
        max_sequence_length=262_144,
        tie_embeddings=False,
        rotary_base=10_000_000,
        rotary_percent=0.25,
        norm_zero_centered=True,
        num_experts=256,
        moe_router_topk=8,
        moe_ffn_hidden_size=512,
        moe_shared_expert_intermediate_size=512,
        moe_shared_expert_gate=True,
        layer_pattern="GGG*" * 10,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    ),
    # Tiny models for CPU tests and the demo.
    "tiny": dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=16,
        ffn_hidden_size=192,
        vocab_size=512,
        max_sequence_length=128,
        rotary_base=10_000,
        # param-matched gated variants: G1's 4,096 gate weights per layer are a third of one FFN step of 64
        # (3 x 64 x 64 = 12,288), so 64 left the FFN unshrunk (+3.6 %); steps of 2 keep the width even (TP 2, the
        # most the 2 KV groups allow) and the difference within 2 x 3 x 64 x 2 / 2 = 384 parameters (0.3 %)
        ffn_multiple=2,
    ),
    "tiny-moe": dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=16,
        ffn_hidden_size=64,
        vocab_size=512,
        max_sequence_length=128,
        rotary_base=10_000,
        tie_embeddings=False,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
    ),
    # A tiny Qwen3-Next-shaped hybrid (examples/hybrid_cpu.yaml): GGG* (3 GDN : 1 attention), MoE with a gated shared
    # expert, zero-centred norms, partial rotary
    "tiny-hybrid": dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=16,
        ffn_hidden_size=64,
        vocab_size=512,
        max_sequence_length=128,
        rotary_base=10_000,
        rotary_percent=0.5,
        norm_zero_centered=True,
        tie_embeddings=False,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        moe_shared_expert_intermediate_size=64,
        moe_shared_expert_gate=True,
        layer_pattern="GGG*",
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
}


def model_preset(name: str, gate: GateConfig | None = None, **overrides: Any) -> ModelConfig:
    """A preset ModelConfig with an optional gate and field overrides."""
    if name not in PRESETS:
        raise ConfigError(
            f"model preset {name!r} is unknown; known presets: {', '.join(PRESETS)}{did_you_mean(name, PRESETS)}"
        )
    check_fields(overrides)
    values = {**PRESETS[name], **overrides}
    if gate is not None:
        values["gate"] = gate
    return ModelConfig(**values)


def from_dict(values: Mapping[str, Any], gate: GateConfig) -> ModelConfig:
    """ModelConfig from a `preset` name plus field overrides (as in a YAML config's model section)."""
    values = dict(values)
    preset_name = values.pop("preset", None)
    if preset_name is None:
        check_fields(values)
        return ModelConfig(gate=gate, **values)
    return model_preset(preset_name, gate=gate, **values)
