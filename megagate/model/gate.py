"""The paper's gate design space as one validated configuration, and the pure gate math.

A gated tensor is `Y' = Y ⊙ act(X W)` (multiplicative) or `Y' = Y + act(X W)` (additive), where X is the attention
input (the hidden state after the layer's pre-norm) and W a learned projection; an input-independent gate replaces
`X W` by a learned, zero-initialised parameter. The paper: arXiv 2505.06708; the README has the table of axes.

Positions:   g1 = SDPA output (per query head, before W_O)   g2 = value (per KV head)   g3 = key (per KV head)
             g4 = query (per query head)                     g5 = after the output projection W_O (hidden width)
Granularity: elementwise (one score per channel) | headwise (one score per head)
Sharing:     head_specific | head_shared (one gate shared by all heads of the gated tensor)
Combine:     multiplicative | additive
Activation:  sigmoid | silu | ns_sigmoid (0.5 + 0.5·sigmoid, non-sparse) | 2sigmoid (2·sigmoid: a zero logit is
             the identity) | identity
Input:       query_dependent (X W) | input_independent (learned parameter, zero-initialised)
Init:        normal (W drawn like the model's other weights) | zeros (W = 0: every score starts at act(0))
Input width: input_fraction f in (0, 1]: the logits read only the first f·h channels of X (W is [·, f·h]); f < 1
             takes the gate out of linear_qkv into a projection of its own (column-parallel with the heads)
Non-gate SDPA-output baselines (`sdpa_norm`): rmsnorm (per-head RMSNorm, "SDPA GroupNorm") | silu (no parameters).
Stability baseline: `sandwich_norm` (a norm on each sublayer output before the residual add).

A variant's formula lives here (ACTIVATIONS, COMBINES), its parameters in megagate.model.gate_params and its name in
PRESETS; docs/gate_variants.md adds one end to end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megagate.errors import ConfigError
from megagate.sections import did_you_mean

POSITIONS = ("none", "g1", "g2", "g3", "g4", "g5")
GRANULARITIES = ("elementwise", "headwise")
SHARINGS = ("head_specific", "head_shared")
INPUTS = ("query_dependent", "input_independent")
INITS = ("normal", "zeros")
SDPA_NORMS = ("none", "rmsnorm", "silu")


# --- the gate math: one registry per axis whose values are formulas (docs/gate_variants.md adds one) ------------
@dataclass(frozen=True)
class Activation:
    """scores = fn(logits, **parameters), in fp32. `fn`'s keyword arguments are the activation's own learned
    parameters, declared in megagate.model.gate_params.ACTIVATION_PARAMETERS and shaped like the scores.
    `positive`: every score is > 0, so adding it (combine='additive') is an offset, not a gate."""

    fn: Callable[..., torch.Tensor]
    positive: bool = False


ACTIVATIONS: dict[str, Activation] = {
    "sigmoid": Activation(torch.sigmoid, positive=True),
    "silu": Activation(F.silu),
    "ns_sigmoid": Activation(lambda z: 0.5 + 0.5 * torch.sigmoid(z), positive=True),  # non-sparse: in (0.5, 1)
    # in (0, 2), 2·σ(0) = 1: with zero-initialised weights a new gate leaves the layer unchanged
    "2sigmoid": Activation(lambda z: 2.0 * torch.sigmoid(z), positive=True),
    "identity": Activation(lambda z: z),
}

COMBINES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "multiplicative": lambda y, scores: y * scores,
    "additive": lambda y, scores: y + scores,
}

# Which attention tensor each position gates, and on which heads it lives.
QUERY_SIDE = ("g1", "g4")  # per query head
KV_SIDE = ("g2", "g3")  # per key/value head (GQA: k groups)


@dataclass(frozen=True)
class GateConfig:
    """One point of the paper's gate design space (defaults: the paper's best, G1 elementwise sigmoid)."""

    position: str = "g1"
    granularity: str = "elementwise"
    sharing: str = "head_specific"
    combine: str = "multiplicative"
    activation: str = "sigmoid"
    input: str = "query_dependent"
    init: str = "normal"
    input_fraction: float = 1.0
    sdpa_norm: str = "none"
    sandwich_norm: bool = False

    def __post_init__(self) -> None:
        validate(self)

    # --- derived properties used by the attention module and the parameter counts -----------------------------
    @property
    def enabled(self) -> bool:
        return self.position != "none"

    @property
    def on_query_heads(self) -> bool:
        return self.position in QUERY_SIDE

    @property
    def on_kv_heads(self) -> bool:
        return self.position in KV_SIDE

    @property
    def fused_rows(self) -> bool:
        """Whether the gate projection is fused into linear_qkv (head-specific, query-dependent, per-head gates that
        read the whole input: a truncated input cannot share linear_qkv's GEMM)."""
        return (
            self.position in QUERY_SIDE + KV_SIDE
            and self.sharing == "head_specific"
            and self.input == "query_dependent"
            and self.input_fraction == 1
        )

    def input_width(self, hidden_size: int) -> int:
        """Channels of X the gate logits read: input_fraction · hidden_size, which must be a whole number >= 1."""
        k = self.input_fraction * hidden_size
        if not 1 <= round(k) <= hidden_size or abs(k - round(k)) > 1e-9:
            raise ConfigError(
                f"gate.input_fraction={self.input_fraction!r} gives {k:g} of hidden_size {hidden_size} gate inputs; "
                f"input_fraction · hidden_size must be a whole number in 1..{hidden_size}"
            )
        return round(k)

    def width(self, head_dim: int) -> int:
        """Scores per head: head_dim for elementwise gates, 1 for headwise gates."""
        return head_dim if self.granularity == "elementwise" else 1

    def describe(self) -> str:
        if not self.enabled:
            extra = [f"sdpa_norm={self.sdpa_norm}"] if self.sdpa_norm != "none" else []
        else:
            extra = [self.position, self.granularity, self.sharing, self.combine, self.activation, self.input]
            if self.init != "normal":
                extra.append(f"init={self.init}")
            if self.input_fraction != 1:
                extra.append(f"input_fraction={self.input_fraction:g}")
        if self.sandwich_norm:
            extra.append("sandwich_norm")
        return " ".join(extra) or "baseline"


def validate(gate: GateConfig) -> None:
    """Raise ConfigError naming the value(s) for any unknown value or invalid combination."""
    for name, allowed in (
        ("position", POSITIONS),
        ("granularity", GRANULARITIES),
        ("sharing", SHARINGS),
        ("combine", COMBINES),
        ("activation", ACTIVATIONS),
        ("input", INPUTS),
        ("init", INITS),
        ("sdpa_norm", SDPA_NORMS),
    ):
        value = getattr(gate, name)
        if value not in allowed:
            raise ConfigError(f"gate.{name}={value!r} is not one of {', '.join(allowed)}{did_you_mean(value, allowed)}")
    if not isinstance(gate.sandwich_norm, bool):
        raise ConfigError(f"gate.sandwich_norm={gate.sandwich_norm!r} must be true or false")
    fraction = gate.input_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        raise ConfigError(f"gate.input_fraction={fraction!r} must be a number in (0, 1]")
    if fraction != 1 and gate.input == "input_independent":
        raise ConfigError(
            f"gate.input_fraction={fraction!r} needs a query-dependent gate: gate.input='input_independent' reads no "
            "input (leave input_fraction at 1)"
        )
    if gate.position == "g5" and gate.granularity == "headwise":
        raise ConfigError(
            "gate.granularity='headwise' is invalid with gate.position='g5': G5 gates the hidden "
            "state after W_O, which has no heads; use elementwise"
        )
    if gate.position == "g5" and gate.sharing == "head_shared":
        raise ConfigError("gate.sharing='head_shared' is invalid with gate.position='g5' (no heads after W_O)")
    if gate.combine == "additive" and ACTIVATIONS[gate.activation].positive:
        raise ConfigError(
            f"gate.combine='additive' with gate.activation={gate.activation!r} is not a gate (it only adds a "
            "positive offset); additive gates use activation 'silu' or 'identity', as in the paper"
        )
    if gate.sdpa_norm != "none" and gate.position == "g1":
        raise ConfigError(
            f"gate.sdpa_norm={gate.sdpa_norm!r} replaces the gate at the SDPA output; it cannot be combined with "
            "gate.position='g1' (set position='none' for the non-gate baselines)"
        )
    if not gate.enabled:
        defaults = GateConfig.__dataclass_fields__
        stray = [
            f"{f}={getattr(gate, f)!r}"
            for f in ("granularity", "sharing", "combine", "activation", "input", "init", "input_fraction")
            if getattr(gate, f) != defaults[f].default
        ]
        if stray:
            raise ConfigError(f"gate.position='none' but gate fields are set: {', '.join(stray)}")


# --- presets: the rows of the paper's Tables 1, 3 and 4 ---------------------------------------------------------

PRESETS: dict[str, dict[str, Any]] = {
    "baseline": {"position": "none"},
    # Table 1 / 4: position and granularity
    "g1-elementwise": {},
    "g1-headwise": {"granularity": "headwise"},
    "g1-elementwise-head-shared": {"sharing": "head_shared"},
    "g1-headwise-head-shared": {"granularity": "headwise", "sharing": "head_shared"},
    "g2-elementwise": {"position": "g2"},
    "g2-headwise": {"position": "g2", "granularity": "headwise"},
    "g2-elementwise-head-shared": {"position": "g2", "sharing": "head_shared"},
    "g3-elementwise": {"position": "g3"},
    "g3-headwise": {"position": "g3", "granularity": "headwise"},
    "g4-elementwise": {"position": "g4"},
    "g4-headwise": {"position": "g4", "granularity": "headwise"},
    "g5-elementwise": {"position": "g5"},
    # Table 1: combination and activation
    "g1-additive-silu": {"combine": "additive", "activation": "silu"},
    "g1-additive-identity": {"combine": "additive", "activation": "identity"},
    "g1-silu": {"activation": "silu"},
    "g1-ns-sigmoid": {"activation": "ns_sigmoid"},
    "g1-identity": {"activation": "identity"},
    # Table 4: input-independent gate
    "g1-input-independent": {"input": "input_independent"},
    "g1-headwise-input-independent": {"granularity": "headwise", "input": "input_independent"},
    # Variants seen in practice (docs/gate_variants.md): 2·sigmoid, zero-initialised gate weights (the pair starts as
    # the identity), and a gate reading only part of the hidden state
    "g1-2sigmoid": {"activation": "2sigmoid"},
    "g1-zero-init": {"init": "zeros"},
    "g1-2sigmoid-zero-init": {"activation": "2sigmoid", "init": "zeros"},
    "g1-input-half": {"input_fraction": 0.5},
    # Non-gate baselines at the SDPA output and the stability baseline
    "sdpa-rmsnorm": {"position": "none", "sdpa_norm": "rmsnorm"},
    "sdpa-silu": {"position": "none", "sdpa_norm": "silu"},
    "sandwich-norm": {"position": "none", "sandwich_norm": True},
    "g1-elementwise-sandwich-norm": {"sandwich_norm": True},
}


def from_dict(values: Mapping[str, Any] | None = None, preset: str | None = None) -> GateConfig:
    """Build a GateConfig from a preset name and/or explicit field values (explicit values win)."""
    fields = {f.name for f in dataclasses.fields(GateConfig)}
    merged: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(
                f"gate preset {preset!r} is unknown; known presets: {', '.join(PRESETS)}{did_you_mean(preset, PRESETS)}"
            )
        merged.update(PRESETS[preset])
    for key, value in (values or {}).items():
        if key == "preset":
            continue
        if key not in fields:
            raise ConfigError(
                f"gate.{key} is not a gate field; fields: {', '.join(sorted(fields))}{did_you_mean(key, fields)}"
            )
        merged[key] = value
    return GateConfig(**merged)


def preset(name: str) -> GateConfig:
    """The GateConfig of a named preset (e.g. 'g1-elementwise', 'baseline')."""
    return from_dict(preset=name)


# --- pure gate math -------------------------------------------------------------------------------------------
def gate_scores(logits: torch.Tensor, activation: str, **parameters: torch.Tensor) -> torch.Tensor:
    """Activation of the gate logits (with the activation's own parameters), in fp32 as megatron does for its
    output gate."""
    if activation not in ACTIVATIONS:
        raise ConfigError(f"gate activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[activation].fn(logits.float(), **{k: v.float() for k, v in parameters.items()})


def combine(y: torch.Tensor, scores: torch.Tensor, mode: str) -> torch.Tensor:
    """Y ⊙ scores or Y + scores (scores broadcast), computed in fp32 and returned in Y's dtype."""
    if mode not in COMBINES:
        raise ConfigError(f"gate combine {mode!r} is not one of {', '.join(COMBINES)}")
    return COMBINES[mode](y, scores).to(y.dtype)


def apply_gate(y: torch.Tensor, logits: torch.Tensor, gate: GateConfig, **parameters: torch.Tensor) -> torch.Tensor:
    """Gate `y` with `logits` (broadcastable to y) according to `gate`."""
    return combine(y, gate_scores(logits, gate.activation, **parameters), gate.combine)


def head_rms_norm(y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last (head) dimension in fp32; y: [..., np, hn], weight: [np, hn]."""
    x = y.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * weight.float()).to(y.dtype)
