"""Fault injection for stability tests: at a chosen step, corrupt the batch, scale the loss or LR, or poison the grads.

The trainer's FaultInjection callback (megagate.train.callbacks) calls these at fixed points of a step (all are
no-ops on other steps and when no fault is set):

    batches = faults.batches(step, batches, vocab) # pre_step: the step's micro-batches, after fetching them
    faults.grads(step, model.parameters())         # post_backward: before the grad norm / optimizer step
    loss = faults.loss(step, loss)                 # pre_optim_step: the loss later callbacks (the spike monitor)
                                                   # judge the step by; gradients and the logged loss unchanged
    lr = lr * faults.lr_scale(step)                # pre_optim_step: this step's update

Config section `monitor.faults`: a list of {"step": int, "kind": one of KINDS, "factor": float} (read by
`Fault.from_dict`, which refuses unknown keys).
Each fault fires once: after a rollback the replayed step runs clean, like a transient fault (a rollback that
skips the offending data must be able to succeed). Fired faults are in `state_dict()` for the checkpoint.

Cluster faults for drills and tests (megagate.monitor.process_faults carries them out) name a rank, or a host:

    {step: 7, kind: hang, rank: 1, phase: forward_backward}   rank 1 blocks when it enters that phase at step 7
    {step: 7, kind: hang, host: node1, phase: save}          every rank on node1 (a broken node: every launch)
    {step: 1, kind: slow_rank, rank: 1, factor: 1.5}         rank 1 computes 1.5x as long from step 1 on (from
                                                             its second step: a first step has no time to scale)
    {step: 6, kind: fail_save, rank: 1}                      rank 1's write of the step-6 checkpoint fails (EIO)
    {step: 0, kind: fail_load, rank: 1}                      rank 1's first checkpoint read fails (EIO); step:
                                                             the checkpoint's step, 0 for any

A rank fault fires once per run (recorded in health.jsonl, so a rerun resumes past it, like a transient fault);
a host fault fires in every launch that runs on that host.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megagate.errors import ConfigError
from megagate.sections import refuse_unknown

STEP_KINDS = ("corrupt_batch", "scale_loss", "scale_lr", "nan_grad")
CLUSTER_KINDS = ("hang", "slow_rank", "fail_save", "fail_load")  # megagate.monitor.process_faults
KINDS = STEP_KINDS + CLUSTER_KINDS
FIELDS = ("step", "kind", "factor", "rank", "host", "phase")
# where a hang can be injected: the trainer's phases (megagate.health.config.PHASES) and `write`, inside the
# checkpoint writer (the background process of an asynchronous save)
HANG_PHASES = (
    "data",
    "forward_backward",
    "grad_sync",
    "optimizer",
    "after_step",
    "evaluation",
    "save",
    "load",
    "write",
)


def check_fault(
    step: Any,
    kind: Any,
    factor: Any,
    where: str = "fault",
    rank: Any = None,
    host: Any = None,
    phase: Any = None,
) -> None:
    """Raise a one-line ConfigError naming the first invalid value (`where`: the config path of the fault)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"{where}.step={step!r} must be a non-negative integer")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ConfigError(f"{where}.kind={kind!r} is not one of {', '.join(KINDS)}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
        raise ConfigError(f"{where}.factor={factor!r} must be a finite number")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ConfigError(f"{where}.rank={rank!r} must be a non-negative integer")
    if host is not None and (not isinstance(host, str) or not host.strip()):
        raise ConfigError(f"{where}.host={host!r} must be a host name")
    if kind in STEP_KINDS:
        for name, value in (("rank", rank), ("host", host), ("phase", phase)):
            if value is not None:
                raise ConfigError(f"{where}.{name} is for the cluster faults ({', '.join(CLUSTER_KINDS)}), not {kind}")
        return
    if rank is None and (kind != "hang" or host is None):
        needs = "a rank or a host" if kind == "hang" else "a rank"
        raise ConfigError(f"{where} ({kind}) needs {needs}")
    if kind == "hang" and phase not in HANG_PHASES:
        raise ConfigError(f"{where}.phase={phase!r} is not one of {', '.join(HANG_PHASES)} (where the rank hangs)")
    if kind != "hang" and phase is not None:
        raise ConfigError(f"{where}.phase is for a hang, not {kind}")
    if kind == "slow_rank" and not factor > 1:
        raise ConfigError(f"{where}.factor={factor!r} must be > 1 for slow_rank (how many times slower)")


@dataclass(frozen=True)
class Fault:
    step: int
    kind: str
    factor: float = 10.0  # scale_loss / scale_lr multiplier, slow_rank's slowdown; others: unused
    rank: int | None = None  # the cluster faults' global rank
    host: str | None = None  # ... or host (a hang on every rank of a node)
    phase: str | None = None  # a hang's phase

    def __post_init__(self) -> None:
        check_fault(self.step, self.kind, self.factor, "fault", self.rank, self.host, self.phase)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}

    @classmethod
    def from_dict(cls, item: Any, where: str = "monitor.faults[0]") -> Fault:
        """A fault from its config mapping, refusing unknown and missing keys (errors name `where`)."""
        if not isinstance(item, Mapping):
            raise ConfigError(f"{where} must be a mapping with keys {', '.join(FIELDS)}, not {item!r}")
        refuse_unknown(item, FIELDS, where)
        for key in ("step", "kind"):
            if key not in item:
                raise ConfigError(f"{where} needs a {key} (kinds: {', '.join(KINDS)})")
        factor = item.get("factor", 10.0)
        rank, host, phase = item.get("rank"), item.get("host"), item.get("phase")
        check_fault(item["step"], item["kind"], factor, where, rank, host, phase)
        return cls(item["step"], item["kind"], float(factor), rank, host, phase)


