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
    output:     dir
    seed

Every mistake is a `ConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

import yaml

from megagate.errors import ConfigError
from megagate.model import gate as gates
from megagate.model.config import ModelConfig, ParallelConfig
from megagate.model.config import from_dict as model_from_dict

PRECISIONS = ("fp32", "bf16", "fp8")
LR_SCHEDULES = ("cosine", "wsd", "linear", "constant")
BACKENDS = ("auto", "local", "te")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
OPTIMIZER_FORMATS = ("fully_reshardable", "dp_reshardable")


@dataclass(frozen=True)
class TrainSection:
    micro_batch_size: int = 4
    global_batch_size: int = 16
    seq_length: int = 128
    train_steps: int = 100
    precision: str = "fp32"
    backend: str = "auto"  # auto: Transformer Engine when installed and on GPU, else megatron's local modules
    fp8_recipe: str = "delayed"
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"
    lr: float = 1e-3
    min_lr: float = 1e-5
    lr_schedule: str = "cosine"
    warmup_steps: int = 10
    wsd_decay_steps: Optional[int] = None
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = True
    eval_interval: int = 0  # steps between validations (0: only at the end)
    eval_iters: int = 2  # global batches per validation
    wall_time_limit: Optional[float] = None  # seconds; checkpoint and exit cleanly before it
    exit_after_steps: Optional[int] = None  # checkpoint and exit after this many steps of this launch's run


@dataclass(frozen=True)
class DataSection:
    blend: Optional[list] = None  # ["prefix", ...] or ["0.7", "prefix_a", "0.3", "prefix_b"]
    tokenizer: Optional[str] = None
    split: str = "969,30,1"
    mock: bool = False
    demo: bool = False  # build the real-text demo corpus (stdlib docs/code) + BPE tokenizer under demo_dir
    demo_dir: str = "runs/demo-data"
    demo_vocab_size: int = 2048
    demo_max_bytes: int = 1_500_000
    loader: str = "torch"
    cache_dir: Optional[str] = None


@dataclass(frozen=True)
class CheckpointSection:
    dir: Optional[str] = None  # default: <output.dir>/checkpoints
    interval: int = 0  # steps between saves (0: only at the end and on a stop request)
    keep_last: int = 2
    load: bool = True  # resume from the latest good checkpoint in dir
    optimizer_format: str = "fully_reshardable"  # fully_reshardable allows TP/PP changes on resume


@dataclass(frozen=True)
class LoggingSection:
    interval: int = 1
    tensorboard: bool = True


@dataclass(frozen=True)
class OutputSection:
    dir: str = "runs/default"


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    train: TrainSection = TrainSection()
    data: DataSection = DataSection()
    checkpoint: CheckpointSection = CheckpointSection()
    logging: LoggingSection = LoggingSection()
    output: OutputSection = OutputSection()
    monitor: dict = field(default_factory=dict)
    seed: int = 1234
    raw: dict = field(default_factory=dict, compare=False, repr=False)  # the merged YAML, for the run directory

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.output.dir, "checkpoints")


# --- loading -------------------------------------------------------------------------------------------------------
def load_yaml(path: str) -> dict:
    """The YAML mapping in `path` (ConfigError if missing or not a mapping)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of sections, not {type(data).__name__}")
    return data


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


def _check_type(value: Any, annotation: Any, path: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(value, arg, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}={value!r} must be true or false")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}={value!r} must be an integer")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}={value!r} must be a number")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}={value!r} must be a string")
        return value
    if annotation is list or origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}={value!r} must be a list")
        return value
    if annotation is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}={value!r} must be a mapping")
        return value
    return value


def build_section(cls: type, values: Any, name: str) -> Any:
    """A frozen dataclass section from a mapping, refusing unknown keys and wrong types."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{name} must be a mapping, not {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"{name}.{unknown[0]} is not a known key; allowed: {', '.join(sorted(fields))}")
    return cls(**{k: _check_type(v, hints[k], f"{name}.{k}") for k, v in values.items()})


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
            values[key] = _check_type(value, hints[key], f"model.{key}")
    return model_from_dict(values, gate)


SECTIONS = ("model", "parallel", "train", "data", "checkpoint", "logging", "output", "monitor", "seed")


def from_dict(data: Mapping[str, Any]) -> TrainConfig:
    """A validated TrainConfig from the merged YAML mapping."""
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
        monitor=_check_type(data.get("monitor") or {}, dict, "monitor"),
        seed=_check_type(data.get("seed", 1234), int, "seed"),
        raw=dict(data),
    )
    validate(cfg)
    return cfg


def load(path: str, overrides: list[str] | None = None) -> TrainConfig:
    """Load a YAML config, apply overrides and validate."""
    return from_dict(apply_overrides(load_yaml(path), overrides or []))


# --- validation --------------------------------------------------------------------------------------------------
def _choice(value: str, allowed: tuple[str, ...], path: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{path}={value!r} is not one of {', '.join(allowed)}")


def validate(cfg: TrainConfig) -> None:
    """Checks that need no process group (the world size is checked in `layout`)."""
    t, p, m = cfg.train, cfg.parallel, cfg.model
    _choice(t.precision, PRECISIONS, "train.precision")
    _choice(t.lr_schedule, LR_SCHEDULES, "train.lr_schedule")
    _choice(t.backend, BACKENDS, "train.backend")
    _choice(t.fp8_recipe, FP8_RECIPES, "train.fp8_recipe")
    _choice(cfg.data.loader, ("torch", "dali"), "data.loader")
    _choice(cfg.checkpoint.optimizer_format, OPTIMIZER_FORMATS, "checkpoint.optimizer_format")
    for name in ("micro_batch_size", "global_batch_size", "seq_length", "train_steps"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be positive")
    if t.seq_length > m.max_sequence_length:
        raise ConfigError(f"train.seq_length ({t.seq_length}) exceeds model.max_sequence_length ({m.max_sequence_length})")
    if not 0 <= t.min_lr <= t.lr:
        raise ConfigError(f"train.min_lr ({t.min_lr}) must be in [0, train.lr ({t.lr})]")
    if t.warmup_steps < 0 or t.warmup_steps > t.train_steps:
        raise ConfigError(f"train.warmup_steps ({t.warmup_steps}) must be in [0, train.train_steps ({t.train_steps})]")
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "context_parallel_size"):  # fmt: skip
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name}={getattr(p, name)} must be >= 1")
    tp = p.tensor_model_parallel_size
    if m.num_attention_heads % tp:
        raise ConfigError(f"model.num_attention_heads ({m.num_attention_heads}) must be divisible by "
                          f"parallel.tensor_model_parallel_size ({tp})")  # fmt: skip
    if m.num_query_groups % tp:
        raise ConfigError(f"model.num_query_groups ({m.num_query_groups}) must be divisible by "
                          f"parallel.tensor_model_parallel_size ({tp})")  # fmt: skip
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    chunks = pp * (vpp or 1)
    if vpp is not None and pp < 2:
        raise ConfigError(f"parallel.virtual_pipeline_model_parallel_size ({vpp}) needs pipeline_model_parallel_size > 1")
    if m.num_layers % chunks:
        raise ConfigError(f"model.num_layers ({m.num_layers}) must be divisible by pipeline stages x virtual stages ({chunks})")
    if p.expert_model_parallel_size > 1 and not m.is_moe:
        raise ConfigError(f"parallel.expert_model_parallel_size ({p.expert_model_parallel_size}) needs an MoE model (model.num_experts > 0)")
    if m.is_moe and m.num_experts % p.expert_model_parallel_size:
        raise ConfigError(f"parallel.expert_model_parallel_size ({p.expert_model_parallel_size}) must divide "
                          f"model.num_experts ({m.num_experts})")  # fmt: skip
    if p.context_parallel_size > 1 and t.backend != "te":
        raise ConfigError(f"parallel.context_parallel_size={p.context_parallel_size} needs Transformer Engine's attention: "
                          "set train.backend=te (megatron's local attention has no context parallelism)")
    if p.sequence_parallel and tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs tensor_model_parallel_size > 1")
    if t.precision == "fp8":
        from megagate.model.spec import transformer_engine_available

        if not transformer_engine_available():
            raise ConfigError("train.precision='fp8' needs Transformer Engine, which is not installed; use bf16 or fp32")
    if t.backend == "te":
        from megagate.model.spec import check_backend

        check_backend("te")
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
                if not os.path.exists(base + suffix):
                    raise ConfigError(f"data.blend: missing data file {base + suffix!r} (preprocess with `megagate preprocess`)")
    if cfg.checkpoint.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={cfg.checkpoint.keep_last} must be >= 1")


@dataclass(frozen=True)
class Layout:
    """The resolved parallel layout and batch arithmetic for a world size."""

    world_size: int
    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int


def layout(cfg: TrainConfig, world_size: int) -> Layout:
    """Data-parallel size and micro-batches per step, or a ConfigError naming the sizes that do not fit."""
    p, t = cfg.parallel, cfg.train
    tp, pp, cp, ep = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.context_parallel_size, p.expert_model_parallel_size)  # fmt: skip
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ConfigError(f"world size {world_size} is not divisible by TP ({tp}) x PP ({pp}) x CP ({cp}) = {model_parallel}")
    dp = world_size // model_parallel
    if (dp * cp) % ep:
        raise ConfigError(f"expert_model_parallel_size ({ep}) must divide DP ({dp}) x CP ({cp}) = {dp * cp}")
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise ConfigError(f"train.global_batch_size ({t.global_batch_size}) must be divisible by micro_batch_size "
                          f"({t.micro_batch_size}) x data-parallel size ({dp}) = {per_step}")  # fmt: skip
    return Layout(world_size, tp, pp, cp, ep, dp, t.micro_batch_size, t.global_batch_size, t.global_batch_size // per_step)
