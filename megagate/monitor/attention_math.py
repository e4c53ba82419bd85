"""The attention math of the diagnostics, pure torch: scaled causal logits from what core attention receives, the
per-call statistics (first-token probability per head, max logit, Gu et al.'s Sink^eps_1 hits), the scale core
attention applies, and the output layer's log-partition (log Z) under a vocabulary split over tensor-parallel ranks.
megagate.monitor.diagnostics documents the definitions and captures the tensors."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from megagate.errors import MegagateError

SINK_EPSILON = 0.3  # Gu et al.'s eps
SINK_LENGTH = 64  # Gu et al.'s probe length T


def attention_logits(query: Tensor, key: Tensor, scale: float, mask: Tensor | None = None) -> Tensor:
    """Scaled causal logits [b, np, sq, sk] in fp32 (masked entries = -inf) from query [sq, b, np, hn], key [sk, b, ng, hn].

    GQA: each key group serves np/ng consecutive query heads (megatron's repeat_interleave). `mask`: optional bool
    [b or 1, 1, sq, sk], True = masked (megatron's convention), combined with the causal mask.
    """
    sq, sk = query.shape[0], key.shape[0]
    np_, ng = query.shape[2], key.shape[2]
    q = query.float().permute(1, 2, 0, 3)  # [b, np, sq, hn]
    k = key.float().permute(1, 2, 0, 3)  # [b, ng, sk, hn]
    if np_ != ng:
        k = k.repeat_interleave(np_ // ng, dim=1)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    # Causal with the queries aligned to the end of the keys (sq == sk for training probes).
    causal = torch.ones(sq, sk, dtype=torch.bool, device=logits.device).triu(sk - sq + 1)
    masked = causal if mask is None else causal | mask.to(torch.bool)
    return logits.masked_fill(masked, -math.inf)


def attention_probs(logits: Tensor, sink_logit: Tensor | None = None) -> Tensor:
    """Softmax of the logits [b, np, sq, sk] over the keys; with a softmax sink (`sink_logit` [np], core attention's
    `softmax_offset`: zeros for off-by-one, learned for learnable) exp(sink_logit) joins every row's denominator,
    so the probabilities are the ones the model uses and a row sums to less than 1 (the rest is on the sink)."""
    if sink_logit is None:
        return torch.softmax(logits, dim=-1)
    sink = sink_logit.detach().float().reshape(1, -1, 1, 1).expand(*logits.shape[:3], 1)
    return torch.exp(logits - torch.logsumexp(torch.cat([logits, sink], dim=-1), dim=-1, keepdim=True))


def attention_stats(
    logits: Tensor,
    sink_epsilon: float = SINK_EPSILON,
    sink_length: int = SINK_LENGTH,
    sink_logit: Tensor | None = None,
) -> dict[str, Tensor]:
    """Sums and maxima of one attention call (reducible over TP ranks): first-token prob per head, counts, max logit,
    and the Sink^eps_1 hits: (sample, head) pairs whose mean first-token prob over the first T queries exceeds eps.
    `sink_logit`: the softmax sink's logit per head (`attention_probs`), None for vanilla softmax."""
    probs = attention_probs(logits, sink_logit)  # [b, np, sq, sk]
    first = probs[:, :, 1:, 0]  # queries >= 1 on key 0
    length = min(sink_length, probs.shape[2])
    alpha = probs[:, :, :length, 0].mean(dim=2)  # [b, np]: Gu et al.'s alpha_1 per sample and head
    return {
        "f_sum_per_head": first.sum(dim=(0, 2)),  # [np]
        "f_count_per_head": torch.full((logits.shape[1],), float(first.shape[0] * first.shape[2])),
        "max_logit": logits.max(),  # masked entries are -inf
        "sink_hits": (alpha > sink_epsilon).sum().double(),
        "sink_pairs": torch.tensor(float(alpha.numel()), dtype=torch.float64),
        "sink_length": torch.tensor(length),
        "probs": probs,
    }


def check_sink_settings(epsilon: float, length: int, context: int | None = None) -> None:
    """Refuse an eps outside (0, 1), a length < 1, or a length beyond the model's context, in one line."""
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0 < epsilon < 1:
        raise MegagateError(f"sink epsilon={epsilon!r} must be in (0, 1)")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise MegagateError(f"sink probe length={length!r} must be a positive integer")
    if context is not None and length > context:
        raise MegagateError(f"sink probe length {length} is longer than the model's context ({context} tokens)")


def softmax_scale(core_attention: torch.nn.Module, head_dim: int) -> float:
    """The scale core attention applies to q·k (megatron's local or TE module; 1/sqrt(hn) otherwise)."""
    scale = getattr(core_attention, "softmax_scale", None)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    # megatron's apply_query_key_layer_scaling divides softmax_scale by the layer number and multiplies it back
    # inside its fused softmax.
    coeff = getattr(getattr(core_attention, "scale_mask_softmax", None), "scale", None)
    return scale * float(coeff) if coeff else scale


LOG_Z_CHUNK = 1024  # tokens per fp32 chunk of the log-Z computation


def log_z(logits: Tensor, tp_group: Any = None) -> Tensor:
    """log sum_v exp(logit_v) per token, in fp32, from this rank's vocabulary shard [..., V / TP]; with a TP group the
    shards combine as max + log sum_r exp(lse_r - max) (megatron splits the output layer's vocabulary over TP)."""
    # in chunks of tokens: an fp32 copy of [s, b, V] logits at once can be gigabytes (eval batches, 150k vocabularies)
    flat = logits.reshape(-1, logits.shape[-1])
    local = torch.cat([torch.logsumexp(c.float(), dim=-1) for c in flat.split(LOG_Z_CHUNK)]).reshape(logits.shape[:-1])
    if tp_group is None:
        return local
    import torch.distributed as dist

    top = local.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
    total = torch.exp(local - top)
    dist.all_reduce(total, group=tp_group)
    return top + torch.log(total)