class FaultInjector:
    """The faults of a run, applied by step (each fault fires at its step only)."""

    def __init__(self, faults: Sequence[Fault] = ()) -> None:
        self.faults = tuple(faults)
        self._fired: set[int] = set()  # indices into self.faults

    def _at(self, step: int, kind: str) -> list[Fault]:
        hits = [i for i, f in enumerate(self.faults) if f.step == step and f.kind == kind and i not in self._fired]
        self._fired.update(hits)
        return [self.faults[i] for i in hits]

    def state_dict(self) -> dict[str, list[int]]:
        return {"fired": sorted(self._fired)}

    def load_state_dict(self, state: dict[str, list[int]]) -> None:
        self._fired = set(state.get("fired", []))

    def batches(
        self, step: int, microbatches: Sequence[Mapping[str, torch.Tensor]], vocab_size: int
    ) -> list[dict[str, torch.Tensor]]:
        """corrupt_batch: every micro-batch of the step becomes uniformly random text, `tokens` [b, s] and their
        next-token `labels` (a reproducible, out-of-distribution batch); other entries are kept."""
        batches = [dict(mb) for mb in microbatches]
        if not self._at(step, "corrupt_batch"):
            return batches
        gen = torch.Generator().manual_seed(1_000_003 + step)
        for mb in batches:
            tokens = mb["tokens"]
            text = torch.randint(0, vocab_size, (tokens.shape[0], tokens.shape[1] + 1), generator=gen)
            mb["tokens"] = text[:, :-1].to(tokens.device, tokens.dtype)
            if "labels" in mb:
                mb["labels"] = text[:, 1:].to(mb["labels"].device, mb["labels"].dtype)
        return batches

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_factor(step)

    def loss_factor(self, step: int) -> float:
        """scale_loss: the factor of the loss the monitor sees at `step` (1 without a fault there)."""
        factor = 1.0
        for fault in self._at(step, "scale_loss"):
            factor *= fault.factor
        return factor

    def lr_scale(self, step: int) -> float:
        scale = 1.0
        for fault in self._at(step, "scale_lr"):
            scale *= fault.factor
        return scale

    def grads(self, step: int, parameters: Iterable[torch.nn.Parameter]) -> None:
        """nan_grad: write NaN into the first gradient found (the global grad norm becomes NaN)."""
        if not self._at(step, "nan_grad"):
            return
        for p in parameters:
            grad = getattr(p, "main_grad", None)
            grad = p.grad if grad is None else grad
            if grad is not None:
                grad.view(-1)[0] = float("nan")
                return

    def __bool__(self) -> bool:
        return bool(self.faults)
