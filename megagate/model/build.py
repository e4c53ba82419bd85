"""megatron objects from a `ModelConfig`: its `TransformerConfig` (produced, never copied) and the language model
(megatron's `HybridModel`; its `GPTModel` for the layouts HybridModel cannot carry, see `gpt_model_reason`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from megagate.errors import ConfigError
from megagate.model import hybrid
from megagate.model.model_config import ModelConfig, ParallelConfig

if TYPE_CHECKING:  # megatron is imported inside the functions (its import is slow and prints notices)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig


def transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig = ParallelConfig(),
    *,
    params_dtype: torch.dtype = torch.float32,
    use_cpu: bool | None = None,
    perform_initialization: bool = True,
    **extra: Any,
) -> TransformerConfig:
    """megatron's TransformerConfig for `model` under `parallel`.

    `extra` wins over everything set here: a run passes its precision (FP8 recipe) and the perf settings in force
    on its machine (`megagate.run_setup.RunSetup.transformer_kwargs`, from the config's `perf:` section: the one
    place that decides them, CPU switch-offs included). Without them (tests, the planner's parameter counts) the
    model is built as megatron's defaults build it: SequentialMLP experts, no fusions; the parameters are the same.
    `use_cpu` (default: no CUDA here) initialises on the CPU and sends pipeline messages one by one.
    """
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
            moe_z_loss_coeff=model.moe_z_loss_coeff or None,  # 0: no z-loss, as Megatron-LM's unset flag
            moe_router_score_function="softmax",
            # softmax over all experts before top-k (no renormalisation) when the top-k probabilities are not
            # normalised; megatron's default softmax over the top-k logits otherwise
            moe_router_pre_softmax=not model.moe_router_norm_topk,
        )
        if model.moe_shared_expert_intermediate_size:
            moe.update(
                moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
                moe_shared_expert_gate=model.moe_shared_expert_gate,
            )
    if hybrid.is_hybrid(model):
        # read by megatron's GatedDeltaNet (megagate.model.gdn); which layers are GDN is the spec's business
        moe.update({name: getattr(model, name) for name in hybrid.GDN_FIELDS})
        # layers of two kinds cannot be stacked along one layer axis in a distributed checkpoint: one key per layer
        moe.update(hetereogenous_dist_checkpoint=True)
    kwargs: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.effective_ffn_hidden_size,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        layernorm_zero_centered_gamma=model.norm_zero_centered,
        qk_layernorm=model.qk_layernorm,
        softmax_type=model.softmax_type,
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
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        num_layers_in_first_pipeline_stage=parallel.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=parallel.num_layers_in_last_pipeline_stage,
        account_for_embedding_in_pipeline_split=parallel.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=parallel.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=parallel.pipeline_model_parallel_layout,
        use_cpu_initialization=cpu,
        perform_initialization=perform_initialization,
        **moe,
    )
    if cpu:
        # gloo pairs batched isend/irecv out of order under the interleaved (VPP) schedule: the micro-batches after
        # the first group got another micro-batch's activations (measured); single p2p ops stay ordered
        kwargs.update(batch_p2p_comm=False)
    if model.recompute_granularity is not None:
        kwargs.update(
            recompute_granularity=model.recompute_granularity,
            recompute_method=model.recompute_method,
            recompute_num_layers=model.recompute_num_layers,
        )
    kwargs.update(extra)
    config = TransformerConfig(**kwargs)
    if model.position_embedding == "yarn":
        # megatron reads YaRN's settings as config attributes outside the dataclass (GPTModel builds its
        # YarnRotaryEmbedding from them; attention applies the concentration factor to q and k when they exist),
        # so they are set only for YaRN models
        config.yarn_rotary_scaling_factor = model.yarn_factor
        config.yarn_original_max_position_embeddings = model.yarn_original_length
        config.yarn_beta_fast = model.yarn_beta_fast
        config.yarn_beta_slow = model.yarn_beta_slow
        config.yarn_mscale = model.yarn_mscale
        config.yarn_mscale_all_dim = model.yarn_mscale_all_dim
        config.yarn_correction_range_round_to_int = model.yarn_correction_range_round_to_int
    return config


def gpt_model_reason(config: TransformerConfig) -> str | None:
    """Why `config` is built on megatron's deprecated GPTModel rather than its HybridModel (None: it is not).

    HybridModel splits the layers over pipeline stages by the pattern's "|" cuts and refuses the first/last-stage
    layer counts with them, has no place for a custom pipeline layout, and builds one layer spec per symbol, so a
    model whose MoE layers alternate with dense ones cannot be said in its pattern of whole layers."""
    if config.pipeline_model_parallel_layout is not None:
        return "parallel.pipeline_model_parallel_layout (HybridModel splits stages at the pattern's '|' only)"
    if config.num_layers_in_first_pipeline_stage is not None or config.num_layers_in_last_pipeline_stage is not None:
        return "parallel.num_layers_in_first/last_pipeline_stage (HybridModel refuses them with '|' cuts)"
    if config.moe_layer_freq != 1:
        return f"moe_layer_freq={config.moe_layer_freq!r} (HybridModel builds one layer spec per symbol)"
    return None


def hybrid_layer_pattern(model: ModelConfig, config: TransformerConfig) -> str:
    """HybridModel's `hybrid_layer_pattern` for `model`: its layer pattern with a "|" cut between the pipeline
    stages (virtual stages in megatron's order: stage v of rank r is segment v * pp + r), the layers each stage
    holds being those megatron's GPT block gives it (`get_transformer_layer_offset`, `get_num_layers_to_build`)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from megagate.model.spec import _global_layer_ids

    symbols = hybrid.pattern(model)
    pp = config.pipeline_model_parallel_size
    if pp == 1:
        return symbols
    vpp = config.virtual_pipeline_model_parallel_size
    segments, order = [], []
    for vp in range(vpp or 1):
        stage = vp if vpp else None
        for rank in range(pp):
            ids = _global_layer_ids(config, stage, rank, get_num_layers_to_build(config, vp_stage=stage, pp_rank=rank))
            order.extend(ids)
            segments.append("".join(symbols[i] for i in ids))
    if order != list(range(len(symbols))):  # HybridModel's segments are consecutive runs of the pattern
        raise ConfigError(f"the pipeline split of model.layer_pattern {symbols!r} is not in layer order: {order}")
    return "|".join(segments)


def build_gpt_model(
    model: ModelConfig,
    config: TransformerConfig,
    *,
    backend: str = "local",
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    core_attention: str = "auto",
) -> torch.nn.Module:
    """megagate's language model (this pipeline stage's part): megatron's HybridModel with the gated layer specs
    (`megagate.model.spec.gated_hybrid_stack_spec`), or megatron's GPTModel with the gated decoder block spec for
    the layouts HybridModel cannot carry (`gpt_model_reason`). `core_attention` ("auto" | "sdpa" | "local" | "te")
    picks the attention kernel (`megagate.model.kernels.resolve_core_attention`). Both classes hold the same
    parameters under the same names and read and write the same distributed checkpoints."""
    from megatron.core import parallel_state

    from megagate.model.kernels import resolve_core_attention
    from megagate.model.rotary import fit_rotary

    if model.softmax_type != "vanilla" and not torch.cuda.is_available():
        if resolve_core_attention(backend, core_attention) == "local":
            raise ConfigError(
                f"model.softmax_type={model.softmax_type!r} with core_attention='local' needs CUDA (megatron-core "
                "0.19 allocates the sink on the current CUDA device); use core_attention='sdpa'"
            )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    hybrid.check_gdn_parallel(model, tp, parallel_state.get_context_parallel_world_size())
    common = model_kwargs(model, config, pre_process, post_process, vp_stage)
    if gpt_model_reason(config) is None:
        from megagate.model.hybrid_stack import GatedHybridModel
        from megagate.model.spec import gated_hybrid_stack_spec

        stack = gated_hybrid_stack_spec(
            config, model.gate, backend=backend, tp_size=tp, core_attention=core_attention, pattern=model.layer_pattern
        )
        lm = GatedHybridModel(
            hybrid_stack_spec=stack, hybrid_layer_pattern=hybrid_layer_pattern(model, config), **common
        )
    else:
        lm = _build_gpt_model(model, config, backend, vp_stage, core_attention, tp, common)
    fit_rotary(lm, model, config)
    if post_process:
        from megagate.model.loss import use_local_cross_entropy

        use_local_cross_entropy(lm)  # TP = 1: torch's cross-entropy instead of three one-rank all-reduces
    return lm


def model_kwargs(
    model: ModelConfig, config: TransformerConfig, pre_process: bool, post_process: bool, vp_stage: int | None
) -> dict[str, Any]:
    """The constructor arguments HybridModel and GPTModel share (embedding, output layer, rotary, stage)."""
    return dict(
        config=config,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=model.tie_embeddings,
        position_embedding_type=model.position_embedding,
        rotary_base=model.rotary_base,
        rotary_percent=model.rotary_percent,
        seq_len_interpolation_factor=model.rotary_interpolation_factor,
        vp_stage=vp_stage,
    )


def _build_gpt_model(
    model: ModelConfig,
    config: TransformerConfig,
    backend: str,
    vp_stage: int | None,
    core_attention: str,
    tp: int,
    common: dict[str, Any],
) -> GPTModel:
    """GPTModel with the gated decoder block spec: the layouts of `gpt_model_reason` only (megatron 0.19 logs
    "GPTModel IS DEPRECATED" for it; megagate.console keeps that notice for this path)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megagate.model.spec import gated_decoder_block_spec

    block = gated_decoder_block_spec(
        config,
        model.gate,
        backend=backend,
        vp_stage=vp_stage,
        tp_size=tp,
        core_attention=core_attention,
        pattern=model.layer_pattern,
    )
    # Llama-3 scaling with the model's own original context: fit_rotary
    return GPTModel(transformer_layer_spec=block, rope_scaling=False, **common)


def meta_parameter_count(model: ModelConfig) -> int:
    """Parameters of the model as megatron builds it (TP=PP=1), on the meta device: no memory, no initialisation.

    Needs megatron's parallel state (e.g. inside `megagate.distributed.parallel.single_process()`).
    """
    config = transformer_config(model, use_cpu=True, perform_initialization=False)
    with torch.device("meta"):
        lm = build_gpt_model(model, config)
    return sum(p.numel() for p in lm.parameters())
