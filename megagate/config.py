"""The training configuration: a YAML file plus `key=value` overrides → a validated, typed config tree.

Sections (Megatron-LM's names for the parallel sizes):

    model:      preset + ModelConfig overrides, and `gate:` (preset + GateConfig fields)
    parallel:   tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size,
                expert_model_parallel_size, context_parallel_size, sequence_parallel
    train:      batch sizes, sequence length, steps, precision, optimizer, LR schedule, evaluation, wall time
    data:       blend (prefixes with weights), tokenizer, split, mock / demo data, loader
    checkpoint: dir, interval, keep_last, load, optimizer_format
    logging:    interval, tensorboard
    monitor:    spike monitor and live diagnostics (megagate.monitor)
    watchdog:   hang detection: phase limits, heartbeat (megagate.health)
    straggler:  slow-rank reports: window, margin (megagate.health)
    perf:       performance features (fusions, grouped GEMM, overlap, CUDA graphs, manual GC, profiling) resolved
                per device by `resolve_perf` (docs/performance.md)
    output:     dir
    seed

Every mistake is a `ConfigError` naming the key, the value and what is allowed. This is the only reader of a
training config: `train` (and its --dry-run), `submit`, `sweep` and `analyze` all load through `load`/`from_dict`,
and check the layout for a world size with `layout` (megagate.distributed.layout's rules).
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from megagate.distributed import layout as layout_rules
from megagate.distributed.layout import Layout
from megagate.errors import ConfigError, MegagateError
from megagate.health.config import StragglerConfig, WatchdogConfig
from megagate.model import gate as gates
from megagate.model.config import ModelConfig, ParallelConfig
from megagate.model.config import from_dict as model_from_dict
from megagate.model.qkv_layout import check_tensor_parallel
from megagate.monitor.config import MonitorConfig
from megagate.perf import Device, check_perf
from megagate.sections import as_mapping, build_section, check_choice, check_type
from megagate.yamlfile import load_mapping

PRECISIONS = ("fp32", "bf16", "fp8")
LR_SCHEDULES = ("cosine", "wsd", "linear", "constant")
MEGATRON_LR_STYLE = {"cosine": "cosine", "wsd": "WSD", "linear": "linear", "constant": "constant"}  # lr_decay_style
BACKENDS = ("auto", "local", "te")
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
    use_distributed_optimizer: bool = True
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
    keep_last: int = 2
    load: bool = True  # resume from the latest good checkpoint in dir
    # a fresh run (nothing to resume in dir) starts from these weights (another run's checkpoint, its root or run
    # folder): same architecture, new optimizer, schedule and data (a context extension, a continued pre-training)
    init_from: str | None = None
    # dp_reshardable: each rank saves its own optimizer shard (no gather); a resume may change only the DP size.
    # fully_reshardable gathers the DP group's state onto one rank per save and allows any TP/PP/EP change.
    optimizer_format: str = "dp_reshardable"


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
    exp_avg_dtype: str = "fp32"  # fp32 | fp16 | bf16 | fp8
    exp_avg_sq_dtype: str = "fp32"  # fp32 | fp16 | bf16 | fp8
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


# --- loading -------------------------------------------------------------------------------------------------------
def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides (values parsed as YAML) to a nested dict, returning a new dict."""
    import copy

    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        key, text = item.split("=", 1)
        try:
            value = yaml.safe_load(text) if text != "" else None
        except yaml.YAMLError:
            value = text
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


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


def _perf(values: Any) -> PerfSection:
    values = as_mapping(values, "perf")
    profile = build_section(ProfileSection, values.pop("profile", None), "perf.profile")
    return dataclasses.replace(build_section(PerfSection, values, "perf"), profile=profile)


def from_dict(data: Mapping[str, Any], *, environment: bool = True) -> TrainConfig:
    """A validated TrainConfig from the merged YAML mapping (`environment`: see `validate`)."""
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{unknown[0]} is not a config section; sections: {', '.join(SECTIONS)}")
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
        perf=_perf(data.get("perf")),
        watchdog=WatchdogConfig.from_dict(data.get("watchdog")),
        straggler=StragglerConfig.from_dict(data.get("straggler")),
        seed=check_type(data.get("seed", 1234), int, "seed"),
        raw=dict(data),
    )
    validate(cfg, environment=environment)
    return cfg


def load(path: str, overrides: list[str] | None = None, *, environment: bool = True) -> TrainConfig:
    """Load a YAML config, apply overrides and validate (`environment`: see `validate`)."""
    return from_dict(apply_overrides(load_mapping(path), overrides or []), environment=environment)


