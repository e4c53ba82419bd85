"""Layout-independent weight initialisation: the same seed gives the same full model for any TP / PP / EP sizes.

Each parameter's *full* tensor is drawn from a generator seeded by (seed, its global name) — the name with the
global layer number and the global expert index — and every rank keeps its own shard. Runs with different
parallel layouts therefore start from identical weights, so their loss curves can be compared step by step, and a
checkpoint written under one layout means the same model under another.

Every parameter gets its value from exactly one explicit rule, and a parameter that no rule covers is an error:

* gate parameters: the rule of their entry in the gate table (megagate.model.gate_params), per attention module
  (gate rows fused into linear_qkv whose rule is zeros: linear_qkv's draw with those rows of the full tensor zeroed,
  so the other rows are the default init's, and every TP size gets the same weights);
* `RULES` below, matched on the parameter's name: megatron's initialisation, normal(0, σ) for weights, σ/√(2L) for
  the output projections of each sublayer (`linear_proj`, `linear_fc2`), ones for norm weights, zeros for biases.

Naming and sharding are explicit too: `_global_name` (layer and expert renumbering, the tied output layer;
`global_expert_name` gives every expert implementation — SequentialMLP, TorchGroupedMLP, TEGroupedMLP — the same
name per global expert, hence the same values) and
`_shard` (megatron's TP attributes, SwiGLU fc1 halves; expert weights over the expert-tensor-parallel group).
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass

import torch

from megagate.model.attention import GatedSelfAttention
from megagate.model.gate_params import GateParam
from megagate.model.qkv_layout import qkv_layout

_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")
# SequentialMLP's and TorchGroupedMLP's experts: `...mlp.experts.local_experts.<local index>.linear_fc{1,2}.weight`
_EXPERT = re.compile(r"^(.*local_experts\.)(\d+)(\..*)$")
# TEGroupedMLP's experts (TE GroupedLinear's numbered parameters): `...mlp.experts.linear_fc{1,2}.weight<local index>`
_TE_GROUPED_EXPERT = re.compile(r"^(.*\.experts\.)(linear_fc[12])\.(weight|bias)(\d*)$")


@dataclass(frozen=True)
class Rule:
    """An initial value for the parameters whose (global) name matches `pattern`."""

    what: str
    pattern: re.Pattern[str]
    init: str  # zeros | ones | normal (σ) | normal_scaled (σ/√(2L)) | log_uniform_1_16 (log U(1, 16))


RULES: tuple[Rule, ...] = (
    Rule("bias", re.compile(r"(^|\.)(layer_norm_)?bias$"), "zeros"),
    # local norms (input_layernorm, pre_mlp_layernorm, q/k_layernorm, final_layernorm, sandwich `*_bda.norm`) and
    # the norm fused into TE's LayerNormLinear (`layer_norm_weight`)
    # Qwen3-Next's gated output norm of a Gated DeltaNet layer is plain (w) in every model (megagate.model.gdn)
    Rule("GDN output norm weight", re.compile(r"\.out_norm\.weight$"), "ones"),
    Rule("norm weight", re.compile(r"(layernorm\.weight|\.norm\.weight|\.layer_norm_weight)$"), "ones"),
    Rule("sublayer output projection", re.compile(r"\.(linear_proj|linear_fc2)\.weight$"), "normal_scaled"),
    Rule("input projection", re.compile(r"\.(linear_qkv|linear_fc1)\.weight$"), "normal"),
    Rule("MoE router", re.compile(r"\.router\.weight$"), "normal"),
    Rule("shared expert gate", re.compile(r"\.shared_experts\.gate_weight$"), "normal"),
    # Gated DeltaNet (megatron's initialisation: A = U(1, 16), dt_bias 1; the conv like the projections, as
    # transformers initialises Qwen3-Next's)
    Rule("GDN input projection", re.compile(r"\.in_proj\.weight$"), "normal"),
    Rule("GDN output projection", re.compile(r"\.out_proj\.weight$"), "normal_scaled"),
    Rule("GDN conv", re.compile(r"\.conv1d\.weight$"), "normal"),
    Rule("GDN dt bias", re.compile(r"\.dt_bias$"), "ones"),
    Rule("GDN decay", re.compile(r"\.A_log$"), "log_uniform_1_16"),
    # the learnable softmax sink (model.softmax_type=learnable): megatron's init_method, normal(0, σ), per head
    Rule("softmax sink logit", re.compile(r"\.core_attention\.softmax_offset$"), "normal"),
    Rule("embedding / output layer", re.compile(r"^(embedding\.word_embeddings|output_layer)\.weight$"), "normal"),
)


def rule_for(name: str) -> Rule:
    """The first rule matching `name` (a global parameter name); ValueError naming it if none does."""
    for rule in RULES:
        if rule.pattern.search(name):
            return rule
    raise ValueError(
        f"no initialisation rule covers parameter {name!r}: add one to megagate.model.init.RULES, or declare a gate "
        "parameter in megagate.model.gate_params"
    )


def global_expert_name(name: str, ep_rank: int, num_local_experts: int) -> str:
    """The full-model name of a parameter, for expert parameters SequentialMLP's name with the GLOBAL expert index.

    Every expert implementation maps to the same name, so an expert gets the same values from SequentialMLP,
    TorchGroupedMLP (same names) and TEGroupedMLP (`experts.linear_fc1.weight3` -> `experts.local_experts.<g>.
    linear_fc1.weight`), under any EP size: this EP rank holds experts [ep_rank·local, (ep_rank+1)·local).
    Other names come back unchanged."""
    offset = ep_rank * num_local_experts
    match = _EXPERT.match(name)
    if match:
        return f"{match.group(1)}{int(match.group(2)) + offset}{match.group(3)}"
    match = _TE_GROUPED_EXPERT.match(name)
    if match:
        head, linear, kind, index = match.groups()
        if not index:  # TE >= 2.14's moe_single_grouped_weight: one tensor for all experts
            raise ValueError(
                f"expert parameter {name!r} holds all local experts in one tensor (moe_single_grouped_weight): "
                "layout-independent initialisation needs one tensor per expert; set moe_single_grouped_weight=False"
            )
        return f"{head}local_experts.{int(index) + offset}.{linear}.{kind}"
    return name


def _global_name(name: str, chunk: torch.nn.Module, ep_rank: int) -> str:
    """The parameter's name in the full model: global layer number, global expert index, tied embedding."""
    if name == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights", False):
        return "embedding.word_embeddings.weight"  # the last stage's copy of a tied embedding (PP > 1)
    layer_match = _LAYER.match(name)
    if layer_match:
        layer = chunk.decoder.layers[int(layer_match.group(2))]
        name = f"{layer_match.group(1)}{layer.layer_number - 1}{layer_match.group(3)}"
        if ".experts." in name:  # SequentialMLP, TorchGroupedMLP and TEGroupedMLP all have num_local_experts
            name = global_expert_name(name, ep_rank, layer.mlp.experts.num_local_experts)
    return name


