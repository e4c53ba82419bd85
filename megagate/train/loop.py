"""The training loop: megatron's forward-backward schedule, gradient finalisation, optimizer step, LR schedule.

Everything else is a component built in `setup` (model chunks, DDP, DistributedOptimizer, scheduler, data) or
called from the loop (Checkpointer, Metrics, StopConditions, the spike monitor and live diagnostics).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Iterator, Optional

import torch

from megagate import config as config_mod
from megagate.config import Layout, TrainConfig
from megagate.distributed import megatron_cpu
from megagate.errors import ConfigError
from megagate.model.build import build_gpt_model, transformer_config
from megagate.model.counts import flops_per_token
from megagate.train import checkpoint as ckpt
from megagate.train.metrics import Metrics, log
from megagate.train.signals import StopConditions


@dataclass
class Run:
    """The built components of one training run."""

    cfg: TrainConfig
    layout: Layout
    model: list  # unwrapped model chunks (one per virtual pipeline stage)
    ddp: list  # the same chunks wrapped in megatron's DistributedDataParallel
    optimizer: Any
    scheduler: Any
    train_data: Any
    valid_data: Any
    step: int = 0
    consumed_samples: int = 0
    extra_state: dict = field(default_factory=dict)


# --- setup -------------------------------------------------------------------------------------------------------
def resolve_backend(cfg: TrainConfig) -> str:
    """'te' or 'local' (auto: Transformer Engine when it imports and a GPU is present)."""
    from megagate.model.spec import transformer_engine_available

    if cfg.train.backend != "auto":
        return cfg.train.backend
    return "te" if torch.cuda.is_available() and transformer_engine_available() else "local"


def precision_kwargs(cfg: TrainConfig) -> tuple[torch.dtype, dict]:
    t = cfg.train
    if t.precision == "fp32":
        return torch.float32, {}
    extra: dict[str, Any] = {}
    if t.precision == "fp8":
        extra = dict(fp8="hybrid", fp8_recipe=t.fp8_recipe, fp8_margin=t.fp8_margin,
                     fp8_amax_history_len=t.fp8_amax_history_len, fp8_amax_compute_algo=t.fp8_amax_compute_algo)  # fmt: skip
    return torch.bfloat16, extra


def build_model_chunks(cfg: TrainConfig) -> list:
    """This rank's model chunks (one per virtual pipeline stage), initialised layout-independently."""
    from megatron.core import parallel_state

    from megagate.train import init

    dtype, extra = precision_kwargs(cfg)
    tconfig = transformer_config(cfg.model, cfg.parallel, params_dtype=dtype, **extra)
    backend = resolve_backend(cfg)
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunk = build_gpt_model(
            cfg.model,
            tconfig,
            backend=backend,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            vp_stage=stage,
        )
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    init.initialize(chunks, cfg.seed, cfg.model.init_method_std, cfg.model.num_layers)
    return chunks


