"""`calibrate(budget_s)`: measure this machine within a time budget and fit its DeviceProfile (docs/planning.md)."""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megagate.calibrate import collectives, framework, measure
from megagate.calibrate.timing import Deadline
from megagate.errors import MegagateError
from megagate.plan import curves
from megagate.plan.gpu_defaults import FITTED
from megagate.plan.profile import Curve, DeviceProfile, Host, Link

# shares of the budget left when each section starts (the framework's trainer steps matter most on a CPU)
SHARES = {"bandwidth": 0.02, "gemm": 0.25, "grouped": 0.06, "collectives": 0.35, "attention": 0.3}
UNMEASURED_LINK = Link(50e-6, 5e9)  # a single-rank machine: no collective to time (stated in the profile)


def _machine() -> tuple[str, str, int, str | None]:
    """(name, kind, memory bytes, GPU table name) of this machine."""
    if torch.cuda.is_available():
        from megagate.plan.devices import from_cuda_name

        name = torch.cuda.get_device_name()
        spec = from_cuda_name(name)
        memory = spec.memory_bytes if spec else torch.cuda.get_device_properties(0).total_memory
        return name, "gpu", memory, spec.name if spec else None
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"cpu: {model} ({os.cpu_count()} cores)", "cpu", memory, None


@dataclass
class Measured:
    """What the sections measured so far: the record each one adds to, and the profile is fitted from."""

    name: str
    kind: str
    memory: int
    gpu: str | None  # the GPU table's name, None for a CPU or an unknown GPU
    samples: dict  # every timing behind the fits (the profile keeps them)
    notes: list[str] = field(default_factory=list)  # what was not measured, and why
    bandwidth: float = 0.0
    gemm: dict[str, Curve] = field(default_factory=dict)
    grouped: dict[str, Curve] = field(default_factory=dict)
    intra: Link = UNMEASURED_LINK
    local_ranks: dict = field(default_factory=dict)
    alltoall: float = 1.0
    attention: dict = field(default_factory=dict)
    waited: float = 0.0  # seconds spent waiting for the collectives' other processes

    @property
    def gpu_run(self) -> bool:
        return self.kind == "gpu"


def calibrate(budget_s: float = 110.0, ranks: int = 2, log: Callable[[str], None] = print) -> DeviceProfile:
    """Measure kernels, collectives and the trainer's overheads within `budget_s` seconds; the fitted profile."""
    deadline = Deadline(budget_s)
    cpu_start = time.process_time()
    name, kind, memory, gpu = _machine()
    samples: dict = {"threads": torch.get_num_threads(), "torch": torch.__version__, "load": [os.getloadavg()[0]]}
    m = Measured(name, kind, memory, gpu, samples)
    dtypes = ["bf16"] if m.gpu_run else ["fp32", "bf16"]
    if not m.gpu_run and os.getloadavg()[0] > 1.5 * (os.cpu_count() or 1):
        log(
            f"calibrate: the machine is busy (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores): "
            "the profile predicts steps under that load, and its figures are noisy"
        )
    _bandwidth(m, deadline, log)
    _gemms(m, dtypes, deadline, log)
    main = dtypes[0]
    _experts(m, main, deadline, log)
    _collectives(m, ranks, deadline, log)
    from megagate.distributed import megatron_cpu, parallel

    megatron_cpu.install()
    with parallel.single_process():
        _attention(m, main, deadline, log)
        provisional = _profile(m, Host(0, 0, 0, 0, 0, 0, serial=not m.gpu_run))
        host, scales, host_notes = _framework(provisional, main, deadline)
        m.notes += host_notes
    samples["notes"] = m.notes
    samples["load"].append(os.getloadavg()[0])
    # the share of its threads' time this process got while it measured (1 on a quiet machine; a busy machine's
    # other work takes the rest): what the measured times include of the load
    busy = max(1e-9, (deadline.elapsed() - m.waited) * torch.get_num_threads())
    samples["cpu_share"] = min(1.0, (time.process_time() - cpu_start) / busy)
    p = dataclasses.replace(_profile(m, host), **scales)
    log(
        f"calibrate: the trainer's steps: {host.per_layer * 1e3:.2f} ms per layer and micro-batch, "
        f"{host.per_microbatch * 1e3:.2f} ms per micro-batch, {host.per_step * 1e3:.2f} ms per step of host "
        f"overhead; inside a step the GEMMs take {scales['gemm_scale']:.2f}x, attention "
        f"{scales['attention_scale']:.2f}x and the memory-bound work {scales['work_scale']:.2f}x their curves' time"
    )
    log(f"calibrate: done in {deadline.elapsed():.0f} s")
    return p


