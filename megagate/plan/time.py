"""Step time from the work: per layer, per pipeline stage, then the schedule, the data-parallel traffic and the
optimizer (docs/planning.md, "How the step time is modelled").

For every stage and micro-batch: each layer's device seconds (megatron.plan.cost: GEMMs by shape, grouped experts
by tokens per expert, attention by kernel, memory-bound bytes, recomputation; a calibrated CPU profile's kernels at
their speed inside a step, DeviceProfile.in_step), its exposed TP / EP / CP traffic (megagate.plan.comm) and the
host's overhead for it — on a GPU the host queues work ahead, so a layer takes the longer of the two (plus a
dropless MoE layer's host sync), on a CPU they add; the first stage adds the embedding, the last the output layer
and the loss, every chunk boundary a point-to-point send. The schedule (megagate.plan.schedule) turns the stages'
work into the forward-backward time; the data-parallel reduce-scatter / all-gather (exposed or hidden per the
overlap settings), the optimizer step and the per-step overhead follow.
Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megagate.plan import comm, cost, schedule
from megagate.plan.profile import DeviceProfile
from megagate.plan.work import (
    LayerWork,
    Workload,
    embedding_work,
    expert_block,
    layer_work,
    optimizer_bytes,
    output_work,
    recompute_work,
)

COMM_KINDS = ("TP", "EP", "CP", "PP p2p")
STEP_COLLECTIVES = 6


@dataclass
class StageTime:
    """One pipeline stage: per micro-batch seconds (forward, backward; by term) and its per-step costs."""

    stage: int
    layers: tuple[int, ...]
    fwd: float
    bwd: float
    terms: dict[str, float]  # per micro-batch, forward + backward
    expert_loss: float  # per micro-batch: expert GEMM seconds beyond the large-GEMM rate
    optimizer: float  # per step: the optimizer's memory-bound work
    dp: dict[str, float]  # exposed data-parallel communication per step
    step_host: float = 0.0  # per step: the host's per-step and per-layer-and-step overheads
    step_reductions: float = 0.0  # per step: the trainer's latency-bound reductions over several ranks

    @property
    def work(self) -> float:
        return self.fwd + self.bwd


@dataclass
class StepTime:
    """Seconds per training step, by term (they add up to `total`), per stage, and what the estimate assumed."""

    terms: dict[str, float]
    stages: list[StageTime]
    bottleneck: int
    notes: list[str] = field(default_factory=list)
    limits: dict[str, float] = field(default_factory=dict)  # share of the step lost to each limiting factor

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def exposed_communication(self) -> float:
        return sum(v for k, v in self.terms.items() if k.startswith(("DP", *COMM_KINDS)))

    def limiting(self) -> str:
        """The factor that costs the most (bubble, exposed communication, small expert GEMMs, host overhead), or
        `compute` when none costs 10 % of the step."""
        if not self.limits:
            return "compute"
        name, share = max(self.limits.items(), key=lambda kv: kv[1])
        return name if share >= 0.10 else "compute"


def _layer_times(w: Workload, profile: DeviceProfile, topo: comm.Topology) -> tuple[cost.PassTime, comm.LayerComm]:
    work = layer_work(w)
    size = _tensor_bytes(w)
    device = cost.work_seconds(work, profile, w.attention, size)
    device.recompute(cost.work_seconds(recompute_work(w, work), profile, w.attention, size))
    attention = cost.work_seconds(LayerWork(attention=work.attention), profile, w.attention)  # what CP's ring hides
    attention_seconds = (attention.fwd, attention.bwd)
    gemms = [cost.gemm_seconds(profile.curve(g.precision), g) for g in work.gemms if not g.name.startswith("expert")]
    hidden = (sum(f for f, _ in gemms), sum(b for _, b in gemms))
    return device, comm.layer_comm(w, topo, attention_seconds, _ep_windows(w, work, device, profile, size), hidden)


def _ep_windows(
    w: Workload, work: LayerWork, device: cost.PassTime, profile: DeviceProfile, size: float
) -> comm.EpWindows:
    """The layer's device time either side of the MoE dispatch: the experts' part (their GEMMs, permute and
    activation, recomputed where recompute covers them) and the rest."""
    if not work.moe:
        return comm.EpWindows()
    mlp = cost.work_seconds(expert_block(work), profile, w.attention, size)
    mlp.recompute(cost.work_seconds(expert_block(recompute_work(w, work)), profile, w.attention, size))
    return comm.EpWindows(device.fwd - mlp.fwd, device.bwd - mlp.bwd, mlp.fwd, mlp.bwd)


def _tensor_bytes(w: Workload) -> float:
    """The size of a layer's activation tensors ([T, h] in the activation dtype)."""
    return w.tokens * w.model.hidden_size * w.act_bytes


