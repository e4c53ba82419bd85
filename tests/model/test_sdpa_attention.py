"""SDPACoreAttention (torch scaled_dot_product_attention) computes megatron's local DotProductAttention's function:
module by module at several shapes, and inside the whole GatedSelfAttention of every gate preset (forward, input and
parameter gradients, fp32), with GQA, causal and explicit masks, and under selective recompute."""

import dataclasses
import math

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import build_module

from megagate.errors import ConfigError
from megagate.model import gate as gates
from megagate.model.build import build_gpt_model, transformer_config
from megagate.model.core_attention import SDPACoreAttention
from megagate.model.kernels import core_attention_name, resolve_core_attention
from megagate.model.presets import model_preset
from megagate.model.spec import gated_layer_spec

TOL = dict(atol=1e-5, rtol=1e-5)


def _config(heads: int, groups: int, head_dim: int, **extra):
    model = model_preset(
        "tiny", num_attention_heads=heads, num_query_groups=groups, head_dim=head_dim, hidden_size=heads * head_dim
    )
    return transformer_config(model, **extra)


def _pair(config, layer_number=1, mask_type=AttnMaskType.causal):
    kw = dict(config=config, layer_number=layer_number, attn_mask_type=mask_type, attention_type="self")
    kw["softmax_scale"] = config.softmax_scale  # what megatron's SelfAttention passes
    return SDPACoreAttention(**kw), DotProductAttention(**kw)


def _qkv(sq, b, np_, ng, hn, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, np_, hn, generator=gen).requires_grad_()
    k = torch.randn(sq, b, ng, hn, generator=gen).requires_grad_()
    v = torch.randn(sq, b, ng, hn, generator=gen).requires_grad_()
    return q, k, v


def _run(module, q, k, v, mask=None, grad_seed=0):
    """Forward and backward of one core-attention module on clones of q, k, v; returns output and input grads."""
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = module(*inputs, mask)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed))
    out.backward(grad)
    return out, [t.grad for t in inputs]


# --- module level -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sq,b,np_,ng,hn",
    [(7, 2, 4, 2, 16), (33, 1, 8, 1, 8), (100, 3, 6, 3, 32), (64, 2, 4, 4, 16), (1, 2, 4, 2, 16)],
)
def test_module_equals_local_causal(megatron_world, sq, b, np_, ng, hn):
    """Causal mask type without a mask (what the GPT model passes), MHA, GQA and MQA, odd and power-of-2 lengths."""
    sdpa, local = _pair(_config(np_, ng, hn))
    q, k, v = _qkv(sq, b, np_, ng, hn, seed=sq)
    out_s, grads_s = _run(sdpa, q, k, v)
    out_l, grads_l = _run(local, q, k, v)
    assert out_s.shape == (sq, b, np_ * hn)
    torch.testing.assert_close(out_s, out_l, **TOL)
    for name, gs, gl in zip("qkv", grads_s, grads_l):
        torch.testing.assert_close(gs, gl, **TOL, msg=lambda m, name=name: f"d{name}: {m}")
    if sq > 1:  # the causal mask is really applied: position 0 sees only itself, so its output is v[0] of its group
        torch.testing.assert_close(out_s[0, :, :hn], v[0, :, 0].detach(), **TOL)


def test_module_equals_local_with_explicit_mask(megatron_world):
    """A boolean mask (megatron's convention: True = masked) replaces the causal mask, as in the local module."""
    sq, b, np_, ng, hn = 19, 2, 4, 2, 16
    sdpa, local = _pair(_config(np_, ng, hn))
    q, k, v = _qkv(sq, b, np_, ng, hn, seed=3)
    gen = torch.Generator().manual_seed(4)
    mask = torch.rand(b, 1, sq, sq, generator=gen) < 0.4  # random holes, not causal
    mask[..., torch.arange(sq), torch.arange(sq)] = False  # every query sees at least itself
    out_s, grads_s = _run(sdpa, q, k, v, mask)
    out_l, grads_l = _run(local, q, k, v, mask)
    torch.testing.assert_close(out_s, out_l, **TOL)
    for gs, gl in zip(grads_s, grads_l):
        torch.testing.assert_close(gs, gl, **TOL)
    causal_out, _ = _run(sdpa, q, k, v)
    assert (causal_out - out_s).abs().max() > 1e-2  # the mask was used, not the mask type


