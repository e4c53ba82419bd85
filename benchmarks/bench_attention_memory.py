"""Peak memory and time of ONE gated layer's forward+backward, megatron's local attention vs SDPA, against sq.

    .venv/bin/python benchmarks/bench_attention_memory.py [--quick] [--seqs 512 1024 2048 4096] [--reps 3]

The layer is a whole gated TransformerLayer (G1 elementwise, hidden 256, 4 query heads x 64 in 2 KV groups, batch 1,
fp32, CPU) built from `megagate.model.spec.gated_layer_spec` with `core_attention="local"` (megatron's
DotProductAttention: scores and probabilities [b, np, sq, sk] materialised and kept for backward) or `"sdpa"`
(`SDPACoreAttention`, torch's fused kernel).

Memory: the peak *resident set* increase during one forward+backward, measured by the kernel, because torch's CPU
allocator has no statistics (`torch.cuda.max_memory_allocated` has no CPU counterpart, and tracemalloc does not see
torch's allocations). To make RSS track live tensors:
  * glibc's mmap threshold is fixed at 64 KiB (`mallopt(M_MMAP_THRESHOLD)`), so every tensor above 64 KiB is its own
    mmap and a free returns it to the OS at once (the default threshold adapts upwards and would keep freed tensors
    resident);
  * in the full run each kernel is measured in its own fresh process (the layers never share an address space);
    `--quick` measures both in this one process (the CI test calls it in-process: starting megatron takes ~20 s);
  * before each case: megatron's global memory buffer (where the local path's [b·np, sq, sk] scores live) is
    dropped, so each case allocates it as a fresh process would, and `malloc_trim(0)` returns freed small-block
    memory; then the high-water mark is reset (`/proc/self/clear_refs` ← 5) and the current RSS is the baseline;
  * peak = VmHWM after forward+backward − that baseline: every byte allocated and touched during the step
    (activations kept for backward, transient buffers, gradients of the input and the weights), not the weights.
Cases run in increasing sq, after a warm-up step at sq 64 (first-call allocations: thread pools, kernels' tables).

Time: one more process (in `--quick`, the same one) with both layers (same weights, so the outputs are also compared); each repetition runs
local then sdpa at every sq (interleaved, so a machine that gets busier affects both alike); the median is printed.
torch uses one thread (`--threads`): the figures are per core, and stable on a shared machine.

The growth exponent is the least-squares slope of log(value) over log(sq): ~2 for the local path (the [sq, sk]
matrices dominate), ~1 for SDPA (activations linear in sq).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KERNELS = ("local", "sdpa")
FULL_SEQS = (512, 1024, 2048, 4096)
QUICK_SEQS = (64, 128, 256)
WARMUP_SEQ = 64
SHAPE = dict(hidden_size=256, num_attention_heads=4, num_query_groups=2, head_dim=64, ffn_hidden_size=512)


# --- measured in the child processes -------------------------------------------------------------------------------
def _layers(kernels: tuple[str, ...]):
    """One gated TransformerLayer per kernel, with the same weights."""
    import torch
    from megatron.core.transformer.spec_utils import build_module

    from megagate.model import gate as gates
    from megagate.model.build import transformer_config
    from megagate.model.presets import model_preset
    from megagate.model.spec import gated_layer_spec

    model = model_preset("tiny", gate=gates.preset("g1-elementwise"), num_layers=1, **SHAPE)
    config = transformer_config(model)
    layers = {}
    for kernel in kernels:
        spec = gated_layer_spec(config, model.gate, core_attention=kernel)
        layers[kernel] = build_module(spec, config=config, layer_number=1)
    first = layers[kernels[0]]
    for layer in layers.values():
        layer.load_state_dict(first.state_dict())
    return layers, model.hidden_size, torch


def _step(layer, hidden: int, seq: int, torch) -> object:
    """Forward+backward of the layer on [sq, 1, h]; returns the output (detached)."""
    x = torch.randn(seq, 1, hidden, generator=torch.Generator().manual_seed(seq), requires_grad=True)
    out, _ = layer(x, attention_mask=None)
    out.backward(torch.ones_like(out))
    layer.zero_grad(set_to_none=True)
    return out.detach()


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _fresh_megatron_buffer() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_global_memory_buffer()
    parallel_state._set_global_memory_buffer()


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


@contextlib.contextmanager
def _rss_tracks_tensors():
    """glibc serves every allocation above 64 KiB by its own mmap while inside (see the module docstring)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    try:
        yield libc
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # glibc's initial value (its adaptation stays off)


def measure_memory(kernels: tuple[str, ...], seqs: list[int]) -> list[dict]:
    """Peak RSS increase (MiB) of one forward+backward per (kernel, sq), in this process."""
    layers, hidden, torch = _layers(kernels)
    rows = []
    with _rss_tracks_tensors() as libc:
        for kernel in kernels:
            _step(layers[kernel], hidden, WARMUP_SEQ, torch)
            for seq in seqs:
                _fresh_megatron_buffer()
                libc.malloc_trim(0)
                Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
                base = _rss_kib("VmRSS")
                _step(layers[kernel], hidden, seq, torch)
                rows.append({"kernel": kernel, "seq": seq, "peak_mib": (_rss_kib("VmHWM") - base) / 1024})
    return rows


