"""Layout converters, format selection and refusals: exact round trips, one-line errors instead of wrong weights."""

from __future__ import annotations

import pytest
import torch

from megagate.errors import ConfigError
from megagate.interop import hf
from megagate.model import gate as gates
from megagate.model import qkv_layout as layout
from megagate.model.model_config import ModelConfig

N, G, D, H = 6, 3, 8, 40


def _one_line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def _model(gate: str = "baseline", **overrides: object) -> ModelConfig:
    values: dict = dict(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=N,
        num_query_groups=G,
        head_dim=D,
        ffn_hidden_size=64,
        vocab_size=96,
        gate=gates.preset(gate),
    )
    values.update(overrides)
    return ModelConfig(**values)


MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, tie_embeddings=False)


# --- qkv_layout converters ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("granularity", ["elementwise", "headwise"])
def test_paper_converters_round_trip_exactly(granularity):
    width = D if granularity == "elementwise" else 1
    fused = torch.randn(layout.QkvLayout(N, G, D, q_gate_width=width).rows, H)
    q, k, v = layout.to_paper(fused, N, G, D, granularity)
    assert q.shape == (N * D + N * width, H) and k.shape == v.shape == (G * D, H)
    assert torch.equal(layout.from_paper(q, k, v, N, G, D, granularity), fused)
    # the paper's q_proj, per KV group: [q of the group's heads | their gates]; row 0 of group 1 is head 2's q
    npg = N // G
    group_rows = npg * D + npg * width
    own = layout.QkvLayout(N, G, D, q_gate_width=width).row_keys()
    assert own[layout.QkvLayout(N, G, D, q_gate_width=width).rows_per_group] == ("q", npg, 0)
    assert torch.equal(q[group_rows], fused[own.index(("q", npg, 0))])
    assert torch.equal(q[npg * D], fused[own.index(("q_gate", 0, 0))])


def test_qwen3_and_qwen3_next_converters_round_trip_exactly():
    plain = torch.randn(layout.QkvLayout(N, G, D).rows, H)
    assert torch.equal(layout.from_qwen3(*layout.to_qwen3(plain, N, G, D), N, G, D), plain)
    gated = torch.randn(layout.QkvLayout(N, G, D, q_gate_width=D).rows, H)
    q, k, v = layout.to_qwen3_next(gated, N, G, D)
    assert torch.equal(layout.from_qwen3_next(q, k, v, N, G, D), gated)
    # Qwen3-Next: per head [q_h | gate_h]
    assert torch.equal(q[D], gated[layout.QkvLayout(N, G, D, q_gate_width=D).row_keys().index(("q_gate", 0, 0))])
    for t in (q, k, v):
        assert t.is_contiguous() and t.untyped_storage().data_ptr() != gated.untyped_storage().data_ptr()


def test_elementwise_layouts_share_a_shape_but_not_an_order():
    """Indistinguishable by shape (hence the explicit format), different rows."""
    gated = torch.randn(layout.QkvLayout(N, G, D, q_gate_width=D).rows, H)
    paper = layout.to_paper(gated, N, G, D, "elementwise")
    nxt = layout.to_qwen3_next(gated, N, G, D)
    assert [t.shape for t in paper] == [t.shape for t in nxt]
    assert not torch.equal(paper[0], nxt[0])
    assert not torch.equal(layout.from_qwen3_next(*paper, N, G, D), gated)


def test_converters_refuse_wrong_shapes_in_one_line():
    q, k, v = layout.to_paper(torch.randn(layout.QkvLayout(N, G, D, q_gate_width=1).rows, H), N, G, D, "headwise")
    with pytest.raises(ConfigError) as e:  # the headwise paper q_proj is not Qwen3-Next's
        layout.from_qwen3_next(q, k, v, N, G, D)
    assert "q_proj has shape (54, 40)" in _one_line(e) and str(2 * N * D) in str(e.value)
    with pytest.raises(ConfigError) as e:  # nor the elementwise paper one
        layout.from_paper(q, k, v, N, G, D, "elementwise")
    assert "q_proj" in _one_line(e)
    with pytest.raises(ConfigError) as e:  # k_proj of another group count
        layout.from_paper(q, k[:-D], v, N, G, D, "headwise")
    assert "k_proj" in _one_line(e)
    with pytest.raises(ConfigError) as e:  # megagate's fused rows of another gate
        layout.to_qwen3_next(torch.randn(layout.QkvLayout(N, G, D).rows, H), N, G, D)
    assert "linear_qkv has shape" in _one_line(e)
    with pytest.raises(ConfigError) as e:
        layout.to_paper(torch.randn(10, H), N, G, D, "rowwise")
    assert "granularity" in _one_line(e)


