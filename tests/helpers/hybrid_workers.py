"""Worker for the hybrid (Gated DeltaNet + gated attention) TP / PP / EP equivalence tests (tests/model/
test_hybrid_parallel.py): one process-group layout against the single-process model with the same full weights.

The reference is built at TP = PP = EP = 1, initialised by megagate's layout-independent initialiser and perturbed
(every norm, decay and gate path non-trivial); the parallel model gets its shards with megagate.model.init's own
sharding (GDN's in_proj and conv1d shard per section), runs megatron's schedule and DDP gradient finalisation, and
its losses and (unsharded) gradients are compared.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads

from helpers.parallel_workers import SEQ, _batch, _ddp, _schedule_losses
from megagate.distributed.parallel import initialize_model_parallel
from megagate.model import gate as gates
from megagate.model import init
from megagate.model.build import build_gpt_model, transformer_config
from megagate.model.model_config import ModelConfig, ParallelConfig
from megagate.model.presets import model_preset

GDN_SIZES = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)


def hybrid_model(moe: bool) -> ModelConfig:
    """4 layers "G*GG" (attention in the second: each PP stage of two holds both kinds); MoE with a gated shared
    expert, or dense."""
    extra: dict[str, Any] = dict(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0) if moe else {}
    if moe:
        extra.update(moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True)
    return model_preset(
        "tiny-moe" if moe else "tiny",
        gate=gates.preset("g1-elementwise"),
        num_layers=4,
        layer_pattern="G*GG",
        tie_embeddings=False,
        norm_zero_centered=True,
        **GDN_SIZES,
        **extra,
    )


def _build(model: ModelConfig, parallel: ParallelConfig, stage: tuple[bool, bool] = (True, True)) -> torch.nn.Module:
    initialize_model_parallel(parallel, seed=5)
    config = transformer_config(model, parallel)
    return build_gpt_model(model, config, pre_process=stage[0], post_process=stage[1])


def _groups(name: str) -> tuple[int, int, Any]:
    if ".experts." in name:
        return (
            parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_group(),
        )
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def _unshard(local: torch.Tensor, name: str, param: torch.Tensor, sections: list[int] | None) -> torch.Tensor:
    """The full tensor from every rank's shard: the inverse of megagate.model.init._shard."""
    _, size, group = _groups(name)
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    if sections is not None or name.endswith("linear_fc1.weight"):
        sizes = [s // size for s in sections] if sections is not None else [local.shape[0] // 2] * 2
        pieces = [p.split(sizes, dim=0) for p in parts]
        return torch.cat([torch.cat([piece[i] for piece in pieces]) for i in range(len(sizes))])
    return torch.cat(parts, dim=param.partition_dim)


def hybrid_worker(rank: int, world: int, mode: str, num_microbatches: int = 2) -> dict[str, Any]:
    """mode "tp" (dense hybrid, TP 2), "tpsp" (MoE hybrid, TP 2 with sequence parallelism: experts and the shared
    expert TP-sharded), "pp" (MoE hybrid, PP 2, 1F1B over the micro-batches) or "ep" (MoE hybrid, EP 2, each rank
    half the batch): max |Δ| of losses and gradients against one process."""
    model = hybrid_model(moe=mode != "tp")
    microbatches = [_batch(512, batch=4, seed=100 + i) for i in range(num_microbatches)]
    ref = _build(model, ParallelConfig())
    init.initialize([ref], 3, model.init_method_std, model.num_layers)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in sorted(ref.named_parameters()):
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    ref_losses = _schedule_losses(ref, ref.config, microbatches, pp=1)
    full = {n: (p.detach().clone(), p.grad.clone()) for n, p in ref.named_parameters()}
    parallel_state.destroy_model_parallel()

    parallel = {
        "tp": ParallelConfig(tensor_model_parallel_size=2),
        "tpsp": ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
        "pp": ParallelConfig(pipeline_model_parallel_size=2),
        "ep": ParallelConfig(expert_model_parallel_size=2),
    }[mode]
    stage = rank if mode == "pp" else None
    part = _build(model, parallel, (stage != 1, stage != 0))
    sections = init._gdn_sections(part)
    ep_rank = parallel_state.get_expert_model_parallel_rank()

    def full_name(name: str) -> str:
        return init._global_name(name, part, ep_rank)

    with torch.no_grad():
        for name, p in part.named_parameters():
            r, size, _ = _groups(name)
            p.copy_(init._shard(full[full_name(name)][0], full_name(name), p, r, size, True, sections.get(name)))
    if mode == "ep":  # each rank half of every micro-batch; the replicated gradients add up over the two
        half = slice(rank * 2, rank * 2 + 2)
        microbatches = [tuple(t[half] for t in mb) for mb in microbatches]
    ddp = _ddp(part)
    ddp.config.no_sync_func = None
    losses = _schedule_losses(ddp, part.config, microbatches, pp=parallel.pipeline_model_parallel_size)
    if mode != "ep":
        finalize_model_grads([ddp])
    grad_diff, scale = 0.0, 0.0
    for name, p in part.named_parameters():
        grad = p.main_grad.float()
        if mode == "ep" and getattr(p, "allreduce", True):
            grad = grad.clone()
            torch.distributed.all_reduce(grad)
        if mode == "ep":  # the loss is a mean over each rank's own half: the full batch's mean is their average
            grad = grad / 2
        grad = _unshard(grad, name, p, sections.get(name))
        reference = full[full_name(name)][1]
        grad_diff = max(grad_diff, (grad - reference).abs().max().item())
        scale = max(scale, reference.abs().max().item())
    parallel_state.destroy_model_parallel()
    if mode == "ep":
        gathered = [None, None]
        torch.distributed.all_gather_object(gathered, losses)
        losses = [(a + b) / 2 for a, b in zip(*gathered)]
    return {
        "stage": stage,
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)) if losses else None,
        "num_losses": len(losses),
        "grad": grad_diff,
        "grad_scale": scale,
        "gdn_params": sum(1 for n, _ in part.named_parameters() if ".A_log" in n),
        "seq": SEQ,
    }
