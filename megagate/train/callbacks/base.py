"""The callback interface of the Trainer (megagate.train.trainer): the hooks, the objects they receive, and what a
callback sees of the trainer (`TrainerView`). Callbacks import this module, never the trainer.

Hooks, in the order the trainer calls them; each hook goes to every callback, highest `priority` first (callbacks
of equal priority in the order they were given):

    on_start(trainer)                          once, after a resume (weights, optimizer, callback states loaded)
    per step:
      on_step_start(trainer, step)             before the step's data is read: trainer.stop(), trainer.seek()
      pre_step(trainer, step, microbatches)    -> the micro-batches to train on (may replace them)
      post_backward(trainer, step)             gradients reduced into the DDP buffers, not yet clipped
      pre_optim_step(trainer, update)          loss and global grad norm computed (on the device: reading
                                               them is a host read), nothing applied yet:
                                               update.skip(), update.scale_lr(f), update.flag(name),
                                               trainer.restore(path)
      post_step(trainer, output)               the step is done (output: StepOutput); not called for a step
                                               that a restore() dropped
    post_checkpoint_saved(trainer, path, step) after every checkpoint (whoever asked for it), on every rank
    on_end(trainer)                            the loop ended: completed, stopped, or aborted by trainer.stop(error)
    on_close(trainer)                          always last, also after an exception: release resources
    log_metrics(trainer, step, metrics)        whenever a callback records metrics (trainer.record_metric), on the
                                               ranks that record them (not a collective): the loggers' end
                                               (MetricsLogger: TensorBoard, the validation line)

Callbacks record what they found through the trainer, never into another callback: `trainer.record_metric(step,
{name: number or text})` for the loggers, `trainer.record_summary(key, value)` for summary.json.

`state_dict()` of a callback with a `state_key` is saved in every checkpoint (as "x_<state_key>" in its
megagate.json, so it must be JSON-serialisable) and handed to `load_state_dict` when a run resumes.
Every rank runs every hook with the same values, so hooks may make collective calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from megagate.monitor.tensorboard import Metric
from megagate.run_config import TrainConfig
from megagate.train.step_values import HostReads, StepLog, StepValues

if TYPE_CHECKING:
    from megagate.checkpoint import Checkpointer
    from megagate.train.components import Components

VALID_LOSS = "valid/loss"  # the metric name of a validation loss: MetricsLogger writes it as the validation line


@dataclass
class Update:
    """This step's update before it is applied (pre_optim_step): callbacks may veto it or scale its LR.

    `loss` and `grad_norm` are the global values (mean over micro-batches and data-parallel ranks; the norm after
    the reduction), what callbacks judge the step by. They stay on the device until first asked for: asking is a
    host read (one per step for both, a collective call, so a callback that asks must ask on every rank), which a
    callback that decides nothing before the update should not make (megagate.train.step_values). A callback may
    scale the loss the callbacks after it see (`scale_loss`: fault injection does); the logged values stay the
    computed ones.
    """

    step: int
    values: StepValues
    lr_scale: float = 1.0
    skipped: bool = False
    flags: set[str] = field(default_factory=set)  # what callbacks found in this step, e.g. "spike:loss"

    def flag(self, name: str) -> None:
        """Mark this step for the callbacks after this one (they see it in StepOutput.flags)."""
        self.flags.add(name)

    @property
    def loss(self) -> float:
        return self.values.seen_loss

    @property
    def grad_norm(self) -> float:
        return self.values.grad_norm

    def scale_loss(self, factor: float) -> None:
        """The callbacks after this one judge the step by its loss x `factor` (no host read)."""
        self.values.scale_seen_loss(factor)

    def skip(self) -> None:
        """Do not apply this update (weights and optimizer state stay as they are; the data moves on)."""
        self.skipped = True

    def scale_lr(self, factor: float) -> None:
        """Multiply this update's LR (from the schedule) by `factor`; factors of several callbacks multiply."""
        self.lr_scale *= factor


@dataclass(frozen=True)
class StepOutput:
    """What post_step callbacks see of a finished step (`loss`, `grad_norm`: read when asked, as on `Update`)."""

    step: int
    values: StepValues  # global mean training loss as computed, global gradient norm before clipping
    lr: float  # the LR of the update (after scale_lr)
    step_time: float  # host seconds of the step, data included (on a GPU the device may still be running it)
    applied: bool  # False: the update was skipped (by a callback, or by the optimizer on non-finite gradients)
    flags: frozenset[str] = frozenset()  # Update.flags: e.g. "spike:loss" when the spike monitor flagged the loss

    @property
    def loss(self) -> float:
        return self.values.loss

    @property
    def grad_norm(self) -> float:
        return self.values.grad_norm


class TrainerView(Protocol):
    """What a callback may read and do of the running Trainer (megagate.train.trainer.Trainer)."""

    cfg: TrainConfig
    components: Components  # this rank's model chunks (unwrapped: `.model`), optimizer, datasets, `.layout`
    checkpointer: Checkpointer
    logging_rank: bool  # this rank writes the run files
    step: int  # completed steps
    start_step: int  # the step this launch began at
    consumed_samples: int  # the data position: global samples before the next step
    stop_reason: str | None
    error: BaseException | None
    summary: Mapping[str, Any]  # read here, written through record_summary
    first_loss: float | None
    reads: HostReads  # the trainer's device-to-host reads (counted)
    step_log: StepLog  # the trained steps' loss and grad norm, on the device until read
    side_time: float  # seconds spent in evaluations and checkpoint saves

    @property
    def completed(self) -> bool: ...

    stop_final: bool  # the stop decided the run (stop(..., final=True)): it is over, not paused

    def stop(self, reason: str, error: BaseException | None = None, *, final: bool = False) -> None: ...

    def seek(self, samples: int) -> None: ...

    def record_metric(self, step: int, metrics: Mapping[str, Metric]) -> None: ...

    def record_summary(self, key: str, value: Any) -> None: ...

    def latest_checkpoint(self) -> Path | None: ...

    def save_checkpoint(self, background: bool = False) -> Path: ...

    def restore(self, path: Path) -> dict[str, Any]: ...

    def forward_backward(self, microbatches: list[dict], forward_only: bool) -> Any: ...  # a 0-d device tensor


class Callback:
    """A no-op for every hook; subclasses override what they need and declare their `priority`."""

    priority: ClassVar[int] = 0  # higher runs earlier in every hook; user callbacks (0) run after the built-ins
    state_key: str = ""  # non-empty: this callback's state_dict() goes into checkpoints

    def on_start(self, trainer: TrainerView) -> None:
        pass

    def on_step_start(self, trainer: TrainerView, step: int) -> None:
        pass

    def pre_step(self, trainer: TrainerView, step: int, microbatches: list[dict]) -> list[dict]:
        return microbatches

    def post_backward(self, trainer: TrainerView, step: int) -> None:
        pass

    def pre_optim_step(self, trainer: TrainerView, update: Update) -> None:
        pass

    def post_step(self, trainer: TrainerView, output: StepOutput) -> None:
        pass

    def post_checkpoint_saved(self, trainer: TrainerView, path: Path, step: int) -> None:
        pass

    def on_end(self, trainer: TrainerView) -> None:
        pass

    def on_close(self, trainer: TrainerView) -> None:
        pass

    def log_metrics(self, trainer: TrainerView, step: int, metrics: Mapping[str, Metric]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def in_priority_order(callbacks: Sequence[Callback]) -> list[Callback]:
    """`callbacks` sorted by priority, highest first (a stable sort: equal priorities keep their order)."""
    return sorted(callbacks, key=lambda cb: -cb.priority)
