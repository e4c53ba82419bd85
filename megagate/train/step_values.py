"""Per-step training values (loss, gradient norm) kept on the device, and the one place the trainer reads them.

A step leaves its local loss (this rank's mean over its micro-batches, last pipeline stage; zero elsewhere) and the
global gradient norm on the device in a `StepLog`. Nothing is reduced or read while training runs ahead; a read
(`StepLog.flush`) takes every pending step at once: one data-parallel mean and one pipeline broadcast of the
stacked losses, then a single device-to-host transfer through `HostReads.read`, which counts it. The trainer
reads when something needs a value on the host: a callback that decides before the update (the spike monitor's
skip / rollback / lr_backoff / abort: every step), a logging step, an evaluation, a checkpoint, the end of a run.

A flush is a collective call: every rank makes it at the same step (callbacks run the same hooks on every rank).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch


class HostReads:
    """Device-to-host reads of the trainer: `read` is the only way it reads tensors; `count` says how many."""

    def __init__(self) -> None:
        self.count = 0

    def read(self, values: torch.Tensor) -> list[float]:
        """The elements of `values` as Python floats: one transfer (on a GPU, one synchronisation)."""
        self.count += 1
        return [float(x) for x in values.reshape(-1).tolist()]


@contextlib.contextmanager
def cuda_syncs() -> Iterator[list[str]]:
    """The synchronising CUDA calls made inside the block (torch.cuda.set_sync_debug_mode): a list of their messages,
    filled when the block ends. On a machine without CUDA the list stays empty."""
    found: list[str] = []
    if not torch.cuda.is_available():
        yield found
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    found += [str(w.message) for w in caught if "synchronizing" in str(w.message)]


@dataclass(frozen=True)
class Values:
    """A step's global values on the host."""

    loss: float  # mean training loss over micro-batches and data-parallel ranks, as computed
    grad_norm: float  # global gradient norm before clipping
    seen_loss: float  # the loss callbacks judged the step by (fault injection may scale it)
    z_loss: float | None = None  # the z-loss term added to the back-propagated loss (train.z_loss_coeff), not in loss


def global_losses(local: torch.Tensor) -> torch.Tensor:
    """Losses [k] of k steps, each this rank's mean over its micro-batches (zeros off the last pipeline stage), made
    global on every rank: mean over data-parallel ranks, shared along the pipeline. A collective call."""
    from megatron.core import parallel_state

    value = local.clone()
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        dp = parallel_state.get_data_parallel_world_size()
        if dp > 1:
            torch.distributed.all_reduce(value, group=parallel_state.get_data_parallel_group())
            value /= dp
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        # the last stage holds it: other stages contribute zeros to the sum
        torch.distributed.all_reduce(value, group=parallel_state.get_pipeline_model_parallel_group())
    return value


def read_global_losses(reads: HostReads, local: Sequence[torch.Tensor]) -> list[float]:
    """Local losses (0-d, see global_losses) made global and read on the host: one read. A collective call."""
    return reads.read(global_losses(torch.stack([x.reshape(()) for x in local])))


