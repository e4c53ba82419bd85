"""The default build is megatron's HybridModel (megagate.model.build, megagate.model.hybrid_stack): no deprecation
notice, and the same model as the GPTModel heterogeneous-spec build it replaced (names, forward, gradients and the
distributed-checkpoint entries equal), so checkpoints of either load into the other. The layouts HybridModel cannot
carry stay on GPTModel, by name (`gpt_model_reason`)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import warnings

import pytest
import torch

from megagate.model import gate as gates
from megagate.model import init
from megagate.model.build import _build_gpt_model, build_gpt_model, gpt_model_reason, model_kwargs, transformer_config
from megagate.model.loss import use_local_cross_entropy
from megagate.model.presets import model_preset
from megagate.model.rotary import fit_rotary

PRESETS = ["tiny", "tiny-moe", "tiny-hybrid"]


def _gpt(mc, cfg) -> torch.nn.Module:
    """The model as main built it before the move: GPTModel with the gated decoder block spec."""
    common = model_kwargs(mc, cfg, True, True, None)
    gpt = _build_gpt_model(mc, cfg, "local", None, "auto", 1, common)
    fit_rotary(gpt, mc, cfg)
    use_local_cross_entropy(gpt)
    return gpt


@pytest.mark.parametrize("preset", PRESETS)
def test_default_build_is_hybrid_model_and_logs_no_deprecation(megatron_world, preset, caplog):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    mc = model_preset(preset, gate=gates.preset("g1-elementwise"))
    caplog.set_level(logging.DEBUG)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = build_gpt_model(mc, transformer_config(mc))
    assert isinstance(model, HybridModel)
    lines = [r.getMessage() for r in caplog.records] + [str(w.message) for w in seen]
    # megatron 0.19's GPTModel logs "GPTModel IS DEPRECATED ..." on every build; HybridModel's build says nothing so
    assert not [line for line in lines if "GPTModel" in line or "IS DEPRECATED" in line], lines


def test_console_no_longer_lists_the_gpt_deprecation():
    from megagate import console

    assert not [n for n in console.NOTICES if "gpt_model" in n.source or "GPTModel" in n.text]


@pytest.mark.parametrize("preset", PRESETS)
def test_hybrid_model_is_the_gpt_model_it_replaces(megatron_world, preset):
    mc = model_preset(preset, gate=gates.preset("g1-elementwise"))
    cfg = transformer_config(mc)
    new, old = build_gpt_model(mc, cfg), _gpt(mc, cfg)
    assert [n for n, _ in new.named_parameters()] == [n for n, _ in old.named_parameters()]
    init.initialize([new], 0, mc.init_method_std, mc.num_layers)
    old.load_state_dict(new.state_dict())
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(32).unsqueeze(0).expand(2, -1)
    a, b = new(tokens, positions, None, labels=tokens), old(tokens, positions, None, labels=tokens)
    assert torch.equal(a, b)
    a.mean().backward()
    b.mean().backward()
    for (name, p), q in zip(new.named_parameters(), old.parameters(), strict=True):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name
    ours, theirs = new.sharded_state_dict(), old.sharded_state_dict()
    assert ours.keys() == theirs.keys()
    for key, entry in ours.items():
        other = theirs[key]
        assert (entry.key, getattr(entry, "global_shape", None), getattr(entry, "global_offset", None)) == (
            other.key,
            getattr(other, "global_shape", None),
            getattr(other, "global_offset", None),
        ), key


def test_layouts_hybrid_model_cannot_carry_stay_on_gpt_model(megatron_world):
    mc = model_preset("tiny", gate=gates.preset("g1-elementwise"))
    cfg = transformer_config(mc)
    assert gpt_model_reason(cfg) is None
    for field, value, named in [
        ("moe_layer_freq", [1, 0], "moe_layer_freq"),
        ("num_layers_in_first_pipeline_stage", 1, "num_layers_in_first/last_pipeline_stage"),
        ("pipeline_model_parallel_layout", "E|t*2|L", "pipeline_model_parallel_layout"),
    ]:
        other = copy.copy(cfg)
        setattr(other, field, value)
        assert named in gpt_model_reason(other), field


@pytest.mark.parametrize(
    "parallel, num_layers, expected",
    [
        ({}, 4, "GGG*"),
        ({"pipeline_model_parallel_size": 2}, 4, "GG|G*"),
        # virtual stage v of rank r is segment v * pp + r, as megatron's interleaved GPT block assigns them
        ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}, 4, "G|G|G|*"),
        # the embedding and the loss count as a layer each: (8 + 2) / 2 = 5 per stage, one short at either end
        (
            {
                "pipeline_model_parallel_size": 2,
                "account_for_embedding_in_pipeline_split": True,
                "account_for_loss_in_pipeline_split": True,
            },
            8,
            "GGG*|GGG*",
        ),
    ],
)
def test_pipeline_cuts_are_where_the_gpt_block_put_them(megatron_world, parallel, num_layers, expected):
    from megagate.model.build import hybrid_layer_pattern
    from megagate.model.model_config import ParallelConfig

    mc = model_preset("tiny-hybrid", gate=gates.preset("g1-elementwise"))
    mc = dataclasses.replace(mc, num_layers=num_layers, layer_pattern="GGG*" * (num_layers // 4))
    assert hybrid_layer_pattern(mc, transformer_config(mc, ParallelConfig(**parallel))) == expected
