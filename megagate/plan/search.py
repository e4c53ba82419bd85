"""The layout search: every layout (TP, PP, VPP with the embedding/loss split where the layers need it, EP,
micro-batch, recompute) that fits, ranked by step time, each
with what limits it (memory, the pipeline bubble, exposed communication, small expert GEMMs, host overhead)."""

from __future__ import annotations

from dataclasses import dataclass

from megagate.errors import ConfigError
from megagate.plan.core import Plan, device_profile, plan, with_overrides
from megagate.plan.profile import DeviceProfile
from megagate.run_config import TrainConfig

RECOMPUTE = (
    {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None},
    {"recompute_granularity": "selective", "recompute_method": None, "recompute_num_layers": None},
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
)
MEMORY_TIGHT = 0.10  # a layout with less than this share of the device free is limited by memory


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    label: str

    def limited_by(self) -> str:
        """What limits this layout: memory when it is within 10 % of the device's memory or needs recompute to
        fit, else the step-time factor that costs the most (megagate.plan.time.StepTime.limiting)."""
        p = self.plan
        free = 1 - p.peak.total / p.memory_bytes
        reason = p.time.limiting()
        if free < MEMORY_TIGHT:
            return f"memory ({free:.0%} free)" + ("" if reason == "compute" else f", {reason}")
        if reason == "compute":
            return "compute"
        return f"{reason} ({p.time.limits[reason]:.0%} of the step)"


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in (1, 2, 4, 8, 16, 32, 64, 128) if d <= limit and n % d == 0]


def _pipeline_splits(num_layers: int, pp: int) -> list[tuple[int | None, bool]]:
    """(VPP, embedding+loss split) pairs megatron can build at `pp` stages: every virtual depth up to 8 whose
    chunks divide the layers evenly, or with the embedding and the loss counted as layers (Qwen3-235B's 94 layers
    at PP 8 x VP 4, Llama-3-70B's 80 at VP 5), each chunk keeping at least one layer."""
    if pp > num_layers:
        return []
    out: list[tuple[int | None, bool]] = []
    for vpp in [None, *range(2, 9)] if pp > 1 else [None]:
        virtual = pp * (vpp or 1)
        if virtual > num_layers:
            continue
        if num_layers % virtual == 0:
            out.append((vpp, False))
        elif pp > 1 and (num_layers + 2) % virtual == 0 and (num_layers + 2) // virtual >= 2:
            out.append((vpp, True))
    return out


def _variants(cfg: TrainConfig, ep: int, gpus_per_node: int) -> list[tuple[dict, str]]:
    """The context-parallel sizes and dispatchers to try beside the layout: CP 2 and 4 for sequences of 16k and more
    (TE's attention; the layout rules refuse what does not divide), DeepEP's flex dispatcher beside alltoall when the
    EP group leaves the NVLink domain (the config's own dispatcher otherwise)."""
    cps = [1] + ([2, 4] if cfg.train.seq_length >= 16384 and cfg.train.backend != "local" else [])
    dispatchers = [None]
    if cfg.model.is_moe and ep > gpus_per_node and cfg.perf.moe_token_dispatcher_type in ("auto", "alltoall"):
        dispatchers.append("flex")
    out = []
    for cp in cps:
        for dispatcher in dispatchers:
            extra: dict = {"context_parallel_size": cp}
            if dispatcher:
                extra["moe_token_dispatcher_type"] = dispatcher
            out.append((extra, (f" CP{cp}" if cp > 1 else "") + (f" {dispatcher}" if dispatcher else "")))
    return out


