"""A megagate config as the `args` namespace of Megatron-LM's `megatron/training/theoretical_memory_usage.py`.

Megatron-LM's estimator (`compute_weight_and_optimizer_memory`, `compute_activation_memory`,
`compute_activation_memory_without_sp`, `report_theoretical_memory`) reads Megatron-LM's argparse flags. This builds
them from the same TrainConfig the trainer runs, so tests/plan/test_theoretical_memory.py can print megatron's figures
next to the planner's and docs/planning.md can explain every difference. Pure: no megatron import here.
"""

from __future__ import annotations

from types import SimpleNamespace

from megagate.distributed.layout import Layout
from megagate.run_config import TrainConfig


def megatron_args(cfg: TrainConfig, layout: Layout) -> SimpleNamespace:
    """Megatron-LM's flags for `cfg` on `layout` (megagate.config.layout(cfg, world_size)).

    Mapped as megatron itself would be configured for this model: `ffn_hidden_size` is the FFN megagate builds (a
    gated dense model's shrunk one; for the MoE, the preset's dense width, which megatron's activation formula uses
    although no layer has a dense MLP), `padded_vocab_size` is the vocabulary megagate builds (megagate does not pad
    to 128 x TP as Megatron-LM's tokenizer set-up does), expert tensor parallelism is TP (megagate's ETP), SwiGLU and
    RMSNorm as megagate always uses. Gates, QK-norm and RoPE have no flag the estimator reads.
    """
    m, t, p = cfg.model, cfg.train, cfg.parallel
    moe = m.is_moe
    return SimpleNamespace(
        # model
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        kv_channels=m.head_dim,
        group_query_attention=m.num_query_groups != m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size if moe else m.effective_ffn_hidden_size,
        swiglu=True,
        normalization=m.normalization,
        add_bias_linear=False,
        padded_vocab_size=m.vocab_size,
        untie_embeddings_and_output_weights=not m.tie_embeddings,
        multi_latent_attention=False,
        num_experts=m.num_experts if moe else None,
        moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size if moe else None,
        moe_layer_freq=1,
        moe_shared_expert_intermediate_size=None,
        moe_latent_size=None,
        mtp_num_layers=None,
        hybrid_layer_pattern=None,
        # parallelism
        world_size=layout.world_size,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.tp,
        context_parallel_size=layout.cp,
        data_parallel_size=layout.dp,
        sequence_parallel=p.sequence_parallel,
        # training
        seq_length=t.seq_length,
        micro_batch_size=t.micro_batch_size,
        use_distributed_optimizer=t.use_distributed_optimizer,
        recompute_granularity=m.recompute_granularity,
    )
