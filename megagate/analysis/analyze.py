"""`megagate analyze CHECKPOINT`: the per-layer diagnostics of a model on a text sample, as a table and PNG plots.

Plots (in --out): first_token_attention.png (F-Attn per layer, heads as dots), gate_scores.png (score histogram per
layer), max_activation.png (M-Act per layer), attention_map.png (one head of the layer with the largest F-Attn).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from megagate.analysis import plotting
from megagate.monitor import diagnostics as D

SAMPLE_TEXT = (
    "The gate is a small projection of the attention input followed by a sigmoid. It multiplies the output of "
    "scaled dot-product attention, head by head and channel by channel, before the output projection. Because the "
    "scores are sparse and depend on the query, a head can return almost nothing when the context holds nothing "
    "relevant, so it no longer needs to park its attention on the first token of the sequence."
)


# --- table -------------------------------------------------------------------------------------------------------
def format_table(diags: Sequence[D.LayerDiagnostics]) -> str:
    """Per-layer rows plus a model row (F-Attn and gate score averaged, M-Act and max logit the maximum)."""

    def f(x: float | None, spec: str) -> str:
        # -inf: no attention logit was seen (a hybrid's Gated DeltaNet layer has none)
        missing = x is None or (isinstance(x, float) and (math.isnan(x) or x == -math.inf))
        return "-" if missing else format(x, spec)

    # Gu et al.'s Sink^0.3_1: the share of (sample, head) pairs over 0.3 of first-token attention, at T tokens
    sink = f"Sink(T={diags[0].sink_length})" if diags else "Sink"
    header = ["layer", "gate_score", "sparsity(<0.1)", "F-Attn", sink, "M-Act", "max_logit"]
    rows = [
        [
            str(d.layer),
            f(d.gate_score_mean, ".3f"),
            f(d.gate_sparsity, ".3f"),
            f(d.f_attn, ".3f"),
            f(d.sink, ".3f"),
            f(d.m_act, ".4g"),
            f(d.max_logit, ".4g"),
        ]
        for d in diags
    ]
    s = D.to_scalars(list(diags))
    if diags:
        rows.append(
            [
                "all",
                f(s.get("diag/gate_score"), ".3f"),
                f(s.get("diag/gate_sparsity"), ".3f"),
                f(s["diag/f_attn"], ".3f"),
                f(s["diag/sink"], ".3f"),
                f(s["diag/m_act"], ".4g"),
                f(s["diag/max_logit"], ".4g"),
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if diags:
        lines.insert(len(lines) - 1, lines[1])
    return "\n".join(lines)


# --- plots -------------------------------------------------------------------------------------------------------
def write_plots(diags: Sequence[D.LayerDiagnostics], out_dir: str | Path) -> list[Path]:
    plt = plotting.pyplot()
    out = Path(out_dir)
    layers = [d.layer for d in diags]
    written = []

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(layers, [d.f_attn for d in diags], color="tab:blue", alpha=0.7, label="mean over heads")
    heads = [(d.layer, f) for d in diags for f in d.f_attn_per_head]
    if heads:  # one scatter, one legend entry for every head's dot
        ax.scatter(*zip(*heads), s=10, color="k", zorder=3, label="one head")
    ax.set(xlabel="layer", ylabel="attention on token 0", ylim=(0, 1), title="first-token attention (F-Attn)")
    plotting.integer_ticks(ax)
    ax.legend(fontsize=8)
    written.append(plotting.save(fig, out / "first_token_attention.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    gated = [d for d in diags if d.gate_hist_counts]
    for d in gated:
        edges, counts = d.gate_hist_edges, d.gate_hist_counts
        total = sum(counts) or 1.0
        centres = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
        ax.plot(
            centres, [c / total for c in counts], marker=".", label=f"layer {d.layer} (mean {d.gate_score_mean:.3f})"
        )
    if not gated:
        ax.text(
            0.5,
            0.5,
            "no bounded gate scores (baseline or unbounded activation)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    ax.axvline(D.SPARSE_BELOW, color="gray", ls="--", lw=1)
    ax.set(xlabel="gate score", ylabel="fraction of scores", xlim=(0, 1), title="gate score histogram")
    if gated:
        ax.legend(fontsize=7)
    written.append(plotting.save(fig, out / "gate_scores.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(layers, [d.m_act for d in diags], marker="o")
    ax.set(xlabel="layer", ylabel="max |hidden state|", title="massive activation (M-Act) per layer")
    plotting.integer_ticks(ax)
    plotting.value_scale(ax, [d.m_act for d in diags])  # log only where the layers span decades
    written.append(plotting.save(fig, out / "max_activation.png"))

    mapped = [d for d in diags if d.attn_map is not None]
    if mapped:
        d = max(mapped, key=lambda x: x.f_attn)
        fig, ax = plt.subplots(figsize=(5, 4.5))
        image = ax.imshow(d.attn_map.numpy(), cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        fig.colorbar(image, ax=ax, fraction=0.046)
        ax.set(xlabel="key position", ylabel="query position", title=f"attention, layer {d.layer}, head 0")
        written.append(plotting.save(fig, out / "attention_map.png"))
    return written


def analyze_model(model: torch.nn.Module, tokens: torch.Tensor, out_dir: str | Path | None = None) -> str:
    """Diagnostics of `model` on `tokens` [b, s]: returns the table; writes the plots when `out_dir` is given."""
    diags = D.collect(model, tokens, keep_attn_map=True)
    if out_dir is not None:
        write_plots(diags, out_dir)
    return format_table(diags)


# --- command line ------------------------------------------------------------------------------------------------
