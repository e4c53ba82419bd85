"""The one table of gate parameters: what every gate variant adds to an attention layer.

`gate_parameters(gate, hidden_size, num_heads, num_groups, head_dim)` lists each parameter with its full
(unsharded) shape, tensor-parallel axis, initial value, role and gradient reduction. That list drives

* construction: `GatedSelfAttention` creates exactly the entries not fused into linear_qkv (shapes per TP rank,
  megatron's TP attributes, `sequence_parallel` marks), and nothing else;
* counting: `gate_parameter_count` (here) is the sum over the table (and so the dense models' FFN
  matching and `megagate variants`);
* initialisation: `megagate.model.init` gives each gate parameter the table's rule (zeros / ones / normal; fused
  rows whose rule is zeros are zeroed inside linear_qkv's full tensor);
* checkpointing: `GatedSelfAttention.sharded_state_dict` splits the TP-sharded entries along their axis.

Pure arithmetic on shapes: no megatron, no tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from megagate.errors import ConfigError
from megagate.model.gate import GateConfig
from megagate.model.qkv_layout import qkv_layout

INIT_RULES = ("zeros", "ones", "normal")  # normal: N(0, init_method_std), the model's std
# How the attention module uses an entry:
#   qkv_rows    rows fused into linear_qkv (counted here; linear_qkv builds, initialises and shards them)
#   projection  a gate projection W, logits = X Wᵀ
#   logits      input-independent logits (a learned parameter shaped like the scores)
#   activation  an extra input of the activation, passed to gate.ACTIVATIONS[...].fn by its name
#   sdpa_norm   the per-head RMSNorm weight of the sdpa_norm='rmsnorm' baseline
ROLES = ("qkv_rows", "projection", "logits", "activation", "sdpa_norm")


class Dims(NamedTuple):
    """Attention sizes the gate parameters depend on."""

    hidden_size: int
    num_heads: int
    num_groups: int
    head_dim: int


@dataclass(frozen=True)
class GateParam:
    """One gate parameter of an attention layer (full, unsharded shape)."""

    name: str  # attribute of GatedSelfAttention ("linear_qkv.weight" for the fused rows)
    shape: tuple[int, ...]
    tp_axis: int | None  # the axis split over TP ranks; None: every TP rank holds all of it
    init: str  # one of INIT_RULES
    role: str  # one of ROLES
    # Under sequence parallelism each TP rank sees only its chunk of the sequence, so its gradient is a partial sum
    # that megatron must all-reduce over TP (megatron does so for parameters marked `sequence_parallel`).
    sequence_parallel_grad: bool = False

    def __post_init__(self) -> None:
        if self.init not in INIT_RULES:
            raise ValueError(f"gate parameter {self.name}: init={self.init!r} is not one of {', '.join(INIT_RULES)}")
        if self.role not in ROLES:
            raise ValueError(f"gate parameter {self.name}: role={self.role!r} is not one of {', '.join(ROLES)}")
        if self.tp_axis is not None and not 0 <= self.tp_axis < len(self.shape):
            raise ValueError(f"gate parameter {self.name}: tp_axis={self.tp_axis} is not an axis of {self.shape}")

    @property
    def in_linear_qkv(self) -> bool:
        """Rows of linear_qkv's weight: counted in the table, built (and sharded) by linear_qkv itself."""
        return self.role == "qkv_rows"

    @property
    def checkpoint_axis(self) -> int | None:
        """The axis GatedSelfAttention.sharded_state_dict splits the entry along (None: replicated, or linear_qkv's)."""
        return None if self.in_linear_qkv else self.tp_axis

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_shape(self, tp_size: int) -> tuple[int, ...]:
        """The shape one tensor-parallel rank holds; a one-line ConfigError where TP cannot split it (a parameter per
        KV group with fewer groups than TP ranks: megatron replicates such groups, a parameter cannot follow)."""
        if self.tp_axis is None:
            return self.shape
        if self.shape[self.tp_axis] % tp_size:
            raise ConfigError(
                f"gate parameter {self.name} {list(self.shape)} has {self.shape[self.tp_axis]} rows (per KV group) "
                f"that tensor_model_parallel_size ({tp_size}) cannot split; use num_query_groups a multiple of TP"
                + (" or an input-dependent gate" if self.role == "logits" else "")
            )
        shape = list(self.shape)
        shape[self.tp_axis] //= tp_size
        return tuple(shape)


