"""Forward + backward time of one MoE layer: megatron's SequentialMLP experts vs TorchGroupedMLP (torch grouped GEMM).

    .venv/bin/python benchmarks/bench_grouped_experts.py [--tokens 2048] [--experts 8] [--hidden 256] [--ffn 512]
                                                         [--topk 2] [--reps 10] [--dtype fp32|bf16] [--quick]

Both layers are megatron `MoELayer`s of a 1-layer tiny MoE GPT built by megagate (router, allgather dispatcher,
experts), with the same weights (same seed: the two implementations have the same parameter names). Timing:
warm-up steps are not timed; then repetitions alternate the two layers (sequential, grouped, sequential, ...) so a
machine that gets busier affects both alike. Reported: median and min of fwd+bwd per layer, the ratio of medians,
and the max abs difference of the outputs (the two must compute the same function). No assertions: this prints
figures (tests/model/test_grouped_experts.py runs `--quick`).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

QUICK = dict(tokens=256, experts=4, hidden=64, ffn=64, topk=2, reps=2)


def _layer(grouped: bool, args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    from megagate.model import gate as gates
    from megagate.model.presets import model_preset
    from megagate.model_factory import build_model
    from megagate.run_config import DataSection, PerfSection, TrainConfig, TrainSection
    from megagate.run_setup import resolve

    mc = model_preset(
        "tiny-moe",
        gate=gates.preset("baseline"),
        num_layers=1,
        hidden_size=args.hidden,
        head_dim=args.hidden // 4,
        num_experts=args.experts,
        moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.ffn,
    )
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    cfg = TrainConfig(
        model=mc,
        train=TrainSection(precision=precision),
        data=DataSection(mock=True),
        perf=PerfSection(moe_grouped_gemm=grouped),
        seed=0,
    )
    (model,) = build_model(resolve(cfg, None))  # initialised layout-independently (seed 0)
    return model.decoder.layers[0].mlp.to(dtype)  # the MoELayer: router, dispatcher, experts


def _step(layer: torch.nn.Module, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    """One forward + backward; (seconds, output)."""
    layer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    out, _ = layer(x)
    out.float().square().mean().backward()
    return time.perf_counter() - start, out.detach()


def run(args: argparse.Namespace) -> dict[str, float]:
    """Time both layers; returns the figures it prints."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    layers = {"sequential": _layer(False, args, dtype), "grouped": _layer(True, args, dtype)}
    x = torch.randn(args.tokens, 1, args.hidden, generator=torch.Generator().manual_seed(1)).to(dtype)  # [s, b, h]
    outputs = {}
    for name, layer in layers.items():  # warm-up, untimed
        for _ in range(2):
            _, outputs[name] = _step(layer, x)
    times: dict[str, list[float]] = {name: [] for name in layers}
    for _ in range(args.reps):
        for name, layer in layers.items():  # interleaved
            times[name].append(_step(layer, x)[0])
    seq, grp = statistics.median(times["sequential"]), statistics.median(times["grouped"])
    diff = (outputs["grouped"].float() - outputs["sequential"].float()).abs().max().item()
    print(
        f"MoE layer fwd+bwd: {args.tokens} tokens, {args.experts} experts top-{args.topk}, hidden {args.hidden}, "
        f"ffn {args.ffn}, {args.dtype}, {args.reps} interleaved reps, torch threads {torch.get_num_threads()}"
    )
    for name in layers:
        print(
            f"  {name:<10} median {1e3 * statistics.median(times[name]):8.2f} ms   min {1e3 * min(times[name]):8.2f} ms"
        )
    print(f"  grouped / sequential (medians): {grp / seq:.3f}")
    print(f"  max abs output difference: {diff:.3g}")
    return {"sequential_s": seq, "grouped_s": grp, "ratio": grp / seq, "max_abs_diff": diff}


def main(argv: list[str] | None = None) -> int:
    """Parse the options and run in a one-process megatron world (the caller's, if one is set up)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--quick", action="store_true", help="a few-second run with small sizes (for the tests)")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    from megatron.core import parallel_state

    from megagate.distributed import parallel

    world = contextlib.nullcontext() if parallel_state.model_parallel_is_initialized() else parallel.single_process()
    with world:
        run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
