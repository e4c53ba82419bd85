"""megagate models and transformers' own model classes compute the same logits on the same weights (fp32, CPU).

For each format, dense and MoE where the format allows, two head/group shapes, RoPE on: a randomly initialised
megagate GPTModel (norms and router perturbed so mistakes show) goes to HF through `to_hf_state_dict` and is loaded
strictly into transformers' own `...ForCausalLM(config)` built from `hf_config`; and an HF model with its own random
weights comes into megagate through `from_hf_state_dict`. Both directions compare logits and round-trip bit-exactly.

The paper's released code has no transformers class: `PaperQwen3Attention` below (test-only) is transformers' own
`Qwen3Attention` with the paper's q_proj unpacking (per KV group [q of the group's heads | their gates], sigmoid gate
on the SDPA output) and its `use_qk_norm` switch, i.e. what loading the paper's modeling_qwen3.py computes.
"""

from __future__ import annotations

import pytest
import torch

from megagate.interop import hf
from megagate.model import gate as gates
from megagate.model import qkv_layout
from megagate.model.build import build_gpt_model, transformer_config
from megagate.model.model_config import ModelConfig

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

BATCH, SEQ, VOCAB = 2, 12, 96
TOL = 1e-5
SHAPES = {
    "4q2kv-hn16": dict(num_attention_heads=4, num_query_groups=2, head_dim=16, hidden_size=48),
    "6q3kv-hn8": dict(num_attention_heads=6, num_query_groups=3, head_dim=8, hidden_size=40),
}
FORMAT_GATE = {"qwen3": "baseline", "qwen3_moe": "baseline", "qwen3_next": "g1-elementwise"}


