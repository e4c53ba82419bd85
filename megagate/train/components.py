"""The set-up half of training: model chunks, megatron DDP, DistributedOptimizer, LR scheduler, data, loaders.

`build_components(setup)` initialises megatron's parallel state and returns `Components` for a `RunSetup`
(megagate.run_setup: every setting already resolved; the model comes from megagate.model_factory); the Trainer
(megagate.train.trainer) steps them. Nothing here knows about the loop or its callbacks, so benchmarks can build
what they need from here alone.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megagate.console import log
from megagate.distributed.layout import Layout, placement_key
from megagate.distributed.utils import rank0_first
from megagate.errors import ConfigError, MegagateError
from megagate.model_factory import build_model
from megagate.run_config import MEGATRON_LR_STYLE, TrainConfig
from megagate.run_setup import RunSetup, initialize_tp_comm_overlap

if TYPE_CHECKING:  # type-only: ddp_config and optimizer_config import the classes where they build them
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig


@dataclass
class Components:
    """The built parts of one training run."""

    setup: RunSetup  # the run's config and what it resolved to on this machine
    model: list  # unwrapped model chunks (one per virtual pipeline stage)
    ddp: list  # the same chunks wrapped in megatron's DistributedDataParallel
    optimizer: Any  # megatron's (Distributed)Optimizer
    scheduler: Any  # megatron's OptimizerParamScheduler
    train_data: Any  # megatron datasets
    valid_data: Any
    data: DataBuild | None = None  # how the datasets were built (stored in checkpoints)

    @property
    def cfg(self) -> TrainConfig:
        return self.setup.cfg

    @property
    def layout(self) -> Layout:
        return self.setup.layout


@dataclass(frozen=True)
class DataBuild:
    """The sample counts the datasets were built with and the tokenizer file: megatron's GPTDataset order depends
    on the sample count, so a resumed run rebuilds with the saved counts (see `data_samples`)."""

    train_samples: int
    valid_samples: int
    tokenizer: str | None


# --- DDP, optimizer ------------------------------------------------------------------------------------------------
def ddp_config(setup: RunSetup) -> DistributedDataParallelConfig:
    """megatron's DistributedDataParallelConfig of the run set-up."""
    from megatron.core.distributed import DistributedDataParallelConfig

    cfg, perf = setup.cfg, setup.perf
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.perf.grad_reduce_in_fp32 or cfg.train.precision == "fp32",
        overlap_grad_reduce=perf.overlap_grad_reduce,
        overlap_param_gather=perf.overlap_param_gather,
        bucket_size=perf.bucket_size,
        use_distributed_optimizer=cfg.train.use_distributed_optimizer,
        fp8_param_gather=cfg.train.precision == "fp8" and cfg.train.fp8_param_gather,
        check_for_nan_in_grad=False,  # the spike monitor sees non-finite gradients and decides what to do
        use_megatron_fsdp=perf.use_megatron_fsdp,
        data_parallel_sharding_strategy=cfg.perf.data_parallel_sharding_strategy,  # read by Megatron-FSDP only
    )


def sync_params(ddp: list) -> None:
    """Gather every chunk's parameters now where the gather overlaps the next forward (perf.overlap_param_gather):
    after an optimizer step the model's own copy is stale on the shards other ranks updated until that forward runs,
    so a checkpoint must gather first (Megatron-LM's disable_forward_pre_hook before a save)."""
    for chunk in ddp:
        if chunk.ddp_config.use_distributed_optimizer and chunk.ddp_config.overlap_param_gather:
            with torch.no_grad():
                chunk.start_param_sync(force_sync=True)


def wrap_ddp(setup: RunSetup, chunks: list) -> list:
    """megatron's DistributedDataParallel around each chunk (bucketing on the first only, as megatron-LM does)."""
    from megatron.core.distributed import DistributedDataParallel, FullyShardedDataParallel

    config = ddp_config(setup)
    # perf.use_megatron_fsdp (GPU only: resolve_perf switches it off on a CPU): megatron's FSDP adapter, same API
    wrapper = FullyShardedDataParallel if config.use_megatron_fsdp else DistributedDataParallel
    return [wrapper(chunk.config, config, chunk, disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.uint8}


def optimizer_config(setup: RunSetup) -> OptimizerConfig:
    """megatron's OptimizerConfig (AdamW or Muon, with clipping; the precision-aware optimizer's dtypes) of the
    set-up."""
    from megatron.core.optimizer import OptimizerConfig

    t, perf, dtype = setup.cfg.train, setup.perf, setup.params_dtype
    precision_aware: dict[str, Any] = {}
    if perf.use_precision_aware_optimizer:
        # megatron stores fp8 optimizer moments as torch.uint8 (TE's FusedAdam scales them)
        precision_aware = dict(
            use_precision_aware_optimizer=True,
            main_params_dtype=_DTYPES[perf.main_params_dtype],
            main_grads_dtype=_DTYPES[perf.main_grads_dtype],
            exp_avg_dtype=_DTYPES[perf.exp_avg_dtype],
            exp_avg_sq_dtype=_DTYPES[perf.exp_avg_sq_dtype],
        )
    offload: dict[str, Any] = {}  # megatron's defaults (no offload, fraction 0) unless perf.optimizer_cpu_offload
    if perf.optimizer_cpu_offload:
        offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=setup.cfg.perf.optimizer_offload_fraction)
    if t.precision == "fp8":
        offload["fp8_recipe"] = t.fp8_recipe  # the precision-aware optimizer's FP8 path reads it
    choice: dict[str, Any] = {"optimizer": "adam"}
    if t.optimizer == "muon":
        from megagate.train.muon import muon_config_kwargs

        choice = muon_config_kwargs(t)
    return OptimizerConfig(
        **choice,
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=t.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=t.use_distributed_optimizer,
        overlap_param_gather=perf.overlap_param_gather,
        **offload,
        **precision_aware,
    )


