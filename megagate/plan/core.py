"""`plan(cfg, world_size, gpu)`: per-GPU memory of every rank role and the step time, for any layout."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megagate.distributed.layout import stage_layers
from megagate.machine import Machine
from megagate.model.counts import flops_per_token
from megagate.plan import memory as mem
from megagate.plan.devices import GB, GpuSpec, gpu_spec
from megagate.plan.gpu_defaults import gpu_profile
from megagate.plan.params import RankShape, layer_params, rank_buffers
from megagate.plan.profile import DeviceProfile, Link
from megagate.plan.time import StepTime, step_time
from megagate.plan.work import Workload
from megagate.run_config import TrainConfig
from megagate.run_setup import RunSetup, resolve

DEFAULT_MARGIN_GB = 3.0  # CUDA context, cuBLAS/TE workspaces, NCCL buffers of every communicator
DEFAULT_FRAGMENTATION = 0.05  # caching-allocator slack, as a share of the activations


@dataclass(frozen=True)
class Role:
    """One distinct kind of rank: a pipeline stage (every TP/EP/DP rank of it holds the same amounts)."""

    pp_rank: int
    params: int
    expert_params: int
    items: dict[str, int]  # bytes, by item
    in_flight: int = 1  # model-chunk forwards whose activations the stage holds at its peak

    @property
    def total(self) -> int:
        return sum(self.items.values())

    @property
    def activations(self) -> int:
        return sum(v for k, v in self.items.items() if k.startswith("activations"))


@dataclass
class Plan:
    """The plan of one config on one world size and device."""

    cfg: TrainConfig
    world_size: int
    profile: DeviceProfile
    layout: object  # megagate.distributed.layout.Layout
    kernels: mem.Kernels
    roles: list[Role]
    time: StepTime
    workload: Workload
    gpus_per_node: int = 8
    assumptions: list[str] = field(default_factory=list)

    @property
    def device_name(self) -> str:
        return self.profile.name

    @property
    def memory_bytes(self) -> int:
        """Memory per rank: the GPU's, or a CPU's shared by the ranks on it."""
        if self.profile.kind == "cpu":
            return self.profile.memory_bytes // max(1, min(self.gpus_per_node, self.world_size))
        return self.profile.memory_bytes

    @property
    def fits(self) -> bool:
        return all(r.total <= self.memory_bytes for r in self.roles)

    @property
    def peak(self) -> Role:
        return max(self.roles, key=lambda r: r.total)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch_size * self.cfg.train.seq_length

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of the whole cluster."""
        return self.tokens_per_step / self.time.total

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.world_size

    def mfu(self, precision: str | None = None) -> float | None:
        """Model FLOPs (megagate.model.counts, as the trainer logs them) per GPU over the dense peak of `precision`
        (default: the run's); None on a device without a datasheet peak (a CPU)."""
        if self.profile.gpu is None:
            return None
        peak = gpu_spec(self.profile.gpu).peak_tflops(precision or self.cfg.train.precision) * 1e12
        flops = flops_per_token(self.cfg.model, self.cfg.train.seq_length) * self.tokens_per_s_per_gpu
        return flops / peak

    def refusal(self) -> str:
        """One line: why the job is predicted not to fit (empty when it fits)."""
        if self.fits:
            return ""
        r = self.peak
        largest = max(r.items, key=r.items.get)
        return (
            f"predicted out of memory: pipeline stage {r.pp_rank} needs {r.total / GB:.1f} GB of "
            f"{self.memory_bytes / GB:.0f} GB on {self.device_name} ({self.layout.describe()}, micro-batch "
            f"{self.cfg.train.micro_batch_size}); largest item: {largest} {r.items[largest] / GB:.1f} GB"
        )

    def table(self) -> str:
        from megagate.plan.report import table

        return table(self)

    def to_dict(self) -> dict:
        from megagate.plan.report import to_dict

        return to_dict(self)


def kernels_for(backend: str, core_attention: str = "auto", cpu: bool = False) -> mem.Kernels:
    """The kernel set of a resolved backend ("te" | "local") and core attention ("te" | "sdpa" | "local"):
    megatron's local attention keeps the [b, np, s, s] scores, TE's and SDPA's do not."""
    if cpu:
        return mem.CPU_LOCAL if core_attention == "local" else mem.CPU_SDPA
    if core_attention == "local":
        return mem.GPU_LOCAL
    if backend == "local":
        return mem.GPU_SDPA
    return mem.GPU_TE


