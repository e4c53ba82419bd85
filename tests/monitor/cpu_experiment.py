"""The CPU stability experiment of docs/monitoring.md: tiny gated vs baseline GPT across learning rates.

    .venv/bin/python tests/monitor/cpu_experiment.py OUT_DIR

Trains with the test loop (tiny_train; the project's trainer will replace it), monitor in warn mode, and writes run
directories in the trainer's schema, then `megagate report`-style plots and an analysis of the highest-LR models.
"""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers package

from helpers import tiny_train

from megagate.distributed import parallel  # noqa: E402
from megagate.monitor import analyze, diagnostics, report, runfiles  # noqa: E402
from megagate.monitor.events import EventLog  # noqa: E402
from megagate.monitor.spike import SpikeMonitor  # noqa: E402

STEPS, LRS, VARIANTS, SEEDS = 300, (3e-3, 1e-2, 3e-2, 6e-2), ("baseline", "g1-elementwise"), (0,)


def main(out: Path) -> None:
    probe = tiny_train.batch_at(10_000, 4, 64)[:, :-1]
    with parallel.single_process():
        for variant in VARIANTS:
            for lr in LRS:
                for seed in SEEDS:
                    run_dir = out / "runs" / f"{variant}_lr{lr:g}_s{seed}"
                    run_dir.mkdir(parents=True, exist_ok=True)
                    for f in run_dir.iterdir():
                        f.unlink()
                    runfiles.write_atomic(run_dir / "config.yaml",
                                          f"seed: {seed}\ntrain: {{lr: {lr}}}\nmodel: {{gate: {{preset: {variant}}}}}\n")
                    res = tiny_train.train(STEPS, lr=lr, preset=variant, seed=seed, monitor=SpikeMonitor())
                    for step, (loss, gn) in enumerate(zip(res.losses, res.grad_norms), start=1):
                        runfiles.write_metrics(run_dir, step, "train", loss=loss, lr=lr, grad_norm=gn, tokens_per_s=0.0)
                    EventLog(run_dir / runfiles.EVENTS).write(res.events)
                    diags = diagnostics.collect(res.model, probe, keep_attn_map=True)
                    for rec in diagnostics.records(STEPS, diags):
                        runfiles.append_jsonl(run_dir / runfiles.DIAGNOSTICS, rec)
                    final = sum(res.losses[-20:]) / 20  # mean of the last 20 steps: less batch noise
                    bad = not all(math.isfinite(x) for x in res.losses)
                    runfiles.write_summary(run_dir, STEPS, final, None, runfiles.is_diverged(res.losses[0], final, any_nonfinite=bad))
                    print(f"{variant} lr={lr:g}: final {final:.3f}, events {len(res.events)}", flush=True)
                    if lr == LRS[-1] and seed == SEEDS[0]:
                        table = analyze.analyze_model(res.model, probe, out / f"analysis_{variant}")
                        print(table, flush=True)
    print(report.report([out / "runs"], out / "report"))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