def model_config(fmt: str, shape: str, moe: bool, gate: str | None = None, **overrides: object) -> ModelConfig:
    values: dict = dict(
        num_layers=2,
        ffn_hidden_size=64,
        vocab_size=VOCAB,
        max_sequence_length=64,
        rotary_base=10_000,
        tie_embeddings=not moe,  # both embedding layouts are covered
        gate=gates.preset(gate or FORMAT_GATE[fmt]),
        norm_zero_centered=fmt == "qwen3_next",
        rotary_percent=0.5 if fmt == "qwen3_next" else 1.0,  # Qwen3-Next's partial rotary
        **SHAPES[shape],
    )
    if moe:
        values.update(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
    values.update(overrides)
    return ModelConfig(**values)


def _norm(name: str) -> bool:
    return name.endswith(("layernorm.weight", "norm.weight"))


@torch.no_grad()
def randomize_megagate(model: torch.nn.Module, mc: ModelConfig, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if _norm(name):  # away from 1 (plain) / 0 (zero-centred) so a wrong norm convention shows
            p.copy_((0.0 if mc.norm_zero_centered else 1.0) + 0.3 * noise)
        elif "router" in name:
            p.copy_(noise)  # decisive, tie-free routing
        elif "word_embeddings" in name or "output_layer" in name:
            p.copy_(0.3 * noise)  # logits of a few units: 1e-5 stays a test of the computation, not of fp32 rounding
        else:
            p.copy_(0.1 * noise)


@torch.no_grad()
def perturb_hf(model: torch.nn.Module, seed: int) -> None:
    """HF's own init leaves norms at 1 (or 0 for Qwen3-Next): move them, and make routing decisive."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "shared_expert_gate" in name:
            p.zero_()  # megagate's representation of "no shared expert" (see megagate.interop.hf_weights)
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
        elif name.endswith("mlp.gate.weight"):
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.mul_(5.0)  # std 0.02 -> 0.1: attention patterns far from uniform


class PaperQwen3Attention(modeling_qwen3.Qwen3Attention):
    """transformers' Qwen3Attention with the paper's gated q_proj (test-only; see the module docstring)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        heads, self.kv = config.num_attention_heads, config.num_key_value_heads
        self.heads, self.npg = heads, heads // self.kv
        self.width = (
            self.head_dim if config.elementwise_attn_output_gate else 1 if config.headwise_attn_output_gate else 0
        )
        rows = heads * self.head_dim + heads * self.width
        self.q_proj = torch.nn.Linear(config.hidden_size, rows, bias=config.qkv_bias)
        if not config.use_qk_norm:
            self.q_norm = self.k_norm = torch.nn.Identity()

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        b, s, _ = hidden_states.shape
        hd = self.head_dim
        q = self.q_proj(hidden_states).view(b, s, self.kv, -1)  # per KV group [q heads | gates]
        q, gate = torch.split(q, [self.npg * hd, self.npg * self.width], dim=-1)
        query = self.q_norm(q.reshape(b, s, -1, hd)).transpose(1, 2)
        key = self.k_norm(self.k_proj(hidden_states).view(b, s, -1, hd)).transpose(1, 2)
        value = self.v_proj(hidden_states).view(b, s, -1, hd).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = modeling_qwen3.apply_rotary_pos_emb(query, key, cos, sin)
        out, _ = modeling_qwen3.eager_attention_forward(
            self, query, key, value, attention_mask, scaling=self.scaling, dropout=0.0
        )  # [b, s, heads, hd]
        if self.width:
            out = out * torch.sigmoid(gate.reshape(b, s, self.heads, self.width))
        return self.o_proj(out.reshape(b, s, -1)), None


def build_hf(mc: ModelConfig, fmt: str) -> torch.nn.Module:
    """transformers' own class for the format (the paper's: Qwen3 with PaperQwen3Attention), fp32, eager."""
    config = transformers.AutoConfig.for_model(**hf.hf_config(mc, fmt), attn_implementation="eager")
    model = getattr(transformers, hf.ARCHITECTURES[fmt])(config)
    if fmt == "paper":
        for i, layer in enumerate(model.model.layers):
            layer.self_attn = PaperQwen3Attention(config, i)
        model.post_init()
    return model.float().eval()


def load_hf(model: torch.nn.Module, tensors: dict, tied: bool) -> None:
    """Tensors as on disk (one per expert) into transformers' module (5.x: experts fused in memory)."""
    result = model.load_state_dict(hf.fuse_experts(tensors), strict=not tied)
    if tied:  # HF's tied models hold lm_head as the embedding itself; no separate tensor is written
        assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
        assert model.lm_head.weight is model.model.embed_tokens.weight


def hf_tensors(model: torch.nn.Module, tied: bool) -> dict:
    """transformers' module's tensors as on disk (one per expert; what `save_pretrained` writes)."""
    state = hf.unfuse_experts(model.state_dict())
    if tied:
        state.pop("lm_head.weight")
    return state


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return ids, torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)


@torch.no_grad()
def logits_pair(mg: torch.nn.Module, model: torch.nn.Module) -> float:
    ids, positions = tokens()
    ours = mg(ids, positions, None)  # causal mask; [b, s, vocab]
    theirs = model(input_ids=ids, use_cache=False).logits
    assert ours.shape == theirs.shape == (BATCH, SEQ, VOCAB)
    return (ours - theirs).abs().max().item()


def megagate_state(mg: torch.nn.Module) -> dict:
    return {k: v for k, v in mg.state_dict().items() if not k.endswith("_extra_state")}


def assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


CASES = [("qwen3", None, False, shape, {}) for shape in SHAPES] + [
    ("qwen3_moe", None, True, "4q2kv-hn16", {"moe_router_norm_topk": True}),
    ("qwen3_moe", None, True, "4q2kv-hn16", {"moe_router_norm_topk": False}),
    ("qwen3_moe", None, True, "6q3kv-hn8", {"moe_router_norm_topk": True}),
    ("qwen3_moe", None, True, "6q3kv-hn8", {"moe_router_norm_topk": False}),
    ("qwen3_next", None, False, "4q2kv-hn16", {}),
    ("qwen3_next", None, False, "6q3kv-hn8", {}),
    ("qwen3_next", None, True, "4q2kv-hn16", {}),
    ("qwen3_next", None, True, "6q3kv-hn8", {"moe_router_norm_topk": False}),
    ("paper", "g1-elementwise", False, "4q2kv-hn16", {}),
    ("paper", "g1-elementwise", False, "6q3kv-hn8", {}),
    ("paper", "g1-headwise", False, "4q2kv-hn16", {}),
    ("paper", "g1-headwise", False, "6q3kv-hn8", {}),
    ("paper", "baseline", False, "4q2kv-hn16", {"qk_layernorm": False}),
]


def _case_id(case) -> str:
    fmt, gate, moe, shape, extra = case
    parts = [fmt, gate or FORMAT_GATE[fmt], "moe" if moe else "dense", shape]
    parts += [f"{k}={v}" for k, v in extra.items()]
    return "-".join(parts)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_logits_match_transformers_both_ways(megatron_world, case):
    fmt, gate, moe, shape, extra = case
    mc = model_config(fmt, shape, moe, gate, **extra)
    assert fmt in hf.formats_for(mc)
    mg = build_gpt_model(mc, transformer_config(mc)).eval()
    randomize_megagate(mg, mc, seed=1)

    # megagate -> HF: transformers' class on megagate's weights
    state = megagate_state(mg)
    tensors = hf.to_hf_state_dict(mc, fmt, state)
    for t in tensors.values():
        assert t.is_contiguous()
    assert len({t.untyped_storage().data_ptr() for t in tensors.values() if t.numel()}) == sum(
        1 for t in tensors.values() if t.numel()
    )  # no two outputs share storage (safetensors needs that)
    model = build_hf(mc, fmt)
    load_hf(model, tensors, mc.tie_embeddings)
    to_hf_diff = logits_pair(mg, model)
    assert_same_tensors(hf.from_hf_state_dict(mc, fmt, tensors), state)  # megagate -> HF -> megagate: bit-exact

    # HF -> megagate: transformers' own random weights in megagate
    native = build_hf(mc, fmt)
    perturb_hf(native, seed=2)
    native_tensors = hf_tensors(native, mc.tie_embeddings)
    imported = hf.from_hf_state_dict(mc, fmt, native_tensors)
    result = mg.load_state_dict(imported, strict=False)
    assert not result.unexpected_keys and all(k.endswith("_extra_state") for k in result.missing_keys)
    from_hf_diff = logits_pair(mg, native)
    assert_same_tensors(hf.to_hf_state_dict(mc, fmt, imported), native_tensors)  # HF -> megagate -> HF: identical

    print(f"\n{_case_id(case)}: max|dlogit| megagate->HF {to_hf_diff:.2e}, HF->megagate {from_hf_diff:.2e}")
    assert to_hf_diff < TOL and from_hf_diff < TOL


@pytest.mark.parametrize("shape", list(SHAPES))
def test_wrong_layout_gives_other_logits(megatron_world, shape):
    """The paper's elementwise q_proj and Qwen3-Next's have the same shape: converting paper weights with
    `from_qwen3_next` is not detectable by shape, and gives a model whose logits visibly differ from the paper
    model's; `from_paper` (the right format) matches."""
    mc = model_config("paper", shape, False, "g1-elementwise")
    native = build_hf(mc, "paper")
    perturb_hf(native, seed=4)
    tensors = hf_tensors(native, mc.tie_embeddings)
    mg = build_gpt_model(mc, transformer_config(mc)).eval()
    mg.load_state_dict(hf.from_hf_state_dict(mc, "paper", tensors), strict=False)
    right = logits_pair(mg, native)
    n, g, d = mc.num_attention_heads, mc.num_query_groups, mc.head_dim
    wrong = {}
    for i in range(mc.num_layers):
        q, k, v = (tensors[f"model.layers.{i}.self_attn.{x}_proj.weight"] for x in "qkv")
        assert q.shape == (2 * n * d, mc.hidden_size)  # exactly Qwen3-Next's q_proj shape
        wrong[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = qkv_layout.from_qwen3_next(q, k, v, n, g, d)
    mg.load_state_dict(wrong, strict=False)
    wrong_diff = logits_pair(mg, native)
    print(f"\npaper elementwise {shape}: right layout {right:.2e}, Qwen3-Next layout {wrong_diff:.2e}")
    assert right < TOL and wrong_diff > 1e-2
