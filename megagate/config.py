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

Every mistake is a `ConfigError` naming the key, the value and what is allowed. This is the only reader of a
training config: `train` (and its --dry-run), `submit`, `sweep` and `analyze` all load through `load`/`from_dict`,
and check the layout for a world size with `layout` (megagate.distributed.layout's rules).
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from megagate.distributed import layout as layout_rules
from megagate.distributed.layout import Layout
from megagate.errors import ConfigError
from megagate.model import gate as gates
from megagate.model.config import ModelConfig, ParallelConfig
from megagate.model.config import from_dict as model_from_dict
from megagate.model.qkv_layout import check_tensor_parallel
from megagate.monitor.config import MonitorConfig
from megagate.sections import build_section, check_type
from megagate.yamlfile import load_mapping

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
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
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


SECTIONS = ("model", "parallel", "train", "data", "checkpoint", "logging", "output", "monitor", "seed")


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
        seed=check_type(data.get("seed", 1234), int, "seed"),
        raw=dict(data),
    )
    validate(cfg, environment=environment)
    return cfg


def load(path: str, overrides: list[str] | None = None, *, environment: bool = True) -> TrainConfig:
    """Load a YAML config, apply overrides and validate (`environment`: see `validate`)."""
    return from_dict(apply_overrides(load_mapping(path), overrides or []), environment=environment)


# --- validation --------------------------------------------------------------------------------------------------
def _choice(value: str, allowed: tuple[str, ...], path: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{path}={value!r} is not one of {', '.join(allowed)}")


def validate(cfg: TrainConfig, *, environment: bool = True) -> None:
    """Checks that need no process group (the world size is checked in `layout`).

    `environment=False` skips what depends on the machine the check runs on (Transformer Engine installed, the
    data files on disk): for a config judged away from where it runs (a container job's submission, an old run's
    checkpoint); the trainer always checks everything.
    """
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
        raise ConfigError(
            f"train.seq_length ({t.seq_length}) exceeds model.max_sequence_length ({m.max_sequence_length})"
        )
    if not 0 <= t.min_lr <= t.lr:
        raise ConfigError(f"train.min_lr ({t.min_lr}) must be in [0, train.lr ({t.lr})]")
    if t.warmup_steps < 0 or t.warmup_steps > t.train_steps:
        raise ConfigError(f"train.warmup_steps ({t.warmup_steps}) must be in [0, train.train_steps ({t.train_steps})]")
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
        if environment and not os.path.exists(d.tokenizer):
            raise ConfigError(f"data.tokenizer: missing tokenizer file {d.tokenizer!r}")
    if cfg.checkpoint.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={cfg.checkpoint.keep_last} must be >= 1")


def layout(cfg: TrainConfig, world_size: int) -> Layout:
    """The run's layout on `world_size` ranks (megagate.distributed.layout's rules), or a one-line ConfigError."""
    return layout_rules.layout(
        cfg.parallel,
        world_size,
        micro_batch_size=cfg.train.micro_batch_size,
        global_batch_size=cfg.train.global_batch_size,
        num_experts=cfg.model.num_experts,
    )
