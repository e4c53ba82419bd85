"""Why `train.qk_clip_threshold` is refused (docs/monitoring.md, QK-clip): what megatron-core 0.19's QK-clip does
with megagate's attention, in numbers.

megatron's `SelfAttention.clip_qk` reads each head's max attention logit from `core_attention.current_max_attn_logits`
(written only by Transformer Engine's fused attention, TE >= 2.9) and, where a query group's max exceeds the
threshold, multiplies its q rows of linear_qkv by eta^alpha and its k rows by eta^(1 - alpha), eta = threshold / max.
These tests pin the three facts behind the refusal; when one changes, the refusal is to be looked at again."""

from __future__ import annotations

import pytest
import torch

from megagate.model import gate as gates
from megagate.model.build import build_gpt_model, transformer_config
from megagate.model.presets import model_preset
from megagate.model.qkv_layout import qkv_layout

THRESHOLD, MAX_LOGIT, ALPHA = 1.0, 4.0, 0.5  # eta = 1/4: q and k rows x 1/2, v rows unchanged


def _layer(variant: str, core: str):
    """The first GatedSelfAttention of a tiny model built with QK-clip on, after one forward and backward."""
    model = model_preset("tiny", gate=gates.preset(variant))
    config = transformer_config(model, qk_clip=True, qk_clip_threshold=THRESHOLD, qk_clip_alpha=ALPHA)
    gpt = build_gpt_model(model, config, core_attention=core)
    tokens = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    gpt(tokens, torch.arange(16).expand(2, 16), None, labels=tokens).sum().backward()
    return model, gpt.decoder.layers[0].self_attention


@pytest.mark.parametrize("core", ["local", "sdpa"])
def test_megagates_core_attentions_track_no_max_logit(megatron_world, core):
    _, attn = _layer("g1-elementwise", core)
    assert not hasattr(attn.core_attention, "current_max_attn_logits")
    with pytest.raises(AttributeError, match="current_max_attn_logits"):
        attn.clip_qk()


def test_megatrons_rescale_with_a_given_max_logit_on_the_ungated_layout(megatron_world):
    """Given a max logit over the threshold, megatron scales the q and k rows down (x 1/2 here) and leaves v."""
    model, attn = _layer("baseline", "sdpa")
    attn.core_attention.current_max_attn_logits = torch.full((model.num_attention_heads,), MAX_LOGIT)
    before = attn.linear_qkv.weight.detach().clone()
    attn.clip_qk()
    layout = qkv_layout(gates.preset("baseline"), model.num_attention_heads, model.num_query_groups, model.head_dim)
    ratio = (attn.linear_qkv.weight.detach() / before).view(layout.num_groups, layout.rows_per_group, -1)
    start = 0
    expected = {"q": (THRESHOLD / MAX_LOGIT) ** ALPHA, "k": (THRESHOLD / MAX_LOGIT) ** (1 - ALPHA), "v": 1.0}
    for name, size in layout.group_segments():
        assert torch.allclose(ratio[:, start : start + size], torch.tensor(expected[name])), name
        start += size
    assert attn.core_attention.current_max_attn_logits is None  # reset for the next step


def test_megatrons_rescale_fails_on_the_fused_gate_rows(megatron_world):
    """With G1's gate rows fused into linear_qkv, megatron's [q|k|v] split of the weight does not fit."""
    model, attn = _layer("g1-elementwise", "sdpa")
    attn.core_attention.current_max_attn_logits = torch.full((model.num_attention_heads,), MAX_LOGIT)
    with pytest.raises(RuntimeError, match="must match the size"):
        attn.clip_qk()
