"""What the stability instrument costs per step: `megagate train` with the monitors off, at the defaults, and with
every probe on, in paired rounds on the same config.

    .venv/bin/python benchmarks/bench_monitor_overhead.py [--shape tiny] [--rounds 3] [--windows 10]
                                                          [--interval 10] [--probe-every 50] [--clock wall|cpu]

Arms (examples/tiny_cpu.yaml + bench_loop_overhead's overrides of the shape; evaluation off, no checkpoint but
the final one), run in an order rotating every round:

  off       monitor.spike.enabled=false: no spike monitor, no SpikeScore (what the loop costs without them);
  default   the defaults: the spike monitor in warn mode with the SpikeScore of loss and grad norm beside it;
  all       the defaults + monitor.diagnostics.interval=PROBE_EVERY: gate scores, F-Attn, Sink^0.3_1, M-Act, max
            logit, log Z and each layer's update ratio on the probe batch every PROBE_EVERY steps.

Timing: megagate's own step_time per logging window (`--clock wall`: wall clock, data loading included,
evaluations and saves left out; a probe runs inside its step, so it is counted), or the main thread's CPU time per
window (`--clock cpu`, bench_loop_overhead's worker: much less moved by other processes on a shared machine; the
monitors run on the main thread, so it counts all of their work). Reported: each arm's median window, and the paired ratios
default / off and all / default per round (median and min..max). The load average is printed: on a shared machine
read the spread. No assertions: this prints figures; the closing note of issue 39 and docs/monitoring.md keep them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_loop_overhead import SHAPES, child_env, run_megagate, run_overrides  # noqa: E402

ARMS = ("off", "default", "all")


def arm_overrides(arm: str, probe_every: int) -> list[str]:
    if arm == "off":
        return ["monitor.spike.enabled=false"]
    if arm == "all":
        return [f"monitor.diagnostics.interval={probe_every}"]
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tiny", choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interval", type=int, default=10, help="steps per timed window (the logging interval)")
    parser.add_argument("--windows", type=int, default=10, help="timed windows per process")
    parser.add_argument("--warmup", type=int, default=1, help="windows per process not counted")
    parser.add_argument("--probe-every", type=int, default=50, help="monitor.diagnostics.interval of the 'all' arm")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--data-dir", default=str(REPO / "runs" / "demo-data"))
    args = parser.parse_args()
    if min(args.rounds, args.interval, args.windows, args.probe_every) < 1 or args.warmup < 0:
        parser.error("--rounds, --interval, --windows and --probe-every must be >= 1, --warmup >= 0")
    from megagate.data.demo import prepare_demo_data

    prepare_demo_data(args.data_dir, 2048, 1_500_000)
    steps = args.interval * (args.warmup + args.windows)
    load = os.getloadavg()
    print(
        f"{args.shape}: {args.rounds} rounds x {len(ARMS)} arms; {args.windows} windows of {args.interval} steps after "
        f"{args.warmup} warm-up; probes every {args.probe_every} steps in 'all'; {args.clock} clock; "
        f"load {load[0]:.2f} {load[1]:.2f}",
        flush=True,
    )
    medians: dict[str, list[float]] = {arm: [] for arm in ARMS}
    env = child_env(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ARMS[r % 3 :] + ARMS[: r % 3]
            for arm in order:
                out = os.path.join(tmp, f"{arm}-{r}")
                over = run_overrides(args.shape, steps, args.interval, out, args.data_dir)
                windows = run_megagate([*over, *arm_overrides(arm, args.probe_every)], out, env, args.clock)
                medians[arm].append(statistics.median(windows[args.warmup :]))
            print(
                "  round " + str(r + 1) + ": " + ", ".join(f"{a} {medians[a][-1] * 1e3:.2f} ms/step" for a in ARMS),
                flush=True,
            )
    load = os.getloadavg()
    print(f"\nload average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    for arm in ARMS:
        print(f"{arm:8s} {statistics.median(medians[arm]) * 1e3:8.2f} ms/step")
    for num, den in (("default", "off"), ("all", "default")):
        ratios = [a / b for a, b in zip(medians[num], medians[den])]
        print(f"{num} / {den}: {statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