def _bandwidth(m: Measured, deadline: Deadline, log: Callable[[str], None]) -> None:
    bandwidth, cache_bandwidth, cache_bytes = measure.bandwidth(deadline.share(SHARES["bandwidth"]))
    m.bandwidth = bandwidth
    m.samples["bandwidth"] = [bandwidth, cache_bandwidth, cache_bytes]
    log(
        f"calibrate: memory bandwidth {bandwidth / 1e9:.1f} GB/s"
        + (f", {cache_bandwidth / 1e9:.1f} GB/s on tensors up to {cache_bytes >> 10} KiB" if cache_bandwidth else "")
        + f" ({deadline.elapsed():.0f} s)"
    )


def _gemms(m: Measured, dtypes: list[str], deadline: Deadline, log: Callable[[str], None]) -> None:
    for i, dt in enumerate(dtypes):
        s = measure.gemm_samples(dt, deadline.share(SHARES["gemm"] / (len(dtypes) - i)))
        try:
            m.gemm[dt], err = curves.fit_gemm(s)
        except ValueError:  # the timings do not grow with the work: noise (a busy machine) or too few shapes
            raise MegagateError(
                f"calibrate: the {dt} GEMM timings of {len(s)} shapes do not grow with their work, so no rate can "
                f"be fitted (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores); run it again with a "
                "larger --budget-s or on a quieter machine"
            ) from None
        m.samples[f"gemm_{dt}"] = s
        log(
            f"calibrate: {dt} GEMMs up to {m.gemm[dt].rate / 1e9:.1f} GFLOP/s, half speed at {m.gemm[dt].half:.0f}, "
            f"{m.gemm[dt].latency * 1e6:.1f} us per call ({len(s)} shapes, rms error {err:.0%})"
        )


def _experts(m: Measured, main: str, deadline: Deadline, log: Callable[[str], None]) -> None:
    g = measure.grouped_samples(main, deadline.share(SHARES["grouped"]))
    m.samples["experts"] = g
    curve = grouped_curve(g["grouped"])
    if curve is not None:
        m.grouped[main] = curve
    elif g["grouped"]:
        log(
            f"calibrate: the grouped GEMM's {len(g['grouped'])} timings do not grow with tokens per expert; the plan "
            "times experts as one GEMM each"
        )
    log(f"calibrate: experts by tokens per expert, {'a grouped GEMM' if m.grouped else 'one GEMM each'} measured")


def _collectives(m: Measured, ranks: int, deadline: Deadline, log: Callable[[str], None]) -> None:
    # the ranks' processes take seconds to start on a quiet machine, a minute on a crowded one: they are given at
    # least 90 s before the measurement is given up (a single-GPU machine starts none)
    remaining = deadline.left() * SHARES["collectives"]
    start = time.perf_counter()
    world = collectives.measure(ranks, timeout=max(90.0, remaining)) if ranks > 1 else None
    m.waited = time.perf_counter() - start  # the other processes' time, not this one's
    if not world:
        m.notes.append("collectives not measured (one rank / one GPU): links assumed")
        return
    ring = [tuple(x) for x in world["all_gather"] + world["all_reduce"]]
    m.intra, err = curves.fit_link(ring)
    if world["all_to_all"]:
        a2a, _ = curves.fit_link([tuple(x) for x in world["all_to_all"]])
        m.alltoall = min(1.0, a2a.bandwidth / m.intra.bandwidth)
    flops, tiny = collectives.compute_probe()
    # per repeat the slowest rank (a step waits for it), then the median over repeats
    repeats = world["concurrent"]
    shares = {
        "compute": statistics.median(min(f for f, _ in probes) for probes in repeats) / flops,
        "host": tiny / statistics.median(max(t for _, t in probes) for probes in repeats),
    }
    m.local_ranks[str(ranks)] = shares
    m.samples["collectives"] = world
    log(
        f"calibrate: {ranks} local ranks: {m.intra.latency * 1e6:.0f} us + {m.intra.bandwidth / 1e9:.2f} GB/s per "
        f"collective; each rank at {shares['compute']:.2f}x compute, {shares['host']:.2f}x host speed of one process"
    )


