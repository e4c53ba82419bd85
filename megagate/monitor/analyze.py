"""`megagate analyze CHECKPOINT`: the per-layer diagnostics of a model on a text sample, as a table and PNG plots.

Plots (in --out): first_token_attention.png (F-Attn per layer, heads as dots), gate_scores.png (score histogram per
layer), max_activation.png (M-Act per layer), attention_map.png (one head of the layer with the largest F-Attn).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from megagate.errors import MegagateError
from megagate.monitor import diagnostics as D
from megagate.monitor import plotting

SAMPLE_TEXT = (
    "The gate is a small projection of the attention input followed by a sigmoid. It multiplies the output of "
    "scaled dot-product attention, head by head and channel by channel, before the output projection. Because the "
    "scores are sparse and depend on the query, a head can return almost nothing when the context holds nothing "
    "relevant, so it no longer needs to park its attention on the first token of the sequence."
)


# --- table -------------------------------------------------------------------------------------------------------
def format_table(diags: Sequence[D.LayerDiagnostics]) -> str:
    """Per-layer rows plus a model row (F-Attn and gate score averaged, M-Act and max logit the maximum)."""

    def f(x: Optional[float], spec: str) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    header = ["layer", "gate_score", "sparsity(<0.1)", "F-Attn", "M-Act", "max_logit"]
    rows = [[str(d.layer), f(d.gate_score_mean, ".3f"), f(d.gate_sparsity, ".3f"), f(d.f_attn, ".3f"),
             f(d.m_act, ".4g"), f(d.max_logit, ".4g")] for d in diags]  # fmt: skip
    s = D.to_scalars(list(diags))
    if diags:
        rows.append(["all", f(s.get("diag/gate_score"), ".3f"), f(s.get("diag/gate_sparsity"), ".3f"),
                     f(s["diag/f_attn"], ".3f"), f(s["diag/m_act"], ".4g"), f(s["diag/max_logit"], ".4g")])  # fmt: skip
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
    for d in diags:
        ax.scatter([d.layer] * len(d.f_attn_per_head), d.f_attn_per_head, s=10, color="k", zorder=3)
    ax.set(xlabel="layer", ylabel="attention on token 0", ylim=(0, 1), title="first-token attention (F-Attn)")
    ax.legend(fontsize=8)
    written.append(plotting.save(fig, out / "first_token_attention.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    gated = [d for d in diags if d.gate_hist_counts]
    for d in gated:
        edges, counts = d.gate_hist_edges, d.gate_hist_counts
        total = sum(counts) or 1.0
        centres = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
        ax.plot(centres, [c / total for c in counts], marker=".", label=f"layer {d.layer} (mean {d.gate_score_mean:.3f})")
    if not gated:
        ax.text(0.5, 0.5, "no bounded gate scores (baseline or unbounded activation)", ha="center", va="center",
                transform=ax.transAxes)  # fmt: skip
    ax.axvline(D.SPARSE_BELOW, color="gray", ls="--", lw=1)
    ax.set(xlabel="gate score", ylabel="fraction of scores", xlim=(0, 1), title="gate score histogram")
    if gated:
        ax.legend(fontsize=7)
    written.append(plotting.save(fig, out / "gate_scores.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(layers, [d.m_act for d in diags], marker="o")
    ax.set(xlabel="layer", ylabel="max |hidden state|", title="massive activation (M-Act) per layer")
    ax.set_yscale("log")
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
_WORLD: list = []  # the single-process megatron world opened for analysis (kept until the process exits)


def _ensure_single_process_world() -> None:
    """A one-process megatron world with TP = PP = 1: the caller's if one is active, else one opened here."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if tp != 1 or pp != 1:
            raise MegagateError(f"analysis builds the whole model in one process; the active parallel state has "
                                f"TP={tp}, PP={pp}")  # fmt: skip
        return
    import atexit
    import contextlib

    from megagate import parallel

    stack = contextlib.ExitStack()
    stack.enter_context(parallel.single_process())
    _WORLD.append(stack)
    atexit.register(stack.close)


def _run_tokenizer(data: object) -> Optional[str]:
    """The tokenizer file of a run's data section (the demo tokenizer for `data.demo` runs without a blend)."""
    if data.demo and not data.blend:
        from megagate.data.demo import prepare_demo_data

        tokenizer, _ = prepare_demo_data(data.demo_dir, data.demo_vocab_size, data.demo_max_bytes)
        return tokenizer
    return data.tokenizer


