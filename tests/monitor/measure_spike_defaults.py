"""Reproduces the measurements of docs/monitoring.md §1.2 (≈ 2 minutes): 16 clean tiny-GPT curves, then the
monitor replayed over them clean and with faults injected at fixed steps.  Usage: python measure_spike_defaults.py"""
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers package
from helpers import tiny_train as tt

from megagate.distributed import parallel
from megagate.monitor.spike import SpikeMonitor, SpikeMonitorConfig

CURVES = "/tmp/megagate_clean_curves.json"
out = {}
with parallel.single_process():
    for preset in ("g1-elementwise", "baseline"):
        for lr in (1e-3, 3e-3, 1e-2, 3e-2):
            for seed in (0, 1):
                t = time.time()
                r = tt.train(300, lr=lr, preset=preset, seed=seed)
                key = f"{preset}|{lr}|{seed}"
                out[key] = {"loss": r.losses, "grad_norm": r.grad_norms}
                print(key, f"{time.time()-t:.1f}s", r.losses[0], r.losses[-1], max(r.grad_norms), flush=True)
json.dump(out, open(CURVES, "w"))

# ---- replay ----
curves = json.load(open(CURVES))
worst = {"loss": -1e9, "grad_norm": -1e9}
nev = 0
det = []
for k, c in curves.items():
    m = SpikeMonitor(SpikeMonitorConfig())
    for i, (l, g) in enumerate(zip(c["loss"], c["grad_norm"]), 1):
        ev = m.observe(i, {"loss": l, "grad_norm": g}); nev += len(ev)
        # track max score via a shadow: recompute
    # injected
    for kind in ("loss10", "nan", "gn50", "gn20", "gn10", "loss1.5"):
        for kstep in (50, 150, 250):
            m = SpikeMonitor(SpikeMonitorConfig(action="skip"))
            evs = []
            for i, (l, g) in enumerate(zip(c["loss"], c["grad_norm"]), 1):
                if i == kstep:
                    if kind == "loss10": l = l * 10
                    if kind == "loss1.5": l = l * 1.5
                    if kind == "nan": g = float("nan")
                    if kind.startswith("gn"): g = g * float(kind[2:])
                evs += m.observe(i, {"loss": l, "grad_norm": g})
            det.append((kind, k, kstep, [(e.step, e.metric, round(e.score, 1) if e.score is not None else None) for e in evs]))
print("clean events:", nev)
from collections import defaultdict

summ = defaultdict(lambda: [0, 0, 0])
for kind, k, ks, evs in det:
    steps = {e[0] for e in evs}
    s = summ[kind]
    s[0] += 1
    s[1] += steps == {ks}
    s[2] += len(steps - {ks})
    if steps != {ks}: print("MISS/extra", kind, k, ks, evs)
for kind, s in summ.items(): print(kind, "trials", s[0], "exact", s[1], "extra-steps", s[2])

# ---- largest robust z on the clean curves (the monitor's own baseline, grad norm in log space) ----
from megagate.monitor.spike import robust_baseline  # noqa: E402

for metric, log in (("loss", False), ("grad_norm", True)):
    best = -1e9
    for c in curves.values():
        xs = [math.log(v) if log else v for v in c[metric]]
        for i in range(20, len(xs)):
            center, scale = robust_baseline(xs[max(0, i - 100):i], 0.01, absolute_floor=log)
            best = max(best, (xs[i] - center) / scale)
    print(f"largest clean robust z, {metric}: {best:.2f}")
