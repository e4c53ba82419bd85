"""RoPE scaling between a megagate ModelConfig and a Hugging Face config.json's `rope_scaling`, both ways.

transformers computes a model's rotary table with `ROPE_INIT_FUNCTIONS[rope_type]`, in every class megagate exports
to (Qwen3, Qwen3-MoE, Qwen3-Next, Qwen3.5; the paper's code is Qwen3's). transformers 5 holds the settings in one
`rope_parameters` object (`rope_type`, `rope_theta`, `partial_rotary_factor` and the scaling's keys), 4.x in the
top-level `rope_scaling`, `rope_theta` and `partial_rotary_factor`; 5.x reads both. `parameters` writes the 5.x
object, `legacy_view` reads either (both present must agree) as the 4.x keys, which `from_hf` converts. Qwen3.5's
`mrope_section` / `mrope_interleaved` (multimodal RoPE) are ignored: with text positions its three position rows are
equal and the table is the 1-D RoPE of the same dims. The types megatron can build, and their megagate fields:

    linear   factor                                   rotary_interpolation_factor (positions / f = θ / f)
    llama3   factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
                                                      rope_scaling=true, rope_scaling_factor, rope_scaling_*
    yarn     factor, original_max_position_embeddings, beta_fast, beta_slow, truncate, and the attention factor
                                                      position_embedding=yarn, yarn_*

Partial rotary (Qwen3-Next's partial_rotary_factor) applies to all three, as in megatron (megagate.model.rotary).

The YaRN attention factor. megatron computes (0.1·mscale·ln s + 1) / (0.1·mscale_all_dim·ln s + 1); transformers
computes the same only when both mscale and mscale_all_dim are non-zero, and otherwise ignores them (0.1·ln s + 1),
unless an explicit `attention_factor` is given, which it uses as is. So an export writes nothing for megagate's
defaults (mscale 1, mscale_all_dim 0: both give 0.1·ln s + 1), mscale and mscale_all_dim when both are non-zero
(the definitions agree), and otherwise the explicit `attention_factor` megatron computes: the exact number the
model multiplies cos and sin by, where writing `mscale` alone would silently change the model (HF would ignore it).
An import takes what transformers computes: an `attention_factor` becomes the mscale (with mscale_all_dim 0) whose
megatron factor is exactly that number; a lone `mscale` or `mscale_all_dim` is dropped, as transformers drops it.

Refused in one line: linear interpolation and Llama-3 scaling together (a config holds one rope_scaling), other
rope types (dynamic, longrope: megatron has no such module), unknown keys, an attention factor with factor 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from megagate.errors import ConfigError
from megagate.model import position
from megagate.model.model_config import ModelConfig

# The keys of each rope_type megagate reads (besides rope_type / its old name type).
KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "truncate",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
    ),
}


def problem(model: ModelConfig) -> str | None:
    """Why no HF rope_scaling holds `model`'s position embedding (one clause naming the field), or None."""
    if model.position_embedding == "rope" and model.rope_scaling and model.rotary_interpolation_factor is not None:
        return (
            f"model.rotary_interpolation_factor={model.rotary_interpolation_factor!r} with model.rope_scaling=true: "
            "an HF config holds one RoPE scaling (rope_scaling linear or llama3, not both)"
        )
    return None


