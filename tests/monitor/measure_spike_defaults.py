"""Reproduces the measurements of docs/monitoring.md §1.2 with the real trainer: 16 clean curves of `megagate train`
(examples/tiny_cpu.yaml at seq 64 x batch 8, 200 steps, the default monitor in warn mode), {baseline, G1 elementwise}
x LR {1e-3, 3e-3, 1e-2, 3e-2} x seeds {1234, 1}, then the spike monitor replayed over them, clean and with faults
injected at fixed steps.

    .venv/bin/python tests/monitor/measure_spike_defaults.py [OUT_DIR]      (about 6 minutes on 2 cores)

The runs go through helpers.trainer_jobs (forked children, two at a time); OUT_DIR (default /tmp/megagate-spike-defaults) keeps
them, so a second call only replays.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers package

from helpers import trainer_jobs  # noqa: E402
from megagate.monitor.spike import SpikeMonitor, SpikeMonitorConfig, robust_baseline  # noqa: E402

STEPS, FAULT_STEPS = 200, (50, 100, 150, 190)
PRESETS, LRS, SEEDS = ("g1-elementwise", "baseline"), (0.001, 0.003, 0.01, 0.03), (1234, 1)
FAULTS = {
    "loss x10": ("loss", 10.0),
    "nan": ("grad_norm", math.nan),
    "grad-norm x50": ("grad_norm", 50.0),
    "grad-norm x20": ("grad_norm", 20.0),
    "grad-norm x10": ("grad_norm", 10.0),
    "loss x1.5": ("loss", 1.5),
}


class Base:
    """What trainer_jobs needs of pytest's tmp_path_factory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def getbasetemp(self) -> Path:
        return self.root


def curves(out: Path) -> dict[str, dict[str, list[float]]]:
    base = Base(out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = {
        f"{p}|lr {lr:g}|seed {s}": [
            *trainer_jobs.TINY,
            f"train.train_steps={STEPS}",
            "logging.tensorboard=false",
            f"model.gate.preset={p}",
            f"train.lr={lr}",
            f"seed={s}",
        ]
        for p in PRESETS
        for lr in LRS
        for s in SEEDS
    }
    runs = trainer_jobs.run_jobs(base, trainer_jobs.demo_data(base), jobs, timeout=7200)
    found = {}
    for name, run in runs.items():
        assert run.rc == 0, f"{name}: {run.log[-2000:]}"
        records = run.train_records()
        found[name] = {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records]}
        print(
            f"{name}: loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}, max grad norm "
            f"{max(found[name]['grad_norm']):.3f} ({run.seconds:.0f} s)",
            flush=True,
        )
    return found


def replay(curve: dict[str, list[float]], at: int = 0, metric: str = "", factor: float = 1.0) -> list:
    monitor, events = SpikeMonitor(SpikeMonitorConfig(action="skip")), []
    for step, (loss, gn) in enumerate(zip(curve["loss"], curve["grad_norm"]), start=1):
        values = {"loss": loss, "grad_norm": gn}
        if step == at:
            values[metric] = math.nan if math.isnan(factor) else values[metric] * factor
        events += monitor.observe(step, values)
    return events


def main(out: Path) -> None:
    found = curves(out)
    natural = {name: replay(curve) for name, curve in found.items()}
    print("events on the clean curves at the defaults:", sum(map(len, natural.values())))
    for name, events in natural.items():
        for e in events:
            print(
                f"  {name}: step {e.step} {e.metric} {e.value:.3g} = {e.value / e.baseline:.1f} x its baseline "
                f"{e.baseline:.3g}, z {e.score:.1f}"
            )
    for kind, (metric, factor) in FAULTS.items():
        trials = exact = extra = clean_trials = clean_exact = 0
        for name, curve in found.items():
            for at in FAULT_STEPS:
                steps = {e.step for e in replay(curve, at, metric, factor)}
                trials, exact, extra = trials + 1, exact + (steps == {at}), extra + len(steps - {at})
                if not natural[name]:
                    clean_trials, clean_exact = clean_trials + 1, clean_exact + (steps == {at})
        print(
            f"{kind:14s} at steps {FAULT_STEPS}: {exact}/{trials} exactly that step ({extra} events at other "
            f"steps); on the curves without a natural event {clean_exact}/{clean_trials}"
        )
    for metric, log in (("loss", False), ("grad_norm", True)):
        best = (-math.inf, "", 0)
        for name, curve in found.items():
            xs = [math.log(v) if log else v for v in curve[metric]]
            for i in range(20, len(xs)):  # after min_history, against the monitor's own baseline
                center, scale = robust_baseline(xs[max(0, i - 100) : i], 0.01, absolute_floor=log)
                best = max(best, ((xs[i] - center) / scale, name, i + 1))
        print(f"largest clean robust z, {'log ' if log else ''}{metric}: {best[0]:.2f} ({best[1]}, step {best[2]})")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/megagate-spike-defaults"))