@pytest.mark.parametrize("layer_scaling", [False, True])
def test_softmax_scale_config_and_layer_scaling(megatron_world, layer_scaling):
    """config.softmax_scale is honoured; apply_query_key_layer_scaling keeps the same net scale (layer 3)."""
    sq, b, np_, ng, hn = 12, 2, 4, 2, 16
    config = _config(np_, ng, hn, softmax_scale=0.4, apply_query_key_layer_scaling=layer_scaling)
    sdpa, local = _pair(config, layer_number=3)
    assert sdpa.softmax_scale == pytest.approx(0.4)
    q, k, v = _qkv(sq, b, np_, ng, hn, seed=9)
    out_s, grads_s = _run(sdpa, q, k, v)
    out_l, grads_l = _run(local, q, k, v)
    torch.testing.assert_close(out_s, out_l, **TOL)
    for gs, gl in zip(grads_s, grads_l):
        torch.testing.assert_close(gs, gl, **TOL)
    default, _ = _pair(_config(np_, ng, hn))
    assert default.softmax_scale == pytest.approx(1 / math.sqrt(hn))


def test_attention_dropout_in_training_only(megatron_world):
    sq, b, np_, ng, hn = 16, 2, 4, 2, 16
    sdpa, _ = _pair(dataclasses.replace(_config(np_, ng, hn), attention_dropout=0.5))
    q, k, v = _qkv(sq, b, np_, ng, hn, seed=1)
    sdpa.eval()
    reference, _ = _pair(_config(np_, ng, hn))
    with torch.no_grad():
        torch.testing.assert_close(sdpa(q, k, v, None), reference(q, k, v, None), rtol=0, atol=0)
        sdpa.train()
        dropped = sdpa(q, k, v, None)
    assert (dropped - reference(q, k, v, None)).abs().max() > 1e-2


def test_refusals_are_one_line(megatron_world):
    sq, b, np_, ng, hn = 4, 1, 4, 2, 16
    config = _config(np_, ng, hn)
    sdpa, _ = _pair(config)
    q, k, v = _qkv(sq, b, np_, ng, hn, seed=0)
    packed = PackedSeqParams(qkv_format="thd")
    with pytest.raises(ConfigError, match="packed sequences") as err:
        sdpa(q, k, v, None, packed_seq_params=packed)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="attention_bias"):
        sdpa(q, k, v, None, attention_bias=torch.zeros(1, np_, sq, sq))
    cp = dataclasses.replace(config)
    cp.context_parallel_size = 2  # set after validation: megatron's own checks want a CP world
    with pytest.raises(ConfigError, match="context_parallel_size=2"):
        _pair(cp)
    with pytest.raises(ConfigError, match="window_size"):
        _pair(dataclasses.replace(config, window_size=(8, 0)))


# --- the whole gated attention, every preset -----------------------------------------------------------------------
def _attention(config, gate, core_attention):
    spec = gated_layer_spec(config, gate, core_attention=core_attention)
    return build_module(spec.submodules.self_attention, config=config, layer_number=1)


def _attention_pair(preset, **extra):
    model = model_preset("tiny", gate=gates.preset(preset))  # 4 heads, 2 query groups (GQA), head_dim 16
    config = transformer_config(model, **extra)
    sdpa, local = _attention(config, model.gate, "sdpa"), _attention(config, model.gate, "local")
    assert isinstance(sdpa.core_attention, SDPACoreAttention)
    assert type(local.core_attention) is DotProductAttention
    with torch.no_grad():  # non-trivial weights everywhere (zero-initialised gate parameters included)
        gen = torch.Generator().manual_seed(11)
        for p in sdpa.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    local.load_state_dict(sdpa.state_dict())
    return model, sdpa, local


def _layer_run(module, x, mask=None):
    x = x.detach().clone().requires_grad_()
    out, _ = module(x, mask)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)))
    return out, x.grad, {n: p.grad for n, p in module.named_parameters()}


def _close(actual, expected, name):
    """fp32 agreement to 1e-5 of the tensor's own scale (gradients here reach |g| ~ 50: summation-order noise is
    1e-5 absolute there, while a wrong mask, scale or group mapping is off by O(1))."""
    atol = 1e-5 * max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def _assert_same(a, b):
    out_a, dx_a, grads_a = a
    out_b, dx_b, grads_b = b
    _close(out_a, out_b, "output")
    _close(dx_a, dx_b, "input grad")
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, g in grads_a.items():
        assert g is not None, name
        _close(g, grads_b[name], name)


