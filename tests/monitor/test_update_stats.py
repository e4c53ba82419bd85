"""Spike precursors on a real tiny megatron model: the per-layer update ratio (megagate.monitor.update_stats) against
a hand computation over named parameters, and the output layer's log Z (megagate.monitor.diagnostics) against
torch.logsumexp of the logits the model returns."""

from __future__ import annotations

import math
import re

import pytest
import torch

from helpers import tiny_model
from megagate.monitor import diagnostics as D
from megagate.monitor import update_stats


def by_layer(model: torch.nn.Module) -> dict[str, list[str]]:
    """Parameter names grouped as the ratio groups them: "0", "1" (decoder.layers.N.) and "other"."""
    groups: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        m = re.search(r"decoder\.layers\.(\d+)\.", name)
        groups.setdefault(m.group(1) if m else "other", []).append(name)
    return groups


def test_known_changes_give_known_ratios(megatron_world):
    model = tiny_model.build("g1-elementwise", seed=0)
    ratio = update_stats.UpdateRatio(num_layers=2)
    ratio.snapshot([model])
    with torch.no_grad():
        for p in model.decoder.layers[1].parameters():
            p.mul_(1.1)  # every weight of layer 1 x 1.1: ||update|| / ||weights|| = 0.1 exactly
    result = ratio.measure([model])
    assert result["1"] == pytest.approx(0.1, rel=1e-6)  # fp32 weights: x 1.1 rounds per element
    assert result["0"] == 0.0 and result["other"] == 0.0
    with pytest.raises(RuntimeError, match="without a snapshot"):
        ratio.measure([model])  # a snapshot serves one measurement


def test_adam_step_ratios_equal_the_hand_computation(megatron_world):
    model = tiny_model.build("g1-elementwise", seed=1)
    params = dict(model.named_parameters())
    tokens = tiny_model.text_tokens(2, 16)
    position_ids = torch.arange(16).expand(2, -1)
    loss = model(tokens, position_ids, None, labels=tokens).float().mean()
    loss.backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    before = {n: p.detach().clone() for n, p in params.items()}
    ratio = update_stats.UpdateRatio(num_layers=2)
    ratio.snapshot([model])
    optimizer.step()
    result = ratio.measure([model])
    for group, names in by_layer(model).items():
        update = math.sqrt(sum(float((params[n].detach() - before[n]).double().square().sum()) for n in names))
        weights = math.sqrt(sum(float(before[n].double().square().sum()) for n in names))
        assert result[group] == pytest.approx(update / weights, rel=1e-9), group
    # Adam moves every element by ~lr in its first step: the ratio is ~lr / RMS(weight), far from 0
    assert all(r > 1e-3 for r in result.values()) and sorted(result) == ["0", "1", "other"]


def test_overlap_param_gather_is_not_measured(megatron_world):
    from megatron.core.distributed import DistributedDataParallelConfig

    model = tiny_model.build("baseline", seed=0)
    assert update_stats.supported([model])
    model.ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True)
    assert not update_stats.supported([model])


def test_log_z_of_the_output_layer_equals_logsumexp_of_the_logits(megatron_world):
    model = tiny_model.build("g1-headwise", seed=4)
    model.eval()
    tokens = tiny_model.text_tokens(2, 24, index=3)
    position_ids = torch.arange(24).expand(2, -1)
    with torch.no_grad():
        logits = model(tokens, position_ids, None)  # [b, s, V]
    expected = torch.logsumexp(logits.double(), dim=-1)
    diags, out = D.collect_with_output(model, tokens, position_ids)
    assert len(diags) == 2
    assert out["log_z_mean"] == pytest.approx(float(expected.mean()), rel=1e-5)
    assert out["log_z_max"] == pytest.approx(float(expected.max()), rel=1e-5)
    # with these initial weights log Z is near log V (logits ~ 0): a sanity check on the scale, not the definition
    assert abs(out["log_z_mean"] - math.log(logits.shape[-1])) < 1.0


def test_log_z_in_chunks_equals_logsumexp():
    """More tokens than one fp32 chunk (LOG_Z_CHUNK): the chunks join in token order."""
    from megagate.monitor import attention_math

    logits = torch.randn(attention_math.LOG_Z_CHUNK + 7, 3, 11, generator=torch.Generator().manual_seed(0)) * 4
    torch.testing.assert_close(attention_math.log_z(logits.bfloat16()), torch.logsumexp(logits.bfloat16().float(), -1))
