"""`RunSetup`: every decision a run's config leaves to the machine, made once, by `resolve(cfg, world_size, machine)`.

A config value reaches megatron in one pass:

    YAML + overrides ─ config_reader.load ─▶ TrainConfig ─ resolve(cfg, world, machine) ─▶ RunSetup ─▶ builders
                                                             layout (batch arithmetic)
                                                             perf (every None/"auto" decided; the CPU's switch-offs)
                                                             backend, core attention, experts
                                                             precision / FP8 recipe
                                                             transformer_kwargs ─ model.build.transformer_config ─▶
                                                                                   megatron TransformerConfig

Everything downstream takes the RunSetup (the trainer's components and callbacks, `--dry-run`, the model factory
for evaluation, analysis, export/import and the benchmarks): none of them resolves again. `resolve` also judges the
perf rules of a real GPU (`perf_rules.check_perf`), where the resolution is made. A set-up for loading a trained model
(`training=False`: analysis, evaluation, export) runs it in its storage dtype with megatron's default kernels (no FP8
recipe, no fusions, the default core attention), as a forward-only tool needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from megagate.distributed.layout import Layout
from megagate.machine import Machine
from megagate.model.kernels import experts_name, resolve_core_attention
from megagate.model.model_config import ModelConfig
from megagate.perf import ResolvedPerf, fp8_format, resolve_perf
from megagate.perf_rules import check_perf
from megagate.run_config import TrainConfig, layout

_FROZEN: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class RunSetup:
    """One run's config and what it resolves to on one machine (frozen: nothing downstream decides again)."""

    cfg: TrainConfig
    machine: Machine
    layout: Layout | None  # None: a set-up for loading a model (no training batch arithmetic)
    perf: ResolvedPerf
    backend: str  # "te" | "local": the module backend the model is built from
    core_attention: str  # "te" | "local" | "sdpa": the kernel `perf.core_attention` means under `backend`
    experts: str | None  # the MoE expert implementation (None: a dense model)
    precision: str  # "fp32" | "bf16": the parameter dtype (an FP8 run keeps bf16 parameters)
    training: bool = True
    fp8: Mapping[str, Any] = field(default=_FROZEN)  # TE's FP8 recipe arguments ({} without FP8)
    transformer_kwargs: Mapping[str, Any] = field(default=_FROZEN)  # builder arguments beyond model and parallel

    @property
    def model(self) -> ModelConfig:
        return self.cfg.model

    @property
    def params_dtype(self) -> Any:
        """The torch dtype of the parameters."""
        return _torch_dtype(self.precision)

    def transformer_config(self, **extra: Any) -> Any:
        """megatron's TransformerConfig of this set-up (model, parallel sizes, precision, perf settings); `extra`
        wins (e.g. perform_initialization)."""
        from megagate.model.build import transformer_config

        return transformer_config(self.cfg.model, self.cfg.parallel, **{**self.transformer_kwargs, **extra})

    def describe(self) -> list[str]:
        """The kernels and perf settings in force, as `megagate train --dry-run` prints them."""
        from megagate.model.kernels import core_attention_name

        choice, m = self.cfg.perf.core_attention, self.cfg.model
        kernels = f"kernels: attention {core_attention_name(self.backend, choice, cuda=self.machine.gpu)}"
        if self.experts:
            kernels += f"; experts {self.experts}"
        where = "on GPU" if self.machine.gpu else "on CPU"
        te = "Transformer Engine" if self.backend == "te" else "no Transformer Engine"
        modules = f" {list(self.perf.recompute_modules)}" if self.perf.recompute_modules else ""
        return [
            kernels,
            f"perf ({where}, {te}): core attention {self.core_attention} ({choice}); recompute "
            f"{m.recompute_granularity or 'none'}{modules}",
            *self.perf.describe(),
        ]


def resolve(
    cfg: TrainConfig, world_size: int | None, machine: Machine | None = None, *, training: bool = True
) -> RunSetup:
    """The run set-up of `cfg` on `world_size` ranks (None: no layout, for loading a model) of `machine` (default:
    this one, `Machine.detect()`). Refuses, as one-line ConfigErrors, a layout the world size cannot hold and the
    perf settings a real GPU cannot run."""
    machine = Machine.detect() if machine is None else machine
    run_layout = None if world_size is None else layout(cfg, world_size)
    perf = resolve_perf(cfg, machine)
    if machine.gpu and training:
        check_perf(cfg, perf)  # the real GPU's rules (a CPU switches off what it cannot run: nothing to refuse)
    backend = "te" if perf.backend_te else "local"
    core_attention = resolve_core_attention(backend, cfg.perf.core_attention if training else "auto")
    grouped = perf.moe_grouped_gemm if training else False  # a loaded model: megatron's SequentialMLP experts
    t = cfg.train
    precision = "fp32" if t.precision == "fp32" else "bf16"
    fp8 = _fp8_kwargs(cfg) if training else {}
    kwargs: dict[str, Any] = dict(params_dtype=_torch_dtype(precision), use_cpu=not machine.gpu)
    if training:
        kwargs.update(fp8)
        kwargs.update(_perf_kwargs(cfg, perf))
        # what Megatron-LM's argument parser sets beyond the dataclass defaults (docs/performance.md, the recipe
        # comparison): context parallelism's ring exchange, and the pipeline's outputs freed once sent (GPU: with
        # gloo's CPU sends megagate keeps them)
        kwargs.update(cp_comm_type="p2p", deallocate_pipeline_outputs=machine.gpu)
        if machine.gpu and cfg.parallel.virtual_pipeline_model_parallel_size:
            # the interleaved schedule's sends overlapped with compute, one by one (--overlap-p2p-communication)
            kwargs.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    else:
        kwargs.update(perform_initialization=False)
    return RunSetup(
        cfg=cfg,
        machine=machine,
        layout=run_layout,
        perf=perf,
        backend=backend,
        core_attention=core_attention,
        experts=experts_name(backend, grouped) if cfg.model.is_moe else None,
        precision=precision,
        training=training,
        fp8=MappingProxyType(fp8),
        transformer_kwargs=MappingProxyType(kwargs),
    )


