"""The work of a training step, as an inventory: GEMM shapes, attention calls and memory-bound bytes per layer.

`Workload` is everything the step time depends on (model shape, layout, batch, precision, kernels, recompute, the
perf settings that move communication, the pipeline's layer split); `megagate.plan.core` builds one from a
TrainConfig, `megagate.plan.published` from a published run. `layer_work` lists what one transformer layer does for
one micro-batch on one rank; `embedding_work`, `output_work` and `optimizer_bytes` the rest. Timing them is
`megagate.plan.cost`'s job. Pure arithmetic.

Shapes, megatron's notation: T = micro-batch x sequence / CP tokens enter attention and the MLP on every TP rank
(after sequence parallelism's all-gather), T_sp = T / TP of them live on a rank in the sequence domain (norms,
residuals) under SP. A GEMM is (m, n, k): an [m, k] x [k, n] product. Memory-bound bytes count each tensor read or
written once per pass (assumption: the backward pass moves twice the forward's bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megagate.model.gate_params import gate_parameters
from megagate.model.model_config import ModelConfig


@dataclass(frozen=True)
class Workload:
    """One training step's shape (see the module docstring)."""

    model: ModelConfig
    seq: int
    micro_batch: int
    global_batch: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    cp: int = 1
    dp: int = 1
    etp: int | None = None  # expert tensor parallelism (None: TP, megagate's and megatron's default)
    precision: str = "bf16"  # fp32 | bf16 | fp8 (the linear layers' GEMMs; attention and the output layer stay bf16)
    attention: str = "flash"  # flash | sdpa | local
    fused_norms: bool = True  # False: torch's composite RMSNorm (CPU)
    sequence_parallel: bool = False
    recompute: str | None = None  # None | selective | full
    recompute_modules: tuple[str, ...] = ("core_attn",)
    grouped_gemm: bool = True  # experts in one grouped GEMM (else megatron's SequentialMLP loop)
    dispatcher: str = "alltoall"  # alltoall | allgather | flex
    tp_overlap: bool = False  # TE's userbuffers overlap of TP collectives with the GEMMs (tp_comm_overlap)
    ep_overlap: bool = False  # megatron's overlap_moe_expert_parallel_comm (EP traffic under another micro-batch)
    distributed_optimizer: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    bucket_size: int | None = None  # elements per DDP bucket (None: megatron's max(40M, 1M x DP))
    fsdp: bool = False  # parameters all-gathered per micro-batch (Megatron FSDP), gradients reduce-scattered
    grad_bytes: int = 4  # DDP's gradient element: 4 with grad_reduce_in_fp32 (megatron's default), else 2
    routing_imbalance: float = 1.0  # tokens of the busiest expert rank / the mean (1: balanced routing)
    stage_layers: tuple[tuple[int, ...], ...] | None = None  # [PP][VPP chunk] layers; None: the even split
    gpus_per_node: int = 8
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        return self.world // (self.expert_tp * self.ep * self.pp)

    @property
    def routed_tokens(self) -> float:
        """Token copies the busiest rank's experts compute per micro-batch: the sequence-domain tokens of its
        expert-TP group (the dispatcher gathers them over ETP), times top-k, times the routing imbalance."""
        return self.tokens_sp * self.expert_tp * self.model.moe_router_topk * self.routing_imbalance

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def tokens(self) -> int:
        """T: tokens of one micro-batch on a rank inside attention and the MLP."""
        return self.micro_batch * self.seq // self.cp

    @property
    def tokens_sp(self) -> int:
        """T_sp: tokens of one micro-batch a rank holds in the sequence domain."""
        return self.tokens // self.tp if self.sequence_parallel else self.tokens

    def layers(self) -> tuple[tuple[int, ...], ...]:
        """Layers per (stage, chunk): the configured split, else num_layers / (PP x VPP) each."""
        if self.stage_layers is not None:
            return self.stage_layers
        each = self.model.num_layers // (self.pp * self.chunks)
        return tuple(tuple(each for _ in range(self.chunks)) for _ in range(self.pp))


@dataclass(frozen=True)
class Gemm:
    """`calls` GEMMs of [m, k] x [k, n] in `precision` (forward; backward runs the dgrad and wgrad products)."""

    name: str
    m: float
    n: float
    k: float
    precision: str
    calls: int = 1


@dataclass(frozen=True)
class Grouped:
    """The experts of a rank: `experts` GEMMs of [m, k] x [k, n] each (m: tokens per expert)."""

    name: str
    experts: int
    m: float
    n: float
    k: float
    precision: str