def build_optimizer(setup: RunSetup, ddp: list) -> tuple[Any, Any]:
    """(megatron optimizer: AdamW, or Muon with AdamW on the non-matrix parameters, with clipping;
    OptimizerParamScheduler counting samples)."""
    from megatron.core.optimizer import get_megatron_optimizer

    optimizer = get_megatron_optimizer(optimizer_config(setup), ddp)
    if setup.cfg.train.optimizer == "muon":
        from megagate.train.muon import tag_fused_qkv

        tag_fused_qkv(ddp)  # megagate's fused rows, not megatron's guess from the model config
    return optimizer, lr_scheduler(setup.cfg, optimizer)


def lr_scheduler(cfg: TrainConfig, optimizer: Any) -> Any:
    """megatron's OptimizerParamScheduler for `cfg.train`'s schedule, counted in samples."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = cfg.train
    gbs = t.global_batch_size
    style = MEGATRON_LR_STYLE[t.lr_schedule]
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.warmup_steps * gbs,
        lr_decay_steps=t.train_steps * gbs,
        lr_decay_style=style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=t.train_steps * gbs,
        wd_incr_style="constant",
        wsd_decay_steps=t.wsd_steps * gbs if style == "WSD" else None,
        lr_wsd_decay_style="linear" if style == "WSD" else None,
    )


# --- data ----------------------------------------------------------------------------------------------------------
def build_data(cfg: TrainConfig, layout: Layout) -> tuple[Any, Any, DataBuild]:
    """(train, valid) megatron datasets for the run, and how they were built."""
    from megagate.data.loader import build_datasets

    d, t = cfg.data, cfg.train
    blend, tokenizer = d.blend, d.tokenizer
    if d.demo and not blend:
        from megagate.data.demo import prepare_demo_data

        tokenizer, prefix = rank0_first(lambda: prepare_demo_data(d.demo_dir, d.demo_vocab_size, d.demo_max_bytes))
        blend = [prefix]
    if tokenizer is not None:
        from megagate.data.tokenizer import load_tokenizer

        vocab = load_tokenizer(tokenizer).vocab_size
        if vocab > cfg.model.vocab_size:
            raise ConfigError(f"the tokenizer has {vocab} tokens but model.vocab_size is {cfg.model.vocab_size}")
    train_samples, valid_samples = data_samples(cfg)
    train, valid, _ = build_datasets(
        blend,
        tokenizer=tokenizer,
        seq_length=t.seq_length,
        # the test split is not used in training: one epoch of it (a sample count on an empty split never ends)
        num_samples=(train_samples, valid_samples, None),
        split=d.split,
        seed=cfg.seed,
        cache_dir=d.cache_dir or os.path.join(cfg.output.dir, "data_cache"),
        mock=d.mock,
        mock_vocab_size=cfg.model.vocab_size,
    )
    return train, valid, DataBuild(train_samples, valid_samples, tokenizer)


def data_samples(cfg: TrainConfig) -> tuple[int, int]:
    """(train, valid) sample counts to build the datasets with.

    A fresh run: what its steps and evaluations read. A resumed run: at least the counts its checkpoint was built
    with — megatron's GPTDataset orders its samples by epochs of the count it is built for, so the data position (a
    sample count) keeps pointing into the same order after a change of the global batch size or of the evaluation
    cadence. Whether the order really is the same is checked on resume (megagate.train.resume.order_digest).
    """
    from megagate.train.resume import newest_meta

    t = cfg.train
    gbs = t.global_batch_size
    evaluations = (t.train_steps // t.eval_interval if t.eval_interval else 0) + 1
    train_samples, valid_samples = t.train_steps * gbs, evaluations * t.eval_iters * gbs
    saved = newest_meta(cfg.checkpoint_dir) if cfg.checkpoint.load else None
    built = (saved or {}).get("data_samples")
    if not built:
        return train_samples, valid_samples
    needed = int(saved["consumed_samples"]) + (t.train_steps - int(saved["step"])) * gbs
    return max(needed, int(built["train"])), max(valid_samples, int(built["valid"]))


def loader(cfg: TrainConfig, dataset: Any, consumed_samples: int) -> Iterator[dict]:
    """This data-parallel rank's micro-batches of `dataset`, starting after `consumed_samples` global samples."""
    from megatron.core import parallel_state

    from megagate.data.loader import build_loader
    from megagate.distributed import children

    return iter(
        build_loader(
            dataset,
            cfg.train.micro_batch_size,
            kind=cfg.data.loader,
            seed=cfg.seed,
            consumed_samples=consumed_samples,
            data_parallel_rank=parallel_state.get_data_parallel_rank(),
            data_parallel_size=parallel_state.get_data_parallel_world_size(),
            # workers (if any) ignore the stop signals and die with the trainer, like every child of it
            worker_init_fn=functools.partial(children.worker_init, os.getpid()),
        )
    )


