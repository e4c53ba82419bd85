"""`plan(cfg, world_size, gpu)`: per-GPU memory of every rank role and a step-time estimate, for any layout."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megagate import run_config
from megagate.model.model_config import ModelConfig
from megagate.plan import memory as mem
from megagate.plan.devices import GB, Device, device
from megagate.plan.params import RankShape, rank_buffers
from megagate.plan.time import Links, StepTime, step_time
from megagate.run_config import TrainConfig

DEFAULT_MFU = 0.40  # a well-tuned megatron bf16 run reaches 35-50 % on H100; the estimate scales as 1 / MFU
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
    device: Device
    layout: object  # megagate.distributed.layout.Layout
    kernels: mem.Kernels
    roles: list[Role]
    time: StepTime
    assumptions: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(r.total <= self.device.memory_bytes for r in self.roles)

    @property
    def peak(self) -> Role:
        return max(self.roles, key=lambda r: r.total)

    def refusal(self) -> str:
        """One line: why the job is predicted not to fit (empty when it fits)."""
        if self.fits:
            return ""
        r = self.peak
        largest = max(r.items, key=r.items.get)
        return (
            f"predicted out of memory: pipeline stage {r.pp_rank} needs {r.total / GB:.1f} GB of "
            f"{self.device.memory_bytes / GB:.0f} GB on {self.device.name} ({self.layout.describe()}, micro-batch "
            f"{self.cfg.train.micro_batch_size}); largest item: {largest} {r.items[largest] / GB:.1f} GB"
        )

    def table(self) -> str:
        """The per-role memory table, the step-time terms and every assumption."""
        t = self.cfg.train
        m = self.cfg.model
        lines = [
            f"layout: {self.layout.describe()}; {self.layout.describe_batch()}; seq {t.seq_length}; {t.precision}; "
            f"distributed optimizer {t.use_distributed_optimizer}; kernels {self.kernels.name}; "
            f"recompute {_recompute(m)}; sequence parallel {self.cfg.parallel.sequence_parallel}",
            f"device: {self.device.name}, {self.device.memory_bytes / GB:.0f} GB",
        ]
        names = list(dict.fromkeys(k for r in self.roles for k in r.items))
        names.sort(key=lambda n: n == "workspace margin")  # the margin last, after every stage's own items
        width = max(len(n) for n in names + ["parameters (dense / expert)"])
        header = f"{'GB per GPU':<{width}s}" + "".join(f"{'stage ' + str(r.pp_rank):>16s}" for r in self.roles)
        lines += [header, "-" * len(header)]
        lines.append(
            f"{'parameters (dense / expert)':<{width}s}"
            + "".join(
                f"{_count(r.params - r.expert_params) + ' / ' + _count(r.expert_params):>16s}" for r in self.roles
            )
        )
        for n in names:
            lines.append(f"{n:<{width}s}" + "".join(f"{r.items.get(n, 0) / GB:16.2f}" for r in self.roles))
        lines.append(f"{'total':<{width}s}" + "".join(f"{r.total / GB:16.2f}" for r in self.roles))
        verdict = "fits" if self.fits else "DOES NOT FIT: " + self.refusal()
        lines.append(
            f"{'free':<{width}s}" + "".join(f"{(self.device.memory_bytes - r.total) / GB:16.2f}" for r in self.roles)
        )
        lines.append(f"{'chunk forwards in flight':<{width}s}" + "".join(f"{r.in_flight:16d}" for r in self.roles))
        lines.append(f"-> {verdict}")
        tokens = t.global_batch_size * t.seq_length
        lines.append(
            f"step time ~{self.time.total:.2f} s = "
            + " + ".join(f"{k} {v:.3f}" for k, v in self.time.terms.items() if v > 0)
            + f"; {tokens / self.time.total:,.0f} tokens/s"
        )
        lines += ["assumptions:"] + [f"  - {a}" for a in self.assumptions + self.time.notes]
        return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def _recompute(m: ModelConfig) -> str:
    if m.recompute_granularity == "full":
        return f"full/{m.recompute_method}/{m.recompute_num_layers}"
    return m.recompute_granularity or "none"


def kernels_for(backend: str, core_attention: str = "auto") -> mem.Kernels:
    """The GPU kernel set of a train.backend ('auto' plans for Transformer Engine, the cluster default) and a
    perf.core_attention: megatron's local attention keeps the [b, np, s, s] scores, TE's and SDPA's do not."""
    if core_attention == "local":
        return mem.GPU_LOCAL
    if backend == "local":
        return mem.GPU_SDPA
    return mem.GPU_TE


