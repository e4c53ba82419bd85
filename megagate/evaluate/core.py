"""Checkpoints -> perplexity per dataset, length and position bucket, plus F-Attn / M-Act, under any TP x PP x DP.

Every rank runs the same code: this rank's model chunks are built for the evaluation layout (not the training one:
megatron's dist_checkpointing reshards), the samples are split over data-parallel ranks as in training, the forward
goes through megatron's forward-only pipeline schedule, and per-position sums of the token losses are reduced over
data-parallel ranks and along the pipeline, so every rank ends with the same numbers. Perplexity is exp of the
token-mean loss over every evaluated token (with the trainer's all-ones loss mask, the trainer's mean of
micro-batch means is the same number).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from megagate.errors import MegagateError
from megagate.evaluate.options import DataSpec, check_lengths, with_overrides
from megagate.model.model_config import POSITION_FIELDS, ModelConfig, ParallelConfig


@dataclass
class Prepared:
    """A checkpoint checked and ready to load: its folder, metadata, run config and the model to build."""

    path: Path
    name: str
    meta: dict
    cfg: Any  # megagate.run_config.TrainConfig of the run
    model: ModelConfig  # the run's model with the --rope overrides
    tokenizer: str | None


@dataclass
class Options:
    """The evaluation settings shared by every checkpoint."""

    lengths: list[int]
    samples: int = 32
    micro_batch_size: int = 1
    buckets: int = 8
    diagnostics_max_length: int = 4096
    seed: int = 1234
    cache_dir: str = "eval/data_cache"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


# --- before anything is built ------------------------------------------------------------------------------------
def prepare(given: str, rope: dict[str, Any], lengths: list[int], name: str | None = None) -> Prepared:
    """Read a checkpoint's metadata and config (no tensors), apply --rope and check the lengths against it."""
    from megagate.data.demo import run_tokenizer
    from megagate.model_factory import read_checkpoint

    path, meta, cfg = read_checkpoint(given)
    where = f"checkpoint {str(path)!r}"
    model = with_overrides(cfg.model, rope, where)
    check_lengths(model, lengths, where)
    tokenizer = None if cfg.data.mock else run_tokenizer(cfg.data)
    run = path.parent.parent.name if path.parent.name == "checkpoints" else path.parent.name
    return Prepared(path, name or f"{run}@{int(meta.get('step', 0))}", meta, cfg, model, tokenizer)


def check_layout(prepared: list[Prepared], parallel: ParallelConfig, world_size: int) -> int:
    """The data-parallel size of the evaluation layout; refuses a layout a checkpoint's model cannot be split by."""
    from megagate.model.qkv_layout import check_tensor_parallel

    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise MegagateError(f"--tp {tp} x --pp {pp} does not divide the {world_size} processes")
    for p in prepared:
        m = p.model
        if m.num_layers % pp:
            raise MegagateError(f"checkpoint {str(p.path)!r}: {m.num_layers} layers do not split into --pp {pp} stages")
        try:
            check_tensor_parallel(m.num_attention_heads, m.num_query_groups, tp, model="model.", parallel="--tp ")
        except MegagateError as exc:
            raise MegagateError(f"checkpoint {str(p.path)!r}: {exc}") from None
    return world_size // (tp * pp)


# --- data ----------------------------------------------------------------------------------------------------------
def dataset(spec: DataSpec, p: Prepared, length: int, opts: Options) -> Any:
    """The megatron dataset of `spec` at `length` (the valid split of every document of a prefix, or the run's own
    validation split rebuilt as the trainer built it: same blend, split, seed, and sample count at its length)."""
    from megagate.data.loader import build_datasets

    if p.tokenizer is None:
        raise MegagateError(f"checkpoint {str(p.path)!r}: the run used mock data (no tokenizer): give --data PREFIX")
    if spec.prefix is not None:
        blend, split, seed, valid_samples = [spec.prefix], "0,1,0", opts.seed, None
    else:
        d = p.cfg.data
        blend = d.blend
        if d.demo and not blend:
            from megagate.data.demo import prepare_demo_data

            _, prefix = prepare_demo_data(d.demo_dir, d.demo_vocab_size, d.demo_max_bytes)
            blend = [prefix]
        built = (p.meta.get("data_samples") or {}).get("valid")
        # megatron orders a split by epochs of the sample count it is built for: the trainer's count reproduces its
        # validation samples at its length; other lengths read one epoch
        valid_samples = int(built) if built and length == p.cfg.train.seq_length else None
        split, seed = d.split, p.cfg.seed
    _, valid, _ = build_datasets(
        blend,
        tokenizer=p.tokenizer,
        seq_length=length,
        num_samples=(None, valid_samples, None),
        split=split,
        seed=seed,
        cache_dir=opts.cache_dir,
    )
    if valid is None or len(valid) == 0:
        raise MegagateError(f"--data {spec.name}: no sample of {length} tokens in its evaluation split")
    return valid


