"""The model description: `ModelConfig` (a gated GPT, dense or MoE, with its own checks) and `ParallelConfig`.

Dense gated models shrink their FFN so that the parameter count matches the baseline (the paper's rule), rounded to
`ffn_multiple` so the width stays TP- and kernel-friendly. Pure data, no megatron (`megagate.model.build` turns
these into megatron objects); the named models are in `megagate.model.presets`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megagate.errors import ConfigError
from megagate.model import hybrid, position
from megagate.model.gate import GateConfig
from megagate.model.gate_params import gate_parameter_count
from megagate.sections import did_you_mean


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
    # Position embedding (megatron's options; none of them changes a weight, so a context extension may change
    # them on resume or at evaluation). "rope" or "yarn"; rotary_percent: the share of each head's dims rotated;
    # rotary_interpolation_factor: linear position interpolation (positions / factor); rope_scaling: Llama-3.x
    # frequency scaling by rope_scaling_factor from rope_scaling_original_max_position_embeddings (wavelengths
    # above original / low_freq_factor slowed by the factor, below original / high_freq_factor kept, smoothed
    # between); yarn_*: YaRN (Peng et al. 2023) NTK-by-parts interpolation by yarn_factor from
    # yarn_original_max_position_embeddings (None: max_sequence_length), ramp between yarn_beta_slow and
    # yarn_beta_fast rotations, attention factor 0.1*yarn_mscale*ln(s)+1 (over the same with yarn_mscale_all_dim)
    # applied to q and k. The reach of each: megagate.model.position.
    position_embedding: str = "rope"
    rotary_percent: float = 1.0
    rotary_interpolation_factor: float | None = None
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192
    yarn_factor: float = 1.0
    yarn_original_max_position_embeddings: int | None = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True
    norm_epsilon: float = 1e-6
    # Zero-centred norm weights (megatron's layernorm_zero_centered_gamma; Qwen3-Next's norms): every RMSNorm
    # (input, pre-MLP, final, q/k) computes x * rsqrt(mean(x^2) + eps) * (1 + w), with w initialised to zeros,
    # so such a model equals the plain one at initialisation.
    norm_zero_centered: bool = False
    init_method_std: float = 0.02
    # MoE (fine-grained experts, softmax router, top-k)
    num_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_aux_loss_coeff: float = 1e-3
    moe_z_loss_coeff: float = 1e-3
    moe_load_balancing: str = "global_aux_loss"  # the paper: global-batch load balancing
    # Router probabilities of the chosen experts: True = softmax over the top-k logits, i.e. renormalised to sum
    # to 1 (megatron's default; HF norm_topk_prob=True); False = softmax over all experts, then top-k (megatron's
    # moe_router_pre_softmax; HF norm_topk_prob=False).
    moe_router_norm_topk: bool = True
    # A shared expert in every MoE layer (megatron's moe_shared_expert_intermediate_size, 0: none), its output
    # scaled per token by sigmoid(x . w) when moe_shared_expert_gate (Qwen3-Next's shared_expert_gate)
    moe_shared_expert_intermediate_size: int = 0
    moe_shared_expert_gate: bool = False
    # Hybrids (megagate.model.hybrid): one symbol per layer, "*" gated attention, "G" Gated DeltaNet; None = all
    # attention. The linear_* sizes (megatron's and Hugging Face's names) shape the GDN layers only.
    layer_pattern: str | None = None
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # Dense gated models: shrink the FFN to the baseline's parameter count
    match_baseline_params: bool = True
    ffn_multiple: int = 64
    # Activation recomputation, megatron's names: granularity None / "selective" (core attention) / "full";
    # full needs method "uniform" (checkpoint groups of recompute_num_layers) or "block" (the first N of each stage)
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # Softmax sink baseline (megatron's softmax_type): "vanilla"; "off-by-one" (exp(0) added to every attention
    # row's denominator); "learnable" (exp(s_h), one learned logit per head and attention layer). The gate multiplies
    # the attention output after the softmax, so every gate variant composes with a sink.
    softmax_type: str = "vanilla"
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
        hybrid.check_pattern(self)
        if self.gate.enabled and self.gate.input == "query_dependent":
            self.gate.input_width(self.hidden_size)  # input_fraction · hidden_size must be a whole number
        if self.softmax_type not in SOFTMAX_TYPES:
            hint = did_you_mean(str(self.softmax_type), SOFTMAX_TYPES)
            raise ConfigError(
                f"model.softmax_type={self.softmax_type!r} is not one of {', '.join(SOFTMAX_TYPES)}{hint}"
            )
        check_shared_expert(self)
        check_recompute(self.recompute_granularity, self.recompute_method, self.recompute_num_layers)
        check_position_embedding(self)
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ConfigError(f"model.normalization={self.normalization!r} is not one of RMSNorm, LayerNorm")
        if not isinstance(self.norm_zero_centered, bool):
            raise ConfigError(f"model.norm_zero_centered={self.norm_zero_centered!r} must be true or false")
        if self.norm_zero_centered and self.normalization != "RMSNorm":
            raise ConfigError(f"model.norm_zero_centered=true needs normalization=RMSNorm (not {self.normalization})")
        if not isinstance(self.moe_router_norm_topk, bool):
            raise ConfigError(f"model.moe_router_norm_topk={self.moe_router_norm_topk!r} must be true or false")
        if not self.moe_router_norm_topk and not self.num_experts:
            raise ConfigError("model.moe_router_norm_topk=false is a MoE router setting: it needs num_experts > 0")
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
        gate = gate_parameter_count(
            self.gate, self.hidden_size, self.num_attention_heads, self.num_query_groups, self.head_dim
        )
        # a hybrid's gate sits in its attention layers only: the one FFN width absorbs the per-layer average
        added = gate * hybrid.attention_layers(self) // self.num_layers + self.sandwich_norm_params
        return matched_ffn_width(self.ffn_hidden_size, self.hidden_size, added, self.ffn_multiple)

    @property
    def sandwich_norm_params(self) -> int:
        """Parameters per layer of the sandwich norms (the gate's `sandwich_norm`): two RMSNorm weights."""
        return 2 * self.hidden_size if self.gate.sandwich_norm else 0

    def with_gate(self, gate: GateConfig) -> ModelConfig:
        return dataclasses.replace(self, gate=gate)

    @property
    def yarn_original_length(self) -> int:
        """The context YaRN extends from (yarn_original_max_position_embeddings, else max_sequence_length)."""
        return self.yarn_original_max_position_embeddings or self.max_sequence_length

    @property
    def context_length(self) -> int:
        """The longest sequence the position embedding is set up for: max_sequence_length, or the scalings' reach
        (every slow rotary dim kept to the angles seen within the context the scaling starts from; YaRN by s from
        L reaches s·L; see megagate.model.position)."""
        return position.context_length(self)


def check_shared_expert(m: ModelConfig) -> None:
    """The shared-expert fields as one-line ConfigErrors (they need MoE)."""
    size = m.moe_shared_expert_intermediate_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ConfigError(f"model.moe_shared_expert_intermediate_size={size!r} must be an integer >= 0")
    if not isinstance(m.moe_shared_expert_gate, bool):
        raise ConfigError(f"model.moe_shared_expert_gate={m.moe_shared_expert_gate!r} must be true or false")
    if size and not m.num_experts:
        raise ConfigError(f"model.moe_shared_expert_intermediate_size={size}: a shared expert needs num_experts > 0")
    if m.moe_shared_expert_gate and not size:
        raise ConfigError("model.moe_shared_expert_gate=true needs model.moe_shared_expert_intermediate_size > 0")


SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
RECOMPUTE_GRANULARITIES = ("selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")


def check_recompute(granularity: str | None, method: str | None, num_layers: int | None) -> None:
    """megatron's recompute rules, as one-line ConfigErrors: full needs a method and a layer count, selective
    takes neither."""
    if granularity is None:
        if method is not None or num_layers is not None:
            raise ConfigError("model.recompute_method/recompute_num_layers need model.recompute_granularity=full")
        return
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise ConfigError(
            f"model.recompute_granularity={granularity!r} is not one of {', '.join(RECOMPUTE_GRANULARITIES)} (or null)"
        )
    if granularity == "selective":
        if method is not None or num_layers is not None:
            raise ConfigError("model.recompute_granularity=selective takes no recompute_method/recompute_num_layers")
        return
    if method not in RECOMPUTE_METHODS:
        raise ConfigError(
            f"model.recompute_method={method!r} is not one of {', '.join(RECOMPUTE_METHODS)} (needed with full)"
        )
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise ConfigError(f"model.recompute_num_layers={num_layers!r} must be a positive integer with full recompute")


POSITION_EMBEDDINGS = ("rope", "yarn")
# The ModelConfig fields of the position embedding (evaluation may override them: none changes a weight).
POSITION_FIELDS = (
    "rotary_base",
    "position_embedding",
    "rotary_percent",
    "rotary_interpolation_factor",
    "rope_scaling",
    "rope_scaling_factor",
    "rope_scaling_low_freq_factor",
    "rope_scaling_high_freq_factor",
    "rope_scaling_original_max_position_embeddings",
    "yarn_factor",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_mscale",
    "yarn_mscale_all_dim",
    "yarn_correction_range_round_to_int",
)
_YARN_DEFAULTS = dict(
    yarn_factor=1.0,
    yarn_original_max_position_embeddings=None,
    yarn_beta_fast=32.0,
    yarn_beta_slow=1.0,
    yarn_mscale=1.0,
    yarn_mscale_all_dim=0.0,
    yarn_correction_range_round_to_int=True,
)


def check_position_embedding(m: ModelConfig) -> None:
    """The position-embedding fields as one-line ConfigErrors (what megatron's RoPE / YaRN modules can build)."""
    if m.position_embedding not in POSITION_EMBEDDINGS:
        raise ConfigError(
            f"model.position_embedding={m.position_embedding!r} is not one of {', '.join(POSITION_EMBEDDINGS)}"
        )
    if isinstance(m.rotary_base, bool) or not isinstance(m.rotary_base, int) or m.rotary_base < 2:
        raise ConfigError(f"model.rotary_base={m.rotary_base!r} must be an integer >= 2")
    if not 0 < m.rotary_percent <= 1:
        raise ConfigError(f"model.rotary_percent={m.rotary_percent!r} must be in (0, 1]")
    rotated = int(m.head_dim * m.rotary_percent)
    if rotated < 2 or rotated % 2:
        raise ConfigError(
            f"model.rotary_percent={m.rotary_percent!r} rotates {rotated} of head_dim {m.head_dim} dims: "
            "it must be an even number >= 2"
        )
    if m.rotary_interpolation_factor is not None and not m.rotary_interpolation_factor >= 1:
        raise ConfigError(f"model.rotary_interpolation_factor={m.rotary_interpolation_factor!r} must be >= 1 (or null)")
    if not m.rope_scaling_factor >= 1:
        raise ConfigError(f"model.rope_scaling_factor={m.rope_scaling_factor!r} must be >= 1")
    check_llama3_scaling(m)
    if m.position_embedding == "rope":
        changed = [k for k, v in _YARN_DEFAULTS.items() if getattr(m, k) != v]
        if changed:
            raise ConfigError(f"model.{changed[0]} is a YaRN setting: it needs model.position_embedding=yarn")
        return
    # YaRN: megatron's YarnRotaryEmbedding ignores the other two scalings (a partial rotary is built over the
    # rotated dims: megagate.model.rotary)
    if m.rotary_interpolation_factor is not None or m.rope_scaling:
        raise ConfigError(
            "model.position_embedding=yarn takes no rotary_interpolation_factor / rope_scaling (YaRN scales itself)"
        )
    if not m.yarn_factor >= 1:
        raise ConfigError(f"model.yarn_factor={m.yarn_factor!r} must be >= 1")
    original = m.yarn_original_max_position_embeddings
    if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original < 1):
        raise ConfigError(f"model.yarn_original_max_position_embeddings={original!r} must be a positive integer")
    if not 0 < m.yarn_beta_slow < m.yarn_beta_fast:
        raise ConfigError(
            f"model.yarn_beta_slow={m.yarn_beta_slow!r} and yarn_beta_fast={m.yarn_beta_fast!r} must satisfy "
            "0 < beta_slow < beta_fast"
        )


