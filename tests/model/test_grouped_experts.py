"""TorchGroupedMLP (torch grouped-GEMM experts) equals megatron's SequentialMLP: module, whole model, checkpoints.

The module test feeds both the same tokens (uneven counts, an expert with no tokens) and compares outputs and the
gradients of input, probabilities and every expert weight; the model test compares loss and every gradient of two
tiny MoE GPT models that differ only in `moe_grouped_gemm`. EP, initialisation and cross-layout checkpoints are
tests/train/test_init_experts.py's.
"""

from __future__ import annotations

import logging

import pytest
import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from helpers import tiny_model
from megagate.model import gate as gates
from megagate.model import init
from megagate.model.build import build_gpt_model, transformer_config
from megagate.model.experts import TorchGroupedMLP, _probe, unsupported_reason
from megagate.model.presets import model_preset

SEQ = 12


def _moe_model(grouped: bool, seed: int = 4, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    mc = model_preset("tiny-moe", gate=gates.preset("g1-elementwise"), num_layers=1, **overrides)
    config = transformer_config(mc, params_dtype=dtype, moe_grouped_gemm=grouped)
    model = build_gpt_model(mc, config)
    init.initialize([model], seed, mc.init_method_std, mc.num_layers)
    return model.to(dtype)


def _experts_inputs(counts: list[int], hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), hidden, generator=gen).to(dtype).requires_grad_()
    probs = torch.rand(sum(counts), generator=gen).to(dtype).requires_grad_()
    return x, torch.tensor(counts), probs


def _run_experts(experts: torch.nn.Module, counts: list[int], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    x, tokens_per_expert, probs = _experts_inputs(counts, experts.config.hidden_size, dtype)
    out, bias = experts(x, tokens_per_expert, probs)
    assert bias is None and out.shape == x.shape
    # a non-uniform upstream gradient (a plain .sum() would hand the grouped GEMM a stride-0 gradient)
    (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = {"out": out.detach().float(), "x.grad": x.grad.float(), "probs.grad": probs.grad.float()}
    grads |= {n: p.grad.float() for n, p in experts.named_parameters()}
    return grads


@pytest.mark.parametrize(
    ("dtype", "counts", "atol"),
    [
        (torch.float32, [5, 0, 9, 2], 1e-5),  # uneven, one expert without tokens
        (torch.float32, [0, 0, 16, 0], 1e-5),  # all tokens to one expert
        (torch.float32, [0, 0, 0, 0], 0.0),  # no tokens on this rank at all
        (torch.bfloat16, [7, 1, 0, 24], 2e-2),  # bf16: the grouped kernel runs (widths 64: 16-byte rows)
    ],
)
def test_grouped_experts_equal_sequential_mlp(megatron_world, dtype, counts, atol):
    seq_model, grp_model = _moe_model(False, dtype=dtype), _moe_model(True, dtype=dtype)
    seq, grp = seq_model.decoder.layers[0].mlp.experts, grp_model.decoder.layers[0].mlp.experts
    assert type(seq) is SequentialMLP and type(grp) is TorchGroupedMLP
    # the same parameter names, shapes and megatron attributes, and (same seed) the same initial values
    for (n1, p1), (n2, p2) in zip(seq.named_parameters(), grp.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
        assert getattr(p1, "allreduce", None) == getattr(p2, "allreduce", None)
        assert getattr(p1, "tensor_model_parallel", None) == getattr(p2, "tensor_model_parallel", None)
    assert unsupported_reason("cpu", dtype, (64, 128, 64)) is None  # the grouped path, not the fallback
    a, b = _run_experts(seq, counts, dtype), _run_experts(grp, counts, dtype)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=atol, msg=key)
    if sum(counts) and 0 in counts:  # an expert without tokens gets exactly zero gradient
        idle = counts.index(0)
        assert not b[f"local_experts.{idle}.linear_fc1.weight"].any()
    if sum(counts):
        assert a["local_experts.0.linear_fc2.weight"].abs().sum() + a["local_experts.2.linear_fc2.weight"].abs().sum()


def test_kernel_probe_is_not_fooled_by_no_grad():
    # the first forward may be an evaluation: the one-time kernel probe must still see the backward work
    _probe.cache_clear()
    with torch.inference_mode():
        assert unsupported_reason("cpu", torch.float32, (64, 128, 64)) is None
    with torch.no_grad():
        assert unsupported_reason("cpu", torch.bfloat16, (64, 128, 64)) is None


def test_misaligned_widths_fall_back_per_expert(megatron_world, caplog):
    # 24-byte fp32 rows (ffn 6): torch's grouped GEMM refuses them, so the experts loop, with the reason logged once
    reason = unsupported_reason("cpu", torch.float32, (64, 12, 6))
    assert reason is not None and "[6]" in reason and "divisible by 4" in reason
    assert "[20]" in unsupported_reason("cpu", torch.bfloat16, (64, 20, 64))
    seq = _moe_model(False, moe_ffn_hidden_size=6).decoder.layers[0].mlp.experts
    grp = _moe_model(True, moe_ffn_hidden_size=6).decoder.layers[0].mlp.experts
    with caplog.at_level(logging.WARNING, logger="megagate.model.experts"):
        a, b = _run_experts(seq, [3, 0, 5, 1], torch.float32), _run_experts(grp, [3, 0, 5, 1], torch.float32)
    assert sum("per-expert GEMMs instead of grouped GEMM" in r.message for r in caplog.records) == 1
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-6, msg=key)


def test_grouped_moe_model_equals_sequential(megatron_world):
    """A tiny MoE GPT (top-2 of 4 experts, aux and z losses on) built both ways: same loss, same gradients."""
    ids = tiny_model.text_tokens(2, SEQ + 1)
    tokens, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    positions = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    results = []
    for grouped in (False, True):
        model = _moe_model(grouped)
        loss = model(tokens, positions, None, labels=labels)
        loss.mean().backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_s, grads_s), (loss_g, grads_g) = results
    torch.testing.assert_close(loss_g, loss_s, rtol=0, atol=1e-5)
    assert grads_s.keys() == grads_g.keys() and any("local_experts.3" in n for n in grads_g)
    for name in grads_s:
        torch.testing.assert_close(grads_g[name], grads_s[name], rtol=0, atol=1e-5, msg=name)


def test_benchmark_quick(megatron_world, capsys):
    """benchmarks/bench_grouped_experts.py --quick runs in this process and both layers compute the same output."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_grouped_experts.py"
    spec = importlib.util.spec_from_file_location("bench_grouped_experts", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_grouped_experts", bench)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "sequential median" in out and "grouped    median" in out
    diff = float(out.split("max abs output difference:")[1])
    assert diff < 1e-5
