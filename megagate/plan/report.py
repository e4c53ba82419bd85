"""A plan as people read it (`table`) and as programs read it (`to_dict`, what `megagate plan --json` prints).

The JSON keys are a stable interface (tools/gpu_acceptance.py and the docs read them; docs/planning.md lists each):
`device`, `layout`, `fits`, `refusal`, `memory` (per stage), `time` (step seconds, tokens/s per GPU and per cluster,
MFU, the terms, the exposed communication, the bubble, per stage, the limiting factor) and `assumptions`.
"""

from __future__ import annotations

from typing import Any

from megagate.plan.devices import GB

Plan = Any  # megagate.plan.core.Plan (core calls these; importing it here, even for typing, would be a cycle)

JSON_VERSION = 1


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def _recompute(p: Plan) -> str:
    m = p.cfg.model
    if m.recompute_granularity == "full":
        return f"full/{m.recompute_method}/{m.recompute_num_layers}"
    return m.recompute_granularity or "none"


def time_lines(p: Plan) -> list[str]:
    """The step time, its terms and the throughput, labelled per GPU and per cluster."""
    st = p.time
    unit = "GPU" if p.profile.kind == "gpu" else "rank"
    mfu = p.mfu()
    lines = [
        f"step time ~{st.total:.3f} s = "
        + " + ".join(f"{k} {v:.3f}" for k, v in st.terms.items() if v > 0.0005 * st.total)
        + (f" (slowest stage: {st.bottleneck})" if len(st.stages) > 1 else ""),
        f"throughput: {p.tokens_per_s_per_gpu:,.0f} tokens/s per {unit}; {p.tokens_per_s:,.0f} tokens/s for the "
        f"cluster of {p.world_size} {unit}s ({p.tokens_per_step:,} tokens per step)"
        + (f"; MFU {mfu:.1%} of the {p.cfg.train.precision} peak" if mfu is not None else ""),
        f"exposed communication {st.exposed_communication:.3f} s; pipeline bubble "
        f"{max(0.0, st.terms.get('pipeline bubble', 0.0)):.3f} s; limited by: {st.limiting()}",
    ]
    return lines


def table(p: Plan) -> str:
    """The per-role memory table, the step time and every assumption."""
    t = p.cfg.train
    lines = [
        f"layout: {p.layout.describe()}; {p.layout.describe_batch()}; seq {t.seq_length}; {t.precision}; "
        f"distributed optimizer {t.use_distributed_optimizer}; kernels {p.kernels.name}; "
        f"recompute {_recompute(p)}; sequence parallel {p.cfg.parallel.sequence_parallel}",
        f"device: {p.device_name}, {p.memory_bytes / GB:.0f} GB"
        + (f" per rank ({p.profile.memory_bytes / GB:.0f} GB shared)" if p.profile.kind == "cpu" else "")
        + f"; profile: {p.profile.source or 'measured'}",
    ]
    names = list(dict.fromkeys(k for r in p.roles for k in r.items))
    names.sort(key=lambda n: n == "workspace margin")  # the margin last, after every stage's own items
    width = max(len(n) for n in names + ["parameters (dense / expert)"])
    header = f"{'GB per GPU':<{width}s}" + "".join(f"{'stage ' + str(r.pp_rank):>16s}" for r in p.roles)
    lines += [header, "-" * len(header)]
    lines.append(
        f"{'parameters (dense / expert)':<{width}s}"
        + "".join(f"{_count(r.params - r.expert_params) + ' / ' + _count(r.expert_params):>16s}" for r in p.roles)
    )
    for n in names:
        lines.append(f"{n:<{width}s}" + "".join(f"{r.items.get(n, 0) / GB:16.2f}" for r in p.roles))
    lines.append(f"{'total':<{width}s}" + "".join(f"{r.total / GB:16.2f}" for r in p.roles))
    verdict = "fits" if p.fits else "DOES NOT FIT: " + p.refusal()
    lines.append(f"{'free':<{width}s}" + "".join(f"{(p.memory_bytes - r.total) / GB:16.2f}" for r in p.roles))
    lines.append(f"{'chunk forwards in flight':<{width}s}" + "".join(f"{r.in_flight:16d}" for r in p.roles))
    if len(p.time.stages) > 1:
        lines.append(
            f"{'ms per micro-batch (fwd+bwd)':<{width}s}" + "".join(f"{st.work * 1e3:16.2f}" for st in p.time.stages)
        )
    lines.append(f"-> {verdict}")
    lines += time_lines(p)
    lines += ["assumptions:"] + [f"  - {a}" for a in p.assumptions + p.time.notes]
    return "\n".join(lines)


def to_dict(p: Plan) -> dict[str, Any]:
    """The plan as JSON-ready data (see the module docstring; docs/planning.md documents every key)."""
    L, st = p.layout, p.time
    return {
        "version": JSON_VERSION,
        "device": {
            "name": p.device_name,
            "kind": p.profile.kind,
            "memory_gb": p.memory_bytes / GB,
            "profile": p.profile.source,
        },
        "world_size": p.world_size,
        "gpus_per_node": p.gpus_per_node,
        "layout": {
            "tp": L.tp,
            "pp": L.pp,
            "vpp": L.vpp,
            "cp": L.cp,
            "ep": L.ep,
            "dp": L.dp,
            "expert_dp": L.expert_dp,
            "micro_batch": L.micro_batch_size,
            "global_batch": L.global_batch_size,
            "microbatches": L.num_microbatches,
            "seq_length": p.cfg.train.seq_length,
            "precision": p.cfg.train.precision,
            "sequence_parallel": p.cfg.parallel.sequence_parallel,
            "recompute": _recompute(p),
            "kernels": p.kernels.name,
            "attention": p.workload.attention,
        },
        "fits": p.fits,
        "refusal": p.refusal(),
        "memory": {
            "peak_gb": p.peak.total / GB,
            "stages": [
                {
                    "stage": r.pp_rank,
                    "total_gb": r.total / GB,
                    "free_gb": (p.memory_bytes - r.total) / GB,
                    "params": r.params,
                    "expert_params": r.expert_params,
                    "in_flight": r.in_flight,
                    "items_gb": {k: v / GB for k, v in r.items.items()},
                }
                for r in p.roles
            ],
        },
        "time": {
            "step_s": st.total,
            "tokens_per_step": p.tokens_per_step,
            "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
            "tokens_per_s_cluster": p.tokens_per_s,
            "mfu": p.mfu(),
            "mfu_bf16": p.mfu("bf16"),
            "terms_s": dict(st.terms),
            "exposed_communication_s": st.exposed_communication,
            "pipeline_bubble_s": max(0.0, st.terms.get("pipeline bubble", 0.0)),
            "limiting": st.limiting(),
            "limits": dict(st.limits),
            "slowest_stage": st.bottleneck,
            "stages": [
                {
                    "stage": s.stage,
                    "layers": list(s.layers),
                    "fwd_s_per_microbatch": s.fwd,
                    "bwd_s_per_microbatch": s.bwd,
                    "optimizer_s": s.optimizer,
                    "step_host_s": s.step_host,
                    "dp_exposed_s": sum(s.dp.values()),
                }
                for s in st.stages
            ],
        },
        "assumptions": p.assumptions + st.notes,
    }
