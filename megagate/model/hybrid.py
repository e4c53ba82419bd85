"""Hybrid models: which layers mix with gated attention and which with Gated DeltaNet (pure, no megatron).

`ModelConfig.layer_pattern` is the canonical form: one symbol per layer, megatron's hybrid symbols, `*` a gated
attention layer (any of megagate's gate variants) and `G` a Gated DeltaNet layer (megatron-core's `GatedDeltaNet`,
linear attention with its own output gate). Every layer keeps its MLP (dense, MoE, MoE with a shared expert), as in
Qwen3-Next and Qwen3.5. `None` (the default) is all attention: today's models. Hugging Face's
`full_attention_interval` (Qwen3-Next: 4, i.e. `GGG*` repeated) converts with `interval_pattern`, its
`layer_types` with `pattern_from_layer_types` / `layer_types`.
"""

from __future__ import annotations

from typing import Protocol

from megagate.errors import ConfigError


class HybridFields(Protocol):
    """The ModelConfig fields these functions read (model_config imports this module for its checks, so the
    class itself cannot be imported here, not even for the hints)."""

    @property
    def layer_pattern(self) -> str | None: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def linear_num_key_heads(self) -> int: ...
    @property
    def linear_num_value_heads(self) -> int: ...
    @property
    def linear_key_head_dim(self) -> int: ...
    @property
    def linear_value_head_dim(self) -> int: ...
    @property
    def linear_conv_kernel_dim(self) -> int: ...
    @property
    def moe_shared_expert_intermediate_size(self) -> int: ...
    @property
    def moe_shared_expert_gate(self) -> bool: ...


ATTENTION, GDN = "*", "G"
SYMBOLS = {ATTENTION: "gated attention", GDN: "Gated DeltaNet"}
HF_LAYER_TYPES = {ATTENTION: "full_attention", GDN: "linear_attention"}
GDN_FIELDS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def interval_pattern(num_layers: int, interval: int) -> str:
    """Hugging Face's `full_attention_interval`: every `interval`-th layer (1-based) attention, the rest GDN."""
    if interval < 1:
        raise ConfigError(f"full_attention_interval={interval!r} must be a positive integer")
    return "".join(ATTENTION if (i + 1) % interval == 0 else GDN for i in range(num_layers))


def pattern_from_layer_types(types: list[str]) -> str:
    """config.json `layer_types` -> a layer pattern; unknown kinds refused in one line."""
    inverse = {v: k for k, v in HF_LAYER_TYPES.items()}
    unknown = sorted(set(types) - set(inverse))
    if unknown:
        raise ConfigError(f"config.json layer_types has {unknown}: megagate holds {sorted(inverse)}")
    return "".join(inverse[t] for t in types)


def layer_types(model: HybridFields) -> list[str]:
    """The model's layers as config.json `layer_types`."""
    return [HF_LAYER_TYPES[s] for s in pattern(model)]


def pattern(model: HybridFields) -> str:
    """The layer pattern in force (all attention when `layer_pattern` is None)."""
    return model.layer_pattern or ATTENTION * model.num_layers


def is_hybrid(model: HybridFields) -> bool:
    return GDN in pattern(model)


def attention_layers(model: HybridFields) -> int:
    return pattern(model).count(ATTENTION)


def check_pattern(model: HybridFields) -> None:
    """The layer pattern and the GDN sizes as one-line ConfigErrors."""
    p = model.layer_pattern
    if p is None:
        return
    if not isinstance(p, str):
        raise ConfigError(f"model.layer_pattern={p!r} must be a string of {', '.join(SYMBOLS)} (or null)")
    bad = sorted(set(p) - set(SYMBOLS))
    if bad:
        allowed = ", ".join(f"{s!r} {what}" for s, what in SYMBOLS.items())
        raise ConfigError(f"model.layer_pattern={p!r} has unknown symbols {bad}: one per layer, {allowed}")
    if len(p) != model.num_layers:
        raise ConfigError(f"model.layer_pattern={p!r} has {len(p)} symbols but model.num_layers is {model.num_layers}")
    if GDN not in p:
        return
    for name in GDN_FIELDS:
        value = getattr(model, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"model.{name}={value!r} must be a positive integer (Gated DeltaNet layers)")
    if model.linear_num_value_heads % model.linear_num_key_heads:
        raise ConfigError(
            f"model.linear_num_value_heads ({model.linear_num_value_heads}) must be a multiple of "
            f"model.linear_num_key_heads ({model.linear_num_key_heads})"
        )


def check_gdn_parallel(model: HybridFields, tp: int, cp: int) -> None:
    """What megatron's GatedDeltaNet can split: whole key heads (hence value heads) per TP rank; no CP here."""
    if not is_hybrid(model):
        return
    if model.linear_num_key_heads % tp:
        raise ConfigError(
            f"model.linear_num_key_heads ({model.linear_num_key_heads}) must be divisible by "
            f"parallel.tensor_model_parallel_size ({tp}) in a model with Gated DeltaNet layers"
        )
    if cp > 1:
        raise ConfigError(
            f"parallel.context_parallel_size={cp}: megagate runs Gated DeltaNet layers without context parallelism "
            "(megatron's GDN CP all-to-all is untested here); use 1"
        )


def gdn_parameter_count(model: HybridFields) -> int:
    """Parameters of one Gated DeltaNet mixer: in_proj (q, k, v, z, beta, alpha), the depthwise conv over q/k/v,
    A_log and dt_bias per value head, the per-head output norm, out_proj."""
    h = model.hidden_size
    qk = model.linear_num_key_heads * model.linear_key_head_dim
    v = model.linear_num_value_heads * model.linear_value_head_dim
    nv = model.linear_num_value_heads
    conv = (2 * qk + v) * model.linear_conv_kernel_dim
    return h * (2 * qk + 2 * v + 2 * nv) + conv + 2 * nv + model.linear_value_head_dim + v * h


def shared_expert_parameter_count(model: HybridFields) -> int:
    """Parameters of one MoE layer's shared expert (SwiGLU) and its sigmoid gate."""
    size = model.moe_shared_expert_intermediate_size
    return 3 * model.hidden_size * size + (model.hidden_size if model.moe_shared_expert_gate else 0)
