"""Position-embedding settings of ModelConfig → the rotary tables megatron's modules produce, against an independent
implementation of the published formulas (RoPE: Su et al. 2021; linear position interpolation: Chen et al. 2023;
YaRN: Peng et al. 2023), against megatron's own modules built directly with its defaults, and against transformers'
`ROPE_INIT_FUNCTIONS` (Llama-3 scaling from any original context, YaRN over a partial rotary); and the reach
(`context_length`) those tables give."""

from __future__ import annotations

import dataclasses
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
        (dict(rope_scaling_original_max_position_embeddings=128), "is a Llama-3 scaling setting"),
        (dict(rope_scaling=True, rope_scaling_low_freq_factor=4.0, rope_scaling_high_freq_factor=2.0), "0 < low"),
        (dict(rope_scaling=True, rope_scaling_original_max_position_embeddings=0), "must be a positive integer"),
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


# --- Llama-3 scaling from any original context, YaRN over a partial rotary: transformers' tables -------------------
def _hf_rope(rope_scaling: dict | None, head_dim: int = 16, partial: float = 1.0, base: float = 10_000.0):
    """(inv_freq, attention factor) of transformers' ROPE_INIT_FUNCTIONS for a Qwen3-shaped config."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # transformers 5: every RoPE setting in one rope_parameters object
    parameters = {**(rope_scaling or {"rope_type": "default"}), "rope_theta": base, "partial_rotary_factor": partial}
    config = Qwen3Config(
        head_dim=head_dim, hidden_size=64, num_attention_heads=4, max_position_embeddings=100_000,
        rope_parameters=parameters,
    )  # fmt: skip
    if rope_scaling is None:  # transformers 5 computes the plain table in the model's own rotary class (Qwen3-Next's
        # reads partial_rotary_factor)
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

        return Qwen3NextRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_scaling["rope_type"]](config, "cpu")


def test_llama3_default_original_is_megatrons_own(megatron_world):
    """rope_scaling=true with the default settings is exactly megatron's RotaryEmbedding(rope_scaling=True): 8192,
    low 1, high 4, as before the original context became a setting."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    m, gpt = _model(megatron_world, rope_scaling=True, rope_scaling_factor=4.0)
    direct = RotaryEmbedding(
        kv_channels=16, rotary_percent=1.0, rotary_base=10_000, rope_scaling=True, rope_scaling_factor=4.0,
        use_cpu_initialization=True,
    )  # fmt: skip
    assert torch.equal(gpt.rotary_pos_emb.inv_freq, direct.inv_freq)
    assert torch.equal(gpt.rotary_pos_emb(SEQ), direct(SEQ))


@pytest.mark.parametrize(
    "original, low, high, percent", [(8192, 1.0, 4.0, 1.0), (128, 1.0, 4.0, 1.0), (64, 2.0, 16.0, 0.5)]
)
def test_llama3_with_an_original_context_is_transformers_table(megatron_world, original, low, high, percent):
    m, gpt = _model(
        megatron_world, rope_scaling=True, rope_scaling_factor=4.0, rotary_percent=percent,
        rope_scaling_original_max_position_embeddings=original, rope_scaling_low_freq_factor=low,
        rope_scaling_high_freq_factor=high,
    )  # fmt: skip
    scaling = dict(
        rope_type="llama3", factor=4.0, low_freq_factor=low, high_freq_factor=high,
        original_max_position_embeddings=original,
    )  # fmt: skip
    inv, factor = _hf_rope(scaling, partial=percent)
    assert factor == 1.0 and torch.equal(gpt.rotary_pos_emb.inv_freq, inv)  # bit for bit
    plain, _ = _hf_rope(None, partial=percent)
    # the slowed dims: every one with a wavelength beyond original/low, none below original/high
    wavelength = 2 * math.pi / plain.double()
    slowed = ~torch.isclose(inv, plain, rtol=1e-6, atol=0)
    assert torch.equal(slowed, wavelength >= original / high)
    torch.testing.assert_close(inv[wavelength > original / low], plain[wavelength > original / low] / 4)


def test_yarn_over_a_partial_rotary_is_transformers_table(megatron_world):
    """megatron's YaRN over the rotated dims only: transformers' yarn with partial_rotary_factor, table and factor."""
    m, gpt = _model(
        megatron_world, position_embedding="yarn", yarn_factor=4.0, yarn_original_max_position_embeddings=32,
        rotary_percent=0.5,
    )  # fmt: skip
    emb, mscale = gpt.rotary_pos_emb(SEQ)
    assert emb.shape[-1] == m.head_dim // 2  # half the dims rotate; the rest pass through apply_rotary_pos_emb
    inv, factor = _hf_rope(dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32), partial=0.5)
    assert torch.equal(emb[:, 0, 0, : m.head_dim // 4], torch.outer(torch.arange(SEQ, dtype=torch.float32), inv))
    assert mscale == factor == gpt.decoder.layers[0].self_attention._yarn_concentration_factor


# --- the reach -----------------------------------------------------------------------------------------------------
def _reach_from_tables(m, gpt) -> int:
    """context_length recomputed from megatron's own tables: the seen context S times the smallest slow-down
    θ_i / θ'_i among the dims that do not turn once within S (megagate.model.position's definition)."""
    from megagate.model.position import seen_length

    dim = int(m.head_dim * m.rotary_percent)
    theta = 1.0 / (m.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaled = _angles(gpt.rotary_pos_emb, 2)[0][1, : dim // 2]  # the angle at position 1 = θ'_i
    slow = theta / scaled
    seen = seen_length(m)
    limiting = slow[2 * math.pi / theta > seen]
    return max(m.max_sequence_length, int(seen * float(limiting.min()) + 1e-3))


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({}, 128),
        (dict(rotary_interpolation_factor=4.0), 512),
        # megatron's Llama-3 scaling from 8192 on a model declared for 128: the dims with wavelengths 199, 628 and
        # 1987 tokens turn less than once in 128 tokens and are not slowed (below 8192/4): no reach beyond 128
        (dict(rope_scaling=True, rope_scaling_factor=4.0), 128),
        (dict(rope_scaling=True, rope_scaling_factor=4.0, rope_scaling_original_max_position_embeddings=128), 512),
        (dict(position_embedding="yarn", yarn_factor=4.0), 512),
        (dict(position_embedding="yarn", yarn_factor=4.0, yarn_original_max_position_embeddings=64), 256),
        # an original context above the declared length: the dim of wavelength 199 turns 5 times in 1024 tokens
        # and is only ramped (slowed 1.6x): 128 x 1.6
        (dict(position_embedding="yarn", yarn_factor=4.0, yarn_original_max_position_embeddings=1024), 204),
    ],
)
def test_context_length_is_the_reach_of_the_tables(megatron_world, fields, expected):
    m, gpt = _model(megatron_world, rotary_base=10_000, **fields)
    assert m.context_length == expected == _reach_from_tables(m, gpt)


def test_eval_refuses_lengths_beyond_the_llama3_reach():
    from megagate.errors import MegagateError
    from megagate.evaluate.options import check_lengths

    from_8192 = model_preset("tiny", rope_scaling=True, rope_scaling_factor=4.0)
    with pytest.raises(MegagateError, match="length 512 exceeds the 128 tokens .*Llama-3 scaling x4 from 8192") as info:
        check_lengths(from_8192, [128, 512], "ckpt")
    assert "rope_scaling_original_max_position_embeddings=128" in str(info.value)
    check_lengths(dataclasses.replace(from_8192, rope_scaling_original_max_position_embeddings=128), [512], "ckpt")
