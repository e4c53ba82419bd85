"""The perf and FP8 combinations refused: `check_perf(cfg, resolved)` raises a one-line ConfigError for what
megatron or the machine would refuse, judged on `megagate.perf.resolve_perf`'s result; the config rules call it
before any process group exists (for the target GPU), `megagate.run_setup.resolve` again for the real machine.
Every key: docs/performance.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megagate.errors import ConfigError
from megagate.machine import Machine
from megagate.model.kernels import CORE_ATTENTIONS
from megagate.perf import OPTIMIZER_DTYPES, ResolvedPerf
from megagate.sections import check_choice as _choice

if TYPE_CHECKING:
    from megagate.run_config import TrainConfig

FP8_FORMATS = ("e4m3", "hybrid")
DISPATCHERS = ("auto", "alltoall", "allgather", "flex")
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine")  # transformer_engine: refused (see _check_cuda_graphs)
CUDA_GRAPH_MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess")
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mlp", "moe", "shared_experts")
ROUTER_DTYPES = ("fp32", "fp64")
FLEX_BACKENDS = ("deepep", "hybridep")
FSDP_SHARDING = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# megatron's fine-grained activation offloading modules (fused_group_mlp needs TE's op fuser, which megagate's
# experts do not use)
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
FP8_ALIGNMENT = 16  # TE's FP8 GEMMs need every dimension of a weight shard to be a multiple of 16


def check_perf(cfg: TrainConfig, r: ResolvedPerf) -> None:
    """The perf and FP8 combinations megatron (or the machine) refuses, as one-line ConfigErrors, before any process
    group exists, judged on `r` (`resolve_perf(cfg, machine)`): for the target GPU everywhere (`Machine.target`, the
    config rules) and for the real machine where it runs (`megagate.run_setup.resolve`)."""
    p, t, m = cfg.perf, cfg.train, cfg.model
    machine = r.machine
    _choice(p.core_attention, CORE_ATTENTIONS, "perf.core_attention")
    _choice(p.moe_token_dispatcher_type, DISPATCHERS, "perf.moe_token_dispatcher_type")
    _choice(p.cross_entropy_fusion_impl, ("native", "te"), "perf.cross_entropy_fusion_impl")
    _choice(p.cuda_graph_impl, CUDA_GRAPH_IMPLS, "perf.cuda_graph_impl")
    if p.moe_router_dtype is not None:
        _choice(p.moe_router_dtype, ROUTER_DTYPES, "perf.moe_router_dtype")
    for name, allowed in OPTIMIZER_DTYPES.items():
        _choice(getattr(p, name), allowed, f"perf.{name}")
    for key, value in (("bucket_size", p.bucket_size), ("cuda_graph_warmup_steps", p.cuda_graph_warmup_steps)):
        if value is not None and value < 1:
            raise ConfigError(f"perf.{key}={value} must be a positive integer")
    if p.manual_gc_interval is not None and p.manual_gc_interval < 0:
        raise ConfigError(f"perf.manual_gc_interval={p.manual_gc_interval} must be >= 0 (0: Python's own collector)")
    _check_profile(cfg)
    te_needed = "needs Transformer Engine (train.backend te or auto on a GPU with TE)"
    if p.core_attention == "te" and not r.backend_te:
        raise ConfigError(f"perf.core_attention='te' {te_needed}; use sdpa or local")
    if m.is_moe:
        for key in ("moe_permute_fusion", "moe_router_fusion"):
            if getattr(r, key) and not r.backend_te:
                raise ConfigError(f"perf.{key}=true {te_needed}")
        if r.moe_token_dispatcher_type == "flex":
            if machine.deep_ep is False:
                raise ConfigError(
                    "perf.moe_token_dispatcher_type='flex' needs DeepEP, which is not installed; use alltoall"
                )
            if not r.backend_te:
                raise ConfigError(f"perf.moe_token_dispatcher_type='flex' {te_needed}")
    if r.overlap_param_gather and not t.use_distributed_optimizer:
        raise ConfigError(
            "perf.overlap_param_gather=true needs train.use_distributed_optimizer=true (it overlaps the distributed "
            "optimizer's parameter all-gather)"
        )
    if r.overlap_param_gather and not r.overlap_grad_reduce:
        raise ConfigError("perf.overlap_param_gather=true needs perf.overlap_grad_reduce=true (Megatron-LM's rule)")
    if p.apply_rope_fusion and not r.backend_te and machine.gpu:
        raise ConfigError(f"perf.apply_rope_fusion=true {te_needed}")
    if r.cross_entropy_loss_fusion and r.cross_entropy_fusion_impl == "te" and not r.backend_te:
        raise ConfigError(f"perf.cross_entropy_fusion_impl='te' {te_needed}; use native")
    if p.gradient_accumulation_fusion and machine.gpu and machine.apex is False:
        raise ConfigError(
            "perf.gradient_accumulation_fusion=true needs apex's fused_weight_gradient_mlp_cuda, which is not "
            "installed (megatron's output layer uses it)"
        )
    if p.masked_softmax_fusion and p.core_attention == "local" and machine.gpu and machine.softmax_kernels is False:
        raise ConfigError(
            "perf.masked_softmax_fusion=true with perf.core_attention=local needs megatron's fused softmax kernels "
            "(scaled_masked_softmax_cuda, from apex), which are not installed; leave it unset or false"
        )
    _check_recompute_modules(cfg, r)
    _check_cuda_graphs(cfg, r)
    _check_recipe(cfg, r, te_needed)
    if not p.use_precision_aware_optimizer:
        for name in OPTIMIZER_DTYPES:
            if getattr(p, name) != "fp32":
                raise ConfigError(f"perf.{name}={getattr(p, name)!r} needs perf.use_precision_aware_optimizer=true")
    elif not t.use_distributed_optimizer:
        raise ConfigError("perf.use_precision_aware_optimizer=true needs train.use_distributed_optimizer=true")
    elif machine.gpu and not machine.te:
        raise ConfigError(
            "perf.use_precision_aware_optimizer=true needs Transformer Engine's FusedAdam, which is not installed"
        )
    _check_fp8(cfg, machine)


def _check_recipe(cfg: TrainConfig, r: ResolvedPerf, te_needed: str) -> None:
    """NVIDIA's recipe knobs: megatron's own rules (TransformerConfig, Megatron-LM's argument checks) and the
    kernels or libraries each needs, one line each."""
    p, t, m, par = cfg.perf, cfg.train, cfg.model, cfg.parallel
    _choice(p.moe_flex_dispatcher_backend, FLEX_BACKENDS, "perf.moe_flex_dispatcher_backend")
    _choice(p.data_parallel_sharding_strategy, FSDP_SHARDING, "perf.data_parallel_sharding_strategy")
    if p.tp_comm_overlap:
        if not r.backend_te:
            raise ConfigError(f"perf.tp_comm_overlap=true needs Transformer Engine's userbuffers: it {te_needed}")
        if par.tensor_model_parallel_size < 2 or not par.sequence_parallel:
            raise ConfigError(
                "perf.tp_comm_overlap=true needs tensor_model_parallel_size > 1 and parallel.sequence_parallel=true "
                f"(it overlaps SP's all-gather/reduce-scatter; TP is {par.tensor_model_parallel_size}, sequence_"
                f"parallel {par.sequence_parallel})"
            )
    if p.overlap_moe_expert_parallel_comm:
        key = "perf.overlap_moe_expert_parallel_comm=true"
        if not m.is_moe or par.expert_model_parallel_size < 2:
            raise ConfigError(f"{key} needs a MoE model with parallel.expert_model_parallel_size > 1")
        if r.moe_token_dispatcher_type not in ("alltoall", "flex"):
            raise ConfigError(f"{key} needs perf.moe_token_dispatcher_type alltoall or flex (megatron's rule)")
        if m.recompute_granularity == "full" or "moe" in (r.recompute_modules or ()):
            raise ConfigError(f"{key} cannot recompute whole layers or 'moe' (megatron's rule); use selective")
        if t.precision == "fp32":
            raise ConfigError(f"{key} needs train.precision bf16 or fp8 (megatron's rule)")
        if par.pipeline_model_parallel_size > 1 and par.virtual_pipeline_model_parallel_size is None:
            raise ConfigError(f"{key} with pipeline_model_parallel_size > 1 needs virtual_pipeline_model_parallel_size")
    if p.delay_wgrad_compute and not p.overlap_moe_expert_parallel_comm:
        raise ConfigError("perf.delay_wgrad_compute=true needs perf.overlap_moe_expert_parallel_comm=true")
    if p.delay_wgrad_compute and not r.backend_te:  # TE's linears split the weight gradient off (wgrad hooks)
        raise ConfigError(f"perf.delay_wgrad_compute=true {te_needed}")
    if m.is_moe and r.moe_token_dispatcher_type == "flex" and p.moe_flex_dispatcher_backend == "hybridep":
        if r.machine.deep_ep is False:
            raise ConfigError(
                "perf.moe_flex_dispatcher_backend='hybridep' needs DeepEP's HybridEP (deep_ep.HybridEPBuffer), "
                "which is not installed; use deepep or perf.moe_token_dispatcher_type alltoall"
            )
    if p.use_megatron_fsdp:
        if not t.use_distributed_optimizer:
            raise ConfigError(
                "perf.use_megatron_fsdp=true needs train.use_distributed_optimizer=true (Megatron-FSDP shards the "
                "optimizer state itself: Megatron-LM's rule)"
            )
        if t.optimizer != "adamw":
            raise ConfigError(f"perf.use_megatron_fsdp=true supports train.optimizer adamw, not {t.optimizer!r}")
    _check_layer_offloading(cfg, r, te_needed)
    modules = list(p.offload_modules or [])
    for module in modules:
        _choice(module, OFFLOAD_MODULES, "perf.offload_modules[]")
    if "attn_proj" in modules and "core_attn" not in modules:
        raise ConfigError("perf.offload_modules: 'attn_proj' needs 'core_attn' too (its input is core_attn's output)")
    if {"expert_fc1", "moe_act"} & set(modules) and not m.is_moe:
        raise ConfigError("perf.offload_modules: expert_fc1 and moe_act need a MoE model")
    if {"expert_fc1", "moe_act"} & set(modules) and "moe" in (r.recompute_modules or ()):
        raise ConfigError("perf.offload_modules: expert_fc1 / moe_act cannot be offloaded while 'moe' is recomputed")
    if p.optimizer_cpu_offload:
        if not p.use_precision_aware_optimizer:
            raise ConfigError(
                "perf.optimizer_cpu_offload=true needs perf.use_precision_aware_optimizer=true (Megatron-LM's rule: "
                "the hybrid device optimizer reuses its code path)"
            )
        if t.fp8_param_gather and t.fp8_recipe != "delayed":
            raise ConfigError("perf.optimizer_cpu_offload=true with train.fp8_param_gather needs fp8_recipe delayed")
    if not 0 < p.optimizer_offload_fraction <= 1:
        raise ConfigError(f"perf.optimizer_offload_fraction={p.optimizer_offload_fraction} must be in (0, 1]")


def _check_layer_offloading(cfg: TrainConfig, r: ResolvedPerf, te_needed: str) -> None:
    """megatron's rules for `cpu_offloading` (TransformerConfig.__post_init__; TE's CPU offload context)."""
    n, key = cfg.perf.cpu_offloading_num_layers, "perf.cpu_offloading_num_layers"
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < cfg.model.num_layers:
        raise ConfigError(f"{key}={n!r} must be an integer in [0, model.num_layers={cfg.model.num_layers})")
    if not n:
        return
    if not r.backend_te and r.machine.gpu:
        raise ConfigError(f"{key}={n} needs Transformer Engine's CPU offload context: it {te_needed}")
    if cfg.parallel.pipeline_model_parallel_size > 1:
        raise ConfigError(f"{key}={n} needs pipeline_model_parallel_size 1 (megatron's rule)")
    if cfg.model.recompute_granularity is not None:
        raise ConfigError(f"{key}={n} cannot run with model.recompute_granularity (megatron's rule)")
    if cfg.perf.offload_modules:
        raise ConfigError(f"{key}={n} cannot run with perf.offload_modules (megatron's rule)")


def _check_profile(cfg: TrainConfig) -> None:
    prof = cfg.perf.profile
    if prof.steps is not None:
        steps = prof.steps
        if len(steps) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
            raise ConfigError(f"perf.profile.steps={steps!r} must be [start, end]: two step numbers")
        if not 1 <= steps[0] <= steps[1] <= cfg.train.train_steps:
            raise ConfigError(
                f"perf.profile.steps={steps!r} must satisfy 1 <= start <= end <= train.train_steps "
                f"({cfg.train.train_steps})"
            )
    if not prof.ranks or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in prof.ranks):
        raise ConfigError(f"perf.profile.ranks={prof.ranks!r} must be a non-empty list of global ranks (>= 0)")
    if prof.nvtx not in (True, False, "auto"):
        raise ConfigError(f"perf.profile.nvtx={prof.nvtx!r} is not one of auto, true, false")


def _check_recompute_modules(cfg: TrainConfig, r: ResolvedPerf) -> None:
    """megatron's rules for selective recompute's modules (TransformerConfig.__post_init__)."""
    modules, m = cfg.perf.recompute_modules, cfg.model
    if modules is None:
        return
    if m.recompute_granularity != "selective":
        raise ConfigError(
            f"perf.recompute_modules={modules!r} needs model.recompute_granularity=selective "
            f"(it is {m.recompute_granularity!r})"
        )
    for module in modules:
        _choice(module, RECOMPUTE_MODULES, "perf.recompute_modules[]")
        if module in ("moe_act", "moe", "shared_experts") and not m.is_moe:
            raise ConfigError(f"perf.recompute_modules: {module!r} needs a MoE model (model.num_experts)")
    if "moe_act" in modules and not r.moe_grouped_gemm and r.machine.gpu:
        raise ConfigError("perf.recompute_modules: 'moe_act' needs perf.moe_grouped_gemm=true (megatron's rule)")
    if r.fp8_format and cfg.train.fp8_recipe == "delayed" and {"moe_act", "layernorm"} & set(modules):
        raise ConfigError(
            "perf.recompute_modules: 'moe_act' and 'layernorm' cannot be recomputed under train.fp8_recipe=delayed; "
            "use tensorwise or blockwise"
        )


def _check_cuda_graphs(cfg: TrainConfig, r: ResolvedPerf) -> None:
    p, m = cfg.perf, cfg.model
    if p.cuda_graph_modules and p.cuda_graph_impl == "none":
        raise ConfigError(
            f"perf.cuda_graph_modules={p.cuda_graph_modules!r} needs perf.cuda_graph_impl local or transformer_engine"
        )
    if p.cuda_graph_impl == "none":
        return
    if p.cuda_graph_impl == "transformer_engine":
        # TE's graphs are captured by Megatron-LM's training loop (TECudaGraphHelper after the warm-up steps);
        # megatron's local graphs are captured inside the layers, so they need nothing from the trainer
        raise ConfigError(
            "perf.cuda_graph_impl='transformer_engine' needs Megatron-LM's training-loop capture, which megagate's "
            "trainer does not run; use local"
        )
    if r.overlap_param_gather:
        raise ConfigError(
            f"perf.cuda_graph_impl={p.cuda_graph_impl!r} with perf.overlap_param_gather: graph replay skips the "
            "forward hooks that gather the parameters; set perf.overlap_param_gather=false"
        )
    if m.recompute_granularity == "full":
        raise ConfigError(
            f"perf.cuda_graph_impl={p.cuda_graph_impl!r} cannot capture full recompute (megatron allows full "
            "recompute only with full-iteration graphs); use selective recompute or none"
        )
    modules = list(p.cuda_graph_modules or [])
    for module in modules:
        _choice(module, CUDA_GRAPH_MODULES, "perf.cuda_graph_modules[]")
    if m.is_moe and "mlp" in modules:
        raise ConfigError("perf.cuda_graph_modules: 'mlp' captures a dense MLP; a MoE model uses moe or moe_router")
    if not m.is_moe and {"moe", "moe_router", "moe_preprocess"} & set(modules):
        raise ConfigError("perf.cuda_graph_modules: moe, moe_router and moe_preprocess need a MoE model")
    if "moe_preprocess" in modules and "moe_router" not in modules:
        raise ConfigError("perf.cuda_graph_modules: 'moe_preprocess' needs 'moe_router' too (megatron's rule)")
    if m.is_moe and "moe" in modules:
        raise ConfigError(
            "perf.cuda_graph_modules: 'moe' captures the dropless token dispatch, whose shapes change every step; "
            "use moe_router and moe_preprocess"
        )


def _gate_name(cfg: TrainConfig) -> str:
    """The gate's preset as the config names it, else its description."""
    gate = (cfg.raw.get("model") or {}).get("gate") if isinstance(cfg.raw.get("model"), dict) else None
    if isinstance(gate, str):
        return gate
    if isinstance(gate, dict) and isinstance(gate.get("preset"), str) and len(gate) == 1:
        return gate["preset"]
    return repr(cfg.model.gate.describe())