def prebuild(prepared: list[Prepared], specs: list[DataSpec], opts: Options) -> None:
    """Build every dataset's index cache in this process, before the process group exists (global rank 0 only).

    Later every rank reads complete cache files: megatron's builder builds on rank 0 first, but between its
    per-split barriers rank 0 would still be writing the next split's .npy files while the other ranks check the
    shared cache folder. It also refuses a dataset without a sample at some length before any model is loaded.
    """
    for p in prepared:
        for spec in specs:
            for length in opts.lengths:
                dataset(spec, p, length, opts)


def _batches(ds: Any, count: int, mbs: int, dp: int, dp_rank: int) -> list[dict]:
    """This DP rank's micro-batches of the first `count` samples: each global batch is dp x mbs consecutive samples
    and rank r takes the r-th slice (the trainer's sampler)."""
    from megagate.data.sampler import collate

    out = []
    for start in range(0, count, mbs * dp):
        first = start + dp_rank * mbs
        out.append(collate([ds[i] for i in range(first, first + mbs)]))
    return out


# --- the model -----------------------------------------------------------------------------------------------------
def load_chunks(p: Prepared, opts: Options) -> list:
    """This rank's model chunk(s) of `p` (its --rope overrides, the evaluation layout) in eval mode, its tensors
    loaded (resharded) from the checkpoint by the model factory after the safety check and the verification."""
    from megagate.model_factory import load_verified

    return load_verified(p.path, dataclasses.replace(p.cfg, model=p.model, parallel=opts.parallel))


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
    losses = output.float()  # [b, s] token losses (vocab-parallel cross entropy: full values on every TP rank)
    mask = loss_mask.to(losses.device).float()
    nll = (losses * mask).double().sum(dim=0)
    count = mask.double().sum(dim=0)
    loss = nll.sum() / count.sum().clamp(min=1)
    return loss.float(), {"nll": nll.detach().cpu(), "count": count.cpu()}


def _forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {k: v.to(device) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _sum_to_all(value: torch.Tensor) -> torch.Tensor:
    """Sum over DP ranks on the last stage, then along the pipeline (other stages add zeros): every rank has it."""
    from megatron.core import parallel_state

    if torch.cuda.is_available():
        value = value.cuda()
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        torch.distributed.all_reduce(value, group=parallel_state.get_data_parallel_group())
    torch.distributed.all_reduce(value, group=parallel_state.get_pipeline_model_parallel_group())
    return value.cpu()


def _diagnostics(probes: list, dp: int) -> dict[str, Any]:
    """The probes' per-layer F-Attn / M-Act / max logit (and gate scores): averaged over DP ranks (equal token
    counts) or maxed, and gathered along the pipeline; model-level F-Attn is the layer mean, M-Act the layer max."""
    from megatron.core import parallel_state

    layers = [d for probe in probes for d in probe.results()]  # TP-reduced inside
    means = torch.tensor(
        [[d.f_attn, d.gate_score_mean or 0.0, d.gate_sparsity or 0.0] for d in layers], dtype=torch.float64
    )
    maxima = torch.tensor([[d.m_act, d.max_logit] for d in layers], dtype=torch.float64)
    group = parallel_state.get_data_parallel_group()
    if dp > 1 and len(layers):
        if torch.cuda.is_available():  # nccl reduces device tensors only
            means, maxima = means.cuda(), maxima.cuda()
        torch.distributed.all_reduce(means, group=group)
        means /= dp
        torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX, group=group)
        means, maxima = means.cpu(), maxima.cpu()
    rows = [
        {
            "layer": d.layer,
            "f_attn": float(means[i, 0]),
            "m_act": float(maxima[i, 0]),
            "max_logit": float(maxima[i, 1]),
            "gate_score_mean": None if d.gate_score_mean is None else float(means[i, 1]),
            "gate_sparsity": None if d.gate_sparsity is None else float(means[i, 2]),
        }
        for i, d in enumerate(layers)
    ]
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    gathered: list = [None] * torch.distributed.get_world_size(pp_group)
    torch.distributed.all_gather_object(gathered, rows, group=pp_group)
    rows = sorted((r for part in gathered for r in part), key=lambda r: r["layer"])
    gated = [r["gate_score_mean"] for r in rows if r["gate_score_mean"] is not None]
    return {
        "f_attn": sum(r["f_attn"] for r in rows) / len(rows),
        "m_act": max(r["m_act"] for r in rows),
        "max_logit": max(r["max_logit"] for r in rows),
        "gate_score_mean": sum(gated) / len(gated) if gated else None,
        "layers": rows,
    }


