"""The Transformer Engine layer spec computes the local spec's function for every gate preset (skipped without CUDA
and TE).

TE's spec fuses the input norm into `linear_qkv` (and the pre-MLP norm into `linear_fc1`) and leaves the separate
norms IdentityOps; the gated attention must then normalise the raw residual itself wherever its gate projects the
layer input (head-shared gates, G5). Same weights (the local norms' weights copied into TE's fused modules, every
weight perturbed so a missing norm shows), fp32, forward and gradients. The CPU proof of the same property, on a
torch-native fused module, is tests/model/test_input_norm.py.
"""

import pytest
import torch

from megagate.model.kernels import transformer_engine_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not transformer_engine_available(), reason="needs Transformer Engine"),
]

SEQ, BATCH = 16, 2
# local TransformerLayer names -> the TE spec's names for the same tensors
LOCAL_TO_TE = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


def _presets() -> list[str]:
    from megagate.model import gate as gates

    return list(gates.PRESETS)


def _layers(variant: str, **overrides):
    from megatron.core.transformer.spec_utils import build_module

    from megagate.model import gate as gates
    from megagate.model.build import transformer_config
    from megagate.model.presets import model_preset
    from megagate.model.spec import gated_layer_spec

    gate = gates.preset(variant)
    model = model_preset("tiny", gate=gate, **overrides)
    config = transformer_config(model)
    local = build_module(gated_layer_spec(config, gate, backend="local"), config=config, layer_number=1).cuda()
    te = build_module(gated_layer_spec(config, gate, backend="te"), config=config, layer_number=1).cuda()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in sorted(local.named_parameters()):
            p.add_((0.3 * torch.randn(p.shape, generator=gen)).to(p.device))
        local.input_layernorm.weight.copy_(torch.rand(model.hidden_size, generator=gen) * 3.0 + 0.2)
    state = {LOCAL_TO_TE.get(k, k): v for k, v in local.state_dict().items()}
    missing, unexpected = te.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith("_extra_state") for k in missing), missing  # TE's FP8 metadata only
    return local, te, config


def _step(layer, x, grad):
    x = x.clone().requires_grad_()
    out, _ = layer(x, attention_mask=None)
    out.backward(grad)
    grads = {LOCAL_TO_TE.get(n, n): p.grad.detach().clone() for n, p in layer.named_parameters()}
    return out.detach(), x.grad, grads


@pytest.fixture(autouse=True)
def _exact_fp32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _compare(local, te, config):
    from megagate.model.fused_norm import has_fused_norm

    assert has_fused_norm(te.self_attention.linear_qkv)  # TE's shape: the norm inside linear_qkv
    gen = torch.Generator().manual_seed(5)
    x = (2.0 * torch.randn(SEQ, BATCH, config.hidden_size, generator=gen) + 0.5).cuda()
    grad = torch.randn(SEQ, BATCH, config.hidden_size, generator=gen).cuda()
    out_l, dx_l, grads_l = _step(local, x, grad)
    out_t, dx_t, grads_t = _step(te, x, grad)
    tol = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out_t, out_l, **tol)
    torch.testing.assert_close(dx_t, dx_l, **tol)
    assert set(grads_t) == set(grads_l)
    for name, g in grads_l.items():
        torch.testing.assert_close(grads_t[name], g, atol=1e-4, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("variant", _presets())
def test_te_spec_equals_local_spec(megatron_world, variant):
    _compare(*_layers(variant))


@pytest.mark.parametrize("variant", ["g1-elementwise-head-shared", "g5-elementwise", "g1-elementwise"])
def test_te_spec_equals_local_spec_zero_centered(megatron_world, variant):
    local, te, config = _layers(variant, norm_zero_centered=True)
    assert te.self_attention.linear_qkv.zero_centered_gamma
    _compare(local, te, config)