def wrap_ddp(cfg: TrainConfig, chunks: list) -> list:
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.train.use_distributed_optimizer,
        check_for_nan_in_grad=False,  # the spike monitor sees non-finite gradients and decides what to do
    )
    return [
        DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


def build_optimizer(cfg: TrainConfig, ddp: list) -> tuple[Any, Any]:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = cfg.train
    dtype, _ = precision_kwargs(cfg)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad,
            bf16=dtype == torch.bfloat16, params_dtype=dtype,
            use_distributed_optimizer=t.use_distributed_optimizer,
        ),  # fmt: skip
        ddp,
    )
    gbs = t.global_batch_size
    style = {"cosine": "cosine", "wsd": "WSD", "linear": "linear", "constant": "constant"}[t.lr_schedule]
    scheduler = OptimizerParamScheduler(
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
        wsd_decay_steps=(t.wsd_decay_steps or max(1, t.train_steps // 5)) * gbs if style == "WSD" else None,
        lr_wsd_decay_style="linear" if style == "WSD" else None,
    )
    return optimizer, scheduler


def build_data(cfg: TrainConfig, layout: Layout) -> tuple[Any, Any]:
    """(train, valid) megatron datasets for the run."""
    from megagate.data.loader import build_datasets

    d, t = cfg.data, cfg.train
    blend, tokenizer = d.blend, d.tokenizer
    if d.demo and not blend:
        from megagate.data.demo import prepare_demo_data

        tokenizer, prefix = _rank0_first(lambda: prepare_demo_data(d.demo_dir, d.demo_vocab_size, d.demo_max_bytes))
        blend = [prefix]
    if tokenizer is not None:
        from megagate.data.tokenizer import load_tokenizer

        vocab = load_tokenizer(tokenizer).vocab_size
        if vocab > cfg.model.vocab_size:
            raise ConfigError(f"the tokenizer has {vocab} tokens but model.vocab_size is {cfg.model.vocab_size}")
    gbs = t.global_batch_size
    evaluations = (t.train_steps // t.eval_interval if t.eval_interval else 0) + 1
    # the test split is not used in training: one epoch of it (a sample count on an empty split never ends)
    num_samples = (t.train_steps * gbs, evaluations * t.eval_iters * gbs, None)
    train, valid, _ = build_datasets(
        blend, tokenizer=tokenizer, seq_length=t.seq_length, num_samples=num_samples, split=d.split,
        seed=cfg.seed, cache_dir=d.cache_dir or os.path.join(cfg.output.dir, "data_cache"), mock=d.mock,
        mock_vocab_size=cfg.model.vocab_size,
    )  # fmt: skip
    return train, valid


def _rank0_first(fn: Any) -> Any:
    """Run fn on global rank 0 first (it may build cached files), then on the others."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        result = fn()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    if rank != 0:
        result = fn()
    return result


def loader(cfg: TrainConfig, dataset: Any, consumed_samples: int) -> Iterator[dict]:
    from megatron.core import parallel_state

    from megagate.data.loader import build_loader

    return iter(build_loader(
        dataset, cfg.train.micro_batch_size, kind=cfg.data.loader, seed=cfg.seed, consumed_samples=consumed_samples,
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
    ))  # fmt: skip


# --- one step ------------------------------------------------------------------------------------------------------
def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
    losses = output.float()
    mask = loss_mask.to(losses.device).float()
    loss = (losses * mask).sum() / mask.sum().clamp(min=1)
    # clone: the schedule divides the returned loss by the number of micro-batches in place
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator: Iterator[dict], model: Any) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    if model.config.context_parallel_size > 1:
        # each context-parallel rank keeps its (load-balanced, zigzag) share of every sequence
        from megatron.core import parallel_state
        from megatron.core.utils import get_batch_on_this_cp_rank

        batch = get_batch_on_this_cp_rank({**batch, "cu_seqlens": None}, is_hybrid_cp=False,
                                          cp_group=parallel_state.get_context_parallel_group())  # fmt: skip
        batch.pop("cu_seqlens", None)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _global_loss(results: list[dict]) -> float:
    """Mean loss over micro-batches and data-parallel ranks, known on every rank afterwards."""
    from megatron.core import parallel_state

    value = torch.zeros(1, dtype=torch.float64)
    if results:  # last pipeline stage
        value[0] = sum(float(r["lm loss"]) for r in results) / len(results)
    if torch.cuda.is_available():
        value = value.cuda()
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        torch.distributed.all_reduce(value, group=parallel_state.get_data_parallel_group())
        value /= parallel_state.get_data_parallel_world_size()
    # the last stage holds it: share it along the pipeline (sum: other stages contribute zeros)
    torch.distributed.all_reduce(value, group=parallel_state.get_pipeline_model_parallel_group())
    return float(value.item())


def run_schedule(run: Run, microbatches: list[dict], forward_only: bool) -> float:
    """megatron's forward(-backward) schedule over this step's micro-batches; returns the global mean loss."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    iterators = [iter(microbatches) for _ in run.ddp] if len(run.ddp) > 1 else iter(microbatches)
    results = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iterators,
        model=run.ddp if len(run.ddp) > 1 else run.ddp[0],
        num_microbatches=len(microbatches),
        seq_length=run.cfg.train.seq_length,
        micro_batch_size=run.cfg.train.micro_batch_size,
        forward_only=forward_only,
    )
    return _global_loss(results)


def train_step(run: Run, microbatches: list[dict], monitor: Any, step: int) -> tuple[float, float, float, Optional[str]]:
    """One optimizer step; returns (loss, grad norm, LR of the update, the monitor's action or None if applied)."""
    for chunk in run.ddp:
        chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    loss = run_schedule(run, microbatches, forward_only=False)
    monitor.after_backward(run, step)
    # The monitor decides before anything is applied: gradients are reduced and their global norm is known.
    run.scheduler.step(increment=0)  # this update's LR from the schedule (a previous step may have scaled it)
    run.optimizer.prepare_grads()
    grad_norm = float(run.optimizer.get_grad_norm())
    action = monitor.decide(run, step, loss, grad_norm)
    lr = float(run.optimizer.param_groups[0]["lr"])
    if action in ("skip", "rollback", "abort"):
        return loss, grad_norm, lr, action
    applied, _, _ = run.optimizer.step()  # prepares the same gradients again, clips and updates
    if applied:
        run.scheduler.step(increment=run.cfg.train.global_batch_size)
        return loss, grad_norm, lr, None
    return loss, grad_norm, lr, "skip"


MOE_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                  "global_aux_loss": "global_load_balancing_loss"}  # fmt: skip


def moe_metrics(run: Run, step: int) -> dict[str, float]:
    """This step's MoE load-balancing and z-loss (averaged over layers and micro-batches); a collective call."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    model = run.cfg.model
    names = [MOE_LOSS_NAMES[model.moe_load_balancing]] + (["z_loss"] if model.moe_z_loss_coeff else [])
    totals: dict[str, Any] = {}
    get_moe_metrics_tracker().report(
        loss_scale=1.0 / run.layout.num_microbatches, iteration=step, track_names=names, force_initialize=True,
        num_layers=model.num_layers, moe_layer_freq=1, total_loss_dict=totals,
    )  # fmt: skip
    return {f"moe_{name}": float(value) for name, value in totals.items()}


def evaluate(run: Run) -> float:
    """Mean validation loss over eval_iters global batches (the same batches every time)."""
    data = loader(run.cfg, run.valid_data, 0)
    for chunk in run.model:
        chunk.eval()
    losses = []
    with torch.no_grad():
        for _ in range(run.cfg.train.eval_iters):
            batches = [next(data) for _ in range(run.layout.num_microbatches)]
            losses.append(run_schedule(run, batches, forward_only=True))
    for chunk in run.model:
        chunk.train()
    return sum(losses) / len(losses)


# --- the loop ------------------------------------------------------------------------------------------------------
def layout_key(layout: Layout, cfg: TrainConfig) -> dict:
    return {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "dp": layout.dp, "cp": layout.cp,
            "vpp": cfg.parallel.virtual_pipeline_model_parallel_size}  # fmt: skip


def save(run: Run, checkpointer: ckpt.Checkpointer) -> None:
    meta = {
        "consumed_samples": run.consumed_samples,
        "scheduler": run.scheduler.state_dict(),
        "layout": layout_key(run.layout, run.cfg),
        "optimizer_format": run.cfg.checkpoint.optimizer_format,
        "config": run.cfg.raw,
        **run.extra_state,
    }
    path = checkpointer.save(run.step, run.model, run.optimizer, meta)
    log(f"saved checkpoint {path}")


def resume(run: Run, checkpointer: ckpt.Checkpointer) -> None:
    path = ckpt.latest(checkpointer.root)
    if path is None or not run.cfg.checkpoint.load:
        return
    meta = ckpt.read_meta(path)
    same_layout = meta.get("layout") == layout_key(run.layout, run.cfg)
    meta = checkpointer.load(path, run.model, run.optimizer, same_layout=same_layout)
    run.scheduler.load_state_dict(meta["scheduler"])
    run.step, run.consumed_samples = int(meta["step"]), int(meta["consumed_samples"])
    run.extra_state = {k: v for k, v in meta.items() if k.startswith("x_")}
    log(f"resumed from {path} at step {run.step} ({run.consumed_samples} samples)"
        + ("" if same_layout else f"; resharded from {meta.get('layout')}"))


def setup(cfg: TrainConfig, world_size: int) -> Run:
    from megatron.core.distributed import finalize_model_grads

    from megagate.distributed.parallel import initialize_model_parallel

    layout = config_mod.layout(cfg, world_size)
    megatron_cpu.install()
    megatron_cpu.fix_torch_adam_checkpoint_load()
    initialize_model_parallel(cfg.parallel, seed=cfg.seed)
    chunks = build_model_chunks(cfg)
    ddp = wrap_ddp(cfg, chunks)
    optimizer, scheduler = build_optimizer(cfg, ddp)
    tconfig = chunks[0].config
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.grad_scale_func = optimizer.scale_loss
    tconfig.no_sync_func = [c.no_sync for c in ddp] if len(ddp) > 1 else ddp[0].no_sync
    train_data, valid_data = build_data(cfg, layout)
    return Run(cfg, layout, chunks, ddp, optimizer, scheduler, train_data, valid_data)


def is_logging_rank() -> bool:
    from megatron.core import parallel_state

    return (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )


def rollback(run: Run, checkpointer: ckpt.Checkpointer, monitor: Any, event_step: int) -> None:
    """Restore the last good checkpoint after a spike; the monitor drops the offending data window."""
    from megagate.monitor.spike import SpikeAbort

    path = ckpt.latest(checkpointer.root)
    if path is None:
        raise SpikeAbort(f"spike at step {event_step} asks for a rollback, but {checkpointer.root} has no checkpoint")
    restore_step = int(ckpt.read_meta(path)["step"])
    plan = monitor.spike.rollback_plan(event_step, restore_step)
    meta = checkpointer.load(path, run.model, run.optimizer, same_layout=True)
    run.scheduler.load_state_dict(meta["scheduler"])
    run.step, run.consumed_samples = restore_step, int(meta["consumed_samples"])
    monitor.spike.restore_after_rollback(meta["x_monitor"], plan, event_step)
    log(f"rollback: spike at step {event_step}; restored step {restore_step} from {path}; "
        f"dropping batches {plan.skip_first}-{plan.skip_last}")


def train(cfg: TrainConfig, world_size: int) -> dict:
    """Train to cfg.train.train_steps (or until a stop condition); returns the run summary."""
    from megagate.monitor import runfiles
    from megagate.monitor.spike import SpikeAbort
    from megagate.train.monitoring import MonitorHook

    run = setup(cfg, world_size)
    t = cfg.train
    gbs = t.global_batch_size
    checkpointer = ckpt.Checkpointer(cfg.checkpoint_dir, cfg.checkpoint.keep_last, cfg.checkpoint.optimizer_format)
    resume(run, checkpointer)
    logging_rank = is_logging_rank()
    if logging_rank:
        os.makedirs(cfg.output.dir, exist_ok=True)
        runfiles.write_atomic(os.path.join(cfg.output.dir, "config.yaml"), _yaml(cfg.raw))
    metrics = Metrics(cfg.output.dir, logging_rank, cfg.logging.tensorboard, t.train_steps, gbs * t.seq_length,
                      flops_per_token(cfg.model, t.seq_length), world_size)  # fmt: skip
    monitor = MonitorHook(cfg.monitor, cfg.output.dir, logging_rank)
    monitor.start(run, metrics)
    stop = StopConditions(t.wall_time_limit)
    data, data_position = None, None
    first_loss = last_loss = valid_loss = None
    step_time, stopped, start_step = 0.0, None, run.step
    try:
        while run.step < t.train_steps:
            if stop.should_stop(step_time):
                stopped = stop.reason
                break
            if t.exit_after_steps is not None and run.step - start_step >= t.exit_after_steps:
                stopped = f"exit_after_steps={t.exit_after_steps}"
                break
            start = time.perf_counter()
            step = run.step + 1
            wanted = (monitor.batch_index(step) - 1) * gbs  # rollbacks skip windows of data
            if data is None or wanted != data_position:
                data = loader(cfg, run.train_data, wanted)
            run.consumed_samples = wanted
            microbatches = monitor.before_step(run, step, [next(data) for _ in range(run.layout.num_microbatches)])
            data_position = wanted + gbs
            loss, grad_norm, lr, action = train_step(run, microbatches, monitor, step)
            if action == "rollback":
                rollback(run, checkpointer, monitor, step)
                data = None
                continue
            run.step, run.consumed_samples = step, wanted + gbs
            step_time = time.perf_counter() - start
            first_loss = loss if first_loss is None else first_loss
            last_loss = loss
            extra = {"skipped": float(action == "skip")}
            if cfg.model.is_moe:
                extra.update(moe_metrics(run, run.step))
            if run.step % cfg.logging.interval == 0 or run.step == t.train_steps or action == "abort":
                metrics.train_step(run.step, loss, lr, grad_norm, step_time, extra)
            if action == "abort":
                run.extra_state = monitor.state()
                save(run, checkpointer)
                if logging_rank:
                    runfiles.write_summary(cfg.output.dir, run.step, loss, None, True, aborted=True)
                raise SpikeAbort(f"training aborted by the spike monitor at step {step} (loss {loss:.4g}, "
                                 f"grad norm {grad_norm:.4g}); checkpoint saved in {checkpointer.root}")  # fmt: skip
            monitor.after_step(run, run.step)
            if t.eval_interval and run.step % t.eval_interval == 0 and run.step < t.train_steps:
                valid_loss = evaluate(run)
                metrics.validation(run.step, valid_loss)
            if cfg.checkpoint.interval and run.step % cfg.checkpoint.interval == 0 and run.step < t.train_steps:
                run.extra_state = monitor.state()
                save(run, checkpointer)
        if stopped is None and run.step >= t.train_steps:
            valid_loss = evaluate(run)
            metrics.validation(run.step, valid_loss)
        if run.step > start_step:  # otherwise the latest checkpoint already holds this state (or nothing ran)
            run.extra_state = monitor.state()
            save(run, checkpointer)
    finally:
        stop.restore()
        metrics.close()
    summary = {"steps": run.step, "final_loss": last_loss, "final_valid_loss": valid_loss, "stopped": stopped}
    if logging_rank and stopped is None:
        runfiles.write_summary(cfg.output.dir, run.step, last_loss if last_loss is not None else float("nan"),
                               valid_loss, runfiles.is_diverged(first_loss, last_loss),
                               spikes=monitor.spike.num_events if monitor.spike else 0)  # fmt: skip
    if stopped:
        log(f"stopped at step {run.step} ({stopped}); checkpoint saved, resume by running the same command")
    return summary


def _yaml(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)
