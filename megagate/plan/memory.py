"""Per-rank memory: weights, gradient buffers, optimizer shards (exact, from megagate.plan.params) and activations.

Activations are an inventory of the tensors autograd keeps per layer (what `saved_tensors_hooks` sees), derived from
megatron-core 0.19's modules and checked on CPU against a real forward of the local modules
(tests/plan/test_activations.py). The kernel sets:

* `CPU_LOCAL`: megatron's local modules as they run without CUDA (what the test measures): torch's composite RMSNorm
  keeps two fp32 copies of its input, attention is megatron's unfused DotProductAttention (scores [b, np, sq, sk]
  kept as fp32 softmax output and bf16 probabilities, GQA keys/values expanded to all heads), SwiGLU unfused;
* `CPU_SDPA`: the same with megagate's SDPA core attention (the CPU default): torch's flash kernel keeps q, k, v,
  its output and the log-sum-exp, as GPU_SDPA (not measured byte for byte);
* `GPU_TE`: Transformer Engine / flash attention on a GPU: fused norms keep their input and fp32 1/rms, flash
  attention keeps q, k, v (KV heads only), its output and the fp32 log-sum-exp, megatron's fused SwiGLU keeps its input;
* `GPU_SDPA`: megatron's local modules on a GPU (no TE) with megagate's SDPA core attention (the default there): fused
  norms, and torch's flash / cuDNN / memory-efficient attention keeps what flash attention keeps (as GPU_TE);
* `GPU_LOCAL`: megatron's local modules on a GPU with its own core attention (perf.core_attention: local): fused
  norms, but the unfused attention of CPU_LOCAL.

Symbols: s = sequence / CP, b = micro-batch, h, np/ng = heads/KV groups per TP rank, d = head dim, f = FFN width per
TP rank, a = bytes of an activation element (2 for bf16/fp8, 4 for fp32). With sequence parallelism the tensors in
the sequence domain (norms, the inputs of column-parallel linears) are split over TP too.
"""

from __future__ import annotations

from dataclasses import dataclass

from megagate.model.gate_params import gate_parameters
from megagate.model.model_config import ModelConfig


@dataclass(frozen=True)
class Kernels:
    """Which implementation each saved-tensor-heavy op has."""

    name: str
    composite_norm: bool  # torch's composite RMSNorm (CPU): two fp32 copies of the input + fp32 1/rms
    flash_attention: bool  # fused/flash attention: no [b, np, s, s] scores kept
    fused_swiglu: bool  # megatron's bias_swiglu fusion: keeps only its input


CPU_LOCAL = Kernels("cpu-local", composite_norm=True, flash_attention=False, fused_swiglu=False)
# the trainer's CPU default (perf.core_attention auto = SDPA): CPU_LOCAL's norms and SwiGLU, flash-like attention
CPU_SDPA = Kernels("cpu-sdpa", composite_norm=True, flash_attention=True, fused_swiglu=False)
GPU_LOCAL = Kernels("gpu-local", composite_norm=False, flash_attention=False, fused_swiglu=True)
GPU_TE = Kernels("gpu-te", composite_norm=False, flash_attention=True, fused_swiglu=True)
GPU_SDPA = Kernels("gpu-sdpa", composite_norm=False, flash_attention=True, fused_swiglu=True)


@dataclass(frozen=True)
class ActivationShape:
    """The sizes one micro-batch's activations depend on."""

    seq: int  # sequence length per CP rank
    micro_batch: int
    tp: int = 1
    sequence_parallel: bool = False
    act_bytes: int = 2
    expert_tp: int | None = None  # expert tensor parallelism (None: TP, as megagate builds it)
    # bytes of a linear layer's saved input: 1 under FP8 (TE keeps the quantised copy for the weight gradient),
    # None: act_bytes
    linear_bytes: int | None = None


def _norm(tokens: int, width: int, a: int, k: Kernels) -> int:
    """A norm over `tokens` rows of `width`: composite keeps 2 fp32 copies, fused keeps its input; both 1/rms."""
    return tokens * width * (8 if k.composite_norm else a) + 4 * tokens


