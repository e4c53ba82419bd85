"""Performance settings: the `perf:` section and FP8 resolved for a machine, and the combinations refused.

`resolve_perf(cfg, machine)` decides every `None`/"auto" of `cfg.perf` (and the FP8 keys of `cfg.train`) for one
`Machine`: on GPU Megatron-LM's defaults and NVIDIA's Qwen3-30B-A3B recipe, on CPU off what has no CPU kernel or
needs CUDA streams (listed, for the one line the trainer prints). The combinations refused are
megagate.perf_rules' (`check_perf`).
Pure functions of the config: the trainer's megatron configs are built from the result
(megagate.train.components). Every key: docs/performance.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megagate import extensions
from megagate.machine import Machine
from megagate.model.kernels import resolve_backend

if TYPE_CHECKING:
    from megagate.run_config import TrainConfig, TrainSection

# --- constants ------------------------------------------------------------------------
OPTIMIZER_DTYPES = {  # Megatron-LM's choices for the precision-aware optimizer's tensors
    "main_params_dtype": ("fp32", "fp16"),
    "main_grads_dtype": ("fp32", "bf16"),
    "exp_avg_dtype": ("fp32", "fp16", "bf16", "fp8"),
    "exp_avg_sq_dtype": ("fp32", "fp16", "bf16", "fp8"),
}
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
    tp_comm_overlap: bool = False
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    moe_flex_dispatcher_backend: str = "deepep"
    use_megatron_fsdp: bool = False
    offload_modules: tuple[str, ...] = ()  # fine-grained activation offloading (empty: none)
    cpu_offloading_num_layers: int = 0  # layer-wise activation offloading (0: none)
    optimizer_cpu_offload: bool = False
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
        recipe = [
            name
            for name, on_ in (
                ("TP comm overlap (userbuffers)", self.tp_comm_overlap),
                ("EP all-to-all overlap", self.overlap_moe_expert_parallel_comm),
                ("delayed expert wgrad", self.delay_wgrad_compute),
                ("Megatron-FSDP", self.use_megatron_fsdp),
                (f"activation offloading ({', '.join(self.offload_modules)})", bool(self.offload_modules)),
                (
                    f"activation offloading of {self.cpu_offloading_num_layers} layers",
                    bool(self.cpu_offloading_num_layers),
                ),
                ("optimizer CPU offload", self.optimizer_cpu_offload),
            )
            if on_
        ]
        if self.moe and self.moe_token_dispatcher_type == "flex":
            recipe.append(f"flex dispatcher backend {self.moe_flex_dispatcher_backend}")
        if recipe:
            lines.append(f"perf recipe: {'; '.join(recipe)}")
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
        **_recipe_values(p),
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
            # CUDA streams, TE's userbuffers, pinned host memory: nothing of them on a CPU
            tp_comm_overlap=False,
            overlap_moe_expert_parallel_comm=False,
            delay_wgrad_compute=False,
            use_megatron_fsdp=False,
            offload_modules=(),
            cpu_offloading_num_layers=0,
            optimizer_cpu_offload=False,
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
        moe_flex_dispatcher_backend=p.moe_flex_dispatcher_backend,
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


def _recipe_values(p: Any) -> dict[str, Any]:
    """The recipe knobs as the config sets them (no auto: each is off unless asked for)."""
    return dict(
        tp_comm_overlap=p.tp_comm_overlap,
        overlap_moe_expert_parallel_comm=p.overlap_moe_expert_parallel_comm,
        delay_wgrad_compute=p.delay_wgrad_compute,
        use_megatron_fsdp=p.use_megatron_fsdp,
        offload_modules=tuple(p.offload_modules or ()),
        cpu_offloading_num_layers=p.cpu_offloading_num_layers,
        optimizer_cpu_offload=p.optimizer_cpu_offload,
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
