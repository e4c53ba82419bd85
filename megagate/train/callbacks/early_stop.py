"""`monitor.early_stop` in the trainer: end a run at a step boundary once its outcome is decided, with the reason.

The rule is megagate.monitor.early_stop's (pure); this callback feeds it each step's global loss and whether the
spike monitor flagged that loss, reads the control file at every step boundary, and ends a decided run with
`trainer.stop(reason, final=True)`: the checkpoint and every log are kept, summary.json says why (`stopped`,
`early_stop`), and the process exits 0. A rerun of a run that was decided early does not train on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megagate.console import log
from megagate.monitor import runfiles
from megagate.monitor.early_stop import EarlyStopConfig, EarlyStopRule, StopDecision
from megagate.train.callbacks.base import Callback, StepOutput, TrainerView


def read_control(path: str) -> str | None:
    """The stop reason a control file asks for (`{"stop": "why"}`), else None (absent, being written, or no stop)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None  # not there (yet), or caught mid-write by a writer that does not rename: next step
    reason = data.get("stop") if isinstance(data, dict) else None
    return str(reason) if reason else None


class EarlyStopping(Callback):
    """After SpikeMonitoring (whose loss events it counts: the step's "spike:loss" flag), before LiveDiagnostics (no
    probe of a stopped run)."""

    priority = 65
    state_key = "early_stop"

    def __init__(self, config: EarlyStopConfig, warmup_steps: int) -> None:
        self.config = config
        self.rule = EarlyStopRule(config, warmup_steps)
        self.decision: StopDecision | None = None

    def on_start(self, trainer: TrainerView) -> None:
        previous = runfiles.read_json(Path(trainer.cfg.output.dir) / runfiles.SUMMARY) or {}
        early = previous.get("early_stop")
        if isinstance(early, dict) and previous.get("steps") == trainer.step and trainer.step:
            # decided at this checkpoint already: stay decided (a plain stop writes no new summary)
            trainer.record_summary("early_stop", early)  # summary.json stays as the decision wrote it (no final stop)
            trainer.stop(f"already decided: {early.get('reason')}")

    def on_step_start(self, trainer: TrainerView, step: int) -> None:
        if self.config.control_file and trainer.stop_reason is None:
            reason = read_control(self.config.control_file)
            if reason is not None:  # every rank reads the same file: the same decision on every rank
                self._decide(trainer, StopDecision("control", step - 1, f"stopped from outside: {reason}"))

    def post_step(self, trainer: TrainerView, output: StepOutput) -> None:
        if trainer.stop_reason is not None:
            return
        decision = self.rule.observe(output.step, output.loss, loss_spike="spike:loss" in output.flags)
        if decision is not None:
            self._decide(trainer, decision)

    def _decide(self, trainer: TrainerView, decision: StopDecision) -> None:
        self.decision = decision
        trainer.record_summary("early_stop", decision.to_dict())
        trainer.stop(decision.reason, final=True)
        log(f"early stop at step {decision.step} ({decision.rule}): {decision.reason}")

    def state_dict(self) -> dict[str, Any]:
        return self.rule.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rule.load_state_dict(state)


__all__ = ["EarlyStopping", "read_control"]
