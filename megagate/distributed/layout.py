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
    expert_tp: int | None = None  # parallel.expert_tensor_parallel_size (None: TP)

    @property
    def etp(self) -> int:
        """Expert tensor-parallel size: parallel.expert_tensor_parallel_size, else megatron's default, the TP size."""
        return self.tp if self.expert_tp is None else self.expert_tp

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
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    if etp is not None and (not _integer(etp) or etp < 1):
        raise ConfigError(f"parallel.expert_tensor_parallel_size={etp!r} must be >= 1 (or unset: TP)")
    if etp is not None and not num_experts:
        raise ConfigError(f"parallel.expert_tensor_parallel_size ({etp}) needs an MoE model (model.num_experts > 0)")
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
    etp = parallel.expert_tensor_parallel_size
    if etp is not None and world_size % (etp * ep * pp):
        raise ConfigError(
            f"megatron's expert grid ETP ({etp}) x EP ({ep}) x PP ({pp}) = {etp * ep * pp} must divide world size "
            f"{world_size} (parallel.expert_tensor_parallel_size, expert_model_parallel_size)"
        )
    if (
        etp is None and (dp * cp) % ep
    ):  # = world % (ETP x EP x PP) with ETP = TP: the expert grid does not fill the world
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
        expert_tp=etp,
    )


# --- the pipeline split ----------------------------------------------------------------------------------------------
_LAYOUT_CHARS = {"E": "embedding", "L": "loss", "t": "decoder layer", "m": "MTP layer"}


def parse_pipeline_layout(text: str) -> list[str]:
    """megatron's layout string as its virtual stages in order (PipelineParallelLayerLayout.parse_str_to_list):
    commas are cosmetic, `(...)*n` and `x*n` repeat, `|` separates the stages."""
    import re

    unrolled = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        unrolled = re.sub(pattern, lambda x: x.group(1) * int(x.group(2)), unrolled)
    bad = sorted(set(unrolled) - set(_LAYOUT_CHARS) - {"|"})
    if bad:
        allowed = ", ".join(f"{c} ({what})" for c, what in _LAYOUT_CHARS.items())
        raise ConfigError(
            f"parallel.pipeline_model_parallel_layout={text!r}: {bad[0]!r} is not a layer; allowed: {allowed}, "
            "| between stages, (...)*n and x*n repeats"
        )
    return unrolled.split("|")


