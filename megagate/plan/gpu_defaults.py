"""A GPU's device profile without a calibration: the datasheet (megagate.plan.devices) times achieved shares.

Some shares are assumptions, stated with their reason; the others were fitted against the fit half of the published
Megatron runs (megagate/plan/published_runs.yaml) by `tools/fit_published.py`, which prints the error on the held-out
half (the table in docs/planning.md). `megagate calibrate` on a GPU replaces what it can measure there (GEMM and
attention curves, memory bandwidth, the host's overheads; the links when the machine has several GPUs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megagate.plan.devices import GpuSpec
from megagate.plan.profile import AttentionCurve, Curve, DeviceProfile, Host, Link


@dataclass(frozen=True)
class GpuConstants:
    """Achieved shares of the datasheet and the host's overheads (seconds) of a Megatron training on a GPU."""

    gemm_bf16: float  # large bf16 GEMMs: share of the dense bf16 peak
    gemm_fp8: float  # large fp8 GEMMs: share of the dense fp8 peak
    attention: float  # flash attention, forward: share of the bf16 peak (backward: 2.5x the FLOPs at that rate)
    memory: float  # memory-bound kernels: share of the HBM bandwidth
    nvlink: float  # ring collectives inside an NVLink domain: share of the NVLink rate
    network: float  # ring collectives between domains: share of the per-GPU network rate
    alltoall: float  # all-to-all inside an NVLink domain: share of the ring collectives' bandwidth
    overlap: float  # the share of a compute window that hides communication run alongside it (SMs are shared)
    dispatch_sms: float  # SMs the MoE dispatcher's all-to-all kernels hold (megatron's DeepEP default: 20)
    grouped_half: float  # a grouped GEMM's half-speed rows per expert, over a plain GEMM's
    expert_latency: float  # device seconds per local expert and grouped-GEMM call (its GEMM and fp8 casts)
    gemm_latency: float  # a GEMM kernel's shortest duration
    link_latency: float  # a collective's start-up
    host_layer: float  # host seconds to issue one layer's forward + backward (TE, per micro-batch)
    host_moe: float  # what a MoE block adds to that (router, dispatcher, permutation)
    moe_sync: float  # a dropless MoE layer pass's host-device synchronisation (the token counts per expert)
    host_microbatch: float  # the schedule, embedding and loss per micro-batch
    host_step: float  # the optimizer step's launches, the gradient norm, the step's bookkeeping


# Fitted on the fit split by tools/fit_published.py (its FREE: the GEMM, attention, network, all-to-all and overlap
# shares, moe_sync, grouped_half, host_microbatch; values rounded); assumed: memory 0.80 (what streaming kernels
# reach of HBM), nvlink 0.75 (NCCL bus bandwidth of ring collectives on NVSwitch), dispatch_sms 20 (DeepEP's
# default), expert_latency 8 us, gemm_latency 4 us, link_latency 15 us, host_layer 0.6 ms, host_step 40 ms.
FITTED = GpuConstants(
    gemm_bf16=0.744,
    gemm_fp8=0.57,
    attention=0.4373,
    memory=0.80,
    nvlink=0.75,
    network=1.0,
    alltoall=1.0,
    overlap=0.7987,
    dispatch_sms=20,
    grouped_half=0.5,
    expert_latency=8e-6,
    gemm_latency=4e-6,
    link_latency=15e-6,
    host_layer=0.6e-3,
    host_moe=0.0,
    moe_sync=0.698e-3,
    host_microbatch=0.406e-3,
    host_step=40e-3,
)


def gpu_curve(rate: float, bytes_per_element: float, bandwidth: float, latency: float) -> Curve:
    """A GEMM curve whose half-speed size is the roofline's ridge: a GEMM of `half` rows takes as long to read its
    weight (half x ... bytes over the bandwidth) as to compute, so `half = rate x bytes / (2 x bandwidth)`."""
    return Curve(rate, rate * bytes_per_element / (2 * bandwidth), latency)


def gpu_profile(spec: GpuSpec, c: GpuConstants = FITTED) -> DeviceProfile:
    """The profile of `spec` from its datasheet and the constants `c`."""
    bandwidth = spec.hbm_gbs * 1e9 * c.memory
    bf16 = spec.bf16_tflops * 1e12 * c.gemm_bf16
    gemm = {
        "bf16": gpu_curve(bf16, 2, bandwidth, c.gemm_latency),
        "fp32": gpu_curve(bf16 / 2, 4, bandwidth, c.gemm_latency),  # TF32 tensor cores
    }
    if spec.fp8_tflops:
        gemm["fp8"] = gpu_curve(spec.fp8_tflops * 1e12 * c.gemm_fp8, 1, bandwidth, c.gemm_latency)
    flash = AttentionCurve(spec.bf16_tflops * 1e12 * c.attention, c.gemm_latency)
    # megatron's unfused attention: batched GEMMs on every score (no causal skipping) and the scores through the
    # mask, the fp32 softmax and the bf16 probabilities (12 bytes per score element forward)
    local = AttentionCurve(bf16, 5 * c.gemm_latency, backward=2.0, causal_skip=False, score_bytes=12.0)
    return DeviceProfile(
        name=spec.name,
        kind="gpu",
        memory_bytes=spec.memory_bytes,
        gemm=gemm,
        # TE's grouped GEMM: one launch, each expert at its shape's speed (small groups fill the GPU worse)
        grouped_gemm={
            k: dataclasses.replace(v, half=v.half * c.grouped_half, latency=c.expert_latency) for k, v in gemm.items()
        },
        attention={"flash": flash, "sdpa": flash, "local": local},
        memory_bandwidth=bandwidth,
        intra=Link(c.link_latency, spec.intra_node_gbs * 1e9 * c.nvlink),
        inter=Link(2 * c.link_latency, spec.inter_node_gbs * 1e9 * c.network),
        host=Host(
            per_step=c.host_step,
            per_microbatch=c.host_microbatch,
            per_layer=c.host_layer,
            per_layer_gate=0.1 * c.host_layer,
            per_layer_moe=c.host_moe,
            per_expert=20e-6,
            moe_sync=c.moe_sync,
            serial=False,
        ),
        gpu=spec.name,
        nvlink_domain=spec.nvlink_domain,
        alltoall_efficiency=c.alltoall,
        overlap_efficiency=c.overlap,
        dispatch_compute_share=c.dispatch_sms / spec.sms,
        source="datasheet + constants fitted on published Megatron runs",
    )


def with_constants(**changes: float) -> GpuConstants:
    """FITTED with some constants replaced (for the fit and its tests)."""
    return dataclasses.replace(FITTED, **changes)