def to_hf(model: ModelConfig) -> dict[str, Any] | None:
    """config.json's `rope_scaling` for `model` (None: plain RoPE); see the module docstring."""
    if problem(model) is not None:
        raise ConfigError(problem(model))
    if model.position_embedding == "yarn":
        out: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": float(model.yarn_factor),
            "original_max_position_embeddings": model.yarn_original_length,
        }
        if model.yarn_beta_fast != 32.0 or model.yarn_beta_slow != 1.0:
            out.update(beta_fast=float(model.yarn_beta_fast), beta_slow=float(model.yarn_beta_slow))
        if not model.yarn_correction_range_round_to_int:
            out["truncate"] = False
        mscale, all_dim = model.yarn_mscale, model.yarn_mscale_all_dim
        if (mscale, all_dim) == (1.0, 0.0):
            pass  # transformers' default: 0.1 ln s + 1, as megatron's
        elif mscale and all_dim:
            out.update(mscale=float(mscale), mscale_all_dim=float(all_dim))
        else:
            out["attention_factor"] = position.yarn_attention_factor(model.yarn_factor, mscale, all_dim)
        return out
    if model.rope_scaling:
        return {
            "rope_type": "llama3",
            "factor": float(model.rope_scaling_factor),
            "low_freq_factor": float(model.rope_scaling_low_freq_factor),
            "high_freq_factor": float(model.rope_scaling_high_freq_factor),
            "original_max_position_embeddings": model.rope_scaling_original_max_position_embeddings,
        }
    if model.rotary_interpolation_factor is not None:
        return {"rope_type": "linear", "factor": float(model.rotary_interpolation_factor)}
    return None


LEGACY_KEYS = ("rope_scaling", "rope_theta", "partial_rotary_factor")
MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def parameters(model: ModelConfig, partial: bool) -> dict[str, Any]:
    """transformers 5's `rope_parameters` of `model` (with `partial_rotary_factor` for formats that hold one)."""
    out: dict[str, Any] = {**(to_hf(model) or {"rope_type": "default"}), "rope_theta": float(model.rotary_base)}
    if partial:
        out["partial_rotary_factor"] = model.rotary_percent
    return out


