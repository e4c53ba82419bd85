"""The trainer's side of megagate.monitor: spike actions, fault injection, live diagnostics.

Config section `monitor`:

    monitor:
      spike: {action: warn|skip|rollback|lr_backoff|abort, threshold: 8, ...}   # megagate.monitor.spike
      diagnostics: {interval: 50}                                           # every N steps on a fixed probe batch
      faults: [{step: 30, kind: scale_loss, factor: 10}]                     # test hooks (megagate.monitor.faults)

The loop asks `decide()` once per step, after the gradients and their global norm are ready and before the
update, so `skip` can drop an update and `rollback` can restore a checkpoint before anything is applied.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from megagate.errors import ConfigError
from megagate.monitor import diagnostics, runfiles
from megagate.monitor.events import EventLog
from megagate.monitor.faults import FaultInjector
from megagate.monitor.spike import SpikeMonitor, SpikeMonitorConfig, worst_action

SECTIONS = ("spike", "diagnostics", "faults")


class MonitorHook:
    """Spike monitor + faults + diagnostics for one run; every rank runs it and takes the same decisions."""

    def __init__(self, section: dict, run_dir: str, logging_rank: bool) -> None:
        unknown = sorted(set(section) - set(SECTIONS))
        if unknown:
            raise ConfigError(f"monitor.{unknown[0]} is not a monitor section; sections: {', '.join(SECTIONS)}")
        spike_cfg = SpikeMonitorConfig.from_dict(section.get("spike"))
        self.spike: Optional[SpikeMonitor] = SpikeMonitor(spike_cfg) if spike_cfg.enabled else None
        self.faults = FaultInjector.from_config(section.get("faults"))
        diag = dict(section.get("diagnostics") or {})
        self.diag_interval = int(diag.pop("interval", 0))
        if diag:
            raise ConfigError(f"monitor.diagnostics.{sorted(diag)[0]} is not known; allowed: interval")
        self.run_dir, self.logging_rank = run_dir, logging_rank
        self.events: Optional[EventLog] = None
        self.writer: Any = None
        self.probe: Optional[dict] = None
        self.aborted = False

    # --- lifecycle ------------------------------------------------------------------------------------------------
    def start(self, run: Any, metrics: Any) -> None:
        self.writer = metrics.writer
        if self.logging_rank:
            self.events = EventLog(os.path.join(self.run_dir, "events.jsonl"), self.writer)
        self.load_state(run.extra_state)
        if self.diag_interval:
            from megagate.train.loop import loader

            self.probe = next(loader(run.cfg, run.valid_data, 0))  # a fixed batch: comparable across steps and runs

    def state(self) -> dict:
        """Extra checkpoint entries (keys start with x_ so the loop carries them)."""
        state: dict[str, Any] = {"x_faults": self.faults.state_dict()}
        if self.spike is not None:
            state["x_monitor"] = self.spike.state_dict()
        return state

    def load_state(self, extra: dict) -> None:
        if self.spike is not None and "x_monitor" in extra:
            self.spike.load_state_dict(extra["x_monitor"])
        if "x_faults" in extra:
            self.faults.load_state_dict(extra["x_faults"])

    # --- per step -------------------------------------------------------------------------------------------------
    def batch_index(self, step: int) -> int:
        """The (1-based) batch that `step` trains on: rollbacks skip windows of data."""
        return self.spike.data_index(step) if self.spike is not None else step

    def before_step(self, run: Any, step: int, microbatches: list[dict]) -> list[dict]:
        vocab = run.cfg.model.vocab_size
        return [{**mb, "tokens": self.faults.batch(step, mb["tokens"], vocab)} for mb in microbatches]

    def after_backward(self, run: Any, step: int) -> None:
        params = [p for chunk in run.model for p in chunk.parameters()]
        self.faults.grads(step, params)

    def decide(self, run: Any, step: int, loss: float, grad_norm: float) -> Optional[str]:
        """The spike action for this step (None: apply the update normally); sets this update's LR."""
        loss = self.faults.loss(step, loss)
        action = None
        if self.spike is not None:
            events = self.spike.observe(step, {"loss": loss, "grad_norm": grad_norm})
            if events and self.events is not None:
                self.events.write(events)
            action = worst_action(events)
        scale = self.faults.lr_scale(step) * (self.spike.lr_scale(step) if self.spike is not None else 1.0)
        if scale != 1.0:
            for group in run.optimizer.param_groups:
                group["lr"] *= scale
        return action

    def after_step(self, run: Any, step: int) -> None:
        if not self.diag_interval or step % self.diag_interval:
            return
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            return  # the probe forward needs the whole model on this rank (PP=1)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        diags = diagnostics.collect(run.model[0], self.probe["tokens"].to(device), self.probe["position_ids"].to(device))
        if self.logging_rank:
            if self.writer is not None:
                diagnostics.log_to_tensorboard(self.writer, step, diags)
            for record in diagnostics.records(step, diags):
                runfiles.append_jsonl(os.path.join(self.run_dir, "diagnostics.jsonl"), record)