def device_profile(
    gpu: str | GpuSpec | DeviceProfile, intra_gbs: float | None = None, inter_gbs: float | None = None
) -> DeviceProfile:
    """The profile to plan with: a calibrated one as given, else the GPU's datasheet profile; link rates given on
    the command line replace the nominal ones (a datasheet profile applies its achieved shares to them)."""
    if isinstance(gpu, DeviceProfile):
        p = gpu
        if intra_gbs is not None:
            p = dataclasses.replace(p, intra=Link(p.intra.latency, intra_gbs * 1e9))
        if inter_gbs is not None:
            p = dataclasses.replace(p, inter=Link(p.inter.latency, inter_gbs * 1e9))
        return p
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    if intra_gbs is not None or inter_gbs is not None:
        spec = dataclasses.replace(
            spec,
            intra_node_gbs=spec.intra_node_gbs if intra_gbs is None else intra_gbs,
            inter_node_gbs=spec.inter_node_gbs if inter_gbs is None else inter_gbs,
        )
    return gpu_profile(spec)


def workload(setup: RunSetup, profile: DeviceProfile, gpus_per_node: int, imbalance: float) -> Workload:
    """The step's work as the trainer runs the set-up (`run_setup.resolve` for the profile's device)."""
    cfg, layout, r = setup.cfg, setup.layout, setup.perf
    m, t, p = cfg.model, cfg.train, cfg.parallel
    cpu = profile.kind == "cpu"
    attention = "local" if setup.core_attention == "local" else ("sdpa" if cpu else "flash")
    return Workload(
        model=m,
        seq=t.seq_length,
        micro_batch=t.micro_batch_size,
        global_batch=t.global_batch_size,
        tp=layout.tp,
        pp=layout.pp,
        vpp=layout.vpp,
        ep=layout.ep,
        cp=layout.cp,
        dp=layout.dp,
        precision=t.precision,
        attention=attention,
        fused_norms=not cpu,
        sequence_parallel=p.sequence_parallel,
        recompute=m.recompute_granularity,
        recompute_modules=tuple(r.recompute_modules or ("core_attn",)),
        grouped_gemm=r.moe_grouped_gemm,
        dispatcher=r.moe_token_dispatcher_type,
        distributed_optimizer=t.use_distributed_optimizer,
        overlap_grad_reduce=r.overlap_grad_reduce,
        overlap_param_gather=r.overlap_param_gather,
        bucket_size=r.bucket_size,
        etp=layout.etp,
        tp_overlap=r.tp_comm_overlap,
        ep_overlap=r.overlap_moe_expert_parallel_comm,
        fsdp=r.use_megatron_fsdp,
        grad_bytes=4 if cfg.perf.grad_reduce_in_fp32 or t.precision == "fp32" else 2,
        stage_layers=stage_layers(p, m.num_layers),
        routing_imbalance=imbalance,
        gpus_per_node=gpus_per_node,
    )


