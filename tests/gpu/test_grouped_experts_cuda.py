"""TorchGroupedMLP on one GPU in bf16 (skipped without CUDA): torch's CUDA grouped GEMM (sm90+) against megatron's
SequentialMLP with the same weights, forward and gradients, uneven counts with an idle expert."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def world():
    from megagate.distributed import parallel

    with parallel.single_process():
        yield


def _experts(grouped: bool) -> torch.nn.Module:
    from megagate.model import gate as gates
    from megagate.model import init
    from megagate.model.build import build_gpt_model, transformer_config
    from megagate.model.presets import model_preset

    mc = model_preset(
        "tiny-moe",
        gate=gates.preset("baseline"),
        num_layers=1,
        hidden_size=256,
        head_dim=64,
        num_experts=8,
        moe_ffn_hidden_size=512,
    )
    model = build_gpt_model(mc, transformer_config(mc, params_dtype=torch.bfloat16, moe_grouped_gemm=grouped))
    init.initialize([model], 0, mc.init_method_std, mc.num_layers)
    return model.to(torch.bfloat16).cuda().decoder.layers[0].mlp.experts


def test_grouped_experts_cuda_bf16(world):
    from megagate.model.experts import TorchGroupedMLP, unsupported_reason

    reason = unsupported_reason("cuda", torch.bfloat16, (256, 1024, 512))
    if reason is not None:
        pytest.skip(reason)  # e.g. a GPU before sm90: the module falls back per expert (covered on CPU)
    counts = [300, 0, 17, 1, 512, 64, 0, 130]
    results = []
    for grouped in (False, True):
        experts = _experts(grouped)
        assert isinstance(experts, TorchGroupedMLP) == grouped
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(sum(counts), 256, generator=gen).to(torch.bfloat16).cuda().requires_grad_()
        probs = torch.rand(sum(counts), generator=gen).to(torch.bfloat16).cuda().requires_grad_()
        out, _ = experts(x, torch.tensor(counts), probs)
        (out.float() * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
        grads = {n: p.grad.float() for n, p in experts.named_parameters()}
        results.append({"out": out.float(), "x": x.grad.float(), "probs": probs.grad.float(), **grads})
    sequential, grouped = results
    for key, value in sequential.items():
        scale = value.abs().max().item() + 1e-6
        assert (grouped[key] - value).abs().max().item() <= 2e-2 * scale, key
    assert not grouped["local_experts.1.linear_fc1.weight"].any()  # the idle expert
