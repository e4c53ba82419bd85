"""A hand-made CPU device profile for the planner's tests (tests/plan): round numbers whose plans can be checked."""

from __future__ import annotations

from megagate.plan.profile import AttentionCurve, Curve, DeviceProfile, Host, Link


def cpu_profile() -> DeviceProfile:
    return DeviceProfile(
        name="cpu: test (2 cores)",
        kind="cpu",
        memory_bytes=16 * 2**30,
        gemm={"fp32": Curve(20e9, 16.0, 5e-6), "bf16": Curve(5e9, 16.0, 8e-6)},
        grouped_gemm={},
        attention={"sdpa": AttentionCurve(4e9, 2e-5), "local": AttentionCurve(2e9, 3e-5, 2.0, False, 12.0)},
        memory_bandwidth=8e9,
        intra=Link(1e-4, 2e9),
        inter=Link(1e-4, 2e9),
        host=Host(2e-3, 1e-3, 1.5e-3, 2e-4, 1e-3, 1e-4, per_layer_step=3e-4, serial=True),
        gemm_scale=1.5,
        work_scale=2.0,
        threads=2,
        local_ranks={"2": {"compute": 0.5, "host": 0.8}},
        source="test",
    )
