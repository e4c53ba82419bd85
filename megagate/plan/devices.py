"""The GPU table (`GpuSpec`): memory, dense peak FLOP/s, HBM and link bandwidths, for the planner and the trainer's MFU.

Figures are the vendors' datasheet numbers for dense (not 2:4-sparse) tensor-core math and HBM bandwidth. Link
bandwidths are per GPU and per direction: NVLink/NVSwitch (or PCIe where a part has no NVLink) inside an NVLink
domain, and the node's InfiniBand/RoCE share per GPU between domains (one 400 Gb/s NIC per GPU = 50 GB/s is the usual
H100/H200/B200 build, 200 Gb/s on the A100 generation, 100 Gb/s for the PCIe parts). `nvlink_domain` is how many GPUs
one NVLink fabric joins: 8 in a DGX/HGX node, 72 in a GB200 NVL72 rack (whose trays hold 4). Override the rates on
the command line when a cluster differs. What a GPU *achieves* of these peaks is the device profile's business
(megagate.plan.profile).
"""

from __future__ import annotations

from dataclasses import dataclass

from megagate.errors import ConfigError
from megagate.sections import did_you_mean

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator model, as its datasheet gives it."""

    name: str
    memory_bytes: int
    bf16_tflops: float  # dense peak
    fp8_tflops: float | None  # dense peak; None where the part has no FP8 tensor cores
    intra_node_gbs: float  # GB/s per GPU per direction (NVLink, or PCIe)
    inter_node_gbs: float  # GB/s per GPU per direction (the node's IB/RoCE share)
    hbm_gbs: float  # memory bandwidth, GB/s
    cuda_names: tuple[str, ...] = ()  # torch.cuda.get_device_name() strings of this part, exactly
    nvlink_domain: int = 8  # GPUs one NVLink fabric joins
    sms: int = 132  # streaming multiprocessors

    def peak_tflops(self, precision: str) -> float:
        """The dense peak for a training precision (fp32 runs on TF32 tensor cores at half the bf16 rate)."""
        if precision == "fp8":
            return self.fp8_tflops or self.bf16_tflops
        if precision == "fp32":
            return self.bf16_tflops / 2
        return self.bf16_tflops

    def mfu_peaks(self, precision: str) -> dict[str, float]:
        """The peaks (TFLOP/s) a run's MFU is logged against, keyed by the metric's name, which names the peak's
        precision: fp32 -> mfu_tf32; bf16 -> mfu_bf16; fp8 -> mfu_fp8 and mfu_bf16 (TE runs attention and the
        norms in bf16, and the bf16 figure compares with bf16 runs); fp8 on a part without FP8 -> mfu_bf16 only."""
        if precision == "fp32":
            return {"mfu_tf32": self.bf16_tflops / 2}
        peaks = {"mfu_bf16": self.bf16_tflops}
        if precision == "fp8" and self.fp8_tflops:
            peaks = {"mfu_fp8": self.fp8_tflops, **peaks}
        return peaks


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("h100-sxm", 80 * GB, 989.0, 1979.0, 450.0, 50.0, 3350.0, ("NVIDIA H100 80GB HBM3",)),
        GpuSpec("h100-pcie", 80 * GB, 756.0, 1513.0, 64.0, 25.0, 2000.0, ("NVIDIA H100 PCIe",), sms=114),
        GpuSpec("h100-nvl", 94 * GB, 835.0, 1671.0, 300.0, 50.0, 3900.0, ("NVIDIA H100 NVL",)),
        GpuSpec("h200", 141 * GB, 989.0, 1979.0, 450.0, 50.0, 4800.0, ("NVIDIA H200",)),
        GpuSpec("h200-nvl", 141 * GB, 835.0, 1671.0, 450.0, 50.0, 4800.0, ("NVIDIA H200 NVL",)),
        GpuSpec("h20", 96 * GB, 148.0, 296.0, 450.0, 50.0, 4000.0, ("NVIDIA H20",), sms=78),
        GpuSpec("gh200", 96 * GB, 989.0, 1979.0, 450.0, 50.0, 4000.0, ("NVIDIA GH200 480GB", "NVIDIA GH200 96GB HBM3")),
        GpuSpec("gh200-144gb", 144 * GB, 989.0, 1979.0, 450.0, 50.0, 4900.0, ("NVIDIA GH200 144G HBM3e",)),
        GpuSpec(
            "a100-40gb",
            40 * GB,
            312.0,
            None,
            300.0,
            25.0,
            1555.0,
            ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"),
            sms=108,
        ),
        GpuSpec(
            "a100-80gb",
            80 * GB,
            312.0,
            None,
            300.0,
            25.0,
            2039.0,
            ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"),
            sms=108,
        ),
        GpuSpec("b200", 180 * GB, 2250.0, 4500.0, 900.0, 50.0, 8000.0, ("NVIDIA B200",), sms=148),
        GpuSpec("gb200", 186 * GB, 2500.0, 5000.0, 900.0, 50.0, 8000.0, ("NVIDIA GB200",), nvlink_domain=72, sms=148),
        GpuSpec("l40s", 48 * GB, 362.0, 733.0, 32.0, 12.5, 864.0, ("NVIDIA L40S",), sms=142),
        GpuSpec("l40", 48 * GB, 181.0, 362.0, 32.0, 12.5, 864.0, ("NVIDIA L40",), sms=142),
    )
}


def gpu_spec(name: str) -> GpuSpec:
    """The GPU called `name` (case-insensitive; "h100" means the SXM part), or a one-line ConfigError."""
    key = name.lower().replace("_", "-").replace(" ", "-")
    key = {"h100": "h100-sxm", "a100": "a100-80gb", "a100-40": "a100-40gb", "a100-80": "a100-80gb"}.get(key, key)
    if key not in GPUS:
        raise ConfigError(f"--gpu {name!r} is not a known GPU; known: {', '.join(GPUS)}{did_you_mean(key, GPUS)}")
    return GPUS[key]


def from_cuda_name(cuda_name: str) -> GpuSpec | None:
    """The table entry of a `torch.cuda.get_device_name()` string, matched exactly (a substring would give the
    "NVIDIA H100 PCIe" the SXM part's peak and the "NVIDIA L40S" the L40's); None for a part not in the table."""
    name = " ".join(cuda_name.split())
    return next((g for g in GPUS.values() if name in g.cuda_names), None)
