"""The input norm fused into linear_qkv (TE's spec shape) computes the same layer as the separate input_layernorm.

megatron's TE spec leaves `input_layernorm` an IdentityOp and normalises inside `linear_qkv`; the attention then sees
the raw residual, and every gate that projects the layer input itself (head-shared gates, G5) must normalise it
again with the fused module's parameters. `megagate.model.fused_norm` gives the same shape without TE
(NormColumnParallelLinear, fuse_input_norm), so these tests run the real fused shape on CPU, for every gate preset.
"""

import pytest
import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import build_module

from megagate.model import attention as attention_module
from megagate.model import gate as gates
from megagate.model.build import transformer_config
from megagate.model.fused_norm import NormColumnParallelLinear, apply_norm, fuse_input_norm, has_fused_norm
from megagate.model.presets import model_preset
from megagate.model.spec import gated_layer_spec

SEQ, BATCH = 8, 2  # even: sequence parallelism splits it in two
ALL_PRESETS = list(gates.PRESETS)
# the presets whose gate projects the layer input outside linear_qkv: the ones the raw residual would break
PROJECTING = [
    name
    for name in ALL_PRESETS
    if gates.preset(name).enabled
    and gates.preset(name).input == "query_dependent"
    and not gates.preset(name).fused_rows
]
NORM_KEYS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
}


def test_projecting_presets_cover_head_shared_and_g5():
    assert "g5-elementwise" in PROJECTING
    assert {n for n in ALL_PRESETS if gates.preset(n).sharing == "head_shared"} <= set(PROJECTING)
    assert len(PROJECTING) >= 4


