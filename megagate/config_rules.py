"""The rules a run config must satisfy on any machine: pure functions of the `TrainConfig`, no file, library or GPU
looked at. The perf and FP8 rules are judged for the GPU node the config is written for (`Machine.target`).

`check_rules(cfg)` raises the first broken rule as a one-line `ConfigError` naming the key, the value and what is
allowed. What depends on the machine a config is judged on (libraries, GPUs, files, folders) is
`megagate.config_reader.check_environment` and `megagate.run_setup.resolve` (the perf rules of the real GPU).
"""

from __future__ import annotations

import importlib.metadata
import math

from megagate.distributed import layout as layout_rules
from megagate.errors import ConfigError
from megagate.machine import Machine
from megagate.model.gate_params import check_gate_tensor_parallel
from megagate.model.hybrid import check_gdn_parallel
from megagate.model.qkv_layout import check_tensor_parallel
from megagate.perf import resolve_perf
from megagate.perf_rules import check_perf
from megagate.run_config import (
    BACKENDS,
    FP8_RECIPES,
    LR_SCHEDULES,
    MUON_MATMUL_PRECISIONS,
    MUON_TP_MODES,
    OPTIMIZER_FORMATS,
    OPTIMIZERS,
    PRECISIONS,
    SEED_MAX,
    TrainConfig,
    TrainSection,
)
from megagate.sections import check_choice


