"""Worker functions for the multi-process TP / PP / EP equivalence tests (run by tests/distributed.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads

from megagate.distributed.parallel import initialize_model_parallel
from megagate.model import gate as gates
from megagate.model.attention import GatedSelfAttention
from megagate.model.build import build_gpt_model, transformer_config
from megagate.model.model_config import ParallelConfig
from megagate.model.presets import model_preset

SEQ, BATCH = 12, 4


def _batch(vocab: int, batch: int = BATCH, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, SEQ + 1), generator=gen)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(batch, -1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), position_ids


def _build(model, parallel: ParallelConfig, **kw):
    initialize_model_parallel(parallel, seed=5)
    return build_gpt_model(model, transformer_config(model, parallel), **kw)


def _perturb_(module: torch.nn.Module, seed: int) -> None:
    # Non-trivial values everywhere (norm weights and zero-initialised gates included) so every path matters.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.add_(0.2 * torch.randn(p.shape, generator=gen))


def _is_glu_fc1(name: str) -> bool:
    return name.endswith("linear_fc1.weight")


def _shard(name: str, full: torch.Tensor, param: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's part of a full (TP=1) tensor, following megatron's parameter attributes."""
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return full
    dim = param.partition_dim
    if _is_glu_fc1(name):  # SwiGLU fc1 = [gate; up], each sharded separately
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]])
    return full.chunk(size, dim=dim)[rank]


def _unshard(name: str, local: torch.Tensor, param: torch.Tensor, group) -> torch.Tensor:
    size = torch.distributed.get_world_size(group)
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    if _is_glu_fc1(name):
        gates_, ups = zip(*(p.chunk(2, dim=0) for p in parts))
        return torch.cat([torch.cat(gates_), torch.cat(ups)])
    return torch.cat(parts, dim=param.partition_dim)


def _ddp(module):
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    return DistributedDataParallel(module.config, ddp_config, module)


def _checkpoint_mismatches(model: torch.nn.Module) -> list[str]:
    """Gate parameters whose distributed-checkpoint entry disagrees with the gate table (full shape, local part)."""
    bad = []
    for prefix, module in model.named_modules():
        if not isinstance(module, GatedSelfAttention):
            continue
        sharded = module.sharded_state_dict(prefix=f"{prefix}.")
        for entry in module.gate_params:
            if entry.in_linear_qkv:
                continue
            tensor, param = sharded[f"{prefix}.{entry.name}"], getattr(module, entry.name)
            if tuple(tensor.global_shape) != entry.shape or tuple(tensor.local_shape) != tuple(param.shape):
                bad.append(f"{prefix}.{entry.name}: global {tuple(tensor.global_shape)} vs table {entry.shape}")
    return bad


