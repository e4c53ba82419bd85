"""Step-time estimate: compute at an assumed MFU, the pipeline bubble, and exposed communication over link bandwidths.

Every term is printed with its assumption. Communication is counted as not overlapped with compute (the trainer runs
megatron DDP with overlap_grad_reduce off, and the all-to-all / TP collectives sit on the critical path), so the
figure is conservative. A group's collective runs at the inter-node bandwidth when the group spans nodes (megatron's
rank order tp-cp-ep-dp-pp puts TP innermost), else at the NVLink bandwidth; ring algorithms move (n - 1) / n of the
data per rank for a reduce-scatter or all-gather, twice that for an all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

from megagate.model.counts import flops_per_token
from megagate.model.model_config import ModelConfig
from megagate.plan.devices import Device


@dataclass(frozen=True)
class Links:
    """Bandwidths (GB/s per GPU per direction) and the node size that decides which one a group uses."""

    gpus_per_node: int
    intra_gbs: float
    inter_gbs: float

    def bandwidth(self, stride: int, size: int) -> float:
        """Bytes/s of a group of `size` ranks `stride` apart (inside a node when it spans at most one)."""
        return 1e9 * (self.intra_gbs if stride * size <= self.gpus_per_node else self.inter_gbs)


@dataclass(frozen=True)
class StepTime:
    """Seconds per training step, by term."""

    terms: dict[str, float]
    notes: list[str]

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def _ring(size: int) -> float:
    return (size - 1) / size if size > 1 else 0.0


def step_time(
    model: ModelConfig,
    *,
    seq: int,
    global_batch: int,
    micro_batch: int,
    world: int,
    tp: int,
    pp: int,
    vpp: int | None,
    ep: int,
    cp: int,
    dp: int,
    microbatches: int,
    device: Device,
    links: Links,
    precision: str,
    mfu: float,
    dense_buffer_bytes: tuple[int, int],  # (param buffer, grad buffer) bytes per rank, dense
    expert_buffer_bytes: tuple[int, int],
    expert_dp: int,
) -> StepTime:
    """The estimate for one step of `global_batch` sequences (see the module docstring for the rules)."""
    tokens = global_batch * seq
    flops = flops_per_token(model, seq) * tokens / world
    recompute = model.recompute_granularity
    notes = [f"compute at MFU {mfu:.0%} of {device.peak_tflops(precision):.0f} TFLOP/s dense {precision}"]
    if recompute == "full":
        flops *= 4 / 3  # one more forward of the recomputed layers (all of them, for uniform groups)
        notes.append("full recompute: +1 forward (x4/3 FLOPs)")
    elif recompute == "selective":
        attn = 3 * 2 * model.num_layers * seq * model.num_attention_heads * model.head_dim  # fwd share only
        flops += attn / 3 * tokens / world
        notes.append("selective recompute: +1 forward of the attention scores")
    compute = flops / (device.peak_tflops(precision) * 1e12 * mfu)
    terms = {"compute": compute}
    if pp > 1:
        terms["pipeline bubble"] = compute * (pp - 1) / ((vpp or 1) * microbatches)
        notes.append(f"bubble (PP-1)/(VPP x M) = {pp - 1}/({vpp or 1} x {microbatches}) of compute")
    a = 4 if precision == "fp32" else 2
    tok = micro_batch * seq // cp
    layers_here = model.num_layers // pp
    # data parallel: reduce-scatter of the fp32 grad buffer + all-gather of the param buffer (distributed optimizer)
    dense_bw = links.bandwidth(tp, cp * dp)  # the DP x CP group: ranks TP apart
    dp_bytes = _ring(dp * cp) * sum(dense_buffer_bytes)
    exp_bw = links.bandwidth(tp * ep, expert_dp)
    ex_bytes = _ring(expert_dp) * sum(expert_buffer_bytes)
    terms["DP grad reduce-scatter + param all-gather"] = dp_bytes / dense_bw + ex_bytes / exp_bw
    if model.is_moe and ep > 1:
        # per MoE layer and micro-batch: dispatch + combine forward, and both again backward
        volume = 4 * _ring(ep) * tok * model.moe_router_topk * model.hidden_size * a
        terms["EP all-to-all"] = volume * layers_here * microbatches / links.bandwidth(tp, ep)
        notes.append("EP all-to-all assumes balanced routing (every rank gets tokens x top-k / EP per expert group)")
    if tp > 1:
        collectives = 4 + (2 if recompute == "full" else 0)  # 2 forward + 2 backward all-reduce equivalents per layer
        volume = collectives * 2 * _ring(tp) * tok * model.hidden_size * a
        terms["TP all-reduce / SP gather-scatter"] = volume * layers_here * microbatches / links.bandwidth(1, tp)
    if cp > 1:
        kv = 2 * tok * model.num_query_groups // tp * model.head_dim * a
        terms["CP ring exchange of K/V"] = 3 * (cp - 1) * kv * layers_here * microbatches / links.bandwidth(tp, cp)
    if pp > 1:
        boundary = tok * model.hidden_size * a // (tp if tp > 1 else 1)
        terms["PP send/recv"] = 2 * boundary * microbatches * (vpp or 1) / links.bandwidth(tp * cp * dp, pp)
    notes.append(
        f"links: {links.intra_gbs:.0f} GB/s inside a node of {links.gpus_per_node}, {links.inter_gbs:.0f} GB/s "
        "per GPU between nodes; communication counted as exposed (not overlapped)"
    )
    return StepTime(terms, notes)