def evaluate_length(chunks: list, ds: Any, length: int, opts: Options, dp: int) -> dict[str, Any]:
    """Loss, perplexity and position buckets (and diagnostics when length <= diagnostics_max_length) of the first
    `opts.samples` samples of `ds` (rounded down to whole global batches of DP x micro-batch samples)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megagate.monitor.diagnostics import Probe

    per_batch = dp * opts.micro_batch_size
    count = min(opts.samples, len(ds)) // per_batch * per_batch
    if count == 0:
        raise MegagateError(
            f"length {length}: the data holds {len(ds)} sample(s), fewer than one batch of {per_batch} "
            f"(DP {dp} x --micro-batch-size {opts.micro_batch_size})"
        )
    batches = _batches(ds, count, opts.micro_batch_size, dp, parallel_state.get_data_parallel_rank())
    probes = [Probe(c) for c in chunks] if length <= opts.diagnostics_max_length else []
    for probe in probes:
        probe.__enter__()
    try:
        with torch.no_grad():
            results = get_forward_backward_func()(
                forward_step_func=_forward_step,
                data_iterator=iter(batches),
                model=chunks[0],
                num_microbatches=len(batches),
                seq_length=length,
                micro_batch_size=opts.micro_batch_size,
                forward_only=True,
            )
    finally:
        for probe in probes:
            probe.__exit__(None, None, None)
    sums = torch.zeros(2, length, dtype=torch.float64)
    for r in results or []:
        sums[0] += r["nll"]
        sums[1] += r["count"]
    sums = _sum_to_all(sums)
    nll, tokens = sums[0], sums[1]
    loss = float(nll.sum() / tokens.sum().clamp(min=1))
    edges = [round(i * length / min(opts.buckets, length)) for i in range(min(opts.buckets, length) + 1)]
    buckets = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        b_loss = float(nll[lo:hi].sum() / tokens[lo:hi].sum().clamp(min=1))
        buckets.append({"start": lo, "end": hi, "loss": b_loss, "ppl": _ppl(b_loss)})
    out: dict[str, Any] = {
        "seq_length": length,
        "samples": count,
        "tokens": int(tokens.sum()),
        "loss": loss,
        "ppl": _ppl(loss),
        "buckets": buckets,
        "diagnostics": _diagnostics(probes, dp) if probes else None,
    }
    return out


def _ppl(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


def evaluate(prepared: list[Prepared], specs: list[DataSpec], opts: Options, dp: int, log: Any = print) -> dict:
    """Every checkpoint on every dataset at every length (collective: every rank calls it with the same inputs)."""
    checkpoints = []
    for p in prepared:
        chunks = load_chunks(p, opts)
        rows = []
        for spec in specs:
            for length in opts.lengths:
                ds = dataset(spec, p, length, opts)
                row = {"data": spec.name, **evaluate_length(chunks, ds, length, opts, dp)}
                log(f"{p.name} {spec.name} L={length}: loss {row['loss']:.4f} ppl {row['ppl']:.2f}")
                rows.append(row)
        checkpoints.append(
            {
                "name": p.name,
                "path": str(p.path),
                "step": int(p.meta.get("step", 0)),
                "gate": p.model.gate.describe(),
                "train_seq_length": p.cfg.train.seq_length,
                "position_embedding": {
                    k: getattr(p.model, k) for k in (*POSITION_FIELDS, "max_sequence_length", "context_length")
                },
                "results": rows,
            }
        )
        del chunks
    return {
        "layout": {
            "tp": opts.parallel.tensor_model_parallel_size,
            "pp": opts.parallel.pipeline_model_parallel_size,
            "dp": dp,
            "world": int(os.environ.get("WORLD_SIZE", "1")),
        },
        "data": [s.name for s in specs],
        "seq_lengths": opts.lengths,
        "checkpoints": checkpoints,
    }
