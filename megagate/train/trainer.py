"""The Trainer: megatron's forward-backward schedule, gradient finalisation, optimizer step and LR schedule, with
callbacks around them (the OLMo-core pattern).

The loop knows only steps. Logging, evaluation, checkpoint cadence, stop conditions, the spike monitor's actions,
fault injection and live diagnostics are callbacks (megagate.train.callbacks) that act through the hooks of
`Callback` and a few generic operations of the trainer:

    stop(reason, error=None)   end the run before the next step (on_end still runs; `error` is raised afterwards;
                               final=True: the run is decided, summary.json is written, a rerun does not go on)
    seek(samples)              the next step reads the training data from this global sample position
    save_checkpoint()          a checkpoint of this state (model, optimizer, scheduler, RNG, data position, and
                               every callback's state_dict under "x_<state_key>")
    restore(path)              load a checkpoint into the running trainer; the current step is dropped
    forward_backward(...)      megatron's schedule over micro-batches (forward_only for evaluation)

and, from pre_optim_step, on the `Update` it is given: `skip()` the update, `scale_lr(factor)` of this update.

The step reads nothing on the host by itself: its loss and gradient norm stay on the device (megagate.train.
step_values) until a callback asks for them (`update.loss`, `output.loss`: one read of every pending step, a
collective call), the gradient norm is computed once for the callbacks and the clipping (megagate.train.optim_step),
and the next step's micro-batches are read in a background thread while this one computes (megagate.data.prefetch).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from megagate import checkpoint as ckpt
from megagate.console import log
from megagate.data.prefetch import StepPrefetcher
from megagate.errors import MegagateError
from megagate.health import progress
from megagate.model.loss import ZLoss, z_loss_of
from megagate.monitor.tensorboard import Metric
from megagate.run_setup import RunSetup
from megagate.train import components as parts
from megagate.train import resume as resume_checks
from megagate.train.callbacks.base import Callback, StepOutput, Update, in_priority_order
from megagate.train.optim_step import OptimizerStep, skip_self_copies, skip_single_rank_gathers
from megagate.train.step_values import HostReads, StepLog, StepValues


class Trainer:
    """Steps the components of a run with the callbacks' hooks around each step (every rank runs the same calls)."""

    def __init__(self, components: parts.Components, callbacks: Sequence[Callback] = ()) -> None:
        self.setup = components.setup
        self.cfg = cfg = components.setup.cfg
        self.components = components
        self.layout = components.layout
        self.model, self.ddp = components.model, components.ddp
        self.optimizer, self.scheduler = components.optimizer, components.scheduler
        self.callbacks = in_priority_order(callbacks)
        keys = [cb.state_key for cb in self.callbacks if cb.state_key]
        if len(keys) != len(set(keys)):
            raise MegagateError(f"two callbacks share a checkpoint state key: {sorted(keys)}")
        self.checkpointer = ckpt.Checkpointer(
            cfg.checkpoint_dir,
            cfg.checkpoint.keep_last,
            cfg.checkpoint.optimizer_format,
            check_interval=cfg.checkpoint.async_check_interval,
            on_saved=lambda path, step: self._call("post_checkpoint_saved", path, step),
        )
        self.logging_rank = parts.is_logging_rank()
        self.step = self.start_step = 0  # completed steps (start_step: when this launch began)
        self.consumed_samples = 0  # the data position: global samples consumed (or skipped) before the next step
        self.stop_reason: str | None = None
        self.stop_final = False  # the stop decided the run (an early stop): it is over, not paused
        self.error: BaseException | None = None
        self.summary: dict[str, Any] = {"steps": 0, "final_loss": None, "final_valid_loss": None, "stopped": None}
        self.first_loss: float | None = None  # the run's first step (read at the end)
        # the first loss of the run, from the checkpoint a launch resumed: a resumed launch's own first step is
        # late in the run, and judging divergence by it calls a run that ends just above it diverged
        self._run_first_loss: float | None = None
        self.side_time = 0.0  # seconds spent in evaluations and checkpoint saves (not in training steps)
        self.reads = HostReads()  # every device value the trainer reads goes through it (counted)
        self.step_log = StepLog(self.reads)  # the trained steps' loss and grad norm, on the device until read
        self._optim = OptimizerStep(self.optimizer)
        skip_single_rank_gathers(self.optimizer, self.ddp)  # DP = 1: no one-rank parameter all-gather per step
        skip_self_copies(self.optimizer)  # fp32: the main shards are the parameters, nothing to copy back
        gbs = cfg.train.global_batch_size
        self._prefetch = StepPrefetcher(
            lambda position: parts.loader(cfg, components.train_data, position), self.layout.num_microbatches, gbs
        )
        self._seek: int | None = None  # a data position asked for by seek(), taken when the next step reads
        self._schedule: Any = None  # megatron's forward-backward schedule and its process groups (first use)
        self._groups: Any = None
        self._restored = False
        self._z_loss = cfg.train.z_loss_coeff > 0  # the step's z-loss term is logged beside its loss
        tokenizer = None if components.data is None else components.data.tokenizer
        self._data_order = resume_checks.data_order(cfg, tokenizer)
        self._mark_phases()

    # --- the loop --------------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Resume if a checkpoint exists, train to train.train_steps or until a callback stops; the run summary."""
        with progress.within("load"):
            self._resume()
        progress.PROGRESS.resumed_at(self.step)
        if self.step >= self.cfg.train.train_steps:
            # a finished run rerun (e.g. a requeued job that had completed): nothing to do, and nothing written —
            # its summary, metrics and checkpoints stay as the finished run left them
            log(f"the run in {self.cfg.output.dir} is already complete at step {self.step}; nothing to do")
            return self.summary
        try:
            self._call("on_start")
            while self.step < self.cfg.train.train_steps and self.stop_reason is None:
                progress.PROGRESS.step_started(self.step + 1)
                self._call("on_step_start", self.step + 1)
                if self.stop_reason is not None:
                    break
                start = time.perf_counter()
                microbatches = self._next_microbatches()
                for cb in self.callbacks:
                    microbatches = cb.pre_step(self, self.step + 1, microbatches)
                output = self.train_step(microbatches, start)
                if output is not None:  # None: a callback restored a checkpoint instead
                    self._call("post_step", output)
            self._read_summary()
            self._call("on_end")
            progress.enter("end")
        finally:
            self._prefetch.close()
            self._call("on_close")
        if self.error is not None:
            raise self.error
        return self.summary

    def train_step(self, microbatches: list[dict], start: float | None = None) -> StepOutput | None:
        """One optimizer step on this step's micro-batches; None if a callback restored a checkpoint during it."""
        step, start = self.step + 1, time.perf_counter() if start is None else start
        for chunk in self.ddp:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        progress.enter("forward_backward")
        results = self._run_schedule(microbatches, forward_only=False)
        local_loss, local_z = _local_loss(results), _local_loss(results, "z loss") if self._z_loss else None
        progress.enter("optimizer")
        self._call("post_backward", step)
        # Callbacks decide before anything is applied: gradients are reduced and their global norm is known.
        self.scheduler.step(increment=0)  # this update's LR from the schedule (a previous step may have scaled it)
        found_inf, grad_norm = self._optim.prepare()  # the one norm of the step, on the device where megatron can
        self.step_log.add(step, local_loss, grad_norm, local_z)
        update = Update(step, StepValues(self.step_log, step))
        self._restored = False
        for cb in self.callbacks:
            cb.pre_optim_step(self, update)
            if self._restored:
                return None
        if update.lr_scale != 1.0:
            for group in self.optimizer.param_groups:
                group["lr"] *= update.lr_scale
        lr = self.scheduler.get_lr(self.optimizer.param_groups[0]) * update.lr_scale  # a host number
        applied = False
        if not update.skipped and not found_inf:
            applied = self._optim.apply(grad_norm)  # clips by the same norm and updates
            if applied:
                self.scheduler.step(increment=self.cfg.train.global_batch_size)
        self.step, self.consumed_samples = step, self.consumed_samples + self.cfg.train.global_batch_size
        self.summary["steps"] = step
        progress.PROGRESS.step_finished()
        return StepOutput(step, update.values, lr, time.perf_counter() - start, applied, frozenset(update.flags))

    def _read_summary(self) -> None:
        """The run summary's losses (a read of what is pending, on every rank) before the callbacks end the run."""
        last = self.step_log.last()
        if last is not None:
            self.summary["final_loss"] = last[1].loss
        self.first_loss = self._first_loss_of_run()

    def _first_loss_of_run(self) -> float | None:
        """The loss of the run's first step: carried by the checkpoint a launch resumed, else this launch's."""
        if self._run_first_loss is not None:
            return self._run_first_loss
        return None if self.step_log.first is None else self.step_log.first[1].loss

    def _mark_phases(self) -> None:
        """Phase markers for the watchdog and the straggler report (megagate.health.progress): megatron's gradient
        reduction at the end of the schedule is the grad_sync phase; the pipeline stage groups the ranks."""
        from megatron.core import parallel_state

        progress.PROGRESS.reset()
        if parallel_state.model_parallel_is_initialized():
            progress.PROGRESS.stage = parallel_state.get_pipeline_model_parallel_rank()
        config = self.model[0].config
        if config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func = progress.marking("grad_sync", config.finalize_model_grads_func)

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def _next_microbatches(self) -> list[dict]:
        if self._seek is not None:
            self.consumed_samples, self._seek = self._seek, None
        # the next step's batches are read while this one computes (unless this is the last step)
        return self._prefetch.take(self.consumed_samples, prefetch_next=self.step + 2 <= self.cfg.train.train_steps)

    # --- generic operations for callbacks --------------------------------------------------------------------------
    @property
    def completed(self) -> bool:
        """True when the run reached train.train_steps without a stop."""
        return self.stop_reason is None and self.step >= self.cfg.train.train_steps

    def stop(self, reason: str, error: BaseException | None = None, *, final: bool = False) -> None:
        """End the run before the next step; on_end runs (a final checkpoint), then `error` is raised if given.

        `final`: the run is decided (an early stop): like a completed run it gets its summary.json (with the reason
        under `stopped`) and exits cleanly; a plain stop (signal, wall time) is a pause that a rerun resumes."""
        if self.stop_reason is None:
            self.stop_reason, self.summary["stopped"] = reason, reason
            self.stop_final = final
        self.error = self.error or error

    def seek(self, samples: int) -> None:
        """Read the next step's batch from global sample position `samples` (e.g. past a dropped data window).

        Taken when that step reads its data: a stop before it leaves the position (and the checkpoint) as it was.
        """
        self._seek = int(samples)

    def callback(self, kind: type) -> Any:
        """The first callback of this type, or None."""
        return next((cb for cb in self.callbacks if isinstance(cb, kind)), None)

    def record_metric(self, step: int, metrics: Mapping[str, Metric]) -> None:
        """Metrics of `step` (numbers, or text) for the loggers: every callback's `log_metrics` hook gets them."""
        for cb in self.callbacks:
            cb.log_metrics(self, step, metrics)

    def record_summary(self, key: str, value: Any) -> None:
        """An entry of the run's summary.json (written by RunSummary when the run is over)."""
        self.summary[key] = value

    def latest_checkpoint(self) -> Path | None:
        self.checkpointer.wait()  # a save being written in the background becomes the latest first
        return ckpt.latest(self.checkpointer.root)

    def save_checkpoint(self, background: bool = False) -> Path:
        """Checkpoint the current state (a collective call: every rank must make it); `background`: the shards are
        written while training goes on (post_checkpoint_saved comes when the checkpoint is complete)."""
        start = time.perf_counter()
        try:
            with progress.within("save"):
                return self._save_checkpoint(background)
        finally:
            self.side_time += time.perf_counter() - start  # not a training step's time (metrics' step_time)

    def _save_checkpoint(self, background: bool) -> Path:
        parts.sync_params(self.ddp)  # overlapped parameter all-gather: the last update is not gathered yet
        self.step_log.flush()  # callbacks that judge every step catch up before their state is saved
        self._prefetch.settle()  # the data digest below reads the training set on this thread
        data = self.components.data
        meta = {
            "consumed_samples": self.consumed_samples,
            "first_loss": _float_or_none(self._first_loss_of_run()),
            "scheduler": self.scheduler.state_dict(),
            "layout": parts.layout_key(self.cfg, self.layout),
            "optimizer_format": self.cfg.checkpoint.optimizer_format,
            "config": self.cfg.raw,
            # what a resume checks (megagate.train.resume)
            "architecture": ckpt.architecture(self.cfg),
            "data_order": self._data_order,
            "schedule": resume_checks.schedule(self.cfg),
            "data_samples": None if data is None else {"train": data.train_samples, "valid": data.valid_samples},
            "data_position": resume_checks.order_digest(self.components.train_data, self.consumed_samples),
            **{f"x_{cb.state_key}": cb.state_dict() for cb in self.callbacks if cb.state_key},
        }
        return self.checkpointer.save(self.step, self.model, self.optimizer, meta, background=background)

    def restore(self, path: Path) -> dict[str, Any]:
        """Load checkpoint `path` (same layout) into the running trainer and return its metadata.

        Model, optimizer, scheduler, RNG, step and data position are restored; callback states are *not* (each
        callback that wants its saved state reads `meta["x_<state_key>"]`). Called from pre_optim_step, it drops
        the current step: no update, no post_step, the loop continues after the restored step.
        """
        meta = self._load(path, same_layout=True)
        self._restored = True
        return meta

    def _load(self, path: Path, same_layout: bool) -> dict[str, Any]:
        with progress.within("load"):
            meta = self.checkpointer.load(path, self.model, self.optimizer, same_layout=same_layout)
        # megatron's load_state_dict *adds* the saved step count to the scheduler's own (right only for a fresh
        # one): a restore in a running trainer would otherwise jump the schedule forward, to min_lr
        self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(meta["scheduler"])
        self.step, self.consumed_samples = int(meta["step"]), int(meta["consumed_samples"])
        self.summary["steps"] = self.step
        self.step_log.drop_after(self.step)
        self._prefetch.reset()
        skip_self_copies(self.optimizer)  # a load may have given the optimizer new tensors: check the aliasing again
        self._seek = None
        return meta

    def _resume(self) -> None:
        resumed = None
        if self.cfg.checkpoint.load:
            tokenizer = None if self.components.data is None else self.components.data.tokenizer
            # newest good checkpoint first: a damaged one is moved aside with a warning, a crafted one refused;
            # a config that cannot resume from the chosen one is the user's error (check_compatible raises)
            resumed = self.checkpointer.resume(
                self.model,
                self.optimizer,
                parts.layout_key(self.cfg, self.layout),
                check=lambda p, saved: resume_checks.check_compatible(
                    saved, self.cfg, tokenizer=tokenizer, path=str(p)
                ),
                load=self._load,
            )
        if resumed is not None:
            path, meta, same_layout = resumed.path, resumed.meta, resumed.same_layout
            self._run_first_loss = meta.get("first_loss")  # None from checkpoints written before it was kept
            saved_layout = meta.get("layout")
            log(
                f"resumed from {path} at step {self.step} ({self.consumed_samples} samples)"
                + ("" if same_layout else f"; resharded from {saved_layout}")
            )
            if resume_checks.order_changed(meta.get("data_position"), self.components.train_data):
                log(
                    f"warning: the training data order differs from the checkpoint's at sample {self.consumed_samples} "
                    "(the dataset was rebuilt for more samples than it held, into more epochs): training continues "
                    "on the new order"
                )
            changed = resume_checks.reschedule(self.scheduler, meta, self.cfg)
            if changed:
                log(f"the schedule follows this config from step {self.step + 1} on: {'; '.join(changed)}")
            for cb in self.callbacks:
                if cb.state_key and f"x_{cb.state_key}" in meta:
                    cb.load_state_dict(meta[f"x_{cb.state_key}"])
        elif self.cfg.checkpoint.init_from:
            self._init_from(self.cfg.checkpoint.init_from)
        self.start_step = self.step

    def _init_from(self, source: str) -> None:
        """A fresh run from another run's weights (checkpoint.init_from): the architecture must match; optimizer,
        schedule, data position and RNG start fresh."""
        path, meta = self.checkpointer.load_weights(
            source,
            self.model,
            check=lambda p, saved: resume_checks.check_architecture(
                saved, self.cfg, path=str(p), verb="initialise the model from"
            ),
        )
        # the optimizer's main parameters were copied from the initial weights (bf16 runs): copy the loaded ones
        if hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()
        log(f"initialised the model from {path} (weights of step {meta.get('step')}; optimizer, schedule and data new)")

    # --- megatron's schedule ---------------------------------------------------------------------------------------
    def forward_backward(self, microbatches: list[dict], forward_only: bool) -> torch.Tensor:
        """megatron's forward(-backward) schedule over micro-batches; this rank's mean loss over them, a 0-d float64
        device tensor (zero off the last pipeline stage; step_values.global_losses makes it global)."""
        return _local_loss(self._run_schedule(microbatches, forward_only))

    def _run_schedule(self, microbatches: list[dict], forward_only: bool) -> list[dict]:
        """megatron's schedule over micro-batches: each micro-batch's reported losses (last pipeline stage)."""
        if self._schedule is None:
            from megatron.core.pipeline_parallel import get_forward_backward_func

            # the run's schedule, and (without pipelining) its process groups once: megatron rebuilds the groups'
            # collection per call; the pipelined schedules take it only with a p2p communicator, so they build both
            self._schedule = get_forward_backward_func()
            self._groups = parts.schedule_groups() if self.layout.pp == 1 else None
        iterators = [iter(microbatches) for _ in self.ddp] if len(self.ddp) > 1 else iter(microbatches)
        return self._schedule(
            forward_step_func=_forward_step,
            data_iterator=iterators,
            model=self.ddp if len(self.ddp) > 1 else self.ddp[0],
            num_microbatches=len(microbatches),
            seq_length=self.cfg.train.seq_length,
            micro_batch_size=self.cfg.train.micro_batch_size,
            forward_only=forward_only,
            pg_collection=self._groups,
        )


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _loss_func(loss_mask: torch.Tensor, z_loss: ZLoss | None, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The masked mean cross-entropy of a micro-batch, plus (train.z_loss_coeff) the masked mean z-loss term: the
    back-propagated loss is their sum, "lm loss" the cross-entropy alone, "z loss" the term."""
    losses = output.float()
    mask = loss_mask.to(losses.device).float()
    count = mask.sum().clamp(min=1)
    loss = (losses * mask).sum() / count
    # clone: the schedule divides the returned loss by the number of micro-batches in place
    reported = {"lm loss": loss.detach().clone()}
    z_tokens = None if z_loss is None else z_loss.take()  # [b, s] coeff * lse^2 of this forward
    if z_tokens is not None:
        z = (z_tokens.float() * mask).sum() / count
        reported["z loss"] = z.detach().clone()
        loss = loss + z
    return loss, reported


def _forward_step(data_iterator: Iterator[dict], model: Any) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    if model.config.context_parallel_size > 1:
        # each context-parallel rank keeps its (load-balanced, zigzag) share of every sequence
        from megatron.core import parallel_state
        from megatron.core.utils import get_batch_on_this_cp_rank

        batch = get_batch_on_this_cp_rank(
            {**batch, "cu_seqlens": None}, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group()
        )
        batch.pop("cu_seqlens", None)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # losses [b, s]
    return output, partial(_loss_func, batch["loss_mask"], z_loss_of(model))


def _local_loss(results: list[dict], key: str = "lm loss") -> torch.Tensor:
    """This rank's mean of `key` over its micro-batches on the device (the last pipeline stage has results)."""
    if results:
        return torch.stack([r[key].reshape(()) for r in results]).double().mean()
    return torch.zeros(
        (), dtype=torch.float64, device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    )


def train(
    setup: RunSetup,
    callbacks: Sequence[Callback] | None = None,
    extra_callbacks: Sequence[Callback] = (),
) -> dict[str, Any]:
    """Build the run's components and train them (`callbacks`: default_callbacks(setup), plus `extra_callbacks`;
    all run in priority order)."""
    from megagate.train.callbacks import default_callbacks

    components = parts.build_components(setup)
    chosen = list(default_callbacks(setup) if callbacks is None else callbacks) + list(extra_callbacks)
    return Trainer(components, chosen).fit()
