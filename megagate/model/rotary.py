"""The rotary embedding of a built HybridModel or GPTModel, for the two settings their constructors cannot pass on.

- Llama-3 scaling from another original context (or other low/high frequency factors): GPTModel builds its
  `RotaryEmbedding` with `_apply_scaling`'s defaults (8192, 1, 4); the scaled table is recomputed here with
  megatron's own `_apply_scaling` and the model's settings, from the unscaled frequencies megatron built.
- YaRN over a partial rotary: megatron's `YarnRotaryEmbedding` builds its table over all `kv_channels` whatever
  `rotary_percent` says; built with `kv_channels` = the rotated dims it is YaRN over exactly those (the ramp, the
  table and the attention factor; `apply_rotary_pos_emb` rotates the first dims and passes the rest through), which
  is transformers' YaRN with `partial_rotary_factor`.

Both are applied right after the model is built, before any forward (megatron caches tables per call).
"""

from __future__ import annotations

from typing import Any

from megagate.model.model_config import ModelConfig
from megagate.model.position import rotated_dims


def fit_rotary(gpt: Any, model: ModelConfig, config: Any) -> None:
    """Give `gpt` (a megatron HybridModel or GPTModel built from `model`, no rope scaling) the rotary embedding `model`
    describes; `config` is its TransformerConfig."""
    rope = getattr(gpt, "rotary_pos_emb", None)
    if rope is None:
        return
    if model.position_embedding == "rope" and model.rope_scaling:
        rope.inv_freq = rope._apply_scaling(
            rope.inv_freq,
            factor=model.rope_scaling_factor,
            low_freq_factor=model.rope_scaling_low_freq_factor,
            high_freq_factor=model.rope_scaling_high_freq_factor,
            original_max_position_embeddings=model.rope_scaling_original_max_position_embeddings,
        )
        gpt.rotary_scaling = True
    elif model.position_embedding == "yarn" and model.rotary_percent < 1.0:
        from megatron.core.models.common.embeddings import YarnRotaryEmbedding

        gpt.rotary_pos_emb = YarnRotaryEmbedding(
            kv_channels=rotated_dims(model),
            rotary_percent=1.0,
            rotary_interleaved=config.rotary_interleaved,
            rotary_base=model.rotary_base,
            scaling_factor=config.yarn_rotary_scaling_factor,
            original_max_position_embeddings=config.yarn_original_max_position_embeddings,
            beta_fast=config.yarn_beta_fast,
            beta_slow=config.yarn_beta_slow,
            mscale=config.yarn_mscale,
            mscale_all_dim=config.yarn_mscale_all_dim,
            correction_range_round_to_int=config.yarn_correction_range_round_to_int,
            use_cpu_initialization=config.use_cpu_initialization,
        )