def _host_layer(w: Workload, profile: DeviceProfile) -> float:
    """Host seconds of one layer, forward + backward, per micro-batch."""
    h, m = profile.host, w.model
    seconds = h.per_layer + (h.per_layer_gate if m.gate.enabled else 0.0)
    if m.is_moe:
        seconds += h.per_layer_moe
        if not (w.grouped_gemm and profile.grouped_gemm):
            seconds += h.per_expert * (m.num_experts // w.ep)
    if w.recompute == "full":
        seconds *= 4 / 3  # the forward's ops are issued again
    return seconds


def step_time(w: Workload, profile: DeviceProfile, ranks_per_node: int = 8) -> StepTime:
    """The step time of workload `w` on the device of `profile` (`ranks_per_node`: ranks sharing a node)."""
    scales = (profile.gemm_scale, profile.attention_scale, profile.work_scale)
    profile = profile.scaled_for_ranks(min(ranks_per_node, w.world)).in_step()
    topo = comm.Topology.of(profile, ranks_per_node)
    host = profile.host
    layer, lcomm = _layer_times(w, profile, topo)
    host_layer = _host_layer(w, profile)
    sync = host.moe_sync if w.model.is_moe and not host.serial else 0.0
    if host.serial:
        layer_fwd = layer.fwd + sum(lcomm.fwd.values()) + host_layer / 3
        layer_bwd = layer.bwd + sum(lcomm.bwd.values()) + 2 * host_layer / 3
    else:
        layer_fwd = max(layer.fwd + sum(lcomm.fwd.values()), host_layer / 3) + sync
        layer_bwd = max(layer.bwd + sum(lcomm.bwd.values()), 2 * host_layer / 3) + 2 * sync
    hidden_host = (layer_fwd + layer_bwd) - (layer.total + lcomm.total)  # the host time not hidden behind work
    embed = cost.work_seconds(embedding_work(w), profile, w.attention, _tensor_bytes(w))
    # the logits: [T, V / TP] in fp32 through the loss
    output = cost.work_seconds(output_work(w), profile, w.attention, 4 * w.tokens * w.model.vocab_size / w.tp)
    first_comm, last_comm = comm.edge_comm(w, topo)
    p2p = comm.pp_seconds(w, topo)
    grid = w.layers()
    # the trainer's per-step reductions over the model-parallel ranks (the loss, the gradient norm twice, the
    # optimizer's found-inf checks, SP's norm gradients): latency-bound, one link latency each
    step_collectives = STEP_COLLECTIVES * (topo.intra.latency if w.world > 1 else 0.0)
    stages: list[StageTime] = []
    for s, chunks in enumerate(grid):
        n = sum(chunks)
        terms: dict[str, float] = {}
        for k, v in layer.terms.items():
            terms[k] = terms.get(k, 0.0) + n * v
        for k in set(lcomm.fwd) | set(lcomm.bwd):
            terms[k] = n * (lcomm.fwd.get(k, 0.0) + lcomm.bwd.get(k, 0.0))
        fwd, bwd = n * layer_fwd, n * layer_bwd
        edge_device, edge_comm = 0.0, 0.0  # the embedding / output work and its TP traffic
        if s == 0:
            edge_device += embed.total
            edge_comm += first_comm
            fwd, bwd = fwd + embed.fwd, bwd + embed.bwd
        if s == len(grid) - 1:
            edge_device += output.total
            edge_comm += last_comm
            fwd, bwd = fwd + output.fwd, bwd + output.bwd
        terms["embedding, output layer, loss"] = edge_device
        if edge_comm:
            terms["TP"] = terms.get("TP", 0.0) + edge_comm
            fwd += edge_comm / 2
            bwd += edge_comm / 2
        if w.pp > 1:
            if w.vpp and not host.serial:
                # the interleaved schedule with overlap_p2p_comm (the trainer sets it with VPP on a GPU, as
                # Megatron-LM does): a chunk's send and the next receive are posted asynchronously and waited for
                # only before the chunk that needs them, so each transfer runs behind a chunk's compute
                p2p_fwd = sum(topo.hidden(p2p, c * layer_fwd) for c in chunks)
                p2p_bwd = sum(topo.hidden(p2p, c * layer_bwd) for c in chunks)
            else:  # 1F1B's blocking send/receive pairs (and gloo's on a CPU): on the critical path
                p2p_fwd = p2p_bwd = len(chunks) * p2p
            terms["PP p2p"] = p2p_fwd + p2p_bwd
            fwd, bwd = fwd + p2p_fwd, bwd + p2p_bwd
        # the schedule's work per model chunk and micro-batch (forward_step, the loss, the p2p hand-over): on a GPU
        # the next chunk waits for it (its input comes from another stage), so it is not hidden
        extra_host = host.per_microbatch * len(chunks)
        fwd, bwd = fwd + extra_host / 3, bwd + 2 * extra_host / 3
        terms["host overhead"] = n * (host_layer if host.serial else hidden_host) + extra_host
        if sync:
            terms["MoE host sync"] = 3 * n * sync
            terms["host overhead"] -= 3 * n * sync
        state = optimizer_bytes(w, s)
        optim = state / profile.bandwidth(state / 10)
        step_host = host.per_step + host.per_layer_step * n
        dp = comm.dp_seconds(w, topo, s, bwd_window=bwd, fwd_window=fwd)
        expert_loss = n * max(0.0, layer.terms.get("expert GEMMs", 0.0) - layer.expert_ideal)
        stages.append(StageTime(s, chunks, fwd, bwd, terms, expert_loss, optim, dp, step_host, step_collectives))
    m = w.microbatches
    pipe = schedule.pipeline_seconds([st.work for st in stages], m, w.chunks)
    b = max(range(len(stages)), key=lambda i: stages[i].work)
    slow = stages[b]
    terms = {k: m * v for k, v in slow.terms.items() if v}
    # the stage terms add up to the stage's work only up to the host time hidden behind it: rescale to the work
    scale = m * slow.work / max(sum(terms.values()), 1e-30)
    terms = {k: v * scale for k, v in terms.items()}
    terms["pipeline bubble"] = pipe - m * slow.work
    after = max(stages, key=lambda st: st.optimizer + st.step_host + st.step_reductions + sum(st.dp.values()))
    terms.update({k: v for k, v in after.dp.items() if v})
    terms["optimizer step"] = after.optimizer
    terms["host overhead"] = terms.get("host overhead", 0.0) + after.step_host
    terms["DP/TP step reductions"] = after.step_reductions
    st = StepTime({k: v for k, v in terms.items() if v > 0 or k == "pipeline bubble"}, stages, b)
    total = st.total
    exposed = sum(v for k, v in st.terms.items() if k.startswith(("DP", *COMM_KINDS)))
    st.limits = {
        "pipeline bubble": max(0.0, st.terms.get("pipeline bubble", 0.0)) / total,
        "exposed communication": exposed / total,
        "small expert GEMMs": m * slow.expert_loss * scale / total,
        "host overhead": (st.terms.get("host overhead", 0.0) + st.terms.get("MoE host sync", 0.0)) / total,
    }
    st.notes = _notes(w, profile, topo, scales)
    return st


def _notes(w: Workload, profile: DeviceProfile, topo: comm.Topology, scales: tuple[float, ...]) -> list[str]:
    h = profile.host
    curve = profile.curve(w.precision)
    in_step = ""
    if set(scales) != {1.0}:
        in_step = (
            f" (the rates inside a step: the calibrated kernels' time x {scales[0]:.2f} for GEMMs, x {scales[1]:.2f}"
            f" for attention, x {scales[2]:.2f} for memory-bound work)"
        )
    notes = [
        f"device profile {profile.name} ({profile.source or profile.kind}): {w.precision} GEMMs up to "
        f"{curve.rate / 1e12:.0f} TFLOP/s (half speed at {curve.half:.0f} rows), {w.attention} attention at "
        f"{profile.attention_curve(w.attention).rate / 1e12:.0f} TFLOP/s, memory-bound work at "
        f"{profile.memory_bandwidth / 1e9:.0f} GB/s{in_step}",
        f"links: {topo.intra.bandwidth / 1e9:.0f} GB/s inside an NVLink domain of {topo.domain} ranks, "
        f"{topo.inter.bandwidth / 1e9:.0f} GB/s per rank between domains (as collectives achieve them)",
        f"host overhead: {h.per_layer * 1e3:.2f} ms per layer and micro-batch"
        + (
            f" (+{h.per_layer_moe * 1e3:.2f} ms MoE, {h.moe_sync * 1e3:.2f} ms sync per MoE pass)"
            if w.model.is_moe
            else ""
        )
        + (", added to the work (CPU)" if h.serial else ", hidden behind longer device work (GPU)"),
    ]
    if w.model.is_moe:
        notes.append(
            f"MoE routing imbalance {w.routing_imbalance:g} (busiest expert rank / mean; 1 = balanced, as NVIDIA's "
            f"benchmarks force); {w.dispatcher} dispatcher; experts "
            + ("in one grouped GEMM" if w.grouped_gemm and profile.grouped_gemm else "one GEMM each")
        )
    overlap = []
    if w.overlap_grad_reduce:
        overlap.append("gradient reduce-scatter behind the last backward")
    if w.overlap_param_gather:
        overlap.append("parameter all-gather behind the first forward")
    notes.append(
        "data parallel: "
        + (", ".join(overlap) if overlap else "nothing overlapped")
        + f"; buckets of {(w.bucket_size or comm.default_bucket(w.dp * w.cp)) / 1e6:.0f}M elements"
    )
    if w.recompute:
        notes.append(
            f"recompute {w.recompute}"
            + (f" ({', '.join(w.recompute_modules)})" if w.recompute == "selective" else "")
            + ": its forward again in the backward"
        )
    return notes + list(w.notes)