def tp_worker(
    rank: int,
    world: int,
    variants: list[str | gates.GateConfig],
    setup: Callable[[], Any] | None = None,
    fields: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """For each variant (a preset name or a GateConfig): TP=1 and TP=2 models with the same full weights; max |Δ| of
    losses and gradients, and the gate parameters whose checkpoint shapes disagree with the table. `setup` runs
    first (e.g. registering a variant in this process); `fields` override the tiny model's (e.g. softmax_type)."""
    if setup is not None:
        setup()
    tokens, labels, position_ids = _batch(512)
    report = {}
    for variant in variants:
        gate = gates.preset(variant) if isinstance(variant, str) else variant
        model = model_preset("tiny", gate=gate, **(fields or {}))
        ref = _build(model, ParallelConfig())
        _perturb_(ref, seed=1)
        ref_loss = ref(tokens, position_ids, None, labels=labels)
        ref_loss.sum().backward()
        full = {n: (p.detach().clone(), p.grad.clone()) for n, p in ref.named_parameters()}
        parallel_state.destroy_model_parallel()

        tp = _build(model, ParallelConfig(tensor_model_parallel_size=2))
        tp_rank, group = (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_group(),
        )
        with torch.no_grad():
            for name, p in tp.named_parameters():
                p.copy_(_shard(name, full[name][0], p, tp_rank, 2))
        # megatron's DDP wrapper and gradient finalisation (TP sums of QK-norm / sequence-parallel grads)
        ddp = _ddp(tp)
        loss = ddp(tokens, position_ids, None, labels=labels)
        loss.sum().backward()
        finalize_model_grads([ddp])
        grad_diff = 0.0
        for name, p in tp.named_parameters():
            grad_diff = max(grad_diff, (_unshard(name, p.main_grad, p, group) - full[name][1]).abs().max().item())
        report[variant if isinstance(variant, str) else gate.describe()] = {
            "loss": (loss - ref_loss).abs().max().item(),
            "grad": grad_diff,
            "grad_scale": max(g.abs().max().item() for _, g in full.values()),
            "checkpoint": _checkpoint_mismatches(tp),
        }
        parallel_state.destroy_model_parallel()
    return report


def _schedule_losses(model, config, microbatches, pp: int) -> list[float]:
    """megatron's forward-backward schedule over the given micro-batches; returns per-micro-batch losses."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, module):
        tokens, labels, position_ids = next(data_iterator)
        output = module(tokens, position_ids, None, labels=labels)

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    config.no_sync_func = None
    config.finalize_model_grads_func = None
    results = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=SEQ,
        micro_batch_size=microbatches[0][0].shape[0],
        forward_only=False,
    )
    return [r["lm loss"].item() for r in results] if results else []


def pp_worker(
    rank: int, world: int, variants: list[str], num_microbatches: int, split: dict | None = None
) -> dict[str, dict]:
    """pp_variant for each variant, in one process group (`split`: ParallelConfig's pipeline-split keys)."""
    return {v: pp_variant(v, num_microbatches, split) for v in variants}


def pp_variant(variant: str, num_microbatches: int, split: dict | None = None) -> dict[str, float]:
    """PP=1 vs PP=2 (1F1B schedule, several micro-batches) with the same weights: losses and gradients; `split`
    (e.g. num_layers_in_first_pipeline_stage=1) splits the layers unevenly, as megatron builds the stages."""
    from megagate.distributed.layout import stage_layers

    model = model_preset("tiny", gate=gates.preset(variant), num_layers=4, tie_embeddings=False)
    microbatches = [_batch(512, batch=2, seed=100 + i) for i in range(num_microbatches)]

    ref = _build(model, ParallelConfig())
    _perturb_(ref, seed=2)
    ref_losses = _schedule_losses(ref, ref.config, microbatches, pp=1)
    full = {n: (p.detach().clone(), p.grad.clone()) for n, p in ref.named_parameters()}
    parallel_state.destroy_model_parallel()

    parallel = ParallelConfig(pipeline_model_parallel_size=2, **(split or {}))
    initialize_model_parallel(parallel, seed=5)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    config = transformer_config(model, parallel)
    part = build_gpt_model(model, config, pre_process=stage == 0, post_process=stage == 1)
    offset = sum(sum(chunks) for chunks in stage_layers(parallel, model.num_layers)[:stage])

    def full_name(name: str) -> str:
        if name.startswith("decoder.layers."):
            index, rest = name[len("decoder.layers.") :].split(".", 1)
            return f"decoder.layers.{int(index) + offset}.{rest}"
        return name

    with torch.no_grad():
        for name, p in part.named_parameters():
            p.copy_(full[full_name(name)][0])
    losses = _schedule_losses(part, config, microbatches, pp=2)
    grad_diff = max((p.grad - full[full_name(n)][1]).abs().max().item() for n, p in part.named_parameters())
    parallel_state.destroy_model_parallel()
    return {
        "stage": stage,
        "layers": len(part.decoder.layers),
        "params": sum(1 for _ in part.parameters()),
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)) if losses else None,
        "num_losses": len(losses),
        "ref_losses": ref_losses,
        "grad": grad_diff,
    }


def ep_worker(rank: int, world: int, variants: list[str]) -> dict[str, dict]:
    """ep_variant for each variant, in one process group."""
    return {v: ep_variant(rank, v) for v in variants}


def ep_variant(rank: int, variant: str) -> dict[str, float]:
    """EP=1 on the whole batch vs EP=2 (each rank half the batch, half the experts): token losses and gradients."""
    model = model_preset("tiny-moe", gate=gates.preset(variant), moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
    tokens, labels, position_ids = _batch(512, batch=4)
    ref = _build(model, ParallelConfig())
    _perturb_(ref, seed=3)
    ref_loss = ref(tokens, position_ids, None, labels=labels)
    ref_loss.sum().backward()
    full = {n: (p.detach().clone(), p.grad.clone()) for n, p in ref.named_parameters()}
    parallel_state.destroy_model_parallel()

    ep = _build(model, ParallelConfig(expert_model_parallel_size=2))
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    local_experts = model.num_experts // 2

    def full_name(name: str) -> str:
        marker = "local_experts."
        if marker in name:
            head, rest = name.split(marker)
            index, tail = rest.split(".", 1)
            return f"{head}{marker}{int(index) + ep_rank * local_experts}.{tail}"
        return name

    with torch.no_grad():
        for name, p in ep.named_parameters():
            p.copy_(full[full_name(name)][0])
    half = slice(rank * 2, rank * 2 + 2)
    loss = ep(tokens[half], position_ids[half], None, labels=labels[half])
    loss.sum().backward()
    loss_diff = (loss - ref_loss[half]).abs().max().item()
    grad_diff, experts_seen = 0.0, 0
    for name, p in ep.named_parameters():
        grad = p.grad
        if getattr(p, "allreduce", True):  # replicated parameter: the two halves of the batch add up
            grad = grad.clone()
            torch.distributed.all_reduce(grad)
        else:
            experts_seen += 1
        grad_diff = max(grad_diff, (grad - full[full_name(name)][1]).abs().max().item())
    parallel_state.destroy_model_parallel()
    return {"loss": loss_diff, "grad": grad_diff, "expert_params": experts_seen}
