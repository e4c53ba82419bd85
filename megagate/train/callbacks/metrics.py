"""Run files and console: training metrics (TensorBoard, metrics.jsonl, console line), config.yaml, summary.json."""

from __future__ import annotations

import math
import os
from typing import Any

from megagate.console import log
from megagate.files import write_atomic
from megagate.model.counts import flops_per_token
from megagate.monitor import runfiles
from megagate.train.callbacks.base import Callback, StepOutput, TrainerView
from megagate.train.metric_writer import Metrics

MOE_LOSS_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


class MetricsLogger(Callback):
    """Writes config.yaml, then a train line every logging.interval steps, the last step of the run and the step
    a callback stopped it at. Owns the TensorBoard writer other callbacks log to (`writer`, None when off), so it
    starts before them."""

    priority = 90

    def __init__(self) -> None:
        self.metrics: Metrics | None = None

    @property
    def writer(self) -> Any:
        return None if self.metrics is None else self.metrics.writer

    def on_start(self, trainer: TrainerView) -> None:
        cfg, t = trainer.cfg, trainer.cfg.train
        if trainer.logging_rank:
            os.makedirs(cfg.output.dir, exist_ok=True)
            write_atomic(os.path.join(cfg.output.dir, runfiles.CONFIG), _yaml(cfg.raw))
            if trainer.step:  # resumed: what a killed launch logged after the checkpoint is logged again now
                dropped = runfiles.truncate_after(cfg.output.dir, trainer.step)
                if dropped:
                    log(f"dropped {dropped} records after step {trainer.step} that the resumed steps log again")
        self.metrics = Metrics(
            cfg.output.dir,
            trainer.logging_rank,
            cfg.logging.tensorboard,
            t.train_steps,
            t.global_batch_size * t.seq_length,
            flops_per_token(cfg.model, t.seq_length),
            trainer.layout.world_size,
            resumed_at=trainer.step,
            precision=t.precision,
        )

    def post_step(self, trainer: TrainerView, output: StepOutput) -> None:
        cfg = trainer.cfg
        extra = {"skipped": float(not output.applied)}
        if cfg.model.is_moe:
            extra.update(moe_metrics(trainer, output.step))  # collective, and resets megatron's tracker: every step
        step = output.step
        if step % cfg.logging.interval == 0 or step == cfg.train.train_steps or trainer.stop_reason is not None:
            self.metrics.train_step(step, output.loss, output.lr, output.grad_norm, output.step_time, extra)

    def validation(self, step: int, loss: float) -> None:
        """A validation line (console, JSONL, TensorBoard)."""
        if self.metrics is not None:
            self.metrics.validation(step, loss)

    def on_close(self, trainer: TrainerView) -> None:
        if self.metrics is not None:
            self.metrics.close()


def moe_metrics(trainer: TrainerView, step: int) -> dict[str, float]:
    """This step's MoE load-balancing and z-loss (averaged over layers and micro-batches); a collective call."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    model = trainer.cfg.model
    names = [MOE_LOSS_NAMES[model.moe_load_balancing]] + (["z_loss"] if model.moe_z_loss_coeff else [])
    totals: dict[str, Any] = {}
    get_moe_metrics_tracker().report(
        loss_scale=1.0 / trainer.layout.num_microbatches,
        iteration=step,
        track_names=names,
        force_initialize=True,
        num_layers=model.num_layers,
        moe_layer_freq=1,
        total_loss_dict=totals,
    )
    return {f"moe_{name}": float(value) for name, value in totals.items()}


class RunSummary(Callback):
    """summary.json at the end of a run that completed, that a callback aborted (diverged, `aborted: true`), or
    that a callback decided early (`trainer.stop(..., final=True)`: `stopped` holds the reason).

    A paused run (signal, wall time, exit_after_steps) writes none: it is not over. Entries that callbacks put
    into `trainer.summary` besides the standard ones (e.g. `spikes`) are written too.
    """

    priority = 10  # last: it reports the final validation and what the other callbacks put in the summary
    STANDARD = ("steps", "final_loss", "final_valid_loss", "stopped")

    def on_end(self, trainer: TrainerView) -> None:
        paused = trainer.stop_reason is not None and trainer.error is None and not trainer.stop_final
        if not trainer.logging_rank or paused:
            return
        s = trainer.summary
        extra = {k: v for k, v in s.items() if k not in self.STANDARD}
        if trainer.stop_final:
            extra["stopped"] = trainer.stop_reason
        last = s["final_loss"] if s["final_loss"] is not None else math.nan
        if trainer.error is not None:
            runfiles.write_summary(trainer.cfg.output.dir, trainer.step, last, None, True, aborted=True, **extra)
        else:
            runfiles.write_summary(
                trainer.cfg.output.dir,
                trainer.step,
                last,
                s["final_valid_loss"],
                runfiles.is_diverged(trainer.first_loss, s["final_loss"]),
                **extra,
            )


def _yaml(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)
