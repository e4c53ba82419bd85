"""Hugging Face formats: the interface `megagate export` / `import` / `analyze` use (config and tensors, in memory).

FORMATS = ("qwen3", "qwen3_moe", "qwen3_next", "paper", "qwen3_5", "qwen3_5_moe"); which models each holds, and their config.json, are in
`megagate.interop.hf_config` (its `rope_scaling`: `megagate.interop.hf_rope`); the tensor mapping (and Qwen3-Next's zero-size shared expert) in
`megagate.interop.hf_weights`; the q/k/v row layouts in `megagate.model.qkv_layout`. Both directions are exact:
pure reindexing, bit-identical tensors, every key and shape checked (one-line ConfigError, never wrong weights).
Files (safetensors, checkpoints) are `megagate.interop.hf_io`'s.
"""

from __future__ import annotations

from megagate.interop.hf_config import (
    ARCHITECTURES,
    FORMATS,
    GATED,
    MODEL_TYPES,
    check_exportable,
    default_format,
    formats_for,
    hf_config,
    model_config_from_hf,
    same_architecture,
)
from megagate.interop.hf_weights import (
    from_hf_state_dict,
    fuse_experts,
    hf_shapes,
    megatron_shapes,
    to_hf_state_dict,
    unfuse_experts,
)

__all__ = [
    "ARCHITECTURES",
    "FORMATS",
    "GATED",
    "MODEL_TYPES",
    "check_exportable",
    "default_format",
    "formats_for",
    "from_hf_state_dict",
    "fuse_experts",
    "hf_config",
    "hf_shapes",
    "megatron_shapes",
    "model_config_from_hf",
    "same_architecture",
    "to_hf_state_dict",
    "unfuse_experts",
]
