"""The paper's Table-4 diagnostics, per layer, on a probe batch: gate scores, F-Attn, M-Act, max attention logit.

* gate score mean / sparsity (fraction < 0.1) / histogram — from `GatedSelfAttention.score_observer`, which receives
  the fp32 gate scores [sq, b, heads, w] of each forward (broadcast dims are 1 for head-shared or input-independent
  gates; the mean and fractions of a broadcast tensor equal those of its expansion, so no expansion is needed).
* F-Attn — the attention probability on key position 0, averaged over heads, batch and query positions >= 1
  (query 0 can only attend to itself). With a softmax sink (core attention's `softmax_offset`: off-by-one,
  learnable) the sink's exp(logit) is in every denominator, as in the model.
* Sink^eps_1 (Gu et al., "When Attention Sink Emerges in Language Models", ICLR 2025) — the share of (sample,
  head) pairs whose mean attention on the first token, over all T query positions including the first, exceeds
  eps = 0.3, at T = 64 (their probe length; the reference code sail-sg/Attention-Sink averages the indicator over
  samples, layers and heads). Causal attention makes the first T queries of a longer probe see exactly a T-token
  probe, so it is read from the same forward: probs[:, :, :T, 0]. A probe shorter than 64 gives T = its length
  (`sink_length` says which).
* max attention logit — the largest scaled pre-softmax logit q·k·scale over causally visible pairs.
  Both are recomputed in fp32 from the query [sq, b, np, hn] and key [sk, b, ng, hn] that `core_attention` receives
  (after QK-norm and RoPE), captured with a forward pre-hook: backend independent, since flash attention never
  materialises probabilities.
* M-Act — max |hidden state| at each layer's output (the TransformerLayer returns (hidden_states, context)).

Zero cost when off: hooks and observers exist only inside `Probe` (removed in `finally`).

Parallelism: each pipeline stage sees its own layers (`layer` is the global index, so stages' tags never clash).
Under tensor parallelism every statistic is kept as sums / counts / maxima and reduced over the TP group (heads and,
with sequence parallelism, sequence chunks are split across TP ranks), so every TP rank returns the full-layer values.
Packed sequences (THD) and sliding-window attention are not handled: the probe assumes causal [s, b] batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from megagate.errors import MegagateError
from megagate.monitor.attention_math import (  # re-exported: the diagnostics' math, in its own module
    SINK_EPSILON,
    SINK_LENGTH,
    attention_logits,
    attention_stats,
    check_sink_settings,
    log_z,
    softmax_scale,
)
from megagate.monitor.tensorboard import Histogram

SPARSE_BELOW = 0.1  # the paper's sparsity threshold on gate scores
HIST_BINS = 20
_BOUNDED = ("sigmoid", "ns_sigmoid")  # activations with scores in [0, 1]: fixed histogram bins


@dataclass
class LayerDiagnostics:
    """One layer's diagnostics (layer = global 0-based index). Gate fields are None for ungated layers."""

    layer: int
    f_attn: float
    m_act: float
    max_logit: float
    sink: float = math.nan  # Sink^eps_1 of this layer: share of (sample, head) pairs above eps
    sink_length: int = 0  # the T it was measured at
    gate_score_mean: float | None = None
    gate_sparsity: float | None = None
    gate_min: float | None = None
    gate_max: float | None = None
    gate_hist_edges: list[float] | None = None  # HIST_BINS + 1 edges
    gate_hist_counts: list[float] | None = None  # counts of (distinct, unexpanded) scores per bin
    f_attn_per_head: list[float] = field(default_factory=list)
    attn_map: Tensor | None = None  # [sq, sk] probabilities of (batch 0, head 0) when asked for

    def record(self, step: int) -> dict[str, Any]:
        """The runfiles.DIAGNOSTICS line for this layer."""
        return {
            "step": step,
            "layer": self.layer,
            "gate_score_mean": self.gate_score_mean,
            "gate_sparsity": self.gate_sparsity,
            "f_attn": self.f_attn,
            "m_act": self.m_act,
            "max_logit": self.max_logit,
            "sink": self.sink,
            "sink_length": self.sink_length,
        }


