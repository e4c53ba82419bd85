"""Pure parameter and FLOP arithmetic for gated models (no megatron): what the builders must match."""

from __future__ import annotations

from megagate.model import hybrid
from megagate.model.gate_params import gate_parameter_count
from megagate.model.model_config import ModelConfig


def parameter_counts(model: ModelConfig) -> dict[str, int]:
    """Analytic parameter counts: total, active per token (MoE), and the gate's share; a hybrid's attention and
    gate in its attention layers, Gated DeltaNet mixers in the others."""
    h, n, g, d, layers = (
        model.hidden_size,
        model.num_attention_heads,
        model.num_query_groups,
        model.head_dim,
        model.num_layers,
    )
    attention = h * n * d + 2 * h * g * d + n * d * h + (2 * d if model.qk_layernorm else 0)
    attention += n if model.softmax_type == "learnable" else 0  # the learnable sink: one logit per head
    gate = gate_parameter_count(model.gate, h, n, g, d)
    norms = 2 * h + model.sandwich_norm_params
    if model.is_moe:
        expert = 3 * h * model.moe_ffn_hidden_size
        router = model.num_experts * h
        shared = hybrid.shared_expert_parameter_count(model)
        mlp_total = router + model.num_experts * expert + shared
        mlp_active = router + model.moe_router_topk * expert + shared
    else:
        mlp_total = mlp_active = 3 * h * model.effective_ffn_hidden_size
    embeddings = model.vocab_size * h * (1 if model.tie_embeddings else 2)
    attn_layers = hybrid.attention_layers(model)
    mixers = attn_layers * (attention + gate) + (layers - attn_layers) * hybrid.gdn_parameter_count(model)
    total = embeddings + mixers + layers * (norms + mlp_total) + h  # + final norm
    active = embeddings + mixers + layers * (norms + mlp_active) + h
    return {"total": total, "active": active, "gate": attn_layers * gate, "embedding": embeddings}


def flops_per_token(model: ModelConfig, seq_length: int) -> int:
    """Training FLOPs per token (forward + backward = 3 × forward; matmuls only, causal attention halved)."""
    counts = parameter_counts(model)
    dense_params = counts["active"] - model.vocab_size * model.hidden_size * (0 if model.tie_embeddings else 1)
    attention_scores = (
        2 * hybrid.attention_layers(model) * seq_length * model.num_attention_heads * model.head_dim
    )  # QK^T and AV, causal
    gdn_layers = model.num_layers - hybrid.attention_layers(model)
    return 3 * (2 * dense_params + attention_scores + gdn_layers * gdn_mixing_flops(model))


def gdn_mixing_flops(model: ModelConfig, chunk: int = 64) -> int:
    """Forward FLOPs per token of one Gated DeltaNet layer's delta rule (the projections are parameters): per value
    head, the causal products within a chunk (≈ chunk·(dk + dv)) and the state's three dk×dv products (read by q,
    read by k, updated)."""
    dk, dv = model.linear_key_head_dim, model.linear_value_head_dim
    return model.linear_num_value_heads * (chunk * (dk + dv) + 6 * dk * dv)
