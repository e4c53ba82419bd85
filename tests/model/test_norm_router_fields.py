"""The architecture fields the Hugging Face formats need: zero-centred norms and the MoE top-k normalisation.

Their validation (one-line errors), and that a zero-centred model is today's model at initialisation, on one
process and under tensor parallelism (norm weights replicated). Their numerics against transformers' Qwen3-Next and
Qwen3-MoE are tests/interop/test_hf_logits.py's.
"""

from __future__ import annotations

import pytest
import torch

from helpers import distributed, tiny_model
from megagate.errors import ConfigError
from megagate.model.norms import ZeroCenteredRMSNorm
from megagate.model.presets import model_preset

SEQ = 10


@pytest.mark.parametrize(
    ("preset", "overrides", "name"),
    [
        ("tiny", {"norm_zero_centered": "yes"}, "norm_zero_centered"),
        ("tiny", {"norm_zero_centered": True, "normalization": "LayerNorm"}, "normalization=RMSNorm"),
        ("tiny", {"moe_router_norm_topk": False}, "num_experts"),
        ("tiny-moe", {"moe_router_norm_topk": 0}, "moe_router_norm_topk"),
    ],
)
def test_new_fields_are_validated_in_one_line(preset, overrides, name):
    with pytest.raises(ConfigError) as e:
        model_preset(preset, **overrides)
    assert name in str(e.value) and "\n" not in str(e.value)
    assert model_preset("tiny-moe", moe_router_norm_topk=False).moe_router_norm_topk is False


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    ids = tiny_model.text_tokens(2, SEQ)
    return ids, torch.arange(SEQ).unsqueeze(0).expand(2, -1)


@torch.no_grad()
def test_zero_centered_model_equals_plain_model_at_init(megatron_world):
    plain = tiny_model.build("g1-elementwise", seed=3).eval()
    centred = tiny_model.build("g1-elementwise", seed=3, norm_zero_centered=True).eval()
    norms = {n: m for n, m in centred.named_modules() if isinstance(m, ZeroCenteredRMSNorm)}
    # input, pre-MLP, q and k norms of both layers and the final norm
    assert len(norms) == 2 * 4 + 1 and all(not m.weight.any() for m in norms.values())
    ids, positions = _tokens()
    torch.testing.assert_close(centred(ids, positions, None), plain(ids, positions, None), rtol=0, atol=1e-6)
    # and the weight is (1 + w): the same offset on every weight moves the outputs the same way
    for (name, p), q in zip(centred.named_parameters(), plain.parameters()):
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.add_(0.25)
            q.add_(0.25)
    torch.testing.assert_close(centred(ids, positions, None), plain(ids, positions, None), rtol=0, atol=1e-6)


def _tp2_logits(rank: int, world_size: int) -> tuple[torch.Tensor, list[str]]:
    from megagate.distributed.parallel import initialize_model_parallel
    from megagate.model import gate as gates
    from megagate.model import init
    from megagate.model.build import build_gpt_model, transformer_config
    from megagate.model.model_config import ParallelConfig

    parallel = ParallelConfig(tensor_model_parallel_size=world_size)
    initialize_model_parallel(parallel, seed=5)
    mc = model_preset("tiny", gate=gates.preset("g1-elementwise"), norm_zero_centered=True)
    model = build_gpt_model(mc, transformer_config(mc, parallel))
    init.initialize([model], 3, mc.init_method_std, mc.num_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # replicated: every rank adds the same values
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    ids, positions = _tokens()
    with torch.no_grad():
        logits = model.eval()(ids, positions, None)  # this rank's vocabulary shard
    kinds = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith("norm") and m._parameters})
    return logits, kinds


@pytest.mark.distributed
def test_zero_centered_model_under_tensor_parallelism(megatron_world, tmp_path):
    results = distributed.run(_tp2_logits, 2, tmp_path)
    reference = tiny_model.build("g1-elementwise", seed=3, norm_zero_centered=True).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
        full = reference(*_tokens(), None)
    shards = torch.cat([logits for logits, _ in results], dim=-1)
    assert results[0][1] == ["ZeroCenteredRMSNorm"]
    torch.testing.assert_close(shards, full, rtol=0, atol=1e-5)
