"""Qwen3.5 (transformers 5's `qwen3_5` / `qwen3_5_moe`): its vision-language folders read as their text model, and
its Gated DeltaNet input projections (pure, bit-identical reindexing).

The released Qwen3.5 checkpoints are vision-language models: config.json has model_type `qwen3_5` / `qwen3_5_moe`,
architectures `Qwen3_5(Moe)ForConditionalGeneration`, the text model in `text_config` and the vision encoder in
`vision_config`; the weights hold the text model under `model.language_model.*` (and `lm_head.weight`), the vision
encoder under `model.visual.*` and the MTP head under `mtp.*`. megagate takes the text part, as transformers'
`Qwen3_5ForCausalLM` does when it loads such a folder (its checkpoint conversion drops `language_model`, its
`_keys_to_ignore_on_load_unexpected` the vision and MTP tensors): `text_model` gives the text config.json (model_type
`qwen3_5_text` / `qwen3_5_moe_text`), `text_tensors` the text tensors under transformers' text-model names and what
was dropped. An export writes the text model only (`Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM`).

A Qwen3.5 Gated DeltaNet layer projects with four linears where megatron has one `in_proj` of rows
[q; k; v; z; beta; alpha] (each section head-major, value head j of key head j // r):

    in_proj_qkv  rows [q; k; v]   (the conv's channels, in the same order)
    in_proj_z    rows z
    in_proj_b    rows beta
    in_proj_a    rows alpha

so the conversion is a split / concatenation of rows (Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` group them per key
head instead: megagate.interop.hf_hybrid).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from megagate.errors import ConfigError

# config.json model_type of a vision-language folder -> its text model's model_type, and the VL architecture
TEXT_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
VL_ARCHITECTURES = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
TEXT_PREFIX, HF_PREFIX = "model.language_model.", "model."
DROPPED = {"model.visual.": "the vision encoder", "mtp.": "the MTP head"}
PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def is_vision_language(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") in TEXT_MODEL_TYPES


def text_model(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config.json of a Qwen3.5 vision-language config.json (its `text_config`, model_type
    `qwen3_5(_moe)_text`); one-line ConfigError where it is not one."""
    model_type = config["model_type"]
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigError(
            f"config.json model_type={model_type!r} has no text_config object (a Qwen3.5 vision-language config holds "
            "its text model there; a text-only folder has model_type "
            f"{TEXT_MODEL_TYPES[model_type]!r})"
        )
    architectures = list(config.get("architectures") or [VL_ARCHITECTURES[model_type]])
    if architectures != [VL_ARCHITECTURES[model_type]]:
        raise ConfigError(
            f"config.json architectures={architectures!r}: a {model_type} vision-language folder is "
            f"[{VL_ARCHITECTURES[model_type]!r}]"
        )
    out = dict(text)
    inner = out.get("model_type", TEXT_MODEL_TYPES[model_type])
    if inner != TEXT_MODEL_TYPES[model_type]:
        raise ConfigError(
            f"config.json text_config.model_type={inner!r}: a {model_type} folder's text model is "
            f"{TEXT_MODEL_TYPES[model_type]!r}"
        )
    if "tie_word_embeddings" in config:
        tied = bool(config["tie_word_embeddings"])
        if "tie_word_embeddings" in out and bool(out["tie_word_embeddings"]) != tied:
            raise ConfigError(
                f"config.json tie_word_embeddings={tied!r} and text_config.tie_word_embeddings="
                f"{out['tie_word_embeddings']!r} disagree"
            )
        out["tie_word_embeddings"] = tied
    out.pop("architectures", None)
    return {**out, "model_type": inner}


def text_tensors(tensors: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, int]]:
    """A vision-language folder's tensors -> (the text model's under transformers' text-model names, the number
    dropped per part: vision encoder, MTP head); a tensor of no known part is kept (and refused by the shape check)."""
    out: dict[str, Tensor] = {}
    dropped = dict.fromkeys(DROPPED.values(), 0)
    for key, tensor in tensors.items():
        part = next((what for prefix, what in DROPPED.items() if key.startswith(prefix)), None)
        if part is not None:
            dropped[part] += 1
        elif key.startswith(TEXT_PREFIX):
            out[HF_PREFIX + key[len(TEXT_PREFIX) :]] = tensor
        else:
            out[key] = tensor
    return out, {k: v for k, v in dropped.items() if v}


def _sections(model: Any) -> list[int]:
    nk, nv = model.linear_num_key_heads, model.linear_num_value_heads
    qk, v = nk * model.linear_key_head_dim, nv * model.linear_value_head_dim
    return [qk, qk, v, v, nv, nv]  # q, k, v, z, beta, alpha


def projection_shapes(model: Any) -> dict[str, tuple[int, int]]:
    """The four input projections of a Qwen3.5 GDN layer (keys after `model.layers.N.linear_attn.`)."""
    q, k, v, z, b, a = _sections(model)
    h = model.hidden_size
    rows = {"in_proj_qkv": q + k + v, "in_proj_z": z, "in_proj_b": b, "in_proj_a": a}
    return {f"{name}.weight": (rows[name], h) for name in PROJECTIONS}


def in_proj_to_hf(model: Any, w: Tensor) -> dict[str, Tensor]:
    """megatron in_proj [q; k; v; z; b; a] -> Qwen3.5's four projections (keys as in `projection_shapes`)."""
    q, k, v, z, b, a = w.split(_sections(model), dim=0)
    parts = {"in_proj_qkv": torch.cat([q, k, v], dim=0), "in_proj_z": z, "in_proj_b": b, "in_proj_a": a}
    return {f"{name}.weight": parts[name].contiguous().clone() for name in PROJECTIONS}


def in_proj_from_hf(projections: Mapping[str, Tensor]) -> Tensor:
    """Qwen3.5's four projections -> megatron in_proj (the inverse of `in_proj_to_hf`)."""
    return torch.cat([projections[f"{name}.weight"] for name in PROJECTIONS], dim=0).contiguous()
