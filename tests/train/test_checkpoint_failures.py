"""The one line a failed checkpoint write gets: the OS error behind megatron's and torch DCP's wrappers, by rank."""

import errno

from torch.distributed.checkpoint.api import CheckpointException

from megagate.checkpoint import failures
from megagate.distributed.utils import host_name


def test_an_os_error_known_only_by_its_text_is_named():
    # what megatron's writer hands on from a worker: the text of the exception, in a RuntimeError
    worker = RuntimeError(
        "Worker failure: Local worker 0 encountered an error: [Errno 28] No space left on device: '/c'"
    )
    rank, error = failures.failing_rank_error(CheckpointException("write", {0: (worker, [])}))
    assert rank == 0 and error.errno == errno.ENOSPC and error.strerror == "No space left on device"
    assert failures.write_error(CheckpointException("write", {0: (worker, [])})) == (
        f"rank 0 ({host_name()}): No space left on device (ENOSPC)"
    )
    # another rank's text is not read here: that rank's own line (naming its host) replaces the generic one
    assert failures.write_error(CheckpointException("write", {3: (worker, [])})) == "a write failed on another rank"


def test_a_real_os_error_in_the_chain_wins_over_text():
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as cause:
            raise RuntimeError("[Errno 5] Input/output error") from cause
    except RuntimeError as exc:
        rank, error = failures.failing_rank_error(exc)
    assert rank == 0 and error.errno == errno.EDQUOT


def test_no_os_error_at_all_is_the_generic_line():
    assert failures.os_error_from_text("Worker failure: <class 'OSError'>") is None
    line = failures.write_error(CheckpointException("write", {1: (RuntimeError("<class 'OSError'>"), [])}))
    assert line == "a write failed on another rank"
