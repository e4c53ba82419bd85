"""The run config: the typed tree a training YAML becomes (`TrainConfig` and its sections), parsed from a mapping.

Sections (Megatron-LM's names for the parallel sizes):

    model:      preset + ModelConfig overrides, and `gate:` (preset + GateConfig fields)
    parallel:   tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size,
                expert_model_parallel_size, context_parallel_size, sequence_parallel
    train:      batch sizes, sequence length, steps, precision, optimizer, LR schedule, evaluation, wall time
    data:       blend (prefixes with weights), tokenizer, split, mock / demo data, loader
    checkpoint: dir, interval, keep_last, load, optimizer_format
    logging:    interval, tensorboard
    monitor:    spike monitor and live diagnostics (megagate.monitor.settings)
    watchdog:   hang detection: phase limits, heartbeat (megagate.health.config)
    straggler:  slow-rank reports: window, margin (megagate.health.config)
    perf:       performance features (fusions, grouped GEMM, overlap, CUDA graphs, manual GC, profiling) resolved
                per machine by `megagate.perf.resolve_perf` (docs/performance.md)
    output:     dir
    seed

`parse` builds the tree (unknown keys, wrong types and each section's own rules refused in one line); the rules
across sections are `megagate.config_rules`'; `megagate.config_reader.load` / `from_dict` is the one reader of a
training config (`train` and its --dry-run, `submit`, `sweep`, `analyze`, `eval`, `export`): YAML + overrides →
parse → rules → machine checks. `layout` is the run's layout for a world size (megagate.distributed.layout's rules).
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megagate.distributed import layout as layout_rules
from megagate.distributed.layout import Layout
from megagate.errors import ConfigError
from megagate.health.config import StragglerConfig, WatchdogConfig
from megagate.model import gate as gates
from megagate.model.model_config import ModelConfig, ParallelConfig
from megagate.model.presets import from_dict as model_from_dict
from megagate.monitor.settings import MonitorConfig
from megagate.sections import build_section, check_type, did_you_mean

PRECISIONS = ("fp32", "bf16", "fp8")
OPTIMIZERS = ("adamw", "muon")
MUON_TP_MODES = ("duplicated", "blockwise", "distributed")  # emerging-optimizers' newton_schulz_tp modes
MUON_MATMUL_PRECISIONS = ("medium", "high", "highest")  # torch's float32 matmul precisions
LR_SCHEDULES = ("cosine", "wsd", "linear", "constant")
MEGATRON_LR_STYLE = {"cosine": "cosine", "wsd": "WSD", "linear": "linear", "constant": "constant"}  # lr_decay_style
BACKENDS = ("auto", "local", "te")  # train.backend (auto: megagate.model.kernels.resolve_backend)
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
OPTIMIZER_FORMATS = ("fully_reshardable", "dp_reshardable")
SEED_MAX = 2**32 - 1


@dataclass(frozen=True)
class TrainSection:
    micro_batch_size: int = 4
    global_batch_size: int = 16
    seq_length: int = 128
    train_steps: int = 100
    precision: str = "fp32"
    backend: str = "auto"  # auto: Transformer Engine when installed and on GPU, else megatron's local modules
    # FP8 (precision: fp8; Transformer Engine): NVIDIA's Hopper MoE recipe is blockwise with e4m3
    fp8_recipe: str = "blockwise"
    fp8_format: str | None = None  # e4m3 | hybrid; None: e4m3 for blockwise/mxfp8, hybrid for delayed/tensorwise
    fp8_margin: int = 0  # delayed scaling only
    fp8_amax_history_len: int = 1024  # delayed scaling only
    fp8_amax_compute_algo: str = "max"  # delayed scaling only
    fp8_param_gather: bool = False  # FP8 parameters: the distributed optimizer all-gathers FP8, not bf16
    moe_router_padding_for_fp8: bool | None = None  # None: on for MoE (TE's FP8 grouped GEMM wants 16-row groups)
    first_last_layers_bf16: bool = False  # keep the first/last layers of each pipeline stage in bf16
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-5
    lr_schedule: str = "cosine"
    warmup_steps: int = 10
    wsd_decay_steps: int | None = None
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # PaLM's z-loss on the LM head: coeff * mean(logsumexp(logits)^2) over the loss-masked tokens, added to the
    # back-propagated loss and logged apart (train/z_loss); 0: off. Not model.moe_z_loss_coeff (the MoE router's)
    z_loss_coeff: float = 0.0
    # megatron-core's QK-clip threshold: refused when set (megagate.config_rules: no max attention logit here)
    qk_clip_threshold: float | None = None
    use_distributed_optimizer: bool = True
    # adamw, or muon (megatron-core's TensorParallelMuon on 2-D weights, AdamW with adam_* on the rest)
    optimizer: str = "adamw"
    muon_momentum: float = 0.95
    # duplicated: each TP rank orthogonalises the whole gathered matrix (the update of TP 1 at any TP size);
    # blockwise: each rank its own shard (megatron's default; no communication, a layout-dependent update)
    muon_tp_mode: str = "duplicated"
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    # float32 matmul precision of the Newton-Schulz iterations (megatron's muon_fp32_matmul_prec): medium lets
    # TF32 / bf16 kernels run (GPUs, and CPUs with avx512_bf16 or AMX); highest keeps every product in fp32
    muon_matmul_precision: str = "medium"
    eval_interval: int = 0  # steps between validations (0: only at the end)
    eval_iters: int = 2  # global batches per validation
    wall_time_limit: float | None = None  # seconds; checkpoint and exit cleanly before it
    exit_after_steps: int | None = None  # checkpoint and exit after this many steps of this launch's run

    @property
    def wsd_steps(self) -> int:
        """The WSD schedule's decay steps (default: the last fifth of the run)."""
        return self.wsd_decay_steps or max(1, self.train_steps // 5)


@dataclass(frozen=True)
class DataSection:
    blend: list | None = None  # ["prefix", ...] or ["0.7", "prefix_a", "0.3", "prefix_b"]
    tokenizer: str | None = None
    split: str = "969,30,1"
    mock: bool = False
    demo: bool = False  # build the real-text demo corpus (stdlib docs/code) + BPE tokenizer under demo_dir
    demo_dir: str = "runs/demo-data"
    demo_vocab_size: int = 2048
    demo_max_bytes: int = 1_500_000
    loader: str = "torch"
    cache_dir: str | None = None


@dataclass(frozen=True)
class CheckpointSection:
    dir: str | None = None  # default: <output.dir>/checkpoints
    interval: int = 0  # steps between saves (0: only at the end and on a stop request)
    # a checkpoint at the end of every launch that trained (completed, stopped, aborted); false: none there (a
    # throw-away run, a benchmark: a stopped launch then resumes from its last interval checkpoint, if any)
    save_final: bool = True
    keep_last: int = 2
    load: bool = True  # resume from the latest good checkpoint in dir
    # a fresh run (nothing to resume in dir) starts from these weights (another run's checkpoint, its root or run
    # folder): same architecture, new optimizer, schedule and data (a context extension, a continued pre-training)
    init_from: str | None = None
    # dp_reshardable: each rank saves its own optimizer shard (no gather); a resume may change only the DP size.
    # fully_reshardable gathers the DP group's state onto one rank per save and allows any TP/PP/EP change.
    optimizer_format: str = "dp_reshardable"
    # the step loop goes on while the shards are written by a background process (megatron's async
    # dist_checkpointing); manifest, rename and keep_last at finalisation. None: asynchronous with CUDA (the shards
    # are first copied to host memory), synchronous on CPU
    async_save: bool | None = None
    async_check_interval: int = 10  # steps between the ranks' checks that a background write finished


@dataclass(frozen=True)
class LoggingSection:
    interval: int = 1
    tensorboard: bool = True


@dataclass(frozen=True)
class OutputSection:
    dir: str = "runs/default"


@dataclass(frozen=True)
class ProfileSection:
    """`perf.profile`: a torch.profiler trace of global steps [start, end] on the chosen global ranks."""

    steps: list | None = None  # [start, end], 1-based and inclusive; None: no profiling
    ranks: list = field(default_factory=lambda: [0])
    nvtx: bool | str = "auto"  # NVTX ranges per step and op (for nsys); auto: on GPU only
    dir: str | None = None  # default: <output.dir>/profile


@dataclass(frozen=True)
class PerfSection:
    """Performance features (docs/performance.md). `None`/"auto": the GPU default on GPU; on CPU what cannot run
    there is off. Resolved for a device by `resolve_perf`; the trainer's megatron configs come from the result."""

    core_attention: str = "auto"  # auto | sdpa | local | te (auto: te with backend te, else sdpa)
    # MoE
    moe_grouped_gemm: bool | None = None  # None: on GPU (TE's grouped GEMM, or torch's without TE); off on CPU
    moe_token_dispatcher_type: str = "auto"  # auto | alltoall | allgather | flex (auto: alltoall; CPU allgather)
    moe_permute_fusion: bool | None = None  # None: with Transformer Engine
    moe_router_fusion: bool | None = None  # None: with Transformer Engine
    moe_router_dtype: str | None = "fp32"  # fp32 | fp64 | null (the parameter dtype)
    # data-parallel communication
    overlap_grad_reduce: bool | None = None  # None: on GPU
    overlap_param_gather: bool | None = None  # None: on GPU with the distributed optimizer
    bucket_size: int | None = None  # elements per DDP bucket (None: megatron's max(40M, 1M x DP))
    # selective recompute's modules (model.recompute_granularity: selective); None: megatron's ["core_attn"]
    recompute_modules: list | None = None
    # fusions; None: on GPU where their kernels exist (see resolve_perf)
    bias_activation_fusion: bool | None = None  # bias-SwiGLU
    bias_dropout_fusion: bool | None = None
    apply_rope_fusion: bool | None = None
    masked_softmax_fusion: bool | None = None
    cross_entropy_loss_fusion: bool | None = None
    cross_entropy_fusion_impl: str = "native"  # native | te
    gradient_accumulation_fusion: bool | None = None
    # CUDA graphs (megatron 0.19.2: cuda_graph_impl + cuda_graph_modules)
    cuda_graph_impl: str = "none"  # none | local | transformer_engine
    cuda_graph_modules: list | None = None  # attn, mlp, moe, moe_router, moe_preprocess; None/[]: whole layer
    cuda_graph_warmup_steps: int = 3
    # precision-aware optimizer (TE's FusedAdam; distributed optimizer)
    use_precision_aware_optimizer: bool = False
    main_params_dtype: str = "fp32"  # fp32 | fp16
    main_grads_dtype: str = "fp32"  # fp32 | bf16
    # DDP's gradient buffer and its reduce-scatter in fp32 (megatron's default); false: in the parameter dtype, as
    # NVIDIA's performance recipes run (half the buffer and the traffic)
    grad_reduce_in_fp32: bool = True
    exp_avg_dtype: str = "fp32"  # fp32 | fp16 | bf16 | fp8
    exp_avg_sq_dtype: str = "fp32"  # fp32 | fp16 | bf16 | fp8
    # NVIDIA's recipes (GPU only; off on CPU, listed): TP/EP communication overlap, Megatron-FSDP, offloading
    tp_comm_overlap: bool = False  # TE userbuffers: TP all-gather/reduce-scatter under the GEMMs (needs SP)
    overlap_moe_expert_parallel_comm: bool = False  # EP all-to-all under another micro-batch's compute
    delay_wgrad_compute: bool = False  # expert weight gradients after the dispatch backward (with the EP overlap)
    moe_flex_dispatcher_backend: str = "deepep"  # deepep | hybridep (moe_token_dispatcher_type flex)
    use_megatron_fsdp: bool = False  # Megatron-FSDP in place of DDP + the distributed optimizer
    data_parallel_sharding_strategy: str = "optim_grads_params"  # Megatron-FSDP: no_shard | optim | optim_grads | ..
    offload_modules: list | None = None  # fine-grained activation offloading: the modules whose inputs go to host
    # megatron's layer-wise activation offloading (TE's CPU offload context; PP 1, no recompute): the activations of
    # the first N transformer layers go to host memory during the forward and come back for the backward (0: off)
    cpu_offloading_num_layers: int = 0
    optimizer_cpu_offload: bool = False  # the optimizer step on the host (HybridDeviceOptimizer)
    optimizer_offload_fraction: float = 1.0  # share of the optimizer state on the host
    # Python's garbage collector: disabled, run every N steps on every rank at once (0: Python's own)
    manual_gc_interval: int | None = None  # None: 5 on GPU (NVIDIA's Qwen3-30B-A3B recipe), 0 on CPU
    profile: ProfileSection = field(default_factory=ProfileSection)


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    train: TrainSection = TrainSection()
    data: DataSection = DataSection()
    checkpoint: CheckpointSection = CheckpointSection()
    logging: LoggingSection = LoggingSection()
    output: OutputSection = OutputSection()
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    perf: PerfSection = field(default_factory=PerfSection)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    seed: int = 1234
    raw: dict = field(default_factory=dict, compare=False, repr=False)  # the merged YAML, for the run directory

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.output.dir, "checkpoints")


