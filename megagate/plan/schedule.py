"""The pipeline: which layers each stage holds, and how long the schedule takes from each stage's work.

Layer splits follow megatron's TransformerConfig options: even (num_layers / (PP x VPP) per model chunk); with
`account_for_embedding_in_pipeline_split` / `account_for_loss_in_pipeline_split` the embedding and the loss count as
one layer each, so the first and the last virtual stage hold one transformer layer fewer; with
`num_layers_in_first_pipeline_stage` / `..._last_...` those stages hold the given counts and the others share the
rest. Chunk c of stage s is virtual stage c x PP + s.

Schedule time from W_s, the forward + backward seconds of one micro-batch on stage s (all its chunks), for M
micro-batches and V model chunks per stage (V = 1: 1F1B; V > 1: megatron's interleaved schedule):

    T = (M - 1/V) x max_s W_s + (1/V) x sum_s W_s

For equal stages this is W x (M + (PP - 1)/V), the familiar bubble of (PP - 1)/(V x M); an unequal split costs
M x (max - mean) more, the slowest stage setting the pace of the steady state. Pure arithmetic.
"""

from __future__ import annotations

from megagate.distributed.layout import stage_layers
from megagate.model.model_config import ParallelConfig


def split_layers(
    num_layers: int,
    pp: int,
    vpp: int | None = None,
    *,
    account_for_embedding: bool = False,
    account_for_loss: bool = False,
    first: int | None = None,
    last: int | None = None,
    layout: str | None = None,
) -> tuple[tuple[int, ...], ...]:
    """Transformer layers per (stage, chunk), or a one-line ConfigError when the split does not divide: the
    trainer's own rules (megagate.distributed.layout.stage_layers, megatron's)."""
    parallel = ParallelConfig(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        account_for_embedding_in_pipeline_split=account_for_embedding,
        account_for_loss_in_pipeline_split=account_for_loss,
        pipeline_model_parallel_layout=layout,
    )
    return stage_layers(parallel, num_layers)


def pipeline_seconds(stage_work: list[float], microbatches: int, chunks: int = 1) -> float:
    """Seconds of the forward-backward schedule over `microbatches` (see the module docstring)."""
    if not stage_work:
        return 0.0
    slowest = max(stage_work)
    return (microbatches - 1 / chunks) * slowest + sum(stage_work) / chunks