def layer_items(
    model: ModelConfig,
    shape: ActivationShape,
    k: Kernels,
    recompute: str | None = None,
    modules: tuple[str, ...] = ("core_attn",),
) -> dict:
    """Bytes autograd keeps for one transformer layer and one micro-batch, by item. Under selective recompute
    `modules` are megatron's recompute_modules: core_attn keeps only its inputs; layernorm drops the norms' outputs
    (the linear layers' saved inputs, recomputed from the norm's input); moe_act drops the experts' activation output
    (fc2's saved input)."""
    s, b, t, a = shape.seq, shape.micro_batch, shape.tp, shape.act_bytes
    la = a if shape.linear_bytes is None else shape.linear_bytes  # a linear layer's saved input (FP8: 1 byte)
    h, d = model.hidden_size, model.head_dim
    # groups fewer than TP: each rank holds one whole group (megatron gathers its projection)
    n, g = model.num_attention_heads // t, max(1, model.num_query_groups // t)
    tok_full = s * b  # tokens after the sequence-parallel all-gather (attention, MLP interior)
    tok = tok_full // t if shape.sequence_parallel else tok_full  # tokens in the sequence domain
    x_q, x_kv = tok_full * n * d, tok_full * g * d  # elements of q (or the context) and of k (or v)
    items: dict[str, int] = {}
    selective = set(modules) if recompute == "selective" else set()
    norm_out = 0 if "layernorm" in selective else la  # a norm's output, the next linear's saved input
    items["input norm + linear_qkv input"] = _norm(tok, h, a, k) + norm_out * tok * h
    if model.qk_layernorm:
        items["q/k norms"] = _norm(tok_full * n, d, a, k) + _norm(tok_full * g, d, a, k)
    items["rotary cos/sin"] = 4 * a * s * d
    if "core_attn" in selective:
        items["core attention (selective: q, k + linear_qkv output kept)"] = selective_kept(model, shape)
    elif k.flash_attention:
        items["core attention (flash: q, k, v, lse)"] = a * (x_q + 2 * x_kv) + 4 * b * n * s
    else:
        scores = b * n * s * s
        items["core attention (unfused: q, k, v at all heads)"] = 3 * a * x_q
        items["attention scores [b, np, s, s] (fp32 softmax + probs + mask)"] = (4 + a) * scores + s * s
    gate = model.gate
    context = a * x_q  # the attention output entering linear_proj (a new tensor when gated)
    if gate.enabled:
        width = gate.width(d)
        heads = 1 if gate.sharing == "head_shared" else (n if gate.on_query_heads else g)
        scores = tok_full * (h // t if gate.position == "g5" else heads * width)
        if gate.input == "input_independent":  # one learned score per head and channel, broadcast over tokens
            scores //= tok_full
        gated = tok_full * (h if gate.position == "g5" else (n if gate.on_query_heads else g) * d)
        # fp32 activation output + the gated tensor (a copy unless flash attention's kept output is reused); G2/G3
        # gate value/key, which are views of the fused linear_qkv output: the multiply keeps that whole output alive
        # (under selective recompute flash attention runs in no_grad and keeps nothing: the gate's copy counts)
        reused = k.flash_attention and gate.position == "g1" and "core_attn" not in selective
        kept = qkv_output_bytes(model, shape) if gate.position in ("g2", "g3") else a * gated
        items["gate (fp32 scores + gated input)"] = 4 * scores + (0 if reused else kept)
    elif k.flash_attention and "core_attn" not in selective:
        context = 0  # linear_proj keeps flash attention's own output (which, under selective, flash does not keep)
    if gate.sdpa_norm == "rmsnorm":
        items["sdpa norm"] = _norm(tok_full * n, d, a, k)
    items["linear_proj input"] = context if la == a else context // a * la
    if gate.sandwich_norm:
        items["sandwich norms"] = 2 * _norm(tok, h, a, k)
    items["pre-MLP norm + MLP input"] = _norm(tok, h, a, k) + norm_out * tok * h
    if model.is_moe:
        etp = shape.expert_tp or t
        e, topk, f = model.num_experts, model.moe_router_topk, model.moe_ffn_hidden_size // etp
        # tokens an EP rank computes, with balanced routing (EP-independent): its expert-TP group's share
        routed = tok_full * topk if shape.expert_tp is None else tok * etp * topk
        items["router + dispatcher"] = tok * (a * e + 4 * e + 20 * topk + a) + 8 * tok * topk + (1 + a) * e * tok
        # fc1 out, SwiGLU (+ probs), fc2 input (la), probs
        per_token = ((2 if k.fused_swiglu else 5) * a + (0 if "moe_act" in selective else la)) * f + a
        items["experts (permuted tokens + FFN)"] = la * routed * h + routed * per_token
    else:
        f = model.effective_ffn_hidden_size // t
        items["MLP (fc1 out, SwiGLU, fc2 input)"] = ((2 if k.fused_swiglu else 4) * a + la) * tok_full * f
    return items


def qkv_output_bytes(model: ModelConfig, shape: ActivationShape) -> int:
    """The fused linear_qkv output of one TP rank: q, k, v and the fused gate rows, for all tokens (after SP's gather).

    GatedSelfAttention.get_query_key_value_tensors splits it into key and value *views* (query is reshaped into a
    copy), so whatever autograd keeps of an ungated key or value keeps this whole tensor alive.
    """
    t, d, h = shape.tp, model.head_dim, model.hidden_size
    heads, groups = model.num_attention_heads, model.num_query_groups
    gate_rows = sum(e.numel for e in gate_parameters(model.gate, h, heads, groups, d) if e.in_linear_qkv) // h
    return shape.act_bytes * shape.seq * shape.micro_batch * ((heads + 2 * groups) * d + gate_rows) // t


def selective_kept(model: ModelConfig, shape: ActivationShape) -> int:
    """What megatron's selective recompute (`_checkpointed_attention_forward`) keeps for one layer's core attention.

    `tensor_parallel.checkpoint` saves its tensor inputs: query, key, value, the attention mask (None: causal) and the
    mask type as a one-element int32 tensor (4 bytes). query and key are new tensors (the per-head reshape of q
    copies; QK-norm and RoPE make new ones). value is a view of the fused linear_qkv output (`qkv_output_bytes`), so
    keeping it keeps that whole output alive, gate rows included; under G2 the gated value is a tensor of its own, and
    under G3 the gate's multiply already keeps the fused output (counted in the gate item, not twice). Checked
    exactly on CPU against the storages a real forward saves (tests/plan/test_activations.py).
    """
    a, tokens = shape.act_bytes, shape.seq * shape.micro_batch
    n, g, d = model.num_attention_heads // shape.tp, max(1, model.num_query_groups // shape.tp), model.head_dim
    rotated = a * tokens * (n + g) * d  # query and key after RoPE
    position = model.gate.position
    value = a * tokens * g * d if position == "g2" else 0 if position == "g3" else qkv_output_bytes(model, shape)
    return rotated + value + 4


def layer_bytes(
    model: ModelConfig,
    shape: ActivationShape,
    k: Kernels,
    recompute: str | None = None,
    modules: tuple[str, ...] = ("core_attn",),
) -> int:
    return sum(layer_items(model, shape, k, recompute, modules).values())


def checkpoint_bytes(model: ModelConfig, shape: ActivationShape) -> int:
    """What a full-recompute checkpoint keeps: the layer group's input hidden state."""
    tok = shape.seq * shape.micro_batch // (shape.tp if shape.sequence_parallel else 1)
    return shape.act_bytes * tok * model.hidden_size


def embedding_bytes(shape: ActivationShape) -> int:
    """The first stage's token ids (int64), kept by the embedding lookup."""
    return 8 * shape.seq * shape.micro_batch


def output_items(
    model: ModelConfig, shape: ActivationShape, k: Kernels, local_loss: bool = False, te_loss: bool = False
) -> dict:
    """The last stage's final norm, output-layer input, fp32 softmax of the logits kept by the loss, labels.
    `local_loss`: torch's cross-entropy (megagate.model.loss, TP = 1) instead of megatron's vocab-parallel one.
    `te_loss`: Transformer Engine's fused cross-entropy (`perf.cross_entropy_fusion_impl: te`, NVIDIA's recipes),
    which writes the gradient into the logits' own (activation-dtype) buffer in its forward and keeps no fp32 copy:
    only the labels stay beside the logits (counted in `logits_transient`)."""
    s, b, t, a = shape.seq, shape.micro_batch, shape.tp, shape.act_bytes
    tok = s * b // (t if shape.sequence_parallel else 1)
    vocab = model.vocab_size // t
    # megatron's: the softmax, labels int64 and the target mask; torch's: log-softmax, labels and a scalar weight
    labels = 8 * s * b + 4 if local_loss else 9 * s * b
    return {
        "final norm + output-layer input": _norm(tok, model.hidden_size, a, k) + a * tok * model.hidden_size,
        "logits fp32 (kept by the loss)": (0 if te_loss else 4 * s * b * vocab) + labels,
    }


def logits_transient(model: ModelConfig, shape: ActivationShape) -> int:
    """The logits in the activation dtype, alive while the loss is computed (and their gradient in backward)."""
    return shape.act_bytes * shape.seq * shape.micro_batch * model.vocab_size // shape.tp


def in_flight(pp: int, pp_rank: int, vpp: int | None, microbatches: int, ep_overlap: bool = False) -> int:
    """Forward passes of model chunks whose activations a stage holds at its peak (megatron's schedules).

    1F1B: min(PP - rank, M) micro-batches of the whole stage. Interleaved: (PP - rank - 1) x 2 + (VPP - 1) x PP warm-up
    chunk forwards plus one, capped at M x VPP; each is one chunk of num_layers / (PP x VPP) layers. The EP A2A
    overlap (`ep_overlap`) warms up one chunk more, so that each 1F1B step's forward and backward are independent.
    """
    if vpp:
        warmup = (pp - pp_rank - 1) * 2 + (vpp - 1) * pp + (1 if ep_overlap else 0)
        return min(warmup + 1, microbatches * vpp)
    return min(pp - pp_rank, microbatches)


def recomputed_layers(model: ModelConfig, layers_per_chunk: int) -> tuple[int, int, int]:
    """(checkpoints kept per chunk, layers kept in full per chunk, layers recomputed at once) under model's recompute."""
    if model.recompute_granularity != "full":
        return 0, layers_per_chunk, 0
    n = model.recompute_num_layers or 1
    if model.recompute_method == "uniform":
        return -(-layers_per_chunk // n), 0, min(n, layers_per_chunk)
    block = min(n, layers_per_chunk)  # block: the first n layers of each chunk, one checkpoint each
    return block, layers_per_chunk - block, 1 if block else 0
