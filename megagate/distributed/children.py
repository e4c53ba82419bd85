"""The trainer's child processes: they ignore the stop signals (the trainer alone decides) and die with it.

Slurm delivers preemption, time-limit warnings and `scancel --signal=USR1 --full` to *every* process of a job
step, and a terminal's Ctrl-C goes to the whole process group. A child with the default dispositions dies of
them: megatron's checkpoint writer sends its results through a `multiprocessing.Manager` process
(`filesystem_async.get_write_results_queue`, created at the first save), so a SIGTERM/SIGUSR1 to the process
group killed that Manager and the stop checkpoint failed with a BrokenPipeError. And a SIGKILLed trainer left the
Manager (and its resource tracker) behind as orphans.

Here every child the trainer starts gets `child_init(parent_pid)`: SIG_IGN for SIGTERM/SIGUSR1/SIGINT, and
`prctl(PR_SET_PDEATHSIG, SIGKILL)`, so the kernel kills it when the trainer dies (even of SIGKILL).
A process forked from the trainer (megatron's background checkpoint writer) gets the same from a fork hook
(`install_fork_hook`). `install_checkpoint_writer_queue()` creates megatron's results queue before the first save, from a Manager started
with that initializer, with the stop signals blocked while it starts (a blocked mask is inherited through
fork+exec, so no signal can land between the exec and the initializer; the resource tracker, an exec'd program
that ignores SIGINT/SIGTERM itself, keeps SIGUSR1 blocked for its life and exits when its pipe closes, i.e. when
the trainer and the Manager are gone).

megatron-core 0.19's synchronous save writes with threads (`write_preloaded_data_multithread`); the Manager is the
only process of a save, so the save itself needs no signal blocking: the trainer's handlers only set a flag.

Nothing here (nor in megagate.distributed.utils, whose `die_with_parent` this uses) imports torch or megatron at
module level: a spawned child imports this module to run its initializer.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

from megagate.distributed.utils import die_with_parent

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_manager: Any = None  # the SyncManager behind megatron's results queue (kept alive for the run)
_fork_hook = False


def child_init(parent_pid: int) -> None:
    """Initializer of every trainer child: ignore the stop signals, then die with the parent (`parent_pid`)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # a child started inside blocked_stop_signals() inherited the block: ignored now, so unblocking drops them
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    die_with_parent(parent_pid)


def worker_init(parent_pid: int, worker_id: int) -> None:
    """`torch.utils.data.DataLoader` worker_init_fn (bind the parent: `functools.partial(worker_init, pid)`)."""
    child_init(parent_pid)


@contextlib.contextmanager
def blocked_stop_signals() -> Iterator[None]:
    """Block the stop signals in this thread (children started meanwhile inherit the block); restore after.

    A signal that arrives meanwhile stays pending and reaches the trainer's handler when the block ends.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def install_fork_hook() -> None:
    """Every process forked from this one from now on (a background checkpoint writer: megatron forks one per
    asynchronous save) ignores the stop signals and dies with this process. Once per process."""
    global _fork_hook
    if _fork_hook:
        return
    parent = os.getpid()
    os.register_at_fork(after_in_child=lambda: child_init(parent))
    _fork_hook = True


def install_checkpoint_writer_queue() -> None:
    """Create megatron's checkpoint-writer results queue from a Manager that ignores the stop signals and dies
    with this process, and set it as megatron's module global (once per process; megatron then reuses it)."""
    global _manager
    import multiprocessing
    from multiprocessing import resource_tracker
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    with blocked_stop_signals():
        # ensure_running() unblocks SIGINT/SIGTERM on its way out (its own block/unblock), so the Manager is
        # started under a fresh block below
        resource_tracker.ensure_running()
    with blocked_stop_signals():
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))  # megatron's own context
        manager.start(initializer=child_init, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
    _manager = manager


def shutdown() -> None:
    """Stop the Manager (at the end of a run; at interpreter exit multiprocessing would do it too)."""
    global _manager
    if _manager is None:
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = None
    manager, _manager = _manager, None
    with contextlib.suppress(Exception):
        manager.shutdown()