@dataclass(frozen=True)
class Attention:
    b: int
    heads: int
    sq: int
    sk: int
    d: int
    causal: bool = True


@dataclass
class LayerWork:
    """What one layer (or the embedding / output) does for one micro-batch on one rank, forward."""

    gemms: list[Gemm] = field(default_factory=list)
    grouped: list[Grouped] = field(default_factory=list)
    attention: list[Attention] = field(default_factory=list)
    bytes: dict[str, float] = field(default_factory=dict)  # memory-bound, forward
    moe: bool = False
    gate: bool = False
    local_experts: int = 0

    def add_bytes(self, name: str, value: float) -> None:
        self.bytes[name] = self.bytes.get(name, 0.0) + value


def layer_work(w: Workload) -> LayerWork:
    """One transformer layer, one micro-batch, one rank (balanced attention; MoE routing at `routing_imbalance`)."""
    m, a, t = w.model, w.act_bytes, w.tp
    h, n, g, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim
    T, Tsp = w.tokens, w.tokens_sp
    p = w.precision
    out = LayerWork(moe=m.is_moe, gate=m.gate.enabled)
    norm = 2 * a + (
        3 * 4 if not w.fused_norms else 0
    )  # bytes per element: fused reads + writes; composite: fp32 copies
    gate_entries = gate_parameters(m.gate, h, n, g, d)
    gate_rows = sum(e.numel for e in gate_entries if e.in_linear_qkv) // h
    # --- attention block
    out.add_bytes("norms", norm * Tsp * h + 4 * Tsp)
    out.gemms.append(Gemm("linear_qkv", T, ((n + 2 * g) * d + gate_rows) / t, h, p))
    for e in gate_entries:
        if not e.in_linear_qkv and e.role == "projection":
            # G5's [h, k], a head-shared gate's [w, k] (replicated), a truncated-input gate's [heads·w, k] (per rank
            # its heads' rows); k = input_fraction·h
            rows, k = e.local_shape(t)
            out.gemms.append(Gemm("gate projection", Tsp if m.gate.position == "g5" else T, rows, k, p))
    if m.qk_layernorm:
        out.add_bytes("q/k norms", norm * T * (n + g) / t * d)
    out.add_bytes("rotary", 2 * a * T * (n + g) / t * d)
    out.attention.append(Attention(w.micro_batch, n // t, w.seq // w.cp, w.seq, d, causal=True))
    if m.gate.enabled:
        width = T * (h if m.gate.position == "g5" else (n if m.gate.on_query_heads else g) * d / t)
        scores = width if m.gate.granularity == "elementwise" else width / d
        out.add_bytes("gate (scores, activation, multiply)", 2 * 4 * scores + 3 * a * width)
    out.gemms.append(Gemm("linear_proj", T, h, n * d / t, p))
    out.add_bytes("residual adds", 2 * 3 * a * Tsp * h)
    out.add_bytes("norms", norm * Tsp * h + 4 * Tsp)
    if m.gate.sandwich_norm:
        out.add_bytes("norms", 2 * (norm * Tsp * h + 4 * Tsp))
    # --- MLP / MoE block
    if m.is_moe:
        e, f = m.num_experts, m.moe_ffn_hidden_size / w.expert_tp
        routed = w.routed_tokens
        local = e // w.ep
        per_expert = routed / local
        out.local_experts = local
        out.gemms.append(Gemm("router", Tsp, e, h, "fp32" if p != "fp32" else p))
        out.add_bytes("router softmax / top-k", 3 * 4 * Tsp * e)
        out.add_bytes("permute + unpermute", 2 * 2 * a * routed * h)
        out.add_bytes("SwiGLU", 3 * a * routed * f)
        if w.grouped_gemm:
            out.grouped.append(Grouped("experts fc1", local, per_expert, 2 * f, h, p))
            out.grouped.append(Grouped("experts fc2", local, per_expert, h, f, p))
        else:
            out.gemms.append(Gemm("expert fc1", per_expert, 2 * f, h, p, calls=local))
            out.gemms.append(Gemm("expert fc2", per_expert, h, f, p, calls=local))
    else:
        f = m.effective_ffn_hidden_size / t
        out.gemms.append(Gemm("linear_fc1", T, 2 * f, h, p))
        out.gemms.append(Gemm("linear_fc2", T, h, f, p))
        out.add_bytes("SwiGLU", 3 * a * T * f)
    if w.precision == "fp8":
        # every fp8 GEMM input is cast (read bf16 + amax, write fp8) forward; backward casts the output gradients
        cast = sum(x.m * x.k * x.calls for x in out.gemms if x.precision == "fp8")
        cast += sum(x.experts * x.m * x.k for x in out.grouped)
        out.add_bytes("fp8 casts", (2 * a + 1) * cast)
    return out


def expert_block(layer: LayerWork) -> LayerWork:
    """What of a MoE layer's work runs between the dispatch and the combine: permute, the experts, their activation
    (megatron's `mlp` node; the router and the rest are its pre-dispatch computation)."""
    kept = ("permute + unpermute", "SwiGLU")
    return LayerWork(
        gemms=[g for g in layer.gemms if g.name.startswith("expert")],
        grouped=list(layer.grouped),
        bytes={k: v for k, v in layer.bytes.items() if k in kept},
    )


def recompute_work(w: Workload, layer: LayerWork) -> LayerWork:
    """What recomputation adds to one layer's backward (a forward of what was dropped)."""
    if w.recompute == "full":
        return layer
    extra = LayerWork()
    if w.recompute != "selective":
        return extra
    modules = set(w.recompute_modules)
    if "core_attn" in modules:
        extra.attention = list(layer.attention)
    if "layernorm" in modules:
        extra.bytes["norms"] = layer.bytes.get("norms", 0.0)
    if "moe_act" in modules or "mlp" in modules:
        extra.bytes["SwiGLU"] = layer.bytes.get("SwiGLU", 0.0)
    if "moe" in modules or "mlp" in modules:
        extra.gemms = [x for x in layer.gemms if "expert" in x.name or "fc" in x.name]
        extra.grouped = list(layer.grouped)
    return extra


def embedding_work(w: Workload) -> LayerWork:
    """The first stage's embedding lookup (forward: gather; backward: scatter-add into the fp32 gradient)."""
    out = LayerWork()
    out.add_bytes("embedding", 2 * w.act_bytes * w.tokens_sp * w.model.hidden_size)
    return out


def output_work(w: Workload) -> LayerWork:
    """The last stage's final norm, output layer (megatron's own linear: bf16 even under fp8) and cross entropy."""
    m, a = w.model, w.act_bytes
    out = LayerWork()
    norm = 2 * a + (3 * 4 if not w.fused_norms else 0)
    out.add_bytes("final norm", norm * w.tokens_sp * m.hidden_size)
    vocab = m.vocab_size / w.tp
    out.gemms.append(Gemm("output layer", w.tokens, vocab, m.hidden_size, "fp32" if w.precision == "fp32" else "bf16"))
    out.add_bytes("cross entropy (fp32 softmax over the logits)", (a + 12) * w.tokens * vocab)
    return out


def stage_parameters(w: Workload, stage: int) -> tuple[float, float]:
    """(dense, expert) parameters one rank of pipeline stage `stage` holds (sharded over TP / EP; embedding on the
    first stage, output layer on the last; a tied embedding's copy on the last stage when PP > 1)."""
    m, t = w.model, w.tp
    h, n, g, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim
    gate = sum(e.numel for e in gate_parameters(m.gate, h, n, g, d))
    attention = (h * (n + 2 * g) * d + n * d * h + gate) / t + 2 * h + (2 * d if m.qk_layernorm else 0)
    if m.is_moe:
        dense_layer = attention + m.num_experts * h
        expert_layer = m.num_experts // w.ep * 3 * h * m.moe_ffn_hidden_size / w.expert_tp
    else:
        dense_layer, expert_layer = attention + 3 * h * m.effective_ffn_hidden_size / t, 0.0
    layers = sum(w.layers()[stage])
    dense = layers * dense_layer
    vocab = m.vocab_size * h / t
    if stage == 0:
        dense += vocab
    if stage == w.pp - 1 and (not m.tie_embeddings or w.pp > 1):
        dense += vocab + h
    return dense, layers * expert_layer


def optimizer_bytes(w: Workload, stage: int) -> float:
    """Memory-bound bytes of one optimizer step on a rank of `stage`: Adam over the owned (distributed-optimizer
    shard of the) fp32 main parameters (read p, g, m, v; write p, m, v: 28 B), the gradient norm and clipping over
    the owned gradients (12 B), the copy back into the model's parameters and zeroing the gradient buffer (the
    local elements: a + 4 B)."""
    dense, expert = stage_parameters(w, stage)
    if w.distributed_optimizer or w.fsdp:
        owned = dense / (w.dp * w.cp) + expert / w.expert_dp
    else:
        owned = dense + expert
    return 40 * owned + (w.act_bytes + 4) * (dense + expert)
