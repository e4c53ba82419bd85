"""megagate (megatron HybridModel with GPTModel's names, TP = PP = EP = 1, local backend names) tensors <-> Hugging Face tensors.

Pure reindexing, splitting and concatenation: every tensor that comes out is bit-identical to the values it came
from, contiguous and with its own storage (safetensors writes it as is). Every key and shape going in is checked
against the ModelConfig first; a missing, extra or misshaped tensor is a one-line ConfigError naming the key and
the expected vs given shape, never wrong weights.

    embedding.word_embeddings.weight                  model.embed_tokens.weight
    decoder.layers.N.input_layernorm.weight           model.layers.N.input_layernorm.weight
    decoder.layers.N.self_attention.linear_qkv        model.layers.N.self_attn.{q,k,v}_proj (megagate.model.qkv_layout)
    decoder.layers.N.self_attention.linear_proj       model.layers.N.self_attn.o_proj
    decoder.layers.N.self_attention.{q,k}_layernorm   model.layers.N.self_attn.{q,k}_norm
    decoder.layers.N.pre_mlp_layernorm.weight         model.layers.N.post_attention_layernorm.weight
    decoder.layers.N.mlp.linear_fc1 ([gate; up])      model.layers.N.mlp.{gate,up}_proj
    decoder.layers.N.mlp.linear_fc2                   model.layers.N.mlp.down_proj
    decoder.layers.N.mlp.router.weight                model.layers.N.mlp.gate.weight
    ...mlp.experts.local_experts.E.linear_fc{1,2}     model.layers.N.mlp.experts.E.{gate,up,down}_proj
    decoder.final_layernorm.weight                    model.norm.weight
    output_layer.weight (untied only)                 lm_head.weight (untied only: a tied model has none)

Qwen3.5's Gated DeltaNet layers project with `linear_attn.in_proj_{qkv,z,b,a}` (megagate.interop.hf_qwen35), Qwen3-Next's
with `in_proj_qkvz` / `in_proj_ba` (megagate.interop.hf_hybrid).

Experts are written as transformers writes them to disk (`save_pretrained`, 4.x and 5.x alike, and the Hub's
checkpoints): one tensor per expert, `mlp.experts.E.{gate,up,down}_proj.weight`. transformers 5 holds them fused in
memory (`mlp.experts.gate_up_proj` [E, 2f, h], `mlp.experts.down_proj` [E, h, f], converted on load and save); a
state dict in that layout is read too (`unfuse_experts`), and `fuse_experts` gives it (for `load_state_dict`).

Qwen3-Next's and Qwen3.5-MoE's MoE block always builds a shared expert; megagate's MoE may have none. It is represented exactly by
shared_expert_intermediate_size 0: `shared_expert.{gate,up}_proj.weight` [0, h] and `down_proj.weight` [h, 0] are
zero-size (their output is exactly 0, so `sigmoid(shared_expert_gate(x)) * 0` adds nothing), and
`shared_expert_gate.weight` [1, h] is written as zeros; reading requires exactly that (zeros), so HF -> megagate ->
HF gives back the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from megagate.errors import ConfigError
from megagate.interop import hf_hybrid, hf_qwen35
from megagate.interop.hf_config import GATED, QWEN3_5, SHARED_EXPERT, check_exportable, gate_name
from megagate.model import hybrid, qkv_layout
from megagate.model.model_config import ModelConfig

Shape = tuple[int, ...]


def _owned(t: Tensor) -> Tensor:
    """A contiguous copy with its own storage (bit-identical)."""
    return torch.clone(t.detach(), memory_format=torch.contiguous_format)


def _qkv_rows(model: ModelConfig, fmt: str) -> tuple[int, int]:
    """(megagate linear_qkv rows, HF q_proj rows)."""
    n, g, d = model.num_attention_heads, model.num_query_groups, model.head_dim
    layout = qkv_layout.qkv_layout(model.gate, n, g, d)
    return layout.rows, layout.rows - 2 * g * d


def megatron_shapes(model: ModelConfig) -> dict[str, Shape]:
    """Every tensor of megagate's model state_dict() (TP = PP = EP = 1, local backend, no `_extra_state`)."""
    h, v, d = model.hidden_size, model.vocab_size, model.head_dim
    shapes: dict[str, Shape] = {"embedding.word_embeddings.weight": (v, h)}
    qkv_rows, _ = _qkv_rows(model, "")
    for i in _layers(model, hybrid.GDN):
        shapes.update({f"decoder.layers.{i}.{k}": s for k, s in hf_hybrid.megatron_gdn_shapes(model).items()})
    for i in range(model.num_layers):
        p = f"decoder.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        if i in _layers(model, hybrid.ATTENTION):
            shapes[p + "self_attention.linear_qkv.weight"] = (qkv_rows, h)
            shapes[p + "self_attention.linear_proj.weight"] = (h, model.num_attention_heads * d)
        if model.qk_layernorm and i in _layers(model, hybrid.ATTENTION):
            shapes[p + "self_attention.q_layernorm.weight"] = (d,)
            shapes[p + "self_attention.k_layernorm.weight"] = (d,)
        shapes[p + "pre_mlp_layernorm.weight"] = (h,)
        if model.is_moe:
            f = model.moe_ffn_hidden_size
            shapes[p + "mlp.router.weight"] = (model.num_experts, h)
            shapes.update({p + k: s for k, s in hf_hybrid.megatron_shared_expert_shapes(model).items()})
            for e in range(model.num_experts):
                shapes[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * f, h)
                shapes[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, f)
        else:
            f = model.effective_ffn_hidden_size
            shapes[p + "mlp.linear_fc1.weight"] = (2 * f, h)
            shapes[p + "mlp.linear_fc2.weight"] = (h, f)
    shapes["decoder.final_layernorm.weight"] = (h,)
    if not model.tie_embeddings:
        shapes["output_layer.weight"] = (v, h)
    return shapes


