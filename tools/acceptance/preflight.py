"""Part `preflight`: is this the machine the acceptance needs, and what can it do?

CUDA present (without it the 1.7B-shaped parts would run on the CPU: they are skipped instead), the device, its
memory and compute capability, the versions (torch, CUDA, megatron-core, Transformer Engine and apex's kernels,
both expected absent), the perf settings the trainer will resolve here (what is off for a missing kernel, and why),
a one-second 8192³ bf16 matrix product as the measured ceiling that MFU is also reported against, and which of
torch's SDPA kernels run the model's attention shape (causal, grouped KV heads, bf16), forward and backward.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time

from tools.acceptance import child

GPU_ATTENTION = {"heads": 16, "groups": 8, "head_dim": 128, "seq": 4096, "micro_batch": 2}  # 1.7B-28L's
SMOKE_ATTENTION = {"heads": 4, "groups": 2, "head_dim": 16, "seq": 64, "micro_batch": 1}  # the tiny preset's


def nvidia_smi() -> str | None:
    """nvidia-smi's one-line view of the GPU (name, driver, memory, max SM clock), None where it is absent."""
    query = "name,driver_version,memory.total,clocks.max.sm"
    try:
        proc = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() or None


def matmul_ceiling(smoke: bool, seconds: float = 1.0) -> dict:
    """TFLOP/s of repeated n³ matrix products on random data for ~`seconds` (n = 8192 bf16 on GPU; n = 256 fp32
    on CPU in smoke mode): median and best of batches of 10, after 3 warm-ups."""
    import torch

    cuda = torch.cuda.is_available() and not smoke
    n, dtype, device = (8192, torch.bfloat16, "cuda") if cuda else (256, torch.float32, "cpu")
    seconds = seconds if cuda else 0.2
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    c = torch.empty_like(a)
    for _ in range(3):
        torch.mm(a, b, out=c)
    per_product: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(per_product) < 3:
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(10):
                torch.mm(a, b, out=c)
            end.record()
            end.synchronize()
            per_product.append(begin.elapsed_time(end) / 1e3 / 10)
        else:
            t0 = time.perf_counter()
            for _ in range(10):
                torch.mm(a, b, out=c)
            per_product.append((time.perf_counter() - t0) / 10)
    flops = 2 * n**3
    return {
        "n": n,
        "dtype": str(dtype).removeprefix("torch."),
        "products": 10 * len(per_product),
        "tflops_median": round(flops / statistics.median(per_product) / 1e12, 1 if cuda else 4),
        "tflops_best": round(flops / min(per_product) / 1e12, 1 if cuda else 4),
    }


def sdpa_backends(smoke: bool, heads: int, groups: int, head_dim: int, seq: int, micro_batch: int) -> dict:
    """For each of torch's SDPA kernels: does it run the model's attention (causal, GQA as megagate's SDPA core
    attention calls it, forward + backward), and in how many ms (median of 3 after a warm-up)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cuda = torch.cuda.is_available() and not smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    q = torch.randn(micro_batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (
        torch.randn(micro_batch, groups, seq, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in "kv"
    )
    kernels = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    found: dict[str, dict] = {"shape": f"b={micro_batch} np={heads} ng={groups} s={seq} hn={head_dim} {dtype}"}
    for name, backend in kernels.items():
        try:
            times = []
            for _ in range(4):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                with sdpa_kernel([backend]):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups != heads)
                out.float().sum().backward()
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            found[name] = {"runs": True, "fwd_bwd_ms": round(statistics.median(times[1:]) * 1e3, 2)}
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot run this shape says why, in one line
            found[name] = {"runs": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        q.grad = k.grad = v.grad = None
    return found


def body(args, record: child.Record) -> None:
    import torch

    cuda = torch.cuda.is_available()
    record.update(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda_build=torch.version.cuda,
        cuda_available=cuda,
        cpus=os.cpu_count(),
        nvidia_smi=nvidia_smi(),
    )
    if cuda:
        props = torch.cuda.get_device_properties(0)
        record.update(
            device=torch.cuda.get_device_name(0),
            device_count=torch.cuda.device_count(),
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
        )
    problems = []
    if not cuda and not args.smoke:
        problems.append(
            f"CUDA is not available (torch {torch.__version__}, built for CUDA {torch.version.cuda}): the 1.7B-shaped "
            "parts would run on the CPU"
        )
    try:
        import megatron.core

        record.update(megatron_core=megatron.core.__version__)
    except Exception as exc:  # noqa: BLE001
        record.update(megatron_core=None)
        problems.append(f"megatron-core does not import: {type(exc).__name__}: {exc}")
    if record.data.get("megatron_core"):
        try:
            record.update(**machine_and_perf(args))
        except Exception as exc:  # noqa: BLE001 - named; the measurements below still run
            problems.append(f"the acceptance config does not resolve here: {type(exc).__name__}: {exc}")
    record.update(matmul=matmul_ceiling(args.smoke))
    if cuda or args.smoke:
        # the config's attention shape (known where megatron-core imports), else the acceptance model's (toy in smoke)
        default = SMOKE_ATTENTION if args.smoke else GPU_ATTENTION
        shape = {**default, **record.data.get("shape", {})}
        record.update(sdpa=sdpa_backends(args.smoke, *(shape[k] for k in GPU_ATTENTION)))
    if problems:
        record.fail("; ".join(problems))


def machine_and_perf(args) -> dict:
    """What megagate sees here: TE and apex's kernels, the datasheet peak, the perf settings in force for the
    acceptance config and the model shape the SDPA check uses."""
    from megagate import config_reader, extensions
    from megagate.model.kernels import transformer_engine_available
    from megagate.plan.devices import from_cuda_name
    from megagate.run_setup import resolve

    cfg = config_reader.load(str(args.config), args.set, environment=False)
    setup = resolve(cfg, 1)  # as the training will: its perf settings on this machine (and the GPU's refusals)
    known = None
    if setup.machine.gpu:
        import torch

        known = from_cuda_name(torch.cuda.get_device_name(0))
    m, t = cfg.model, cfg.train
    return {
        "transformer_engine": transformer_engine_available(),
        "apex_softmax_kernels": extensions.available(extensions.FUSED_SOFTMAX),
        "apex_gradient_accumulation": extensions.available(extensions.GRADIENT_ACCUMULATION),
        "device_table": None if known is None else known.name,
        "datasheet_bf16_tflops": None if known is None else known.peak_tflops("bf16"),
        "perf_in_force": setup.describe(),
        "perf_gpu_line": setup.perf.gpu_line(),
        "shape": {
            "preset": (cfg.raw.get("model") or {}).get("preset"),
            "layers": m.num_layers,
            "hidden": m.hidden_size,
            "ffn": m.effective_ffn_hidden_size,
            "vocab": m.vocab_size,
            "heads": m.num_attention_heads,
            "groups": m.num_query_groups,
            "head_dim": m.head_dim,
            "seq": t.seq_length,
            "micro_batch": t.micro_batch_size,
        },
    }


def options(p) -> None:
    p.add_argument("--config", required=True, help="the acceptance's YAML config")
    p.add_argument("--set", action="append", default=[], help="a config override key=value (repeatable)")


if __name__ == "__main__":
    child.main(__doc__.splitlines()[0], body, options)