def measure_time(seqs: list[int], reps: int) -> list[dict]:
    """Median forward+backward seconds per (kernel, sq), interleaved; max |output difference| sdpa vs local."""
    layers, hidden, torch = _layers(KERNELS)
    for kernel in KERNELS:
        _step(layers[kernel], hidden, WARMUP_SEQ, torch)
    times = {(k, s): [] for k in KERNELS for s in seqs}
    diff = {}
    for _ in range(reps):
        for seq in seqs:
            outs = {}
            for kernel in KERNELS:
                start = time.perf_counter()
                outs[kernel] = _step(layers[kernel], hidden, seq, torch)
                times[(kernel, seq)].append(time.perf_counter() - start)
            diff[seq] = float((outs["sdpa"] - outs["local"]).abs().max())
    return [
        {"kernel": k, "seq": s, "seconds": statistics.median(times[(k, s)]), "max_abs_diff": diff[s]}
        for k in KERNELS
        for s in seqs
    ]


def _child_main(args: argparse.Namespace) -> None:
    import torch

    from megagate.distributed import parallel

    torch.set_num_threads(args.threads)
    with contextlib.redirect_stdout(sys.stderr), parallel.single_process():
        if args.child == "time":
            rows = measure_time(args.seqs, args.reps)
        else:
            rows = measure_memory((args.child,), args.seqs)
    print(json.dumps(rows))


# --- the parent: runs the children, prints the table ---------------------------------------------------------------
def _run_child(role: str, seqs: list[int], reps: int, threads: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, __file__, "--child", role, "--reps", str(reps), "--threads", str(threads), "--seqs"]
    return subprocess.Popen(
        cmd + [str(s) for s in seqs], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _collect(proc: subprocess.Popen) -> list[dict]:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child failed ({proc.returncode}):\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _in_process(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Both measurements in this process: inside an existing megatron world (a test's), or a fresh one."""
    import torch

    from megagate.distributed import parallel

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        world = contextlib.nullcontext() if torch.distributed.is_initialized() else parallel.single_process()
        with world:
            return measure_memory(KERNELS, args.seqs), measure_time(args.seqs, args.reps)
    finally:
        torch.set_num_threads(threads)


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) over log(x): the growth exponent."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-12)) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"sq {' '.join(map(str, QUICK_SEQS))}, 1 repetition, in this process"
    )
    parser.add_argument("--seqs", type=int, nargs="+", default=None)
    parser.add_argument("--reps", type=int, default=None, help="timing repetitions (default 3; 1 with --quick)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", choices=(*KERNELS, "time"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.seqs is None:
        args.seqs = list(QUICK_SEQS if args.quick else FULL_SEQS)
    args.seqs = sorted(args.seqs)
    if args.reps is None:
        args.reps = 1 if args.quick else 3
    if args.child:
        _child_main(args)
        return 0

    if args.quick:
        memory_rows, time_rows = _in_process(args)
    else:
        # the two memory processes run side by side (RSS is per process); the timing process runs alone afterwards
        memory_procs = [_run_child(kernel, args.seqs, args.reps, args.threads) for kernel in KERNELS]
        memory_rows = [r for p in memory_procs for r in _collect(p)]
        time_rows = _collect(_run_child("time", args.seqs, args.reps, args.threads))
    memory = {(r["kernel"], r["seq"]): r["peak_mib"] for r in memory_rows}
    timing = {(r["kernel"], r["seq"]): r for r in time_rows}

    print(
        f"one gated layer (G1 elementwise, hidden {SHAPE['hidden_size']}, {SHAPE['num_attention_heads']}/"
        f"{SHAPE['num_query_groups']} heads x {SHAPE['head_dim']}, batch 1, fp32, CPU, {args.threads} thread(s)): "
        f"forward+backward"
    )
    header = (
        f"{'sq':>6} | {'local MiB':>10} {'sdpa MiB':>9} {'mem ratio':>9} | "
        f"{'local s':>8} {'sdpa s':>8} {'speed-up':>8} | {'max |Δout|':>10}"
    )
    print(header)
    print("-" * len(header))
    for seq in args.seqs:
        ml, ms = memory[("local", seq)], memory[("sdpa", seq)]
        tl, ts = timing[("local", seq)]["seconds"], timing[("sdpa", seq)]["seconds"]
        print(
            f"{seq:>6} | {ml:>10.1f} {ms:>9.1f} {ml / ms:>8.2f}x | {tl:>8.3f} {ts:>8.3f} {tl / ts:>7.2f}x | "
            f"{timing[('sdpa', seq)]['max_abs_diff']:>10.1e}"
        )
    for what, table in (("peak memory", memory), ("time", {k: v["seconds"] for k, v in timing.items()})):
        exps = {k: slope(args.seqs, [table[(k, s)] for s in args.seqs]) for k in KERNELS}
        print(f"growth exponent of {what} (log-log slope): local {exps['local']:.2f}, sdpa {exps['sdpa']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
