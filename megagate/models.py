"""Model presets (the paper's Table 7 plus tiny CPU models), their megatron `TransformerConfig`, and `GPTModel`.

`ModelConfig` is the project's small typed model description; `transformer_config()` *produces* megatron's config
from it (never a copy of megatron's class). Dense gated models shrink their FFN so that the parameter count matches
the baseline (the paper's rule), rounded to `ffn_multiple` so the width stays TP- and kernel-friendly.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from megagate.attention import gate_parameter_count
from megagate.errors import ConfigError
from megagate.gate import GateConfig


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
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
                     "ffn_hidden_size", "vocab_size", "max_sequence_length"):  # fmt: skip
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
        added = gate_parameter_count(self.gate, self.hidden_size, self.num_attention_heads,
                                     self.num_query_groups, self.head_dim) + self._sandwich_params()  # fmt: skip
        return matched_ffn_width(self.ffn_hidden_size, self.hidden_size, added, self.ffn_multiple)

    def _sandwich_params(self) -> int:
        return 2 * self.hidden_size if self.gate.sandwich_norm else 0

    def with_gate(self, gate: GateConfig) -> "ModelConfig":
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
    "1.7b-28l": dict(num_layers=28, hidden_size=2048, num_attention_heads=16, num_query_groups=8, head_dim=128,
                     ffn_hidden_size=6144, vocab_size=QWEN_VOCAB, tie_embeddings=True),
    "1.7b-48l": dict(num_layers=48, hidden_size=1536, num_attention_heads=16, num_query_groups=8, head_dim=128,
                     ffn_hidden_size=4608, vocab_size=QWEN_VOCAB, tie_embeddings=True),
    "15a2b-moe": dict(num_layers=24, hidden_size=2048, num_attention_heads=32, num_query_groups=4, head_dim=128,
                      ffn_hidden_size=768, vocab_size=QWEN_VOCAB, tie_embeddings=False, num_experts=128,
                      moe_router_topk=8, moe_ffn_hidden_size=768),
    # Tiny models for CPU tests and the demo.
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16,
                 ffn_hidden_size=192, vocab_size=512, max_sequence_length=128, rotary_base=10_000),
    "tiny-moe": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16,
                     ffn_hidden_size=64, vocab_size=512, max_sequence_length=128, rotary_base=10_000,
                     tie_embeddings=False, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64),
}  # fmt: skip


def _check_fields(values: Mapping[str, Any]) -> None:
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"model.{unknown[0]} is not a model field; fields: {', '.join(sorted(fields))}")


def model_preset(name: str, gate: Optional[GateConfig] = None, **overrides: Any) -> ModelConfig:
    """A preset ModelConfig with an optional gate and field overrides."""
    if name not in PRESETS:
        raise ConfigError(f"model preset {name!r} is unknown; known presets: {', '.join(PRESETS)}")
    _check_fields(overrides)
    values = {**PRESETS[name], **overrides}
    if gate is not None:
        values["gate"] = gate
    return ModelConfig(**values)


# --- megatron config -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParallelConfig:
    """Parallel sizes, with Megatron-LM's names."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    expert_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False


def transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig = ParallelConfig(),
    *,
    params_dtype: torch.dtype = torch.float32,
    use_cpu: Optional[bool] = None,
    perform_initialization: bool = True,
    **extra: Any,
) -> "TransformerConfig":  # noqa: F821
    """megatron's TransformerConfig for `model` under `parallel` (CPU-safe fusions off when CUDA is absent)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cpu = (not torch.cuda.is_available()) if use_cpu is None else use_cpu
    moe: dict[str, Any] = {}
    if model.is_moe:
        moe = dict(
            num_moe_experts=model.num_experts,
            moe_router_topk=model.moe_router_topk,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size,
            moe_router_load_balancing_type=model.moe_load_balancing,
            moe_aux_loss_coeff=model.moe_aux_loss_coeff,
            moe_z_loss_coeff=model.moe_z_loss_coeff,
            moe_router_score_function="softmax",
            # alltoall needs CUDA streams; allgather is exact and works over gloo
            moe_token_dispatcher_type="allgather" if cpu else "alltoall",
            moe_grouped_gemm=False,
        )
    kwargs: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.effective_ffn_hidden_size,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        qk_layernorm=model.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        use_cpu_initialization=cpu,
        perform_initialization=perform_initialization,
        **moe,
    )
    if cpu:
        kwargs.update(
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            bias_activation_fusion=False,
            # gloo pairs batched isend/irecv out of order under the interleaved (VPP) schedule: the micro-batches
            # after the first group got another micro-batch's activations (measured); single p2p ops stay ordered
            batch_p2p_comm=False,
        )
    kwargs.update(extra)
    return TransformerConfig(**kwargs)


def build_gpt_model(
    model: ModelConfig,
    config: "TransformerConfig",  # noqa: F821
    *,
    backend: str = "local",
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
) -> "GPTModel":  # noqa: F821
    """A megatron GPTModel built from the gated decoder block spec (this pipeline stage's part)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megagate.spec import gated_decoder_block_spec

    block = gated_decoder_block_spec(config, model.gate, backend=backend, vp_stage=vp_stage,
                                     tp_size=parallel_state.get_tensor_model_parallel_world_size())  # fmt: skip
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=model.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=model.rotary_base,
        vp_stage=vp_stage,
    )


# --- analytic parameter counts ----------------------------------------------------------------------------------------
def parameter_counts(model: ModelConfig) -> dict[str, int]:
    """Analytic parameter counts: total, active per token (MoE), and the gate's share."""
    h, n, g, d, layers = model.hidden_size, model.num_attention_heads, model.num_query_groups, model.head_dim, model.num_layers
    attention = h * n * d + 2 * h * g * d + n * d * h + (2 * d if model.qk_layernorm else 0)
    gate = gate_parameter_count(model.gate, h, n, g, d)
    norms = 2 * h + model._sandwich_params()
    if model.is_moe:
        expert = 3 * h * model.moe_ffn_hidden_size
        router = model.num_experts * h
        mlp_total, mlp_active = router + model.num_experts * expert, router + model.moe_router_topk * expert
    else:
        mlp_total = mlp_active = 3 * h * model.effective_ffn_hidden_size
    embeddings = model.vocab_size * h * (1 if model.tie_embeddings else 2)
    per_layer_fixed = attention + gate + norms
    total = embeddings + layers * (per_layer_fixed + mlp_total) + h  # + final norm
    active = embeddings + layers * (per_layer_fixed + mlp_active) + h
    return {"total": total, "active": active, "gate": layers * gate, "embedding": embeddings}


def flops_per_token(model: ModelConfig, seq_length: int) -> int:
    """Training FLOPs per token (forward + backward = 3 × forward; matmuls only, causal attention halved)."""
    counts = parameter_counts(model)
    dense_params = counts["active"] - model.vocab_size * model.hidden_size * (0 if model.tie_embeddings else 1)
    attention_scores = 2 * model.num_layers * seq_length * model.num_attention_heads * model.head_dim  # QK^T and AV, causal
    return 3 * (2 * dense_params + attention_scores)


def from_dict(values: Mapping[str, Any], gate: GateConfig) -> ModelConfig:
    """ModelConfig from a `preset` name plus field overrides (as in a YAML config's model section)."""
    values = dict(values)
    preset_name = values.pop("preset", None)
    if preset_name is None:
        _check_fields(values)
        return ModelConfig(gate=gate, **values)
    return model_preset(preset_name, gate=gate, **values)


def meta_parameter_count(model: ModelConfig) -> int:
    """Parameters of the model as megatron builds it (TP=PP=1), on the meta device: no memory, no initialisation.

    Needs megatron's parallel state (e.g. inside `megagate.parallel.single_process()`).
    """
    config = transformer_config(model, use_cpu=True, perform_initialization=False)
    with torch.device("meta"):
        gpt = build_gpt_model(model, config)
    return sum(p.numel() for p in gpt.parameters())


class _DropGPTModelDeprecation(logging.Filter):
    # megatron 0.19 logs a deprecation warning for every GPTModel it builds; it stays the GPT path here.
    def filter(self, record: logging.LogRecord) -> bool:
        return "GPTModel IS DEPRECATED" not in record.getMessage()


logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(_DropGPTModelDeprecation())
