"""Published Megatron runs (megagate/plan/published_runs.yaml) as workloads, and the planner's error on them.

Each run becomes a `Workload` exactly as published (model shape, GPU count, precision, TP/PP/CP/VPP/EP, micro and
global batch, sequence length, FSDP, the pipeline split megatron uses) and its published throughput becomes tokens/s
per GPU: as given, from a published step time (GBS x seq / step / GPUs), or from a published TFLOP/s per GPU through
Megatron-LM's own FLOP count (`megatron_flops_per_token`, the formula of the source's version). `predict` gives the
planner's figure for a set of GPU constants; tools/fit_published.py fits them on the `fit` runs. Pure.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megagate.errors import ConfigError
from megagate.model import gate as gates
from megagate.model.model_config import ModelConfig
from megagate.model.presets import from_dict as model_from_dict
from megagate.plan.devices import gpu_spec
from megagate.plan.gpu_defaults import FITTED, GpuConstants, gpu_profile
from megagate.plan.schedule import split_layers
from megagate.plan.time import StepTime, step_time
from megagate.plan.work import Workload, stage_parameters
from megagate.yamlfile import load_mapping

DATA = Path(__file__).with_name("published_runs.yaml")
# the second held-out table (gathered apart, nothing fitted on it; its models are DATA's)
HELD_OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "held_out_runs.yaml"


@dataclass(frozen=True)
class Run:
    """One published run: its workload, device and published tokens/s per GPU."""

    id: str
    workload: Workload
    gpu: str
    gpus_per_node: int
    tokens_per_s_per_gpu: float  # published, or derived from the published figure (see `derived`)
    derived: str  # "" when published as tokens/s per GPU, else how it was derived
    use: str  # fit | held-out
    entry: dict[str, Any]  # the YAML entry (source, section, row, ...)

    @property
    def moe(self) -> bool:
        return self.workload.model.is_moe

    @property
    def config_key(self) -> tuple:
        """What NVIDIA held fixed when choosing the layout: model, system, GPU count, precision, batch, sequence."""
        w = self.workload
        return (self.entry["model"], self.gpu, w.world, w.precision, w.global_batch, w.micro_batch, w.seq)


def megatron_flops_per_token(model: ModelConfig, seq: int, formula: str = "megatron-lm") -> float:
    """Training FLOPs per token as Megatron-LM counts them (megatron/training/training.py,
    `num_floating_point_operations`; SwiGLU, GQA, top-k experts; forward x 3):

    * "megatron-lm" (2025-): per layer 2h(q + 2kv) + 2qh projections, 2·s·q causal core attention, 6·h·F·k MLP;
      2·h·V logits;
    * "megatron-lm-2024" (the README's GPT table, commit f2e5db402c): the same with the full (not causal) core
      attention, 4·s·q (its 12·L·h²·(s/h)·(q/h) term).
    """
    h, n, g, d, L = (
        model.hidden_size,
        model.num_attention_heads,
        model.num_query_groups,
        model.head_dim,
        model.num_layers,
    )
    q, kv = n * d, g * d
    if model.is_moe:
        mlp = 6 * h * model.moe_ffn_hidden_size * model.moe_router_topk
    else:
        mlp = 6 * h * model.effective_ffn_hidden_size
    core = 4 * seq * q if formula == "megatron-lm-2024" else 2 * seq * q
    layer = 2 * h * (q + 2 * kv) + 2 * q * h + core + mlp
    return 3 * (L * layer + 2 * h * model.vocab_size)


def _model(fields: dict[str, Any]) -> ModelConfig:
    return model_from_dict(fields, gate=gates.preset("baseline"))


def model_fields(path: Path = DATA) -> dict[str, dict[str, Any]]:
    """The `models:` entries of `path`, falling back on published_runs.yaml's (the held-out table has none of its
    own)."""
    data = load_mapping(path)
    return {**(load_mapping(DATA)["models"] if path != DATA else {}), **(data.get("models") or {})}


def load_runs(path: Path = DATA) -> list[Run]:
    """Every run of the data file, as workloads (a ConfigError names a run whose layout does not divide)."""
    data = load_mapping(path)
    models = {name: _model(fields) for name, fields in model_fields(path).items()}
    return [_run(e, models) for e in data["runs"]]


def load_held_out() -> list[Run]:
    """The second held-out table (benchmarks/held_out_runs.yaml)."""
    return load_runs(HELD_OUT)


def recipe_defaults(e: dict[str, Any]) -> bool:
    """Whether `e` ran under NVIDIA's performance recipes (Megatron Bridge's perf_recipes/_common.py
    `_benchmark_common`, NeMo's scripts/performance/helpers.py): gradients reduced in bf16 (`grad_reduce_in_fp32 =
    False`) and Transformer Engine's fused cross-entropy (`cross_entropy_fusion_impl = "te"`). The ModelZoo's and
    Megatron-LM's runs keep megatron's defaults (fp32 gradients, the native loss)."""
    return e["source"] == "bridge" or e["source"].startswith("nemo")


def _run(e: dict[str, Any], models: dict[str, ModelConfig]) -> Run:
    model = models[e["model"]]
    tp, pp, cp, ep = e["tp"], e["pp"], e["cp"], e["ep"]
    dp = e["gpus"] // (tp * pp * cp)
    vpp = e.get("vpp")
    account = e.get("split") == "embedding+loss"
    layers = split_layers(model.num_layers, pp, vpp, account_for_embedding=account, account_for_loss=account)
    modules = tuple(e.get("recompute_modules") or ())
    grad_fp32 = e.get("grad_reduce_in_fp32", not recipe_defaults(e)) or e["precision"] == "fp32"
    w = Workload(
        model=model,
        seq=e["seq"],
        micro_batch=e["micro_batch"],
        global_batch=e["global_batch"],
        tp=tp,
        pp=pp,
        vpp=vpp,
        ep=ep,
        cp=cp,
        dp=dp,
        etp=e.get("etp", 1 if model.is_moe else None),
        precision=e["precision"],
        sequence_parallel=e.get("sequence_parallel", tp > 1),
        recompute="selective" if modules else None,
        recompute_modules=modules or ("core_attn",),
        dispatcher=e.get("dispatcher", "alltoall"),
        ep_overlap=bool(e.get("ep_overlap", False)),
        tp_overlap=bool(e.get("tp_overlap", False)),
        fsdp=bool(e.get("fsdp", False)),
        grad_bytes=4 if grad_fp32 else 2,
        stage_layers=layers if account else None,
        gpus_per_node=e.get("gpus_per_node", 4 if e["gpu"] == "gb200" else 8),
    )
    seq_tokens = w.global_batch * w.seq
    if "tokens_per_s_per_gpu" in e:
        tps, derived = float(e["tokens_per_s_per_gpu"]), ""
    elif "step_s" in e:
        tps, derived = seq_tokens / e["step_s"] / e["gpus"], "from the published step time"
    else:
        formula = e.get("flops_formula", "megatron-lm")
        tps = e["tflops_per_gpu"] * 1e12 / megatron_flops_per_token(model, w.seq, formula)
        derived = f"from the published TFLOP/s ({formula} FLOP count)"
    return Run(e["id"], w, e["gpu"], w.gpus_per_node, tps, derived, e["use"], e)


def predict(run: Run, constants: GpuConstants = FITTED, workload: Workload | None = None) -> StepTime:
    """The planner's step time for `run` (or another layout of it) with GPU constants `constants`."""
    profile = gpu_profile(gpu_spec(run.gpu), constants)
    return step_time(workload or run.workload, profile, ranks_per_node=run.gpus_per_node)


def tokens_per_s_per_gpu(run: Run, st: StepTime, workload: Workload | None = None) -> float:
    w = workload or run.workload
    return w.global_batch * w.seq / st.total / w.world


def errors(runs: list[Run], constants: GpuConstants = FITTED) -> dict[str, float]:
    """Relative error of the predicted tokens/s per GPU against the published one, by run id."""
    return {r.id: tokens_per_s_per_gpu(r, predict(r, constants)) / r.tokens_per_s_per_gpu - 1 for r in runs}


def summary(errs: dict[str, float], runs: list[Run]) -> dict[str, dict[str, float]]:
    """Median and worst absolute error of the fit and the held-out runs."""
    out = {}
    for use in ("fit", "held-out"):
        values = [abs(errs[r.id]) for r in runs if r.use == use]
        out[use] = {"runs": len(values), "median": statistics.median(values), "worst": max(values)}
    return out


def with_layout(run: Run, **sizes: Any) -> Workload:
    """`run`'s workload with another layout (tp, pp, vpp, ep, recompute...), the pipeline split recomputed as
    megatron would (embedding and loss counted as layers when the layers do not divide)."""
    w = run.workload
    new = dataclasses.replace(w, **sizes)
    new = dataclasses.replace(new, dp=w.world // (new.tp * new.pp * new.cp))
    L = w.model.num_layers
    if L % (new.pp * new.chunks):
        layers = split_layers(L, new.pp, new.vpp, account_for_embedding=True, account_for_loss=True)
    else:
        layers = None
    return dataclasses.replace(new, stage_layers=layers, sequence_parallel=new.tp > 1)


# --- the layout check: NVIDIA's published layout against the planner's best for the same configuration -------------
def memory_estimate(w: Workload, memory_bytes: float) -> float:
    """Peak bytes per GPU of `w` (the largest stage), from the same activation inventory and parameter counts as the
    exact plan but without megatron's buffer padding (published layouts may split layers unevenly)."""
    from megagate.plan import memory as mem

    a = w.act_bytes
    shape = mem.ActivationShape(w.seq // w.cp, w.micro_batch, w.tp, w.sequence_parallel, a, w.expert_tp)
    layer = mem.layer_bytes(w.model, shape, mem.GPU_TE, recompute=None)
    peak = 0.0
    for s, chunks in enumerate(w.layers()):
        dense, expert = stage_parameters(w, s)
        fp8_copies = 2 * (dense + expert) if w.precision == "fp8" else 0  # TE's cached fp8 weight + transpose
        if w.fsdp:
            states = (14 + w.grad_bytes) * (dense + expert) / (w.dp * w.cp)
        else:
            states = (2 + w.grad_bytes) * (dense + expert) + 12 * (dense / (w.dp * w.cp) + expert / w.expert_dp)
        flights = mem.in_flight(w.pp, s, w.vpp, w.microbatches, w.ep_overlap)
        acts = flights * max(chunks) * layer + layer
        if s == w.pp - 1:
            acts += sum(mem.output_items(w.model, shape, mem.GPU_TE).values()) + mem.logits_transient(w.model, shape)
        peak = max(peak, states + fp8_copies + 1.05 * acts + 3e9)
    return peak


def candidate_layouts(run: Run) -> list[Workload]:
    """Layouts of `run`'s configuration (model, GPUs, batch, precision held): TP within a node, PP, VPP, EP, with
    and without selective recompute of the norms and the MoE activation, that megatron accepts."""
    w, m = run.workload, run.workload.model
    out = []
    for tp in (1, 2, 4, 8):
        # megatron's rule: whole heads per rank, KV groups a multiple or a divisor of TP (qkv_layout)
        if (
            tp > run.gpus_per_node
            or m.num_attention_heads % tp
            or (m.num_query_groups % tp and tp % m.num_query_groups)
        ):
            continue
        for pp in (1, 2, 4, 8, 16, 32):
            model_parallel = tp * pp * w.cp
            if w.world % model_parallel or pp > m.num_layers:
                continue
            dp = w.world // model_parallel
            if w.global_batch % (w.micro_batch * dp):
                continue
            micro = w.global_batch // (w.micro_batch * dp)
            for vpp in (None, *range(2, 13)) if pp > 1 else (None,):
                if vpp and micro % pp:
                    continue
                for ep in (1, 2, 4, 8, 16, 32, 64, 128) if m.is_moe else (1,):
                    if m.is_moe and (m.num_experts % ep or (w.world // pp) % ep):
                        continue
                    for modules in ((), ("layernorm", "moe_act")):
                        try:
                            out.append(
                                with_layout(
                                    run,
                                    tp=tp,
                                    pp=pp,
                                    vpp=vpp,
                                    ep=ep,
                                    recompute="selective" if modules else None,
                                    recompute_modules=modules or ("core_attn",),
                                )
                            )
                        except ConfigError:
                            continue  # the layers do not split over PP x VPP
    return out


def best_layout(run: Run, constants: GpuConstants = FITTED) -> tuple[Workload, float, int]:
    """(the fastest fitting layout, its step seconds, how many layouts fit) for `run`'s configuration."""
    spec = gpu_spec(run.gpu)
    profile = gpu_profile(spec, constants)
    best, best_t, fitting = run.workload, float("inf"), 0
    for w in candidate_layouts(run):
        if memory_estimate(w, spec.memory_bytes) > spec.memory_bytes:
            continue
        fitting += 1
        t = step_time(w, profile, ranks_per_node=run.gpus_per_node).total
        if t < best_t:
            best, best_t = w, t
    return best, best_t, fitting


def describe(w: Workload) -> str:
    text = f"TP{w.tp} PP{w.pp}" + (f" VPP{w.vpp}" if w.vpp else "") + (f" EP{w.ep}" if w.model.is_moe else "")
    return text + (f" CP{w.cp}" if w.cp > 1 else "") + (" rc" if w.recompute else "")


def layout_check_runs(runs: list[Run]) -> list[Run]:
    """One run per MoE configuration: NVIDIA's layout for it (of several published layouts, the fastest)."""
    best: dict[tuple, Run] = {}
    for r in runs:
        if r.moe and (r.config_key not in best or r.tokens_per_s_per_gpu > best[r.config_key].tokens_per_s_per_gpu):
            best[r.config_key] = r
    return list(best.values())


def run_config(run: Run, fields: dict[str, Any]) -> dict[str, Any]:
    """`run` as a megagate training config (a mapping for `config_reader.from_dict`; `fields`: its model's entry
    under `models:`): what `megagate plan CONFIG` reads for it. tests/plan/test_published.py checks that the
    planner's workload from this config is the run's own, field by field: one mapping, not two."""
    w, e = run.workload, run.entry
    account = e.get("split") == "embedding+loss"
    modules = list(e.get("recompute_modules") or ())
    model = {**fields, "gate": "baseline", "max_sequence_length": max(w.seq, 4096)}
    if modules:
        model["recompute_granularity"] = "selective"
    parallel: dict[str, Any] = dict(
        tensor_model_parallel_size=w.tp,
        pipeline_model_parallel_size=w.pp,
        virtual_pipeline_model_parallel_size=w.vpp,
        context_parallel_size=w.cp,
        expert_model_parallel_size=w.ep,
        sequence_parallel=w.sequence_parallel,
        account_for_embedding_in_pipeline_split=account,
        account_for_loss_in_pipeline_split=account,
    )
    if w.model.is_moe:
        parallel["expert_tensor_parallel_size"] = w.expert_tp
    perf: dict[str, Any] = dict(
        moe_token_dispatcher_type=w.dispatcher if w.model.is_moe else "auto",
        tp_comm_overlap=w.tp_overlap,
        overlap_moe_expert_parallel_comm=w.ep_overlap,
        use_megatron_fsdp=w.fsdp,
        grad_reduce_in_fp32=w.grad_bytes == 4,
        cpu_offloading_num_layers=e.get("cpu_offloading_num_layers", 0),
    )
    if recipe_defaults(e):
        perf["cross_entropy_fusion_impl"] = "te"
    if modules:
        perf["recompute_modules"] = modules
    train = dict(
        micro_batch_size=w.micro_batch,
        global_batch_size=w.global_batch,
        seq_length=w.seq,
        precision=w.precision,
        backend="te",
    )
    return {"model": model, "parallel": parallel, "train": train, "perf": perf, "data": {"mock": True}}
