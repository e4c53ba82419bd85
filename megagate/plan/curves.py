"""Fitting a device profile's curves to measurements (what `megagate calibrate` measured). Pure arithmetic.

Every fit minimises the squared *relative* error of the predicted seconds (small and large calls count alike), by
least squares in the curve's linear parameters, the non-linear one (a GEMM's half-speed size) by a grid.
"""

from __future__ import annotations

from collections.abc import Sequence

from megagate.plan.profile import AttentionCurve, Curve, Link

HALVES = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0)


def nonnegative_least_squares(rows: Sequence[Sequence[float]], seconds: Sequence[float]) -> tuple[list[float], float]:
    """Non-negative coefficients c minimising sum((row . c / t - 1)^2), and that sum (a small active-set solve: a
    coefficient that comes out negative is dropped and the rest refitted)."""
    n = len(rows[0])
    active = list(range(n))
    while True:
        # normal equations of the weighted problem: A = rows / t, b = 1
        a = [[r[j] / t for j in active] for r, t in zip(rows, seconds)]
        k = len(active)
        ata = [[sum(row[i] * row[j] for row in a) for j in range(k)] for i in range(k)]
        atb = [sum(row[i] for row in a) for i in range(k)]
        sol = _solve(ata, atb)
        if sol is None or min(sol) >= 0 or k == 1:
            coef = [0.0] * n
            for j, v in zip(active, sol or [0.0] * k):
                coef[j] = max(v, 0.0)
            error = sum((sum(c * x for c, x in zip(coef, r)) / t - 1) ** 2 for r, t in zip(rows, seconds))
            return coef, error
        active.pop(min(range(k), key=lambda i: sol[i]))


def _solve(m: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (None for a singular system)."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(m, b)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_gemm(samples: Sequence[tuple[float, float, float, float]]) -> tuple[Curve, float]:
    """A GEMM curve from (m, n, k, seconds) samples, and its RMS relative error."""
    best: tuple[float, Curve] | None = None
    seconds = [s[3] for s in samples]
    for half in HALVES:
        rows = []
        for m, n, k, _ in samples:
            slow = (1 + half / m) * (1 + half / n) * (1 + half / k)
            rows.append([1.0, 2.0 * m * n * k * slow])
        (latency, inverse), error = nonnegative_least_squares(rows, seconds)
        if inverse <= 0:
            continue
        if best is None or error < best[0]:
            best = (error, Curve(1.0 / inverse, half, latency))
    if best is None:
        raise ValueError("no GEMM curve fits these samples")
    return best[1], (best[0] / len(samples)) ** 0.5


def fit_attention(
    samples: Sequence[tuple[int, int, int, int, float, float]], bandwidth: float, causal_skip: bool, unfused: bool
) -> tuple[AttentionCurve, float]:
    """An attention curve from (b, heads, s, d, forward seconds, backward seconds) of causal calls, and its RMS
    relative error. `unfused`: the kernel writes the [b, np, s, s] scores (fits their bytes per element too)."""
    probe = AttentionCurve(1.0, 0.0, causal_skip=causal_skip)
    rows_f, rows_b, t_f, t_b = [], [], [], []
    for b, heads, s, d, fwd, bwd in samples:
        flops = probe.flops(b, heads, s, s, d, causal=True)
        scores = b * heads * s * s / bandwidth
        rows_f.append([1.0, flops] + ([scores] if unfused else []))
        rows_b.append([1.0, flops] + ([2 * scores] if unfused else []))
        t_f.append(fwd)
        t_b.append(bwd)
    (lat_f, inv_f, *sb_f), err_f = nonnegative_least_squares(rows_f, t_f)
    (_, inv_b, *_), err_b = nonnegative_least_squares(rows_b, t_b)
    inv_f = inv_f or 1e-15
    curve = AttentionCurve(
        rate=1.0 / inv_f,
        latency=lat_f,
        backward=max(inv_b / inv_f, 1.0) if inv_b else 2.5,
        causal_skip=causal_skip,
        score_bytes=sb_f[0] if sb_f else 0.0,
    )
    return curve, ((err_f + err_b) / (2 * len(samples))) ** 0.5


def fit_link(samples: Sequence[tuple[float, float]]) -> tuple[Link, float]:
    """A link from (bytes moved per rank, seconds) samples of collectives, and its RMS relative error."""
    rows = [[1.0, b] for b, _ in samples]
    (latency, inverse), error = nonnegative_least_squares(rows, [t for _, t in samples])
    return Link(latency, 1.0 / inverse if inverse > 0 else 1e12), (error / len(samples)) ** 0.5