def check_llama3_scaling(m: ModelConfig) -> None:
    """The Llama-3 scaling settings as one-line ConfigErrors (they need rope_scaling=true)."""
    if not m.rope_scaling:
        changed = [k for k, v in position.LLAMA3_DEFAULTS.items() if getattr(m, k) != v]
        if changed:
            raise ConfigError(f"model.{changed[0]} is a Llama-3 scaling setting: it needs model.rope_scaling=true")
        return
    low, high = m.rope_scaling_low_freq_factor, m.rope_scaling_high_freq_factor
    if not 0 < low < high:
        raise ConfigError(
            f"model.rope_scaling_low_freq_factor={low!r} and rope_scaling_high_freq_factor={high!r} must satisfy "
            "0 < low < high"
        )
    original = m.rope_scaling_original_max_position_embeddings
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ConfigError(
            f"model.rope_scaling_original_max_position_embeddings={original!r} must be a positive integer"
        )


def matched_ffn_width(ffn: int, hidden: int, added_per_layer: int, multiple: int) -> int:
    """SwiGLU FFN width whose 3·h·f parameters absorb `added_per_layer`, rounded to a multiple of `multiple`."""
    if added_per_layer == 0:
        return ffn
    target = ffn - added_per_layer / (3 * hidden)
    width = int(round(target / multiple)) * multiple
    if width <= 0:
        raise ConfigError(f"the gate adds {added_per_layer} parameters per layer, more than the FFN ({ffn}) can absorb")
    return width


def check_fields(values: Mapping[str, Any]) -> None:
    """Refuse a key that is not a ModelConfig field, naming the fields there are."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        hint = did_you_mean(unknown[0], fields)
        raise ConfigError(f"model.{unknown[0]} is not a model field; fields: {', '.join(sorted(fields))}{hint}")


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel sizes, with Megatron-LM's names."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    expert_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    expert_tensor_parallel_size: int | None = None  # None: TP (megatron's default); NVIDIA's MoE recipes use 1
    # uneven pipeline splits (megatron's TransformerConfig options; rules: megagate.distributed.layout.stage_layers)
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    pipeline_model_parallel_layout: str | None = None  # e.g. "Et*3|(tt|)*29,m|L"; t a layer, E embedding, L loss
