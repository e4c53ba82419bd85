"""Softmax sinks (model.softmax_type off-by-one / learnable) on the SDPA fast path compute megatron's own
DotProductAttention with the same softmax_type (its SoftmaxOne, fp32, causal, GQA, explicit masks), including the
gradient of the learnable offset; the config key is refused in one line when unknown.

megatron's DotProductAttention allocates its softmax_offset with `torch.cuda.current_device()` (no CPU path), so on
this CPU-only machine the reference module is built with softmax_type="vanilla" and then given the same
softmax_type and the very offset tensor: its forward (FusedScaleMaskSoftmax -> SoftmaxOne) is megatron's own code.
"""

import dataclasses

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megagate.errors import ConfigError
from megagate.model.build import transformer_config
from megagate.model.core_attention import SDPACoreAttention
from megagate.model.presets import model_preset

TOL = dict(atol=1e-5, rtol=1e-5)


def _pair(softmax_type, heads, groups, head_dim):
    model = model_preset(
        "tiny", num_attention_heads=heads, num_query_groups=groups, head_dim=head_dim, hidden_size=heads * head_dim
    )
    config = transformer_config(dataclasses.replace(model, softmax_type=softmax_type))
    kw = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    kw["softmax_scale"] = config.softmax_scale
    sdpa = SDPACoreAttention(config=config, **kw)
    local = DotProductAttention(config=dataclasses.replace(config, softmax_type="vanilla"), **kw)
    local.config = config
    if softmax_type == "learnable":
        with torch.no_grad():  # a clearly non-zero sink, so a wrong sink logit or sign shows
            sdpa.softmax_offset.copy_(torch.linspace(-2.0, 3.0, heads))
        local.softmax_offset = torch.nn.Parameter(sdpa.softmax_offset.detach().clone())
    else:
        local.softmax_offset = torch.zeros(heads)
    return sdpa, local


def _run(module, q, k, v, mask=None):
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = module(*inputs, mask)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))
    return out, [t.grad for t in inputs]


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("sq,b,np_,ng,hn", [(7, 2, 4, 2, 16), (33, 1, 8, 1, 8), (16, 2, 4, 4, 16)])
def test_sdpa_sink_equals_megatron(megatron_world, softmax_type, sq, b, np_, ng, hn):
    sdpa, local = _pair(softmax_type, np_, ng, hn)
    gen = torch.Generator().manual_seed(sq)
    q, k, v = (torch.randn(sq, b, n, hn, generator=gen) for n in (np_, ng, ng))
    out_s, grads_s = _run(sdpa, q, k, v)
    out_l, grads_l = _run(local, q, k, v)
    torch.testing.assert_close(out_s, out_l, **TOL)
    for gs, gl in zip(grads_s, grads_l):
        torch.testing.assert_close(gs, gl, **TOL)
    if softmax_type == "learnable":
        assert sdpa.softmax_offset.grad.abs().max() > 1e-3
        torch.testing.assert_close(sdpa.softmax_offset.grad, local.softmax_offset.grad, **TOL)
    # by hand: position 0 sees only itself and the sink, weight exp(z)/(exp(z)+exp(s_h)), z = q0.k0 * scale
    z = (q[0, :, 0] * k[0, :, 0]).sum(-1) * sdpa.softmax_scale
    weight = torch.sigmoid(z - sdpa.softmax_offset.detach()[0])
    torch.testing.assert_close(out_s[0, :, :hn].detach(), weight[:, None] * v[0, :, 0], **TOL)


def test_sdpa_sink_with_explicit_mask_equals_megatron(megatron_world):
    sq, b, np_, ng, hn = 11, 2, 4, 2, 8
    sdpa, local = _pair("learnable", np_, ng, hn)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(sq, b, n, hn, generator=gen) for n in (np_, ng, ng))
    mask = torch.rand(b, 1, sq, sq, generator=gen) < 0.3
    mask[..., 0] = False  # no fully masked row (SDPA and megatron differ there by design)
    out_s, _ = _run(sdpa, q, k, v, mask)
    out_l, _ = _run(local, q, k, v, mask)
    torch.testing.assert_close(out_s, out_l, **TOL)


def test_learnable_offset_is_a_parameter_with_one_logit_per_head(megatron_world):
    sdpa, _ = _pair("learnable", 4, 2, 16)
    names = dict(sdpa.named_parameters())
    assert list(names) == ["softmax_offset"] and names["softmax_offset"].shape == (4,)
    off, _ = _pair("off-by-one", 4, 2, 16)
    assert list(off.named_parameters()) == []


def test_unknown_softmax_type_is_one_line_with_did_you_mean():
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(model_preset("tiny"), softmax_type="learnabel")
    message = str(err.value)
    assert "\n" not in message and "vanilla, off-by-one, learnable" in message and "'learnable'" in message


def test_learnable_sink_counts_and_planner_match_the_built_model(megatron_world):
    """megatron's build (SDPA core attention, TP 1) holds one softmax_offset of num_heads per attention layer, where
    the analytic count and the planner's parameter list (names, sizes, order) put it; off-by-one adds nothing."""
    from megagate.model.build import build_gpt_model, meta_parameter_count
    from megagate.model.counts import parameter_counts
    from megagate.plan.params import RankShape, chunk_params

    base = model_preset("tiny")
    sink = dataclasses.replace(base, softmax_type="learnable")
    added = base.num_layers * base.num_attention_heads
    assert meta_parameter_count(sink) - meta_parameter_count(base) == added == 2 * 4
    assert meta_parameter_count(dataclasses.replace(base, softmax_type="off-by-one")) == meta_parameter_count(base)
    assert parameter_counts(sink)["total"] - parameter_counts(base)["total"] == added
    assert parameter_counts(sink)["total"] == meta_parameter_count(sink)
    gpt = build_gpt_model(sink, transformer_config(sink), core_attention="sdpa")
    built = [(name, p.numel()) for name, p in gpt.named_parameters()]
    assert ("decoder.layers.1.self_attention.core_attention.softmax_offset", 4) in built
    assert built == [(p.name, p.numel) for p in chunk_params(sink, RankShape(), 0, 0)]


