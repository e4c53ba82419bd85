"""The same checks in bf16 on one GPU (skipped without CUDA): every variant against the fp64 reference,
megatron-core's output gate, and a bf16 forward/backward of a paper-width layer."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers (reference.py)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEQ, BATCH = 64, 2


@pytest.fixture(scope="module")
def world():
    from megagate.distributed import parallel

    with parallel.single_process():
        yield


def _attention(gate, model_name="tiny", **overrides):
    from megatron.core.transformer.spec_utils import build_module

    from megagate.model.build import transformer_config
    from megagate.model.presets import model_preset
    from megagate.model.spec import gated_layer_spec

    model = model_preset(model_name, gate=gate, **overrides)
    config = transformer_config(model, params_dtype=torch.bfloat16)
    spec = gated_layer_spec(config, gate)
    return build_module(spec.submodules.self_attention, config=config, layer_number=1).cuda(), model, config


def _variants():
    from megagate.model import gate as gates

    return [n for n, f in gates.PRESETS.items() if not f.get("sandwich_norm")]


@pytest.mark.parametrize("variant", _variants())
def test_variant_bf16_matches_fp64_reference(world, variant):
    from helpers import reference
    from megagate.model import gate as gates

    gate = gates.preset(variant)
    attn, model, config = _attention(gate)
    n, g, h = model.num_attention_heads, model.num_query_groups, model.hidden_size
    w64 = reference.make_weights(gate, h, n, g, model.head_dim, seed=7)
    params = {k: v.detach().cuda().bfloat16() for k, v in reference.module_params(w64, gate, n, g).items()}
    x64 = torch.randn(SEQ, BATCH, h, dtype=torch.float64)
    out, _ = torch.func.functional_call(attn, params, (x64.cuda().bfloat16(), None))
    expected = reference.attention(x64, w64, gate, n, g, config.layernorm_epsilon).detach()
    err = (out.double().cpu() - expected).abs().max().item()
    assert err < 3e-2 * max(1.0, expected.abs().max().item()), (variant, err)


def test_g1_bf16_equals_megatron_output_gate(world):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from megagate.model import gate as gates

    ours, model, config = _attention(gates.preset("g1-elementwise"))
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    theirs = build_module(
        spec.submodules.self_attention, config=dataclasses.replace(config, attention_output_gate=True), layer_number=1
    ).cuda()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(SEQ, BATCH, model.hidden_size, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(ours(x, None)[0], theirs(x, None)[0], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("variant", ["baseline", "g1-elementwise", "g1-headwise"])
def test_paper_width_layer_bf16_forward_backward(world, variant):
    """A 1.7B-28L-width gated GPT (2 layers) trains a step in bf16 without NaNs; gate scores stay in (0, 1)."""
    from megagate.model import gate as gates
    from megagate.model.build import build_gpt_model, transformer_config
    from megagate.model.presets import model_preset

    model = model_preset("1.7b-28l", gate=gates.preset(variant), num_layers=2, vocab_size=32768)
    gpt = build_gpt_model(model, transformer_config(model, params_dtype=torch.bfloat16)).cuda()
    tokens = torch.randint(0, model.vocab_size, (2, 512), device="cuda")
    pos = torch.arange(512, device="cuda").unsqueeze(0).expand(2, -1)
    scores = []
    for layer in gpt.decoder.layers:
        layer.self_attention.score_observer = lambda m, s: scores.append(s)
    loss = gpt(tokens, pos, None, labels=tokens).float().mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in gpt.parameters() if p.grad is not None)
    if variant != "baseline":
        assert scores and all(0 < s.min() and s.max() < 1 for s in scores)