def _torch_dtype(precision: str) -> Any:
    import torch  # not at module level: the config layer is read without torch

    return torch.bfloat16 if precision == "bf16" else torch.float32


def _fp8_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """TransformerConfig's FP8 arguments of `train.precision: fp8` (TE's recipe options); {} otherwise."""
    t, m = cfg.train, cfg.model
    if t.precision != "fp8":
        return {}
    extra: dict[str, Any] = dict(
        fp8=fp8_format(t),
        fp8_recipe=t.fp8_recipe,
        fp8_margin=t.fp8_margin,
        fp8_amax_history_len=t.fp8_amax_history_len,
        fp8_amax_compute_algo=t.fp8_amax_compute_algo,
        fp8_param=t.fp8_param_gather,  # parameters kept in FP8 (Megatron-LM sets both from --fp8-param-gather)
        first_last_layers_bf16=t.first_last_layers_bf16,
        num_layers_at_start_in_bf16=t.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=t.num_layers_at_end_in_bf16,
    )
    if m.is_moe:
        # megatron 0.19 renames moe_router_padding_for_fp8 (deprecated, warns) to ..._for_quantization
        extra["moe_router_padding_for_quantization"] = t.moe_router_padding_for_fp8 is not False
    return extra


def _perf_kwargs(cfg: TrainConfig, perf: ResolvedPerf) -> dict[str, Any]:
    """The TransformerConfig arguments of the resolved perf settings (MoE keys only for MoE models)."""
    kwargs: dict[str, Any] = dict(
        bias_activation_fusion=perf.bias_activation_fusion,
        bias_dropout_fusion=perf.bias_dropout_fusion,
        apply_rope_fusion=perf.apply_rope_fusion,
        masked_softmax_fusion=perf.masked_softmax_fusion,
        cross_entropy_loss_fusion=perf.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=perf.cross_entropy_fusion_impl,
        gradient_accumulation_fusion=perf.gradient_accumulation_fusion,
        cuda_graph_impl=perf.cuda_graph_impl,
    )
    if perf.cuda_graph_impl != "none":
        kwargs.update(use_te_rng_tracker=perf.cuda_graph_impl == "transformer_engine")
        kwargs.update(
            cuda_graph_modules=list(perf.cuda_graph_modules), cuda_graph_warmup_steps=perf.cuda_graph_warmup_steps
        )
    if perf.recompute_modules is not None:
        kwargs["recompute_modules"] = list(perf.recompute_modules)
    if cfg.model.is_moe:
        kwargs.update(
            moe_grouped_gemm=perf.moe_grouped_gemm,
            moe_token_dispatcher_type=perf.moe_token_dispatcher_type,
            moe_permute_fusion=perf.moe_permute_fusion,
            moe_router_fusion=perf.moe_router_fusion,
            moe_router_dtype=perf.moe_router_dtype,
        )
        if perf.moe_token_dispatcher_type == "flex":
            kwargs["moe_flex_dispatcher_backend"] = perf.moe_flex_dispatcher_backend
        if perf.overlap_moe_expert_parallel_comm:
            kwargs.update(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=perf.delay_wgrad_compute)
    if perf.tp_comm_overlap:
        kwargs["tp_comm_overlap"] = True
    if perf.offload_modules:
        kwargs.update(fine_grained_activation_offloading=True, offload_modules=list(perf.offload_modules))
    if perf.cpu_offloading_num_layers:
        kwargs.update(
            cpu_offloading=True,
            cpu_offloading_num_layers=perf.cpu_offloading_num_layers,
            cpu_offloading_activations=True,
            cpu_offloading_weights=False,
        )
    return kwargs


def initialize_tp_comm_overlap(setup: RunSetup) -> None:
    """TE's userbuffers for `perf.tp_comm_overlap` (Megatron-LM's `_initialize_tp_communicators`, default buffer
    settings, NCCL bootstrap): once per process, after the process groups and before the model is built."""
    from transformer_engine.pytorch import module as te_module  # the rules refused the run without TE

    cfg = setup.cfg
    t, p = cfg.train, cfg.parallel
    shape = [t.seq_length * t.micro_batch_size // p.context_parallel_size, cfg.model.hidden_size]
    fp8 = t.precision == "fp8"
    modes = getattr(te_module.base, "UserBufferQuantizationMode", None)
    if modes is not None:  # TE >= 2.7
        quant = [modes.FP8 if fp8 else modes.NONE]
        if fp8 and t.first_last_layers_bf16 and (t.num_layers_at_start_in_bf16 or t.num_layers_at_end_in_bf16):
            quant.append(modes.NONE)
        te_module.base.initialize_ub(
            shape=shape,
            tp_size=p.tensor_model_parallel_size,
            quantization_modes=quant,
            ub_cfgs={},
            bootstrap_backend="nccl",
        )
    else:
        te_module.base.initialize_ub(
            shape=shape, tp_size=p.tensor_model_parallel_size, use_fp8=fp8, ub_cfgs={}, bootstrap_backend="nccl"
        )
