"""Fit the planner's GPU constants on the `fit` half of the published Megatron runs; report the held-out error.

    .venv/bin/python tools/fit_published.py [--fit] [--markdown]

Without --fit it evaluates the constants in megagate/plan/gpu_defaults.py (FITTED) as they are. With --fit it
minimises the mean squared log error of tokens/s per GPU over the `fit` runs of megagate/plan/published_runs.yaml
(Nelder-Mead over the constants named in FREE, the others held at their stated assumptions) and prints the constants
to paste into FITTED. Either way it prints every run (published, predicted, error, fit/held-out), the median and worst
absolute error of each half, and the layout check: for each MoE configuration, the planner's predicted step time of
NVIDIA's layout over the fastest layout it finds for the same model, GPUs, batch and precision. --markdown prints the
tables as docs/planning.md holds them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megagate.plan import published as P  # noqa: E402
from megagate.plan.devices import gpu_spec  # noqa: E402
from megagate.plan.gpu_defaults import FITTED, GpuConstants  # noqa: E402

FREE = (
    "gemm_bf16",
    "gemm_fp8",
    "attention",
    "network",
    "alltoall",
    "moe_sync",
    "grouped_half",
    "overlap",
    "host_microbatch",
)
BOUNDS = {
    "gemm_bf16": (0.3, 0.95),
    "gemm_fp8": (0.2, 0.95),
    "attention": (0.2, 0.9),
    "alltoall": (0.1, 1.0),
    "network": (0.5, 1.0),
    "host_moe": (0.0, 5e-3),
    "moe_sync": (0.0, 5e-3),
    "grouped_half": (0.5, 20.0),
    "overlap": (0.2, 1.0),
    "host_microbatch": (0.0, 10e-3),
    "expert_latency": (0.0, 300e-6),
}


def constants(x: list[float]) -> GpuConstants:
    values = {}
    for name, v in zip(FREE, x):
        lo, hi = BOUNDS[name]
        values[name] = min(hi, max(lo, v))
    return dataclasses.replace(FITTED, **values)


def loss(x: list[float], runs: list[P.Run]) -> float:
    errs = P.errors(runs, constants(x))
    return sum(math.log1p(e) ** 2 for e in errs.values()) / len(errs)


def nelder_mead(f, x0: list[float], steps: list[float], iterations: int = 300) -> list[float]:
    """Minimise f from x0 (a plain Nelder-Mead: reflect, expand, contract, shrink)."""
    n = len(x0)
    simplex = [list(x0)] + [[x0[j] + (steps[i] if j == i else 0.0) for j in range(n)] for i in range(n)]
    values = [f(p) for p in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=lambda i: values[i])
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centroid = [sum(p[j] for p in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]
        reflect = [c + (c - w) for c, w in zip(centroid, worst)]
        fr = f(reflect)
        if fr < values[0]:
            expand = [c + 2 * (c - w) for c, w in zip(centroid, worst)]
            fe = f(expand)
            simplex[-1], values[-1] = (expand, fe) if fe < fr else (reflect, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflect, fr
        else:
            contract = [c + 0.5 * (w - c) for c, w in zip(centroid, worst)]
            fc = f(contract)
            if fc < values[-1]:
                simplex[-1], values[-1] = contract, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (p - b) for b, p in zip(best, q)] for q in simplex[1:]]
                values = [values[0]] + [f(p) for p in simplex[1:]]
    return simplex[min(range(n + 1), key=lambda i: values[i])]


def report(runs: list[P.Run], c: GpuConstants, markdown: bool) -> None:
    errs = P.errors(runs, c)
    if markdown:
        print("| run | GPU | GPUs | precision | layout | published tokens/s/GPU | predicted | error | used for |")
        print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        pred = P.tokens_per_s_per_gpu(r, P.predict(r, c))
        w = r.workload
        pub = f"{r.tokens_per_s_per_gpu:,.0f}" + (" *" if r.derived else "")
        if markdown:
            print(
                f"| {r.id} | {r.gpu} | {w.world} | {w.precision} | {P.describe(w)} mbs{w.micro_batch} gbs{w.global_batch}"
                f" | {pub} | {pred:,.0f} | {errs[r.id]:+.1%} | {r.use} |"
            )
        else:
            print(f"{r.id:46s} {r.use:9s} published {pub:>9s}  predicted {pred:9,.0f}  error {errs[r.id]:+6.1%}")
    for use, s in P.summary(errs, runs).items():
        print(f"{use}: {s['runs']} runs, median |error| {s['median']:.1%}, worst {s['worst']:.1%}")
    if markdown:
        print(
            "\n| MoE configuration (NVIDIA's layout) | its predicted step | its memory estimate | planner's best "
            "layout (of N fitting) | best's step | ratio |"
        )
        print("|---|---|---|---|---|---|")
    for r in P.layout_check_runs(runs):
        best, best_t, n = P.best_layout(r, c)
        own = P.predict(r, c).total
        limit = gpu_spec(r.gpu).memory_bytes
        memory = f"{P.memory_estimate(r.workload, limit) / 1e9:.0f} of {limit / 1e9:.0f} GB"
        line = (P.describe(r.workload), f"{own:.2f} s", P.describe(best), f"{best_t:.2f} s", f"{own / best_t:.3f}")
        if markdown:
            print(f"| {r.id} ({line[0]}) | {line[1]} | {memory} | {line[2]} ({n}) | {line[3]} | {line[4]} |")
        else:
            print(
                f"layout {r.id:44s} NVIDIA {line[0]:22s} {line[1]:>9s}  best of {n:4d}: {line[2]:22s} {line[3]:>9s}  x{line[4]}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="fit the FREE constants on the fit runs first")
    parser.add_argument("--markdown", action="store_true", help="print the tables for docs/planning.md")
    parser.add_argument("--iterations", type=int, default=300)
    args = parser.parse_args()
    runs = P.load_runs()
    c = FITTED
    if args.fit:
        fit_runs = [r for r in runs if r.use == "fit"]
        x0 = [getattr(FITTED, k) for k in FREE]
        steps = [0.1 * (BOUNDS[k][1] - BOUNDS[k][0]) for k in FREE]
        x = nelder_mead(lambda v: loss(v, fit_runs), x0, steps, args.iterations)
        c = constants(x)
        print("fitted: " + ", ".join(f"{k}={getattr(c, k):.4g}" for k in FREE))
    report(runs, c, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
