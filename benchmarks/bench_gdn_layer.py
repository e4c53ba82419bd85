"""Time of ONE layer's forward+backward: a Gated DeltaNet layer against a gated-attention layer, against sq (CPU).

    .venv/bin/python benchmarks/bench_gdn_layer.py [--quick] [--seqs 512 1024 2048 4096] [--reps 3] [--threads 1]

Both are whole TransformerLayers with the same dense SwiGLU MLP, built the way megagate builds a hybrid
(`megagate.model.spec.gated_layer_spec`, then `gdn_layer` for the GDN one): the attention layer is G1 elementwise
over torch's SDPA (hidden 256, 4 query heads x 64 in 2 KV groups); the GDN layer is megatron-core's `GatedDeltaNet`
with Qwen3-Next's proportions (2 key heads x 64, 4 value heads x 64, conv 4), computing with megatron's torch path
(`torch_chunk_gated_delta_rule`, chunk 64) where flash-linear-attention is absent, as here. fp32, batch 1.

Each repetition runs attention then GDN at every sq (interleaved, so a machine that gets busier slows both alike); the
median is printed, with the GDN / attention ratio and each one's growth exponent (least-squares slope of log time
over log sq): attention's core grows as sq² (its projections and MLP as sq), the chunked delta rule as sq, so the
ratio falls as sq grows. torch uses `--threads` threads (default 1: per-core figures, stable on a shared machine).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FULL_SEQS = (512, 1024, 2048, 4096)
QUICK_SEQS = (64, 128)
SHAPE = dict(hidden_size=256, num_attention_heads=4, num_query_groups=2, head_dim=64, ffn_hidden_size=512)
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)


def layers() -> dict[str, object]:
    """{"attention": gated-attention layer, "gdn": Gated DeltaNet layer} (call inside a megatron world)."""
    from megatron.core.transformer.spec_utils import build_module

    from megagate.model import gate as gates
    from megagate.model import init
    from megagate.model.build import transformer_config
    from megagate.model.presets import model_preset
    from megagate.model.spec import gated_layer_spec, gdn_layer

    model = model_preset("tiny", gate=gates.preset("g1-elementwise"), num_layers=2, layer_pattern="*G", **SHAPE, **GDN)
    config = transformer_config(model)
    spec = gated_layer_spec(config, model.gate, core_attention="sdpa")
    built = {
        "attention": build_module(spec, config=config, layer_number=1),
        "gdn": build_module(gdn_layer(spec, "local"), config=config, layer_number=2),
    }
    for index, layer in enumerate(built.values()):
        init.initialize([layer], index, model.init_method_std, model.num_layers)
    return built


def step(layer, seq: int, hidden: int = SHAPE["hidden_size"]) -> float:
    """Seconds of one forward+backward of `layer` on [seq, 1, hidden]; the output is checked finite."""
    import torch

    x = torch.randn(seq, 1, hidden, requires_grad=True)
    start = time.perf_counter()
    out, _ = layer(x, attention_mask=None)
    out.float().pow(2).mean().backward()
    elapsed = time.perf_counter() - start
    if not torch.isfinite(out).all():
        raise AssertionError(f"non-finite output at sq {seq}")
    layer.zero_grad(set_to_none=True)
    return elapsed


def slope(xs: list[float], ys: list[float]) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def run(seqs: tuple[int, ...], reps: int) -> dict[str, dict[int, float]]:
    """Median seconds per kind and sq (after one warm-up step of each at the smallest sq); in the caller's megatron
    world if it has one (the CI test), else in a one-process world of its own."""
    import contextlib

    from megatron.core import parallel_state

    from megagate.distributed.parallel import single_process

    world = contextlib.nullcontext() if parallel_state.model_parallel_is_initialized() else single_process()
    with world:
        built = layers()
        for layer in built.values():
            step(layer, seqs[0])
        times: dict[str, dict[int, list[float]]] = {k: {s: [] for s in seqs} for k in built}
        for _ in range(reps):
            for seq in seqs:
                for kind, layer in built.items():
                    times[kind][seq].append(step(layer, seq))
    return {k: {s: statistics.median(v) for s, v in by_seq.items()} for k, by_seq in times.items()}


def report(medians: dict[str, dict[int, float]]) -> str:
    seqs = sorted(medians["attention"])
    lines = [f"{'sq':>6} {'attention ms':>13} {'GDN ms':>9} {'GDN / attention':>16}"]
    for s in seqs:
        a, g = medians["attention"][s] * 1e3, medians["gdn"][s] * 1e3
        lines.append(f"{s:>6} {a:>13.1f} {g:>9.1f} {g / a:>16.2f}")
    for kind in ("attention", "gdn"):
        lines.append(f"growth exponent {kind}: {slope(seqs, [medians[kind][s] for s in seqs]):.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"sq {QUICK_SEQS}, one repetition (the CI test)")
    parser.add_argument("--seqs", type=int, nargs="+", default=list(FULL_SEQS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    seqs, reps = (QUICK_SEQS, 1) if args.quick else (tuple(sorted(args.seqs)), args.reps)
    from megagate.model.gdn import kernel_name

    print(f"GDN kernels: {kernel_name()}; torch threads {args.threads}; median of {reps}")
    print(report(run(seqs, reps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
