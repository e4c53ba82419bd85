"""The model description: `ModelConfig` (a gated GPT, dense or MoE), `ParallelConfig`, and the presets.

The paper's Table 7 models plus tiny CPU models. Dense gated models shrink their FFN so that the parameter count
matches the baseline (the paper's rule), rounded to `ffn_multiple` so the width stays TP- and kernel-friendly.
Pure data, no megatron (`megagate.model.build` turns these into megatron objects).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megagate.errors import ConfigError
from megagate.model.counts import gate_parameter_count
from megagate.model.gate import GateConfig


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a gated GPT (dense, or MoE when num_experts > 0)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_sequence_length: int = 4096
    tie_embeddings: bool = True
    qk_layernorm: bool = True
    normalization: str = "RMSNorm"
    rotary_base: int = 1_000_000
    norm_epsilon: float = 1e-6
    init_method_std: float = 0.02
    # MoE (fine-grained experts, softmax router, top-k)
    num_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_aux_loss_coeff: float = 1e-3
    moe_z_loss_coeff: float = 1e-3
    moe_load_balancing: str = "global_aux_loss"  # the paper: global-batch load balancing
    # Dense gated models: shrink the FFN to the baseline's parameter count
    match_baseline_params: bool = True
    ffn_multiple: int = 64
    gate: GateConfig = field(default_factory=GateConfig)

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "ffn_hidden_size",
            "vocab_size",
            "max_sequence_length",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model.{name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"model.num_query_groups ({self.num_query_groups})"
            )
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ConfigError(f"model.normalization={self.normalization!r} is not one of RMSNorm, LayerNorm")
        if self.num_experts:
            if not 0 < self.moe_router_topk <= self.num_experts:
                raise ConfigError(
                    f"model.moe_router_topk ({self.moe_router_topk}) must be in 1..num_experts ({self.num_experts})"
                )
            if self.moe_ffn_hidden_size <= 0:
                raise ConfigError(f"model.moe_ffn_hidden_size={self.moe_ffn_hidden_size!r} must be positive for MoE")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def effective_ffn_hidden_size(self) -> int:
        """The dense FFN width actually built: shrunk for gated dense models when match_baseline_params is set."""
        if self.is_moe or not self.match_baseline_params:
            return self.ffn_hidden_size
        added = (
            gate_parameter_count(
                self.gate, self.hidden_size, self.num_attention_heads, self.num_query_groups, self.head_dim
            )
            + self._sandwich_params()
        )
        return matched_ffn_width(self.ffn_hidden_size, self.hidden_size, added, self.ffn_multiple)

    def _sandwich_params(self) -> int:
        return 2 * self.hidden_size if self.gate.sandwich_norm else 0

    def with_gate(self, gate: GateConfig) -> ModelConfig:
        return dataclasses.replace(self, gate=gate)


def matched_ffn_width(ffn: int, hidden: int, added_per_layer: int, multiple: int) -> int:
    """SwiGLU FFN width whose 3·h·f parameters absorb `added_per_layer`, rounded to a multiple of `multiple`."""
    if added_per_layer == 0:
        return ffn
    target = ffn - added_per_layer / (3 * hidden)
    width = int(round(target / multiple)) * multiple
    if width <= 0:
        raise ConfigError(f"the gate adds {added_per_layer} parameters per layer, more than the FFN ({ffn}) can absorb")
    return width


# --- presets -------------------------------------------------------------------------------------------------------
QWEN_VOCAB = 151_936

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
}


def _check_fields(values: Mapping[str, Any]) -> None:
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"model.{unknown[0]} is not a model field; fields: {', '.join(sorted(fields))}")


def model_preset(name: str, gate: GateConfig | None = None, **overrides: Any) -> ModelConfig:
    """A preset ModelConfig with an optional gate and field overrides."""
    if name not in PRESETS:
        raise ConfigError(f"model preset {name!r} is unknown; known presets: {', '.join(PRESETS)}")
    _check_fields(overrides)
    values = {**PRESETS[name], **overrides}
    if gate is not None:
        values["gate"] = gate
    return ModelConfig(**values)


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel sizes, with Megatron-LM's names."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    expert_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False


def from_dict(values: Mapping[str, Any], gate: GateConfig) -> ModelConfig:
    """ModelConfig from a `preset` name plus field overrides (as in a YAML config's model section)."""
    values = dict(values)
    preset_name = values.pop("preset", None)
    if preset_name is None:
        _check_fields(values)
        return ModelConfig(gate=gate, **values)
    return model_preset(preset_name, gate=gate, **values)
