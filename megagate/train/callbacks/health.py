"""Cluster health in the trainer: the straggler report (the hang watchdog and one-rank failures run beside the
trainer, megagate.health.watchdog).

StragglerReport  every `straggler.interval` steps the logging rank reads every rank's progress record (the watchdog's
                 side channel: files, no collective) and compares each rank's compute time per step with the median
                 of the other ranks of its pipeline stage (megagate.health.straggler); a rank slower by more than
                 `straggler.margin` in `straggler.windows` consecutive windows is reported: a console line, the
                 TensorBoard scalars straggler/* and a `straggler` record in health.jsonl (`megagate report` lists
                 them). A rank the others wait for on many steps, though its fastest step is normal (a stall that
                 comes and goes), is reported by who arrived last and what it cost (megagate.health.arrival:
                 straggler/max_late_slowdown, straggler/latest_rank); a job slower than its own early steps on
                 every rank alike by a `slowdown` line (megagate.health.slowdown). Needs the watchdog's records
                 (`watchdog.enabled`).
"""

from __future__ import annotations

from megagate.console import log
from megagate.health import channel, watchdog
from megagate.health.config import StragglerConfig
from megagate.health.straggler import StragglerDetector
from megagate.train.callbacks.base import Callback, StepOutput, TrainerView


class StragglerReport(Callback):
    """Every `straggler.interval` steps on the logging rank: the slow-rank reports (console, health.jsonl) and their
    figures recorded for the loggers; reads files only, so its place among the step's other callbacks does not
    matter."""

    priority = 55

    def __init__(self, cfg: StragglerConfig) -> None:
        # a window spans at least 3/4 of the interval: records lagging a heartbeat behind shorten a window by a step
        # or two, not to one or two steps (too few for the fastest step to filter a loaded machine's noise)
        self.cfg = cfg
        self.detector = StragglerDetector(
            cfg.margin, cfg.windows, min_steps=-(-3 * cfg.interval // 4), late_share=cfg.late_share
        )

    def post_step(self, trainer: TrainerView, output: StepOutput) -> None:
        dog = watchdog.current()
        if dog is None or not trainer.logging_rank or output.step % self.cfg.interval:
            return
        summary = self.detector.observe(dog.channel.records())
        slowest = summary.slowest
        if slowest is not None:
            trainer.record_metric(
                output.step, {"straggler/max_compute_ratio": slowest[1], "straggler/slowest_rank": slowest[0]}
            )
        costliest = summary.costliest
        if costliest is not None:
            trainer.record_metric(
                output.step, {"straggler/max_late_slowdown": costliest[1], "straggler/latest_rank": costliest[0]}
            )
        slowdown = () if summary.slowdown is None else (summary.slowdown,)
        for report in (*summary.reports, *slowdown):
            log(report.line())
            channel.append_event(trainer.cfg.output.dir, report.to_dict())
            trainer.record_metric(output.step, {f"{report.to_dict()['kind']}/reports": report.line()})