# --- validation --------------------------------------------------------------------------------------------------
def validate(cfg: TrainConfig, *, environment: bool = True) -> None:
    """Checks that need no process group (the world size is checked in `layout`).

    `environment=False` skips what depends on the machine the check runs on (Transformer Engine installed, the
    data files on disk and intact, output/checkpoint/cache folders usable, the data cache intact): for a config
    judged away from where it runs (a container job's submission, an old run's checkpoint); the trainer always
    checks everything.
    """
    t, p, m = cfg.train, cfg.parallel, cfg.model
    check_choice(t.precision, PRECISIONS, "train.precision")
    check_choice(t.lr_schedule, LR_SCHEDULES, "train.lr_schedule")
    check_choice(t.backend, BACKENDS, "train.backend")
    check_choice(t.fp8_recipe, FP8_RECIPES, "train.fp8_recipe")
    check_choice(cfg.data.loader, ("torch", "dali"), "data.loader")
    check_choice(cfg.checkpoint.optimizer_format, OPTIMIZER_FORMATS, "checkpoint.optimizer_format")
    for name in ("micro_batch_size", "global_batch_size", "seq_length", "train_steps"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be positive")
    if t.seq_length > m.max_sequence_length:
        raise ConfigError(
            f"train.seq_length ({t.seq_length}) exceeds model.max_sequence_length ({m.max_sequence_length})"
        )
    _check_optimizer(t)
    _check_cadence(cfg)
    _check_split(cfg.data.split)
    if not 0 <= cfg.seed <= SEED_MAX:  # numpy's and megatron's RNG seeds are 32-bit unsigned
        raise ConfigError(f"seed={cfg.seed} must be in [0, {SEED_MAX}]")
    layout_rules.check_parallel(p, m.num_experts)  # sizes >= 1; VPP, SP and EP rules (megatron's, in one place)
    check_tensor_parallel(
        m.num_attention_heads, m.num_query_groups, p.tensor_model_parallel_size, model="model.", parallel="parallel."
    )
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    chunks = pp * (vpp or 1)
    if m.num_layers % chunks:
        raise ConfigError(
            f"model.num_layers ({m.num_layers}) must be divisible by pipeline stages x virtual stages ({chunks})"
        )
    if p.context_parallel_size > 1 and t.backend != "te":
        raise ConfigError(
            f"parallel.context_parallel_size={p.context_parallel_size} needs Transformer Engine's attention: "
            "set train.backend=te (megatron's local attention has no context parallelism)"
        )
    if environment and t.precision == "fp8":
        from megagate.model.spec import transformer_engine_available

        if not transformer_engine_available():
            raise ConfigError(
                "train.precision='fp8' needs Transformer Engine, which is not installed; use bf16 or fp32"
            )
    if environment and t.backend == "te":
        from megagate.model.spec import check_backend

        check_backend("te")
    check_perf(cfg, Device.target(cfg))  # the rules of the GPU the config is written for, judged anywhere
    if environment:
        device = Device.detect()
        if device.gpu:  # and of this GPU (a CPU switches off what it cannot run: nothing to refuse there)
            check_perf(cfg, device)
    d = cfg.data
    if not (d.mock or d.demo or d.blend):
        raise ConfigError("data: give data.blend (dataset prefixes), or data.mock=true, or data.demo=true")
    if d.blend and not d.tokenizer and not d.mock:
        raise ConfigError("data.tokenizer is required with data.blend (the tokenizer the data was preprocessed with)")
    if d.blend and not d.mock:
        from megagate.data.indexed import strip_suffix
        from megagate.data.loader import parse_blend

        for prefix in parse_blend(d.blend)[0]:
            base = strip_suffix(prefix)
            for suffix in (".bin", ".idx"):
                if environment and not os.path.exists(base + suffix):
                    raise ConfigError(
                        f"data.blend: missing data file {base + suffix!r} (preprocess with `megagate preprocess`)"
                    )
            if environment:  # a truncated or foreign file: refused with its name now, not inside megatron later
                from megagate.data.indexed import validate as validate_files

                try:
                    validate_files(base)
                except MegagateError as exc:
                    raise ConfigError(f"data.blend: {exc}") from None
        if environment and not os.path.exists(d.tokenizer):
            raise ConfigError(f"data.tokenizer: missing tokenizer file {d.tokenizer!r}")
    if cfg.checkpoint.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={cfg.checkpoint.keep_last} must be >= 1")
    if environment:
        # where the run writes: a file in the way or a read-only folder would fail after the model is built
        from megagate.data.indexed import check_writable_dir

        for key, path in (
            ("output.dir", cfg.output.dir),
            ("checkpoint.dir", cfg.checkpoint_dir),
            ("data.cache_dir", d.cache_dir),
            ("data.demo_dir", d.demo_dir if d.demo and not d.blend else None),
        ):
            if path is not None:
                try:
                    check_writable_dir(path, key)
                except MegagateError as exc:
                    raise ConfigError(str(exc)) from None
        from megagate.data.loader import check_cache_files

        check_cache_files(d.cache_dir or os.path.join(cfg.output.dir, "data_cache"))


def _check_optimizer(t: TrainSection) -> None:
    """The learning-rate schedule and AdamW settings megatron's OptimizerParamScheduler and torch's AdamW accept."""
    if t.lr <= 0:
        raise ConfigError(f"train.lr={t.lr} must be positive")
    if not 0 <= t.min_lr <= t.lr:
        raise ConfigError(f"train.min_lr ({t.min_lr}) must be in [0, train.lr ({t.lr})]")
    # megatron's scheduler asserts lr_warmup_steps < lr_decay_steps (= train_steps here)
    if not 0 <= t.warmup_steps < t.train_steps:
        raise ConfigError(
            f"train.warmup_steps ({t.warmup_steps}) must be in [0, train.train_steps ({t.train_steps})): "
            "warmup must end before the last step"
        )
    if t.wsd_decay_steps is not None and not 1 <= t.wsd_decay_steps <= t.train_steps - t.warmup_steps:
        raise ConfigError(
            f"train.wsd_decay_steps ({t.wsd_decay_steps}) must be in [1, train.train_steps - train.warmup_steps "
            f"({t.train_steps - t.warmup_steps})]"
        )
    for name, low, high, what in (
        ("clip_grad", 0.0, None, ">= 0 (0: no clipping)"),
        ("weight_decay", 0.0, None, ">= 0"),
        ("adam_beta1", 0.0, 1.0, "in [0, 1)"),
        ("adam_beta2", 0.0, 1.0, "in [0, 1)"),
    ):
        value = getattr(t, name)
        if value < low or (high is not None and value >= high):
            raise ConfigError(f"train.{name}={value} must be {what}")
    if t.adam_eps <= 0:
        raise ConfigError(f"train.adam_eps={t.adam_eps} must be positive")
    check_choice(t.fp8_recipe, FP8_RECIPES, "train.fp8_recipe")
    if t.fp8_amax_history_len < 1:
        raise ConfigError(f"train.fp8_amax_history_len={t.fp8_amax_history_len} must be >= 1")


def _check_cadence(cfg: TrainConfig) -> None:
    """Intervals and limits: a zero divides by zero or never fires; a negative one means nothing."""
    t = cfg.train
    for key, value in (
        ("train.eval_iters", t.eval_iters),  # the validation loss is a mean over eval_iters batches
        ("logging.interval", cfg.logging.interval),
    ):
        if value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")
    for key, value, zero in (
        ("train.eval_interval", t.eval_interval, "only at the end"),
        ("checkpoint.interval", cfg.checkpoint.interval, "only at the end and on a stop request"),
    ):
        if value < 0:
            raise ConfigError(f"{key}={value} must be >= 0 (0: {zero})")
    if t.wall_time_limit is not None and t.wall_time_limit <= 0:
        raise ConfigError(
            f"train.wall_time_limit={t.wall_time_limit:g} must be a positive number of seconds (or unset)"
        )
    if t.exit_after_steps is not None and t.exit_after_steps < 1:
        raise ConfigError(f"train.exit_after_steps={t.exit_after_steps} must be >= 1 (or unset)")
    d = cfg.data
    if d.demo_vocab_size < 259 or d.demo_max_bytes < 1:
        raise ConfigError(
            f"data.demo_vocab_size={d.demo_vocab_size} must be >= 259 and data.demo_max_bytes={d.demo_max_bytes} >= 1"
        )


def _check_split(split: str) -> None:
    """`train,valid,test` weights as megatron's parse_and_normalize_split reads them, with a training share and a
    validation share (every completed run evaluates at the end). megatron itself pads missing weights with zeros,
    asserts non-negative ones and divides by their sum; its regex also reads `a,b` as no weights at all."""
    expected = "three comma-separated weights train,valid,test, e.g. 969,30,1"
    try:
        weights = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"data.split={split!r} must be {expected}") from None
    if len(weights) != 3:
        raise ConfigError(f"data.split={split!r} has {len(weights)} weights; it must be {expected}")
    if not all(math.isfinite(w) and w >= 0 for w in weights):
        raise ConfigError(f"data.split={split!r}: the weights must be finite and non-negative, e.g. 969,30,1")
    if weights[0] <= 0 or weights[1] <= 0:
        share = "training" if weights[0] <= 0 else "validation"
        raise ConfigError(f"data.split={split!r} gives no {share} share: the train and valid weights must be positive")


def layout(cfg: TrainConfig, world_size: int) -> Layout:
    """The run's layout on `world_size` ranks (megagate.distributed.layout's rules), or a one-line ConfigError."""
    return layout_rules.layout(
        cfg.parallel,
        world_size,
        micro_batch_size=cfg.train.micro_batch_size,
        global_batch_size=cfg.train.global_batch_size,
        num_experts=cfg.model.num_experts,
    )
