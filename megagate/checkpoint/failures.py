"""Why a checkpoint write or read failed, in one line: the operating-system error behind an exception, and the rank
it happened on (this one, or the one a torch DCP CheckpointException names: DCP raises on every rank when one
failed, with the failures gathered by rank)."""

from __future__ import annotations

import errno
import re

from torch.distributed.checkpoint.api import CheckpointException

from megagate.distributed.utils import get_rank, host_name

# what a failed save or load raises: torch DCP's CheckpointException derives from BaseException, not Exception
FAILURES = (Exception, CheckpointException)


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind an exception (its cause/context chain, or a torch DCP CheckpointException's failures)."""
    found = failing_rank_error(exc)
    return None if found is None else found[1]


def failing_rank_error(exc: BaseException) -> tuple[int, OSError] | None:
    """(the rank it happened on, the OSError) behind an exception: this rank's own, or one of the failures a torch
    DCP CheckpointException gathered from the ranks ({rank: (exception, traceback)})."""
    seen = set()
    todo: list[tuple[int, BaseException]] = [(get_rank(), exc)]
    from_text: tuple[int, OSError] | None = None
    while todo:
        rank, e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return rank, e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for r, f in failures.items():
                f = f[0] if isinstance(f, tuple) and f else f
                if isinstance(f, BaseException):
                    todo.append((int(r), f))
        elif from_text is None and rank == get_rank():  # this rank's own only: another rank's failure is named by
            text_error = os_error_from_text(str(e))  # that rank's line (with its host), which replaces ours
            from_text = None if text_error is None else (rank, text_error)
        todo.extend((rank, x) for x in (e.__cause__, e.__context__) if x is not None)
    return from_text


# an OS error that reached us as text only (an exception pickled from a writer process, or megatron's writer log)
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^:'\"\]]+)")


def os_error_from_text(text: str) -> OSError | None:
    """The OSError an exception's text names ("[Errno 28] No space left on device: ..."), None if it names none."""
    found = _ERRNO_TEXT.search(text)
    return None if found is None else OSError(int(found[1]), found[2].strip())


def write_error(exc: BaseException) -> str:
    """One line for a failed write: the OS error behind it, naming the rank (and its host when it is this one), or,
    when the failure was another rank's and says no more (megatron raises on every rank), a generic line that the
    failing rank's own replaces."""
    failed = failing_rank_error(exc)
    if failed is not None:
        rank, cause = failed
        return (
            f"rank {rank} ({host_name()}): {os_message(cause)}"
            if rank == get_rank()
            else f"rank {rank}: {os_message(cause)}"
        )
    if isinstance(exc, CheckpointException):
        return "a write failed on another rank"
    raise exc


def os_message(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{text} ({name})" if name else text
