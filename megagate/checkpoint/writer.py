"""Writing a checkpoint's shards: megatron's dist_checkpointing save as an AsyncRequest, run now or in the background.

`prepare` plans the save with megatron (`dist_checkpointing.save(..., async_sharded_save=True)`: collective, every
rank) and wraps the request's write function, which runs on this rank now (`run_now`) or in the process megatron's
AsyncCallsQueue forks for it (megagate.checkpoint.background). Around megatron's writer, on each rank:

- the cluster faults' injection point (megagate.monitor.process_faults: a failed or hung write on one rank);
- the CRC-32 and size of every file the rank wrote, into `.crc-rankNNNNN.json` (the manifest's records: a
  background save checksums in the background too, while the data is still in the page cache);
- a failure (an exception, or megatron's writer reporting one) into `.error-rankNNNNN.txt`: one line naming the
  rank, its host and the error, which the finalisation raises on every rank;
- megatron's writer hands its results to the main process through a queue; exactly one item goes there per write.

The files written here carry a leading dot and are removed before the folder is published.
"""

from __future__ import annotations

import errno
import json
import logging
import queue
from functools import partial
from pathlib import Path
from typing import Any

from megagate.checkpoint.failures import os_error_from_text
from megagate.checkpoint.manifest import records
from megagate.distributed.utils import host_name
from megagate.monitor import process_faults

CRC_FILE = ".crc-rank{:05d}.json"
ERROR_FILE = ".error-rank{:05d}.txt"
MEGATRON_WRITER_LOG = "megatron.core.dist_checkpointing.strategies.filesystem_async"


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, "")
        return f"{exc.strerror or exc} ({name})" if name else str(exc.strerror or exc)
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def _write(fn: Any, tmp: str, step: int, rank: int, write_buckets: list, results_queue: Any) -> None:
    """The wrapped writer: fault point, megatron's write, checksums; any failure recorded (one queue item always)."""
    folder = Path(tmp)
    local: queue.Queue = queue.Queue()
    logged = _WorkerErrors()
    megatron_log = logging.getLogger(MEGATRON_WRITER_LOG)
    megatron_log.addHandler(logged)
    try:
        process_faults.checkpoint_io("write", step, folder)
        fn(rank, write_buckets, local)  # megatron's writer: puts its results (or an exception) into the queue
        result = local.get_nowait()
        if isinstance(result, BaseException):
            # megatron's writer keeps only the text of its worker's exception (it then fails an assertion on the
            # exception's type): the OS error behind it, from that text, names what went wrong
            raise next(filter(None, map(os_error_from_text, logged.texts)), result)
        names = [bucket[1] for bucket in write_buckets]  # (full path, file name, data) per file
        (folder / CRC_FILE.format(rank)).write_text(json.dumps(records(folder, names)))
    except Exception as exc:  # noqa: BLE001 - reported through the error file and megatron's results
        try:
            (folder / ERROR_FILE.format(rank)).write_text(f"rank {rank} ({host_name()}): {_one_line(exc)}")
        except OSError:
            pass
        result = exc
    finally:
        megatron_log.removeHandler(logged)
    results_queue.put(result)


class _WorkerErrors(logging.Handler):
    """The error lines megatron's checkpoint writer logs while one write runs."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(record.getMessage())


def prepare(state: dict, tmp: Path, step: int) -> Any:
    """megatron's AsyncRequest for writing `state` into `tmp`, its writer wrapped (collective: every rank)."""
    from megatron.core import dist_checkpointing

    request = dist_checkpointing.save(state, str(tmp), async_sharded_save=True, async_strategy="mcore")
    if request.async_fn is None:  # nothing to write on this rank
        return request
    return request._replace(async_fn=partial(_write, request.async_fn, str(tmp), step))


def run_now(request: Any) -> None:
    """Write here and now, then megatron's finalisation (a barrier, the metadata; collective)."""
    request.execute_sync()


def own_error(tmp: Path, rank: int) -> str | None:
    """This rank's write failure, as its writer recorded it (None: it wrote everything)."""
    path = tmp / ERROR_FILE.format(rank)
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def own_records(tmp: Path, rank: int, wrote: bool) -> dict:
    """The manifest records of the files this rank's writer wrote (`wrote`: it had something to write)."""
    if not wrote:
        return {}
    return json.loads((tmp / CRC_FILE.format(rank)).read_text())


def remove_own_files(tmp: Path) -> None:
    """The writers' bookkeeping files, before the folder is published."""
    for entry in tmp.iterdir():
        if entry.name.startswith((".crc-rank", ".error-rank")):
            entry.unlink(missing_ok=True)