def _gate_entries(chunk: torch.nn.Module) -> tuple[dict[str, GateParam], dict[str, torch.Tensor]]:
    """({parameter name in `chunk`: its gate-table entry} for every gate parameter built as its own tensor,
    {linear_qkv weight name: the full-tensor indices of its fused gate rows} where those rows start at zero)."""
    entries, zero_rows = {}, {}
    for prefix, module in chunk.named_modules():
        if isinstance(module, GatedSelfAttention):
            for entry in module.gate_params:
                if not entry.in_linear_qkv:
                    entries[f"{prefix}.{entry.name}" if prefix else entry.name] = entry
                elif entry.init == "zeros":
                    # drawn with the rest of linear_qkv, then the gate rows of the full tensor set to zero
                    zero_rows[f"{prefix}.linear_qkv.weight"] = _fused_gate_rows(module)
                elif rule_for(f"{prefix}.linear_qkv.weight").init != entry.init:
                    # fused rows are drawn with the rest of linear_qkv: the table must not promise another value
                    raise ValueError(f"{prefix}: fused gate rows want init={entry.init!r}, linear_qkv gives another")
    return entries, zero_rows


def _fused_gate_rows(module: GatedSelfAttention) -> torch.Tensor:
    """Indices of the gate rows in the full (unsharded) linear_qkv weight of `module`."""
    cfg = module.config
    full = qkv_layout(module.gate, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels)
    keys = full.row_keys()
    return torch.tensor([i for i, key in enumerate(keys) if key[0] in ("q_gate", "kv_gate")], dtype=torch.long)


