"""Fault injection for stability tests: at a chosen step, corrupt the batch, scale the loss or LR, or poison the grads.

The trainer calls the hooks at fixed points of its step (all are no-ops on other steps and when no fault is set):

    tokens = faults.batch(step, tokens)            # after fetching the batch
    loss = faults.loss(step, loss)                 # on the reported loss the monitor sees (gradients unchanged)
    faults.grads(step, model.parameters())         # after backward, before the grad norm / optimizer step
    lr = lr * faults.lr_scale(step)                # when setting the LR of this step's update

Config section `monitor.faults`: a list of {"step": int, "kind": one of KINDS, "factor": float}.
Each fault fires once: after a rollback the replayed step runs clean, like a transient fault (a rollback that
skips the offending data must be able to succeed). Fired faults are in `state_dict()` for the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

from megagate.errors import ConfigError

KINDS = ("corrupt_batch", "scale_loss", "scale_lr", "nan_grad")


@dataclass(frozen=True)
class Fault:
    step: int
    kind: str
    factor: float = 10.0  # scale_loss / scale_lr multiplier; corrupt_batch: unused

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ConfigError(f"monitor.faults step={self.step!r} must be a non-negative integer")
        if self.kind not in KINDS:
            raise ConfigError(f"monitor.faults kind={self.kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(self.factor, (int, float)):
            raise ConfigError(f"monitor.faults factor={self.factor!r} must be a number")


class FaultInjector:
    """The faults of a run, applied by step (each fault fires at its step only)."""

    def __init__(self, faults: Sequence[Fault] = ()) -> None:
        self.faults = tuple(faults)
        self._fired: set[int] = set()  # indices into self.faults

    @classmethod
    def from_config(cls, items: Iterable[Mapping[str, Any]] | None) -> "FaultInjector":
        return cls([Fault(**dict(item)) for item in (items or [])])

    def _at(self, step: int, kind: str) -> list[Fault]:
        hits = [i for i, f in enumerate(self.faults) if f.step == step and f.kind == kind and i not in self._fired]
        self._fired.update(hits)
        return [self.faults[i] for i in hits]

    def state_dict(self) -> dict[str, list[int]]:
        return {"fired": sorted(self._fired)}

    def load_state_dict(self, state: dict[str, list[int]]) -> None:
        self._fired = set(state.get("fired", []))

    def batch(self, step: int, tokens: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
        """corrupt_batch: replace the batch by uniformly random tokens (a reproducible, out-of-distribution batch)."""
        if not self._at(step, "corrupt_batch"):
            return tokens
        high = vocab_size or int(tokens.max().item()) + 1
        gen = torch.Generator().manual_seed(1_000_003 + step)
        return torch.randint(0, high, tokens.shape, generator=gen).to(tokens.device, tokens.dtype)

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        for fault in self._at(step, "scale_loss"):
            loss = loss * fault.factor
        return loss

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
