"""The parallel layout of a run: megatron-core's rules in one place, for `train`, `train --dry-run`, `submit`, `sweep`.

Rules (megatron.core.parallel_state.initialize_model_parallel and the pipeline schedules):

- dense grid: world = TP x PP x CP x DP, so TP x PP x CP must divide the world size;
- expert grid: world = ETP x EP x PP x expert-DP with ETP = TP (megatron's default; megagate's config has no separate
  expert TP size), so EP must divide DP x CP; EP must also divide the number of experts, and EP > 1 needs experts;
- batch: global batch = micro batch x DP x micro-batches per step;
- interleaved (virtual) pipeline: megatron groups micro-batches in runs of PP (`microbatch_group_size_per_vp_stage`
  defaults to PP) and refuses a step whose micro-batch count is not a multiple of PP.

Pure arithmetic on plain sizes (`megagate.model.model_config.ParallelConfig`): no torch, no process group. Every mistake is a
one-line `ConfigError` naming the sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

from megagate.errors import ConfigError
from megagate.model.model_config import ParallelConfig

_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "context_parallel_size",
)


@dataclass(frozen=True)
class Layout:
    """A parallel layout that fits its world size, with the batch arithmetic of one training step."""

    world_size: int
    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    num_experts: int = 0
    vpp: int | None = None

    @property
    def etp(self) -> int:
        """Expert tensor-parallel size: megatron's default, the dense TP size."""
        return self.tp

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert grid (world / (ETP x EP x PP))."""
        return self.world_size // (self.etp * self.ep * self.pp)

    def describe(self) -> str:
        """One line, e.g. ``TP=1 PP=1 CP=1 DP=64 EP=8 ETP=1 expert-DP=8 experts=128 world=64``."""
        text = f"TP={self.tp} PP={self.pp} CP={self.cp} DP={self.dp}"
        if self.vpp:
            text += f" VPP={self.vpp}"
        if self.num_experts:
            text += f" EP={self.ep} ETP={self.etp} expert-DP={self.expert_dp} experts={self.num_experts}"
        return text + f" world={self.world_size}"

    def describe_batch(self) -> str:
        """One line, e.g. ``global 1024 = micro 2 x DP 64 x 8 micro-batches``."""
        return (
            f"global {self.global_batch_size} = micro {self.micro_batch_size} x DP {self.dp} x "
            f"{self.num_microbatches} micro-batches"
        )


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_parallel(parallel: ParallelConfig, num_experts: int = 0) -> None:
    """The checks that need no world size: sizes >= 1, VPP needs PP > 1, SP needs TP > 1, EP fits the experts."""
    for name in _SIZES:
        value = getattr(parallel, name)
        if not _integer(value) or value < 1:
            raise ConfigError(f"parallel.{name}={value!r} must be >= 1")
    vpp, pp = parallel.virtual_pipeline_model_parallel_size, parallel.pipeline_model_parallel_size
    if vpp is not None:
        if not _integer(vpp) or vpp < 1:
            raise ConfigError(f"parallel.virtual_pipeline_model_parallel_size={vpp!r} must be >= 1 (or unset)")
        if pp < 2:
            raise ConfigError(
                f"parallel.virtual_pipeline_model_parallel_size ({vpp}) needs pipeline_model_parallel_size > 1"
            )
    ep = parallel.expert_model_parallel_size
    if ep > 1 and not num_experts:
        raise ConfigError(f"parallel.expert_model_parallel_size ({ep}) needs an MoE model (model.num_experts > 0)")
    if num_experts and num_experts % ep:
        raise ConfigError(f"parallel.expert_model_parallel_size ({ep}) must divide model.num_experts ({num_experts})")
    if parallel.sequence_parallel and parallel.tensor_model_parallel_size == 1:
        raise ConfigError("parallel.sequence_parallel=true needs tensor_model_parallel_size > 1")


def layout(
    parallel: ParallelConfig,
    world_size: int,
    *,
    micro_batch_size: int,
    global_batch_size: int,
    num_experts: int = 0,
) -> Layout:
    """The layout of `parallel` on `world_size` ranks, or a ConfigError naming the sizes that do not fit."""
    check_parallel(parallel, num_experts)
    if not _integer(world_size) or world_size < 1:
        raise ConfigError(f"world size {world_size!r} must be a positive integer")
    for name, value in (("micro_batch_size", micro_batch_size), ("global_batch_size", global_batch_size)):
        if not _integer(value) or value < 1:
            raise ConfigError(f"train.{name}={value!r} must be positive")
    tp, pp, cp, ep = (
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.context_parallel_size,
        parallel.expert_model_parallel_size,
    )
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by TP ({tp}) x PP ({pp}) x CP ({cp}) = {model_parallel}"
        )
    dp = world_size // model_parallel
    if (dp * cp) % ep:  # = world % (ETP x EP x PP) with ETP = TP: the expert grid does not fill the world
        raise ConfigError(
            f"parallel.expert_model_parallel_size ({ep}) must divide DP ({dp}) x CP ({cp}) = {dp * cp}: "
            f"megatron's expert grid ETP ({tp}) x EP ({ep}) x PP ({pp}) = {tp * ep * pp} must divide "
            f"world size {world_size}"
        )
    per_step = micro_batch_size * dp
    if global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size ({global_batch_size}) must be divisible by micro_batch_size "
            f"({micro_batch_size}) x data-parallel size ({dp}) = {per_step}"
        )
    num_microbatches = global_batch_size // per_step
    vpp = parallel.virtual_pipeline_model_parallel_size
    if vpp is not None and num_microbatches % pp:
        raise ConfigError(
            f"train.global_batch_size ({global_batch_size}) gives {num_microbatches} micro-batches per "
            f"step; the interleaved pipeline schedule (virtual_pipeline_model_parallel_size={vpp}) needs "
            f"a multiple of pipeline_model_parallel_size ({pp})"
        )
    return Layout(
        world_size,
        tp,
        pp,
        cp,
        ep,
        dp,
        micro_batch_size,
        global_batch_size,
        num_microbatches,
        num_experts=num_experts,
        vpp=vpp,
    )
