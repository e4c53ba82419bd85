"""The GPU table behind the planner and the trainer's MFU: exact torch.cuda.get_device_name() strings, the peak of
each precision, and the MFU metrics a run logs (named by the peak's precision)."""

import pytest

from megagate.plan.devices import GPUS, from_cuda_name
from megagate.train.metric_writer import mfu_peaks


@pytest.mark.parametrize(
    "cuda_name, device, bf16",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm", 989.0),
        ("NVIDIA H100 PCIe", "h100-pcie", 756.0),  # a substring match gave it the SXM part's 989
        ("NVIDIA H100 NVL", "h100-nvl", 835.0),
        ("NVIDIA H200", "h200", 989.0),
        ("NVIDIA H200 NVL", "h200-nvl", 835.0),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb", 312.0),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb", 312.0),
        ("NVIDIA L40S", "l40s", 362.0),
        ("NVIDIA L40", "l40", 181.0),  # and "L40" no longer catches the L40S, nor the reverse
        ("NVIDIA B200", "b200", 2250.0),
        ("NVIDIA GB200", "gb200", 2500.0),
        ("NVIDIA GH200 480GB", "gh200", 989.0),
        ("  NVIDIA  H100 80GB HBM3 ", "h100-sxm", 989.0),  # whitespace only is forgiven
    ],
)
def test_exact_device_names(cuda_name: str, device: str, bf16: float) -> None:
    found = from_cuda_name(cuda_name)
    assert found is not None and found.name == device and found.bf16_tflops == bf16


@pytest.mark.parametrize("cuda_name", ["NVIDIA H100", "H100 PCIe", "NVIDIA L40S-X", "Tesla V100-SXM2-16GB", ""])
def test_unknown_names_are_not_guessed(cuda_name: str) -> None:
    assert from_cuda_name(cuda_name) is None


def test_every_name_is_one_device() -> None:
    names = [n for d in GPUS.values() for n in d.cuda_names]
    assert len(names) == len(set(names)) and all(n.startswith("NVIDIA ") for n in names)


def test_mfu_peaks_name_their_precision() -> None:
    h100 = "NVIDIA H100 80GB HBM3"
    assert mfu_peaks(h100, "bf16") == ({"mfu_bf16": 989.0}, None)
    assert mfu_peaks(h100, "fp8") == ({"mfu_fp8": 1979.0, "mfu_bf16": 989.0}, None)  # both: FP8 is not all GEMMs
    assert mfu_peaks(h100, "fp32") == ({"mfu_tf32": 494.5}, None)
    assert mfu_peaks("NVIDIA A100-SXM4-80GB", "fp8") == ({"mfu_bf16": 312.0}, None)  # no FP8 cores: bf16 only
    assert mfu_peaks("NVIDIA H100 PCIe", "bf16") == ({"mfu_bf16": 756.0}, None)
    assert mfu_peaks(None, "bf16") == ({}, None)  # CPU: nothing, silently


def test_unknown_gpu_logs_no_mfu_and_one_line() -> None:
    peaks, note = mfu_peaks("NVIDIA RTX 6000 Ada Generation", "bf16")
    assert peaks == {} and note is not None and "\n" not in note
    assert "'NVIDIA RTX 6000 Ada Generation'" in note and "MFU is not logged" in note
