"""Qwen3.5 (`qwen3_5`, `qwen3_5_moe`: transformers 5's `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM`) through files:
folders written by transformers' own `save_pretrained` (random weights) -> `megagate import` -> `megagate export` ->
`from_pretrained`, logits and tensors compared; a vision-language folder (`Qwen3_5ForConditionalGeneration`) read as
its text model, as transformers' `AutoModelForCausalLM` reads it; transformers 5's fused in-memory expert layout read
like the per-expert one on disk; bad folders refused in one line. (In-memory logits both ways, per layer kind:
tests/interop/test_hf_hybrid.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megagate.cli import main
from megagate.errors import ConfigError
from megagate.interop import hf, hf_qwen35

transformers = pytest.importorskip("transformers")
from tests.interop.test_export_import import _megagate_greedy, assert_identical, model_tensors  # noqa: E402
from tests.interop.test_export_import import hf_tensors as folder_tensors  # noqa: E402
from tests.interop.test_hf_logits import model_config  # noqa: E402

GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12)
CASES = {
    "qwen3_5": dict(moe=False, layer_pattern="GGG*"),
    "qwen3_5_moe": dict(moe=True, layer_pattern="G*G*", moe_shared_expert_intermediate_size=24),
}
TOL = 1e-5


def qwen35_config(fmt: str, **overrides):
    extra = {**CASES[fmt], **overrides}
    moe = extra.pop("moe")
    if extra.get("moe_shared_expert_intermediate_size"):
        extra["moe_shared_expert_gate"] = True
    return model_config("qwen3_next", "4q2kv-hn16", moe, num_layers=4, tie_embeddings=False, **GDN, **extra)


def native_model(mc, fmt: str, seed: int = 3) -> torch.nn.Module:
    """transformers' own class for `hf_config(mc, fmt)`, its random init perturbed (no norm at 0, decisive
    routing, decays and step biases away from their initial values)."""
    config = transformers.AutoConfig.for_model(**hf.hf_config(mc, fmt))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert type(model).__name__ == hf.ARCHITECTURES[fmt]
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(1.0 + 15.0 * torch.rand(p.shape, generator=gen)))
            elif name.endswith("dt_bias") or "shared_expert_gate" in name or name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if name.endswith("dt_bias") else 1.0))
            elif name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.mul_(5.0)
    return model.eval()


def ids() -> torch.Tensor:
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def megagate_logits(checkpoint: Path) -> torch.Tensor:
    from megagate.commands.analyze import load_model_for_analysis

    model, _ = load_model_for_analysis(checkpoint, need_tokenizer=False)
    tokens = ids()
    return model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1), None)


@torch.no_grad()
def hf_logits(model: torch.nn.Module) -> torch.Tensor:
    return model(input_ids=ids(), use_cache=False).logits


@pytest.mark.slow  # ~15 s: checkpoints written and read four times
@pytest.mark.parametrize("fmt", list(CASES))
def test_save_pretrained_import_export_round_trip(fmt, tmp_path, megatron_world):
    """transformers' save_pretrained -> import: megagate's logits are transformers'; -> export (the import's format
    by default): every safetensors tensor identical, `from_pretrained` gives the same logits and greedy tokens
    (generate with its cache); -> import again: a bit-identical checkpoint."""
    from megagate.interop.hf_io import export_checkpoint, import_hf

    mc = qwen35_config(fmt)
    native = native_model(mc, fmt)
    native.save_pretrained(tmp_path / "hf")
    on_disk = folder_tensors(tmp_path / "hf")
    if mc.is_moe:  # transformers 5 fuses the experts in memory and writes them one per expert
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in on_disk
        assert "model.layers.0.mlp.experts.gate_up_proj" in native.state_dict()
    import_hf(tmp_path / "hf", tmp_path / "ck", log=str)
    imported = (megagate_logits(tmp_path / "ck") - hf_logits(native)).abs().max().item()

    export_checkpoint(tmp_path / "ck", tmp_path / "hf2", log=str)
    config = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert config["model_type"] == hf.MODEL_TYPES[fmt] and config["architectures"] == [hf.ARCHITECTURES[fmt]]
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    assert config["dtype"] == "float32" and "rope_scaling" not in config
    assert_identical(on_disk, folder_tensors(tmp_path / "hf2"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2").eval()
    assert type(loaded).__name__ == hf.ARCHITECTURES[fmt]
    exported = (hf_logits(loaded) - megagate_logits(tmp_path / "ck")).abs().max().item()

    # transformers' greedy generate with its cache (the GDN layers' recurrent and conv states, the attention KV)
    # decodes megagate's greedy tokens (megagate recomputes the whole sequence at each step)
    from megagate.commands.analyze import load_model_for_analysis

    prompt = [3, 17, 9, 5, 42, 7]
    with torch.no_grad():
        generated = loaded.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    ours = _megagate_greedy(load_model_for_analysis(tmp_path / "ck", need_tokenizer=False)[0], prompt, 8)
    assert generated[0, len(prompt) :].tolist() == ours and len(set(ours)) >= 3, ours

    import_hf(tmp_path / "hf2", tmp_path / "ck2", log=str)
    a, b = (model_tensors(tmp_path / c / "iter_0000000", tmp_path) for c in ("ck", "ck2"))
    assert len(a) >= 8
    assert_identical(a, b)
    print(f"\n{fmt}: max|dlogit| import {imported:.2e}, export {exported:.2e}")
    assert imported < TOL and exported < TOL


def vision_language_folder(mc, fmt: str, folder: Path) -> torch.nn.Module:
    """A folder laid out as the released Qwen3.5 checkpoints: a vision-language config.json (text_config +
    vision_config), the text model under model.language_model.*, a vision encoder and an MTP head beside it."""
    from safetensors.torch import save_file

    native = native_model(mc, fmt)
    tensors = {}
    for key, value in hf.unfuse_experts(native.state_dict()).items():
        name = "model.language_model." + key[len("model.") :] if key.startswith("model.") else key
        tensors[name] = value.contiguous().clone()
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(16, 3, 2, 2, 2)
    tensors["model.visual.merger.linear_fc2.weight"] = torch.randn(48, 16)
    tensors["mtp.fc.weight"] = torch.randn(48, 96)
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    text = {k: v for k, v in hf.hf_config(mc, fmt).items() if k != "architectures"}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    config = {
        "architectures": [hf_qwen35.VL_ARCHITECTURES[fmt]],
        "model_type": fmt,
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 48,
            "patch_size": 2,
            "temporal_patch_size": 2,
            "spatial_merge_size": 1,
            "num_position_embeddings": 16,
        },  # fmt: skip
    }
    (folder / "config.json").write_text(json.dumps(config))
    return native


@pytest.mark.slow  # ~8 s: a checkpoint written and exported
@pytest.mark.parametrize("fmt", list(CASES))
def test_vision_language_folder_gives_its_text_model(fmt, tmp_path, megatron_world, capsys):
    """The text part is taken, as transformers' AutoModelForCausalLM takes it (Qwen3_5(Moe)ForCausalLM on the same
    folder): the same logits; one warning line names what was dropped; an export is the text model alone."""
    from megagate.interop.hf_io import export_checkpoint, import_hf

    mc = qwen35_config(fmt)
    native = vision_language_folder(mc, fmt, tmp_path / "vl")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "vl").eval()
    assert type(loaded).__name__ == hf.ARCHITECTURES[fmt]
    assert (hf_logits(loaded) - hf_logits(native)).abs().max() == 0
    capsys.readouterr()
    import_hf(tmp_path / "vl", tmp_path / "ck", log=lambda m: None)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vision-language folder: took its text model" in err, err
    assert "2 tensors of the vision encoder, 1 tensors of the MTP head" in err
    diff = (megagate_logits(tmp_path / "ck") - hf_logits(loaded)).abs().max().item()
    print(f"\n{fmt} vision-language folder: max|dlogit| {diff:.2e}")
    assert diff < TOL
    export_checkpoint(tmp_path / "ck", tmp_path / "text", log=str)
    assert json.loads((tmp_path / "text" / "config.json").read_text())["model_type"] == hf.MODEL_TYPES[fmt]
    assert not [k for k in folder_tensors(tmp_path / "text") if "visual" in k or k.startswith("mtp.")]


def test_fused_expert_layout_reads_like_the_per_expert_one():
    """transformers 5's in-memory state dict (experts fused: gate_up_proj [E, 2f, h], down_proj [E, h, f]) converts
    to exactly the tensors of the per-expert layout save_pretrained writes."""
    mc = qwen35_config("qwen3_5_moe")
    native = native_model(mc, "qwen3_5_moe")
    fused = {k: v for k, v in native.state_dict().items()}
    per_expert = hf.unfuse_experts(fused)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in per_expert
    assert_identical(hf.fuse_experts(per_expert), fused)
    assert_identical(
        hf.from_hf_state_dict(mc, "qwen3_5_moe", fused), hf.from_hf_state_dict(mc, "qwen3_5_moe", per_expert)
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.pop("text_config"), "has no text_config object"),
        (lambda c: c.update(architectures=["Qwen3_5ForCausalLM"]), "architectures=['Qwen3_5ForCausalLM']"),
        (lambda c: c["text_config"].update(model_type="qwen3_next"), "text_config.model_type='qwen3_next'"),
        (lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings=True and text_config"),
        (lambda c: c["text_config"].update(layer_types=["linear_attention"] * 3), "layer_types has 3 entries"),
        (
            lambda c: c["text_config"]["rope_parameters"].update(rope_type="longrope"),
            "rope_parameters.rope_type='longrope'",
        ),
        (lambda c: c["text_config"].pop("intermediate_size"), "config.json has no 'intermediate_size'"),
    ],
)
def test_bad_vision_language_folders_refused_in_one_line(change, message, tmp_path, megatron_world, capsys):
    mc = qwen35_config("qwen3_5")
    vision_language_folder(mc, "qwen3_5", tmp_path / "vl")
    config = json.loads((tmp_path / "vl" / "config.json").read_text())
    config["text_config"]["tie_word_embeddings"] = False
    change(config)
    (tmp_path / "vl" / "config.json").write_text(json.dumps(config))
    rc = main(["import", str(tmp_path / "vl"), "--out", str(tmp_path / "ck")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert message in err and not (tmp_path / "ck").exists()


def test_formats_refuse_what_qwen35_cannot_hold():
    dense, moe = qwen35_config("qwen3_5"), qwen35_config("qwen3_5_moe")
    for model, fmt, message in (
        (moe, "qwen3_5", "the qwen3_5 format is dense only"),
        (dense, "qwen3_5_moe", "the qwen3_5_moe format holds MoE models (use qwen3_5 for dense)"),
        (
            qwen35_config("qwen3_5_moe", moe_router_norm_topk=False),
            "qwen3_5_moe",
            "Qwen3.5-MoE always renormalises the top-k routing weights",
        ),
        (qwen35_config("qwen3_5", norm_zero_centered=False), "qwen3_5", "the qwen3_5 format's norms are zero-centred"),
    ):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
            hf.check_exportable(model, fmt)
        assert "\n" not in str(info.value)
    # a Qwen3.5 text config.json without its sizes is refused, not filled with transformers' defaults
    config = hf.hf_config(moe, "qwen3_5_moe")
    del config["shared_expert_intermediate_size"]
    with pytest.raises(ConfigError, match="has no 'shared_expert_intermediate_size'"):
        hf.model_config_from_hf(config)


def test_multimodal_rope_over_text_positions_is_1d_rope():
    """Qwen3.5's rotary class (mrope_section [11, 11, 10], interleaved, as the released configs) over text positions
    gives exactly the cos/sin of Qwen3-Next's 1-D RoPE of the same dims (head 256, partial 0.25, θ 1e7): the reason
    the mrope keys are read and ignored."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25}
    sizes = dict(hidden_size=2048, num_attention_heads=16, head_dim=256, max_position_embeddings=262_144)
    mrope = {**rope, "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    qwen35 = Qwen3_5TextRotaryEmbedding(transformers.Qwen3_5MoeTextConfig(**sizes, rope_parameters=mrope))
    qwen3_next = Qwen3NextRotaryEmbedding(transformers.Qwen3NextConfig(**sizes, rope_parameters=rope))
    x = torch.zeros(1, dtype=torch.float32)
    positions = torch.arange(0, 200_000, 997).unsqueeze(0)
    cos, sin = qwen35(x, positions.unsqueeze(0).expand(3, -1, -1))
    cos_1d, sin_1d = qwen3_next(x, positions)
    assert cos.shape == cos_1d.shape == (1, positions.shape[1], 64)
    assert torch.equal(cos, cos_1d) and torch.equal(sin, sin_1d)
    # the sections do matter once the three rows differ (images): the comparison has teeth
    moved = positions.unsqueeze(0).expand(3, -1, -1).clone()
    moved[1] += 5
    assert not torch.equal(qwen35(x, moved)[0], cos_1d)
