"""Every gate variant of GatedSelfAttention equals the independent plain-torch reference (forward and gradients)."""

import pytest
import torch
from megatron.core.transformer.spec_utils import build_module

from helpers import reference
from megagate.model import gate as gates
from megagate.model.build import transformer_config
from megagate.model.presets import model_preset
from megagate.model.spec import gated_layer_spec

ATTENTION_VARIANTS = [name for name, fields in gates.PRESETS.items() if not fields.get("sandwich_norm")]
SEQ, BATCH = 7, 3


def build_attention(gate):
    model = model_preset("tiny", gate=gate)
    config = transformer_config(model)
    spec = gated_layer_spec(config, gate)
    return build_module(spec.submodules.self_attention, config=config, layer_number=1), model, config


@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
def test_variant_matches_reference(megatron_world, variant):
    gate = gates.preset(variant)
    attn, model, config = build_attention(gate)
    h, n, g = model.hidden_size, model.num_attention_heads, model.num_query_groups
    w64 = reference.make_weights(gate, h, n, g, model.head_dim, seed=7)
    w32 = {k: v.detach().float().requires_grad_() for k, v in w64.items()}
    # every parameter of the module is covered by the reference weights, and nothing else is there
    params32 = reference.module_params(w32, gate, n, g)
    assert set(params32) == {name for name, _ in attn.named_parameters()}

    x64 = torch.randn(
        SEQ, BATCH, h, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True
    )
    x32 = x64.detach().float().requires_grad_()
    grad_out = torch.randn(SEQ, BATCH, h, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    out32, bias = torch.func.functional_call(attn, params32, (x32, None))
    assert bias is None
    out64 = reference.attention(x64, w64, gate, n, g, config.layernorm_epsilon)
    torch.testing.assert_close(out32.double(), out64, atol=2e-6, rtol=1e-5)
    # the output must depend on the gate: a zero/neutral gate would give a different result for gated variants
    out32.backward(grad_out.float())
    out64.backward(grad_out)
    torch.testing.assert_close(x32.grad.double(), x64.grad, atol=5e-6, rtol=1e-4)
    for name in w64:
        torch.testing.assert_close(
            w32[name].grad.double(), w64[name].grad, atol=5e-6, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_gate_changes_the_output(megatron_world):
    """Sanity of the comparison itself: G1 and the baseline disagree on the same q/k/v/o weights."""
    model = model_preset("tiny")
    w = reference.make_weights(gates.preset("g1-elementwise"), model.hidden_size, 4, 2, 16, seed=1)
    x = torch.randn(SEQ, BATCH, model.hidden_size, dtype=torch.float64)
    gated = reference.attention(x, w, gates.preset("g1-elementwise"), 4, 2, 1e-6)
    plain = reference.attention(x, w, gates.preset("baseline"), 4, 2, 1e-6)
    assert (gated - plain).abs().max() > 1e-2
