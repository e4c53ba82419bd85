"""MoE router health in the trainer (megagate.monitor.router): tokens per expert, dead experts, the imbalance's
spread across layers and the router entropy, per window of logging.interval steps, to TensorBoard (`router/...`)
and summary.json (`router`: the last window and the dead experts over the whole run)."""

from __future__ import annotations

import torch

from megagate.monitor import router
from megagate.train.callbacks.base import Callback, StepOutput, TrainerView


class RouterHealth(Callback):
    """On for MoE models. Counting costs a column sum per router call; at logging steps one all-reduce of a
    [layers, experts + 2] tensor over the world and one host read (beside the MoE losses' own)."""

    priority = 57  # after LiveDiagnostics (60), before StragglerReport (55)

    def __init__(self) -> None:
        self.counts: router.RouterCounts | None = None
        self.whole_run: torch.Tensor | None = None

    def on_start(self, trainer: TrainerView) -> None:
        model = trainer.cfg.model
        self.counts = router.RouterCounts(trainer.components.model, model.num_layers, model.num_experts)

    def on_step_start(self, trainer: TrainerView, step: int) -> None:
        # the entropy is measured on the logging steps' micro-batches only (it recomputes the router logits)
        self.counts.entropy_next = step % trainer.cfg.logging.interval == 0

    def post_step(self, trainer: TrainerView, output: StepOutput) -> None:
        if output.step % trainer.cfg.logging.interval == 0:
            self._report(trainer, output.step)

    def on_end(self, trainer: TrainerView) -> None:
        if trainer.error is None:
            self._report(trainer, trainer.step)

    def on_close(self, trainer: TrainerView) -> None:
        if self.counts is not None:
            self.counts.close()

    def _report(self, trainer: TrainerView, step: int) -> None:
        world = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
        sums = self.counts.take(world)
        if not float(sums[:, : router.ENTROPY].sum()):
            return  # no training token since the last report (the end right after a logging step)
        self.whole_run = sums if self.whole_run is None else self.whole_run + sums
        layers = [i for i in range(sums.shape[0]) if float(self.whole_run[i, : router.ENTROPY].sum())]
        stats = router.health(sums, layers)
        whole = router.health(self.whole_run, layers)
        trainer.record_summary(
            "router",
            {"window": stats, "dead_whole_run": {layer: v["dead"] for layer, v in whole["layers"].items()}},
        )
        if trainer.logging_rank:
            trainer.record_metric(step, router.scalars(stats))