def _attention(m: Measured, main: str, deadline: Deadline, log: Callable[[str], None]) -> None:
    """The SDPA and megatron local attention curves (inside a one-process megatron world)."""
    for kernel in ("sdpa", "local"):
        fused = kernel == "sdpa"
        name_k = "flash" if m.gpu_run and fused else kernel
        try:
            s = measure.attention_samples(kernel, main, deadline.share(SHARES["attention"] / (2 if fused else 1)))
        except Exception as error:  # a kernel this machine cannot run: the datasheet's curve stays (said)
            m.notes.append(f"{kernel} attention not measured: {str(error).splitlines()[0][:200]}")
            log(f"calibrate: {m.notes[-1]}")
            continue
        scores_bw = m.samples["bandwidth"][1] or m.bandwidth  # the calibration's score tensors are small
        m.attention[name_k], err = curves.fit_attention(s, scores_bw, causal_skip=fused, unfused=not fused)
        m.samples[f"attention_{kernel}"] = s
        log(f"calibrate: {kernel} attention {m.attention[name_k].rate / 1e9:.1f} GFLOP/s (rms error {err:.0%})")
    if not m.attention and not m.gpu_run:
        raise RuntimeError("no attention kernel could be measured on this CPU: " + "; ".join(m.notes))


def grouped_curve(samples: list[tuple[int, int, int, int, float]]) -> Curve | None:
    """The grouped GEMM's per-expert curve from (experts, tokens per expert, n, k, seconds), or None when the
    timings cannot give one (fewer than two token counts, or no time growing with the work: a noisy moment)."""
    if len({tokens for _, tokens, *_ in samples}) < 2:
        return None
    try:
        return curves.fit_gemm([(tokens, n, k, t / experts) for experts, tokens, n, k, t in samples])[0]
    except ValueError:
        return None


def _framework(provisional: DeviceProfile, precision: str, deadline: Deadline) -> tuple[Host, dict, list[str]]:
    """The trainer's overheads and the device work's scales inside its steps (framework.solve): measured steps
    against the planner's modelled work with the provisional profile."""
    from megagate.plan import plan

    measured = framework.time_variants(precision, "auto", time.perf_counter() + 0.8 * deadline.left())
    modelled = {}
    for name, variant in framework.VARIANTS.items():
        if name not in measured:
            continue
        modelled[name] = {}
        for m in (1, 2):
            cfg = framework.config("unused", variant, precision, "auto", micro_batches=m, environment=False)
            # the step's time is linear in the scales: a plan per scale doubled splits it into GEMMs, attention
            # and the rest
            both = plan(cfg, 1, provisional, gpus_per_node=1).time.total
            parts = []
            for key in framework.SCALES[:-1]:
                slow = dataclasses.replace(provisional, **{key: 2.0})
                parts.append(plan(cfg, 1, slow, gpus_per_node=1).time.total - both)
            modelled[name][m] = (*parts, both - sum(parts))
    values, notes = framework.solve(measured, modelled, fit_scale=provisional.kind == "cpu")
    scales = {k: values.pop(k) for k in framework.SCALES}
    provisional.samples["framework"] = {"measured": measured, "modelled": modelled, **scales}
    # a GPU's MoE host sync is not measured here (one process, no dispatcher): the published runs' fitted value
    host = Host(
        **values, serial=provisional.kind == "cpu", moe_sync=0.0 if provisional.kind == "cpu" else FITTED.moe_sync
    )
    return host, scales, notes


def _profile(m: Measured, host: Host) -> DeviceProfile:
    """The profile; on a GPU of the table, what could not be measured here (the network, the NVLink domain) comes
    from its datasheet profile."""
    if m.gpu is not None:
        from megagate.plan.devices import gpu_spec
        from megagate.plan.gpu_defaults import gpu_profile

        base = gpu_profile(gpu_spec(m.gpu))
        measured_links = m.intra is not UNMEASURED_LINK
        return dataclasses.replace(
            base,
            name=m.name,
            gemm={**base.gemm, **m.gemm},
            grouped_gemm={**base.grouped_gemm, **m.grouped} if m.grouped else base.grouped_gemm,
            attention={**base.attention, **m.attention, "sdpa": m.attention.get("flash", base.attention["sdpa"])},
            memory_bandwidth=m.bandwidth,
            intra=m.intra if measured_links else base.intra,
            host=host,
            threads=None,
            source="megagate calibrate (this GPU; network and NVLink domain from the datasheet)",
            samples=m.samples,
        )
    return DeviceProfile(
        name=m.name,
        kind=m.kind,
        memory_bytes=m.memory,
        gemm=m.gemm,
        grouped_gemm=m.grouped,
        attention=m.attention,
        memory_bandwidth=m.bandwidth,
        intra=m.intra,
        inter=m.intra,
        host=host,
        gpu=None,
        nvlink_domain=8,
        alltoall_efficiency=m.alltoall,
        threads=m.samples["threads"],
        cache_bandwidth=m.samples["bandwidth"][1],
        cache_bytes=m.samples["bandwidth"][2],
        local_ranks=m.local_ranks,
        source="megagate calibrate (this machine)",
        samples=m.samples,
    )
