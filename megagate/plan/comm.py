"""Communication as the trainer configures it: TP, EP, CP, PP and data-parallel traffic, placed on the links.

Placement follows megatron's rank order (tp-cp-ep-dp-pp, expert grid tp-ep-dp-pp with ETP = TP): a group of `size`
ranks `stride` apart has `min(size, domain // stride)` members in each NVLink domain (the node; an NVL72 rack), so
its peers split into an intra-domain and an inter-domain share. Ring collectives (reduce-scatter, all-gather,
all-reduce = both) move (n-1)/n of the tensor per rank and run at the slower link the ring crosses; an all-to-all
sends each share over its own link at once (the slower share decides); inside a domain at the profile's all-to-all
efficiency (NVLink all-to-all runs below the ring collectives' rate), between domains at the network's rate.

Data-parallel gradients are reduce-scattered and parameters all-gathered per DDP bucket (`perf.bucket_size`, default
megatron's max(40M, 1M x DP) elements). With `overlap_grad_reduce` the buckets go out during the last micro-batch's
backward and only what does not fit in that window (at least the last bucket) is exposed; with `overlap_param_gather`
the gather hides behind the next step's first forward likewise; otherwise both are exposed. Pure arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megagate.plan.profile import DeviceProfile, Link
from megagate.plan.work import Workload, stage_parameters


@dataclass(frozen=True)
class Topology:
    """Which ranks share the fast link, and the links' rates."""

    domain: int  # ranks per NVLink domain (a node; an NVL72 rack)
    intra: Link
    inter: Link
    alltoall_efficiency: float = 1.0
    overlap_efficiency: float = 1.0  # the share of a compute window that hides communication
    dispatch_share: float = 0.0  # the share of the compute the MoE dispatcher's kernels hold while they run

    def hidden(self, seconds: float, window: float) -> float:
        """What of `seconds` of communication stays exposed behind `window` seconds of compute."""
        return max(0.0, seconds - self.overlap_efficiency * window)

    @classmethod
    def of(cls, profile: DeviceProfile, ranks_per_node: int) -> Topology:
        """A GPU's NVLink domain is the node unless the fabric spans nodes (NVL72); a CPU's is the machine."""
        if profile.kind == "gpu" and profile.nvlink_domain > 8:
            domain = max(ranks_per_node, profile.nvlink_domain)
        else:
            domain = ranks_per_node
        return cls(
            domain,
            profile.intra,
            profile.inter,
            profile.alltoall_efficiency,
            profile.overlap_efficiency,
            profile.dispatch_compute_share,
        )

    def intra_share(self, size: int, stride: int) -> float:
        """The share of a rank's peers in its own domain, for a group of `size` ranks `stride` apart."""
        if size <= 1:
            return 1.0
        per_domain = 1 if stride >= self.domain else min(size, self.domain // stride)
        return (per_domain - 1) / (size - 1)

    def members_per_domain(self, size: int, stride: int) -> int:
        return 1 if stride >= self.domain else min(size, self.domain // stride)

    def ring(self, size: int, stride: int, tensor_bytes: float, passes: int = 1) -> float:
        """Seconds of `passes` reduce-scatters or all-gathers of a `tensor_bytes` tensor over the group. A ring that
        leaves the domain crosses it once per channel, one channel per member's network port, so it runs at the
        smaller of the NVLink rate and the domain's members x the per-GPU network rate."""
        if size <= 1 or tensor_bytes <= 0:
            return 0.0
        per_domain = self.members_per_domain(size, stride)
        if per_domain >= size:
            link = self.intra
        else:
            link = Link(self.inter.latency, min(self.intra.bandwidth, per_domain * self.inter.bandwidth))
        return passes * link.seconds(tensor_bytes * (size - 1) / size)

    def alltoall(self, size: int, stride: int, bytes_out: float, experts: int = 0, topk: int = 0) -> float:
        """Seconds of an all-to-all in which a rank sends `bytes_out` to the other members, each share over its own
        link. `bytes_out` counts a token once per routed expert (megatron's alltoall dispatcher permutes before it
        sends). With `experts` and `topk` (DeepEP / HybridEP, the `flex` dispatcher) a token goes once to each rank
        its top-k experts reach inside the domain and once to each remote domain they reach (forwarded there over
        NVLink), so only `hit_share` of those copies move."""
        if size <= 1 or bytes_out <= 0:
            return 0.0
        share = self.intra_share(size, stride)
        intra_bytes, inter_bytes = share * bytes_out, (1 - share) * bytes_out
        if topk:
            members = self.members_per_domain(size, stride)
            intra_bytes *= hit_share(experts, topk, size, 1)
            inter_bytes *= hit_share(experts, topk, size, members)
        intra = intra_bytes / (self.intra.bandwidth * self.alltoall_efficiency)
        inter = inter_bytes / self.inter.bandwidth
        latency = self.inter.latency if share < 1 else self.intra.latency
        return latency + max(intra, inter)


def hit_share(experts: int, topk: int, size: int, members: int) -> float:
    """Of a token's copies to its top-k experts (distinct, uniformly drawn from `experts` spread evenly over `size`
    ranks), the share left when each group of `members` consecutive ranks receives one copy however many of its
    experts the token reaches: the expected number of groups reached over the expected copies into them.

    A group of g = members x experts / size experts is missed with probability C(E - g, k) / C(E, k); the other
    groups hold (size - members) / size of the experts, so k x that share of the copies."""
    groups = size // members
    g = experts * members // size
    if groups <= 1 or g < 1:
        return 1.0
    # a factor reaches 0 (the group cannot be missed) once the picks outnumber the other groups' experts
    missed = math.prod((experts - g - i) / (experts - i) for i in range(topk))
    return (groups - 1) * (1 - missed) / (topk * (size - members) / size)


@dataclass(frozen=True)
class EpWindows:
    """A MoE layer's device seconds per micro-batch on either side of the dispatch: `pre` (attention, norms, router:
    megatron's pre_dispatch_computation) and `mlp` (permute, experts, unpermute), forward and backward."""

    pre_fwd: float = 0.0
    pre_bwd: float = 0.0
    mlp_fwd: float = 0.0
    mlp_bwd: float = 0.0


def ep_overlap_exposed(topo: Topology, a2a: float, win: EpWindows) -> float:
    """Exposed seconds of one layer's four all-to-alls (`a2a` each) under megatron's EP A2A overlap, which runs one
    micro-batch's forward of the layer beside another's backward in three phases on two streams
    (megatron/core/models/common/model_chunk_schedule_plan.py, TransformerLayerSchedulePlan.run):

        comm: combine bwd        | dispatch fwd, dispatch bwd | combine fwd
        comp: pre-dispatch fwd   | mlp bwd, mlp fwd           | pre-dispatch bwd

    Each phase ends when both streams have, so a phase's traffic hides only behind that phase's compute. The
    dispatcher's kernels hold a share s of the device while they run, so the compute beside them runs slower: a
    phase of C seconds of traffic beside W of compute takes W + max(C - W, s C) (past the window, the traffic;
    within it, the compute lost to the shared device)."""

    def phase(c: float, w: float) -> float:
        return max(topo.hidden(c, w), topo.dispatch_share * c)

    return phase(a2a, win.pre_fwd) + phase(2 * a2a, win.mlp_bwd + win.mlp_fwd) + phase(a2a, win.pre_bwd)


@dataclass
class LayerComm:
    """Exposed communication of one layer and micro-batch on one rank, forward and backward, by kind."""

    fwd: dict[str, float]
    bwd: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.fwd.values()) + sum(self.bwd.values())


def layer_comm(
    w: Workload,
    topo: Topology,
    attention_seconds: tuple[float, float],
    ep_windows: EpWindows = EpWindows(),
    gemm_seconds: tuple[float, float] = (0.0, 0.0),
) -> LayerComm:
    """TP collectives, the MoE dispatcher's traffic and CP's K/V ring of one layer (`attention_seconds`: the core
    attention's forward/backward device time, which the CP exchange overlaps; `ep_windows`: the layer's compute
    either side of the dispatch, which hides it with `ep_overlap`; `gemm_seconds`: the layer's dense GEMMs forward
    and backward, which hide the TP collectives with `tp_overlap`)."""
    m, a = w.model, w.act_bytes
    h, T, Tsp = m.hidden_size, w.tokens, w.tokens_sp
    fwd: dict[str, float] = {}
    bwd: dict[str, float] = {}
    if w.tp > 1:
        tensor = T * h * a
        # SP: all-gather before linear_qkv / fc1 and reduce-scatter after linear_proj / fc2 (= one all-reduce each);
        # without SP the two all-reduces are four ring passes; backward mirrors the forward
        tp = topo.ring(w.tp, 1, tensor, passes=4)
        if w.tp_overlap:  # split into chunks that run under the GEMMs they feed
            fwd["TP"], bwd["TP"] = topo.hidden(tp, gemm_seconds[0]), topo.hidden(tp, gemm_seconds[1])
        else:
            fwd["TP"] = bwd["TP"] = tp
    if m.is_moe and w.expert_tp > 1:  # the dispatcher gathers the routed tokens over expert TP and scatters back
        etp = topo.ring(w.expert_tp, 1, w.routed_tokens * h * a, passes=2)
        fwd["TP"], bwd["TP"] = fwd.get("TP", 0.0) + etp, bwd.get("TP", 0.0) + etp
    if m.is_moe and w.ep > 1:
        k = m.moe_router_topk * w.routing_imbalance
        if w.dispatcher == "allgather":  # every token to every TP x EP rank, combined by a reduce-scatter
            group = w.expert_tp * w.ep
            ep = topo.ring(group, 1, group * Tsp * h * a, passes=2)
        else:  # alltoall / flex (DeepEP, HybridEP: one copy per rank and per remote domain): dispatch + combine
            dedup = dict(experts=m.num_experts, topk=m.moe_router_topk) if w.dispatcher == "flex" else {}
            ep = 2 * topo.alltoall(w.ep, w.expert_tp, Tsp * k * h * a * (w.ep - 1) / w.ep, **dedup)
        if w.ep_overlap and (w.pp == 1 or w.vpp):  # megatron's EP A2A overlap needs VPP when PP > 1
            # another micro-batch's compute runs under this one's dispatch and combine, phase by phase
            ep = ep_overlap_exposed(topo, ep / 2, ep_windows) / 2
        fwd["EP"] = bwd["EP"] = ep
    if w.cp > 1:
        kv = 2 * T * m.num_query_groups / w.tp * m.head_dim * a
        ring = (
            (w.cp - 1) * topo.intra.seconds(kv) if w.tp * w.cp <= topo.domain else (w.cp - 1) * topo.inter.seconds(kv)
        )
        fwd["CP"] = topo.hidden(ring, attention_seconds[0])
        bwd["CP"] = topo.hidden(2 * ring, attention_seconds[1])
    return LayerComm(fwd, bwd)


def pp_seconds(w: Workload, topo: Topology) -> float:
    """One activation (or its gradient) sent between pipeline stages, per micro-batch and chunk boundary."""
    if w.pp <= 1:
        return 0.0
    stride = w.tp * w.cp * w.dp
    link = topo.inter if stride * 2 > topo.domain else topo.intra
    return link.seconds(w.tokens_sp * w.model.hidden_size * w.act_bytes)


def edge_comm(w: Workload, topo: Topology) -> tuple[float, float]:
    """(first stage, last stage) TP traffic per micro-batch, forward + backward: the vocabulary-parallel embedding's
    reduce of its output, the output layer's gather of its input (SP) and the cross entropy's three reductions."""
    if w.tp <= 1:
        return 0.0, 0.0
    tensor = w.tokens * w.model.hidden_size * w.act_bytes
    first = topo.ring(w.tp, 1, tensor, passes=1 if w.sequence_parallel else 2)
    last = topo.ring(w.tp, 1, tensor, passes=2 if w.sequence_parallel else 0) + 3 * topo.intra.latency
    return first, last


def default_bucket(dp: int) -> int:
    """megatron's DDP bucket size in elements when `perf.bucket_size` is unset: max(40M, 1M x DP)."""
    return max(40_000_000, 1_000_000 * dp)


def _exposed(topo: Topology, total: float, buckets: int, window: float, overlap: bool) -> float:
    """What of `total` seconds, sent as `buckets` equal buckets behind `window` seconds of compute, stays exposed
    (at least the bucket that completes after the window)."""
    if not overlap or total <= 0:
        return total
    return max(total / buckets, topo.hidden(total, window * (1 - 1 / buckets)))


def dp_seconds(w: Workload, topo: Topology, stage: int, bwd_window: float, fwd_window: float) -> dict[str, float]:
    """Exposed data-parallel communication of one rank of `stage` per step: {kind: seconds}.

    `bwd_window` / `fwd_window`: the stage's last backward / first forward of a step (what overlap hides behind).
    Gradients are reduced in `w.grad_bytes` per element (fp32 under grad_reduce_in_fp32), parameters gathered in the
    activation dtype.
    """
    dense, expert = stage_parameters(w, stage)
    out: dict[str, float] = {}
    groups = [("dense", dense, w.dp * w.cp, w.tp)]
    if expert:
        groups.append(("expert", expert, w.expert_dp, w.expert_tp * w.ep))
    for name, params, size, stride in groups:
        if size <= 1 or params <= 0:
            continue
        buckets = max(1, math.ceil(params / (w.bucket_size or default_bucket(size))))
        grads, weights = w.grad_bytes * params, w.act_bytes * params
        if w.fsdp:
            # every micro-batch gathers the weights twice (forward, backward) and reduce-scatters the gradients,
            # layer by layer behind the compute; what the compute cannot hide is exposed
            per_mb = topo.ring(size, stride, weights, 2) + topo.ring(size, stride, grads)
            layers = max(1, sum(w.layers()[stage]))
            exposed = max(per_mb / layers, topo.hidden(per_mb, fwd_window + bwd_window))
            out[f"DP {name} (FSDP gather + reduce-scatter)"] = w.microbatches * exposed
        elif w.distributed_optimizer:
            rs = topo.ring(size, stride, grads)
            ag = topo.ring(size, stride, weights)
            out[f"DP {name} grad reduce-scatter"] = _exposed(topo, rs, buckets, bwd_window, w.overlap_grad_reduce)
            out[f"DP {name} param all-gather"] = _exposed(topo, ag, buckets, fwd_window, w.overlap_param_gather)
        else:
            ar = topo.ring(size, stride, grads, passes=2)
            out[f"DP {name} grad all-reduce"] = _exposed(topo, ar, buckets, bwd_window, w.overlap_grad_reduce)
    return out
