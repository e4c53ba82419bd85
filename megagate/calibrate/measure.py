"""Kernel measurements of this machine: GEMMs by shape and dtype, experts by tokens per expert, core attention by
kernel (megagate's SDPA module and megatron's local DotProductAttention), memory bandwidth."""

from __future__ import annotations

import time

import torch

from megagate.calibrate.timing import median_seconds, paired_median

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def gemm_shapes(gpu: bool) -> list[tuple[int, int, int]]:
    """(m, n, k) of the sweep, small to large (the budget cuts the large end first)."""
    if gpu:
        rows, sides = (64, 256, 1024, 4096, 16384), ((1024, 1024), (4096, 4096), (4096, 14336), (14336, 4096))
    else:
        rows, sides = (4, 16, 64, 256, 1024, 2048), ((64, 64), (64, 256), (256, 64), (256, 256), (512, 1024))
    return sorted(((m, n, k) for m in rows for n, k in sides), key=lambda s: s[0] * s[1] * s[2])


def gemm_samples(dtype: str, until: float) -> list[tuple[float, float, float, float]]:
    """(m, n, k, seconds) of torch.matmul [m, k] x [k, n] in `dtype`, up to the perf_counter() time `until`."""
    dev, dt = device(), DTYPES[dtype]
    out = []
    for m, n, k in gemm_shapes(dev.type == "cuda"):
        if time.perf_counter() > until and len(out) >= 6:
            break
        a = torch.randn(m, k, device=dev, dtype=dt)
        b = torch.randn(k, n, device=dev, dtype=dt)
        out.append((m, n, k, median_seconds(lambda a=a, b=b: torch.matmul(a, b), until=until)))
    return out


def grouped_samples(dtype: str, until: float) -> dict[str, list[tuple[int, int, int, int, float]]]:
    """Experts' fc1-shaped GEMMs by tokens per expert: (experts, tokens per expert, n, k, seconds) one by one
    (megatron's SequentialMLP) and, where torch has it on this device, in one grouped GEMM (megagate's
    TorchGroupedMLP)."""
    from megagate.model.experts import grouped_mm_function

    dev, dt = device(), DTYPES[dtype]
    gpu = dev.type == "cuda"
    experts, n, k = (16, 1536, 2048) if gpu else (8, 128, 64)
    grouped = grouped_mm_function()
    out: dict[str, list] = {"loop": [], "grouped": []}
    for tokens in (1, 8, 32, 128, 512) if not gpu else (16, 64, 256, 1024, 4096):
        if time.perf_counter() > until and len(out["loop"]) >= 3:  # a curve needs a few sizes, whatever the budget
            break
        x = torch.randn(experts * tokens, k, device=dev, dtype=dt)
        w = torch.randn(experts, k, n, device=dev, dtype=dt)
        parts = list(x.split(tokens))

        def loop(parts=parts, w=w):
            return [torch.matmul(p, w[i]) for i, p in enumerate(parts)]

        out["loop"].append((experts, tokens, n, k, median_seconds(loop, until=until)))
        if grouped is not None:
            offs = torch.arange(tokens, experts * tokens + 1, tokens, device=dev, dtype=torch.int32)
            try:
                seconds = median_seconds(lambda x=x, w=w, offs=offs, g=grouped: g(x, w, offs=offs), until=until)
            except (RuntimeError, NotImplementedError):
                grouped = None  # no grouped kernel for this device / dtype
                continue
            out["grouped"].append((experts, tokens, n, k, seconds))
    return out


def _add_bandwidth(elements: int, until: float) -> float:
    dev = device()
    a, b = torch.randn(elements, device=dev), torch.randn(elements, device=dev)
    c = torch.empty_like(a)
    return 3 * 4 * elements / median_seconds(lambda: torch.add(a, b, out=c), until=until)


def largest_cache() -> int:
    """Bytes of the CPU's largest cache level (0 if unknown)."""
    sizes = []
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size", encoding="utf-8") as f:
                text = f.read().strip()
        except OSError:
            break
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=0)


def bandwidth(until: float) -> tuple[float, float | None, int]:
    """(bytes/s of a large element-wise add, which reads two tensors and writes one; on a CPU also the bytes/s when
    the tensors stay in its cache and the largest tensor size that does), for memory-bound kernels."""
    gpu = device().type == "cuda"
    large = _add_bandwidth((256 if gpu else 16) * 2**20, until)
    cache = 0 if gpu else largest_cache() // 8
    if not cache:
        return large, None, 0
    return large, _add_bandwidth(min(cache, 2**20) // 4, until), cache


def attention_shapes(gpu: bool) -> list[tuple[int, int, int, int]]:
    """(b, heads, s, d) of the sweep."""
    if gpu:
        return [(1, h, s, 128) for h in (8, 32) for s in (512, 1024, 2048, 4096)]
    return [(1, h, s, d) for h in (2, 8) for s in (32, 128, 256, 512) for d in (16, 64)]


def attention_samples(kernel: str, dtype: str, until: float) -> list[tuple[int, int, int, int, float, float]]:
    """(b, heads, s, d, forward seconds, backward seconds) of causal self-attention through the real module of
    `kernel`: "sdpa" megagate's SDPACoreAttention, "local" megatron's DotProductAttention (needs megatron's
    parallel state: calibrate runs this inside a one-process world)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megagate import config_reader
    from megagate.model.core_attention import SDPACoreAttention
    from megagate.run_setup import resolve

    dev, dt = device(), DTYPES[dtype]
    out = []
    for b, heads, s, d in attention_shapes(dev.type == "cuda"):
        if time.perf_counter() > until and len(out) >= 4:
            break
        raw = {
            "model": {
                "preset": "tiny",
                "num_layers": 1,
                "hidden_size": heads * d,
                "num_attention_heads": heads,
                "num_query_groups": heads,
                "head_dim": d,
                "ffn_hidden_size": 4 * heads * d,
                "vocab_size": 128,
                "max_sequence_length": s,
                "gate": {"preset": "baseline"},
            },
            "train": {"micro_batch_size": b, "global_batch_size": b, "seq_length": s, "precision": dtype},
            "data": {"mock": True},
        }
        setup = resolve(config_reader.from_dict(raw, environment=False), 1)
        # the unfused softmax: megatron's fused kernel needs apex's scaled_masked_softmax_cuda
        config = setup.transformer_config(masked_softmax_fusion=False)
        cls = SDPACoreAttention if kernel == "sdpa" else DotProductAttention
        module = cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self").to(dev)
        q, k, v = (torch.randn(s, b, heads, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
        grad = torch.randn(s, b, heads * d, device=dev, dtype=dt)

        def fwd(module=module, q=q, k=k, v=v):
            return module(q, k, v, None, attn_mask_type=AttnMaskType.causal)

        def bwd(o, grad=grad):
            o.backward(grad)

        f, bw = paired_median(fwd, bwd, samples=3 if time.perf_counter() > until else 5)
        out.append((b, heads, s, d, f, bw))
    return out
