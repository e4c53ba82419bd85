"""megagate.monitor in the trainer: the spike monitor and its actions, fault injection, live diagnostics.

The spike monitor callback owns every action: `skip` vetoes the update, `lr_backoff` scales the LR of the
updates in its window, `rollback` restores the latest checkpoint and moves the data past the dropped window,
`abort` vetoes the update and stops the run with an error (the final checkpoint and summary.json are written by
the Checkpointing and RunSummary callbacks). It decides in pre_optim_step, once the global loss and gradient norm
are known and before anything is applied: one host read per step. With `warn`, which decides nothing, it reads
nothing itself: it judges each step when the trainer reads the step's values anyway (a logging step, a checkpoint,
the end of the run), so its events may be written a few steps after their step (with their own step numbers).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megagate import checkpoint as ckpt
from megagate.console import log, warn
from megagate.distributed.utils import get_rank, host_name
from megagate.monitor import diagnostics, process_faults, runfiles, update_stats
from megagate.monitor.events import EventLog
from megagate.monitor.faults import Fault, FaultInjector
from megagate.monitor.spike import SpikeAbort, SpikeMonitor, SpikeMonitorConfig, worst_action
from megagate.monitor.spike_score import SpikeScores
from megagate.train import components as parts
from megagate.train.callbacks.base import Callback, StepOutput, TrainerView, Update

SAMPLE_STEPS_KEPT = 10_000  # steps whose batch positions are kept for the events (more than any logging interval)


class SpikeMonitoring(Callback):
    """`monitor.spike`: detection on the global loss and grad norm, events.jsonl, and the configured action; beside
    it the SpikeScore of both (megagate.monitor.spike_score: TensorBoard `spike_score/...` at logging steps,
    summary.json `spike_score`), judged on the same values."""

    priority = 70
    state_key = "monitor"
    DECIDING = ("skip", "rollback", "lr_backoff", "abort")  # actions that change the update: judged before it

    def __init__(self, config: SpikeMonitorConfig, flag_steps: bool = False) -> None:
        self.monitor = SpikeMonitor(config)
        self.scores = SpikeScores(("loss", "grad_norm"))
        self.samples: dict[int, tuple[int, int]] = {}  # step -> its batch's [first, end) sample positions (recent)
        self.events: EventLog | None = None
        # judged before the update (one host read per step): an action that decides, or a callback after this one
        # that needs each step's flags as it trains (EarlyStopping counts the loss spikes)
        self.deciding = config.action in self.DECIDING or flag_steps
        self._trainer: TrainerView | None = None  # where the events' count goes (record_summary)

    def on_start(self, trainer: TrainerView) -> None:
        if trainer.logging_rank:
            self.events = EventLog(Path(trainer.cfg.output.dir) / runfiles.EVENTS, trainer.record_metric)
        trainer.record_summary("spikes", self.monitor.num_events)
        self._trainer = trainer
        if not self.deciding:
            trainer.step_log.subscribe(self._observe_read)  # judged as the trainer reads the steps

    def _observe_read(self, read: list) -> None:
        for step, values in read:
            seen = {"loss": values.seen_loss, "grad_norm": values.grad_norm}
            self.scores.observe(seen)
            self._record(self.monitor.observe(step, seen))

    def _record(self, events: list) -> None:
        if events and self.events is not None:
            self.events.write(events, self.samples)
        if self._trainer is not None:
            self._trainer.record_summary("spikes", self.monitor.num_events)

    def on_step_start(self, trainer: TrainerView, step: int) -> None:
        # Rollbacks drop windows of batches (numbered by the step that reads them in an uninterrupted run). The data
        # position already holds the windows that began before this step (a checkpoint's position includes them;
        # a rollback restores one from before its window); a window that begins now moves it forward. Relative to
        # the position, not step x batch size, which a resume with a new global batch size changes.
        before = self.monitor.data_index(step - 1) - (step - 1)
        dropped = self.monitor.data_index(step) - step - before
        batch = trainer.cfg.train.global_batch_size
        if dropped:
            trainer.seek(trainer.consumed_samples + dropped * batch)
        first = trainer.consumed_samples + dropped * batch
        self.samples[step] = (first, first + batch)
        while len(self.samples) > SAMPLE_STEPS_KEPT:  # warn mode judges the steps read since the last logging step
            del self.samples[next(iter(self.samples))]

    def pre_optim_step(self, trainer: TrainerView, update: Update) -> None:
        if not self.deciding:
            return
        step = update.step
        seen = {"loss": update.loss, "grad_norm": update.grad_norm}  # the step's read
        self.scores.observe(seen)
        events = self.monitor.observe(step, seen)
        for event in events:  # EarlyStopping counts the loss spikes (StepOutput.flags)
            update.flag(f"spike:{event.metric}")
        self._record(events)
        update.scale_lr(self.monitor.lr_scale(step))  # 1 outside a backoff window
        action = worst_action(events)
        if action == "skip":
            update.skip()
        elif action == "rollback":
            self._rollback(trainer, step)
        elif action == "abort":
            update.skip()
            trainer.stop(
                "aborted by the spike monitor",
                SpikeAbort(
                    f"training aborted by the spike monitor at step {step} (loss {update.loss:.4g}, grad norm "
                    f"{update.grad_norm:.4g}); checkpoint saved in {trainer.checkpointer.root}"
                ),
            )

    def post_step(self, trainer: TrainerView, output: StepOutput) -> None:
        # at logging steps, where the values were read anyway (MetricsLogger reads them first: warn mode judged them)
        if output.step % trainer.cfg.logging.interval == 0:
            self._log_scores(output.step)

    def on_end(self, trainer: TrainerView) -> None:
        self._log_scores(trainer.step)

    def _log_scores(self, step: int) -> None:
        if self._trainer is not None:
            self._trainer.record_summary("spike_score", self.scores.summary())
            if self._trainer.logging_rank:
                self._trainer.record_metric(step, self.scores.scalars())

    def _rollback(self, trainer: TrainerView, step: int) -> None:
        path = trainer.latest_checkpoint()
        if path is None:
            raise SpikeAbort(
                f"spike at step {step} asks for a rollback, but {trainer.checkpointer.root} has no checkpoint"
            )
        plan = self.monitor.rollback_plan(step, int(ckpt.read_meta(path)["step"]))
        meta = trainer.restore(path)
        saved = meta.get(f"x_{self.state_key}") or SpikeMonitor(self.monitor.config).state_dict()
        self.monitor.restore_after_rollback(saved, plan, step)
        log(
            f"rollback: spike at step {step}; restored step {plan.restore_step} from {path}; "
            f"dropping batches {plan.skip_first}-{plan.skip_last}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {**self.monitor.state_dict(), "spike_score": self.scores.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.monitor.load_state_dict(state)
        self.scores.load_state_dict(state.get("spike_score", {}))  # absent in checkpoints from before it


class FaultInjection(Callback):
    """`monitor.faults`: corrupt a step's batch, poison a gradient, scale the loss the monitor sees, or the LR; and
    the cluster faults (a hang, a slow rank, a failed save or load on one rank: megagate.monitor.process_faults),
    armed here already because a load fault acts during the resume, before on_start.

    Before SpikeMonitoring: the loss it scales is the one the monitor judges (LR factors multiply in this order).
    """

    priority = 80
    state_key = "faults"

    def __init__(self, faults: Sequence[Fault], run_dir: str | None = None) -> None:
        self.injector = FaultInjector(faults)
        if run_dir is not None:
            process_faults.arm(faults, run_dir, get_rank(), host_name())

    def on_close(self, trainer: TrainerView) -> None:
        process_faults.disarm()

    def pre_step(self, trainer: TrainerView, step: int, microbatches: list[dict]) -> list[dict]:
        return self.injector.batches(step, microbatches, trainer.cfg.model.vocab_size)

    def post_backward(self, trainer: TrainerView, step: int) -> None:
        self.injector.grads(step, [p for chunk in trainer.components.model for p in chunk.parameters()])

    def pre_optim_step(self, trainer: TrainerView, update: Update) -> None:
        factor = self.injector.loss_factor(update.step)
        if factor != 1.0:
            update.scale_loss(factor)  # no host read: the callbacks after it read the scaled value if they judge
        update.scale_lr(self.injector.lr_scale(update.step))

    def state_dict(self) -> dict[str, Any]:
        return self.injector.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.injector.load_state_dict(state)


class LiveDiagnostics(Callback):
    """`monitor.diagnostics.interval`: the paper's Table-4 statistics and Gu et al.'s Sink^eps_1 on a fixed probe batch
    (the first validation micro-batch: comparable across steps and runs) to diagnostics.jsonl and TensorBoard
    (`diag/...`), and the spike precursors of the same step to precursors.jsonl and TensorBoard (`precursor/...`):
    each layer's update RMS / weight RMS (megagate.monitor.update_stats), the max attention logit and the output
    layer's log Z (mean, max) on the probe."""

    priority = 60

    def __init__(
        self, interval: int, sink_epsilon: float = 0.3, sink_length: int | None = None, update_ratio: bool = True
    ) -> None:
        self.interval = interval
        self.sink = {"sink_epsilon": sink_epsilon, "sink_length": sink_length or diagnostics.SINK_LENGTH}
        self.want_ratio = update_ratio
        self.ratio: update_stats.UpdateRatio | None = None
        self.probe: dict | None = None

    def on_start(self, trainer: TrainerView) -> None:
        self.probe = next(parts.loader(trainer.cfg, trainer.components.valid_data, 0))
        if self.want_ratio and update_stats.supported(trainer.components.model):
            self.ratio = update_stats.UpdateRatio(trainer.cfg.model.num_layers)
        elif self.want_ratio:
            warn("monitor.diagnostics: no update ratio with DDP's overlap_param_gather (weights gather in the forward)")

    def pre_optim_step(self, trainer: TrainerView, update: Update) -> None:
        if self.ratio is not None and update.step % self.interval == 0:
            self.ratio.snapshot(trainer.components.model)

    def post_step(self, trainer: TrainerView, output: StepOutput) -> None:
        if output.step % self.interval:
            return
        record: dict[str, Any] = {"step": output.step}
        if self.ratio is not None:  # every model-parallel rank: a collective
            ratios = self.ratio.measure(trainer.components.model, *update_stats.model_parallel_group())
            record.update(update_ratio=ratios, update_ratio_max=max(ratios.values(), default=math.nan))
        if trainer.stop_reason is not None:
            return
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            return  # the probe forward needs the whole model on this rank (PP=1)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        diags, out = diagnostics.collect_with_output(
            trainer.components.model[0],
            self.probe["tokens"].to(device),
            self.probe["position_ids"].to(device),
            **self.sink,
        )
        record.update(max_logit=max((d.max_logit for d in diags), default=math.nan), **out)
        scalars = diagnostics.to_scalars(diags)
        # summary.json: the last probe in the literature's units beside megagate's (F-Attn) and the precursors
        trainer.record_summary(
            "diagnostics",
            {
                "step": output.step,
                **{k: scalars.get(f"diag/{k}") for k in ("f_attn", "sink", "m_act", "gate_score")},
                **{k: v for k, v in record.items() if k not in ("step", "update_ratio")},
            },
        )
        if trainer.logging_rank:
            run_dir = trainer.cfg.output.dir
            # the gate scores' histograms go to TensorBoard only
            trainer.record_metric(output.step, {**precursor_scalars(record), **diagnostics.to_metrics(diags)})
            for line in diagnostics.records(output.step, diags):
                runfiles.append_jsonl(os.path.join(run_dir, runfiles.DIAGNOSTICS), line)
            runfiles.append_jsonl(os.path.join(run_dir, runfiles.PRECURSORS), record)


def precursor_scalars(record: dict[str, Any]) -> dict[str, float]:
    """TensorBoard tags of a precursors.jsonl record: `precursor/update_ratio` (max over layers),
    `precursor/layer_03/update_ratio`, `precursor/other/update_ratio`, `precursor/max_logit`, `precursor/log_z_*`."""
    out = {f"precursor/{k}": record[k] for k in ("max_logit", "log_z_mean", "log_z_max") if k in record}
    if "update_ratio" in record:
        out["precursor/update_ratio"] = record["update_ratio_max"]
        for name, value in record["update_ratio"].items():
            tag = name if name == update_stats.OTHER else f"layer_{int(name):02d}"
            out[f"precursor/{tag}/update_ratio"] = value
    return out