# --- capture -----------------------------------------------------------------------------------------------------
class _LayerState:
    """Running sums for one layer over the forwards of one probe (several micro-batches add up)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.f_sum: Tensor | None = None
        self.f_count: Tensor | None = None
        self.max_logit = -math.inf
        self.sink_hits = self.sink_pairs = 0.0
        self.sink_length = 0
        self.m_act = 0.0
        self.g_sum = self.g_count = self.g_sparse = 0.0
        self.g_min, self.g_max = math.inf, -math.inf
        self.g_hist: Tensor | None = None
        self.g_bounded = True
        self.g_seen = False
        self.attn_map: Tensor | None = None


class Probe:
    """Context manager that instruments a megatron language model's layers; run any forward(s) inside it, then call `results()`.

    Use this directly when the forward must go through megatron's pipeline schedule (PP > 1); `collect` covers the
    single-stage case.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        keep_attn_map: bool = False,
        tp_group: Any = None,
        sink_epsilon: float = SINK_EPSILON,
        sink_length: int = SINK_LENGTH,
    ) -> None:
        check_sink_settings(sink_epsilon, sink_length)
        self.sink_epsilon, self.sink_length = sink_epsilon, sink_length
        self.model = model
        self.keep_attn_map = keep_attn_map
        self.tp_group = tp_group
        self._handles: list[Any] = []
        self._observed: list[Any] = []
        self._states: dict[int, _LayerState] = {}
        self._log_z = [0.0, 0, -math.inf]  # sum, tokens, max of the output layer's log Z

    def __enter__(self) -> Probe:
        try:
            for layer in _decoder_layers(self.model):
                index = int(getattr(layer, "layer_number", len(self._states) + 1)) - 1
                state = self._states[index] = _LayerState(index)
                self._handles.append(layer.register_forward_hook(self._layer_hook(state)))
                attn = getattr(layer, "self_attention", None)
                core = getattr(attn, "core_attention", None)
                if core is not None:
                    self._handles.append(core.register_forward_pre_hook(self._core_hook(state, core), with_kwargs=True))
                if attn is not None and hasattr(attn, "score_observer"):
                    attn.score_observer = self._score_observer(state, getattr(attn, "gate", None))
                    self._observed.append(attn)
            output_layer = getattr(_inner(self.model), "output_layer", None)  # the last pipeline stage's
            if output_layer is not None:
                self._handles.append(output_layer.register_forward_hook(self._output_hook))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for attn in self._observed:
            attn.score_observer = None
        self._handles, self._observed = [], []

    # hooks
    def _layer_hook(self, state: _LayerState) -> Callable:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, (tuple, list)) else output  # [s, b, h]
            state.m_act = max(state.m_act, float(hidden.detach().abs().max()))

        return hook

    def _output_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        logits = output[0] if isinstance(output, (tuple, list)) else output  # [s, b, V / TP]
        values = log_z(logits.detach(), _tp_group(self.tp_group))
        self._log_z[0] += float(values.sum())
        self._log_z[1] += values.numel()
        self._log_z[2] = max(self._log_z[2], float(values.max()))

    def output_stats(self) -> dict[str, float]:
        """The output logits' log Z = log sum_v exp(logit_v) per token: mean and max over the probe's tokens (the
        z-loss's quantity; {} on a stage without the output layer)."""
        total, count, top = self._log_z
        return {"log_z_mean": total / count, "log_z_max": top} if count else {}

    def _core_hook(self, state: _LayerState, core: torch.nn.Module) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            query = args[0] if args else kwargs["query"]
            key = args[1] if len(args) > 1 else kwargs["key"]
            mask = args[3] if len(args) > 3 else kwargs.get("attention_mask")
            scale = softmax_scale(core, query.shape[-1])
            logits = attention_logits(query.detach(), key.detach(), scale, mask)
            # a softmax sink (off-by-one, learnable) takes its share of every row: the probabilities the model uses
            sink_logit = getattr(core, "softmax_offset", None)
            stats = attention_stats(logits, self.sink_epsilon, self.sink_length, sink_logit)
            state.sink_hits += float(stats["sink_hits"])
            state.sink_pairs += float(stats["sink_pairs"])
            state.sink_length = int(stats["sink_length"])
            state.f_sum = stats["f_sum_per_head"] if state.f_sum is None else state.f_sum + stats["f_sum_per_head"]
            state.f_count = (
                stats["f_count_per_head"] if state.f_count is None else state.f_count + stats["f_count_per_head"]
            )
            state.max_logit = max(state.max_logit, float(stats["max_logit"]))
            if self.keep_attn_map and state.attn_map is None:
                state.attn_map = stats["probs"][0, 0].cpu()

        return hook

    def _score_observer(self, state: _LayerState, gate: Any) -> Callable:
        bounded = getattr(gate, "activation", "sigmoid") in _BOUNDED

        def observe(module: torch.nn.Module, scores: Tensor) -> None:
            s = scores.detach().float().reshape(-1)
            state.g_seen = True
            state.g_bounded = bounded
            state.g_sum += float(s.sum())
            state.g_count += s.numel()
            state.g_sparse += float((s < SPARSE_BELOW).sum())
            state.g_min = min(state.g_min, float(s.min()))
            state.g_max = max(state.g_max, float(s.max()))
            if bounded:  # fixed bins: histograms of different steps / runs share one axis
                hist = torch.histc(s, bins=HIST_BINS, min=0.0, max=1.0)
                state.g_hist = hist if state.g_hist is None else state.g_hist + hist

        return observe

    # results
    def results(self) -> list[LayerDiagnostics]:
        """Per-layer diagnostics of everything run inside the probe (TP-reduced when a TP group is set/initialised)."""
        states = [self._states[i] for i in sorted(self._states)]
        _reduce_tp(states, self.tp_group)
        out = []
        for st in states:
            f_heads = (st.f_sum / st.f_count.clamp_min(1)).tolist() if st.f_sum is not None else []
            d = LayerDiagnostics(
                layer=st.layer,
                f_attn=float(st.f_sum.sum() / st.f_count.sum().clamp_min(1)) if st.f_sum is not None else math.nan,
                m_act=st.m_act,
                max_logit=st.max_logit,
                sink=st.sink_hits / st.sink_pairs if st.sink_pairs else math.nan,
                sink_length=st.sink_length,
                f_attn_per_head=f_heads,
                attn_map=st.attn_map,
            )
            if st.g_seen and st.g_count:
                d.gate_score_mean = st.g_sum / st.g_count
                d.gate_sparsity = st.g_sparse / st.g_count
                d.gate_min, d.gate_max = st.g_min, st.g_max
                if st.g_hist is not None:
                    d.gate_hist_edges = torch.linspace(0, 1, HIST_BINS + 1).tolist()
                    d.gate_hist_counts = st.g_hist.tolist()
            out.append(d)
        return out


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and not hasattr(model, "decoder"):  # DDP / Float16Module wrappers
        model = model.module
    return model


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    decoder = getattr(_inner(model), "decoder", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise MegagateError(
            f"diagnostics need a megatron HybridModel or GPTModel with decoder.layers; got {type(model).__name__}"
        )
    return list(decoder.layers)


def _tp_group(explicit: Any) -> Any:
    if explicit is not None:
        return explicit
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return None
        group = parallel_state.get_tensor_model_parallel_group()
    except Exception:  # megatron not initialised in this process: single-rank semantics
        return None
    return group if dist.get_world_size(group) > 1 else None


def _reduce_tp(states: list[_LayerState], tp_group: Any) -> None:
    """Sum the per-head sums/counts and gate sums, max the maxima, over the TP group (every rank gets the totals)."""
    group = _tp_group(tp_group)
    if group is None or not states:
        return
    import torch.distributed as dist

    # Heads are split over TP: per-head vectors are gathered (each rank holds a different slice).
    for st in states:
        if st.f_sum is not None:
            parts = [torch.empty_like(st.f_sum) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, st.f_sum.contiguous(), group=group)
            counts = [torch.empty_like(st.f_count) for _ in parts]
            dist.all_gather(counts, st.f_count.contiguous(), group=group)
            st.f_sum, st.f_count = torch.cat(parts), torch.cat(counts)
    sums = torch.tensor(
        [[st.g_sum, st.g_count, st.g_sparse, st.sink_hits, st.sink_pairs] for st in states], dtype=torch.float64
    )
    dist.all_reduce(sums, group=group)  # heads are split over TP: the sink's hits and pairs add up
    maxima = torch.tensor([[st.max_logit, st.m_act, st.g_max, -st.g_min] for st in states], dtype=torch.float64)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    for i, st in enumerate(states):
        st.g_sum, st.g_count, st.g_sparse, st.sink_hits, st.sink_pairs = sums[i].tolist()
        st.max_logit, st.m_act, st.g_max, neg_min = maxima[i].tolist()
        st.g_min = -neg_min
        if st.g_hist is not None:
            dist.all_reduce(st.g_hist, group=group)


# --- entry points ------------------------------------------------------------------------------------------------
def collect(
    model: torch.nn.Module,
    tokens: Tensor,
    position_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    keep_attn_map: bool = False,
    sink_epsilon: float = SINK_EPSILON,
    sink_length: int = SINK_LENGTH,
) -> list[LayerDiagnostics]:
    """Run one no-grad eval forward of `tokens` [b, s] through `model` (one pipeline stage holding the embedding)
    and return this rank's layers' diagnostics; the model's train/eval mode is restored afterwards."""
    return collect_with_output(model, tokens, position_ids, attention_mask, keep_attn_map, sink_epsilon, sink_length)[0]


def collect_with_output(
    model: torch.nn.Module,
    tokens: Tensor,
    position_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    keep_attn_map: bool = False,
    sink_epsilon: float = SINK_EPSILON,
    sink_length: int = SINK_LENGTH,
) -> tuple[list[LayerDiagnostics], dict[str, float]]:
    """`collect`, and the output layer's log-Z statistics (`Probe.output_stats`)."""
    if position_ids is None:
        position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    was_training = model.training
    model.eval()
    try:
        probe = Probe(model, keep_attn_map=keep_attn_map, sink_epsilon=sink_epsilon, sink_length=sink_length)
        with torch.no_grad(), probe:
            model(tokens, position_ids, attention_mask)
        return probe.results(), probe.output_stats()
    finally:
        model.train(was_training)


def _mean(values: list[float]) -> float:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def to_scalars(diags: list[LayerDiagnostics], prefix: str = "diag") -> dict[str, float]:
    """TensorBoard tags -> values: per layer (`diag/layer_03/f_attn`, ...) and model-level summaries.

    Model level: f_attn and gate_score are averages over layers (the paper's F-Attn / gate score columns);
    m_act and max_logit are maxima over layers (the paper's M-Act is the largest activation); sink is the mean of
    the layers' Sink^0.3_1 (= Gu et al.'s mean over layers, heads and samples: the layers have equal counts).
    """
    out: dict[str, float] = {}
    for d in diags:
        tag = f"{prefix}/layer_{d.layer:02d}"
        out[f"{tag}/f_attn"] = d.f_attn
        out[f"{tag}/m_act"] = d.m_act
        out[f"{tag}/max_logit"] = d.max_logit
        out[f"{tag}/sink"] = d.sink
        if d.gate_score_mean is not None:
            out[f"{tag}/gate_score"] = d.gate_score_mean
            out[f"{tag}/gate_sparsity"] = d.gate_sparsity
    if diags:
        out[f"{prefix}/f_attn"] = _mean([d.f_attn for d in diags])
        out[f"{prefix}/m_act"] = max(d.m_act for d in diags)
        out[f"{prefix}/max_logit"] = max(d.max_logit for d in diags)
        out[f"{prefix}/sink"] = _mean([d.sink for d in diags])  # every layer has the same heads and samples
        gated = [d for d in diags if d.gate_score_mean is not None]
        if gated:
            out[f"{prefix}/gate_score"] = _mean([d.gate_score_mean for d in gated])
            out[f"{prefix}/gate_sparsity"] = _mean([d.gate_sparsity for d in gated])
    return out


def to_metrics(diags: list[LayerDiagnostics], prefix: str = "diag") -> dict[str, float | Histogram]:
    """Scalars of `to_scalars` plus one gate-score histogram per gated layer (fixed [0, 1] bins when bounded)."""
    out: dict[str, float | Histogram] = dict(to_scalars(diags, prefix))
    for d in diags:
        if d.gate_hist_counts is None:
            continue
        counts = d.gate_hist_counts
        edges = d.gate_hist_edges
        total = sum(counts)
        if total <= 0:
            continue
        # sum/sum_squares from the bin centres
        centres = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
        out[f"{prefix}/layer_{d.layer:02d}/gate_scores"] = Histogram(
            min=d.gate_min,
            max=d.gate_max,
            num=total,
            sum=sum(c * x for c, x in zip(counts, centres)),
            sum_squares=sum(c * x * x for c, x in zip(counts, centres)),
            bucket_limits=list(edges[1:]),
            bucket_counts=list(counts),
        )
    return out


def records(step: int, diags: list[LayerDiagnostics]) -> list[dict[str, Any]]:
    """runfiles.DIAGNOSTICS lines for one probe."""
    return [d.record(step) for d in diags]