def search(
    cfg: TrainConfig,
    world_size: int,
    gpu: str | DeviceProfile,
    *,
    gpus_per_node: int = 8,
    misses: list[Candidate] | None = None,
    **plan_kwargs: object,
) -> list[Candidate]:
    """The fitting layouts of cfg's model on world_size GPUs, fastest first (TP within a node, SP whenever TP > 1);
    `misses`, when given, receives the layouts megatron accepts that do not fit."""
    m = cfg.model
    profile = device_profile(gpu, plan_kwargs.pop("intra_gbs", None), plan_kwargs.pop("inter_gbs", None))
    out = []
    # megatron's rule (qkv_layout.check_tensor_parallel): whole heads per rank, KV groups a multiple or divisor of TP
    tps = [
        t
        for t in _divisors(m.num_attention_heads, gpus_per_node)
        if not m.num_query_groups % t or not t % m.num_query_groups
    ]
    for tp in tps:
        for pp in (1, 2, 4, 8, 16, 32):
            for vpp, split in _pipeline_splits(m.num_layers, pp):
                for ep in _divisors(m.num_experts, world_size) if m.is_moe else [1]:
                    for mbs in (1, 2, 4):
                        for rc, (extra, suffix) in (
                            (r, v) for r in RECOMPUTE for v in _variants(cfg, ep, gpus_per_node)
                        ):
                            try:
                                c = with_overrides(
                                    cfg,
                                    tensor_model_parallel_size=tp,
                                    pipeline_model_parallel_size=pp,
                                    virtual_pipeline_model_parallel_size=vpp,
                                    expert_model_parallel_size=ep,
                                    sequence_parallel=tp > 1,
                                    micro_batch_size=mbs,
                                    num_layers_in_first_pipeline_stage=None,
                                    num_layers_in_last_pipeline_stage=None,
                                    pipeline_model_parallel_layout=None,
                                    account_for_embedding_in_pipeline_split=split,
                                    account_for_loss_in_pipeline_split=split,
                                    **rc,
                                    **extra,
                                )
                                p = plan(c, world_size, profile, gpus_per_node=gpus_per_node, **plan_kwargs)
                            except ConfigError:
                                continue  # not a layout megatron accepts for this world / batch
                            label = (
                                f"TP{tp} PP{pp}"
                                + (f" VPP{vpp}" if vpp else "")
                                + (" E+L split" if split else "")
                                + (f" EP{ep}" if m.is_moe else "")
                                + suffix
                                + f" mbs{mbs} recompute={rc['recompute_granularity'] or 'none'}"
                            )
                            if p.fits:
                                out.append(Candidate(p, label))
                            elif misses is not None:
                                misses.append(Candidate(p, label))
    return sorted(out, key=lambda c: c.plan.time.total)


def why_nothing_fits(misses: list[Candidate], world_size: int) -> str:
    """Why a search found no layout: none that megatron accepts on these GPUs, or the one needing the least memory
    and how far over it is."""
    if not misses:
        return f"no layout of the model on {world_size} GPUs is one megatron accepts (heads, layers, batch, experts)"
    least = min(misses, key=lambda c: max(r.total for r in c.plan.roles))
    need = max(r.total for r in least.plan.roles) / 1e9
    return (
        f"the layout needing the least memory, {least.label}, needs {need:.1f} GB of "
        f"{least.plan.memory_bytes / 1e9:.1f} GB per GPU"
    )


def format_search(cands: list[Candidate], top: int = 15) -> str:
    """One line per fitting layout: step time, tokens/s per GPU, peak memory and what limits it."""
    if not cands:
        return "no layout fits"
    unit = "GPU" if cands[0].plan.profile.kind == "gpu" else "rank"
    lines = [f"{'rank':>4s}  {'layout':44s} {'step s':>8s} {'tok/s/' + unit:>11s} {'peak GB':>8s}  limited by"]
    for i, c in enumerate(cands[:top], 1):
        lines.append(
            f"{i:>4d}  {c.label:44s} {c.plan.time.total:8.3f} {c.plan.tokens_per_s_per_gpu:11,.0f} "
            f"{c.plan.peak.total / 1e9:8.1f}  {c.limited_by()}"
        )
    lines.append(f"({len(cands)} layouts fit; tokens/s are per {unit}; the cluster's are x {cands[0].plan.world_size})")
    return "\n".join(lines)