@pytest.mark.parametrize("preset", list(gates.PRESETS))
def test_gated_attention_sdpa_equals_local(megatron_world, preset):
    """Every gate preset: output, input gradient and every parameter gradient agree (GQA, causal, sq = 23)."""
    model, sdpa, local = _attention_pair(preset)
    x = torch.randn(23, 2, model.hidden_size, generator=torch.Generator().manual_seed(2))
    _assert_same(_layer_run(sdpa, x), _layer_run(local, x))


@pytest.mark.parametrize("preset", ["g1-elementwise", "g2-headwise", "g5-elementwise"])
def test_gated_attention_sdpa_equals_local_with_mask(megatron_world, preset):
    model, sdpa, local = _attention_pair(preset)
    sq = 17
    mask = torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    mask[5:, :3] = True  # causal with a hole: not what is_causal alone would compute
    mask = mask.expand(2, 1, sq, sq)
    x = torch.randn(sq, 2, model.hidden_size, generator=torch.Generator().manual_seed(3))
    _assert_same(_layer_run(sdpa, x, mask), _layer_run(local, x, mask))


def test_selective_recompute_gives_the_same_gradients(megatron_world):
    """recompute_granularity=selective checkpoints core attention (run twice: forward and recompute) and
    gives the gradients of the plain SDPA layer and of the local one."""
    _, plain, local = _attention_pair("g1-elementwise")
    model, recomputed, _ = _attention_pair(
        "g1-elementwise", recompute_granularity="selective", recompute_modules=["core_attn"]
    )
    recomputed.load_state_dict(plain.state_dict())
    assert recomputed.checkpoint_core_attention and not plain.checkpoint_core_attention
    calls = []
    recomputed.core_attention.register_forward_hook(lambda *a: calls.append(1))
    recomputed.train()
    x = torch.randn(21, 2, model.hidden_size, generator=torch.Generator().manual_seed(8))
    result = _layer_run(recomputed, x)
    assert len(calls) == 2  # the forward, then the recompute in backward
    _assert_same(result, _layer_run(plain, x))
    _assert_same(result, _layer_run(local, x))


# --- the choice ---------------------------------------------------------------------------------------------------
def test_auto_is_sdpa_on_cpu_and_bad_choices_are_refused(megatron_world):
    assert resolve_core_attention("local") == "sdpa"
    assert resolve_core_attention("te", "auto") == "te"
    assert resolve_core_attention("te", "local") == "local"
    assert core_attention_name("local", "auto", cuda=False).startswith("sdpa")
    assert "CUDA backends enabled" in core_attention_name("local", "sdpa", cuda=True)
    model = model_preset("tiny", gate=gates.preset("g1-elementwise"))
    gpt = build_gpt_model(model, transformer_config(model))
    assert all(isinstance(layer.self_attention.core_attention, SDPACoreAttention) for layer in gpt.decoder.layers)
    with pytest.raises(ConfigError) as err:
        resolve_core_attention("local", "flash")
    assert str(err.value) == "core_attention='flash' is not one of auto, sdpa, local, te"
    with pytest.raises(ConfigError, match=r"core_attention='te' needs backend='te' \(got backend='local'\)"):
        build_gpt_model(model, transformer_config(model), core_attention="te")


# --- the benchmark's quick mode -----------------------------------------------------------------------------------
def _bench():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_attention_memory.py"
    spec = importlib.util.spec_from_file_location("bench_attention_memory", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_attention_memory", module)
    spec.loader.exec_module(module)
    return module


def test_benchmark_quick_prints_the_table(megatron_world, capsys):
    """`--quick` runs in this process (sq 64..256) and prints the table, sane figures and both exponents."""
    bench = _bench()
    assert bench.slope([1, 2, 4], [3, 12, 48]) == pytest.approx(2.0)
    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == list(bench.QUICK_SEQS)
    for r in rows:
        local_mib, sdpa_mib, diff = float(r[2]), float(r[3]), float(r[-1])
        assert local_mib > 0 and sdpa_mib > 0  # the peak was seen
        assert diff < 1e-5  # the two layers computed the same output
    assert "growth exponent of peak memory (log-log slope): local" in out
    assert "growth exponent of time (log-log slope): local" in out
