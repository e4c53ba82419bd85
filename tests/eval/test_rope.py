"""Position-embedding settings of ModelConfig → the rotary tables megatron's modules produce, against an independent
implementation of the published formulas (RoPE: Su et al. 2021; linear position interpolation: Chen et al. 2023;
YaRN: Peng et al. 2023) and against megatron's own modules built directly with its defaults."""

from __future__ import annotations

import math

import pytest
import torch

from megagate.errors import ConfigError
from megagate.model.build import build_gpt_model, transformer_config
from megagate.model.presets import model_preset

SEQ = 96


def _model(megatron_world, **fields):
    m = model_preset("tiny", **fields)
    return m, build_gpt_model(m, transformer_config(m, use_cpu=True))


def _angles(module, seq: int) -> torch.Tensor:
    """The rotation angles [seq, rotated dims] megatron feeds apply_rotary_pos_emb (and its mscale, for YaRN)."""
    out = module(seq)
    emb, mscale = out if isinstance(out, tuple) else (out, 1.0)
    return emb[:, 0, 0, :].double(), float(mscale)


# --- the published formulas, written from the papers -----------------------------------------------------------
def rope_inv_freq(base: float, dim: int) -> torch.Tensor:
    """θ_i = base^(-2i/d), i = 0 .. d/2-1."""
    i = torch.arange(dim // 2, dtype=torch.float64)
    return base ** (-2 * i / dim)


def yarn_inv_freq(base: float, dim: int, s: float, original: int, alpha: float, beta: float, rounded: bool):
    """YaRN's NTK-by-parts frequencies. r_i = L / λ_i with wavelength λ_i = 2π/θ_i: dims that rotate more than β
    times over the original context L keep θ_i, dims that rotate fewer than α times are interpolated (θ_i / s),
    and a linear ramp in between. The dim where r = n is d(n) = d·ln(L / (2πn)) / (2 ln base); the ramp runs
    linearly over the dimension index from d(β) to d(α) (the reference implementation of the paper's authors,
    optionally with floor/ceil of the two ends)."""
    theta = rope_inv_freq(base, dim)

    def d_of(n: float) -> float:
        return dim * math.log(original / (2 * math.pi * n)) / (2 * math.log(base))

    low, high = d_of(beta), d_of(alpha)
    if rounded:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    i = torch.arange(dim // 2, dtype=torch.float64)
    ramp = ((i - low) / (high - low)).clamp(0, 1)  # 0: keep θ (fast dims), 1: interpolate θ/s (slow dims)
    return theta * (1 - ramp) + theta / s * ramp


def yarn_attention_factor(s: float) -> float:
    """sqrt(1/t) = 0.1 ln(s) + 1 (applied to q and k alike, so the logits scale by 1/t)."""
    return 0.1 * math.log(s) + 1.0 if s > 1 else 1.0


def _table(inv_freq: torch.Tensor, seq: int, positions_scale: float = 1.0) -> torch.Tensor:
    pos = torch.arange(seq, dtype=torch.float64) * positions_scale
    freqs = torch.outer(pos, inv_freq)
    return torch.cat([freqs, freqs], dim=-1)  # megatron's non-interleaved layout: [θ_0..θ_{d/2-1}] twice


# --- tests -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("base", [10_000, 1_000_000])
def test_rope_base_matches_formula_and_megatron_default(megatron_world, base):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    m, gpt = _model(megatron_world, rotary_base=base)
    ours, mscale = _angles(gpt.rotary_pos_emb, SEQ)
    expected = _table(rope_inv_freq(base, m.head_dim), SEQ)
    assert mscale == 1.0
    torch.testing.assert_close(ours.cos(), expected.cos(), rtol=0, atol=2e-6)
    torch.testing.assert_close(ours.sin(), expected.sin(), rtol=0, atol=2e-6)
    direct = RotaryEmbedding(kv_channels=m.head_dim, rotary_percent=1.0, rotary_base=base, use_cpu_initialization=True)
    assert torch.equal(gpt.rotary_pos_emb(SEQ), direct(SEQ))
    # a raised base slows every rotation but the first: the last dim turns ~base^(-(d-2)/d) per position
    assert float(ours[1, m.head_dim // 2 - 1]) == pytest.approx(base ** (-(m.head_dim - 2) / m.head_dim), rel=1e-6)


def test_rotary_percent_and_linear_interpolation(megatron_world):
    m, gpt = _model(megatron_world, rotary_percent=0.5, rotary_interpolation_factor=4.0, rotary_base=10_000)
    ours, _ = _angles(gpt.rotary_pos_emb, SEQ)
    assert ours.shape == (SEQ, m.head_dim // 2)  # half the dims rotate
    expected = _table(rope_inv_freq(10_000, m.head_dim // 2), SEQ, positions_scale=1 / 4)  # positions / 4
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    assert m.context_length == 4 * m.max_sequence_length


@pytest.mark.parametrize(
    "fields",
    [
        dict(yarn_factor=4.0, yarn_original_max_position_embeddings=1024),  # megatron's betas and mscale
        dict(yarn_factor=8.0, yarn_original_max_position_embeddings=512, yarn_beta_fast=16.0, yarn_beta_slow=2.0),
        dict(yarn_factor=4.0, yarn_original_max_position_embeddings=1024, yarn_correction_range_round_to_int=False),
    ],
)
def test_yarn_matches_paper_formulas_and_megatron_default(megatron_world, fields):
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    m, gpt = _model(megatron_world, position_embedding="yarn", rotary_base=10_000, **fields)
    s, original = fields["yarn_factor"], fields["yarn_original_max_position_embeddings"]
    ours, mscale = _angles(gpt.rotary_pos_emb, SEQ)
    inv = yarn_inv_freq(
        10_000, m.head_dim, s, original, m.yarn_beta_slow, m.yarn_beta_fast, m.yarn_correction_range_round_to_int
    )
    expected = _table(inv, SEQ)
    torch.testing.assert_close(ours, expected, rtol=2e-6, atol=1e-6)
    assert mscale == pytest.approx(yarn_attention_factor(s), rel=1e-12)
    # the paper's two regions, pointwise: r = L/λ above β_fast keeps θ, below β_slow is θ/s
    theta = rope_inv_freq(10_000, m.head_dim)
    r = original * theta / (2 * math.pi)
    got = ours[1, : m.head_dim // 2]
    fast, slow = r > m.yarn_beta_fast, r < m.yarn_beta_slow
    assert fast.any() and slow.any()
    torch.testing.assert_close(got[fast], theta[fast], rtol=2e-6, atol=0)
    torch.testing.assert_close(got[slow], theta[slow] / s, rtol=2e-6, atol=0)
    # every attention layer scales q and k by the same factor (logits by its square, the paper's 1/t)
    for layer in gpt.decoder.layers:
        assert layer.self_attention._yarn_concentration_factor == pytest.approx(yarn_attention_factor(s))
    # megatron's module built directly with its own defaults for the rest gives the same table
    direct = YarnRotaryEmbedding(
        kv_channels=m.head_dim,
        rotary_base=10_000,
        scaling_factor=s,
        original_max_position_embeddings=original,
        use_cpu_initialization=True,
        **{k[len("yarn_") :]: v for k, v in fields.items() if k.startswith("yarn_beta") or "round" in k},
    )
    d_emb, d_mscale = direct(SEQ)
    assert torch.equal(d_emb, gpt.rotary_pos_emb(SEQ)[0]) and d_mscale == mscale


def test_rope_model_has_no_yarn_factor(megatron_world):
    _, gpt = _model(megatron_world)
    for layer in gpt.decoder.layers:
        assert layer.self_attention._yarn_concentration_factor == 1.0


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(position_embedding="alibi"), "position_embedding='alibi'"),
        (dict(yarn_factor=4.0), "yarn_factor is a YaRN setting"),
        (dict(position_embedding="yarn", rotary_percent=0.5), "rotary_percent=0.5"),
        (dict(position_embedding="yarn", yarn_factor=0.5), "yarn_factor=0.5"),
        (dict(position_embedding="yarn", yarn_beta_fast=1.0, yarn_beta_slow=2.0), "beta_slow"),
        (dict(rotary_percent=0.1), "rotary_percent=0.1"),
        (dict(rotary_interpolation_factor=0.5), "rotary_interpolation_factor=0.5"),
    ],
)
def test_bad_position_settings_are_one_line(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        model_preset("tiny", **fields)


def test_position_fields_stay_out_of_resume_checks():
    from megagate.checkpoint.naming import ARCHITECTURE_FIELDS
    from megagate.model.model_config import POSITION_FIELDS

    assert not set(POSITION_FIELDS) & set(ARCHITECTURE_FIELDS)
    assert "max_sequence_length" not in ARCHITECTURE_FIELDS


def test_training_with_yarn_and_a_raised_base(tmp_path, session_demo_dir):
    """The position fields are training settings too: a YaRN model with base 1M trains (megatron's YaRN path in the
    trainer), and its checkpoint records them for `megagate eval`."""
    import json

    from helpers import tiny_runs as T

    T.run_train(
        tmp_path,
        session_demo_dir,
        "train.train_steps=3",
        "model.position_embedding=yarn",
        "model.yarn_factor=2",
        "model.yarn_original_max_position_embeddings=64",
        "model.rotary_base=1000000",
    )
    curve = T.losses(tmp_path)
    assert sorted(curve) == [1, 2, 3] and all(math.isfinite(v) for v in curve.values())
    assert curve[3] < curve[1]
    meta = json.loads((tmp_path / "checkpoints" / "iter_0000003" / "megagate.json").read_text())
    assert meta["config"]["model"]["position_embedding"] == "yarn" and meta["config"]["model"]["yarn_factor"] == 2
