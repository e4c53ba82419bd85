"""Background checkpoint writes: megatron's AsyncCallsQueue, and when the ranks agree that a write is done.

megatron forks a process per save (TemporalAsyncCaller): the child gets a copy-on-write snapshot of this process's
memory as it is at the fork (on GPU, megatron first copies the shards to host memory), so the step loop changes the
weights at once while the child writes the state of the saved step. megagate's fork hook
(megagate.distributed.children) makes the child ignore the stop signals and die with its parent.

Finalising a save is collective (megatron gathers the write results, writes the metadata, barriers; then the
manifest and the rename), so every rank must do it at the same step. Every `check_interval` steps while a write is
pending, the ranks tell each other whether their child finished: one integer all-reduce on a CPU (gloo) group — no
device synchronisation, and none at all while nothing is pending. `wait()` finalises now, whatever the cost.
"""

from __future__ import annotations

from typing import Any

import torch

from megagate.distributed.utils import get_world_size


class BackgroundWrites:
    """At most one pending background write (a new save waits for the previous one first)."""

    def __init__(self, check_interval: int) -> None:
        self.check_interval = check_interval
        self._queue: Any = None
        self._group: Any = None  # a gloo group for the check when the default one is NCCL
        self._since_check = 0

    @property
    def pending(self) -> bool:
        return self._queue is not None and self._queue.get_num_unfinalized_calls() > 0

    def start(self, request: Any) -> None:
        """Hand `request` to a forked writer (collective: every rank, even one with nothing to write)."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        if self._queue is None:
            self._queue = AsyncCallsQueue(persistent=False)
            if torch.distributed.is_initialized() and torch.distributed.get_backend() != "gloo":
                self._group = torch.distributed.new_group(backend="gloo")
        self._queue.schedule_async_request(request)
        self._since_check = 0

    def _done_here(self) -> bool:
        caller = self._queue.async_calls[0].async_caller
        return caller.is_current_async_call_done(blocking=False, no_dist=True)

    def due(self) -> bool:
        """True every `check_interval` calls while a write is pending, when every rank's writer has finished
        (collective on those calls: every rank calls due() once per step)."""
        if not self.pending:
            return False
        self._since_check += 1
        if self._since_check < self.check_interval:
            return False
        self._since_check = 0
        busy = torch.tensor([0 if self._done_here() else 1], dtype=torch.int32)
        if get_world_size() > 1:
            torch.distributed.all_reduce(busy, op=torch.distributed.ReduceOp.MAX, group=self._group)
        return int(busy.item()) == 0

    def finish(self) -> None:
        """Wait for the writer and run megatron's finalisation (collective). Raises what megatron raises when a
        rank's write failed (CheckpointException, on every rank)."""
        self._queue.maybe_finalize_async_calls(blocking=True, no_dist=True)

    def abort(self) -> None:
        """Kill a pending writer (no collective): its temporary folder stays, never loaded, removed by the next save."""
        if self._queue is not None:
            for call in self._queue.async_calls:
                call.async_caller.close(abort=True)  # SIGKILL; AsyncCallsQueue.close(abort) only stops a persistent one
        self._queue = None
