"""Performance settings: the `perf:` section and FP8 resolved for a machine, and the combinations refused.

`resolve_perf(cfg, machine)` decides every `None`/"auto" of `cfg.perf` (and the FP8 keys of `cfg.train`) for one
`Machine`: on GPU Megatron-LM's defaults and NVIDIA's Qwen3-30B-A3B recipe, on CPU off what has no CPU kernel or
needs CUDA streams (listed, for the one line the trainer prints). `check_perf` refuses, as one-line ConfigErrors,
what megatron or the machine would refuse; the config rules call it before any process group exists.
Pure functions of the config: the trainer's megatron configs are built from the result
(megagate.train.components). Every key: docs/performance.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megagate import extensions
from megagate.errors import ConfigError
from megagate.machine import Machine
from megagate.model.kernels import CORE_ATTENTIONS, resolve_backend
from megagate.sections import check_choice as _choice

if TYPE_CHECKING:
    from megagate.run_config import TrainConfig, TrainSection

# --- constants ------------------------------------------------------------------------
FP8_FORMATS = ("e4m3", "hybrid")
DISPATCHERS = ("auto", "alltoall", "allgather", "flex")
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine")  # transformer_engine: refused (see _check_cuda_graphs)
CUDA_GRAPH_MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess")
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mlp", "moe", "shared_experts")
ROUTER_DTYPES = ("fp32", "fp64")
OPTIMIZER_DTYPES = {  # Megatron-LM's choices for the precision-aware optimizer's tensors
    "main_params_dtype": ("fp32", "fp16"),
    "main_grads_dtype": ("fp32", "bf16"),
    "exp_avg_dtype": ("fp32", "fp16", "bf16", "fp8"),
    "exp_avg_sq_dtype": ("fp32", "fp16", "bf16", "fp8"),
}
FP8_ALIGNMENT = 16  # TE's FP8 GEMMs need every dimension of a weight shard to be a multiple of 16
GPU_MANUAL_GC_INTERVAL = 5  # NVIDIA's Qwen3-30B-A3B recipe (Megatron-MoE-ModelZoo): --manual-gc-interval 5


@dataclass(frozen=True)
class ResolvedPerf:
    """The perf settings in force on one machine (every `None`/"auto" decided), and what the CPU switched off."""

    machine: Machine
    backend_te: bool  # the model is built from Transformer Engine's modules
    moe: bool  # the MoE keys apply (a MoE model)
    moe_grouped_gemm: bool
    moe_token_dispatcher_type: str
    moe_permute_fusion: bool
    moe_router_fusion: bool
    moe_router_dtype: str | None
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    bucket_size: int | None
    recompute_modules: tuple[str, ...] | None
    bias_activation_fusion: bool
    bias_dropout_fusion: bool
    apply_rope_fusion: bool
    masked_softmax_fusion: bool
    cross_entropy_loss_fusion: bool
    cross_entropy_fusion_impl: str
    gradient_accumulation_fusion: bool
    cuda_graph_impl: str
    cuda_graph_modules: tuple[str, ...]
    cuda_graph_warmup_steps: int
    use_precision_aware_optimizer: bool
    main_params_dtype: str
    main_grads_dtype: str
    exp_avg_dtype: str
    exp_avg_sq_dtype: str
    manual_gc_interval: int
    profile_nvtx: bool
    fp8_format: str | None  # None: no FP8
    moe_router_padding_for_fp8: bool
    cpu_off: tuple[str, ...] = ()  # the GPU settings the CPU switched off
    gpu_off: tuple[str, ...] = ()  # GPU defaults off on this GPU because their kernels are missing: one reason each

    def gpu_line(self) -> str | None:
        """The one line a GPU run prints when a GPU default is off for a missing kernel (None when none is)."""
        return f"perf: on this GPU: {'; '.join(self.gpu_off)}" if self.gpu_off else None

    def cpu_line(self) -> str | None:
        """The one line a CPU run prints (None when nothing was switched off)."""
        if not self.cpu_off:
            return None
        off = [key for key in self.cpu_off if key != "moe_token_dispatcher_type"]
        line = f"perf: on CPU: {', '.join(off)} off" if off else "perf: on CPU:"
        if "moe_token_dispatcher_type" in self.cpu_off:  # not a switch: the dispatcher that needs no CUDA streams
            line += f"{';' if off else ''} moe_token_dispatcher_type {self.moe_token_dispatcher_type}"
        return line

    def describe(self) -> list[str]:
        """The settings in force, as `megagate train --dry-run` prints them."""
        on = lambda flag: "on" if flag else "off"  # noqa: E731
        lines = []
        if self.moe:
            lines.append(
                f"perf moe: grouped GEMM {on(self.moe_grouped_gemm)}; dispatcher {self.moe_token_dispatcher_type}; "
                f"permute fusion {on(self.moe_permute_fusion)}; router fusion {on(self.moe_router_fusion)}; "
                f"router dtype {self.moe_router_dtype or 'params'}"
                + (f"; router padding for FP8 {on(self.moe_router_padding_for_fp8)}" if self.fp8_format else "")
            )
        lines += [
            f"perf fusions: bias-SwiGLU {on(self.bias_activation_fusion)}; bias-dropout-add "
            f"{on(self.bias_dropout_fusion)}; RoPE {on(self.apply_rope_fusion)}; masked softmax "
            f"{on(self.masked_softmax_fusion)}; cross entropy {on(self.cross_entropy_loss_fusion)}"
            + (f" ({self.cross_entropy_fusion_impl})" if self.cross_entropy_loss_fusion else "")
            + f"; gradient accumulation {on(self.gradient_accumulation_fusion)}"
            + (
                " (where apex's kernel is installed)"
                if self.gradient_accumulation_fusion and self.machine.apex is None
                else ""
            ),
            f"perf overlap: grad reduce {on(self.overlap_grad_reduce)}; param gather {on(self.overlap_param_gather)}; "
            f"bucket size {self.bucket_size or 'megatron default'}",
            f"perf: CUDA graphs {self.cuda_graph_impl}"
            + (f" ({', '.join(self.cuda_graph_modules) or 'whole layer'})" if self.cuda_graph_impl != "none" else "")
            + f"; precision-aware optimizer {on(self.use_precision_aware_optimizer)}"
            + (
                f" (main params {self.main_params_dtype}, grads {self.main_grads_dtype}, exp_avg "
                f"{self.exp_avg_dtype}, exp_avg_sq {self.exp_avg_sq_dtype})"
                if self.use_precision_aware_optimizer
                else ""
            )
            + (f"; manual GC every {self.manual_gc_interval} steps" if self.manual_gc_interval else "; manual GC off"),
        ]
        if self.fp8_format:
            lines.append(f"perf fp8: format {self.fp8_format}")
        if self.cpu_off:
            lines.append(self.cpu_line() or "")
        if self.gpu_off:
            lines.append(self.gpu_line() or "")
        return lines


def fp8_format(t: TrainSection) -> str | None:
    if t.precision != "fp8":
        return None
    return t.fp8_format or ("e4m3" if t.fp8_recipe in ("blockwise", "mxfp8") else "hybrid")


def resolve_perf(cfg: TrainConfig, machine: Machine) -> ResolvedPerf:
    """The perf settings in force on `machine`: every None/"auto" decided (GPU: Megatron-LM's defaults and NVIDIA's
    recipe; CPU: off what has no CPU kernel or needs CUDA streams, listed in `cpu_off`). Pure: no torch.cuda."""
    p, t, m = cfg.perf, cfg.train, cfg.model
    backend_te = resolve_backend(t.backend, gpu=machine.gpu, te=machine.te) == "te"
    fp8 = fp8_format(t)
    dist_opt = t.use_distributed_optimizer

    def auto(value: bool | None, default: bool) -> bool:
        return default if value is None else value

    grad_reduce = auto(p.overlap_grad_reduce, True)
    # what the GPU runs; the CPU then switches off what it cannot run
    gpu: dict[str, Any] = dict(
        moe_grouped_gemm=auto(p.moe_grouped_gemm, True),
        moe_token_dispatcher_type="alltoall" if p.moe_token_dispatcher_type == "auto" else p.moe_token_dispatcher_type,
        moe_permute_fusion=auto(p.moe_permute_fusion, backend_te),
        moe_router_fusion=auto(p.moe_router_fusion, backend_te),
        overlap_grad_reduce=grad_reduce,
        overlap_param_gather=auto(p.overlap_param_gather, dist_opt and grad_reduce),
        bias_activation_fusion=auto(p.bias_activation_fusion, True),
        bias_dropout_fusion=auto(p.bias_dropout_fusion, True),
        # TE's fused RoPE kernel; YaRN's scaled frequencies go through megatron's unfused path
        apply_rope_fusion=auto(p.apply_rope_fusion, backend_te and m.position_embedding == "rope"),
        # megatron imports apex's softmax kernels whenever this is on (megagate.extensions): off where they are absent
        masked_softmax_fusion=auto(p.masked_softmax_fusion, machine.softmax_kernels is not False),
        cross_entropy_loss_fusion=auto(p.cross_entropy_loss_fusion, True),
        # the output layer is megatron's own ColumnParallelLinear: it needs apex's kernel even under TE
        gradient_accumulation_fusion=auto(p.gradient_accumulation_fusion, machine.apex is not False),
        cuda_graph_impl=p.cuda_graph_impl,
        use_precision_aware_optimizer=p.use_precision_aware_optimizer,
        manual_gc_interval=GPU_MANUAL_GC_INTERVAL if p.manual_gc_interval is None else p.manual_gc_interval,
        profile_nvtx=p.profile.nvtx is True or p.profile.nvtx == "auto",
    )
    modules = None if p.recompute_modules is None else tuple(p.recompute_modules)
    dtypes = {name: getattr(p, name) for name in OPTIMIZER_DTYPES}
    cpu_off: list[str] = []
    gpu_off = _kernels_missing(p, machine)
    values = dict(gpu)
    if not machine.gpu:
        cpu: dict[str, Any] = dict(
            moe_grouped_gemm=auto(p.moe_grouped_gemm, False),  # explicit true: torch's grouped experts
            moe_token_dispatcher_type="allgather",  # alltoall and flex need CUDA streams; allgather is exact
            moe_permute_fusion=False,
            moe_router_fusion=False,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            masked_softmax_fusion=False,
            cross_entropy_loss_fusion=False,
            gradient_accumulation_fusion=False,
            cuda_graph_impl="none",
            use_precision_aware_optimizer=False,
            manual_gc_interval=0 if p.manual_gc_interval is None else p.manual_gc_interval,
            profile_nvtx=False,
        )
        moe_only = {"moe_grouped_gemm", "moe_token_dispatcher_type", "moe_permute_fusion", "moe_router_fusion"}
        for key, value in cpu.items():
            relevant = (m.is_moe or key not in moe_only) and (key != "profile_nvtx" or p.profile.steps)
            if value != gpu[key] and relevant and key != "manual_gc_interval":
                cpu_off.append(key if key != "profile_nvtx" else "profile.nvtx")
        values = cpu
        if cfg.perf.use_precision_aware_optimizer:
            dtypes = {name: "fp32" for name in OPTIMIZER_DTYPES}
        if modules and "moe_act" in modules and not values["moe_grouped_gemm"]:
            modules = tuple(x for x in modules if x != "moe_act")  # megatron recomputes moe_act in grouped MLPs only
            cpu_off.append("recompute_modules moe_act")
    return ResolvedPerf(
        machine=machine,
        backend_te=backend_te,
        moe=m.is_moe,
        moe_router_dtype=p.moe_router_dtype,
        bucket_size=p.bucket_size,
        recompute_modules=modules,
        cross_entropy_fusion_impl=p.cross_entropy_fusion_impl,
        cuda_graph_modules=tuple(p.cuda_graph_modules or ()),
        cuda_graph_warmup_steps=p.cuda_graph_warmup_steps,
        fp8_format=fp8,
        moe_router_padding_for_fp8=bool(fp8) and m.is_moe and auto(t.moe_router_padding_for_fp8, True),
        cpu_off=tuple(cpu_off),
        gpu_off=gpu_off,
        **dtypes,
        **values,
    )


def _kernels_missing(p: Any, machine: Machine) -> tuple[str, ...]:
    """Why each GPU fusion left on auto is off on this GPU: its kernel modules do not import (megagate.extensions)."""
    checks = (
        ("masked_softmax_fusion", machine.softmax_kernels, extensions.FUSED_SOFTMAX, "torch's softmax instead"),
        ("gradient_accumulation_fusion", machine.apex, extensions.GRADIENT_ACCUMULATION, "unfused weight gradients"),
    )
    return tuple(
        f"{key} off ({', '.join(modules)} not installed: {instead})"
        for key, present, modules, instead in checks
        if machine.gpu and getattr(p, key) is None and present is False
    )


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
        per_stage = m.num_layers // par.pipeline_model_parallel_size
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
