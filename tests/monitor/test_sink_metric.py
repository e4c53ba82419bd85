"""Sink^eps_1 (Gu et al., ICLR 2025) in megagate.monitor.diagnostics: known answers on constructed attention, and on
a real tiny model against the reference formula of sail-sg/Attention-Sink (importance of key k = sum_i A[i, k] /
(T - k), thresholded per sample, layer and head), computed from the probabilities of a T = 64 probe that the test
captures itself, while the probe measures it on a longer sequence."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import tiny_model
from megagate.errors import MegagateError
from megagate.monitor import diagnostics as D


def harmonic(n: int) -> float:
    return sum(1 / (i + 1) for i in range(n))


def sink(stats: dict) -> float:
    return float(stats["sink_hits"] / stats["sink_pairs"])


def test_uniform_attention_counts_query_zero_and_the_first_t_queries():
    # zero logits: query i spreads 1/(i+1) over its causal window, so alpha_1 = H_T / T (query 0 gives 1)
    sq = 10
    logits = D.attention_logits(torch.zeros(sq, 2, 3, 4), torch.randn(sq, 2, 1, 4), scale=1.0)
    assert harmonic(sq) / sq == pytest.approx(0.2929, abs=1e-4)  # < 0.3: no sink over all 10 queries
    assert sink(D.attention_stats(logits, 0.3, 64)) == 0.0
    stats = D.attention_stats(logits, 0.3, 4)  # the first 4 queries: H_4 / 4 = 0.521 > 0.3
    assert sink(stats) == 1.0 and int(stats["sink_length"]) == 4 and float(stats["sink_pairs"]) == 2 * 3
    # without query 0 it would be (H_10 - 1) / 9 = 0.214 and the threshold 0.25 would not be reached either
    assert sink(D.attention_stats(logits, 0.25, 64)) == 1.0


def test_share_of_sample_head_pairs_above_epsilon():
    sq, hn = 8, 4
    query = torch.zeros(sq, 2, 2, hn)
    query[:, :, 0, 0] = 10.0  # head 0 matches only key 0: alpha = 1; head 1 uniform: H_8 / 8 = 0.34
    query[:, 1, 1, 0] = 10.0  # sample 1, head 1 also sinks
    key = torch.zeros(sq, 2, 2, hn)
    key[0, :, :, 0] = 10.0
    stats = D.attention_stats(D.attention_logits(query, key, scale=1.0), 0.5, 64)
    assert sink(stats) == pytest.approx(3 / 4)  # (s0,h0), (s1,h0), (s1,h1) of 4 pairs


@pytest.mark.parametrize(
    "epsilon, length, context, message",
    [
        (0.0, 64, None, r"sink epsilon=0.0 must be in \(0, 1\)"),
        (1.5, 64, None, r"sink epsilon=1.5 must be in \(0, 1\)"),
        (0.3, 0, None, "sink probe length=0 must be a positive integer"),
        (0.3, 128, 64, r"sink probe length 128 is longer than the model's context \(64 tokens\)"),
    ],
)
def test_bad_settings_are_refused_in_one_line(epsilon, length, context, message):
    with pytest.raises(MegagateError, match=message):
        D.check_sink_settings(epsilon, length, context)


def test_real_model_matches_the_reference_formula_on_a_64_token_probe(megatron_world):
    model = tiny_model.build("baseline", seed=2)
    model.eval()
    t, longer, batch = 64, 80, 3
    tokens = tiny_model.text_tokens(batch, longer, index=5)
    probs: list[torch.Tensor] = []  # [b, np, T, T] per layer, from the T-token forward
    hooks = []
    for layer in model.decoder.layers:
        core = layer.self_attention.core_attention

        def capture(module, args, kwargs, core=core):
            q, k = args[0], args[1]
            probs.append(torch.softmax(D.attention_logits(q, k, D.softmax_scale(core, q.shape[-1])), dim=-1))

        hooks.append(core.register_forward_pre_hook(capture, with_kwargs=True))
    try:
        with torch.no_grad():
            model(tokens[:, :t], torch.arange(t).expand(batch, -1), None)
    finally:
        for h in hooks:
            h.remove()
    scores = torch.stack(probs, dim=1)  # (samples, layers, heads, T, T) as the reference keeps them
    ratios = torch.arange(t, 0, -1, dtype=scores.dtype)[None, None, None, None, :]
    importance = (scores / ratios).sum(dim=-2)  # (samples, layers, heads, keys)
    # eps chosen from the data so that the share is neither 0 nor 1 (the tiny model is barely trained): the middle
    # of the widest gap between the sorted alphas of the middle half, so round-off cannot move a pair across it
    alpha = importance[..., 0]
    ranked = alpha.flatten().sort().values.double()
    n = ranked.numel()
    gaps = ranked[n // 4 + 1 : 3 * n // 4] - ranked[n // 4 : 3 * n // 4 - 1]
    i = n // 4 + int(gaps.argmax())
    epsilon = float(ranked[i] + ranked[i + 1]) / 2
    assert float(gaps.max()) > 1e-4
    expected = float((alpha > epsilon).float().mean())
    assert 0.0 < expected < 1.0
    diags = D.collect(model, tokens, sink_epsilon=epsilon)
    assert [d.sink_length for d in diags] == [t, t]
    assert D.to_scalars(diags)["diag/sink"] == pytest.approx(expected)
    per_layer = (alpha > epsilon).float().mean(dim=(0, 2))
    assert [d.sink for d in diags] == pytest.approx(per_layer.tolist())
    # Gu et al.'s eps = 0.3, default: a share in [0, 1], in the record and the scalars
    default = D.collect(model, tokens)
    record = D.records(1, default)[0]
    assert record["sink_length"] == t and 0.0 <= record["sink"] <= 1.0 and not math.isnan(record["sink"])