def plan(
    cfg: TrainConfig,
    world_size: int,
    gpu: str | GpuSpec | DeviceProfile = "h100-sxm",
    *,
    gpus_per_node: int = 8,
    margin_gb: float = DEFAULT_MARGIN_GB,
    fragmentation: float = DEFAULT_FRAGMENTATION,
    kernels: mem.Kernels | None = None,
    intra_gbs: float | None = None,
    inter_gbs: float | None = None,
    routing_imbalance: float = 1.0,
) -> Plan:
    """Memory per rank role and the step time of `cfg` on `world_size` devices (see docs/planning.md). `gpu`: a
    GPU table name, a GpuSpec, or a calibrated DeviceProfile (`megagate calibrate`; a CPU's plans the CPU run)."""
    profile = device_profile(gpu, intra_gbs, inter_gbs)
    cpu = profile.kind == "cpu"
    # the trainer's own layout rules and perf decisions for that device (one-line ConfigErrors)
    setup = resolve(cfg, world_size, Machine(gpu=False, te=False) if cpu else Machine.target(cfg))
    layout = setup.layout
    k = kernels or kernels_for(setup.backend, setup.core_attention, cpu=cpu)
    local_loss = layout.tp == 1 and not setup.perf.cross_entropy_loss_fusion  # model.loss: torch's cross-entropy
    fsdp = cfg.perf.data_parallel_sharding_strategy if setup.perf.use_megatron_fsdp else None
    modules = tuple(setup.perf.recompute_modules or ("core_attn",))  # selective recompute's modules, resolved
    te_loss = setup.perf.cross_entropy_loss_fusion and setup.perf.cross_entropy_fusion_impl == "te"
    roles = _roles(
        cfg,
        layout,
        k,
        margin_gb,
        fragmentation,
        local_loss,
        setup.perf.overlap_moe_expert_parallel_comm,
        fsdp,
        modules,
        offloaded=setup.perf.cpu_offloading_num_layers,
        te_loss=te_loss,
    )
    w = workload(setup, profile, gpus_per_node, routing_imbalance)
    st = step_time(w, profile, ranks_per_node=min(gpus_per_node, world_size))
    assumptions = [
        "weights, gradient buffers and optimizer shards: megatron's exact buffer layout (64-element alignment, "
        "buckets padded to lcm(DP, 128)); the optimizer shard is the largest over the data-parallel ranks",
        f"gradients reduced in {'fp32' if w.grad_bytes == 4 else 'bf16'} (perf.grad_reduce_in_fp32); dense "
        "parameters sharded over DP x CP, "
        "expert parameters over the expert-data-parallel group",
        f"activations: the tensors autograd keeps with {k.name} kernels "
        + (
            "(flash attention: no [b, np, s, s] scores)"
            if k.flash_attention
            else "(unfused attention keeps [b, np, s, s] scores)"
        )
        + ", balanced MoE routing; the backward working set is one more layer's worth",
        f"workspace margin: {margin_gb:g} GB fixed + {fragmentation:.0%} of the activations",
    ]
    return Plan(cfg, world_size, profile, layout, k, roles, st, w, gpus_per_node, assumptions)


