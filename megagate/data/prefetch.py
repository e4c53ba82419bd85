"""The next step's micro-batches, read in a background thread while the current step computes.

    prefetch = StepPrefetcher(open_loader, count=4, step_samples=16)
    batches = prefetch.take(position, prefetch_next=True)   # this step's batches; the next step's are being read

`open_loader(position)` gives an iterator of micro-batches starting at global sample `position`; one step reads
`count` of them and moves the position by `step_samples`. Reads happen in loader order on one thread, so a step gets
exactly the batches a synchronous loop would read (the data order, and the losses, are unchanged). A `take` at
another position than the one read ahead (a seek, a restored checkpoint) waits for that read, drops it and opens
the loader at the new position. With CUDA the batches are put in pinned memory, so their copies to the GPU
(`non_blocking=True`) do not wait for the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megagate.errors import MegagateError


class StepPrefetcher:
    """Reads a step's micro-batches one step ahead (see module docstring)."""

    def __init__(
        self, open_loader: Callable[[int], Iterator[dict]], count: int, step_samples: int, pin: bool | None = None
    ) -> None:
        self.open_loader, self.count, self.step_samples = open_loader, count, step_samples
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._iter: Iterator[dict] | None = None
        self._position = -1  # where self._iter reads next
        self._ahead: tuple[int, Future] | None = None  # (position, read) started for the next step
        self._pool: ThreadPoolExecutor | None = None

    def take(self, position: int, prefetch_next: bool) -> list[dict]:
        """The `count` micro-batches at global sample `position`; with `prefetch_next`, start reading the next
        step's in the background."""
        batches = None
        if self._ahead is not None:
            ahead, read = self._ahead
            self._ahead = None
            if ahead == position:
                batches = read.result()  # a loader error surfaces here, where the step needs the data
            else:
                self._drop(read)
        if batches is None:
            if self._iter is None or self._position != position:
                self._iter, self._position = self.open_loader(position), position
            batches = self._read()
        if prefetch_next:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megagate-prefetch")
            position = self._position  # read before the thread moves it
            self._ahead = (position, self._pool.submit(self._read))
        return batches

    def _read(self) -> list[dict]:
        assert self._iter is not None
        try:
            batches = [next(self._iter) for _ in range(self.count)]
        except StopIteration:
            self._iter = None
            raise MegagateError(
                f"the training data ended within the step starting at sample {self._position} "
                f"({self.count} micro-batches per step)"
            ) from None
        except BaseException:
            self._iter = None  # part of a step was read: the iterator's position is unknown
            raise
        if self.pin:  # host tensors only: a loader may hand out device tensors already (DALI on a GPU)
            batches = [{k: v.pin_memory() if v.device.type == "cpu" else v for k, v in b.items()} for b in batches]
        self._position += self.step_samples
        return batches

    def _drop(self, read: Future) -> None:
        try:
            read.result()
        except Exception:  # noqa: BLE001 - batches nobody asked for; the loader is reopened
            self._iter = None

    def settle(self) -> None:
        """Wait for the read in flight (before something else reads the same dataset on this thread)."""
        if self._ahead is not None:
            self._ahead[1].exception()

    def reset(self) -> None:
        """Forget the loader and what was read ahead (a checkpoint was loaded)."""
        if self._ahead is not None:
            self._drop(self._ahead[1])
            self._ahead = None
        self._iter, self._position = None, -1

    def close(self) -> None:
        """Stop the thread (after the read in flight)."""
        self.reset()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
