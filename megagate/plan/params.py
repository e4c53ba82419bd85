"""What each rank holds: its parameters (in megatron's order), its DDP buffers and its distributed-optimizer shard.

Pure arithmetic, no torch. The rules are megatron-core 0.19's, read from its sources and checked exactly against
models built on the meta device under a fake process group of the full world size (tests/plan/test_meta_build.py):

* a rank of pipeline stage p holds, per virtual chunk, `num_layers / (PP x VPP)` layers; the embedding lives on the
  first chunk of the first stage, the final norm and the output layer on the last chunk of the last stage (with tied
  embeddings and PP > 1 the last stage keeps its own copy of the embedding, marked `shared_embedding`);
* column/row-parallel weights are split over TP, expert weights over EP (whole experts) and expert-TP (= TP), norms,
  QK-norms and the router are replicated;
* DDP keeps one contiguous buffer per (dtype, expert) group and model chunk, filled in reverse parameter order, each
  parameter starting on a 64-element boundary; with the distributed optimizer each bucket ends padded to a multiple of
  lcm(DP, 128) (DP: the dense data-parallel group x CP, or the expert data-parallel group), and a parameter marked
  `shared_embedding` gets a bucket of its own; the trainer does not overlap the gradient reduction, so there is
  otherwise one bucket per buffer;
* expert parameters form their own buffer only when EP > 1 (megatron marks them `allreduce=False` only then);
* data-parallel rank r of a bucket owns elements [start + r x S, start + (r + 1) x S) with S = bucket size / DP; its
  optimizer state covers the real (unpadded) parameter elements in that range.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from megagate.model import hybrid
from megagate.model.gate_params import gate_parameters
from megagate.model.model_config import ModelConfig


@dataclass(frozen=True)
class Param:
    """One parameter tensor of a rank (its local, sharded size)."""

    name: str
    numel: int
    expert: bool = False  # an expert weight (sharded over EP)
    shared_embedding: bool = False  # the tied embedding/output copy megatron puts in a bucket of its own

    @property
    def is_norm(self) -> bool:
        """A norm weight: fp32 under megatron's local spec without apex (torch's norm modules), else params_dtype."""
        return self.name.endswith(("layernorm.weight", "bda.norm.weight"))


@dataclass(frozen=True)
class RankShape:
    """The sizes that decide what a rank holds."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    cp: int = 1
    dp: int = 1  # dense data-parallel size (world / (TP x PP x CP))
    expert_dp: int = 1  # world / (ETP x EP x PP)
    etp: int | None = None  # expert tensor parallelism (None: TP)
    stage_layers: tuple[tuple[int, ...], ...] | None = None  # [PP][chunk] layers (None: the even split)

    @property
    def chunks(self) -> int:
        return self.vpp or 1


