"""Run files and console: training metrics (TensorBoard, metrics.jsonl, console line), config.yaml, summary.json."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from megagate.console import log
from megagate.files import write_atomic
from megagate.model.counts import flops_per_token
from megagate.monitor import runfiles, tensorboard
from megagate.monitor.tensorboard import Metric
from megagate.train.callbacks.base import VALID_LOSS, Callback, StepOutput, TrainerView
from megagate.train.metric_writer import Metrics
from megagate.train.step_values import stacked

MOE_LOSS_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


class MetricsLogger(Callback):
    """Writes config.yaml, then a train line every logging.interval steps, the last step of the run and the step
    a callback stopped it at. Owns the TensorBoard writer (`writer`, None when off): the other callbacks' metrics
    reach it through `trainer.record_metric` and its `log_metrics` (they never hold the writer). It starts first.

    Values are read on the host at those steps only (one read for every step since the last one); `step_time` is
    the wall time since the last line per step, evaluations and checkpoint saves left out (on a GPU, what the
    queue running ahead of the host really took: the read waits for it), and the MoE losses are means over the
    same steps (megatron's tracker accumulates them on the device meanwhile).
    """

    priority = 90

    def __init__(self) -> None:
        self.metrics: Metrics | None = None
        self._since: tuple[int, float, float] | None = None  # (step, perf_counter, trainer.side_time) at the last line
        self._moe_steps = 0  # steps in megatron's MoE tracker since its last report

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
            trainer.components.layout.world_size,
            resumed_at=trainer.step,
            precision=t.precision,
        )

    def on_step_start(self, trainer: TrainerView, step: int) -> None:
        if self._since is None or step <= self._since[0]:
            # the first step, or one replayed after a restore: time (and MoE values) from here
            self._since = (step - 1, time.perf_counter(), trainer.side_time)
            if self._moe_steps:
                _moe_tracker().clear()
                self._moe_steps = 0

    def post_step(self, trainer: TrainerView, output: StepOutput) -> None:
        cfg = trainer.cfg
        step = output.step
        self._moe_steps += 1
        if step % cfg.logging.interval and step != cfg.train.train_steps and trainer.stop_reason is None:
            return
        extra = {"skipped": float(not output.applied)}
        if cfg.model.is_moe:
            extra.update(moe_metrics(trainer, step, self._moe_steps))  # a collective; resets megatron's tracker
            self._moe_steps = 0
        loss, grad_norm = output.loss, output.grad_norm  # one read of every pending step (every rank: collective)
        if cfg.train.z_loss_coeff:
            # train/loss stays the cross-entropy; the z-loss term and the objective back-propagated beside it
            z_loss = output.values.z_loss
            extra.update(z_loss=z_loss, loss_with_z_loss=loss + z_loss)
        first, start, side = self._since
        now = time.perf_counter()
        step_time = (now - start - (trainer.side_time - side)) / max(step - first, 1)
        self.metrics.train_step(step, loss, output.lr, grad_norm, step_time, extra)
        self._since = (step, now, trainer.side_time)  # writing this line counts in the next interval

    def validation(self, step: int, loss: float) -> None:
        """A validation line (console, JSONL, TensorBoard)."""
        if self.metrics is not None:
            self.metrics.validation(step, loss)

    def log_metrics(self, trainer: TrainerView, step: int, metrics: Mapping[str, Metric]) -> None:
        """What the callbacks record (`trainer.record_metric`): VALID_LOSS is the validation line; the rest go to
        TensorBoard (`monitor.tensorboard.write`: scalars, texts, histograms; nothing without TensorBoard)."""
        if VALID_LOSS in metrics:
            self.validation(step, float(metrics[VALID_LOSS]))
        if self.writer is not None:
            tensorboard.write(self.writer, step, {k: v for k, v in metrics.items() if k != VALID_LOSS})

    def on_close(self, trainer: TrainerView) -> None:
        if self.metrics is not None:
            self.metrics.close()


def _moe_tracker() -> Any:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return get_moe_metrics_tracker()


def moe_metrics(trainer: TrainerView, step: int, steps: int = 1) -> dict[str, float]:
    """The MoE load-balancing and z-loss of the last `steps` steps (means over layers, micro-batches and those
    steps), and megatron's tracker reset; a collective call, one host read."""
    model = trainer.cfg.model
    names = [MOE_LOSS_NAMES[model.moe_load_balancing]] + (["z_loss"] if model.moe_z_loss_coeff else [])
    totals: dict[str, Any] = {}
    _moe_tracker().report(
        loss_scale=1.0 / (trainer.components.layout.num_microbatches * steps),
        iteration=step,
        track_names=names,
        force_initialize=True,
        num_layers=model.num_layers,
        moe_layer_freq=1,
        total_loss_dict=totals,
    )
    if not totals:
        return {}
    keys = list(totals)
    values = trainer.reads.read(stacked([torch.as_tensor(totals[k]) for k in keys]))
    return {f"moe_{name}": value for name, value in zip(keys, values)}


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