def plan(
    cfg: TrainConfig,
    world_size: int,
    gpu: str | Device = "h100-sxm",
    *,
    gpus_per_node: int = 8,
    mfu: float = DEFAULT_MFU,
    margin_gb: float = DEFAULT_MARGIN_GB,
    fragmentation: float = DEFAULT_FRAGMENTATION,
    kernels: mem.Kernels | None = None,
    intra_gbs: float | None = None,
    inter_gbs: float | None = None,
) -> Plan:
    """Memory per rank role and the step time of `cfg` on `world_size` GPUs of type `gpu` (see docs/planning.md)."""
    dev = gpu if isinstance(gpu, Device) else device(gpu)
    layout = run_config.layout(cfg, world_size)  # the trainer's own layout rules (one-line ConfigError)
    m, t, p = cfg.model, cfg.train, cfg.parallel
    k = kernels or kernels_for(t.backend, cfg.perf.core_attention)
    shape = RankShape(layout.tp, layout.pp, layout.vpp, layout.ep, layout.cp, layout.dp, layout.expert_dp)
    param_bytes = 4 if t.precision == "fp32" else 2
    opt_bytes = 8 if t.precision == "fp32" else 12  # Adam m, v (+ fp32 main params under bf16/fp8)
    act = mem.ActivationShape(
        t.seq_length // layout.cp, t.micro_batch_size, layout.tp, p.sequence_parallel, param_bytes
    )
    per_chunk = m.num_layers // (layout.pp * (layout.vpp or 1))
    checkpoints, stored, at_once = mem.recomputed_layers(m, per_chunk)
    full_layer = mem.layer_bytes(m, act, k, recompute=None)
    kept_layer = mem.layer_bytes(
        m, act, k, recompute=m.recompute_granularity if m.recompute_granularity == "selective" else None
    )
    chunk_act = checkpoints * mem.checkpoint_bytes(m, act) + stored * kept_layer
    roles = []
    dense_bufs = expert_bufs = (0, 0)
    for r in range(layout.pp):
        # megatron's local spec without apex builds torch norms with fp32 weights (their own buffer)
        bufs = rank_buffers(m, shape, r, t.use_distributed_optimizer, fp32_norms=t.backend == "local")
        n_params = sum(b.numel_unpadded for b in bufs)
        n_expert = sum(b.numel_unpadded for b in bufs if b.expert)
        dist = t.use_distributed_optimizer
        weights = sum((b.numel if dist else b.numel_unpadded) * (4 if b.fp32 else param_bytes) for b in bufs)
        grads = sum((b.numel if dist else b.numel_unpadded) * 4 for b in bufs)
        optim = sum((b.max_owned() if dist else b.numel_unpadded) * (8 if b.fp32 else opt_bytes) for b in bufs)
        if r == 0:
            dense_bufs = (
                sum(b.numel * (4 if b.fp32 else param_bytes) for b in bufs if not b.expert),
                sum(b.numel for b in bufs if not b.expert) * 4,
            )
            expert_bufs = (
                sum(b.numel for b in bufs if b.expert) * param_bytes,
                sum(b.numel for b in bufs if b.expert) * 4,
            )
        flights = mem.in_flight(layout.pp, r, layout.vpp, layout.num_microbatches)
        items = {
            f"weights ({'fp32' if param_bytes == 4 else 'bf16'})": weights,
            "gradient buffer (fp32)": grads,
            "optimizer shard (Adam" + (" + fp32 main" if param_bytes == 2 else "") + ")": optim,
            "activations: layers (x chunk forwards in flight)": flights * chunk_act,
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
            out = mem.output_items(m, act, k)
            items["activations: final norm, output input, fp32 logits"] = sum(out.values())
            items["activations: logits transient"] = mem.logits_transient(m, act)
        activations = sum(v for key, v in items.items() if key.startswith("activations"))
        items["workspace margin"] = int(margin_gb * GB + fragmentation * activations)
        roles.append(Role(r, n_params, n_expert, items, flights))
    links = Links(
        gpus_per_node, intra_gbs if intra_gbs is not None else dev.intra_node_gbs, inter_gbs or dev.inter_node_gbs
    )
    st = step_time(
        m,
        seq=t.seq_length,
        global_batch=t.global_batch_size,
        micro_batch=t.micro_batch_size,
        world=world_size,
        tp=layout.tp,
        pp=layout.pp,
        vpp=layout.vpp,
        ep=layout.ep,
        cp=layout.cp,
        dp=layout.dp,
        microbatches=layout.num_microbatches,
        device=dev,
        links=links,
        precision=t.precision,
        mfu=mfu,
        dense_buffer_bytes=dense_bufs,
        expert_buffer_bytes=expert_bufs,
        expert_dp=layout.expert_dp,
    )
    assumptions = [
        "weights, gradient buffers and optimizer shards: megatron's exact buffer layout (64-element alignment, "
        "buckets padded to lcm(DP, 128)); the optimizer shard is the largest over the data-parallel ranks",
        "gradients reduced in fp32 (the trainer's grad_reduce_in_fp32); dense parameters sharded over DP x CP, "
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
    return Plan(cfg, world_size, dev, layout, k, roles, st, assumptions)


def with_overrides(cfg: TrainConfig, **parallel_and_train: object) -> TrainConfig:
    """A copy of cfg with some parallel/train/model fields replaced (for the layout search)."""
    par = {f.name for f in dataclasses.fields(cfg.parallel)}
    tr = {f.name for f in dataclasses.fields(cfg.train)}
    p_up = {k: v for k, v in parallel_and_train.items() if k in par}
    t_up = {k: v for k, v in parallel_and_train.items() if k in tr}
    m_up = {k: v for k, v in parallel_and_train.items() if k not in par and k not in tr}
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, **p_up),
        train=dataclasses.replace(cfg.train, **t_up),
        model=dataclasses.replace(cfg.model, **m_up),
    )
