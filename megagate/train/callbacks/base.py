"""The callback interface of the Trainer (megagate.train.trainer).

Hooks, in the order the trainer calls them; each hook goes to every callback in list order:

    on_start(trainer)                          once, after a resume (weights, optimizer, callback states loaded)
    per step:
      on_step_start(trainer, step)             before the step's data is read: trainer.stop(), trainer.seek()
      pre_step(trainer, step, microbatches)    -> the micro-batches to train on (may replace them)
      post_backward(trainer, step)             gradients reduced into the DDP buffers, not yet clipped
      pre_optim_step(trainer, update)          loss and global grad norm known, nothing applied yet:
                                               update.skip(), update.scale_lr(f), trainer.restore(path)
      post_step(trainer, output)               the step is done (output: StepOutput); not called for a step
                                               that a restore() dropped
    on_end(trainer)                            the loop ended: completed, stopped, or aborted by trainer.stop(error)
    on_close(trainer)                          always last, also after an exception: release resources

`state_dict()` of a callback with a `state_key` is saved in every checkpoint (as "x_<state_key>" in its
megagate.json, so it must be JSON-serialisable) and handed to `load_state_dict` when a run resumes.
Every rank runs every hook with the same values, so hooks may make collective calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megagate.train.trainer import StepOutput, Trainer, Update


class Callback:
    """A no-op for every hook; subclasses override what they need."""

    state_key: str = ""  # non-empty: this callback's state_dict() goes into checkpoints

    def on_start(self, trainer: Trainer) -> None:
        pass

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        pass

    def pre_step(self, trainer: Trainer, step: int, microbatches: list[dict]) -> list[dict]:
        return microbatches

    def post_backward(self, trainer: Trainer, step: int) -> None:
        pass

    def pre_optim_step(self, trainer: Trainer, update: Update) -> None:
        pass

    def post_step(self, trainer: Trainer, output: StepOutput) -> None:
        pass

    def on_end(self, trainer: Trainer) -> None:
        pass

    def on_close(self, trainer: Trainer) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