# --- formats ------------------------------------------------------------------------------------------------------
def test_formats_for_each_variant():
    assert hf.formats_for(_model()) == ["qwen3", "paper"]
    assert hf.default_format(_model(**MOE)) == "qwen3_moe" and hf.formats_for(_model(**MOE)) == ["qwen3_moe"]
    assert hf.formats_for(_model("g1-elementwise", norm_zero_centered=True)) == ["qwen3_next", "qwen3_5"]
    assert hf.formats_for(_model("g1-elementwise", norm_zero_centered=True, **MOE)) == ["qwen3_next", "qwen3_5_moe"]
    # Qwen3.5-MoE always renormalises the top-k routing weights
    assert hf.formats_for(_model("g1-elementwise", norm_zero_centered=True, **MOE, moe_router_norm_topk=False)) == [
        "qwen3_next"
    ]
    assert hf.formats_for(_model("g1-elementwise")) == ["paper"]  # plain norms: the paper's code
    assert hf.default_format(_model("g1-headwise")) == "paper"
    assert hf.formats_for(_model(qk_layernorm=False)) == ["paper"]
    assert hf.formats_for(_model("g1-headwise", **MOE)) == []


@pytest.mark.parametrize(
    ("gate", "fmt", "overrides", "names"),
    [
        ("g2-elementwise", "qwen3_next", {}, ("g2", "formats that hold this model: none")),
        ("g1-headwise", "qwen3_next", {}, ("g1-headwise", "holds g1-elementwise", "paper")),
        ("g1-headwise", "paper", MOE, ("num_experts=4", "dense only", "none")),
        ("baseline", "qwen3", {"normalization": "LayerNorm"}, ("normalization='LayerNorm'", "none")),
        ("baseline", "qwen3", {"qk_layernorm": False}, ("qk_layernorm=false", "paper")),
        ("baseline", "qwen3", {"norm_zero_centered": True}, ("norm_zero_centered=true", "none")),
        ("g1-elementwise", "qwen3_next", {}, ("norm_zero_centered=false", "paper")),
        ("baseline", "qwen3", {"rotary_percent": 0.5}, ("rotary_percent=0.5", "none")),
        ("baseline", "qwen3", {"softmax_type": "learnable"}, ("softmax_type='learnable'", "no attention sink", "none")),
        ("g1-elementwise", "paper", {"softmax_type": "off-by-one"}, ("softmax_type='off-by-one'", "none")),
        (
            "baseline",
            "qwen3",
            {"rotary_interpolation_factor": 2.0, "rope_scaling": True},
            ("rotary_interpolation_factor=2.0 with model.rope_scaling=true", "holds one RoPE scaling", "none"),
        ),
        ("baseline", "qwen3_moe", {}, ("num_experts=0", "qwen3, paper")),
    ],
)
def test_unsupported_models_are_refused_in_one_line(gate, fmt, overrides, names):
    model = _model(gate, **overrides)
    with pytest.raises(ConfigError) as e:
        hf.check_exportable(model, fmt)
    message = _one_line(e)
    for name in names:
        assert name in message
    with pytest.raises(ConfigError):
        hf.hf_config(model, fmt)


def test_default_format_refuses_a_model_no_format_holds():
    with pytest.raises(ConfigError) as e:
        hf.default_format(_model("g5-elementwise"))
    assert "g5" in _one_line(e) and "none" in str(e.value)


# --- config.json both ways ----------------------------------------------------------------------------------------
_ORIGINAL = "yarn_original_max_position_embeddings"


def test_yarn_original_context_is_written_explicitly():
    """megagate's yarn_original_max_position_embeddings null (= max_sequence_length) is written as the number (no
    transformers warning about an unset pre-YaRN length) and read back as that number."""
    model = _model(position_embedding="yarn", yarn_factor=4.0)
    scaling = hf.hf_config(model, "qwen3")["rope_scaling"]
    assert scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    back, _ = hf.model_config_from_hf(hf.hf_config(model, "qwen3"))
    assert back.yarn_original_max_position_embeddings == 4096 == model.yarn_original_length


@pytest.mark.parametrize(
    ("gate", "fmt", "overrides"),
    [
        ("baseline", "qwen3", {}),
        ("baseline", "qwen3_moe", {**MOE, "moe_router_norm_topk": False}),
        ("g1-elementwise", "qwen3_next", {"norm_zero_centered": True, "rotary_percent": 0.5}),
        ("g1-elementwise", "qwen3_next", {"norm_zero_centered": True, **MOE}),
        ("g1-elementwise", "paper", {}),
        ("g1-headwise", "paper", {"rotary_base": 500_000}),
        ("baseline", "paper", {"qk_layernorm": False}),
        ("baseline", "qwen3", {"position_embedding": "yarn", "yarn_factor": 4.0, _ORIGINAL: 32}),
        ("baseline", "qwen3_moe", {**MOE, "rotary_interpolation_factor": 2.0}),
        ("g1-elementwise", "qwen3_next", {"norm_zero_centered": True, "rotary_percent": 0.25, "rope_scaling": True}),
        (
            "g1-headwise",
            "paper",
            {"position_embedding": "yarn", "yarn_factor": 2.0, "yarn_beta_fast": 8.0, _ORIGINAL: 64},
        ),
    ],
)
def test_config_round_trip(gate, fmt, overrides):
    model = _model(gate, **overrides)
    config = hf.hf_config(model, fmt)
    assert config["dtype"] == "float32" and config["architectures"] == [hf.ARCHITECTURES[fmt]]
    back, detected = hf.model_config_from_hf(config)
    assert detected == fmt and hf.same_architecture(back, model)
    assert back.effective_ffn_hidden_size == model.effective_ffn_hidden_size  # the FFN as built (gated: shrunk)
    assert hf.megatron_shapes(back) == hf.megatron_shapes(model)