def _layers(model: ModelConfig, symbol: str) -> list[int]:
    """The layers whose mixer is `symbol` (megagate.model.hybrid: gated attention or Gated DeltaNet)."""
    return [i for i, s in enumerate(hybrid.pattern(model)) if s == symbol]


def _mlp_pairs(mg: str, hf: str) -> list[tuple[str, str]]:
    return [(mg + "linear_fc2.weight", hf + "down_proj.weight")]


def _gdn_projection_shapes(model: ModelConfig, fmt: str) -> dict[str, Shape]:
    """A GDN layer's input projections in `fmt` (keys after `model.layers.N.`)."""
    if fmt in QWEN3_5:
        return {hf_hybrid.HF + k: s for k, s in hf_qwen35.projection_shapes(model).items()}
    return hf_hybrid.hf_gdn_projection_shapes(model)


def _direct_pairs(model: ModelConfig) -> list[tuple[str, str]]:
    """(megagate key, HF key) of every tensor copied unchanged."""
    pairs = [("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    for i in range(model.num_layers):
        p, q = f"decoder.layers.{i}.", f"model.layers.{i}."
        pairs += [
            (p + "input_layernorm.weight", q + "input_layernorm.weight"),
            (p + "pre_mlp_layernorm.weight", q + "post_attention_layernorm.weight"),
        ]
        if i in _layers(model, hybrid.GDN):
            pairs += [(p + mg, q + hf) for mg, hf in hf_hybrid.gdn_direct_pairs()]
        else:
            pairs.append((p + "self_attention.linear_proj.weight", q + "self_attn.o_proj.weight"))
        if model.qk_layernorm and i in _layers(model, hybrid.ATTENTION):
            pairs += [
                (p + "self_attention.q_layernorm.weight", q + "self_attn.q_norm.weight"),
                (p + "self_attention.k_layernorm.weight", q + "self_attn.k_norm.weight"),
            ]
        if model.is_moe:
            pairs.append((p + "mlp.router.weight", q + "mlp.gate.weight"))
            pairs += [(p + mg, q + hf) for mg, hf in hf_hybrid.shared_expert_direct_pairs(model)]
            for e in range(model.num_experts):
                pairs += _mlp_pairs(p + f"mlp.experts.local_experts.{e}.", q + f"mlp.experts.{e}.")
        else:
            pairs += _mlp_pairs(p + "mlp.", q + "mlp.")
    pairs.append(("decoder.final_layernorm.weight", "model.norm.weight"))
    if not model.tie_embeddings:
        pairs.append(("output_layer.weight", "lm_head.weight"))
    return pairs


def _fc1_pairs(model: ModelConfig) -> list[tuple[str, str]]:
    """(megagate linear_fc1 key, HF MLP prefix) of every SwiGLU fc1 ([gate; up] halves)."""
    pairs = []
    for i in range(model.num_layers):
        p, q = f"decoder.layers.{i}.", f"model.layers.{i}."
        if model.is_moe:
            for e in range(model.num_experts):
                pairs.append((p + f"mlp.experts.local_experts.{e}.linear_fc1.weight", q + f"mlp.experts.{e}."))
            if model.moe_shared_expert_intermediate_size:
                pairs.append((p + "mlp.shared_experts.linear_fc1.weight", q + "mlp.shared_expert."))
        else:
            pairs.append((p + "mlp.linear_fc1.weight", q + "mlp."))
    return pairs


def _shared_expert_shapes(model: ModelConfig, fmt: str) -> dict[str, Shape]:
    """Qwen3-Next's zero-size shared expert of a MoE model without one (see the module docstring)."""
    if fmt not in SHARED_EXPERT or not model.is_moe or model.moe_shared_expert_intermediate_size:
        return {}
    h, shapes = model.hidden_size, {}
    for i in range(model.num_layers):
        q = f"model.layers.{i}.mlp."
        shapes[q + "shared_expert.gate_proj.weight"] = (0, h)
        shapes[q + "shared_expert.up_proj.weight"] = (0, h)
        shapes[q + "shared_expert.down_proj.weight"] = (h, 0)
        shapes[q + "shared_expert_gate.weight"] = (1, h)
    return shapes


def hf_shapes(model: ModelConfig, fmt: str) -> dict[str, Shape]:
    """Every tensor of the HF model's state dict in `fmt` (a tied model has no lm_head.weight, as HF saves it)."""
    check_exportable(model, fmt)
    mg = megatron_shapes(model)
    shapes = {hf: mg[key] for key, hf in _direct_pairs(model)}
    _, q_rows = _qkv_rows(model, fmt)
    kv = (model.num_query_groups * model.head_dim, model.hidden_size)
    for i in _layers(model, hybrid.GDN):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in _gdn_projection_shapes(model, fmt).items()})
    for i in _layers(model, hybrid.ATTENTION):
        q = f"model.layers.{i}.self_attn."
        shapes[q + "q_proj.weight"] = (q_rows, model.hidden_size)
        shapes[q + "k_proj.weight"] = kv
        shapes[q + "v_proj.weight"] = kv
    for key, prefix in _fc1_pairs(model):
        rows, h = mg[key]
        shapes[prefix + "gate_proj.weight"] = (rows // 2, h)
        shapes[prefix + "up_proj.weight"] = (rows // 2, h)
    shapes.update(_shared_expert_shapes(model, fmt))
    return shapes


def _check_tensors(what: str, tensors: Mapping[str, Tensor], expected: Mapping[str, Shape]) -> None:
    """Exactly the expected keys, each with the expected shape (one-line ConfigError otherwise)."""
    missing = [k for k in expected if k not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"{what}: missing {missing[0]} (expected shape {expected[missing[0]]}){more}")
    extra = [k for k in tensors if k not in expected]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        shape = tuple(getattr(tensors[extra[0]], "shape", ()))
        raise ConfigError(f"{what}: unexpected {extra[0]} (shape {shape}) for this model config{more}")
    for key, shape in expected.items():
        given = tuple(getattr(tensors[key], "shape", ()))
        if not isinstance(tensors[key], Tensor) or given != tuple(shape):
            raise ConfigError(f"{what}: {key} has shape {given}, expected {tuple(shape)} for this model config")


def _qkv_converters(model: ModelConfig, fmt: str) -> tuple[Callable, Callable]:
    """(megagate linear_qkv -> (q, k, v), (q, k, v) -> linear_qkv) for the format's layout."""
    n, g, d = model.num_attention_heads, model.num_query_groups, model.head_dim
    name = gate_name(model.gate)
    if name == "baseline":
        return (lambda w: qkv_layout.to_qwen3(w, n, g, d)), (lambda q, k, v: qkv_layout.from_qwen3(q, k, v, n, g, d))
    if fmt in GATED:  # Qwen3-Next's and Qwen3.5's q_proj: per head [q; gate]
        return (
            lambda w: qkv_layout.to_qwen3_next(w, n, g, d),
            lambda q, k, v: qkv_layout.from_qwen3_next(q, k, v, n, g, d),
        )
    granularity = "elementwise" if name == "g1-elementwise" else "headwise"
    return (
        lambda w: qkv_layout.to_paper(w, n, g, d, granularity),
        lambda q, k, v: qkv_layout.from_paper(q, k, v, n, g, d, granularity),
    )


def _without_extra_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: v for k, v in state.items() if not k.endswith("_extra_state")}


def to_hf_state_dict(model: ModelConfig, fmt: str, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """megagate model state_dict() (TP = PP = EP = 1; `_extra_state` entries are ignored) -> HF tensors."""
    check_exportable(model, fmt)
    state = _without_extra_state(state)
    _check_tensors("megagate state", state, megatron_shapes(model))
    out = {hf: _owned(state[key]) for key, hf in _direct_pairs(model)}
    split_qkv, _ = _qkv_converters(model, fmt)
    for i in _layers(model, hybrid.GDN):
        in_proj, prefix = state[f"decoder.layers.{i}.self_attention.in_proj.weight"], f"model.layers.{i}.linear_attn."
        if fmt in QWEN3_5:
            out.update({prefix + k: t for k, t in hf_qwen35.in_proj_to_hf(model, in_proj).items()})
            continue
        qkvz, ba = hf_hybrid.in_proj_to_hf(model, in_proj)
        out[prefix + "in_proj_qkvz.weight"], out[prefix + "in_proj_ba.weight"] = qkvz, ba
    for i in _layers(model, hybrid.ATTENTION):
        q_proj, k_proj, v_proj = split_qkv(state[f"decoder.layers.{i}.self_attention.linear_qkv.weight"])
        prefix = f"model.layers.{i}.self_attn."
        out.update(
            {prefix + "q_proj.weight": q_proj, prefix + "k_proj.weight": k_proj, prefix + "v_proj.weight": v_proj}
        )
    for key, prefix in _fc1_pairs(model):
        gate, up = torch.chunk(state[key], 2, dim=0)  # megatron's SwiGLU: silu(first half) * second half
        out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = _owned(gate), _owned(up)
    dtype = state["embedding.word_embeddings.weight"].dtype
    for key, shape in _shared_expert_shapes(model, fmt).items():
        out[key] = torch.zeros(shape, dtype=dtype)
    return out


def from_hf_state_dict(model: ModelConfig, fmt: str, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """HF tensors of `fmt` -> the megagate model tensors `load_state_dict(strict=False)` needs (all but
    `_extra_state`). A tied model's lm_head.weight may be present only as an exact copy of the embedding."""
    check_exportable(model, fmt)
    tensors = unfuse_experts(tensors)
    if model.tie_embeddings and "lm_head.weight" in tensors:
        head, embed = tensors.pop("lm_head.weight"), tensors.get("model.embed_tokens.weight")
        if embed is None or head.shape != embed.shape or not torch.equal(head, embed):
            raise ConfigError(
                "HF tensors: lm_head.weight differs from model.embed_tokens.weight, but the config ties them"
            )
    _check_tensors(f"HF {fmt} tensors", tensors, hf_shapes(model, fmt))
    for key in _shared_expert_shapes(model, fmt):
        if key.endswith("shared_expert_gate.weight") and torch.count_nonzero(tensors[key]):
            raise ConfigError(
                f"HF tensors: {key} must be zeros with shared_expert_intermediate_size 0 (megagate has no shared expert)"
            )
    out = {key: _owned(tensors[hf]) for key, hf in _direct_pairs(model)}
    _, fuse_qkv = _qkv_converters(model, fmt)
    for i in _layers(model, hybrid.GDN):
        prefix, key = f"model.layers.{i}.linear_attn.", f"decoder.layers.{i}.self_attention.in_proj.weight"
        if fmt in QWEN3_5:
            out[key] = hf_qwen35.in_proj_from_hf(
                {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            )
            continue
        qkvz, ba = tensors[prefix + "in_proj_qkvz.weight"], tensors[prefix + "in_proj_ba.weight"]
        out[key] = hf_hybrid.in_proj_from_hf(model, qkvz, ba)
    for i in _layers(model, hybrid.ATTENTION):
        prefix = f"model.layers.{i}.self_attn."
        q, k, v = (tensors[prefix + f"{name}_proj.weight"] for name in ("q", "k", "v"))
        out[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = _owned(fuse_qkv(q, k, v))
    for key, prefix in _fc1_pairs(model):
        out[key] = torch.cat([tensors[prefix + "gate_proj.weight"], tensors[prefix + "up_proj.weight"]], dim=0)
    return out


_FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def unfuse_experts(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """transformers 5's in-memory expert layout (`mlp.experts.gate_up_proj` [E, 2f, h] = [gate; up] per expert,
    `mlp.experts.down_proj` [E, h, f]) -> one tensor per expert, as on disk; other tensors unchanged."""
    out: dict[str, Tensor] = {}
    for key, tensor in tensors.items():
        fused = next((f for f in _FUSED if key.endswith(f)), None)
        if fused is None:
            out[key] = tensor
            continue
        prefix = key[: -len(fused)] + ".mlp.experts."
        if tensor.dim() != 3 or (fused == _FUSED[0] and tensor.shape[1] % 2):
            raise ConfigError(f"HF tensors: {key} has shape {tuple(tensor.shape)}, not [experts, rows, columns]")
        for e, w in enumerate(tensor.unbind(0)):
            if fused == _FUSED[0]:
                gate, up = torch.chunk(w, 2, dim=0)
                out[prefix + f"{e}.gate_proj.weight"], out[prefix + f"{e}.up_proj.weight"] = _owned(gate), _owned(up)
            else:
                out[prefix + f"{e}.down_proj.weight"] = _owned(w)
    return out


def fuse_experts(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """One tensor per expert -> transformers 5's in-memory layout (the inverse of `unfuse_experts`)."""
    out: dict[str, Tensor] = {}
    experts: dict[str, dict[int, dict[str, Tensor]]] = {}
    for key, tensor in tensors.items():
        head, sep, tail = key.partition(".mlp.experts.")
        index, _, name = tail.partition(".")
        if not sep or not index.isdigit() or name not in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
            out[key] = tensor
            continue
        experts.setdefault(head, {}).setdefault(int(index), {})[name] = tensor
    for head, per_expert in experts.items():
        order = [per_expert[e] for e in sorted(per_expert)]
        gate_up = [torch.cat([p["gate_proj.weight"], p["up_proj.weight"]], dim=0) for p in order]
        out[head + _FUSED[0]] = torch.stack(gate_up)
        out[head + _FUSED[1]] = torch.stack([p["down_proj.weight"] for p in order])
    return out