# --- the whole set -------------------------------------------------------------------------------------------------
def schedule_groups() -> Any:
    """The process groups megatron's schedules use (the collection they build from its parallel state on every call
    without one: tensor, context, embedding, pipeline and data-parallel groups), built once for a run."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection()
    groups.tp = parallel_state.get_tensor_model_parallel_group()
    groups.cp = parallel_state.get_context_parallel_group()
    groups.embd = parallel_state.get_embedding_group(check_initialized=False)
    groups.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    groups.pp = parallel_state.get_pipeline_model_parallel_group()
    groups.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
    groups.tp_dp_cp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    groups.dp = parallel_state.get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False)
    return groups


def layout_key(cfg: TrainConfig, layout: Layout) -> dict:
    """The parallel layout as stored in a checkpoint (a resume under another one reshards, without the RNG)."""
    return {
        "tp": layout.tp,
        "pp": layout.pp,
        "ep": layout.ep,
        "dp": layout.dp,
        "cp": layout.cp,
        "vpp": cfg.parallel.virtual_pipeline_model_parallel_size,
        **placement_key(cfg.parallel, cfg.model.num_layers),
    }


def is_logging_rank() -> bool:
    """The rank that writes run files: last pipeline stage, first tensor- and data-parallel rank."""
    from megatron.core import parallel_state

    return (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )


def build_components(setup: RunSetup) -> Components:
    """megatron's parallel state for an initialised torch.distributed world, then every part of the run."""
    from megatron.core.distributed import finalize_model_grads

    from megagate.distributed import megatron_cpu
    from megagate.distributed.parallel import initialize_model_parallel
    from megagate.train.optim_step import has_loss_scaler

    cfg, perf = setup.cfg, setup.perf
    if setup.layout is None:
        raise MegagateError("a training run set-up needs a layout: resolve(cfg, world_size)")
    megatron_cpu.install()
    megatron_cpu.fix_torch_adam_checkpoint_load()
    initialize_model_parallel(cfg.parallel, seed=cfg.seed)
    if perf.cuda_graph_impl != "none":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        # captured graphs need a graph-safe RNG tracker (megatron asserts it): TE's for TE graphs, megatron's
        # graphable one for local graphs, as Megatron-LM's initialize does
        model_parallel_cuda_manual_seed(
            cfg.seed,
            te_rng_tracker=perf.cuda_graph_impl == "transformer_engine",
            use_cudagraphable_rng=perf.cuda_graph_impl == "local",
            force_reset_rng=True,
        )
    for line in (perf.cpu_line(), perf.gpu_line()):
        if line:
            log(line)  # once per run (global rank 0)
    if perf.tp_comm_overlap:
        initialize_tp_comm_overlap(setup)  # TE's userbuffers before the layers that use them are built
    chunks = build_model(setup)
    if cfg.train.z_loss_coeff > 0:  # training only: evaluation and export build the same model without it
        from megagate.model.loss import add_z_loss

        for chunk in chunks:
            if chunk.post_process:
                add_z_loss(chunk, cfg.train.z_loss_coeff)
    ddp = wrap_ddp(setup, chunks)
    optimizer, scheduler = build_optimizer(setup, ddp)
    tconfig = chunks[0].config
    tconfig.finalize_model_grads_func = finalize_model_grads
    # the loss scaler's factor in the backward; without a scaler (fp32, bf16) it would multiply every micro-batch's
    # loss by 1.0: megatron skips the multiplication when there is no function
    tconfig.grad_scale_func = optimizer.scale_loss if has_loss_scaler(optimizer) else None
    tconfig.no_sync_func = [c.no_sync for c in ddp] if len(ddp) > 1 else ddp[0].no_sync
    if ddp[0].ddp_config.overlap_grad_reduce:
        # Megatron-LM's align_grad_reduce: the schedule launches each chunk's reduce when its last backward ends
        tconfig.grad_sync_func = [c.start_grad_sync for c in ddp] if len(ddp) > 1 else ddp[0].start_grad_sync
    train_data, valid_data, data = build_data(cfg, setup.layout)
    return Components(setup, chunks, ddp, optimizer, scheduler, train_data, valid_data, data)