def _roles(
    cfg: TrainConfig,
    layout,
    k: mem.Kernels,
    margin_gb: float,
    fragmentation: float,
    local_loss: bool,
    ep_overlap: bool = False,
    fsdp: str | None = None,
    modules: tuple[str, ...] = ("core_attn",),
    offloaded: int = 0,
    te_loss: bool = False,
) -> list[Role]:
    """Every pipeline stage's memory by item (exact buffers, the activation inventory, the margin). `offloaded`:
    layers whose activations go to the host (`perf.cpu_offloading_num_layers`, PP 1); `te_loss`: TE's fused loss."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    grid = stage_layers(p, m.num_layers)  # the trainer's split: every stage's real layer counts
    shape = RankShape(
        layout.tp, layout.pp, layout.vpp, layout.ep, layout.cp, layout.dp, layout.expert_dp, layout.etp, grid
    )
    param_bytes = 4 if t.precision == "fp32" else 2
    # DDP's gradient buffer: fp32 (grad_reduce_in_fp32, megatron's default) or the parameter dtype (the recipes')
    grad_bytes = 4 if cfg.perf.grad_reduce_in_fp32 else param_bytes
    opt_bytes = 8 if t.precision == "fp32" else 12  # Adam m, v (+ fp32 main params under bf16/fp8)
    act = mem.ActivationShape(
        t.seq_length // layout.cp,
        t.micro_batch_size,
        layout.tp,
        p.sequence_parallel,
        param_bytes,
        expert_tp=None if layout.etp == layout.tp else layout.etp,
        linear_bytes=1 if t.precision == "fp8" else None,  # TE's FP8 linears keep their inputs quantised
    )
    full_layer = mem.layer_bytes(m, act, k, recompute=None)
    kept_layer = mem.layer_bytes(
        m, act, k, m.recompute_granularity if m.recompute_granularity == "selective" else None, modules
    )

    def chunk_bytes(layers: int) -> tuple[int, int]:
        checkpoints, stored, at_once = mem.recomputed_layers(m, layers)
        return checkpoints * mem.checkpoint_bytes(m, act) + stored * kept_layer, at_once

    roles = []
    for r in range(layout.pp):
        # the stage's chunks in flight hold their own layer counts (uneven splits): their mean, rounded up
        per_chunk = [chunk_bytes(n) for n in grid[r]]
        chunk_act = -(-sum(c for c, _ in per_chunk) // len(per_chunk))
        at_once = max(a for _, a in per_chunk)
        # megatron's local spec without apex builds torch norms with fp32 weights (their own buffer)
        bufs = rank_buffers(m, shape, r, t.use_distributed_optimizer, fp32_norms=t.backend == "local")
        n_params = sum(b.numel_unpadded for b in bufs)
        n_expert = sum(b.numel_unpadded for b in bufs if b.expert)
        dist = t.use_distributed_optimizer
        weights = sum((b.numel if dist else b.numel_unpadded) * (4 if b.fp32 else param_bytes) for b in bufs)
        grads = sum((b.numel if dist else b.numel_unpadded) * grad_bytes for b in bufs)
        if fsdp in ("optim_grads", "optim_grads_params"):  # Megatron-FSDP shards the gradients over DP too
            grads = sum(b.max_owned() * grad_bytes for b in bufs)
        if fsdp == "optim_grads_params":  # ... and the weights, two layers' worth gathered at a time (prefetch)
            unit = sum(q.numel for q in layer_params(m, layout.tp, layout.ep, etp=layout.etp)) * param_bytes
            weights = sum(b.max_owned() * (4 if b.fp32 else param_bytes) for b in bufs) + 2 * unit
        optim = sum((b.max_owned() if dist else b.numel_unpadded) * (8 if b.fp32 else opt_bytes) for b in bufs)
        flights = mem.in_flight(layout.pp, r, layout.vpp, layout.num_microbatches, ep_overlap)
        # TE's CPU offload (PP 1): the first `offloaded` layers' activations go to the host as each layer's forward
        # ends; one layer's copy is in flight at a time, so that one stays on the device until it lands
        on_host = max(0, offloaded - 1) * kept_layer if offloaded else 0
        items = {
            f"weights ({'fp32' if param_bytes == 4 else 'bf16'})": weights,
            f"gradient buffer ({'fp32' if grad_bytes == 4 else 'bf16'})": grads,
            "optimizer shard (Adam" + (" + fp32 main" if param_bytes == 2 else "") + ")": optim,
            "activations: layers (x chunk forwards in flight)": flights * (chunk_act - on_host),
        }
        if r == 0:
            items["activations: token ids"] = min(layout.pp, layout.num_microbatches) * mem.embedding_bytes(act)
        if at_once:
            items["activations: recompute working set"] = at_once * full_layer
        elif m.recompute_granularity == "selective":
            # with flash attention selective recompute can keep more than it recomputes away
            items["activations: recompute working set"] = max(0, full_layer - kept_layer)
        items["activations: backward working set (one layer)"] = full_layer
        if r == layout.pp - 1:
            out = mem.output_items(m, act, k, local_loss, te_loss)
            items["activations: final norm, output input, fp32 logits"] = sum(out.values())
            items["activations: logits transient"] = mem.logits_transient(m, act)
        activations = sum(v for key, v in items.items() if key.startswith("activations"))
        items["workspace margin"] = int(margin_gb * GB + fragmentation * activations)
        roles.append(Role(r, n_params, n_expert, items, flights))
    return roles


def with_overrides(cfg: TrainConfig, **parallel_and_train: object) -> TrainConfig:
    """A copy of cfg with some parallel/train/perf/model fields replaced (for the layout search)."""
    par = {f.name for f in dataclasses.fields(cfg.parallel)}
    tr = {f.name for f in dataclasses.fields(cfg.train)}
    pf = {f.name for f in dataclasses.fields(cfg.perf)} - {"recompute_modules"}
    p_up = {k: v for k, v in parallel_and_train.items() if k in par}
    t_up = {k: v for k, v in parallel_and_train.items() if k in tr}
    f_up = {k: v for k, v in parallel_and_train.items() if k in pf}
    m_up = {k: v for k, v in parallel_and_train.items() if k not in par and k not in tr and k not in pf}
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, **p_up),
        train=dataclasses.replace(cfg.train, **t_up),
        model=dataclasses.replace(cfg.model, **m_up),
        perf=dataclasses.replace(cfg.perf, **f_up),
    )
