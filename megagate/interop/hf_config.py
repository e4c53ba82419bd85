"""Which Hugging Face format holds which megagate model, and the config.json of each (both directions).

Formats (FORMATS), each exact for the models it accepts:

    qwen3       Qwen3ForCausalLM      baseline (no gate), dense, QK-norm, plain RMSNorm weights
    qwen3_moe   Qwen3MoeForCausalLM   baseline MoE (softmax router, top-k, norm_topk_prob), every layer MoE
    qwen3_next  Qwen3NextForCausalLM  G1 elementwise sigmoid gate, zero-centred (1 + w) norms, partial rotary;
                                      hybrids (layer_types), shared experts with their gate; dense through
                                      mlp_only_layers = all layers; MoE with shared_expert_intermediate_size 0
                                      (see megagate.interop.hf_weights)
    qwen3_5     Qwen3_5ForCausalLM    Qwen3.5's text model (transformers 5): as qwen3_next, dense in every layer
    qwen3_5_moe Qwen3_5MoeForCausalLM Qwen3.5-MoE's text model: as qwen3_next, MoE in every layer, top-k weights
                                      always renormalised (norm_topk_prob true)
    paper       the paper's released Qwen3 code (model_type "qwen3" with `elementwise_attn_output_gate` /
                `headwise_attn_output_gate`, `use_qk_norm`, `qkv_bias`): baseline, G1 elementwise or G1 headwise
                sigmoid gates, dense only (its decoder layer builds a dense MLP), plain RMSNorm weights

Every format holds RoPE (rope_theta = model.rotary_base) with linear, llama3 or yarn scaling
(megagate.interop.hf_rope: transformers 5's `rope_parameters`, and for the formats 4.x has, its `rope_theta` /
`rope_scaling` too); only the gated formats (qwen3_next, qwen3_5, qwen3_5_moe) hold a partial rotary
(partial_rotary_factor = rotary_percent). A Qwen3.5 vision-language config.json (`text_config` + `vision_config`,
`...ForConditionalGeneration`) is read as its text model (`text_model`). Anything else (LayerNorm, other gate
variants, two RoPE scalings at once, a baseline without QK-norm outside `paper`) is refused in one line naming the
field and the formats that can hold the model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from megagate.errors import ConfigError
from megagate.interop import hf_qwen35, hf_rope
from megagate.model import gate as gates
from megagate.model import hybrid
from megagate.model.model_config import ModelConfig

FORMATS = ("qwen3", "qwen3_moe", "qwen3_next", "paper", "qwen3_5", "qwen3_5_moe")
ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "paper": "Qwen3ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
}
MODEL_TYPES = {
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3_next": "qwen3_next",
    "paper": "qwen3",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
}
# The gates each format can hold, by preset name.
FORMAT_GATES = {
    "qwen3": ("baseline",),
    "qwen3_moe": ("baseline",),
    "qwen3_next": ("g1-elementwise",),
    "paper": ("baseline", "g1-elementwise", "g1-headwise"),
    "qwen3_5": ("g1-elementwise",),
    "qwen3_5_moe": ("g1-elementwise",),
}
# Qwen3-Next and Qwen3.5: gated attention, zero-centred norms, partial rotary, Gated DeltaNet layers
GATED = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
DENSE_ONLY = ("qwen3", "paper", "qwen3_5")
MOE_ONLY = ("qwen3_moe", "qwen3_5_moe")
SHARED_EXPERT = ("qwen3_next", "qwen3_5_moe")  # formats whose MoE block has a (gated) shared expert
QWEN3_5 = ("qwen3_5", "qwen3_5_moe")
# The paper's config flags: their presence marks a model_type "qwen3" config as the paper's code.
PAPER_FLAGS = ("elementwise_attn_output_gate", "headwise_attn_output_gate", "use_qk_norm", "qkv_bias")


def gate_name(gate: gates.GateConfig) -> str | None:
    """The preset name of a gate that some format can hold (baseline, g1-elementwise, g1-headwise), else None."""
    for name in ("baseline", "g1-elementwise", "g1-headwise"):
        if gate == gates.preset(name):
            return name
    return None


def _problem(model: ModelConfig, fmt: str) -> str | None:
    """Why `fmt` cannot hold `model` exactly (one clause naming the field), or None when it can."""
    name = gate_name(model.gate)
    if name not in FORMAT_GATES[fmt]:
        variant = name or model.gate.describe()
        return f"gate variant {variant!r} cannot be held by the {fmt} format (it holds {', '.join(FORMAT_GATES[fmt])})"
    if model.is_moe and fmt in DENSE_ONLY:
        why = "dense only: the paper's code builds a dense MLP in every layer" if fmt == "paper" else "dense only"
        return f"model.num_experts={model.num_experts}: the {fmt} format is {why}"
    if not model.is_moe and fmt in MOE_ONLY:
        dense = "qwen3" if fmt == "qwen3_moe" else "qwen3_5"
        return f"model.num_experts=0: the {fmt} format holds MoE models (use {dense} for dense)"
    if model.normalization != "RMSNorm":
        return f"model.normalization={model.normalization!r}: the {fmt} format uses RMSNorm"
    if model.softmax_type != "vanilla":
        # GPT-OSS's per-head `sinks` is the Hugging Face home of a learnable sink; none of megagate's formats has one
        return f"model.softmax_type={model.softmax_type!r}: the {fmt} format has no attention sink (vanilla only)"
    if hybrid.is_hybrid(model) and fmt not in GATED:
        return f"model.layer_pattern={model.layer_pattern!r}: the {fmt} format has no Gated DeltaNet layers"
    shared = model.moe_shared_expert_intermediate_size
    if shared and fmt not in SHARED_EXPERT:
        return f"model.moe_shared_expert_intermediate_size={shared}: the {fmt} format has no shared expert"
    if shared and not model.moe_shared_expert_gate:
        return f"model.moe_shared_expert_gate=false: the {fmt} format's shared expert always has its sigmoid gate"
    if fmt == "qwen3_5_moe" and not model.moe_router_norm_topk:
        return "model.moe_router_norm_topk=false: Qwen3.5-MoE always renormalises the top-k routing weights"
    if fmt in GATED and not model.norm_zero_centered:
        return f"model.norm_zero_centered=false: the {fmt} format's norms are zero-centred (1 + w)"
    if fmt not in GATED and model.norm_zero_centered:
        return f"model.norm_zero_centered=true: the {fmt} format's norms are plain (w)"
    if not model.qk_layernorm and fmt != "paper":
        return f"model.qk_layernorm=false: the {fmt} format always has QK-norm (the paper format does not need it)"
    rope = hf_rope.problem(model)
    if rope is not None:
        return rope
    if model.rotary_percent != 1.0 and fmt not in GATED:
        return f"model.rotary_percent={model.rotary_percent!r}: the {fmt} format rotates every head dim"
    return None


def formats_for(model: ModelConfig) -> list[str]:
    """The formats that hold `model` exactly, in order of preference (the first is the default)."""
    return [fmt for fmt in FORMATS if _problem(model, fmt) is None]


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")


def check_exportable(model: ModelConfig, fmt: str) -> None:
    """One-line ConfigError naming the variant/field and the formats that can hold the model, unless `fmt` can."""
    _check_format(fmt)
    problem = _problem(model, fmt)
    if problem is not None:
        holders = ", ".join(formats_for(model)) or "none"
        raise ConfigError(f"{problem}; formats that hold this model: {holders}")


def default_format(model: ModelConfig) -> str:
    """baseline dense -> qwen3, baseline MoE -> qwen3_moe, G1 elementwise -> qwen3_next (zero-centred norms) or
    paper, G1 headwise -> paper; a ConfigError naming the reason when none holds it."""
    found = formats_for(model)
    if not found:
        check_exportable(model, "qwen3_next" if gate_name(model.gate) == "g1-elementwise" else "paper")
    return found[0]


def hf_config(model: ModelConfig, fmt: str) -> dict[str, Any]:
    """config.json content of `model` in `fmt` (every field the HF class reads, float32): transformers 5's
    `rope_parameters` and `dtype`; the formats transformers 4.x has also keep its `rope_theta` / `rope_scaling` (and
    Qwen3-Next's `partial_rotary_factor`), the same values."""
    check_exportable(model, fmt)
    layers = model.num_layers
    config: dict[str, Any] = dict(
        architectures=[ARCHITECTURES[fmt]],
        model_type=MODEL_TYPES[fmt],
        dtype="float32",
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size if model.is_moe else model.effective_ffn_hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups,
        head_dim=model.head_dim,
        hidden_act="silu",
        max_position_embeddings=model.max_sequence_length,
        initializer_range=model.init_method_std,
        rms_norm_eps=model.norm_epsilon,
        use_cache=True,
        tie_word_embeddings=model.tie_embeddings,
        rope_parameters=hf_rope.parameters(model, partial=fmt in GATED),
        attention_bias=False,
        attention_dropout=0.0,
    )
    if fmt not in QWEN3_5:  # transformers 4.x's keys (5.x reads them as rope_parameters)
        config.update(rope_theta=float(model.rotary_base), rope_scaling=hf_rope.to_hf(model))
    if fmt in QWEN3_5:
        config.update(
            layer_types=hybrid.layer_types(model), **{name: getattr(model, name) for name in hybrid.GDN_FIELDS}
        )
    if fmt == "qwen3_5_moe":
        del config["intermediate_size"]  # Qwen3.5-MoE has no dense MLP
        config.update(
            num_experts=model.num_experts,
            num_experts_per_tok=model.moe_router_topk,
            moe_intermediate_size=model.moe_ffn_hidden_size,
            # 0 without a shared expert: zero-size tensors whose output is exactly 0 (megagate.interop.hf_weights)
            shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
            output_router_logits=False,
            router_aux_loss_coef=model.moe_aux_loss_coeff,
        )
    if fmt in ("qwen3", "paper"):
        config.update(
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=layers,
            layer_types=["full_attention"] * layers,
        )
    if fmt == "paper":
        name = gate_name(model.gate)
        config.update(
            use_qk_norm=model.qk_layernorm,
            qkv_bias=False,
            elementwise_attn_output_gate=name == "g1-elementwise",
            headwise_attn_output_gate=name == "g1-headwise",
        )
    moe = dict(
        decoder_sparse_step=1,
        num_experts=model.num_experts,
        num_experts_per_tok=model.moe_router_topk,
        moe_intermediate_size=model.moe_ffn_hidden_size,
        norm_topk_prob=model.moe_router_norm_topk,
        output_router_logits=False,
        router_aux_loss_coef=model.moe_aux_loss_coeff,
        mlp_only_layers=[],
    )
    if fmt == "qwen3_moe":
        config.update(moe, use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    if fmt == "qwen3_next":
        config.update(moe)
        if not model.is_moe:  # every layer a dense MLP of intermediate_size
            config.update(
                num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, mlp_only_layers=list(range(layers))
            )
        config.update(
            # 0 without a shared expert: zero-size tensors whose output is exactly 0 (megagate.interop.hf_weights)
            shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
            partial_rotary_factor=model.rotary_percent,
            layer_types=hybrid.layer_types(model),
            # Gated DeltaNet sizes (the model's fields: transformers' defaults unless set)
            **{name: getattr(model, name) for name in hybrid.GDN_FIELDS},
        )
    return config


# --- config.json -> ModelConfig ------------------------------------------------------------------------------------
def _detect_format(config: Mapping[str, Any]) -> str:
    model_type = config.get("model_type")
    text_formats = {MODEL_TYPES[fmt]: fmt for fmt in QWEN3_5}
    if model_type == "qwen3":
        fmt = "paper" if any(flag in config for flag in PAPER_FLAGS) else "qwen3"
    elif model_type in ("qwen3_moe", "qwen3_next"):
        fmt = model_type
    elif model_type in text_formats:
        fmt = text_formats[model_type]
    else:
        raise ConfigError(
            f"config.json model_type={model_type!r} is not one megagate reads (qwen3, qwen3_moe, qwen3_next, "
            "qwen3_5(_moe)(_text), and the paper's qwen3 with attn_output_gate flags)"
        )
    architectures = config.get("architectures") or [ARCHITECTURES[fmt]]
    if list(architectures) != [ARCHITECTURES[fmt]]:
        raise ConfigError(f"config.json architectures={architectures!r}: {fmt} needs [{ARCHITECTURES[fmt]!r}]")
    return fmt


def _required(config: Mapping[str, Any], key: str) -> Any:
    if key not in config:
        raise ConfigError(f"config.json has no {key!r} (needed to build the model)")
    return config[key]


def _positive_int(config: Mapping[str, Any], key: str) -> int:
    value = _required(config, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.json {key}={value!r} must be a positive integer")
    return value


def _positive_float(config: Mapping[str, Any], key: str, default: float | None = None) -> float:
    value = _required(config, key) if default is None else config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"config.json {key}={value!r} must be a positive number")
    return float(value)


def _refuse(config: Mapping[str, Any], key: str, allowed: Any, why: str) -> None:
    value = config.get(key, allowed)
    if value != allowed:
        raise ConfigError(f"config.json {key}={value!r} cannot be held by megagate ({why}; allowed: {allowed!r})")


def _int_theta(theta: Any) -> int:
    if (
        isinstance(theta, bool)
        or not isinstance(theta, (int, float))
        or not math.isfinite(theta)
        or theta != int(theta)
    ):
        raise ConfigError(f"config.json rope_theta={theta!r} must be an integer value (megagate's rotary_base)")
    return int(theta)


def _num_experts(config: Mapping[str, Any]) -> int:
    """config.json's expert count: `num_experts`, or `num_local_experts` (what transformers 5 writes for Qwen3-MoE,
    its attribute_map's name for num_experts); both present must agree."""
    names = [key for key in ("num_experts", "num_local_experts") if config.get(key) is not None]
    values = {int(config[key]) for key in names}
    if len(values) > 1:
        raise ConfigError(f"config.json num_experts={config['num_experts']!r} and num_local_experts disagree")
    return values.pop() if values else 0


def _layer_pattern(config: Mapping[str, Any], fmt: str, layers: int) -> str:
    """The layer pattern of config.json's `layer_types` (Qwen3-Next without one: its `full_attention_interval`,
    default 4, as transformers reads it); Gated DeltaNet layers only in the gated formats."""
    if "layer_types" in config:
        pattern = hybrid.pattern_from_layer_types(list(config["layer_types"]))
        if len(pattern) != layers:
            raise ConfigError(f"config.json layer_types has {len(pattern)} entries, num_hidden_layers is {layers}")
    elif fmt in GATED:
        pattern = hybrid.interval_pattern(layers, int(config.get("full_attention_interval", 4)))
    else:
        pattern = hybrid.ATTENTION * layers
    if hybrid.GDN in pattern and fmt not in GATED:
        raise ConfigError(f"config.json layer_types has ['linear_attention']: the {fmt} format has no such layers")
    return pattern


def model_config_from_hf(config: Mapping[str, Any]) -> tuple[ModelConfig, str]:
    """The megagate ModelConfig of a config.json, and its format; a one-line ConfigError for what megagate cannot
    hold exactly. Dense models get match_baseline_params=False (intermediate_size is the FFN width built). A Qwen3.5
    vision-language config.json is read as its text model (megagate.interop.hf_qwen35)."""
    if hf_qwen35.is_vision_language(config):
        config = hf_qwen35.text_model(config)
    fmt = _detect_format(config)
    rope = hf_rope.legacy_view(config, ignore=hf_rope.MROPE_KEYS if fmt in QWEN3_5 else ())
    partial = rope.get("partial_rotary_factor", 0.25 if fmt in GATED else 1.0)
    if fmt not in GATED and partial != 1.0:
        raise ConfigError(f"config.json partial_rotary_factor={partial!r}: the {fmt} format rotates every head dim")
    layers = _positive_int(config, "num_hidden_layers")
    _refuse(config, "hidden_act", "silu", "SwiGLU with SiLU only")
    _refuse(config, "attention_bias", False, "no biases")
    _refuse(config, "qkv_bias", False, "no biases")
    _refuse(config, "use_sliding_window", False, "full attention only")
    _refuse(config, "attention_dropout", 0.0, "no attention dropout")
    pattern = _layer_pattern(config, fmt, layers)
    values: dict[str, Any] = dict(
        num_layers=layers,
        hidden_size=_positive_int(config, "hidden_size"),
        num_attention_heads=_positive_int(config, "num_attention_heads"),
        num_query_groups=_positive_int(config, "num_key_value_heads"),
        head_dim=_positive_int(config, "head_dim"),
        ffn_hidden_size=_positive_int(config, "moe_intermediate_size" if fmt == "qwen3_5_moe" else "intermediate_size"),
        vocab_size=_positive_int(config, "vocab_size"),
        max_sequence_length=_positive_int(config, "max_position_embeddings"),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_layernorm=True,
        normalization="RMSNorm",
        rotary_base=_int_theta(_required(rope, "rope_theta")),
        norm_epsilon=_positive_float(config, "rms_norm_eps"),
        init_method_std=_positive_float(config, "initializer_range", 0.02),
        match_baseline_params=False,
        gate=gates.preset("baseline"),
        **hf_rope.from_hf(rope, name=hf_rope.source(config)),
    )
    if fmt == "paper":
        elementwise = bool(config.get("elementwise_attn_output_gate", False))
        headwise = bool(config.get("headwise_attn_output_gate", False))
        # the paper's code checks headwise first: both set means headwise; refuse the ambiguity instead
        if elementwise and headwise:
            raise ConfigError("config.json sets both elementwise_ and headwise_attn_output_gate: choose one")
        values["qk_layernorm"] = bool(config.get("use_qk_norm", True))
        if elementwise or headwise:
            values["gate"] = gates.preset("g1-elementwise" if elementwise else "g1-headwise")
    if fmt in GATED:
        if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
            raise ConfigError(f"config.json partial_rotary_factor={partial!r} must be a number in (0, 1]")
        values.update(gate=gates.preset("g1-elementwise"), norm_zero_centered=True, rotary_percent=float(partial))
        if hybrid.GDN in pattern:
            values["layer_pattern"] = pattern
            values.update({name: int(_required(config, name)) for name in hybrid.GDN_FIELDS})
    if fmt in ("qwen3_moe", "qwen3_next"):
        experts = _num_experts(config)
        mlp_only = list(config.get("mlp_only_layers") or [])
        dense = experts == 0 or (fmt == "qwen3_next" and mlp_only == list(range(layers)))
        if fmt == "qwen3_moe" and dense:
            raise ConfigError("config.json num_experts=0: a qwen3_moe config without experts (use qwen3 for dense)")
        if not dense:
            _refuse(config, "decoder_sparse_step", 1, "every layer MoE")
            if mlp_only:
                raise ConfigError(
                    f"config.json mlp_only_layers={mlp_only!r}: megagate's MoE models are MoE in every layer"
                )
            values.update(
                num_experts=experts,
                moe_router_topk=_required(config, "num_experts_per_tok"),
                moe_ffn_hidden_size=_required(config, "moe_intermediate_size"),
                moe_router_norm_topk=bool(config.get("norm_topk_prob", fmt == "qwen3_next")),
                moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 1e-3)),
            )
            shared = int(config.get("shared_expert_intermediate_size", 0) or 0) if fmt == "qwen3_next" else 0
            if shared:  # Qwen3-Next's shared expert always has its sigmoid gate
                values.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    if fmt == "qwen3_5_moe":  # every layer MoE with a gated shared expert; the top-k weights always renormalised
        values.update(
            num_experts=_positive_int(config, "num_experts"),
            moe_router_topk=_positive_int(config, "num_experts_per_tok"),
            moe_ffn_hidden_size=_positive_int(config, "moe_intermediate_size"),
            moe_router_norm_topk=True,
            moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 1e-3)),
        )
        shared = _required(config, "shared_expert_intermediate_size")
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ConfigError(f"config.json shared_expert_intermediate_size={shared!r} must be an integer >= 0")
        if shared:
            values.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    model = ModelConfig(**values)
    check_exportable(model, fmt)
    return model, fmt


def same_architecture(a: ModelConfig, b: ModelConfig) -> bool:
    """Whether two ModelConfigs build the same model (dense FFN compared as built, training-only fields ignored)."""
    ignore = {
        "match_baseline_params",
        "ffn_multiple",
        "ffn_hidden_size",
        "init_method_std",
        "moe_aux_loss_coeff",
        "moe_z_loss_coeff",
        "moe_load_balancing",
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
    }
    fields = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ignore]
    # a MoE model builds no dense MLP: its dense width (absent from a Qwen3.5-MoE config.json) does not count
    return all(getattr(a, f) == getattr(b, f) for f in fields) and (
        a.is_moe or a.effective_ffn_hidden_size == b.effective_ffn_hidden_size
    )