@pytest.mark.parametrize(
    ("fmt", "change", "name"),
    [
        ("qwen3", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
        ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type='dynamic'"),
        ("qwen3", {"hidden_act": "gelu"}, "hidden_act"),
        ("qwen3", {"rope_theta": 10000.5}, "rope_theta"),
        ("qwen3", {"model_type": "llama"}, "model_type"),
        ("qwen3", {"architectures": ["Qwen3ForSequenceClassification"]}, "architectures"),
        ("qwen3_next", {"layer_types": ["linear_attention", "sliding_attention"]}, "sliding_attention"),
        ("qwen3", {"layer_types": ["linear_attention", "full_attention"]}, "linear_attention"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ("paper", {"elementwise_attn_output_gate": True, "headwise_attn_output_gate": True}, "headwise"),
        ("qwen3", {"head_dim": None}, "head_dim"),
    ],
)
def test_configs_megagate_cannot_hold_are_refused(fmt, change, name):
    model = _model(
        "g1-elementwise" if fmt in ("qwen3_next", "paper") else "baseline",
        norm_zero_centered=fmt == "qwen3_next",
        **(MOE if fmt in ("qwen3_moe", "qwen3_next") else {}),
    )
    config = {**hf.hf_config(model, fmt), **change}
    if change.get("head_dim", 0) is None:
        del config["head_dim"]
    with pytest.raises(ConfigError) as e:
        hf.model_config_from_hf(config)
    assert name in _one_line(e)


# --- state dict checks (no megatron needed: the expected tensors come from the config) ----------------------------
def _random_state(model: ModelConfig) -> dict[str, torch.Tensor]:
    return {k: torch.randn(shape) for k, shape in hf.megatron_shapes(model).items()}


def test_state_keys_and_shapes_are_checked_in_one_line():
    model = _model("g1-headwise")
    state = _random_state(model)
    key = "decoder.layers.1.self_attention.linear_qkv.weight"
    with pytest.raises(ConfigError) as e:
        hf.to_hf_state_dict(model, "paper", {k: v for k, v in state.items() if k != key})
    assert f"missing {key}" in _one_line(e)
    with pytest.raises(ConfigError) as e:
        hf.to_hf_state_dict(model, "paper", {**state, "decoder.layers.0.self_attention.gate_weight": torch.ones(3)})
    assert "unexpected decoder.layers.0.self_attention.gate_weight" in _one_line(e)
    with pytest.raises(ConfigError) as e:  # the elementwise model's rows given for a headwise model
        hf.to_hf_state_dict(model, "paper", {**state, key: torch.randn(layout.QkvLayout(N, G, D, D).rows, H)})
    assert key in _one_line(e) and "(144, 40)" in str(e.value) and "(102, 40)" in str(e.value)

    tensors = hf.to_hf_state_dict(model, "paper", state)
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ConfigError) as e:  # a Qwen3-Next q_proj is not a headwise paper one
        hf.from_hf_state_dict(model, "paper", {**tensors, q: torch.randn(2 * N * D, H)})
    assert q in _one_line(e) and "(96, 40)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        hf.from_hf_state_dict(model, "paper", {**tensors, "lm_head.weight": torch.randn(96, H)})
    assert "lm_head.weight" in _one_line(e)
    # an exact copy of the tied embedding is accepted (and not part of the model's tensors)
    same = hf.from_hf_state_dict(model, "paper", {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]})
    assert sorted(same) == sorted(state)


def test_qwen3_next_moe_shared_expert_is_zero_size():
    model = _model("g1-elementwise", norm_zero_centered=True, **MOE)
    tensors = hf.to_hf_state_dict(model, "qwen3_next", _random_state(model))
    prefix = "model.layers.0.mlp."
    assert tensors[prefix + "shared_expert.gate_proj.weight"].shape == (0, H)
    assert tensors[prefix + "shared_expert.down_proj.weight"].shape == (H, 0)
    assert not tensors[prefix + "shared_expert_gate.weight"].any()
    tensors[prefix + "shared_expert_gate.weight"] = torch.ones(1, H)
    with pytest.raises(ConfigError) as e:
        hf.from_hf_state_dict(model, "qwen3_next", tensors)
    assert "shared_expert_gate.weight must be zeros" in _one_line(e)


def test_zero_size_tensors_survive_safetensors(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = _model("g1-elementwise", norm_zero_centered=True, **MOE)
    tensors = hf.to_hf_state_dict(model, "qwen3_next", _random_state(model))
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(tensors, str(path))
    loaded = safetensors_torch.load_file(str(path))
    assert sorted(loaded) == sorted(tensors)
    assert all(torch.equal(loaded[k], tensors[k]) and loaded[k].shape == tensors[k].shape for k in tensors)
    back = hf.from_hf_state_dict(model, "qwen3_next", loaded)
    assert sorted(back) == sorted(hf.megatron_shapes(model))
