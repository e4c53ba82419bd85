"""A small world of local ranks: collective latency and bandwidth, and each rank's speed when they share the machine.

`measure(ranks, seconds)` spawns `ranks` processes (gloo on CPU; NCCL, one GPU each, when the machine has that many
GPUs), as `torchrun --nproc-per-node` would run them (one thread each on CPU, torchrun's default), and times
all-gather, all-reduce and all-to-all of 4 KiB to 4 MiB per rank, each right after a few milliseconds of compute on
every rank, as the trainer calls them (and, for the record, right after a barrier: `idle_*`); each rank also times a
GEMM and a tiny layer's forward and backward (host-bound) while the others do the same, three times. Rank 0 returns
the medians, and the probes as [repeat][rank] = [FLOP/s, tiny seconds].
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from megagate.calibrate.timing import median_seconds

SIZES = (4096, 65536, 1 << 20, 4 << 20)  # bytes per rank
PROBE_REPEATS = 3  # the side-by-side compute probe: its median over repeats
BURST_S = 3e-3  # the compute before each timed collective (a layer's share of a small CPU step)


def _time(fn, reps: int, barrier, before=None) -> float:
    """The median seconds of `fn` on this rank, each repetition started together after `barrier` (and `before`,
    when given: the same compute on every rank, so the collective starts as the trainer's do)."""
    fn()
    times = []
    for _ in range(reps):
        barrier()
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _burst(dev: torch.device, seconds: float, group_max: Callable[[torch.Tensor], object]) -> Callable[[], None]:
    """A fixed amount of matmul work of about `seconds` on the slowest rank (the count agreed over the ranks): the
    compute a trainer's collective follows. On a CPU, gloo's threads sleep through it and the collective pays
    their wake-up; right after a barrier they are awake and it does not (0.6-0.8 ms against 2-3.5 ms measured)."""
    a, b = torch.randn(128, 256, device=dev), torch.randn(256, 256, device=dev)
    one = median_seconds(lambda: torch.matmul(a, b), samples=5)
    count = torch.tensor([max(1, round(seconds / max(one, 1e-9)))], device=dev)
    group_max(count)
    n = int(count.item())

    def run() -> None:
        for _ in range(n):
            torch.matmul(a, b)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    return run


def compute_probe() -> tuple[float, float]:
    """(FLOP/s of a 256 x 512 x 512 matmul, seconds of a tiny Linear's forward + backward): the two rates whose
    ratio alone / side by side scales a rank's compute and host overhead."""
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    a, b = torch.randn(256, 512, device=dev), torch.randn(512, 512, device=dev)
    layer = torch.nn.Linear(16, 16).to(dev)
    x = torch.randn(4, 16, device=dev)

    def gemm():
        torch.matmul(a, b)

    def tiny():
        layer(x).sum().backward()

    gemm_s = median_seconds(gemm, samples=7)
    tiny_s = median_seconds(tiny, samples=7)
    return 2 * 256 * 512 * 512 / gemm_s, tiny_s


def _worker(rank: int, world: int, init_file: str, result_file: str, reps: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1 for several ranks per node
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    dev = torch.device("cuda", rank) if gpu else torch.device("cpu")
    burst = _burst(dev, BURST_S, lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX))
    results: dict[str, list] = {}
    for key, before in (("", burst), ("idle_", None)):  # after compute (the trainer's case), after a barrier
        for kind in ("all_gather", "all_reduce", "all_to_all"):
            results[key + kind] = []
        for size in SIZES:
            n = size // 4
            x = torch.randn(n, device=dev)
            gathered = [torch.empty_like(x) for _ in range(world)]
            gather = _time(lambda x=x, gathered=gathered: dist.all_gather(gathered, x), reps, dist.barrier, before)
            results[key + "all_gather"].append([size * (world - 1), gather])
            reduce = _time(lambda x=x: dist.all_reduce(x), reps, dist.barrier, before)
            results[key + "all_reduce"].append([2 * size * (world - 1) / world, reduce])
            try:
                y = torch.empty(n * world, device=dev)
                xs = torch.randn(n * world, device=dev)
                seconds = _time(lambda y=y, xs=xs: dist.all_to_all_single(y, xs), reps, dist.barrier, before)
                results[key + "all_to_all"].append([size * (world - 1), seconds])
            except (RuntimeError, NotImplementedError):
                pass  # this backend has no all-to-all
    results["concurrent"] = []
    for _ in range(PROBE_REPEATS):  # every rank at once; repeated, a moment's interruption on one rank is one vote
        dist.barrier()
        probes = [None] * world
        dist.all_gather_object(probes, list(compute_probe()))
        results["concurrent"].append(probes)
    if rank == 0:
        with open(result_file, "w", encoding="utf-8") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def measure(ranks: int, reps: int = 7, timeout: float = 120.0) -> dict | None:
    """The medians of a `ranks`-process world (None when this machine cannot host one: a single GPU), from
    separate Python processes as torchrun would start them (not forked: the parent may hold CUDA and threads)."""
    if ranks < 2 or (torch.cuda.is_available() and torch.cuda.device_count() < ranks):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        init_file, result_file = os.path.join(tmp, "rendezvous"), os.path.join(tmp, "result.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        logs = [open(os.path.join(tmp, f"rank{r}.err"), "wb") for r in range(ranks)]  # noqa: SIM115
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "megagate.calibrate.collectives",
                    str(r),
                    str(ranks),
                    init_file,
                    result_file,
                    str(reps),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=logs[r],
            )
            for r in range(ranks)
        ]
        deadline = time.perf_counter() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            return None
        finally:
            for p in procs:  # only the processes started here
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()
        if any(p.returncode for p in procs) or not os.path.exists(result_file):
            errors = [_last_line(os.path.join(tmp, f"rank{r}.err")) for r, p in enumerate(procs) if p.returncode]
            raise RuntimeError(f"the {ranks}-rank collective measurement failed: {errors}")
        with open(result_file, encoding="utf-8") as f:
            return json.load(f)


def _last_line(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().strip().splitlines()
    return lines[-1] if lines else "no message"


if __name__ == "__main__":
    rank, world, init_file, result_file, reps = sys.argv[1:6]
    _worker(int(rank), int(world), init_file, result_file, int(reps))
