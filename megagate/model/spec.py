"""Gated layer specs, derived from megatron-core's own GPT specs with only the attention module swapped.

Starting from megatron's specs (Transformer Engine or local modules, dense or MoE, QK-norm, layer patterns and
pipeline slicing all decided by megatron) keeps every other megatron feature working: TE's fused layernorm-linear and
FP8/BF16 modules, grouped-GEMM experts, the MoE router. Two things are added:

* `self_attention` becomes `GatedSelfAttention` with the `GateConfig` as a spec parameter;
* with `gate.sandwich_norm`, both bias-dropout-add modules become `SublayerOutputNormBDA`, which normalises the
  sublayer output before the residual add (the paper's sandwich-norm stability baseline).

The core attention inside `self_attention` is chosen by `core_attention` (`megagate.model.kernels`): "te" is Transformer
Engine's fused attention (backend te only), "local" megatron's `DotProductAttention` (materialises [b, np, sq, sk]
probabilities), "sdpa" `megagate.model.core_attention.SDPACoreAttention` (torch's fused kernels, memory O(s));
"auto" is te under backend te, else sdpa, on CPU too (faster and smaller there as well).

With `config.layernorm_zero_centered_gamma` (ModelConfig.norm_zero_centered) on the local backend, megatron's local
norm (which refuses it) is replaced everywhere (input, pre-MLP, q/k, final and sandwich norms) by
`megagate.model.norms.ZeroCenteredRMSNorm`; TE's norms read the flag themselves.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import (
    LNImpl,
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megagate.errors import ConfigError
from megagate.model.attention import GatedSelfAttention
from megagate.model.core_attention import SDPACoreAttention
from megagate.model.gate import GateConfig
from megagate.model.gate_params import check_gate_tensor_parallel
from megagate.model.kernels import check_backend, resolve_core_attention
from megagate.model.norms import ZeroCenteredRMSNorm
from megagate.model.qkv_layout import check_tensor_parallel


def _core_attention_module(backend: str, choice: str) -> type | None:
    """The module class for the resolved choice, or None to keep megatron's spec's own (te under te, local under
    local: the module megatron's backend picks)."""
    kernel = resolve_core_attention(backend, choice)
    if kernel == "sdpa":
        return SDPACoreAttention
    if kernel == backend:
        return None
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention  # local attention under backend te


def check_gate_compatible(config: TransformerConfig, gate: GateConfig, tp_size: int) -> None:
    """Model-level validation of a gate against the transformer config and tensor-parallel size."""
    if config.multi_latent_attention and (gate.enabled or gate.sdpa_norm != "none"):
        raise ConfigError(
            f"gate.position={gate.position!r} is not supported with multi_latent_attention (MLA): megagate gates "
            "standard multi-head/GQA attention; set gate.position='none' or multi_latent_attention=false"
        )
    groups = config.num_query_groups or config.num_attention_heads
    check_tensor_parallel(config.num_attention_heads, groups, tp_size)
    check_gate_tensor_parallel(
        gate, config.hidden_size, config.num_attention_heads, groups, config.kv_channels, tp_size
    )


class SublayerOutputNormBDA(MegatronModule):
    """Bias-dropout-add that normalises the sublayer output first: x + dropout(norm(f(x)))."""

    def __init__(self, config: TransformerConfig, norm: Callable[..., Any]) -> None:
        super().__init__(config=config)
        self.norm = norm(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, training: bool, fused: bool) -> Callable:
        """Return the bias-dropout-add function, like megatron's `get_bias_dropout_add(training, fused)`."""
        bda = get_bias_dropout_add(training, fused)

        def normed_bda(x_with_bias: tuple, residual: Any, prob: float) -> Any:
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            return bda((self.norm(x), None), residual, prob)

        return normed_bda


def _local_norms_zero_centered(spec: Any) -> Any:
    """`spec` (a ModuleSpec, a submodules dataclass or a module class) with megatron's local norm class replaced by
    ZeroCenteredRMSNorm, in place where it is a spec object (a deep copy is expected)."""
    if spec is WrappedTorchNorm:
        return ZeroCenteredRMSNorm
    if isinstance(spec, ModuleSpec):
        spec.module = _local_norms_zero_centered(spec.module)
        spec.submodules = _local_norms_zero_centered(spec.submodules)
        return spec
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            old = getattr(spec, f.name)
            new = _local_norms_zero_centered(old)
            if new is not old:
                setattr(spec, f.name, new)
    return spec


def _norm_builder(layer_spec: ModuleSpec, backend: str) -> Callable[..., Any]:
    if backend == "te":
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return layer_spec.submodules.input_layernorm


def gate_layer(
    layer_spec: ModuleSpec, gate: GateConfig, config: TransformerConfig, backend: str, core_attention: str = "auto"
) -> ModuleSpec:
    """A copy of a megatron TransformerLayer spec with the gated attention (and sandwich norm) and the chosen core
    attention swapped in."""
    spec = copy.deepcopy(layer_spec)
    if config.layernorm_zero_centered_gamma and backend != "te":
        spec = _local_norms_zero_centered(spec)
    attention = spec.submodules.self_attention
    module = _core_attention_module(backend, core_attention)
    if module is not None:
        attention.submodules.core_attention = module  # the deep copy's own submodules
    spec.submodules.self_attention = ModuleSpec(
        module=GatedSelfAttention,
        params={**attention.params, "gate": gate},
        submodules=attention.submodules,
    )
    if gate.sandwich_norm:
        norm = _norm_builder(spec, backend)
        bda = ModuleSpec(module=SublayerOutputNormBDA, params={"config": config, "norm": norm})
        spec.submodules.self_attn_bda = bda
        spec.submodules.mlp_bda = bda
    if config.moe_grouped_gemm and backend != "te":  # megatron's local spec would loop the experts (SequentialMLP)
        from megagate.model.experts import use_torch_grouped_experts

        spec = use_torch_grouped_experts(spec, config)
    return spec


def gdn_layer(layer_spec: ModuleSpec, backend: str) -> ModuleSpec:
    """A gated layer spec (from `gate_layer`) with megatron's Gated DeltaNet as its mixer (megagate.model.gdn); the
    layer's input norm is its own module (TE's spec fuses it into linear_qkv, which a GDN layer has not)."""
    from megagate.model.gdn import gdn_mixer_spec

    spec = copy.copy(layer_spec)
    spec.submodules = copy.copy(layer_spec.submodules)
    spec.submodules.self_attention = gdn_mixer_spec(backend)
    if backend == "te":
        spec.submodules.input_layernorm = _norm_builder(spec, backend)
    return spec


def _global_layer_ids(config: TransformerConfig, vp_stage: int | None, pp_rank: int | None, count: int) -> list[int]:
    """The 0-based model-wide indices of this stage's `count` layers, as megatron's block spec slices them."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if config.pipeline_model_parallel_layout is not None:
        ids = config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank
        )
        return list(ids)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return list(range(offset, offset + count))


def gated_decoder_block_spec(
    config: TransformerConfig,
    gate: GateConfig,
    backend: str = "local",
    vp_stage: int | None = None,
    pp_rank: int | None = None,
    tp_size: int = 1,
    core_attention: str = "auto",
    pattern: str | None = None,
) -> TransformerBlockSubmodules:
    """megatron's GPT decoder block spec (this pipeline stage's layers) with gated attention in every layer, its
    core attention chosen by `core_attention` (see `resolve_core_attention`); with a layer `pattern`
    (megagate.model.hybrid), the layers marked "G" mix with Gated DeltaNet instead."""
    check_backend(backend)
    resolve_core_attention(backend, core_attention)
    check_gate_compatible(config, gate, tp_size)
    block = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=backend == "te",
        normalization=config.normalization,
        vp_stage=vp_stage,
        pp_rank=pp_rank,
    )
    block.layer_specs = [gate_layer(layer, gate, config, backend, core_attention) for layer in block.layer_specs]
    if pattern is not None and "G" in pattern:
        ids = _global_layer_ids(config, vp_stage, pp_rank, len(block.layer_specs))
        block.layer_specs = [
            gdn_layer(layer, backend) if pattern[i] == "G" else layer for layer, i in zip(block.layer_specs, ids)
        ]
    if config.layernorm_zero_centered_gamma and backend != "te":
        block.layer_norm = _local_norms_zero_centered(block.layer_norm)  # the final norm
    return block


def gated_hybrid_stack_spec(
    config: TransformerConfig,
    gate: GateConfig,
    backend: str = "local",
    tp_size: int = 1,
    core_attention: str = "auto",
    pattern: str | None = None,
) -> ModuleSpec:
    """The spec of megagate's `GatedHybridStack` for megatron's HybridModel: one layer spec per pattern symbol, "*"
    the gated attention layer and "G" the Gated DeltaNet layer, each a whole TransformerLayer with its MLP (dense,
    MoE, MoE with a shared expert), the layers megatron's GPT layer specs give (see `gated_decoder_block_spec`).

    Every layer of one kind must have one spec (megatron's HybridStack builds by symbol); a model whose layers of
    one kind differ (config.moe_layer_freq other than 1) is refused here (build.py keeps it on GPTModel)."""
    check_backend(backend)
    resolve_core_attention(backend, core_attention)
    check_gate_compatible(config, gate, tp_size)
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules

    if config.moe_layer_freq != 1:
        raise ConfigError(f"moe_layer_freq={config.moe_layer_freq!r}: HybridModel builds one layer spec per symbol")
    layers = get_gpt_decoder_layer_specs(
        config, use_transformer_engine=backend == "te", normalization=config.normalization
    )
    attention = gate_layer(layers[0], gate, config, backend, core_attention)
    submodules = HybridStackSubmodules(attention_layer=attention)
    if pattern is not None and "G" in pattern:
        submodules.gdn_layer = gdn_layer(attention, backend)
    final_norm = _norm_builder(attention, backend) if backend == "te" else LNImpl
    if config.layernorm_zero_centered_gamma and backend != "te":
        final_norm = _local_norms_zero_centered(final_norm)
    from megagate.model.hybrid_stack import GatedHybridStack

    return ModuleSpec(module=GatedHybridStack, submodules=submodules, params={"final_norm": final_norm})


def gated_layer_spec(
    config: TransformerConfig,
    gate: GateConfig,
    backend: str = "local",
    tp_size: int = 1,
    core_attention: str = "auto",
) -> ModuleSpec:
    """One gated TransformerLayer spec (dense, or MoE when config.num_moe_experts is set)."""
    check_backend(backend)
    resolve_core_attention(backend, core_attention)
    check_gate_compatible(config, gate, tp_size)
    single = copy.copy(config)
    single.num_layers, single.moe_layer_freq = 1, 1
    layers = get_gpt_decoder_layer_specs(
        single, use_transformer_engine=backend == "te", normalization=config.normalization
    )
    return gate_layer(layers[0], gate, config, backend, core_attention)
