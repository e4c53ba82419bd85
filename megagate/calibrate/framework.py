"""The trainer's own overheads on this machine, and how fast its kernels run inside its steps: steps of megagate's
trainer (megatron's schedule, DDP, the distributed optimizer, mock data) on tiny models, where the kernels' work is
small next to the framework's, and on four 1-layer models whose work dominates their steps.

Variants (1 process): a dense baseline of 1 and 2 layers, a G1-gated and two MoE models (2 and 4 local experts) of 1
layer, tiny; one model whose work is mostly GEMMs (hidden 256, 256 tokens per micro-batch, a 256 vocabulary), one
mostly attention (one sequence of 512), one mostly the loss (a 4096 vocabulary), one of two experts; each stepped
with 1 and 2 micro-batches. With G, A and R the modelled device seconds of the GEMMs, of attention and of the
memory-bound rest (the planner's own estimate with the measured kernel curves and no overheads), the step is

    step = gemm_scale x G + attention_scale x A + work_scale x R + per_step + L x per_layer_step
           + M x (per_microbatch + L x (per_layer [+ gate] [+ moe + E x per_expert]))

which the eighteen timings determine by a non-negative least-squares fit. The scales are what the kernels' curves,
measured alone with their operands hot in cache, miss inside a step (on a CPU the kernels run between the
framework's other work, on operands it evicted, and the loss's softmax is exp-bound rather than bytes-bound): the
tiny variants fix the overheads, the larger ones the scales. On a GPU the host runs ahead of the device (the step is
not this sum), so there the scales stay 1 and the overheads are fitted to the step minus the modelled work.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {
    "dense-1": {"num_layers": 1},
    "dense-2": {"num_layers": 2},
    "work-gemm-1": {"num_layers": 1, "work": "gemm"},
    "work-attention-1": {"num_layers": 1, "work": "attention"},
    "work-loss-1": {"num_layers": 1, "work": "loss"},
    "work-moe2-1": {"num_layers": 1, "num_experts": 2, "work": "moe"},
    "gate-1": {"num_layers": 1, "gate": "g1-elementwise"},
    "moe2-1": {"num_layers": 1, "num_experts": 2},
    "moe4-1": {"num_layers": 1, "num_experts": 4},
}


def config(
    out_dir: str,
    variant: dict[str, Any],
    precision: str,
    core_attention: str,
    micro_batches: int = 1,
    environment: bool = True,
):
    """The TrainConfig of a tiny calibration model (mock data, no checkpoints; `environment`: checked against this
    machine, as the trainer needs)."""
    from megagate import config_reader

    experts = variant.get("num_experts", 0)
    # (sequence, micro-batch, vocabulary, model fields) of the tiny variants and of the four whose work dominates:
    # one of GEMMs, one of attention, one of the loss (and the output layer), one of experts
    seq, micro_batch, vocab, shape = {
        None: (16, 1, 128, {}),
        "gemm": (32, 8, 256, {"hidden_size": 256, "head_dim": 64, "ffn_hidden_size": 768}),
        "attention": (512, 1, 128, {}),
        "loss": (64, 4, 4096, {}),
        "moe": (128, 2, 1024, {"hidden_size": 128, "head_dim": 32, "moe_ffn_hidden_size": 128}),
    }[variant.get("work")]
    model: dict[str, Any] = {
        "preset": "tiny-moe" if experts else "tiny",
        "num_layers": variant["num_layers"],
        "vocab_size": vocab,
        "max_sequence_length": seq,
        "gate": {"preset": variant.get("gate", "baseline")},
        **shape,
    }
    if experts:
        model.update(num_experts=experts, moe_router_topk=1, moe_router_norm_topk=False)  # top-1: pre-softmax
    raw = {
        "model": model,
        "train": {
            "micro_batch_size": micro_batch,
            "global_batch_size": micro_batch * micro_batches,
            "seq_length": seq,
            "train_steps": 1_000_000,
            "precision": precision,
        },
        "data": {"mock": True},
        "checkpoint": {"interval": 0},
        "logging": {"tensorboard": False},
        "perf": {"core_attention": core_attention},
        "output": {"dir": out_dir},
    }
    return config_reader.from_dict(raw, environment=environment)


def time_variants(precision: str, core_attention: str, until: float, reps: int = 15) -> dict[str, dict[int, float]]:
    """{variant: {micro-batches: step seconds}} of the trainer's step (data fetch included, as `megagate train`
    times it), the variants interleaved so that load changes touch them alike. Each figure is the median of its
    repetitions, the statistic a trainer's logged step time has (`megagate train`'s median step): a few steps the
    scheduler interrupts cannot move it. (The lower quartile, used before, planned every step 4-30 % short on a quiet
    machine: its steps vary that much between repetitions.)"""
    from megatron.core import parallel_state

    from megagate.run_setup import resolve
    from megagate.train import components
    from megagate.train.trainer import Trainer

    runs: dict[str, tuple[Callable[[int], float]]] = {}
    with tempfile.TemporaryDirectory() as out:
        for name, variant in VARIANTS.items():
            if len(runs) >= 2 and time.perf_counter() > until:
                break  # out of time: the dense pair is the minimum, the rest are refinements
            cfg = config(f"{out}/{name}", variant, precision, core_attention)
            parallel_state.destroy_model_parallel()
            parts = components.build_components(resolve(cfg, 1))
            trainer = Trainer(parts, callbacks=[])
            data = components.loader(cfg, parts.train_data, 0)

            def step(m: int, trainer=trainer, data=data) -> float:
                start = time.perf_counter()
                trainer.train_step([next(data) for _ in range(m)], start)
                return time.perf_counter() - start

            step(1), step(2)  # warm-up: the allocator, autograd's caches
            runs[name] = (step,)
        times: dict[str, dict[int, list[float]]] = {n: {1: [], 2: []} for n in runs}
        for r in range(reps):
            if r >= 2 and time.perf_counter() > until:
                break
            for name, (step,) in runs.items():
                for m in (1, 2):
                    times[name][m].append(step(m))
    return {n: {m: statistics.median(v) for m, v in by_m.items()} for n, by_m in times.items()}


SCALES = ("gemm_scale", "attention_scale", "work_scale")  # the order of a variant's modelled seconds


def solve(
    measured: dict[str, dict[int, float]],
    modelled: dict[str, dict[int, tuple[float, ...]]],
    fit_scale: bool = True,
) -> tuple[dict, list[str]]:
    """The Host fields and the SCALES from the timings and the modelled device seconds of the GEMMs, attention and
    the rest (see the module docstring): a non-negative least-squares fit (relative errors), and notes on what came
    out 0. `fit_scale` False (a GPU): the scales are 1 and the overheads are fitted to the timings minus the
    modelled work."""
    from megagate.plan.curves import nonnegative_least_squares

    names = [
        "per_step",
        "per_layer_step",
        "per_microbatch",
        "per_layer",
        "per_layer_gate",
        "per_layer_moe",
        "per_expert",
    ]
    missing = [n for n in VARIANTS if n not in measured]
    scale_notes = []
    if fit_scale and any("work" in VARIANTS[n] for n in missing):
        # the scales need every work-dominated variant (each pins one): without them the curves stand as measured
        fit_scale = False
        scale_notes.append("out of time before the work-dominated variants: the in-step scales are 1")
    rows, seconds = [], []
    for name, by_m in measured.items():
        v = VARIANTS[name]
        layers, gate, experts = v["num_layers"], float("gate" in v), v.get("num_experts", 0)
        for m, t in by_m.items():
            row = [1, layers, m, m * layers, m * layers * gate, m * layers * bool(experts), m * layers * experts]
            work = list(modelled[name][m])
            if fit_scale:
                rows.append([*work, *row])
                seconds.append(t)
            elif t > sum(work):  # else the model alone exceeds the measurement: nothing to learn from it
                rows.append(row)
                seconds.append(t - sum(work))
    scales = dict.fromkeys(SCALES, 1.0)
    if not rows:  # the modelled work alone exceeds every timing (a machine too busy to measure): no overheads
        return {**dict.fromkeys(names, 0.0), **scales}, [
            "host overheads not measured: the modelled work exceeds every timing"
        ]
    # a column no measured variant exercises (out of time before it) is left out of the solve, not made singular
    used = [j for j in range(len(rows[0])) if any(r[j] for r in rows)]
    fitted, _ = nonnegative_least_squares([[r[j] for j in used] for r in rows], seconds)
    coef = [0.0] * len(rows[0])
    for j, v in zip(used, fitted):
        coef[j] = v
    notes = scale_notes
    if fit_scale:
        for key in SCALES:
            scales[key] = coef.pop(0)
            if scales[key] <= 0:  # its larger variant was not measured, or noise: the curves stand as measured
                scales[key] = 1.0
                notes.append(f"{key} not measured (no step where that work dominates): 1")
    values = dict(zip(names, coef))
    notes += [f"host {k} fitted as 0 (noise, or nothing to measure)" for k, v in values.items() if v == 0]
    if missing:
        notes.append(f"out of time before the {', '.join(missing)} variants: their overheads are 0")
    return {**values, **scales}, notes
