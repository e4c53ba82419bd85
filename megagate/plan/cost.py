"""Device seconds of the work inventory (megagate.plan.work) under a device profile (megagate.plan.profile).

A forward GEMM [m, k] x [k, n] is followed in backward by the data gradient [m, n] x [n, k] and the weight
gradient [n, m] x [m, k]: the same FLOPs, each timed at its own shape (a small m, few tokens per expert, slows
all three, the weight gradient's reduction most). Attention follows its kernel's curve; memory-bound work is bytes
over the profile's memory bandwidth, twice the forward's bytes backward. Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megagate.plan.profile import Curve, DeviceProfile
from megagate.plan.work import Gemm, Grouped, LayerWork


@dataclass
class PassTime:
    """Forward and backward device seconds of one piece of work, with the terms they are made of."""

    fwd: float = 0.0
    bwd: float = 0.0
    terms: dict[str, float] = field(default_factory=dict)  # fwd + bwd seconds by kind
    expert_ideal: float = 0.0  # the experts' seconds at the large-GEMM rate (what small GEMMs lose is the rest)

    def add(self, kind: str, fwd: float, bwd: float) -> None:
        self.fwd += fwd
        self.bwd += bwd
        self.terms[kind] = self.terms.get(kind, 0.0) + fwd + bwd

    def merge(self, other: PassTime) -> None:
        self.fwd += other.fwd
        self.bwd += other.bwd
        for k, v in other.terms.items():
            self.terms[k] = self.terms.get(k, 0.0) + v
        self.expert_ideal += other.expert_ideal

    def recompute(self, other: PassTime) -> None:
        """A recomputed forward: `other`'s forward runs again inside this backward."""
        self.bwd += other.fwd
        self.terms["recompute"] = self.terms.get("recompute", 0.0) + other.fwd

    @property
    def total(self) -> float:
        return self.fwd + self.bwd


def gemm_seconds(curve: Curve, g: Gemm) -> tuple[float, float]:
    """(forward, backward) seconds of `g`'s calls."""
    fwd = curve.seconds(g.m, g.n, g.k, g.calls)
    bwd = curve.seconds(g.m, g.k, g.n, g.calls) + curve.seconds(g.n, g.k, g.m, g.calls)
    return fwd, bwd


def grouped_seconds(profile: DeviceProfile, x: Grouped) -> tuple[float, float, float]:
    """(forward, backward, forward+backward at the large-GEMM rate) seconds of a rank's experts: with a grouped
    GEMM each expert at its own shape's speed plus the grouped curve's latency per expert (Transformer Engine issues
    one GEMM, and under fp8 its quantisation kernels, per expert), else the plain GEMM curve per expert."""
    plain = profile.curve(x.precision)
    curve = profile.grouped_curve(x.precision) or plain

    def one(m: float, n: float, k: float) -> float:
        if m <= 0 or x.experts == 0:
            return 0.0
        return x.experts * (curve.latency + 2.0 * m * n * k / curve.speed(m, n, k))

    fwd = one(x.m, x.n, x.k)
    bwd = one(x.m, x.k, x.n) + one(x.n, x.k, x.m)
    ideal = 3 * x.experts * 2.0 * x.m * x.n * x.k / plain.rate
    return fwd, bwd, ideal


def work_seconds(work: LayerWork, profile: DeviceProfile, kernel: str, tensor_bytes: float = float("inf")) -> PassTime:
    """Device seconds of `work` (one micro-batch on one rank; `tensor_bytes`: the size of its activation tensors,
    which decides whether memory-bound kernels run from a CPU's cache)."""
    out = PassTime()
    for g in work.gemms:
        f, b = gemm_seconds(profile.curve(g.precision), g)
        kind = "expert GEMMs" if g.name.startswith("expert") else "GEMMs"
        out.add(kind, f, b)
        if kind == "expert GEMMs":
            out.expert_ideal += 3 * g.calls * 2.0 * g.m * g.n * g.k / profile.curve(g.precision).rate
    for x in work.grouped:
        f, b, ideal = grouped_seconds(profile, x)
        out.add("expert GEMMs", f, b)
        out.expert_ideal += ideal
    curve = profile.attention_curve(kernel)
    for a in work.attention:
        scores = 4.0 * a.b * a.heads * a.sq * a.sk  # an unfused kernel's fp32 scores
        f, b = curve.seconds(a.b, a.heads, a.sq, a.sk, a.d, a.causal, profile.bandwidth(scores))
        out.add("attention", f, b)
    moved = sum(work.bytes.values())
    bandwidth = profile.bandwidth(tensor_bytes)
    out.add("memory-bound", moved / bandwidth, 2 * moved / bandwidth)
    return out
