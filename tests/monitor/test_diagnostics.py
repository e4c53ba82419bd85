"""Diagnostics on constructed inputs with known answers, and through real tiny megatron GPT models (megagate.model,
initialised by the trainer's initialiser; real-text tokens)."""

import math

import pytest
import torch

from helpers import tiny_model
from megagate.monitor import diagnostics as D
from megagate.monitor import tensorboard
from megagate.monitor.attention_math import attention_probs

SEQ = 24


def tokens(batch=2, seq=SEQ, index=0):
    return tiny_model.text_tokens(batch, seq, index)


# --- pure attention math ----------------------------------------------------------------------------------------
def test_all_attention_on_first_token_gives_f_attn_one():
    sq, b, np_, ng, hn = 12, 2, 4, 2, 16
    query = torch.zeros(sq, b, np_, hn)
    query[..., 0] = 10.0
    key = torch.zeros(sq, b, ng, hn)
    key[0, ..., 0] = 10.0  # only key 0 matches: logit 100/4 = 25 against 0 for every other key
    stats = D.attention_stats(D.attention_logits(query, key, scale=1 / math.sqrt(hn)))
    f_attn = float(stats["f_sum_per_head"].sum() / stats["f_count_per_head"].sum())
    assert f_attn == pytest.approx(1.0, abs=1e-9)
    assert float(stats["max_logit"]) == pytest.approx(25.0)
    assert stats["f_count_per_head"].tolist() == [b * (sq - 1)] * np_  # query 0 is excluded


def test_uniform_attention_gives_mean_of_reciprocals():
    sq, hn = 10, 8
    query = torch.zeros(sq, 3, 2, hn)  # zero logits: uniform over the causal window
    key = torch.randn(sq, 3, 1, hn)
    stats = D.attention_stats(D.attention_logits(query, key, scale=0.3))
    f_attn = float(stats["f_sum_per_head"].sum() / stats["f_count_per_head"].sum())
    assert f_attn == pytest.approx(sum(1 / (q + 1) for q in range(1, sq)) / (sq - 1), rel=1e-6)


def test_max_logit_matches_explicit_loops():
    gen = torch.Generator().manual_seed(0)
    sq, b, np_, ng, hn, scale = 7, 2, 6, 3, 5, 0.37
    query, key = torch.randn(sq, b, np_, hn, generator=gen), torch.randn(sq, b, ng, hn, generator=gen)
    logits = D.attention_logits(query, key, scale)
    best = -math.inf
    for bi in range(b):
        for h in range(np_):
            g = h // (np_ // ng)  # megatron's repeat_interleave: consecutive query heads share a group
            for i in range(sq):
                for j in range(i + 1):
                    value = scale * float(query[i, bi, h] @ key[j, bi, g])
                    assert float(logits[bi, h, i, j]) == pytest.approx(value, rel=1e-5, abs=1e-6)
                    best = max(best, value)
                for j in range(i + 1, sq):
                    assert logits[bi, h, i, j] == -math.inf
    assert float(D.attention_stats(logits)["max_logit"]) == pytest.approx(best, rel=1e-6)