def score_parameter(name: str, gate: GateConfig, dims: Dims, init: str, role: str) -> GateParam:
    """A parameter shaped like one token's gate scores, broadcast over [sq, b]: [heads, w] sharded with the heads,
    [1, w] for a head-shared gate (replicated), [1, h] at G5 (replicated; under sequence parallelism every rank
    gates only its sequence chunk)."""
    if gate.position == "g5":
        return GateParam(name, (1, dims.hidden_size), None, init, role, sequence_parallel_grad=True)
    width = gate.width(dims.head_dim)
    if gate.sharing == "head_shared":
        # The attention module passes it through copy_to_tensor_model_parallel_region, which sums its gradient over
        # the TP ranks' heads with or without sequence parallelism.
        return GateParam(name, (1, width), None, init, role)
    heads = dims.num_heads if gate.on_query_heads else dims.num_groups
    return GateParam(name, (heads, width), 0, init, role)


def _logit_parameters(gate: GateConfig, dims: Dims) -> list[GateParam]:
    """Where the gate's logits come from. A projection reads the first k = input_fraction·h channels of X (k = h by
    default) and starts as the gate's `init` (normal, or zeros: every score starts at act(0))."""
    h, init = dims.hidden_size, gate.init
    if gate.input == "input_independent":
        return [score_parameter("gate_param", gate, dims, "zeros", "logits")]
    k = gate.input_width(h)
    if gate.position == "g5":
        # X W at the hidden width; under SP each rank gates its own sequence chunk
        return [GateParam("output_gate_weight", (h, k), None, init, "projection", sequence_parallel_grad=True)]
    width = gate.width(dims.head_dim)
    if gate.sharing == "head_shared":
        # one projection for every head; with SP the input is gathered along the sequence and each rank applies the
        # scores to its heads, so megatron sums the gradient over TP (without SP the logits' copy_to region does)
        return [GateParam("shared_gate_weight", (width, k), None, init, "projection", sequence_parallel_grad=True)]
    if not gate.fused_rows:
        # a truncated input (k < h) cannot share linear_qkv's GEMM: its own projection, per head, column-parallel
        # (sharded with the heads: each rank holds its heads' rows, so its gradient needs no TP reduction)
        heads = dims.num_heads if gate.on_query_heads else dims.num_groups
        return [GateParam("gate_weight", (heads * width, k), 0, init, "projection")]
    rows = qkv_layout(gate, dims.num_heads, dims.num_groups, dims.head_dim).gate_rows
    return [GateParam("linear_qkv.weight", (rows, h), 0, init, "qkv_rows")]


# Parameters an activation brings along, by activation name: each callable returns the entries (role "activation")
# whose names are the keyword arguments of gate.ACTIVATIONS[name].fn. The built-in activations have none.
ACTIVATION_PARAMETERS: dict[str, Callable[[GateConfig, Dims], list[GateParam]]] = {
    # "name": lambda gate, dims: [score_parameter("...", gate, dims, init=..., role="activation")],
}


def gate_parameters(
    gate: GateConfig, hidden_size: int, num_heads: int, num_groups: int, head_dim: int
) -> list[GateParam]:
    """Every parameter the gate of `gate` adds to one attention layer, in construction order."""
    dims = Dims(hidden_size, num_heads, num_groups, head_dim)
    entries: list[GateParam] = []
    if gate.enabled:
        entries += _logit_parameters(gate, dims)
        extra = ACTIVATION_PARAMETERS.get(gate.activation)
        if extra is not None:
            entries += extra(gate, dims)
    if gate.sdpa_norm == "rmsnorm":
        entries.append(GateParam("sdpa_norm_weight", (num_heads, head_dim), 0, "ones", "sdpa_norm"))
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"gate parameter names repeat: {names}")
    return entries


def gate_parameter_count(gate: GateConfig, hidden_size: int, num_heads: int, num_groups: int, head_dim: int) -> int:
    """Parameters one attention layer adds for `gate`: the sum over its table."""
    return sum(p.numel for p in gate_parameters(gate, hidden_size, num_heads, num_groups, head_dim))


def check_gate_tensor_parallel(
    gate: GateConfig, hidden_size: int, num_heads: int, num_groups: int, head_dim: int, tp_size: int
) -> None:
    """A one-line ConfigError where TP cannot split this layer's fused rows or gate parameters (the head and group
    counts themselves are qkv_layout.check_tensor_parallel's)."""
    qkv_layout(gate, num_heads, num_groups, head_dim).local(tp_size)
    for entry in gate_parameters(gate, hidden_size, num_heads, num_groups, head_dim):
        if not entry.in_linear_qkv:
            entry.local_shape(tp_size)