class StepLog:
    """The values of trained steps: on the device until a flush reads every pending step at once.

    Host values of the latest flush are kept (and the first step's); `subscribe(fn)` has `fn([(step, Values)])`
    called with what each flush read, in step order (a callback that judges every step without deciding anything
    before the update, e.g. the spike monitor in warn mode).
    """

    def __init__(self, reads: HostReads) -> None:
        self.reads = reads
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor | float, torch.Tensor | None]] = []
        self._known: dict[int, Values] = {}
        self._factors: dict[int, float] = {}  # step -> factor of the loss the callbacks saw
        self._subscribers: list[Callable[[list[tuple[int, Values]]], None]] = []
        self.first: tuple[int, Values] | None = None  # the first step read (the run summary's first loss)

    def add(
        self, step: int, local_loss: torch.Tensor, grad_norm: torch.Tensor | float, local_z: torch.Tensor | None = None
    ) -> None:
        """Record a step: `local_loss` a 0-d float64 tensor (see global_losses), `grad_norm` the global norm,
        `local_z` this rank's z-loss term like `local_loss` (None: no z-loss)."""
        self._pending.append((step, local_loss, grad_norm, local_z))

    def scale_seen_loss(self, step: int, factor: float) -> None:
        """The callbacks after this one judge `step` by its loss x `factor` (fault injection)."""
        self._factors[step] = self._factors.get(step, 1.0) * factor
        if step in self._known:
            v = self._known[step]
            self._known[step] = dataclasses.replace(v, seen_loss=v.seen_loss * factor)

    def subscribe(self, fn: Callable[[list[tuple[int, Values]]], None]) -> None:
        self._subscribers.append(fn)

    @property
    def pending(self) -> list[int]:
        return [step for step, *_ in self._pending]

    def flush(self) -> list[tuple[int, Values]]:
        """Read every pending step (collective; one host read, none if nothing is pending); the steps read."""
        if not self._pending:
            return []
        local = [loss.reshape(()) for _, loss, _, _ in self._pending]
        with_z = any(z is not None for *_, z in self._pending)
        if with_z:  # the z-loss terms go through the same reduction and the same read, after the losses
            local += [torch.zeros_like(local[0]) if z is None else z.reshape(()) for *_, z in self._pending]
        losses = global_losses(torch.stack(local))
        norms = torch.stack([_as_tensor(norm, losses) for _, _, norm, _ in self._pending])
        host = self.reads.read(torch.cat([losses, norms]))
        k = len(self._pending)
        zs, norm_at = (host[k : 2 * k], 2 * k) if with_z else ([None] * k, k)
        read = []
        for i, (step, *_) in enumerate(self._pending):
            factor = self._factors.pop(step, 1.0)
            read.append((step, Values(host[i], host[norm_at + i], host[i] * factor, zs[i])))
        self._pending.clear()
        self._known = dict(read)
        if self.first is None:
            self.first = read[0]
        for fn in self._subscribers:
            fn(read)
        return read

    def values(self, step: int) -> Values:
        """Step `step`'s values on the host (a flush if it is pending); steps before the latest flush are gone."""
        if step not in self._known:
            self.flush()
        if step not in self._known:
            raise KeyError(f"the values of step {step} were read and dropped (or the step was not trained)")
        return self._known[step]

    def last(self) -> tuple[int, Values] | None:
        """The latest step's values (a flush if anything is pending); None before any step."""
        self.flush()
        if not self._known:
            return None
        step = max(self._known)
        return step, self._known[step]

    def drop_after(self, step: int) -> None:
        """Forget steps after `step` (a restored checkpoint: they are not part of the run)."""
        self._pending = [p for p in self._pending if p[0] <= step]
        self._known = {s: v for s, v in self._known.items() if s <= step}
        self._factors = {s: f for s, f in self._factors.items() if s <= step}


def _as_tensor(norm: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    # megatron returns the norm as a device tensor [1] with Transformer Engine's kernels, a float without them
    if isinstance(norm, torch.Tensor):
        return norm.reshape(()).to(like.device, like.dtype)
    return torch.tensor(float(norm), dtype=like.dtype, device=like.device)


class StepValues:
    """One step's loss and gradient norm as callbacks see them: read on the host on first use (collective: every
    rank must ask at the same step), or given (`StepValues.of`)."""

    def __init__(self, log: StepLog | None, step: int, given: Values | None = None) -> None:
        self._log, self.step, self._given = log, step, given

    @classmethod
    def of(cls, loss: float, grad_norm: float) -> StepValues:
        """Values known on the host already (tests, replays)."""
        return cls(None, 0, Values(float(loss), float(grad_norm), float(loss)))

    def host(self) -> Values:
        if self._given is None:
            assert self._log is not None
            self._given = self._log.values(self.step)
        return self._given

    @property
    def loss(self) -> float:
        return self.host().loss

    @property
    def grad_norm(self) -> float:
        return self.host().grad_norm

    @property
    def seen_loss(self) -> float:
        return self.host().seen_loss

    @property
    def z_loss(self) -> float | None:
        """The step's z-loss term (global mean, like `loss`); None without train.z_loss_coeff."""
        return self.host().z_loss

    def scale_seen_loss(self, factor: float) -> None:
        """Callbacks after this call judge the step by its loss x `factor` (no read)."""
        if self._log is not None:
            self._log.scale_seen_loss(self.step, factor)
        if self._given is not None:
            v = self._given
            self._given = dataclasses.replace(v, seen_loss=v.seen_loss * factor)


def stacked(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """0-d tensors of one device as one 1-d tensor (the form HostReads.read takes)."""
    return torch.stack([v.reshape(()) for v in values])
