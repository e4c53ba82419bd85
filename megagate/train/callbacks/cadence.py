"""When to evaluate, checkpoint and stop: validation, checkpoint interval / final / stop saves, stop conditions."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from megagate.console import log
from megagate.health import progress
from megagate.run_config import TrainConfig
from megagate.train import components as parts
from megagate.train.callbacks.base import VALID_LOSS, Callback, StepOutput, TrainerView
from megagate.train.signals import StopConditions
from megagate.train.step_values import read_global_losses


def evaluate(trainer: TrainerView) -> float:
    """Mean validation loss over train.eval_iters global batches (the same batches every time); one host read."""
    start = time.perf_counter()
    cfg = trainer.cfg
    data = parts.loader(cfg, trainer.components.valid_data, 0)
    for chunk in trainer.components.model:
        chunk.eval()
    losses = []
    with torch.no_grad(), progress.within("evaluation"):
        for _ in range(cfg.train.eval_iters):
            batches = [next(data) for _ in range(trainer.components.layout.num_microbatches)]
            losses.append(trainer.forward_backward(batches, forward_only=True))
    for chunk in trainer.components.model:
        chunk.train()
    values = read_global_losses(trainer.reads, losses)
    trainer.side_time += time.perf_counter() - start  # not training time (MetricsLogger's step_time)
    return sum(values) / len(values)


class Evaluation(Callback):
    """Validation every train.eval_interval steps (not at the last: the end of a completed run evaluates).

    Before Checkpointing: a checkpoint holds the state after an evaluation of the same step (the validation loader
    draws from the RNG). At the end the final state is checkpointed first (unless a checkpoint of it was just
    saved), so a failing final validation loses nothing.
    """

    priority = 30

    def __init__(self) -> None:
        self.saved_step: int | None = None

    def post_step(self, trainer: TrainerView, output: StepOutput) -> None:
        t = trainer.cfg.train
        if (
            t.eval_interval
            and output.step % t.eval_interval == 0
            and output.step < t.train_steps
            and trainer.stop_reason is None
        ):
            self._evaluate(trainer)

    def post_checkpoint_saved(self, trainer: TrainerView, path: Path, step: int) -> None:
        self.saved_step = step

    def on_end(self, trainer: TrainerView) -> None:
        if trainer.completed:
            # the final checkpoint first (unless checkpoint.save_final=false): the validation cannot lose it
            if trainer.cfg.checkpoint.save_final and self.saved_step != trainer.step:
                trainer.save_checkpoint()
            self._evaluate(trainer)

    def _evaluate(self, trainer: TrainerView) -> None:
        loss = evaluate(trainer)
        trainer.record_summary("final_valid_loss", loss)
        trainer.record_metric(trainer.step, {VALID_LOSS: loss})


def asynchronous(cfg: TrainConfig) -> bool:
    """checkpoint.async_save, resolved: None means asynchronous with CUDA, synchronous on CPU."""
    value = cfg.checkpoint.async_save
    return torch.cuda.is_available() if value is None else value


class Checkpointing(Callback):
    """A checkpoint every checkpoint.interval steps and at the end of every launch that trained (completed, stopped
    by a signal or the wall-time limit, or aborted by a callback), so a rerun of the same command resumes; none at
    the end with checkpoint.save_final=false."""

    priority = 20

    def __init__(self) -> None:
        self.saved_step: int | None = None

    def post_checkpoint_saved(self, trainer: TrainerView, path: Path, step: int) -> None:
        self.saved_step = step  # a save asked for by anyone (Evaluation's final one, a callback's)

    def post_step(self, trainer: TrainerView, output: StepOutput) -> None:
        trainer.checkpointer.poll()  # a background save becomes a checkpoint once every rank wrote its shards
        interval = trainer.cfg.checkpoint.interval
        # a stopping run saves once, in on_end
        if (
            interval
            and output.step % interval == 0
            and output.step < trainer.cfg.train.train_steps
            and trainer.stop_reason is None
        ):
            trainer.save_checkpoint(background=asynchronous(trainer.cfg))

    def on_close(self, trainer: TrainerView) -> None:
        # on_end did not run (an exception is leaving the loop): no collective, the previous checkpoint stays
        trainer.checkpointer.abort()

    def on_end(self, trainer: TrainerView) -> None:
        with progress.within("save"):
            trainer.checkpointer.wait()  # the final or stop checkpoint, the lock and a requeue wait for it
        # trainer.step == start_step: the latest checkpoint already holds this state (or no step ran)
        wanted = trainer.cfg.checkpoint.save_final and trainer.step > trainer.start_step
        if wanted and self.saved_step != trainer.step:
            trainer.save_checkpoint()
        if (trainer.stop_final or "early_stop" in trainer.summary) and trainer.error is None:
            log(f"stopped at step {trainer.step}: {trainer.stop_reason}; the run is over (summary.json says why)")
        elif trainer.stop_reason is not None and trainer.error is None:
            if self.saved_step == trainer.step:
                saved = "checkpoint saved"
            elif not trainer.cfg.checkpoint.save_final:
                saved = "no checkpoint at the end (checkpoint.save_final=false)"
            elif trainer.step == 0:
                saved = "no step was trained, nothing to save"
            else:
                saved = f"no step was trained in this launch, the checkpoint of step {trainer.step} holds this state"
            log(f"stopped at step {trainer.step} ({trainer.stop_reason}); {saved}; resume by running the same command")


class StopChecks(Callback):
    """Stops before a step on SIGTERM/SIGUSR1/SIGINT (any rank), near train.wall_time_limit, or after
    train.exit_after_steps steps of this launch; all ranks agree (megagate.train.signals: with several ranks, one
    step after the signal, without a blocking collective per step). First of all."""

    priority = 100

    def __init__(self) -> None:
        self.conditions: StopConditions | None = None
        self.step_time = 0.0  # host seconds of the last step

    def on_start(self, trainer: TrainerView) -> None:
        self.conditions = StopConditions(trainer.cfg.train.wall_time_limit)

    def on_step_start(self, trainer: TrainerView, step: int) -> None:
        limit = trainer.cfg.train.exit_after_steps
        if self.conditions.should_stop(self.step_time):
            trainer.stop(self.conditions.reason)
        elif limit is not None and trainer.step - trainer.start_step >= limit:
            trainer.stop(f"exit_after_steps={limit}")

    def post_step(self, trainer: TrainerView, output: StepOutput) -> None:
        self.step_time = output.step_time

    def on_close(self, trainer: TrainerView) -> None:
        if self.conditions is not None:
            self.conditions.close()
