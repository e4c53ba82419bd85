"""RoPE scaling through the Hugging Face formats: megagate and transformers' own classes compute the same logits at
2x and 4x the original context, after export (megagate weights in transformers' class built from the exported
config.json) and after import (transformers' weights and config.json read back into a megagate model built from the
imported ModelConfig), for YaRN (default, explicit-attention-factor and mscale/mscale_all_dim forms), linear
interpolation and Llama-3 scaling, in Qwen3 (full rotary) and Qwen3-Next (partial rotary) with grouped-query
attention. Tiny random-weight models, fp32, CPU."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megagate.cli import main
from megagate.errors import ConfigError
from megagate.interop import hf, hf_rope
from megagate.model.build import build_gpt_model, transformer_config

from .test_hf_logits import (
    BATCH,
    VOCAB,
    build_hf,
    hf_tensors,
    load_hf,
    megagate_state,
    model_config,
    perturb_hf,
    randomize_megagate,
)

transformers = pytest.importorskip("transformers")

ORIGINAL = 16  # the context the scalings start from; logits are compared at 2x and 4x it
LENGTHS = (2 * ORIGINAL, 4 * ORIGINAL)
TOL = 1e-5
SCALINGS = {
    "yarn": dict(position_embedding="yarn", yarn_factor=4.0, yarn_original_max_position_embeddings=ORIGINAL),
    # mscale without mscale_all_dim: exported as megatron's explicit attention factor; other betas, unrounded ramp
    "yarn-attention-factor": dict(
        position_embedding="yarn",
        yarn_factor=4.0,
        yarn_original_max_position_embeddings=ORIGINAL,
        yarn_mscale=0.707,
        yarn_beta_fast=8.0,
        yarn_beta_slow=0.5,
        yarn_correction_range_round_to_int=False,
    ),
    # both non-zero: transformers' formula is megatron's, written as mscale / mscale_all_dim
    "yarn-mscale-all-dim": dict(
        position_embedding="yarn",
        yarn_factor=4.0,
        yarn_original_max_position_embeddings=ORIGINAL,
        yarn_mscale=1.2,
        yarn_mscale_all_dim=0.8,
    ),
    "linear": dict(rotary_interpolation_factor=4.0),
    "llama3": dict(
        rope_scaling=True,
        rope_scaling_factor=4.0,
        rope_scaling_original_max_position_embeddings=ORIGINAL,
        rope_scaling_high_freq_factor=8.0,  # dims with wavelengths 2..16 tokens smoothed, beyond 16 slowed by 4
    ),
}
# full rotary; partial rotary 0.5 (Qwen3-Next's); Qwen3.5's multimodal rotary class over text positions
FORMATS = ("qwen3", "qwen3_next", "qwen3_5")


def scaled_config(fmt: str, scaling: str):
    return model_config(
        "qwen3_next" if fmt == "qwen3_5" else fmt,
        "4q2kv-hn16",
        False,
        max_sequence_length=4 * ORIGINAL,
        rotary_base=500,
        **SCALINGS[scaling],
    )


@torch.no_grad()
def max_logit_diff(mg: torch.nn.Module, model: torch.nn.Module, length: int) -> float:
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(0, VOCAB, (BATCH, length), generator=gen)
    positions = torch.arange(length).unsqueeze(0).expand(BATCH, -1)
    ours = mg(ids, positions, None)  # [b, s, vocab]
    theirs = model(input_ids=ids, use_cache=False).logits
    assert ours.shape == theirs.shape == (BATCH, length, VOCAB)
    assert theirs.abs().max() > 0.5  # logits on a scale of 1: 1e-5 tests the computation
    return (ours - theirs).abs().max().item()


def as_4x(config: dict) -> dict:
    """A transformers 4.x config.json of the same model: `rope_scaling` / `rope_theta`, no `rope_parameters`."""
    return {k: v for k, v in config.items() if k != "rope_parameters"}


def as_5x(config: dict) -> dict:
    """A transformers 5 config.json (what its save_pretrained writes): `rope_parameters` only."""
    return {k: v for k, v in config.items() if k not in hf_rope.LEGACY_KEYS}


def _hf_attention_factor(model: torch.nn.Module) -> float:
    return float(model.model.rotary_emb.attention_scaling)


def _megatron_attention_factor(mg: torch.nn.Module) -> float:
    return float(mg.decoder.layers[0].self_attention._yarn_concentration_factor)


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_scaled_rope_logits_match_transformers_after_export_and_import(megatron_world, fmt, scaling):
    mc = scaled_config(fmt, scaling)
    config = hf.hf_config(mc, fmt)
    assert config["rope_parameters"]["rope_type"] == scaling.split("-")[0]
    if fmt != "qwen3_5":  # a format transformers 4.x has: its keys too, the same model read alone or together
        assert config["rope_scaling"] == {
            k: v for k, v in config["rope_parameters"].items() if k not in hf_rope.LEGACY_KEYS
        }
        assert hf.model_config_from_hf(as_4x(config)) == hf.model_config_from_hf(as_5x(config))

    # export: megagate's weights in transformers' class built from the exported config.json
    mg = build_gpt_model(mc, transformer_config(mc)).eval()
    randomize_megagate(mg, mc, seed=1)
    model = build_hf(mc, fmt)
    load_hf(model, hf.to_hf_state_dict(mc, fmt, megagate_state(mg)), mc.tie_embeddings)
    exported = [max_logit_diff(mg, model, n) for n in LENGTHS]
    assert _hf_attention_factor(model) == _megatron_attention_factor(mg)  # exactly the same float

    # import: transformers' own random weights and the config.json, read back into a model built from the import
    back, detected = hf.model_config_from_hf(json.loads(json.dumps(config)))
    if scaling == "yarn-attention-factor":  # read back as the mscale (all_dim 0) giving exactly that factor
        assert back.yarn_mscale == pytest.approx(0.707, rel=1e-12) and back.yarn_mscale_all_dim == 0.0
        mc = dataclasses.replace(mc, yarn_mscale=back.yarn_mscale)
    assert detected == fmt and hf.same_architecture(back, mc)
    native = build_hf(mc, fmt)
    perturb_hf(native, seed=2)
    imported = build_gpt_model(back, transformer_config(back)).eval()
    result = imported.load_state_dict(
        hf.from_hf_state_dict(back, fmt, hf_tensors(native, mc.tie_embeddings)), strict=False
    )
    assert not result.unexpected_keys and all(k.endswith("_extra_state") for k in result.missing_keys)
    after_import = [max_logit_diff(imported, native, n) for n in LENGTHS]

    print(f"\n{fmt} {scaling} at {LENGTHS}: export {exported}, import {after_import}")
    assert max(exported + after_import) < TOL


@pytest.mark.parametrize("fmt", FORMATS)
def test_scaling_changes_the_logits(megatron_world, fmt):
    """The comparison above can fail: the same weights without the scaling give other logits beyond the original
    context (transformers' class with rope_scaling, megagate without)."""
    mc = scaled_config(fmt, "yarn")
    plain = dataclasses.replace(
        mc, position_embedding="rope", yarn_factor=1.0, yarn_original_max_position_embeddings=None
    )
    mg = build_gpt_model(plain, transformer_config(plain)).eval()
    randomize_megagate(mg, plain, seed=1)
    model = build_hf(mc, fmt)
    load_hf(model, hf.to_hf_state_dict(plain, fmt, megagate_state(mg)), mc.tie_embeddings)
    assert max_logit_diff(mg, model, 4 * ORIGINAL) > 1e-2


def test_an_explicit_attention_factor_is_imported_exactly(megatron_world):
    """transformers uses `attention_factor` as given: the import finds the mscale whose megatron factor is exactly
    that float, and the export writes it back unchanged; logits agree at 4x."""
    mc = scaled_config("qwen3", "yarn")
    config = as_5x(hf.hf_config(mc, "qwen3"))
    config["rope_parameters"]["attention_factor"] = 1.2345
    back, _ = hf.model_config_from_hf(config)
    assert back.yarn_mscale_all_dim == 0.0 and back.yarn_mscale != 1.0
    assert hf.hf_config(back, "qwen3")["rope_parameters"]["attention_factor"] == 1.2345
    native = build_hf(back, "qwen3")
    perturb_hf(native, seed=3)
    assert _hf_attention_factor(native) == 1.2345
    mg = build_gpt_model(back, transformer_config(back)).eval()
    mg.load_state_dict(hf.from_hf_state_dict(back, "qwen3", hf_tensors(native, back.tie_embeddings)), strict=False)
    assert _megatron_attention_factor(mg) == 1.2345
    assert max_logit_diff(mg, native, 4 * ORIGINAL) < TOL


def test_a_lone_mscale_is_dropped_as_transformers_drops_it():
    """transformers ignores mscale without mscale_all_dim (0.1 ln s + 1): the import does the same."""
    mc = scaled_config("qwen3", "yarn")
    config = as_4x(hf.hf_config(mc, "qwen3"))
    config["rope_scaling"]["mscale"] = 0.707
    back, _ = hf.model_config_from_hf(config)
    assert (back.yarn_mscale, back.yarn_mscale_all_dim) == (1.0, 0.0)


@pytest.mark.parametrize(
    "scaling, message",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type='dynamic'"),
        ({"rope_type": "longrope", "factor": 2.0}, "rope_type='longrope'"),
        ({"rope_type": "yarn", "factor": 2.0, "finetuned": True}, "rope_scaling.finetuned is not a yarn setting"),
        ({"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0}, "has no 'high_freq_factor'"),
        ({"rope_type": "linear", "factor": 0.5}, "factor=0.5 must be >= 1"),
        ({"rope_type": "yarn", "factor": 1.0, "attention_factor": 1.5}, "attention_factor=1.5 with factor 1.0"),
        (
            {
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 16,
            },
            "0 < low < high",
        ),  # fmt: skip
        ("yarn", "must be an object or null"),
    ],
)
@pytest.mark.parametrize("version", ["4.x", "5.x"])
def test_rope_scaling_that_megagate_cannot_hold_is_one_line(scaling, message, version):
    config = hf.hf_config(scaled_config("qwen3", "yarn"), "qwen3")
    if version == "4.x":  # rope_scaling
        config = as_4x(config)
        config["rope_scaling"] = scaling
    else:  # the same settings in rope_parameters, named so in the message
        config = as_5x(config)
        config["rope_parameters"] = {**scaling, "rope_theta": 10_000.0} if isinstance(scaling, dict) else scaling
        message = message.replace("rope_scaling", "rope_parameters")
        if not isinstance(scaling, dict):
            message = "rope_parameters='yarn' must be an object or null"
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as info:
        hf.model_config_from_hf(config)
    assert "\n" not in str(info.value)


def test_4x_and_5x_rope_keys_that_disagree_are_refused():
    config = hf.hf_config(scaled_config("qwen3_next", "yarn"), "qwen3_next")
    for key, value in (("rope_theta", 500_000.0), ("partial_rotary_factor", 1.0)):
        with pytest.raises(ConfigError, match=f"config.json {key}=.* and rope_parameters .* disagree"):
            hf.model_config_from_hf({**config, key: value})
    with pytest.raises(ConfigError, match="rope_scaling=.* and rope_parameters .* disagree"):
        hf.model_config_from_hf({**config, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})


def test_two_scalings_at_once_are_refused_by_export(tmp_path, megatron_world, capsys):
    """Linear interpolation and Llama-3 scaling together (megatron builds both; an HF config holds one): `megagate
    export` refuses in one line naming the setting, exit 2, nothing written."""
    from megagate.interop.hf_io import model_from_state, model_state, write_checkpoint

    from .test_export_import import _random_model

    both = dataclasses.replace(scaled_config("qwen3", "llama3"), rotary_interpolation_factor=2.0)
    with pytest.raises(ConfigError, match="rotary_interpolation_factor=2.0 with model.rope_scaling=true"):
        hf.hf_config(both, "qwen3")
    write_checkpoint(
        model_from_state(both, model_state(_random_model(both))), both, tmp_path / "ck", log=lambda m: None
    )
    capsys.readouterr()
    rc = main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "rotary_interpolation_factor=2.0 with model.rope_scaling=true" in err and "formats that hold" in err
    assert not (tmp_path / "hf").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