def _check_fp8(cfg: TrainConfig, machine: Machine) -> None:
    """FP8 settings: what megatron's TransformerConfig refuses, the machine's FP8 support, TE's row alignment."""
    t, m, par = cfg.train, cfg.model, cfg.parallel
    if t.fp8_format is not None:
        _choice(t.fp8_format, FP8_FORMATS, "train.fp8_format")
    if t.precision != "fp8":
        for key, value, off in (
            ("fp8_param_gather", t.fp8_param_gather, False),
            ("moe_router_padding_for_fp8", t.moe_router_padding_for_fp8, None),
            ("first_last_layers_bf16", t.first_last_layers_bf16, False),
        ):
            if value not in (off, False):
                raise ConfigError(f"train.{key}=true needs train.precision=fp8")
        return
    if t.backend == "local":
        raise ConfigError("train.precision='fp8' needs Transformer Engine: set train.backend te or auto")
    if not machine.gpu:
        raise ConfigError("train.precision='fp8': the CPU has no FP8; use bf16 or fp32")
    if t.fp8_recipe == "mxfp8" and machine.capability is not None and machine.capability < (10, 0):
        major, minor = machine.capability
        raise ConfigError(
            f"train.fp8_recipe='mxfp8' needs compute capability >= 10.0 (Blackwell); this GPU is {major}.{minor}: "
            "use blockwise (Hopper) or tensorwise"
        )
    if t.first_last_layers_bf16:
        if t.fp8_recipe == "delayed":
            raise ConfigError(
                "train.first_last_layers_bf16=true does not work with train.fp8_recipe=delayed "
                "(megatron's rule); use tensorwise or blockwise"
            )
        from megagate.distributed.layout import stage_layers

        per_stage = min(sum(chunks) for chunks in stage_layers(par, m.num_layers))
        for key in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            value = getattr(t, key)
            if not 0 <= value <= per_stage:
                raise ConfigError(f"train.{key}={value} must be in [0, layers per pipeline stage ({per_stage})]")
    from megagate.model.qkv_layout import qkv_layout

    tp = par.tensor_model_parallel_size
    rows = qkv_layout(m.gate, m.num_attention_heads, m.num_query_groups, m.head_dim).rows
    if (rows // tp) % FP8_ALIGNMENT:
        raise ConfigError(
            f"train.precision='fp8': gate {_gate_name(cfg)} gives the fused linear_qkv "
            f"{rows:,} rows, {rows // tp:,} per TP shard at tensor_model_parallel_size={tp}, not a multiple of "
            f"{FP8_ALIGNMENT} as TE's FP8 GEMM needs; use an elementwise gate or bf16"
        )
