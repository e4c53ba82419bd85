"""Position-embedding arithmetic of a `ModelConfig`: how much each rotary frequency is slowed down by the scalings
in force, and from that the longest sequence the position embedding is honestly set up for (`context_length`).

Pure float64 arithmetic on the published formulas (the same ones megatron's and transformers' modules compute in
float32); no torch, no megatron. `model` is any object with ModelConfig's position fields.

The reach. RoPE rotates dim pair i by θ_i per position (θ_i = base^(-2i/d) over the d rotated dims), one turn every
λ_i = 2π/θ_i tokens. A model that saw unscaled positions up to S has seen every angle of the dims with λ_i <= S (a
full turn), but only angles up to S·θ_i of the slower ones. A scaling divides θ_i by s_i (the dim's slow-down:
linear interpolation s for every dim, Llama-3 s only below its low-frequency band, YaRN s only for dims that rotate
fewer than beta_slow times over its original context), so the slow dims keep to seen angles up to S·s_i tokens:

    reach = min over dims with λ_i > S of S·s_i        context_length = max(max_sequence_length, reach)

S is the context the scaling starts from: the scaling's own original context (yarn_original_max_position_embeddings,
rope_scaling_original_max_position_embeddings), but never more than max_sequence_length, the length the model is
declared for; S = max_sequence_length for plain RoPE and linear interpolation. So YaRN by s from its original L
reaches s·L; Llama-3 scaling by s from 8192 on a model declared for 128 tokens reaches 128 (the dims that turn less
than once in 128 tokens but more than once in 2048 are not slowed at all); from 128 it reaches s·128.
"""

from __future__ import annotations

import math
from typing import Any

# The Llama-3 scaling defaults of megatron's RotaryEmbedding._apply_scaling (Llama 3.1's own values).
LLAMA3_DEFAULTS = dict(
    rope_scaling_low_freq_factor=1.0,
    rope_scaling_high_freq_factor=4.0,
    rope_scaling_original_max_position_embeddings=8192,
)


def rotated_dims(model: Any) -> int:
    """The head dims that rotate (megatron: int(kv_channels * rotary_percent))."""
    return int(model.head_dim * model.rotary_percent)


def inv_freq(base: float, dim: int) -> list[float]:
    """θ_i = base^(-2i/dim), i = 0 .. dim/2 - 1."""
    return [base ** (-2 * i / dim) for i in range(dim // 2)]


def yarn_ramp(model: Any) -> list[float]:
    """YaRN's interpolation weight per dim pair (0: keep θ_i, 1: θ_i / yarn_factor), a linear ramp over the dim
    index between the dims that turn yarn_beta_fast and yarn_beta_slow times over the original context."""
    dim, base, original = rotated_dims(model), model.rotary_base, model.yarn_original_length

    def dim_of(turns: float) -> float:
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(model.yarn_beta_fast), dim_of(model.yarn_beta_slow)
    if model.yarn_correction_range_round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference code's guard against a zero-width ramp
    return [min(max((i - low) / (high - low), 0.0), 1.0) for i in range(dim // 2)]


def _partial(weight: float, factor: float) -> float:
    """Slow-down of θ' = (1 - w)·θ + w·θ/factor."""
    return factor if weight >= 1 else 1.0 / ((1 - weight) + weight / factor)


def slowdowns(model: Any) -> list[float]:
    """s_i = θ_i / θ'_i per rotated dim pair under the model's scalings (1.0 everywhere for plain RoPE)."""
    theta = inv_freq(model.rotary_base, rotated_dims(model))
    if model.position_embedding == "yarn":
        return [_partial(w, model.yarn_factor) for w in yarn_ramp(model)]
    out = [model.rotary_interpolation_factor or 1.0] * len(theta)
    if model.rope_scaling:
        factor, original = model.rope_scaling_factor, model.rope_scaling_original_max_position_embeddings
        low, high = model.rope_scaling_low_freq_factor, model.rope_scaling_high_freq_factor
        for i, t in enumerate(theta):
            wavelength = 2 * math.pi / t
            if wavelength > original / low:
                out[i] *= factor
            elif wavelength >= original / high:  # the smoothed band between the two wavelengths
                smooth = (original / wavelength - low) / (high - low)
                out[i] *= _partial(1 - smooth, factor)
    return out


def seen_length(model: Any) -> int:
    """S: the context whose unscaled angles the scaling assumes the model has seen (see the module docstring)."""
    if model.position_embedding == "yarn":
        return min(model.max_sequence_length, model.yarn_original_length)
    if model.rope_scaling:
        return min(model.max_sequence_length, model.rope_scaling_original_max_position_embeddings)
    return model.max_sequence_length


def context_length(model: Any) -> int:
    """The longest sequence the position embedding is set up for: max_sequence_length, or the scalings' reach."""
    seen = seen_length(model)
    theta = inv_freq(model.rotary_base, rotated_dims(model))
    slow = slowdowns(model)
    limiting = [s for t, s in zip(theta, slow) if 2 * math.pi / t > seen]
    reach = seen * min(limiting or slow)
    return max(model.max_sequence_length, int(reach + 1e-6))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's sqrt(1/t) = 0.1·mscale·ln(s) + 1 (1 for s <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """The factor megatron multiplies YaRN's cos and sin by (q and k alike): mscale(s, mscale) / mscale(s, all_dim),
    in the operation order of megatron's `_yarn_get_concentration_factor` (the same float)."""
    return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))


def describe(model: Any) -> str:
    """The position embedding in a few words, e.g. 'YaRN x4 from 64', 'Llama-3 scaling x8 from 8192'."""
    parts = []
    if model.position_embedding == "yarn":
        parts.append(f"YaRN x{model.yarn_factor:g} from {model.yarn_original_length}")
    else:
        if model.rope_scaling:
            original = model.rope_scaling_original_max_position_embeddings
            parts.append(f"Llama-3 scaling x{model.rope_scaling_factor:g} from {original}")
        if model.rotary_interpolation_factor is not None:
            parts.append(f"linear interpolation x{model.rotary_interpolation_factor:g}")
    return " + ".join(parts) or "RoPE"