def check_rules(cfg: TrainConfig) -> None:
    """Every rule across the sections (the world size is checked in `run_config.layout`)."""
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
    _check_muon(cfg)
    if t.qk_clip_threshold is not None:
        raise ConfigError(
            f"train.qk_clip_threshold={t.qk_clip_threshold:g} is not supported: megatron-core 0.19's QK-clip takes each "
            "head's max attention logit from Transformer Engine's fused attention (>= 2.9) only, which megagate's "
            "local and SDPA core attentions do not compute, and rescales linear_qkv as [q|k|v] per group, which "
            "megagate's fused gate rows are not (docs/monitoring.md, QK-clip); leave it unset"
        )
    _check_cadence(cfg)
    _check_early_stop(cfg)
    _check_split(cfg.data.split)
    if not 0 <= cfg.seed <= SEED_MAX:  # numpy's and megatron's RNG seeds are 32-bit unsigned
        raise ConfigError(f"seed={cfg.seed} must be in [0, {SEED_MAX}]")
    layout_rules.check_parallel(p, m.num_experts)  # sizes >= 1; VPP, SP and EP rules (megatron's, in one place)
    check_tensor_parallel(
        m.num_attention_heads, m.num_query_groups, p.tensor_model_parallel_size, model="model.", parallel="parallel."
    )
    check_gate_tensor_parallel(
        m.gate, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim, p.tensor_model_parallel_size
    )
    check_gdn_parallel(m, p.tensor_model_parallel_size, p.context_parallel_size)
    layout_rules.stage_layers(p, m.num_layers)  # even, uneven first/last, embedding/loss split or layout string
    if p.context_parallel_size > 1 and t.backend != "te":
        raise ConfigError(
            f"parallel.context_parallel_size={p.context_parallel_size} needs Transformer Engine's attention: "
            "set train.backend=te (megatron's local attention has no context parallelism)"
        )
    check_perf(cfg, resolve_perf(cfg, Machine.target(cfg)))  # the rules of the GPU it is written for, anywhere
    d = cfg.data
    if not (d.mock or d.demo or d.blend):
        raise ConfigError("data: give data.blend (dataset prefixes), or data.mock=true, or data.demo=true")
    if d.demo and d.blend:  # the two are different data: which one trains must not depend on a precedence rule
        raise ConfigError(
            "data.demo=true and data.blend name two data sources: set data.demo=false to train on data.blend "
            "(or drop data.blend for the demo corpus)"
        )
    if d.blend and not d.tokenizer and not d.mock:
        raise ConfigError("data.tokenizer is required with data.blend (the tokenizer the data was preprocessed with)")
    if cfg.checkpoint.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={cfg.checkpoint.keep_last} must be >= 1")
    if cfg.checkpoint.async_check_interval < 1:
        raise ConfigError(f"checkpoint.async_check_interval={cfg.checkpoint.async_check_interval} must be >= 1 (steps)")


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
            f"warmup must end before the last step (for a short run also set train.warmup_steps={t.train_steps // 10})"
        )
    if t.wsd_decay_steps is not None and not 1 <= t.wsd_decay_steps <= t.train_steps - t.warmup_steps:
        raise ConfigError(
            f"train.wsd_decay_steps ({t.wsd_decay_steps}) must be in [1, train.train_steps - train.warmup_steps "
            f"({t.train_steps - t.warmup_steps})]"
        )
    for name, low, high, what in (
        ("clip_grad", 0.0, None, ">= 0 (0: no clipping)"),
        ("z_loss_coeff", 0.0, None, ">= 0 (0: no z-loss; PaLM used 1e-4)"),
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
    sink = cfg.monitor.diagnostics.sink_length
    if sink is not None and sink > t.seq_length:  # the probe is a validation micro-batch of train.seq_length
        raise ConfigError(f"monitor.diagnostics.sink_length={sink} is longer than train.seq_length ({t.seq_length})")
    d = cfg.data
    if d.demo_vocab_size < 259 or d.demo_max_bytes < 1:
        raise ConfigError(
            f"data.demo_vocab_size={d.demo_vocab_size} must be >= 259 and data.demo_max_bytes={d.demo_max_bytes} >= 1"
        )


def _check_early_stop(cfg: TrainConfig) -> None:
    """Early-stop rules that could never fire, and a run that never saves: refused or said, one line each."""
    e, steps = cfg.monitor.early_stop, cfg.train.train_steps
    # (0 with the monitor off is what a frontier trial sets by default: allowed, as megagate.frontier.spec does)
    if e.max_loss_spikes and not cfg.monitor.spike.enabled:
        raise ConfigError(
            f"monitor.early_stop.max_loss_spikes={e.max_loss_spikes} counts the spike monitor's events, but "
            "monitor.spike.enabled=false: turn the monitor on or drop the rule"
        )
    if cfg.straggler.enabled and not cfg.watchdog.enabled:
        from megagate.console import warn

        warn("straggler.enabled with watchdog.enabled=false: no straggler report (it reads the watchdog's records)")
    late = [s for s, _ in e.rungs if s > steps]
    if late:
        from megagate.console import warn

        warn(f"monitor.early_stop.rungs at steps {late} lie beyond train.train_steps={steps}: they never judge the run")
    if not cfg.checkpoint.save_final and cfg.checkpoint.interval == 0:
        from megagate.console import warn

        warn(
            "checkpoint.save_final=false with checkpoint.interval=0: this run never saves a checkpoint (a stop or a "
            "failure leaves nothing to resume from)"
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


MIN_EMERGING_OPTIMIZERS = (0, 2)  # what megatron-core 0.19.2 requires for its Muon


def _emerging_optimizers_version() -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in importlib.metadata.version("emerging-optimizers").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def _check_muon(cfg: TrainConfig) -> None:
    """train.optimizer and the Muon settings megatron-core 0.19's TensorParallelMuon accepts, here."""
    t, p, m = cfg.train, cfg.parallel, cfg.model
    check_choice(t.optimizer, OPTIMIZERS, "train.optimizer")
    check_choice(t.muon_tp_mode, MUON_TP_MODES, "train.muon_tp_mode")
    check_choice(t.muon_matmul_precision, MUON_MATMUL_PRECISIONS, "train.muon_matmul_precision")
    if t.optimizer != "muon":
        return
    if not 0 <= t.muon_momentum < 1:
        raise ConfigError(f"train.muon_momentum={t.muon_momentum} must be in [0, 1)")
    if t.muon_ns_steps < 1:
        raise ConfigError(f"train.muon_ns_steps={t.muon_ns_steps} must be >= 1 (Newton-Schulz iterations)")
    version = _emerging_optimizers_version()
    if version is None or version < MIN_EMERGING_OPTIMIZERS:
        found = "not installed" if version is None else "version " + ".".join(map(str, version))
        raise ConfigError(
            f"train.optimizer='muon' needs emerging-optimizers >= 0.2 (megatron-core's Muon), which is {found}: "
            "pip install -r requirements.txt, or train.optimizer='adamw'"
        )
    if t.use_distributed_optimizer:
        raise ConfigError(
            "train.optimizer='muon' with train.use_distributed_optimizer=true: megatron-core 0.19 shards Muon only "
            "layer-wise (LayerWiseDistributedOptimizer), which megagate does not build; set "
            "train.use_distributed_optimizer=false"
        )
    if t.precision == "fp8":
        raise ConfigError("train.optimizer='muon' with train.precision='fp8' is not supported; use fp32 or bf16")
    tp = p.tensor_model_parallel_size
    if m.num_query_groups < tp:
        raise ConfigError(
            f"train.optimizer='muon' splits linear_qkv per KV group, but model.num_query_groups "
            f"({m.num_query_groups}) < parallel.tensor_model_parallel_size ({tp}) leaves a rank part of a group; "
            "use num_query_groups >= TP or train.optimizer='adamw'"
        )