# --- through the real model -------------------------------------------------------------------------------------
def test_recomputed_attention_reproduces_core_attention_output(megatron_world):
    """The probe's logits (from what core_attention receives) are the ones the model uses: softmax·V == its output."""
    model = tiny_model.build("g1-elementwise", seed=3)
    model.eval()
    captured = {}
    core = model.decoder.layers[1].self_attention.core_attention
    h1 = core.register_forward_pre_hook(lambda m, a, k: captured.update(q=a[0], k=a[1], v=a[2]), with_kwargs=True)
    h2 = core.register_forward_hook(lambda m, a, out: captured.update(out=out))
    try:
        with torch.no_grad():
            model(tokens(), torch.arange(SEQ).expand(2, -1), None)
    finally:
        h1.remove(), h2.remove()
    q, k, v = captured["q"], captured["k"], captured["v"]
    probs = torch.softmax(D.attention_logits(q, k, D.softmax_scale(core, q.shape[-1])), dim=-1)  # [b, np, sq, sk]
    v = v.permute(1, 2, 0, 3).repeat_interleave(q.shape[2] // v.shape[2], dim=1)  # [b, np, sk, hn]
    out = (probs @ v).permute(2, 0, 1, 3).reshape(SEQ, 2, -1)
    torch.testing.assert_close(out, captured["out"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_probe_probabilities_include_the_softmax_sink(megatron_world, softmax_type):
    """With a softmax sink the probe's probabilities are the model's (the sink's share in every denominator):
    probs·V == core attention's output, and the probe's F-Attn is the mean of exactly those probabilities."""
    model = tiny_model.build("baseline", seed=3, softmax_type=softmax_type)
    model.eval()
    core = model.decoder.layers[0].self_attention.core_attention
    if softmax_type == "learnable":
        with torch.no_grad():  # clearly non-zero sink logits, one per head
            core.softmax_offset.copy_(torch.tensor([-1.0, 0.5, 2.0, 4.0]))
    captured = {}
    h1 = core.register_forward_pre_hook(lambda m, a, k: captured.update(q=a[0], k=a[1], v=a[2]), with_kwargs=True)
    h2 = core.register_forward_hook(lambda m, a, out: captured.update(out=out))
    try:
        with torch.no_grad():
            model(tokens(), torch.arange(SEQ).expand(2, -1), None)
    finally:
        h1.remove(), h2.remove()
    q, k, v = captured["q"], captured["k"], captured["v"]
    logits = D.attention_logits(q, k, D.softmax_scale(core, q.shape[-1]))
    probs = attention_probs(logits, core.softmax_offset)
    assert float(probs.sum(-1).max()) < 1.0  # the rest of every row is on the sink
    v = v.permute(1, 2, 0, 3).repeat_interleave(q.shape[2] // v.shape[2], dim=1)
    out = (probs @ v).permute(2, 0, 1, 3).reshape(SEQ, 2, -1)
    torch.testing.assert_close(out, captured["out"], atol=1e-5, rtol=1e-5)
    diags = D.collect(model, tokens())
    assert diags[0].f_attn == pytest.approx(float(probs[:, :, 1:, 0].mean()), rel=1e-5)
    assert diags[0].f_attn < float(torch.softmax(logits, -1)[:, :, 1:, 0].mean())  # below the sink-free value


def test_off_by_one_on_zero_logits_gives_one_over_i_plus_two():
    logits = D.attention_logits(torch.zeros(6, 1, 2, 4), torch.zeros(6, 1, 2, 4), scale=1.0)
    probs = attention_probs(logits, torch.zeros(2))  # query i: i + 1 keys and the sink, all at logit 0
    expected = torch.tensor([1 / (i + 2) for i in range(6)])
    torch.testing.assert_close(probs[0, 1, :, 0], expected)


def test_zero_qkv_weights_give_known_answers(megatron_world):
    """linear_qkv = 0: gate logits 0 -> sigmoid scores exactly 0.5; q = k = 0 -> uniform attention, logits 0."""
    model = tiny_model.build("g1-elementwise", seed=1)
    for layer in model.decoder.layers:
        torch.nn.init.zeros_(layer.self_attention.linear_qkv.weight)
    model.train()
    diags = D.collect(model, tokens())
    assert model.training  # mode restored
    uniform = sum(1 / (q + 1) for q in range(1, SEQ)) / (SEQ - 1)
    assert [d.layer for d in diags] == [0, 1]
    for d in diags:
        assert d.gate_score_mean == 0.5 and d.gate_sparsity == 0.0 and d.gate_min == d.gate_max == 0.5
        assert d.f_attn == pytest.approx(uniform, rel=1e-6)
        assert d.f_attn_per_head == pytest.approx([uniform] * 4, rel=1e-6)
        assert d.max_logit == 0.0
        # every score falls in the bin [0.5, 0.55); counts = distinct scores: sq·b·heads·head_dim
        assert d.gate_hist_counts[10] == SEQ * 2 * 4 * 16 and sum(d.gate_hist_counts) == SEQ * 2 * 4 * 16


def test_input_independent_gate_with_known_parameters(megatron_world):
    model = tiny_model.build("g1-input-independent", seed=1)
    low, high = 0.05, 0.8
    for layer in model.decoder.layers:
        param = layer.self_attention.gate_param  # [heads, head_dim], broadcast over sq and b
        with torch.no_grad():
            param[:2] = math.log(low / (1 - low))
            param[2:] = math.log(high / (1 - high))
    for d in D.collect(model, tokens()):
        assert d.gate_score_mean == pytest.approx((low + high) / 2, rel=1e-6)
        assert d.gate_sparsity == 0.5  # half the scores are below 0.1
        assert d.gate_min == pytest.approx(low, rel=1e-6) and d.gate_max == pytest.approx(high, rel=1e-6)


def test_m_act_matches_next_layer_input_and_final_norm_input(megatron_world):
    model = tiny_model.build("baseline", seed=2)
    seen = {}
    hooks = [
        model.decoder.layers[1].register_forward_pre_hook(
            lambda m, a, k: seen.update(l0=float((a[0] if a else k["hidden_states"]).abs().max())), with_kwargs=True
        ),
        model.decoder.final_layernorm.register_forward_pre_hook(lambda m, a: seen.update(l1=float(a[0].abs().max()))),
    ]
    try:
        diags = D.collect(model, tokens())
    finally:
        for h in hooks:
            h.remove()
    assert diags[0].m_act == seen["l0"] and diags[1].m_act == seen["l1"]
    assert diags[0].gate_score_mean is None  # the baseline has no gate


def test_no_hooks_remain_and_errors_clean_up(megatron_world):
    model = tiny_model.build("g1-elementwise", seed=0)
    D.collect(model, tokens())

    def instrumented():
        n = 0
        for module in model.modules():
            n += len(module._forward_hooks) + len(module._forward_pre_hooks)
            n += getattr(module, "score_observer", None) is not None
        return n

    assert instrumented() == 0
    with pytest.raises(RuntimeError, match="interrupted"):
        with D.Probe(model):
            # per layer: layer hook, core-attention pre-hook, score observer; and the output layer's log-Z hook
            assert instrumented() == 2 * 3 + 1
            model(tokens(), torch.arange(SEQ).expand(2, -1), None)
            raise RuntimeError("interrupted")  # e.g. an OOM in the middle of a probe
    assert instrumented() == 0


def test_sparse_scores_histogram_and_tensorboard(megatron_world, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    model = tiny_model.build("g1-headwise", seed=0)
    diags = D.collect(model, tokens(), keep_attn_map=True)
    scalars = D.to_scalars(diags)
    assert scalars["diag/f_attn"] == pytest.approx((diags[0].f_attn + diags[1].f_attn) / 2)
    assert scalars["diag/m_act"] == max(d.m_act for d in diags)
    assert scalars["diag/layer_01/gate_score"] == diags[1].gate_score_mean
    assert diags[0].attn_map.shape == (SEQ, SEQ) and torch.allclose(diags[0].attn_map.sum(-1), torch.ones(SEQ))
    writer = SummaryWriter(str(tmp_path))
    tensorboard.write(writer, 7, D.to_metrics(diags))
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    (f_attn,) = acc.Scalars("diag/layer_00/f_attn")
    assert (f_attn.step, f_attn.value) == (7, pytest.approx(diags[0].f_attn, rel=1e-6))
    (hist,) = acc.Histograms("diag/layer_01/gate_scores")
    assert hist.step == 7 and hist.histogram_value.num == sum(diags[1].gate_hist_counts)
    # headwise G1: one score per (token, batch, head)
    assert hist.histogram_value.num == SEQ * 2 * 4
    records = D.records(7, diags)
    assert records[1] == {
        "step": 7,
        "layer": 1,
        "gate_score_mean": diags[1].gate_score_mean,
        "gate_sparsity": diags[1].gate_sparsity,
        "f_attn": diags[1].f_attn,
        "m_act": diags[1].m_act,
        "max_logit": diags[1].max_logit,
        "sink": diags[1].sink,
        "sink_length": SEQ,  # the probe is shorter than Gu et al.'s 64 tokens
    }
