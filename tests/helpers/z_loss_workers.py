"""Worker for the TP 2 vs TP 1 z-loss test (run by helpers.distributed.run: 2 processes over gloo).

The TP 1 model (torch's local cross-entropy) and the TP 2 model (megatron's vocab-parallel cross-entropy, the
vocabulary split over the two ranks) get the same full weights; both compute the trainer's loss function with the
z-loss on the same masked batch. The TP 1 model's logits also give the float64 reference of the term."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads

from helpers.parallel_workers import _batch, _build, _ddp, _perturb_, _shard, _unshard
from megagate.model import gate as gates
from megagate.model.loss import add_z_loss, z_loss_of
from megagate.model.model_config import ParallelConfig
from megagate.model.presets import model_preset
from megagate.train.trainer import _loss_func

COEFF = 1e-2


def _mask(tokens: torch.Tensor) -> torch.Tensor:
    """A loss mask with holes (the first two tokens of every sequence, a few more at random)."""
    gen = torch.Generator().manual_seed(3)
    mask = (torch.rand(tokens.shape, generator=gen) > 0.25).float()
    mask[:, :2] = 0.0
    return mask


def _step(module: Any, tokens: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor):
    """The trainer's loss function on one micro-batch; (back-propagated loss, its report), backward done."""
    output = module(tokens, position_ids, None, labels=labels)
    loss, reported = _loss_func(mask, z_loss_of(module), output)
    loss.backward()
    return loss.detach(), reported


def tp_z_loss_worker(rank: int, world: int, variant: str = "g1-elementwise") -> dict[str, Any]:
    """max |Δ| between TP 2 and TP 1 of the loss, the cross-entropy, the z-loss term and every gradient; the TP 1
    term against the float64 reference from its logits."""
    tokens, labels, position_ids = _batch(512)
    mask = _mask(tokens)
    model = model_preset("tiny", gate=gates.preset(variant))

    ref = _build(model, ParallelConfig())
    _perturb_(ref, seed=1)
    with torch.no_grad():
        logits = ref(tokens, position_ids, None).double()  # [b, s, v]
    lse = torch.logsumexp(logits, dim=-1)
    reference = COEFF * (lse.square() * mask.double()).sum() / mask.double().sum()
    add_z_loss(ref, COEFF)
    ref_loss, ref_report = _step(ref, tokens, labels, position_ids, mask)
    full = {n: (p.detach().clone(), p.grad.clone()) for n, p in ref.named_parameters()}
    parallel_state.destroy_model_parallel()

    tp = _build(model, ParallelConfig(tensor_model_parallel_size=2))
    tp_rank, group = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()
    with torch.no_grad():
        for name, p in tp.named_parameters():
            p.copy_(_shard(name, full[name][0], p, tp_rank, 2))
    add_z_loss(tp, COEFF)
    vocab_shard = tp.embedding.word_embeddings.weight.shape[0]  # this rank's vocabulary rows (tied head)
    ddp = _ddp(tp)
    loss, report = _step(ddp, tokens, labels, position_ids, mask)
    finalize_model_grads([ddp])
    grad_diff = 0.0
    for name, p in tp.named_parameters():
        grad_diff = max(grad_diff, (_unshard(name, p.main_grad, p, group) - full[name][1]).abs().max().item())
    parallel_state.destroy_model_parallel()
    return {
        "reference": reference.item(),
        "tp1_z": ref_report["z loss"].item(),
        "tp2_z": report["z loss"].item(),
        "tp1_ce": ref_report["lm loss"].item(),
        "tp2_ce": report["lm loss"].item(),
        "loss": (loss - ref_loss).abs().item(),
        "sum": (ref_loss - ref_report["lm loss"] - ref_report["z loss"]).abs().item(),
        "grad": grad_diff,
        "grad_scale": max(g.abs().max().item() for _, g in full.values()),
        "vocab_shard": vocab_shard,
        "vocab": model.vocab_size,
    }