def stage_layers(parallel: ParallelConfig, num_layers: int) -> tuple[tuple[int, ...], ...]:
    """Transformer layers of every model chunk, [PP rank][virtual stage], as megatron builds them (its
    TransformerConfig rules for the layout string, the uneven first/last stages and the embedding/loss split; the
    chunk of virtual stage v on rank r is global stage v x PP + r), or a one-line ConfigError naming the value."""
    p = parallel
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    chunks = vpp or 1
    first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    account = p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split
    if p.pipeline_model_parallel_layout is not None:
        if first is not None or last is not None or account:
            raise ConfigError(
                "parallel.pipeline_model_parallel_layout cannot be combined with num_layers_in_first/last_pipeline_"
                "stage or account_for_embedding/loss_in_pipeline_split (megatron's rule): the layout places every layer"
            )
        return _layout_split(p.pipeline_model_parallel_layout, pp, vpp, num_layers)
    if first is not None or last is not None:
        if account:
            raise ConfigError(
                "parallel.num_layers_in_first/last_pipeline_stage cannot be combined with "
                "account_for_embedding/loss_in_pipeline_split (megatron's rule)"
            )
        return _uneven_split(num_layers, pp, vpp, first, last)
    total = num_layers + p.account_for_embedding_in_pipeline_split + p.account_for_loss_in_pipeline_split
    if total % (pp * chunks):
        extra = " + the embedding and/or loss counted as layers" if account else ""
        raise ConfigError(
            f"model.num_layers ({num_layers}{extra}) must be divisible by pipeline stages x virtual stages "
            f"({pp * chunks}); for an uneven split set parallel.num_layers_in_first/last_pipeline_stage, "
            "account_for_embedding/loss_in_pipeline_split or pipeline_model_parallel_layout"
        )
    grid = [[total // (pp * chunks)] * chunks for _ in range(pp)]
    grid[0][0] -= p.account_for_embedding_in_pipeline_split
    grid[pp - 1][chunks - 1] -= p.account_for_loss_in_pipeline_split
    # a chunk of the embedding (or the loss) alone is megatron's (Llama-3.1-405B: 126 + 2 over 128 virtual stages)
    if min(min(row) for row in grid) < 0:
        raise ConfigError(f"model.num_layers ({num_layers}) is fewer than the {pp * chunks} virtual stages")
    return tuple(tuple(row) for row in grid)


def _uneven_split(num_layers: int, pp: int, vpp: int | None, first: int | None, last: int | None) -> tuple:
    chunks = vpp or 1
    for key, value in (("first", first), ("last", last)):
        if value is not None and (not _integer(value) or value < 1):
            raise ConfigError(f"parallel.num_layers_in_{key}_pipeline_stage={value!r} must be >= 1 (or unset)")
        if value is not None and value % chunks:
            raise ConfigError(
                f"parallel.num_layers_in_{key}_pipeline_stage ({value}) must be divisible by "
                f"virtual_pipeline_model_parallel_size ({chunks}) (megatron's rule)"
            )
    if pp < 2:
        raise ConfigError("parallel.num_layers_in_first/last_pipeline_stage needs pipeline_model_parallel_size > 1")
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    given = f"first {first}, last {last}"
    if rest < 0 or bool(rest) != bool(middle):
        raise ConfigError(
            f"parallel.num_layers_in_first/last_pipeline_stage ({given}) leave {rest} of model.num_layers "
            f"({num_layers}) for {middle} other stages: every stage needs at least one layer"
        )
    if middle and rest % (middle * chunks):
        raise ConfigError(
            f"parallel.num_layers_in_first/last_pipeline_stage ({given}) leave {rest} layers, not divisible by the "
            f"{middle} other stages x {chunks} virtual stages"
        )
    per = rest // (middle * chunks) if middle else 0
    counts = [per] * pp
    if first is not None:
        counts[0] = first // chunks
    if last is not None:
        counts[-1] = last // chunks
    return tuple((c,) * chunks for c in counts)


def _layout_split(text: str, pp: int, vpp: int | None, num_layers: int) -> tuple:
    key = f"parallel.pipeline_model_parallel_layout={text!r}"
    stages = parse_pipeline_layout(text)
    if len(stages) % pp:
        raise ConfigError(f"{key} has {len(stages)} stages, not a multiple of pipeline_model_parallel_size ({pp})")
    detected = len(stages) // pp
    if detected != (vpp or 1):
        raise ConfigError(
            f"{key} has {len(stages)} stages = PP {pp} x {detected} virtual stages; set "
            f"parallel.virtual_pipeline_model_parallel_size={detected if detected > 1 else 'null'} (it is {vpp})"
        )
    flat = "".join(stages)
    if not flat.startswith("E") or not flat.endswith("L") or flat.count("E") != 1 or flat.count("L") != 1:
        raise ConfigError(f"{key}: the embedding E must open the first stage and the loss L close the last, once each")
    if flat.count("m"):
        raise ConfigError(f"{key}: megagate's models have no MTP layers (m)")
    if flat.count("t") != num_layers:
        raise ConfigError(f"{key} places {flat.count('t')} decoder layers (t); model.num_layers is {num_layers}")
    return tuple(tuple(stages[v * pp + r].count("t") for v in range(detected)) for r in range(pp))


def placement_key(parallel: ParallelConfig, num_layers: int) -> dict:
    """What places parameters on ranks beyond the sizes, for a checkpoint's layout record, only where it is not the
    default (older checkpoints stay comparable): expert TP, and every stage's layer counts under an uneven split."""
    out: dict = {}
    if parallel.expert_tensor_parallel_size is not None:
        out["etp"] = parallel.expert_tensor_parallel_size
    grid = stage_layers(parallel, num_layers)
    if len({n for row in grid for n in row}) > 1:
        out["stages"] = [list(row) for row in grid]
    return out