def test_learnable_sink_trains_and_round_trips_through_state_dict(megatron_world):
    """The offset gets a gradient through the whole model and is restored by load_state_dict (the sharded state dict
    names it under the layer's core_attention)."""
    from megagate.model.build import build_gpt_model

    sink = dataclasses.replace(model_preset("tiny"), softmax_type="learnable")
    gpt = build_gpt_model(sink, transformer_config(sink), core_attention="sdpa")
    tokens = torch.randint(0, sink.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    gpt(tokens, positions, None, labels=tokens).float().mean().backward()
    offset = gpt.decoder.layers[0].self_attention.core_attention.softmax_offset
    assert offset.grad is not None and offset.grad.abs().max() > 0
    state = {k: v.clone() for k, v in gpt.state_dict().items() if torch.is_tensor(v)}
    with torch.no_grad():
        offset.add_(1.0)
    gpt.load_state_dict(state, strict=False)
    torch.testing.assert_close(offset.detach(), state["decoder.layers.0.self_attention.core_attention.softmax_offset"])
    keys = gpt.decoder.layers[0].self_attention.core_attention.sharded_state_dict(
        prefix="x.", metadata={"dp_cp_group": None}
    )
    assert list(keys) == ["x.softmax_offset"]


@pytest.mark.distributed
@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_tp2_equals_tp1_with_a_sink(tmp_path, softmax_type):
    """Over gloo, 2 real processes: the tiny G1 and baseline models with a sink give the TP 1 loss and gradients at
    TP 2 (the learnable offset sharded by heads, its gradient included)."""
    from helpers import distributed, parallel_workers

    variants = ["baseline", "g1-elementwise"]
    results = distributed.run(parallel_workers.tp_worker, 2, tmp_path, variants, None, {"softmax_type": softmax_type})
    for rank_result in results:
        assert set(rank_result) == set(variants)
        for variant, diff in rank_result.items():
            assert diff["loss"] < 1e-5, (variant, diff)
            assert diff["grad"] < 1e-5 * max(1.0, diff["grad_scale"]), (variant, diff)


def test_layout_independent_init_draws_the_offset(megatron_world):
    """megagate.model.init covers the offset (normal(0, σ) by its global name, full head axis, TP-sharded)."""
    from megagate.model.build import build_gpt_model
    from megagate.model.init import initial_value, initialize, rule_for

    sink = dataclasses.replace(model_preset("tiny"), softmax_type="learnable")
    gpt = build_gpt_model(sink, transformer_config(sink), core_attention="sdpa")
    name = "decoder.layers.0.self_attention.core_attention.softmax_offset"
    assert rule_for(name).what == "softmax sink logit"
    initialize([gpt], seed=3, std=0.02, num_layers=sink.num_layers)
    offset = dict(gpt.named_parameters())[name]
    assert offset.tensor_model_parallel and offset.partition_dim == 0
    expected = initial_value(name, (4,), 3, 0.02, sink.num_layers)
    torch.testing.assert_close(offset.detach(), expected)
    assert 0 < expected.abs().max() < 0.1


def test_variants_lists_the_sink_baselines_with_their_counts(megatron_world, capsys):
    from megagate.cli import main

    assert main(["variants", "--models", "tiny", "--variants", "baseline", "off-by-one", "learnable-sink"]) == 0
    rows = {line.split()[1]: line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("tiny ")}
    base = int(rows["baseline"][2].replace(",", ""))
    assert int(rows["off-by-one"][2].replace(",", "")) == base
    assert int(rows["learnable-sink"][2].replace(",", "")) == base + 2 * 4  # 2 layers x 4 heads


def test_local_core_attention_with_a_sink_is_refused_without_cuda(megatron_world):
    from megagate.model.build import build_gpt_model

    sink = dataclasses.replace(model_preset("tiny"), softmax_type="off-by-one")
    with pytest.raises(ConfigError, match="needs CUDA") as err:
        build_gpt_model(sink, transformer_config(sink), core_attention="local")
    assert "\n" not in str(err.value)


def test_learnable_sink_saves_and_resumes_bit_identically(tmp_path, session_demo_dir):
    """Through megagate's distributed checkpoint (the distributed optimizer's shards included): the offset trains,
    so a resume that re-drew it instead of loading it would move the losses after the restart."""
    from helpers import tiny_runs as T

    sink = ["model.softmax_type=learnable", "train.train_steps=4", "train.warmup_steps=1"]
    T.run_train(tmp_path / "whole", session_demo_dir, *sink)
    T.run_train(tmp_path / "resumed", session_demo_dir, *sink, "train.exit_after_steps=2")
    T.run_train(tmp_path / "resumed", session_demo_dir, *sink)
    whole, resumed = T.losses(tmp_path / "whole"), T.losses(tmp_path / "resumed")
    assert sorted(whole) == [1, 2, 3, 4] and [resumed[s] for s in (3, 4)] == [whole[s] for s in (3, 4)]