def _gdn_params(model: ModelConfig, tp: int, prefix: str) -> list[Param]:
    """A Gated DeltaNet mixer's parameters (megatron's GatedDeltaNet: its own tensors, then in_proj, conv1d, the
    output norm, out_proj), sharded over TP by heads."""
    h, nv = model.hidden_size, model.linear_num_value_heads
    qk = model.linear_num_key_heads * model.linear_key_head_dim
    v = nv * model.linear_value_head_dim
    p = prefix + "self_attention."
    return [
        Param(p + "dt_bias", nv // tp),
        Param(p + "A_log", nv // tp),
        Param(p + "in_proj.weight", (2 * qk + 2 * v + 2 * nv) * h // tp),
        Param(p + "conv1d.weight", (2 * qk + v) * model.linear_conv_kernel_dim // tp),
        Param(p + "out_norm.weight", model.linear_value_head_dim),
        Param(p + "out_proj.weight", v * h // tp),
    ]


def layer_params(
    model: ModelConfig, tp: int, ep: int, prefix: str = "", mixer: str = "*", etp: int | None = None
) -> list[Param]:
    """One transformer layer's parameters on a TP/EP rank, in the order megatron's local spec registers them;
    `mixer` "G": a Gated DeltaNet layer of a hybrid (megagate.model.hybrid); `etp`: expert tensor parallelism
    (None: TP)."""
    out: list[Param] = [Param(prefix + "input_layernorm.weight", model.hidden_size)]
    if mixer == "G":
        out += _gdn_params(model, tp, prefix)
    else:
        out += _attention_params(model, tp, prefix)
    return out + _mlp_params(model, tp, ep, prefix, etp)


def _attention_params(model: ModelConfig, tp: int, prefix: str) -> list[Param]:
    h, n, g, d = model.hidden_size, model.num_attention_heads, model.num_query_groups, model.head_dim
    gate_entries = gate_parameters(model.gate, h, n, g, d)
    qkv_extra = sum(e.numel for e in gate_entries if e.in_linear_qkv)  # fused gate rows (sharded with q/k/v)
    out: list[Param] = []
    # GatedSelfAttention registers its own gate parameters before megatron's attention builds linear_proj
    for e in gate_entries:
        if not e.in_linear_qkv:
            out.append(Param(prefix + "self_attention." + e.name, math.prod(e.local_shape(tp))))
    if model.softmax_type == "learnable":  # core attention (built before linear_proj): one sink logit per head
        out.append(Param(prefix + "self_attention.core_attention.softmax_offset", n // tp))
    out.append(Param(prefix + "self_attention.linear_proj.weight", h * n * d // tp))
    out.append(Param(prefix + "self_attention.linear_qkv.weight", ((n + 2 * g) * d * h + qkv_extra) // tp))
    if model.qk_layernorm:
        out += [
            Param(prefix + "self_attention.q_layernorm.weight", d),
            Param(prefix + "self_attention.k_layernorm.weight", d),
        ]
    return out


def _mlp_params(model: ModelConfig, tp: int, ep: int, prefix: str, etp: int | None = None) -> list[Param]:
    h = model.hidden_size
    out: list[Param] = []
    if model.gate.sandwich_norm:
        out.append(Param(prefix + "self_attn_bda.norm.weight", h))
    out.append(Param(prefix + "pre_mlp_layernorm.weight", h))
    if model.is_moe:
        f = model.moe_ffn_hidden_size
        out.append(Param(prefix + "mlp.router.weight", model.num_experts * h))
        expert = ep > 1  # megatron marks expert weights allreduce=False (their own buffer) only under EP
        for i in range(model.num_experts // ep):
            base = f"{prefix}mlp.experts.local_experts.{i}."
            out.append(Param(base + "linear_fc1.weight", 2 * f * h // (etp or tp), expert=expert))
            out.append(Param(base + "linear_fc2.weight", h * f // (etp or tp), expert=expert))
        shared = model.moe_shared_expert_intermediate_size
        if shared:  # SharedExpertMLP: its gate weight (replicated), then its SwiGLU (TP-sharded like a dense MLP)
            if model.moe_shared_expert_gate:
                out.append(Param(prefix + "mlp.shared_experts.gate_weight", h))
            out.append(Param(prefix + "mlp.shared_experts.linear_fc1.weight", 2 * shared * h // tp))
            out.append(Param(prefix + "mlp.shared_experts.linear_fc2.weight", h * shared // tp))
    else:
        f = model.effective_ffn_hidden_size
        out.append(Param(prefix + "mlp.linear_fc1.weight", 2 * f * h // tp))
        out.append(Param(prefix + "mlp.linear_fc2.weight", h * f // tp))
    if model.gate.sandwich_norm:
        out.append(Param(prefix + "mlp_bda.norm.weight", h))
    return out


def chunk_params(model: ModelConfig, shape: RankShape, pp_rank: int, chunk: int) -> list[Param]:
    """The parameters of model chunk `chunk` (virtual stage) on pipeline stage `pp_rank`, in megatron's order."""
    first = pp_rank == 0 and chunk == 0
    last = pp_rank == shape.pp - 1 and chunk == shape.chunks - 1
    h, vocab = model.hidden_size, model.vocab_size // shape.tp
    if shape.stage_layers is not None:  # the uneven split (megagate.distributed.layout.stage_layers)
        layers = shape.stage_layers[pp_rank][chunk]
    else:
        layers = model.num_layers // (shape.pp * shape.chunks)
    out: list[Param] = []
    if first:
        # tied embeddings across stages: megatron marks the first stage's copy too (a bucket of its own)
        out.append(
            Param("embedding.word_embeddings.weight", vocab * h, shared_embedding=model.tie_embeddings and not last)
        )
    pattern = hybrid.pattern(model)
    # megatron's layer offset of this virtual stage: the layers of the stages before it, chunk by chunk
    if shape.stage_layers is not None:
        offset = sum(
            shape.stage_layers[r][c] for c in range(chunk + 1) for r in range(shape.pp) if (c, r) < (chunk, pp_rank)
        )
    else:
        offset = (chunk * shape.pp + pp_rank) * layers
    for i in range(layers):
        out += layer_params(
            model, shape.tp, shape.ep, prefix=f"decoder.layers.{i}.", mixer=pattern[offset + i], etp=shape.etp
        )
    if last:
        out.append(Param("decoder.final_layernorm.weight", h))
        if not model.tie_embeddings:
            out.append(Param("output_layer.weight", vocab * h))
        elif not first:
            out.append(Param("output_layer.weight", vocab * h, shared_embedding=True))
    return out


@dataclass(frozen=True)
class Buffer:
    """One DDP buffer (parameters of one dtype group of one model chunk), laid out as megatron lays it out."""

    expert: bool
    dp: int  # the data-parallel size its buffer is sharded over
    fp32: bool  # an fp32 parameter group (norms under the local spec) beside the params_dtype one
    numel_unpadded: int
    buckets: tuple[tuple[int, int], ...]  # (start, end) of each bucket, padded
    # real parameter ranges [start, end) in buffer order, for the owned-element count of a DP rank
    starts: tuple[int, ...] = field(repr=False, default=())
    ends: tuple[int, ...] = field(repr=False, default=())
    prefix: tuple[int, ...] = field(repr=False, default=())  # real elements before range i

    @property
    def numel(self) -> int:
        return self.buckets[-1][1] if self.buckets else 0

    def _real_below(self, x: int) -> int:
        i = bisect.bisect_right(self.starts, x) - 1
        if i < 0:
            return 0
        return self.prefix[i] + min(x, self.ends[i]) - self.starts[i]

    def owned(self, dp_rank: int) -> int:
        """Real parameter elements whose optimizer state data-parallel rank `dp_rank` keeps."""
        total = 0
        for start, end in self.buckets:
            size = (end - start) // self.dp
            lo = start + dp_rank * size
            total += self._real_below(lo + size) - self._real_below(lo)
        return total

    def max_owned(self) -> int:
        """The largest optimizer shard over the data-parallel ranks (the rank that bounds the memory)."""
        return max(self.owned(r) for r in range(self.dp))


def _pad(x: int, divisor: int) -> int:
    return -(-x // divisor) * divisor


def layout_buffer(
    params: list[Param], dp: int, distributed_optimizer: bool, expert: bool, fp32: bool = False
) -> Buffer:
    """megatron's buffer layout of `params` (one bucket per buffer, as with overlap_grad_reduce off).

    With the distributed optimizer: DistributedOptimizer._compute_per_buffer_param_layout; without it megatron's
    default layout, which packs the parameters with no padding at all.
    """
    divisor = math.lcm(dp, 128)
    buckets: list[tuple[int, int]] = []
    starts: list[int] = []
    ends: list[int] = []
    start = bucket_start = end = 0
    in_bucket = 0
    for p in reversed(params):  # megatron fills buffers in backprop order
        if distributed_optimizer:
            start = _pad(start, 64)
            if p.shared_embedding and in_bucket:
                bucket_start = start = _finish(buckets, bucket_start, start, divisor)
                in_bucket = 0
        end = start + p.numel
        starts.append(start)
        ends.append(end)
        in_bucket += 1
        if distributed_optimizer and p.shared_embedding:
            bucket_start = start = _finish(buckets, bucket_start, end, divisor)
            in_bucket = 0
        else:
            start = end
    if in_bucket:
        _finish(buckets, bucket_start, end, divisor if distributed_optimizer else 1)
    prefix, acc = [], 0
    for s, e in zip(starts, ends):
        prefix.append(acc)
        acc += e - s
    return Buffer(expert, dp, fp32, acc, tuple(buckets), tuple(starts), tuple(ends), tuple(prefix))


def _finish(buckets: list[tuple[int, int]], bucket_start: int, param_end: int, divisor: int) -> int:
    end = _pad(param_end, divisor)
    buckets.append((bucket_start, end))
    return end


def rank_buffers(
    model: ModelConfig, shape: RankShape, pp_rank: int, distributed_optimizer: bool = True, fp32_norms: bool = False
) -> list[Buffer]:
    """Every DDP buffer of a rank of stage `pp_rank`, per model chunk in megatron's order (groups in the order of
    their first parameter). `fp32_norms`: the local spec without apex, whose torch norms hold fp32 weights."""
    out = []
    for chunk in range(shape.chunks):
        groups: dict[tuple[bool, bool], list[Param]] = {}
        for p in chunk_params(model, shape, pp_rank, chunk):
            # megagate's ZeroCenteredRMSNorm (zero-centred models, local spec) holds params_dtype weights
            fp32 = fp32_norms and p.is_norm and not model.norm_zero_centered
            groups.setdefault((fp32, p.expert), []).append(p)
        for (fp32, expert), params in groups.items():
            dp = shape.expert_dp if expert else shape.dp * shape.cp
            out.append(layout_buffer(params, dp, distributed_optimizer, expert=expert, fp32=fp32))
    return out
