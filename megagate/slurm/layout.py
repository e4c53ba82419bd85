"""Check that a parallel layout fits an allocation, with megatron-core's rules (parallel_state.initialize_model_parallel).

Dense grid: world = TP x PP x CP x DP.  Expert grid: world = ETP x EP x PP x expert-DP with ETP defaulting to TP,
so EP must divide DP x CP (when ETP = TP).  EP must also divide the number of experts, and EP > 1 needs experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from megagate.errors import ConfigError


@dataclass(frozen=True)
class ParallelLayout:
    """A resolved layout: every size is known and fits the world size."""

    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    etp: int
    num_experts: int
    world_size: int

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.etp * self.ep * self.pp)

    def describe(self) -> str:
        text = f"TP={self.tp} PP={self.pp} CP={self.cp} DP={self.dp}"
        if self.num_experts:
            text += f" EP={self.ep} ETP={self.etp} expert-DP={self.expert_dp} experts={self.num_experts}"
        return text + f" world={self.world_size}"


def _positive(name: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}={value!r} is invalid: it must be an integer >= {minimum}")


def check_layout(
    tp: int,
    pp: int,
    cp: int,
    ep: int,
    dp: int | None,
    num_experts: int,
    nodes: int,
    gpus_per_node: int,
    *,
    etp: int | None = None,
    per_node_name: str = "gpus-per-node",
) -> ParallelLayout:
    """Resolve DP (or check the given one) so the layout fills nodes x gpus_per_node; ConfigError otherwise.

    `per_node_name` names the per-node count in messages ("tasks-per-node" for CPU jobs).
    """
    for name, value in (("TP", tp), ("PP", pp), ("CP", cp), ("EP", ep), ("nodes", nodes), (per_node_name, gpus_per_node)):
        _positive(name, value)
    _positive("num_experts", num_experts, minimum=0)
    etp = tp if etp is None else etp
    _positive("ETP", etp)
    world = nodes * gpus_per_node
    where = f"nodes x {per_node_name} = {nodes} x {gpus_per_node} = {world}"
    model = tp * pp * cp
    if world % model:
        raise ConfigError(f"TP({tp}) x PP({pp}) x CP({cp}) = {model} does not divide {where}")
    resolved_dp = world // model
    if dp is not None:
        _positive("DP", dp)
        if dp != resolved_dp:
            raise ConfigError(
                f"TP({tp}) x PP({pp}) x CP({cp}) x DP({dp}) = {model * dp} does not equal {where}"
                f" (DP would be {resolved_dp})"
            )
    if ep > 1 and num_experts == 0:
        raise ConfigError(f"EP({ep}) > 1 needs a mixture-of-experts model, but model.num_experts is 0")
    if num_experts and num_experts % ep:
        raise ConfigError(f"EP({ep}) does not divide the number of experts ({num_experts})")
    expert_grid = etp * ep * pp
    if world % expert_grid:
        raise ConfigError(
            f"ETP({etp}) x EP({ep}) x PP({pp}) = {expert_grid} does not divide {where}"
            + (f" (EP must divide DP x CP = {resolved_dp * cp})" if etp == tp else "")
        )
    return ParallelLayout(tp=tp, pp=pp, cp=cp, ep=ep, dp=resolved_dp, etp=etp, num_experts=num_experts, world_size=world)
