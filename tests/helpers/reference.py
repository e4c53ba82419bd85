"""An independent plain-torch gated attention, written from the paper's formulas (no megagate or megatron code).

Weights are given per head; `fuse_qkv` lays them out the way megagate's linear_qkv documents it, written separately
from megagate.model.qkv_layout so a layout bug cannot cancel out.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def activation(z: torch.Tensor, name: str) -> torch.Tensor:
    if name == "sigmoid":
        return torch.sigmoid(z)
    if name == "silu":
        return z * torch.sigmoid(z)
    if name == "ns_sigmoid":
        return 0.5 + 0.5 * torch.sigmoid(z)
    if name == "2sigmoid":
        return 2.0 / (1.0 + torch.exp(-z))
    assert name == "identity"
    return z


def gated(y: torch.Tensor, z: torch.Tensor, gate, score_fn=None) -> torch.Tensor:
    """`score_fn(z)`, when given, replaces the named activation (for a variant registered by a test)."""
    s = score_fn(z) if score_fn is not None else activation(z, gate.activation)
    return y * s if gate.combine == "multiplicative" else y + s


def rms(y: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return y / torch.sqrt((y * y).mean(-1, keepdim=True) + eps) * w


def gate_inputs(gate, h: int) -> int:
    """k: the gate reads x[..., :k], k = input_fraction · h (all of x by default)."""
    k = getattr(gate, "input_fraction", 1.0) * h
    assert k == int(k) and 0 < k <= h, k
    return int(k)


def fused_gate(gate) -> bool:
    """A head-specific query-dependent G1-G4 gate over the whole input is rows of linear_qkv; over a truncated input
    it is a projection of its own ("gate_weight", [heads·w, k], heads in order)."""
    return getattr(gate, "input_fraction", 1.0) == 1.0


def make_weights(gate, h: int, n: int, g: int, d: int, seed: int = 0, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Random per-head weights for every tensor the variant uses (leaf tensors requiring grad)."""
    gen = torch.Generator().manual_seed(seed)
    k = gate_inputs(gate, h)

    def rand(*shape, scale=None):
        scale = scale if scale is not None else 1.0 / math.sqrt(shape[-1])
        return (torch.randn(*shape, generator=gen, dtype=dtype) * scale).requires_grad_()

    w = {
        "q": rand(n, d, h),
        "k": rand(g, d, h),
        "v": rand(g, d, h),
        "o": rand(h, n * d),
        "qn": (1 + 0.1 * torch.randn(d, generator=gen, dtype=dtype)).requires_grad_(),
        "kn": (1 + 0.1 * torch.randn(d, generator=gen, dtype=dtype)).requires_grad_(),
    }
    width = d if gate.granularity == "elementwise" else 1
    if gate.position in ("g1", "g2", "g3", "g4"):
        heads = n if gate.position in ("g1", "g4") else g
        if gate.input == "input_independent":
            w["p"] = rand(1 if gate.sharing == "head_shared" else heads, width, scale=1.0)
        elif gate.sharing == "head_shared":
            w["gs"] = rand(width, k, scale=2.0 / math.sqrt(k))
        else:
            w["g"] = rand(heads, width, k, scale=2.0 / math.sqrt(k))
    if gate.position == "g5":
        if gate.input == "input_independent":
            w["p"] = rand(1, h, scale=1.0)
        else:
            w["g5"] = rand(h, k, scale=2.0 / math.sqrt(k))
    if gate.sdpa_norm == "rmsnorm":
        w["sn"] = (1 + 0.1 * torch.randn(n, d, generator=gen, dtype=dtype)).requires_grad_()
    return w


def fuse_qkv(w: dict[str, torch.Tensor], gate, n: int, g: int) -> torch.Tensor:
    """linear_qkv weight: per group [q heads | q-side gates | k | v | kv-side gate] (differentiable)."""
    npg, rows = n // g, []
    h = w["q"].shape[-1]
    for grp in range(g):
        heads = range(grp * npg, (grp + 1) * npg)
        rows += [w["q"][i] for i in heads]
        if "g" in w and fused_gate(gate) and gate.position in ("g1", "g4"):
            rows += [w["g"][i] for i in heads]
        rows += [w["k"][grp], w["v"][grp]]
        if "g" in w and fused_gate(gate) and gate.position in ("g2", "g3"):
            rows += [w["g"][grp]]
    return torch.cat([r.reshape(-1, h) for r in rows], dim=0)


def module_params(w: dict[str, torch.Tensor], gate, n: int, g: int) -> dict[str, torch.Tensor]:
    """The megagate GatedSelfAttention parameter dict for these weights."""
    params = {
        "linear_qkv.weight": fuse_qkv(w, gate, n, g),
        "linear_proj.weight": w["o"],
        "q_layernorm.weight": w["qn"],
        "k_layernorm.weight": w["kn"],
    }
    if "g" in w and not fused_gate(gate):
        params["gate_weight"] = w["g"].reshape(-1, w["g"].shape[-1])
    if "gs" in w:
        params["shared_gate_weight"] = w["gs"]
    if "p" in w:
        params["gate_param"] = w["p"]
    if "g5" in w:
        params["output_gate_weight"] = w["g5"]
    if "sn" in w:
        params["sdpa_norm_weight"] = w["sn"]
    return params


def attention(
    x: torch.Tensor, w: dict[str, torch.Tensor], gate, n: int, g: int, eps: float, score_fn=None
) -> torch.Tensor:
    """x: [s, b, h] -> [s, b, h]; causal GQA attention with QK RMSNorm and the gate of `gate` (see `gated`)."""
    s, b, h = x.shape
    d = w["q"].shape[1]
    xg = x[..., : gate_inputs(gate, h)]  # what the gate projection reads
    q = torch.einsum("sbh,ndh->sbnd", x, w["q"])
    k = torch.einsum("sbh,gdh->sbgd", x, w["k"])
    v = torch.einsum("sbh,gdh->sbgd", x, w["v"])

    def gate_logits(heads: int) -> torch.Tensor:
        if "p" in w:
            return w["p"].expand(heads, -1)[None, None] if w["p"].shape[0] == 1 else w["p"][None, None]
        if "gs" in w:
            return torch.einsum("sbh,wh->sbw", xg, w["gs"])[:, :, None, :]
        return torch.einsum("sbh,nwh->sbnw", xg, w["g"])

    if gate.position == "g4":
        q = gated(q, gate_logits(n), gate, score_fn)
    if gate.position == "g3":
        k = gated(k, gate_logits(g), gate, score_fn)
    if gate.position == "g2":
        v = gated(v, gate_logits(g), gate, score_fn)
    q, k = rms(q, w["qn"], eps), rms(k, w["kn"], eps)
    k = k.repeat_interleave(n // g, dim=2)
    v = v.repeat_interleave(n // g, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = F.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
    y = torch.einsum("bnst,tbnd->sbnd", probs, v)
    if gate.position == "g1":
        y = gated(y, gate_logits(n), gate, score_fn)
    if gate.sdpa_norm == "rmsnorm":
        y = rms(y, w["sn"], eps)
    elif gate.sdpa_norm == "silu":
        y = y * torch.sigmoid(y)
    out = y.reshape(s, b, n * d) @ w["o"].T
    if gate.position == "g5":
        z = w["p"] if "p" in w else xg @ w["g5"].T
        out = gated(out, z, gate, score_fn)
    return out
