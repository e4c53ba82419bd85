"""Gated self-attention: megatron-core's `SelfAttention` with every gate variant of the paper.

Where each variant lives (shapes in megatron notation; `_p` = this tensor-parallel rank's part):

* head-specific, query-dependent gates of G1–G4: rows fused into `linear_qkv` per query group (megagate.model.qkv_layout), so
  column-parallel TP shards q, k, v and gate together; logits come out of the same GEMM.
* head-shared gates: one replicated projection W [w, h] (w = hn or 1) whose scores every head multiplies by. Each
  rank applies it to its own heads, so its gradient is a partial sum over heads: without sequence parallelism the
  logits pass through `copy_to_tensor_model_parallel_region` (all-reduce in backward); with it the input is gathered
  along the sequence and the weight is marked `sequence_parallel` so megatron sums its gradient over TP.
* head-specific gates reading a truncated input (`input_fraction` < 1): their own projection W [heads·w, k] over
  X[..., :k], column-parallel with the heads (it cannot share linear_qkv's GEMM, which reads all h channels).
* input-independent gates: a zero-initialised parameter [np_p, w] (TP-sharded with the heads), or [1, w] shared.
* G5: a replicated projection W [h, h] applied to the output of `linear_proj` (its channels do not follow the head
  partition); under sequence parallelism each rank gates its own sequence chunk and the gradient is summed over TP.
* G1 and the SDPA-output baselines are applied through megatron's own output-gate hook (`_apply_output_gate`,
  between core attention and `linear_proj`), so recompute, context parallelism and inference paths stay megatron's.

Which parameters exist, their shapes, TP axes, initial values and sequence-parallel marks come from one table,
`megagate.model.gate_params.gate_parameters`; this module creates what the table lists and nothing else.

G2/G3/G4 gate the projected value/key/query before QK-norm and RoPE (the paper's "after the projection").

Head-shared gates and G5 project the layer's *normed* input. Where the input norm is fused into linear_qkv (TE's
spec: `input_layernorm` is an IdentityOp and hidden_states are the raw residual), that norm is recomputed with
linear_qkv's own parameters (megagate.model.fused_norm.normed_input), so the TE spec computes the local spec's function.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer import attention as _mcore_attention
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import get_pg_rank, get_pg_size
from torch import Tensor

from megagate.model.fused_norm import normed_input
from megagate.model.gate import GateConfig, combine, gate_scores, head_rms_norm
from megagate.model.gate_params import GateParam, gate_parameters
from megagate.model.qkv_layout import QkvLayout, qkv_layout

# TE's split whose backward writes the segment gradients into one buffer instead of concatenating them: megatron's
# attention uses it when TE is installed, and so does this one (None without TE: torch.split).
_SplitAlongDim = getattr(_mcore_attention, "SplitAlongDim", None)


class GatedSelfAttention(SelfAttention):
    """`SelfAttention` whose gate variant is chosen by a `GateConfig` (spec param `gate`)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        gate: GateConfig,
        **kwargs: Any,
    ) -> None:
        self.gate = gate
        # The full (unsharded) table of this layer's gate parameters; megagate.model.init reads it too.
        heads, groups, head_dim = config.num_attention_heads, config.num_query_groups, config.kv_channels
        table = gate_parameters(gate, config.hidden_size, heads, groups, head_dim)
        self.gate_params: tuple[GateParam, ...] = tuple(table)
        tp_size = get_pg_size(kwargs["pg_collection"].tp) if kwargs.get("pg_collection") else _mpu_tp_size()
        full = qkv_layout(gate, heads, groups, head_dim)
        self.qkv_layout: QkvLayout = full.local(tp_size)
        # With fewer KV groups than TP ranks (megatron's rule: TP a multiple of the groups), `replicas` ranks share
        # one group: its projection is gathered and each rank keeps its slice of the group's query heads.
        self._replicas = full.replicas(tp_size)
        # Megatron's output-gate hook carries the G1 logits (and the SDPA-output baselines) from the qkv split to
        # the core-attention output; a private copy of the config switches it on for this module only.
        self._uses_output_hook = gate.position == "g1" or gate.sdpa_norm != "none"
        # the G1 gate can be applied to the flat [sq, b, np_p * hn] output when scores and output match elementwise
        self._flat_output_gate = (
            gate.position == "g1"
            and gate.width(head_dim) == head_dim
            and gate.fused_rows
            and not any(e.role == "activation" for e in table)
        )
        if self._uses_output_hook:
            config = copy.copy(config)
            config.attention_output_gate = True
        # SelfAttention sizes linear_qkv itself (q+k+v, plus np·hn rows when attention_output_gate is set);
        # the builder is wrapped so it is built once with exactly our fused rows.
        base_rows = config.kv_channels * (config.num_attention_heads + 2 * config.num_query_groups)
        if config.attention_output_gate:
            base_rows += config.kv_channels * config.num_attention_heads
        extra_rows = full.rows - base_rows
        build_qkv = submodules.linear_qkv

        def build_fused_qkv(input_size: int, output_size: int, **kw: Any) -> Any:
            return build_qkv(input_size, output_size + extra_rows, **kw)

        submodules = copy.copy(submodules)
        submodules.linear_qkv = build_fused_qkv
        super().__init__(config, submodules, layer_number, **kwargs)
        self.linear_qkv_out_dim += extra_rows
        # Diagnostics (megagate.monitor) set this to receive the gate scores [sq, b, heads, w] of each forward;
        # None (the default) costs one attribute check.
        self.score_observer: Callable[[GatedSelfAttention, Tensor], None] | None = None
        self._build_gate_parameters(tp_size)

    # --- parameters ----------------------------------------------------------------------------------------------
    def _build_gate_parameters(self, tp_size: int) -> None:
        """Create every table entry not fused into linear_qkv, as this TP rank's shard."""
        for entry in self.gate_params:
            if not entry.in_linear_qkv:
                self.register_parameter(entry.name, self._new_parameter(entry, tp_size))

    def _new_parameter(self, entry: GateParam, tp_size: int) -> torch.nn.Parameter:
        cfg = self.config
        shape = entry.local_shape(tp_size)
        # CPU initialisation follows the default device (the meta device when counting parameters).
        device = None if cfg.use_cpu_initialization else torch.cuda.current_device()
        if entry.init == "normal":
            param = torch.nn.Parameter(torch.empty(shape, dtype=cfg.params_dtype, device=device))
            if cfg.perform_initialization:
                # The same RNG stream on every TP rank (CPU default / CUDA default generator) keeps replicas equal.
                with torch.no_grad():
                    cfg.init_method(param)
        else:
            fill = torch.zeros if entry.init == "zeros" else torch.ones
            param = torch.nn.Parameter(fill(shape, dtype=cfg.params_dtype, device=device))
        if entry.tp_axis is not None:
            set_tensor_model_parallel_attributes(param, True, entry.tp_axis, 1)
        if cfg.sequence_parallel and entry.sequence_parallel_grad:
            param.sequence_parallel = True  # its gradient is a partial sum over TP ranks: megatron sums it
        return param

    def _entries(self, *roles: str) -> list[GateParam]:
        return [e for e in self.gate_params if e.role in roles]

    def _score_shaped(self, entry: GateParam) -> Tensor:
        """A parameter shaped like the scores (input-independent logits, activation parameters), broadcastable to
        the gated tensor: [1, h] at G5, else [1, 1, heads_p or 1, w]."""
        param = getattr(self, entry.name)
        if self.gate.position == "g5":
            return param
        if entry.tp_axis is None and get_pg_size(self.tp_group) > 1:
            # shared by all heads: each rank applies it to its own heads, so its gradient is summed over TP
            param = copy_to_tensor_model_parallel_region(param, group=self.tp_group)
        return param.unsqueeze(0).unsqueeze(0)

    # --- gate logits ------------------------------------------------------------------------------------------------
    def _unfused_logits(self, hidden_states: Tensor) -> Tensor:
        """Logits of gates not fused into linear_qkv: [1, 1, heads, w] / [sq, b, 1, w], or [1, h] / [sq(/tp), b, h]
        at G5."""
        (entry,) = self._entries("logits", "projection")
        if entry.role == "logits":
            return self._score_shaped(entry)
        weight = getattr(self, entry.name)
        # The gate projects the layer's normed input. With the input norm fused into linear_qkv (TE's spec), the
        # hidden_states reaching here are the raw residual: apply that same norm (per token, so on this rank's
        # sequence chunk under SP, before any gather).
        hidden_states = normed_input(self.linear_qkv, hidden_states)
        if weight.shape[-1] < hidden_states.shape[-1]:  # gate.input_fraction < 1: the first k channels only
            hidden_states = hidden_states[..., : weight.shape[-1]]
        if self.gate.position == "g5":
            # the output of linear_proj is this rank's sequence chunk under SP, and whole otherwise: so is the input
            return torch.nn.functional.linear(hidden_states, weight)
        if entry.tp_axis == 0:  # per-head rows sharded with the heads (a head-specific gate outside linear_qkv)
            return self._column_parallel_projection(hidden_states, weight)
        return self._replicated_projection(hidden_states, weight).unsqueeze(2)

    def _column_parallel_projection(self, hidden_states: Tensor, weight: Tensor) -> Tensor:
        """X W_p^T -> [sq, b, heads_p, w] with this rank's rows of a per-head projection, as megatron's
        ColumnParallelLinear: the input gathered along the sequence under SP (backward: reduce-scatter), else copied
        into the TP region (backward: the input gradient summed over the ranks' heads)."""
        if self.config.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=self.tp_group)
        elif get_pg_size(self.tp_group) > 1:
            hidden_states = copy_to_tensor_model_parallel_region(hidden_states, group=self.tp_group)
        logits = torch.nn.functional.linear(hidden_states, weight)
        return logits.view(*logits.shape[:2], -1, self.gate.width(self.config.kv_channels))

    def _replicated_projection(self, hidden_states: Tensor, weight: Tensor) -> Tensor:
        """X W^T with a TP-replicated weight whose scores each rank applies to its own heads."""
        if self.config.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=self.tp_group)
            return torch.nn.functional.linear(hidden_states, weight)
        logits = torch.nn.functional.linear(hidden_states, weight)
        if get_pg_size(self.tp_group) > 1:
            logits = copy_to_tensor_model_parallel_region(logits, group=self.tp_group)
        return logits

    # --- forward ----------------------------------------------------------------------------------------------------
    def get_query_key_value_tensors(
        self,
        hidden_states: Tensor,
        key_value_states: Tensor | None = None,
        output_gate: bool = False,
        split_qkv: bool = True,
    ) -> tuple[Tensor, ...]:
        """Split the fused projection into query [sq, b, np_p, hn], key/value [sq, b, ng_p, hn] and gate logits.

        megatron's own split, for every layout: view [sq, b, ng_p, rows_per_group], split the last dim into the
        group's segments (views), and reshape only the per-group query-side tensors to per head (the one copy
        megatron makes too); key, value and kv-side gates stay views."""
        gate, layout = self.gate, self.qkv_layout
        mixed_qkv, _ = self.linear_qkv(hidden_states)  # [sq, b, ng_p * rows_per_group]
        sq, b = mixed_qkv.shape[:2]
        if self._replicas > 1:
            mixed_qkv = self._own_group(mixed_qkv)  # [sq, b, rows_per_group]
        grouped = mixed_qkv.view(sq, b, layout.num_groups, layout.rows_per_group)  # [sq, b, ng_p, rows_per_group]
        names, sizes = zip(*layout.group_segments())
        if _SplitAlongDim is not None:
            pieces = _SplitAlongDim(grouped, 3, list(sizes))
        else:
            pieces = torch.split(grouped, list(sizes), dim=3)
        parts = dict(zip(names, pieces))  # {name: [sq, b, ng_p, rows]}

        query = self._own_heads(parts["q"].reshape(sq, b, -1, layout.head_dim))  # [sq, b, np_p, hn]
        key, value = parts["k"], parts["v"]  # [sq, b, ng_p, hn]

        logits = None
        if "q_gate" in parts:
            logits = self._own_heads(parts["q_gate"].reshape(sq, b, -1, layout.q_gate_width))  # [sq, b, np_p, w]
        elif "kv_gate" in parts:
            logits = parts["kv_gate"]  # [sq, b, ng_p, w]
        elif gate.enabled and gate.position != "g5":
            logits = self._unfused_logits(hidden_states)
        if gate.position == "g4":
            query = self._gate(query, logits)
        elif gate.position == "g3":
            key = self._gate(key, logits)
        elif gate.position == "g2":
            value = self._gate(value, logits)

        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)

        if self._uses_output_hook:
            payload = logits if gate.position == "g1" else query.new_empty(0)
            return query, key, value, payload
        return query, key, value

    def _own_group(self, mixed_qkv: Tensor) -> Tensor:
        """[sq, b, rows / tp] -> [sq, b, rows_per_group]: this rank's KV group, gathered from the TP ranks that share
        it (the gather's backward is a reduce-scatter, so the shared rows' gradients sum over those ranks)."""
        full = all_gather_last_dim_from_tensor_parallel_region(mixed_qkv, group=self.tp_group)
        group = get_pg_rank(self.tp_group) // self._replicas
        rows = self.qkv_layout.rows_per_group
        return full[..., group * rows : (group + 1) * rows]

    def _own_heads(self, per_head: Tensor) -> Tensor:
        """[sq, b, npg, w] -> [sq, b, np_p, w]: this rank's query heads of a shared group (all of them otherwise)."""
        if self._replicas == 1:
            return per_head
        size = per_head.shape[2] // self._replicas
        start = get_pg_rank(self.tp_group) % self._replicas * size
        return per_head[:, :, start : start + size]

    def _apply_output_gate(self, x: Tensor, logits: Tensor) -> Tensor:
        """G1 gate or SDPA-output baseline on the core-attention output x: [sq, b, np_p * hn]."""
        if self._flat_output_gate and self.score_observer is None:
            # elementwise G1 without activation parameters: megatron's own shapes. The logits are a copy already
            # where a group has several query heads (the per-head reshape of the split); with one head per group
            # (MHA) they are a strided view of linear_qkv's output and reshape makes that one copy instead.
            return self._gate(x, logits.reshape(x.shape))
        sq, b = x.shape[:2]
        y = x.view(sq, b, -1, self.config.kv_channels)  # [sq, b, np_p, hn]
        if self.gate.position == "g1":
            y = self._gate(y, logits)
        elif self.gate.sdpa_norm == "rmsnorm":
            y = head_rms_norm(y, self.sdpa_norm_weight, self.config.layernorm_epsilon)
        elif self.gate.sdpa_norm == "silu":
            y = torch.nn.functional.silu(y)
        return y.reshape(sq, b, -1)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor, *args: Any, **kwargs: Any):
        """megatron's attention forward, followed by the G5 gate on the output projection."""
        output, bias = super().forward(hidden_states, attention_mask, *args, **kwargs)
        if self.gate.position != "g5":
            return output, bias
        if bias is not None:
            output, bias = output + bias, None
        return self._gate(output, self._unfused_logits(hidden_states)), bias

    def _gate(self, y: Tensor, logits: Tensor) -> Tensor:
        own = {e.name: self._score_shaped(e) for e in self._entries("activation")}  # the activation's parameters
        scores = gate_scores(logits, self.gate.activation, **own)  # fp32
        if self.score_observer is not None:
            self.score_observer(self, scores.detach())
        return combine(y, scores, self.gate.combine)

    # --- checkpointing ----------------------------------------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """megatron's default (gate parameters replicated), with the table's TP-sharded entries split on their axis."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        axes = {e.name: e.checkpoint_axis for e in self.gate_params if e.checkpoint_axis is not None}
        if axes:
            sharded.update(
                make_sharded_tensors_for_checkpoint(
                    {name: getattr(self, name) for name in axes},
                    prefix,
                    axes,
                    sharded_offsets,
                    tp_group=self.tp_group,
                    dp_cp_group=(metadata or {}).get("dp_cp_group") or _dp_cp_group(),
                )
            )
        return sharded


def _mpu_tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def _dp_cp_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


__all__ = ["GatedSelfAttention"]
