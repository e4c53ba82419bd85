"""Device profiles: what a device *achieves*, as the step-time model needs it (docs/planning.md, "Device profiles").

A `DeviceProfile` holds, for one device: GEMM curves by precision, a grouped-GEMM curve (all local experts in one
call), attention curves by kernel, the memory bandwidth that memory-bound work gets, collective latency and bandwidth
inside and between NVLink domains, and the host's framework overheads (per step, per micro-batch, per layer, per
local expert). `megagate calibrate` measures them on the machine it runs on and writes one as JSON (`save`);
`megagate plan --profile FILE` reads it back (`load`, which refuses a bad file in one line). Without a file, a GPU's
profile is built from the datasheet (megagate.plan.devices) and the constants fitted against published Megatron runs
(megagate.plan.gpu_defaults).

A GEMM of an [m, k] x [k, n] product takes `latency + 2mnk / (rate * s(m) s(n) s(k))` seconds with
`s(x) = x / (x + half)`: large GEMMs run at `rate`; a small dimension slows it down smoothly (a GEMM with few rows
reads its whole weight for little work, so its time tends to the weight's bytes over the bandwidth, the roofline's
memory-bound side). Pure data and arithmetic: no torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from megagate.errors import ConfigError
from megagate.sections import as_mapping, check_choice, read_fields

SCHEMA = 1
KINDS = ("gpu", "cpu")
PRECISIONS = ("fp32", "bf16", "fp8")
ATTENTION_KERNELS = ("flash", "sdpa", "local")  # flash: TE / cuDNN / flash-attn; sdpa: torch's SDPA on this device


@dataclass(frozen=True)
class Curve:
    """Seconds of a GEMM-like call of 2mnk FLOPs (see the module docstring)."""

    rate: float  # FLOP/s of a large call
    half: float  # a dimension of this size halves the speed (in that dimension)
    latency: float  # seconds per call (launch / dispatch)

    def speed(self, m: float, n: float, k: float) -> float:
        """FLOP/s of an [m, k] x [k, n] product."""
        s = 1.0
        for x in (m, n, k):
            s *= x / (x + self.half)
        return self.rate * s

    def seconds(self, m: float, n: float, k: float, calls: int = 1) -> float:
        """`calls` GEMMs of shape [m, k] x [k, n] (0 when a dimension is empty)."""
        if m <= 0 or n <= 0 or k <= 0 or calls <= 0:
            return 0.0
        return calls * (self.latency + 2.0 * m * n * k / self.speed(m, n, k))


@dataclass(frozen=True)
class AttentionCurve:
    """Core attention of one kernel: `latency + flops / rate (+ score bytes / bandwidth for an unfused kernel)`.

    FLOPs are 4·b·np·sq·sk·d forward (QK^T and AV), halved under a causal mask when the kernel skips the masked
    blocks (`causal_skip`: flash kernels do, megatron's unfused attention computes every score); backward costs
    `backward` times the forward's FLOPs. An unfused kernel also writes and reads the [b, np, sq, sk] scores:
    `score_bytes` bytes per score element forward (mask, softmax, probabilities), twice that backward.
    """

    rate: float
    latency: float
    backward: float = 2.5
    causal_skip: bool = True
    score_bytes: float = 0.0

    def flops(self, b: int, heads: int, sq: int, sk: int, d: int, causal: bool) -> float:
        return 4.0 * b * heads * sq * sk * d * (0.5 if causal and self.causal_skip else 1.0)

    def seconds(self, b: int, heads: int, sq: int, sk: int, d: int, causal: bool, bandwidth: float) -> tuple:
        """(forward, backward) seconds."""
        f = self.flops(b, heads, sq, sk, d, causal) / self.rate
        scores = self.score_bytes * b * heads * sq * sk / bandwidth
        return self.latency + f + scores, self.latency + self.backward * f + 2 * scores


@dataclass(frozen=True)
class Link:
    """A collective over one kind of link: `latency + bytes moved per rank / bandwidth`."""

    latency: float  # seconds per collective call
    bandwidth: float  # bytes/s per rank per direction, as collectives achieve it

    def seconds(self, bytes_per_rank: float) -> float:
        return 0.0 if bytes_per_rank <= 0 else self.latency + bytes_per_rank / self.bandwidth


@dataclass(frozen=True)
class Host:
    """Framework overheads of the host (Python, megatron, the dispatcher, kernel launches), in seconds.

    On a GPU the host queues kernels ahead of the device (`serial` False): a layer takes the longer of its device
    work and its host work, and `moe_sync` is the stall of each dropless MoE layer pass (the host reads the token
    counts per expert before it can size the grouped GEMM). On a CPU both run on the same cores (`serial` True): the
    overheads add to the work.
    """

    per_step: float  # the optimizer step, gradient norm, zeroing, the schedule's set-up
    per_microbatch: float  # the schedule's work per model chunk and micro-batch (forward+backward): forward_step,
    # the loss, data loading, the pipeline hand-over
    per_layer: float  # one transformer layer, forward + backward, per micro-batch (attention + dense MLP)
    per_layer_gate: float  # what an attention-output gate adds to a layer
    per_layer_moe: float  # what a MoE block adds to a layer over a dense MLP (router, dispatcher)
    per_expert: float = 0.0  # per local expert and layer, when experts run one by one (megatron's SequentialMLP)
    per_layer_step: float = 0.0  # per layer and step (the optimizer's per-tensor work)
    moe_sync: float = 0.0
    serial: bool = False


@dataclass(frozen=True)
class DeviceProfile:
    """What one device achieves (see the module docstring)."""

    name: str
    kind: str  # "gpu" | "cpu"
    memory_bytes: int
    gemm: dict[str, Curve]  # by precision
    # by precision; its latency is per expert (a grouped GEMM still pays per group); empty: no grouped kernel
    grouped_gemm: dict[str, Curve]
    attention: dict[str, AttentionCurve]  # by kernel
    memory_bandwidth: float  # bytes/s of memory-bound kernels on tensors larger than the cache
    intra: Link  # inside an NVLink domain (a node of the local ranks, on CPU)
    inter: Link  # between domains
    host: Host
    gpu: str | None = None  # the GPU table's name (megagate.plan.devices), if any
    nvlink_domain: int = 8
    alltoall_efficiency: float = 1.0  # all-to-all inside a domain: bandwidth as a share of the ring collectives'
    overlap_efficiency: float = 1.0  # the share of a compute window that hides communication run alongside it
    # the share of the device's compute the MoE dispatcher's kernels hold while they run beside other work (the EP
    # all-to-all overlap): the work beside them runs that much slower
    dispatch_compute_share: float = 0.0
    cache_bandwidth: float | None = None  # bytes/s on tensors of at most `cache_bytes` (a CPU's caches)
    cache_bytes: int = 0
    threads: int | None = None  # CPU: the threads per process the curves were measured with
    # CPU: per-rank slow-down when this many ranks share the machine, {"2": {"compute": f, "host": g}}
    local_ranks: dict[str, dict[str, float]] = field(default_factory=dict)
    # the device work's seconds inside a training step over the curves' (measured on kernels alone, operands hot in
    # cache), of GEMMs, of attention and of the memory-bound rest: a CPU's kernels in a step run between the
    # framework's other work, on operands it evicted, and the loss's softmax is exp-bound, not bytes-bound;
    # calibrate measures them from trainer steps (1 on a GPU)
    gemm_scale: float = 1.0
    attention_scale: float = 1.0
    work_scale: float = 1.0
    source: str = ""
    samples: dict[str, Any] = field(default_factory=dict)  # the raw measurements behind the curves

    def bandwidth(self, tensor_bytes: float) -> float:
        """Bytes/s of memory-bound kernels whose tensors are `tensor_bytes` each: cache-resident ones at the cache's
        rate; of a larger one, the share beyond `cache_bytes` at the memory's (a smooth step: a hard one made a
        model 1.5x another's size take 6x its optimizer time, where the measured times differ 2x)."""
        if not self.cache_bandwidth:
            return self.memory_bandwidth
        if tensor_bytes <= self.cache_bytes:
            return self.cache_bandwidth
        cached = self.cache_bytes / tensor_bytes
        return 1.0 / (cached / self.cache_bandwidth + (1.0 - cached) / self.memory_bandwidth)

    def curve(self, precision: str) -> Curve:
        """The GEMM curve of a precision (fp8 falls back to bf16 where none was measured, fp32 to bf16 at half)."""
        if precision in self.gemm:
            return self.gemm[precision]
        if precision == "fp8" and "bf16" in self.gemm:
            return self.gemm["bf16"]
        if precision == "fp32" and "bf16" in self.gemm:
            c = self.gemm["bf16"]
            return dataclasses.replace(c, rate=c.rate / 2)
        return next(iter(self.gemm.values()))

    def check_precision(self, precision: str) -> None:
        """A one-line ConfigError where `curve` would stand in another precision's curve for `precision` that it
        does not describe (only fp8 measured for an fp32 or bf16 run: fp8's rate is not theirs)."""
        if precision in self.gemm or precision == "fp8" and "bf16" in self.gemm:
            return
        if precision in ("fp32", "bf16") and set(self.gemm) - {"fp8"}:
            return  # the other of fp32 / bf16 stands in (bf16 at half the rate for fp32)
        raise ConfigError(
            f"has GEMM curves for {', '.join(sorted(self.gemm))} only, none for train.precision={precision!r}: "
            f"calibrate {precision} too (megagate calibrate), or plan another precision"
        )

    def grouped_curve(self, precision: str) -> Curve | None:
        """The grouped-GEMM curve of a precision (None: no grouped kernel measured or known)."""
        if not self.grouped_gemm:
            return None
        return (
            self.grouped_gemm.get(precision) or self.grouped_gemm.get("bf16") or next(iter(self.grouped_gemm.values()))
        )

    def attention_curve(self, kernel: str) -> AttentionCurve:
        if kernel in self.attention:
            return self.attention[kernel]
        return self.attention.get("flash") or self.attention.get("sdpa") or next(iter(self.attention.values()))

    def in_step(self) -> DeviceProfile:
        """This profile with its GEMMs' time times `gemm_scale`, attention's times `attention_scale` and the
        memory-bound work's times `work_scale`: what the device work takes inside a training step (itself when all
        are 1); links and overheads unchanged."""
        g, a, k = self.gemm_scale, self.attention_scale, self.work_scale
        if g == a == k == 1.0:
            return self

        def curve(c: Curve) -> Curve:
            return dataclasses.replace(c, rate=c.rate / g, latency=c.latency * g)

        return dataclasses.replace(
            self,
            gemm={p: curve(c) for p, c in self.gemm.items()},
            grouped_gemm={p: curve(c) for p, c in self.grouped_gemm.items()},
            # an unfused kernel's score traffic goes over the bandwidth, which the rest's scale divides
            attention={
                n: dataclasses.replace(c, rate=c.rate / a, latency=c.latency * a, score_bytes=c.score_bytes * a / k)
                for n, c in self.attention.items()
            },
            memory_bandwidth=self.memory_bandwidth / k,
            cache_bandwidth=None if self.cache_bandwidth is None else self.cache_bandwidth / k,
            gemm_scale=1.0,
            attention_scale=1.0,
            work_scale=1.0,
        )

    def scaled_for_ranks(self, ranks: int) -> DeviceProfile:
        """This CPU profile for `ranks` processes on one machine: each rank's rates times the measured compute share,
        its latencies and overheads over the host share (unchanged on a GPU, where every rank has its own device,
        or when nothing was measured for that many)."""
        factors = self.local_ranks.get(str(ranks)) if self.kind == "cpu" and ranks > 1 else None
        if not factors:
            return self
        compute, host = factors["compute"], factors["host"]
        h = self.host

        def curve(c: Curve) -> Curve:  # the rate is compute, the per-call latency is the host's dispatch
            return dataclasses.replace(c, rate=c.rate * compute, latency=c.latency / host)

        return dataclasses.replace(
            self,
            gemm={k: curve(c) for k, c in self.gemm.items()},
            grouped_gemm={k: curve(c) for k, c in self.grouped_gemm.items()},
            attention={
                k: dataclasses.replace(a, rate=a.rate * compute, latency=a.latency / host)
                for k, a in self.attention.items()
            },
            memory_bandwidth=self.memory_bandwidth * compute,
            cache_bandwidth=None if self.cache_bandwidth is None else self.cache_bandwidth * compute,
            host=dataclasses.replace(
                h,
                **{
                    f.name: getattr(h, f.name) / host
                    for f in dataclasses.fields(h)
                    if f.name not in ("serial", "moe_sync")
                },
            ),
        )


# --- JSON ------------------------------------------------------------------------------------------------------
def to_dict(p: DeviceProfile) -> dict[str, Any]:
    """The profile as JSON-ready data (`load` reads it back)."""
    return {"schema": SCHEMA, **dataclasses.asdict(p)}


def save(p: DeviceProfile, path: str) -> None:
    """Write the profile to `path` atomically (a temporary name in the same folder, then a rename)."""
    from megagate.files import write_atomic

    write_atomic(path, json.dumps(to_dict(p), indent=1, sort_keys=True, allow_nan=False) + "\n")


def load(path: str) -> DeviceProfile:
    """The profile in `path`, or a one-line ConfigError naming the file and what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"--profile {path!r}: no such file (write one with `megagate calibrate --out FILE`)"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"--profile {path!r} is a folder, not a profile file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--profile {path!r} is not a JSON device profile ({str(e).splitlines()[0]})") from None
    except OSError as e:
        raise ConfigError(f"--profile {path!r}: {e.strerror or e}") from None
    try:
        return from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"--profile {path!r}: {e}") from None


def from_dict(data: Any) -> DeviceProfile:
    """A profile from `to_dict`'s data: each of its dataclasses read by `sections.read_fields` (unknown keys, types),
    then every number's bound and the rules across fields (a ConfigError names the first bad one)."""
    data = as_mapping(data, "a device profile")
    schema = data.pop("schema", None)
    if schema != SCHEMA:
        raise ConfigError(f"schema {schema!r} is not {SCHEMA} (re-run megagate calibrate)")
    nested = {name: data.pop(name, None) for name in _NESTED}
    profile = _read(DeviceProfile, data, PATH)
    check_choice(profile["kind"], KINDS, f"{PATH}.kind")
    gemm = _curves(Curve, nested["gemm"], "gemm", PRECISIONS)
    if not gemm:
        raise ConfigError(f"gemm must have curves for some of {', '.join(PRECISIONS)} (has none)")
    attention = _curves(AttentionCurve, nested["attention"], "attention", ATTENTION_KERNELS)
    if not attention:
        raise ConfigError(f"attention must have curves for some of {', '.join(ATTENTION_KERNELS)}")
    if profile.get("dispatch_compute_share", 0.0) >= 1:
        raise ConfigError(f"dispatch_compute_share={profile['dispatch_compute_share']!r} must be a share in [0, 1)")
    threads = profile.get("threads")
    if threads is not None and threads < 1:
        raise ConfigError(f"threads={threads!r} must be a positive integer (or null)")
    _gpu_name(profile.get("gpu"))
    ranks = profile.pop("local_ranks", {})
    if not all(
        isinstance(v, dict) and {"compute", "host"} <= set(v) and all(_positive(v[x]) for x in ("compute", "host"))
        for v in ranks.values()
    ):
        raise ConfigError('local_ranks must map a rank count to {"compute": factor, "host": factor} (positive)')
    return DeviceProfile(
        **profile,
        gemm=gemm,
        grouped_gemm=_curves(Curve, nested["grouped_gemm"] or {}, "grouped_gemm", PRECISIONS),
        attention=attention,
        intra=Link(**_read(Link, nested["intra"], f"{PATH}.intra")),
        inter=Link(**_read(Link, nested["inter"], f"{PATH}.inter")),
        host=Host(**_read(Host, nested["host"], f"{PATH}.host")),
        local_ranks={str(k): {"compute": float(v["compute"]), "host": float(v["host"])} for k, v in ranks.items()},
    )


PATH = "profile"  # the key paths of the refusals: profile.gemm.bf16.rate
_NESTED = ("gemm", "grouped_gemm", "attention", "intra", "inter", "host")
# numbers that may be 0; every other number of a profile is positive
_ZERO_OK = {"half", "latency", "score_bytes", "cache_bytes", "dispatch_compute_share"} | {
    f.name for f in dataclasses.fields(Host)
}


_INTS = {"memory_bytes", "cache_bytes", "nvlink_domain", "threads"}


def _read(cls: type, values: Any, path: str) -> dict:
    """The keywords of one of the profile's dataclasses: `read_fields`, every required field present, each number
    finite and positive (or >= 0 where `_ZERO_OK`)."""
    if values is None:
        raise ConfigError(f"{path} is missing")
    values = as_mapping(values, path)
    for name in _INTS & set(values):  # JSON writers may give a byte count as 8e10
        if isinstance(values[name], float) and values[name].is_integer():
            values[name] = int(values[name])
    kw = read_fields(cls, values, path)
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in kw and f.name not in _NESTED:
            raise ConfigError(f"{path}.{f.name} is missing")
        value = kw.get(f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            zero = f.name in _ZERO_OK
            if not (value >= 0 if zero else value > 0):
                need = "a finite number >= 0" if zero else "a positive finite number"
                raise ConfigError(f"{path}.{f.name}={value!r} must be {need}")
    return kw


def _curves(cls: type, values: Any, name: str, allowed: tuple[str, ...]) -> dict:
    """A mapping of curves by precision or kernel (only `allowed` keys)."""
    values = as_mapping(values, f"{PATH}.{name}")
    if set(values) - set(allowed):
        raise ConfigError(f"{name} must have curves for some of {', '.join(allowed)} (has {sorted(values)})")
    return {k: cls(**_read(cls, v, f"{PATH}.{name}.{k}")) for k, v in values.items()}


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _gpu_name(value: Any) -> str | None:
    """The profile's GPU: a name of the planner's GPU table, or none."""
    if value is None:
        return None
    from megagate.plan.devices import GPUS

    if not isinstance(value, str) or value not in GPUS:
        raise ConfigError(f"gpu={value!r} is not a GPU of the planner's table ({', '.join(GPUS)}) or null")
    return value