def load_model_for_analysis(checkpoint_dir: str | Path) -> tuple[torch.nn.Module, Callable[[str], list[int]]]:
    """(model in eval mode, text -> token ids) from a trainer checkpoint (iter_NNNNNNN folder).

    The run's config (saved in the checkpoint's megagate.json) rebuilds the model as one TP = PP = 1 module in
    this process; megatron's dist_checkpointing reshards the saved model tensors into it (any training layout),
    and the optimizer state is not read.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from megagate import megatron_cpu, models
    from megagate.data.tokenizer import load_tokenizer
    from megagate.train import checkpoint as ckpt
    from megagate.train import config as config_mod
    from megagate.train.loop import precision_kwargs, resolve_backend

    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise MegagateError(f"checkpoint {str(path)!r} is not a directory")
    if ckpt.latest(path) is not None:  # a run's checkpoint root (or run dir's checkpoints/): its newest one
        path = ckpt.latest(path)
    elif (path / "checkpoints").is_dir() and ckpt.latest(path / "checkpoints") is not None:
        path = ckpt.latest(path / "checkpoints")
    meta = ckpt.read_meta(path)
    if not isinstance(meta.get("config"), dict):
        raise MegagateError(f"checkpoint {str(path)!r}: {ckpt.META} has no run config")
    cfg = config_mod.from_dict(meta["config"])
    tokenizer_path = _run_tokenizer(cfg.data)
    if tokenizer_path is None:
        raise MegagateError(f"checkpoint {str(path)!r}: the run has no tokenizer (mock data?) to encode text with")
    tokenizer = load_tokenizer(tokenizer_path)

    megatron_cpu.install()
    _ensure_single_process_world()
    dtype, _ = precision_kwargs(cfg)  # fp8 recipes are a training setting: analysis runs in the storage dtype
    backend = resolve_backend(cfg)
    tconfig = models.transformer_config(cfg.model, models.ParallelConfig(), params_dtype=dtype,
                                        perform_initialization=False)  # fmt: skip
    model = models.build_gpt_model(cfg.model, tconfig, backend=backend)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    try:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(path),
                                         strict=StrictHandling.RAISE_UNEXPECTED)  # fmt: skip
    except Exception as exc:  # megatron raises CheckpointingException and others for a mismatched checkpoint
        raise MegagateError(f"cannot load the model from {str(path)!r} (backend {backend}): {exc}") from None
    model.load_state_dict(loaded["model"])
    model.eval()

    def encode(text: str) -> list[int]:
        return [int(i) for i in tokenizer.encode(text)]

    return model, encode


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a training checkpoint directory")
    parser.add_argument("--text", default=None, help="a UTF-8 text file to probe with (default: a built-in paragraph)")
    parser.add_argument("--out", default="analysis", help="folder for the PNG plots and table.txt (default: analysis)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: 256)")
    parser.add_argument("--batch", type=int, default=4, help="sequences (consecutive windows of the text; default 4)")


def text_batch(ids: Sequence[int], seq_len: int, batch: int) -> torch.Tensor:
    """Up to `batch` consecutive windows of `seq_len` tokens; a short text gives one shorter sequence."""
    if len(ids) < 2:
        raise MegagateError(f"the text has {len(ids)} token(s); at least 2 are needed")
    if len(ids) < seq_len:
        return torch.tensor([list(ids)], dtype=torch.long)
    n = max(1, min(batch, len(ids) // seq_len))
    return torch.tensor([list(ids[i * seq_len : (i + 1) * seq_len]) for i in range(n)], dtype=torch.long)


def run(args: argparse.Namespace) -> int:
    if args.seq_len < 2 or args.batch < 1:
        raise MegagateError(f"--seq-len {args.seq_len} must be >= 2 and --batch {args.batch} >= 1")
    if args.text is not None and not Path(args.text).is_file():
        raise MegagateError(f"--text {args.text}: no such file")
    text = Path(args.text).read_text(encoding="utf-8") if args.text else SAMPLE_TEXT
    model, encode = load_model_for_analysis(args.checkpoint)
    tokens = text_batch(encode(text), args.seq_len, args.batch)
    device = next(model.parameters()).device
    table = analyze_model(model, tokens.to(device), args.out)
    from megagate.monitor import runfiles

    runfiles.write_atomic(Path(args.out) / "table.txt", table + "\n")
    print(table)
    print(f"plots written to {args.out}")
    return 0
