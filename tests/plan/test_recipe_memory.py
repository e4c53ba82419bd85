"""The memory plan under the recipes' settings: FP8 linears keep 1-byte inputs, Megatron-FSDP shards weights and
gradients, expert TP 1 routes the sequence-parallel shard's tokens, the uneven split's stages hold their own layers."""

from __future__ import annotations

import copy

from megagate import config_reader as C
from megagate.model import gate
from megagate.model.presets import model_preset
from megagate.plan import memory as mem
from megagate.plan.core import plan
from megagate.plan.params import layer_params

DENSE = {"num_layers": 8, "hidden_size": 1024, "num_attention_heads": 8, "num_query_groups": 4, "head_dim": 128,
         "ffn_hidden_size": 4096, "vocab_size": 32000, "max_sequence_length": 4096, "gate": "baseline"}  # fmt: skip


def test_fp8_linear_inputs_are_one_byte():
    model = model_preset("tiny", gate.preset("baseline"), hidden_size=256, ffn_hidden_size=1024)
    bf16 = mem.ActivationShape(512, 2, 1, False, 2)
    fp8 = mem.ActivationShape(512, 2, 1, False, 2, linear_bytes=1)
    a, b = mem.layer_items(model, bf16, mem.GPU_TE), mem.layer_items(model, fp8, mem.GPU_TE)
    tok, h, f = 512 * 2, 256, model.effective_ffn_hidden_size
    assert a["input norm + linear_qkv input"] - b["input norm + linear_qkv input"] == tok * h
    assert a["pre-MLP norm + MLP input"] - b["pre-MLP norm + MLP input"] == tok * h
    assert a["MLP (fc1 out, SwiGLU, fc2 input)"] - b["MLP (fc1 out, SwiGLU, fc2 input)"] == tok * f
    assert sum(a.values()) - sum(b.values()) == tok * (2 * h + f)  # nothing else moves


def _cfg(**sections):
    data = {"model": copy.deepcopy(DENSE), "data": {"mock": True}, "train": {"precision": "bf16", "backend": "te"}}
    for key, values in sections.items():
        data[key] = {**data.get(key, {}), **values}
    return C.from_dict(data, environment=False)


def test_megatron_fsdp_shards_weights_and_gradients_over_dp():
    base = plan(_cfg(train={"micro_batch_size": 1, "global_batch_size": 8}), 8, "h100-sxm")
    fsdp = plan(_cfg(train={"micro_batch_size": 1, "global_batch_size": 8}, perf={"use_megatron_fsdp": True}), 8,
                "h100-sxm")  # fmt: skip
    w0, w1 = base.roles[0].items["weights (bf16)"], fsdp.roles[0].items["weights (bf16)"]
    unit = sum(p.numel for p in layer_params(base.cfg.model, 1, 1)) * 2
    assert abs(w1 - (w0 / 8 + 2 * unit)) < 0.01 * w0  # a DP-8 shard (buffer padding aside) + two gathered layers
    g0, g1 = base.roles[0].items["gradient buffer (fp32)"], fsdp.roles[0].items["gradient buffer (fp32)"]
    assert abs(g1 - g0 / 8) < 0.01 * g0


def test_uneven_split_stages_hold_their_own_layers():
    parallel = {"pipeline_model_parallel_size": 2, "num_layers_in_first_pipeline_stage": 2}
    p = plan(_cfg(parallel=parallel, train={"micro_batch_size": 1, "global_batch_size": 8}), 2, "h100-sxm")
    assert p.workload.layers() == ((2,), (6,))
    first, last = p.roles
    per_layer = sum(q.numel for q in layer_params(p.cfg.model, 1, 1))
    # stage 1 holds 4 layers more (and the output layer); stage 0 the embedding
    h, v = p.cfg.model.hidden_size, p.cfg.model.vocab_size
    assert last.params - first.params == 4 * per_layer + h + v * h - v * h


def test_recompute_modules_drop_what_they_recompute():
    """The ModelZoo's Qwen3-235B rows recompute [layernorm, moe_act] (not core_attn): the norms' outputs (the next
    linears' saved inputs) and the experts' activation output go; core attention keeps what flash keeps."""
    model = model_preset("tiny", gate.preset("baseline"), num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64)
    shape = mem.ActivationShape(128, 2, 1, False, 2)
    none = mem.layer_items(model, shape, mem.GPU_TE)
    some = mem.layer_items(model, shape, mem.GPU_TE, "selective", ("layernorm", "moe_act"))
    tok, h, routed, f = 256, model.hidden_size, 256 * 2, 64
    assert none["input norm + linear_qkv input"] - some["input norm + linear_qkv input"] == 2 * tok * h
    assert none["pre-MLP norm + MLP input"] - some["pre-MLP norm + MLP input"] == 2 * tok * h
    assert none["experts (permuted tokens + FFN)"] - some["experts (permuted tokens + FFN)"] == 2 * routed * f
    assert sum(none.values()) - sum(some.values()) == 4 * tok * h + 2 * routed * f  # attention untouched
    assert mem.layer_items(model, shape, mem.GPU_TE, "selective") == mem.layer_items(
        model, shape, mem.GPU_TE, "selective", ("core_attn",)
    )  # megatron's default modules: as before


def test_bf16_gradients_halve_the_gradient_buffer():
    """NVIDIA's recipes reduce gradients in bf16 (`perf.grad_reduce_in_fp32: false`): the buffer is half."""
    train = {"micro_batch_size": 1, "global_batch_size": 8}
    fp32 = plan(_cfg(train=train), 8, "h100-sxm").roles[0].items
    bf16 = plan(_cfg(train=train, perf={"grad_reduce_in_fp32": False}), 8, "h100-sxm").roles[0].items
    assert bf16["gradient buffer (bf16)"] * 2 == fp32["gradient buffer (fp32)"]
    assert bf16["weights (bf16)"] == fp32["weights (bf16)"]


def test_layer_offloading_keeps_all_but_the_offloaded_layers_and_one_in_transit():
    """`perf.cpu_offloading_num_layers: 5` of 8 layers (PP 1): the device keeps 3 layers' activations + the one
    whose copy to the host is in flight; the rest of the plan is unchanged."""
    train = {"micro_batch_size": 1, "global_batch_size": 8}
    key = "activations: layers (x chunk forwards in flight)"
    base = plan(_cfg(train=train), 8, "h100-sxm").roles[0].items
    off = plan(_cfg(train=train, perf={"cpu_offloading_num_layers": 5}), 8, "h100-sxm").roles[0].items
    per_layer = base[key] // 8
    assert base[key] == 8 * per_layer and off[key] == 4 * per_layer
    assert {k: v for k, v in off.items() if k not in (key, "workspace margin")} == {
        k: v for k, v in base.items() if k not in (key, "workspace margin")
    }


def test_te_fused_loss_keeps_no_fp32_logits():
    """TE's fused cross-entropy writes its gradient into the bf16 logits: no fp32 copy beside them."""
    train = {"micro_batch_size": 2, "global_batch_size": 16, "seq_length": 1024}
    key = "activations: final norm, output input, fp32 logits"
    native = plan(_cfg(train=train), 8, "h100-sxm").roles[0].items
    te = plan(_cfg(train=train, perf={"cross_entropy_fusion_impl": "te"}), 8, "h100-sxm").roles[0].items
    assert native[key] - te[key] == 4 * 1024 * 2 * DENSE["vocab_size"]