def legacy_view(config: Mapping[str, Any], ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    """config.json's RoPE settings as the 4.x keys (`rope_scaling`, `rope_theta`, `partial_rotary_factor`, those
    present), read from transformers 5's `rope_parameters` or the 4.x keys; both present must agree. `ignore`: keys
    of `rope_parameters` that do not change the table (Qwen3.5's mrope keys)."""
    legacy = {key: config[key] for key in LEGACY_KEYS if key in config}
    params = config.get("rope_parameters")
    if params is None:
        return legacy
    if not isinstance(params, Mapping):
        raise ConfigError(f"config.json rope_parameters={params!r} must be an object or null")
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ConfigError("config.json rope_parameters holds one per layer type: megagate builds one RoPE for all")
    params = {k: v for k, v in params.items() if k not in ignore}
    view = {key: params.pop(key) for key in ("rope_theta", "partial_rotary_factor") if key in params}
    kind = params.get("rope_type", params.get("type", "default"))
    view["rope_scaling"] = None if kind == "default" and set(params) <= {"rope_type", "type"} else params
    for key, value in legacy.items():
        if value is not None and key in view and value != view[key]:
            raise ConfigError(f"config.json {key}={value!r} and rope_parameters ({view[key]!r}) disagree")
    return {**legacy, **view}


def _number(scaling: Mapping[str, Any], key: str, *, integer: bool = False, minimum: float | None = None) -> Any:
    value = scaling[key]
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
        raise ConfigError(f"config.json rope_scaling.{key}={value!r} must be {'an integer' if integer else 'a number'}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"config.json rope_scaling.{key}={value!r} must be >= {minimum:g}")
    return value


def _required(scaling: Mapping[str, Any], key: str, rope_type: str) -> None:
    if scaling.get(key) is None:
        raise ConfigError(f"config.json rope_scaling has no {key!r} (rope_type {rope_type} needs it)")


def source(config: Mapping[str, Any]) -> str:
    """Where config.json holds its RoPE scaling: transformers 5's `rope_parameters` or 4.x's `rope_scaling`."""
    return "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"


def from_hf(config: Mapping[str, Any], name: str = "rope_scaling") -> dict[str, Any]:
    """The ModelConfig position fields of config.json's `rope_scaling` ({} for none / "default"); `name`: the key
    the messages name (`rope_parameters` for a `legacy_view` of a 5.x config)."""
    try:
        return _from_hf(config)
    except ConfigError as exc:
        if name == "rope_scaling":
            raise
        raise ConfigError(str(exc).replace("config.json rope_scaling", f"config.json {name}")) from None


def _from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    scaling = config.get("rope_scaling")
    if scaling is None:
        return {}
    if not isinstance(scaling, Mapping):
        raise ConfigError(f"config.json rope_scaling={scaling!r} must be an object or null")
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type not in KEYS:
        raise ConfigError(
            f"config.json rope_scaling.rope_type={rope_type!r} cannot be held by megagate (megatron builds "
            f"{', '.join(KEYS)})"
        )
    unknown = sorted(set(scaling) - {"rope_type", "type", *KEYS[rope_type]})
    if unknown:
        raise ConfigError(
            f"config.json rope_scaling.{unknown[0]} is not a {rope_type} setting megagate reads "
            f"({', '.join(KEYS[rope_type]) or 'none'})"
        )
    if rope_type == "default":
        return {}
    _required(scaling, "factor", rope_type)
    factor = float(_number(scaling, "factor", minimum=1))
    if rope_type == "linear":
        return {"rotary_interpolation_factor": factor}
    if rope_type == "llama3":
        for key in KEYS["llama3"]:
            _required(scaling, key, rope_type)
        return {
            "rope_scaling": True,
            "rope_scaling_factor": factor,
            "rope_scaling_low_freq_factor": float(_number(scaling, "low_freq_factor")),
            "rope_scaling_high_freq_factor": float(_number(scaling, "high_freq_factor")),
            "rope_scaling_original_max_position_embeddings": _number(
                scaling, "original_max_position_embeddings", integer=True, minimum=1
            ),
        }
    out: dict[str, Any] = {"position_embedding": "yarn", "yarn_factor": factor}
    if scaling.get("original_max_position_embeddings") is not None:
        original = _number(scaling, "original_max_position_embeddings", integer=True, minimum=1)
        out["yarn_original_max_position_embeddings"] = original
    # transformers reads `get(key) or default`: a null or zero beta is its default
    out["yarn_beta_fast"] = float(_number(scaling, "beta_fast") if scaling.get("beta_fast") else 32.0)
    out["yarn_beta_slow"] = float(_number(scaling, "beta_slow") if scaling.get("beta_slow") else 1.0)
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"config.json rope_scaling.truncate={truncate!r} must be true or false")
    out["yarn_correction_range_round_to_int"] = truncate
    out.update(_yarn_mscale_fields(scaling, factor))
    return out


def _yarn_mscale_fields(scaling: Mapping[str, Any], factor: float) -> dict[str, float]:
    """megagate's (yarn_mscale, yarn_mscale_all_dim) giving exactly transformers' YaRN attention factor."""
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if scaling.get("attention_factor") is None:
        if mscale and all_dim:  # the one case transformers uses them: the same formula as megatron's
            return {
                "yarn_mscale": float(_number(scaling, "mscale")),
                "yarn_mscale_all_dim": float(_number(scaling, "mscale_all_dim")),
            }
        return {"yarn_mscale": 1.0, "yarn_mscale_all_dim": 0.0}  # 0.1 ln s + 1 (a lone mscale is ignored)
    target = float(_number(scaling, "attention_factor"))
    if target <= 0:
        raise ConfigError(f"config.json rope_scaling.attention_factor={target!r} must be > 0")
    if position.yarn_attention_factor(factor, 1.0, 0.0) == target:
        return {"yarn_mscale": 1.0, "yarn_mscale_all_dim": 0.0}
    if factor <= 1:
        raise ConfigError(
            f"config.json rope_scaling.attention_factor={target!r} with factor {factor!r}: megatron's YaRN factor is "
            "1 without scaling (factor > 1 needed)"
        )
    # megatron's factor with mscale_all_dim 0 is 0.1·m·ln(s) + 1: solve for m, then step to the neighbouring float
    # that reproduces the target exactly (the division and the rounding of the formula can be an ulp off)
    solved = (target - 1.0) / (0.1 * math.log(factor))
    best = solved
    for direction in (math.inf, -math.inf):
        m = solved
        for _ in range(8):
            if position.yarn_attention_factor(factor, m, 0.0) == target:
                return {"yarn_mscale": m, "yarn_mscale_all_dim": 0.0}
            m = math.nextafter(m, direction)
    return {"yarn_mscale": best, "yarn_mscale_all_dim": 0.0}
