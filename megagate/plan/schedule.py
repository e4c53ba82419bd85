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

from megagate.errors import ConfigError


def split_layers(
    num_layers: int,
    pp: int,
    vpp: int | None = None,
    *,
    account_for_embedding: bool = False,
    account_for_loss: bool = False,
    first: int | None = None,
    last: int | None = None,
) -> tuple[tuple[int, ...], ...]:
    """Transformer layers per (stage, chunk), or a one-line ConfigError when the split does not divide."""
    chunks = vpp or 1
    virtual = pp * chunks
    if first is not None or last is not None:
        edge = (first or 0) + (last or 0)
        middle = pp - (first is not None) - (last is not None)
        rest = num_layers - edge
        if rest < 0 or (middle and rest % (middle * chunks)) or (not middle and rest):
            raise ConfigError(
                f"num_layers ({num_layers}) minus the first/last stages' layers ({edge}) does not divide over the "
                f"{middle} other stages x {chunks} chunks"
            )
        per = rest // (middle * chunks) if middle else 0
        stages = []
        for s in range(pp):
            count = first if s == 0 and first is not None else last if s == pp - 1 and last is not None else None
            if count is not None and count % chunks:
                raise ConfigError(f"a stage of {count} layers does not divide into {chunks} model chunks")
            stages.append(tuple([count // chunks if count is not None else per] * chunks))
        return tuple(stages)
    total = num_layers + account_for_embedding + account_for_loss
    if total % virtual:
        extra = " (+ the embedding and/or loss counted as layers)" if total != num_layers else ""
        raise ConfigError(
            f"num_layers ({num_layers}){extra} is not divisible by PP ({pp}) x VPP ({chunks}) = {virtual}"
        )
    each = total // virtual
    grid = [[each] * chunks for _ in range(pp)]
    grid[0][0] -= account_for_embedding
    grid[pp - 1][chunks - 1] -= account_for_loss
    if min(min(row) for row in grid) < 0:
        raise ConfigError(f"{num_layers} layers over {virtual} virtual stages leaves a stage with a negative count")
    return tuple(tuple(row) for row in grid)


def pipeline_seconds(stage_work: list[float], microbatches: int, chunks: int = 1) -> float:
    """Seconds of the forward-backward schedule over `microbatches` (see the module docstring)."""
    if not stage_work:
        return 0.0
    slowest = max(stage_work)
    return (microbatches - 1 / chunks) * slowest + sum(stage_work) / chunks
