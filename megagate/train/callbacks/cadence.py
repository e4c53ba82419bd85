"""When to evaluate, checkpoint and stop: validation, checkpoint interval / final / stop saves, stop conditions."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megagate.train import components as parts
from megagate.train.callbacks.base import Callback
from megagate.train.callbacks.metrics import MetricsLogger
from megagate.train.metrics import log
from megagate.train.signals import StopConditions

if TYPE_CHECKING:
    from megagate.train.trainer import StepOutput, Trainer


def evaluate(trainer: Trainer) -> float:
    """Mean validation loss over train.eval_iters global batches (the same batches every time)."""
    cfg = trainer.cfg
    data = parts.loader(cfg, trainer.components.valid_data, 0)
    for chunk in trainer.model:
        chunk.eval()
    losses = []
    with torch.no_grad():
        for _ in range(cfg.train.eval_iters):
            batches = [next(data) for _ in range(trainer.layout.num_microbatches)]
            losses.append(trainer.forward_backward(batches, forward_only=True))
    for chunk in trainer.model:
        chunk.train()
    return sum(losses) / len(losses)


class Evaluation(Callback):
    """Validation every train.eval_interval steps (not at the last: the end of a completed run evaluates)."""

    def __init__(self) -> None:
        self.logger: MetricsLogger | None = None

    def on_start(self, trainer: Trainer) -> None:
        self.logger = trainer.callback(MetricsLogger)

    def post_step(self, trainer: Trainer, output: StepOutput) -> None:
        t = trainer.cfg.train
        if (
            t.eval_interval
            and output.step % t.eval_interval == 0
            and output.step < t.train_steps
            and trainer.stop_reason is None
        ):
            self._evaluate(trainer)

    def on_end(self, trainer: Trainer) -> None:
        if trainer.completed:
            checkpointing = trainer.callback(Checkpointing)
            if checkpointing is not None:  # the final checkpoint first: the validation cannot lose it
                checkpointing.save_final(trainer)
            self._evaluate(trainer)

    def _evaluate(self, trainer: Trainer) -> None:
        loss = evaluate(trainer)
        trainer.summary["final_valid_loss"] = loss
        if self.logger is not None:
            self.logger.validation(trainer.step, loss)


class Checkpointing(Callback):
    """A checkpoint every checkpoint.interval steps and at the end of every launch that trained (completed, stopped
    by a signal or the wall-time limit, or aborted by a callback), so a rerun of the same command resumes."""

    def __init__(self) -> None:
        self.saved_step: int | None = None

    def post_step(self, trainer: Trainer, output: StepOutput) -> None:
        interval = trainer.cfg.checkpoint.interval
        # a stopping run saves once, in on_end
        if (
            interval
            and output.step % interval == 0
            and output.step < trainer.cfg.train.train_steps
            and trainer.stop_reason is None
        ):
            trainer.save_checkpoint()
            self.saved_step = output.step

    def save_final(self, trainer: Trainer) -> None:
        """The end-of-launch checkpoint (once; Evaluation asks for it before the final validation)."""
        # trainer.step == start_step: the latest checkpoint already holds this state (or no step ran)
        if trainer.step > trainer.start_step and self.saved_step != trainer.step:
            trainer.save_checkpoint()
            self.saved_step = trainer.step

    def on_end(self, trainer: Trainer) -> None:
        self.save_final(trainer)
        if (trainer.stop_final or "early_stop" in trainer.summary) and trainer.error is None:
            log(f"stopped at step {trainer.step}: {trainer.stop_reason}; the run is over (summary.json says why)")
        elif trainer.stop_reason is not None and trainer.error is None:
            if self.saved_step == trainer.step:
                saved = "checkpoint saved"
            elif trainer.step == 0:
                saved = "no step was trained, nothing to save"
            else:
                saved = f"no step was trained in this launch, the checkpoint of step {trainer.step} holds this state"
            log(f"stopped at step {trainer.step} ({trainer.stop_reason}); {saved}; resume by running the same command")


class StopChecks(Callback):
    """Stops before a step on SIGTERM/SIGUSR1 (any rank), near train.wall_time_limit, or after
    train.exit_after_steps steps of this launch; all ranks agree (megagate.train.signals)."""

    def __init__(self) -> None:
        self.conditions: StopConditions | None = None
        self.step_time = 0.0

    def on_start(self, trainer: Trainer) -> None:
        self.conditions = StopConditions(trainer.cfg.train.wall_time_limit)

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        limit = trainer.cfg.train.exit_after_steps
        if self.conditions.should_stop(self.step_time):
            trainer.stop(self.conditions.reason)
        elif limit is not None and trainer.step - trainer.start_step >= limit:
            trainer.stop(f"exit_after_steps={limit}")

    def post_step(self, trainer: Trainer, output: StepOutput) -> None:
        self.step_time = output.step_time

    def on_close(self, trainer: Trainer) -> None:
        if self.conditions is not None:
            self.conditions.restore()