def _full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
        shape[param.partition_dim] *= tp_size
    return tuple(shape)


def _gdn_sections(chunk: torch.nn.Module) -> dict[str, list[int]]:
    """{parameter name: its full rows' sections} for the Gated DeltaNet tensors whose TP shard is a slice of each
    section (in_proj: q, k, v, z, beta, alpha; conv1d: q, k, v), not one slice of the whole."""
    from megagate.model.gdn import GatedDeltaNet

    sections = {}
    for prefix, module in chunk.named_modules():
        if isinstance(module, GatedDeltaNet):
            tp = module.tp_size
            sections[f"{prefix}.in_proj.weight"] = [s * tp for s in module.in_proj_split_sections]
            sections[f"{prefix}.conv1d.weight"] = [module.qk_dim, module.qk_dim, module.v_dim]
    return sections


def _shard(
    full: torch.Tensor,
    name: str,
    param: torch.Tensor,
    rank: int,
    size: int,
    glu: bool,
    sections: list[int] | None = None,
) -> torch.Tensor:
    """This rank's part of a full tensor, following megatron's tensor-parallel attributes."""
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return full
    if sections is not None:
        return torch.cat([part.chunk(size, 0)[rank] for part in full.split(sections, dim=0)])
    if glu and name.endswith("linear_fc1.weight"):  # SwiGLU fc1 = [gate; up], each sharded separately
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]])
    return full.chunk(size, dim=param.partition_dim)[rank]


def _draw(init: str, name: str, shape: tuple[int, ...], seed: int, std: float, num_layers: int) -> torch.Tensor:
    if init == "zeros":
        return torch.zeros(shape)
    if init == "ones":
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if init == "log_uniform_1_16":
        return torch.log(torch.rand(shape, generator=generator) * 15.0 + 1.0)
    scale = std / math.sqrt(2.0 * num_layers) if init == "normal_scaled" else std
    return torch.randn(shape, generator=generator) * scale


def initial_value(
    name: str,
    shape: tuple[int, ...],
    seed: int,
    std: float,
    num_layers: int,
    gate: GateParam | None = None,
    zero_centered_norms: bool = False,
) -> torch.Tensor:
    """The full initial tensor of the parameter with global name `name` (its gate-table entry, if it has one).

    `zero_centered_norms`: the model's norms compute (1 + w) (ModelConfig.norm_zero_centered), so their weights
    start at zeros instead of ones."""
    if gate is not None:
        if tuple(gate.shape) != tuple(shape):
            raise ValueError(f"gate parameter {name!r} is built {tuple(shape)} but its table entry says {gate.shape}")
        return _draw(gate.init, name, shape, seed, std, num_layers)
    rule = rule_for(name)
    init = "zeros" if zero_centered_norms and rule.what == "norm weight" else rule.init
    return _draw(init, name, shape, seed, std, num_layers)


@torch.no_grad()
def initialize(model_chunks: list[torch.nn.Module], seed: int, std: float, num_layers: int, glu: bool = True) -> int:
    """Overwrite every parameter with its layout-independent value; returns the number of tensors set."""
    from megatron.core import parallel_state

    tp = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
    etp = (parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size())
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    count = 0
    for chunk in model_chunks:
        gate_entries, zero_rows = _gate_entries(chunk)
        sections = _gdn_sections(chunk)
        zero_centered = bool(getattr(getattr(chunk, "config", None), "layernorm_zero_centered_gamma", False))
        for name, param in chunk.named_parameters():
            # expert weights are sharded over the expert-tensor-parallel group, the others over TP
            rank, size = etp if ".experts." in name else tp
            global_name = _global_name(name, chunk, ep_rank)
            shape = _full_shape(param, size)
            full = initial_value(global_name, shape, seed, std, num_layers, gate_entries.get(name), zero_centered)
            if name in zero_rows:  # gate.init='zeros' on rows fused into linear_qkv
                full[zero_rows[name]] = 0.0
            # the global name decides the SwiGLU split: TE's `linear_fc1.weight<i>` is a SwiGLU fc1 too
            param.copy_(_shard(full, global_name, param, rank, size, glu, sections.get(name)).to(param.dtype))
            count += 1
    return count