# --- parsing -------------------------------------------------------------------------------------------------------
def _model(values: Any) -> ModelConfig:
    if not isinstance(values, dict):
        raise ConfigError(f"model must be a mapping with a preset, not {values!r}")
    values = dict(values)
    gate_values = values.pop("gate", None) or {}
    if isinstance(gate_values, str):
        gate_values = {"preset": gate_values}
    if not isinstance(gate_values, dict):
        raise ConfigError(f"model.gate must be a preset name or a mapping, not {gate_values!r}")
    gate = gates.from_dict(gate_values, preset=gate_values.get("preset"))
    hints = typing.get_type_hints(ModelConfig)
    for key, value in values.items():
        if key in hints and key != "gate":
            values[key] = check_type(value, hints[key], f"model.{key}")
    return model_from_dict(values, gate)


SECTIONS = (
    "model",
    "parallel",
    "train",
    "data",
    "checkpoint",
    "logging",
    "output",
    "monitor",
    "perf",
    "watchdog",
    "straggler",
    "seed",
)


def parse(data: Mapping[str, Any]) -> TrainConfig:
    """The typed TrainConfig of a merged YAML mapping: unknown sections and keys, wrong types and each section's own
    rules refused in one line; the rules across sections are `megagate.config_rules`' (`config_reader.from_dict`
    applies them)."""
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        hint = did_you_mean(unknown[0], SECTIONS)
        raise ConfigError(f"{unknown[0]} is not a config section; sections: {', '.join(SECTIONS)}{hint}")
    if "model" not in data:
        raise ConfigError("the config needs a model section (e.g. model: {preset: tiny, gate: g1-elementwise})")
    cfg = TrainConfig(
        model=_model(data["model"]),
        parallel=build_section(ParallelConfig, data.get("parallel"), "parallel"),
        train=build_section(TrainSection, data.get("train"), "train"),
        data=build_section(DataSection, data.get("data"), "data"),
        checkpoint=build_section(CheckpointSection, data.get("checkpoint"), "checkpoint"),
        logging=build_section(LoggingSection, data.get("logging"), "logging"),
        output=build_section(OutputSection, data.get("output"), "output"),
        monitor=MonitorConfig.from_dict(data.get("monitor")),
        perf=build_section(PerfSection, data.get("perf"), "perf"),
        watchdog=WatchdogConfig.from_dict(data.get("watchdog")),
        straggler=StragglerConfig.from_dict(data.get("straggler")),
        seed=check_type(data.get("seed", 1234), int, "seed"),
        raw=dict(data),
    )
    return cfg


def layout(cfg: TrainConfig, world_size: int) -> Layout:
    """The run's layout on `world_size` ranks (megagate.distributed.layout's rules), or a one-line ConfigError."""
    return layout_rules.layout(
        cfg.parallel,
        world_size,
        micro_batch_size=cfg.train.micro_batch_size,
        global_batch_size=cfg.train.global_batch_size,
        num_experts=cfg.model.num_experts,
    )