def build_pair(variant: str, **model_overrides):
    """The same TransformerLayer built from the separate spec and from the fused spec, with the same (random,
    non-trivial) weights: norm weights far from 1, zero-initialised gate parameters non-zero."""
    torch.manual_seed(0)  # the layers' own initialisation draws from the global generator: same in any test order
    gate = gates.preset(variant)
    model = model_preset("tiny", gate=gate, **model_overrides)
    config = transformer_config(model)
    spec = gated_layer_spec(config, gate)
    separate = build_module(spec, config=config, layer_number=1)
    fused = build_module(fuse_input_norm(spec), config=config, layer_number=1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in sorted(separate.named_parameters()):
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
        separate.input_layernorm.weight.copy_(torch.rand(model.hidden_size, generator=gen) * 3.0 + 0.2)
    state = {NORM_KEYS.get(k, k): v for k, v in separate.state_dict().items()}
    fused.load_state_dict(state, strict=True)
    return separate, fused, config


def run(layer, x, grad):
    x = x.clone().requires_grad_()
    out, _ = layer(x, attention_mask=None)
    out.backward(grad)
    grads = {NORM_KEYS.get(n, n): p.grad.clone() for n, p in layer.named_parameters()}
    return out.detach(), x.grad, grads


def inputs(hidden: int, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    x = 2.0 * torch.randn(SEQ, BATCH, hidden, generator=gen) + 0.5  # far from unit RMS: normalising matters
    return x, torch.randn(SEQ, BATCH, hidden, generator=gen)


def assert_same(separate, fused, config):
    x, grad = inputs(config.hidden_size)
    out_s, dx_s, grads_s = run(separate, x, grad)
    out_f, dx_f, grads_f = run(fused, x, grad)

    # fp32 rounding relative to the tensor's scale (the input's gradient and the weights' reach ~1e2 with these
    # weights; an element that cancels to ~1e-2 keeps the scale's rounding): the fused layer back-propagates through
    # the norm twice (linear_qkv's and the gate's) where the separate one sums first
    def close(ours, theirs, name):
        atol = 1e-6 * max(1.0, theirs.abs().max().item())
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=1e-5, msg=lambda m: f"{name}: {m}")

    close(out_f, out_s, "output")
    close(dx_f, dx_s, "input gradient")
    assert set(grads_f) == set(grads_s)
    for name, g in grads_s.items():
        close(grads_f[name], g, name)


@pytest.mark.parametrize("variant", ALL_PRESETS)
def test_fused_input_norm_equals_separate(megatron_world, variant):
    separate, fused, config = build_pair(variant)
    # the fused shape really is TE's: no separate norm, the norm inside linear_qkv
    assert isinstance(fused.input_layernorm, IdentityOp)
    assert isinstance(fused.self_attention.linear_qkv, NormColumnParallelLinear)
    assert has_fused_norm(fused.self_attention.linear_qkv) and not has_fused_norm(separate.self_attention.linear_qkv)
    assert_same(separate, fused, config)


@pytest.mark.parametrize("variant", PROJECTING)
def test_raw_residual_at_the_gate_would_differ(megatron_world, variant, monkeypatch):
    """The comparison above can fail: with the gate projecting the raw residual (the TE bug), the fused layer's
    output differs from the separate one by far more than the tolerance."""
    separate, fused, config = build_pair(variant)
    x, grad = inputs(config.hidden_size)
    linear = fused.self_attention.linear_qkv
    normed = apply_norm(
        x, linear.layer_norm_weight, None, normalization="RMSNorm", eps=linear.eps, zero_centered_gamma=False
    )
    assert (normed - x).abs().max() > 1.0  # the gate input itself: raw and normed are far apart
    out_s, _, _ = run(separate, x, grad)
    monkeypatch.setattr(attention_module, "normed_input", lambda module, hidden_states: hidden_states)
    out_raw, _, _ = run(fused, x, grad)
    assert (out_raw - out_s).abs().max() > 1e-2


ZERO_CENTERED = ["g1-elementwise-head-shared", "g2-elementwise-head-shared", "g5-elementwise", "g1-elementwise"]


@pytest.mark.parametrize("variant", ZERO_CENTERED)
def test_zero_centered_norm_in_both_shapes(megatron_world, variant):
    separate, fused, config = build_pair(variant, norm_zero_centered=True)
    assert config.layernorm_zero_centered_gamma
    assert type(separate.input_layernorm).__name__ == "ZeroCenteredRMSNorm"
    assert fused.self_attention.linear_qkv.zero_centered_gamma
    # (1 + w) with w = the random weight: a plain-weight norm would differ
    assert_same(separate, fused, config)


@pytest.mark.parametrize("variant", ["g1-elementwise-head-shared", "g5-elementwise"])
def test_layernorm_with_bias_in_both_shapes(megatron_world, variant):
    separate, fused, config = build_pair(variant, normalization="LayerNorm")
    assert fused.self_attention.linear_qkv.layer_norm_bias is not None
    with torch.no_grad():  # a non-zero norm bias, copied into the fused module too
        bias = torch.linspace(-1.0, 1.0, config.hidden_size)
        separate.input_layernorm.bias.copy_(bias)
        fused.self_attention.linear_qkv.layer_norm_bias.copy_(bias)
    assert_same(separate, fused, config)


def test_fused_norm_initialises_to_identity(megatron_world):
    """A fresh NormColumnParallelLinear's norm is the plain norm (weight 1, or w = 0 zero-centred), as TE's is."""
    for zc in (False, True):
        _, fused, _ = build_pair("g5-elementwise", norm_zero_centered=zc)
        fresh = build_module(
            fuse_input_norm(gated_layer_spec(fused.config, gates.preset("g5-elementwise"))),
            config=fused.config,
            layer_number=1,
        )
        expected = torch.zeros if zc else torch.ones
        torch.testing.assert_close(
            fresh.self_attention.linear_qkv.layer_norm_weight.detach(), expected(fused.config.hidden_size)
        )


# --- sequence parallelism: the norm runs on this rank's chunk, before the gate's gather ------------------------------
SP_VARIANTS = [
    "g1-elementwise-head-shared",
    "g2-elementwise-head-shared",
    "g5-elementwise",
    "g1-elementwise",
    "g1-input-half",  # its own column-parallel gate projection: the input gathered along the sequence
]


def sp_worker(rank: int, world: int, variants: list[str]) -> dict[str, dict[str, float]]:
    """Per variant: the fused-spec layer under TP=2 with sequence parallelism (each rank: half the sequence) against
    the separate-spec layer at TP=1 on the whole sequence, same weights: max |Δ| of outputs and gradients.
    Zero-centred norms, the local norms that support sequence parallelism (megatron's torch norms refuse it)."""
    from megatron.core import parallel_state

    from helpers.parallel_workers import _shard
    from megagate.distributed.parallel import initialize_model_parallel
    from megagate.model.model_config import ParallelConfig

    report = {}
    for variant in variants:
        initialize_model_parallel(ParallelConfig(), seed=5)
        ref, _, config = build_pair(variant, norm_zero_centered=True)
        x, grad = inputs(config.hidden_size)
        ref_out, ref_dx, ref_grads = run(ref, x, grad)
        full = {NORM_KEYS.get(n, n): p.detach().clone() for n, p in ref.named_parameters()}
        parallel_state.destroy_model_parallel()

        sp = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
        initialize_model_parallel(sp, seed=5)
        gate = gates.preset(variant)
        model = model_preset("tiny", gate=gate, norm_zero_centered=True)
        config = transformer_config(model, sp)
        layer = build_module(fuse_input_norm(gated_layer_spec(config, gate, tp_size=2)), config=config, layer_number=1)
        tp_rank, group = (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_group(),
        )
        params = dict(layer.named_parameters())
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(_shard(name, full[name], p, tp_rank, 2))
        chunk = slice(tp_rank * SEQ // 2, (tp_rank + 1) * SEQ // 2)
        out, dx, grads = run(layer, x[chunk], grad[chunk])
        grad_diff = 0.0
        for name, p in params.items():
            g = grads[name]
            if getattr(p, "sequence_parallel", False):  # a partial sum over TP ranks: megatron sums it
                torch.distributed.all_reduce(g, group=group)
            expected = _shard(name, ref_grads[name], p, tp_rank, 2)
            grad_diff = max(grad_diff, (g - expected).abs().max().item())
        report[variant] = {
            "out": (out - ref_out[chunk]).abs().max().item(),
            "dx": (dx - ref_dx[chunk]).abs().max().item(),
            "grad": grad_diff,
            "fused": float(has_fused_norm(layer.self_attention.linear_qkv)),
            "out_scale": ref_out.abs().max().item(),
            "dx_scale": ref_dx.abs().max().item(),
            "grad_scale": max(g.abs().max().item() for g in ref_grads.values()),
        }
        parallel_state.destroy_model_parallel()
    return report


@pytest.mark.distributed
def test_fused_norm_under_sequence_parallel_equals_tp1(tmp_path):
    from helpers import distributed

    results = distributed.run(sp_worker, 2, tmp_path, SP_VARIANTS)
    bad = []
    for rank_result in results:
        for variant, diff in rank_result.items():
            # fp32, sums split over two ranks: relative to each tensor's scale (measured: <= 9e-7)
            ok = diff["fused"] == 1.0 and all(
                diff[key] < 4e-6 * max(1.0, diff[f"{key}_scale"]) for key in ("out", "dx", "grad")
            )
            if not ok:
                bad.append((variant, diff))
    assert not bad, bad
