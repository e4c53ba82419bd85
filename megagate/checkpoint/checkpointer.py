"""`Checkpointer`: checkpoints with megatron's dist_checkpointing: model, optimizer, scheduler, data position, RNG, step.

Layout under the checkpoint root:

    iter_0000040/            a complete checkpoint (dist_checkpointing files + megagate.json + rng_<rank>.pt +
                             manifest.json, written last: every file's name, size and CRC-32)
    .iter_0000060.tmp/       a save in progress (or killed): never loaded, removed by the next save
    damaged/iter_0000020/    a checkpoint that failed verification or loading on resume, moved aside (never deleted)

A save writes everything into the temporary folder (each rank's writer checksums the files it wrote), then rank 0
writes the manifest and renames the folder to its final name, so a crash during a save never damages the last good
checkpoint and `latest()` only ever sees complete ones. With `background=True` the shards are written by a forked
process while training goes on (megagate.checkpoint.background) and the manifest, the rename and keep_last come at
finalisation (`poll()` once per step, `wait()`); a write that fails on one rank names that rank and its host. Before writing, the free space is compared with the checkpoint's expected
size; a failed write (no space, no permission) removes the temporary folder and is one line. On resume
(`Checkpointer.resume`) every candidate, newest first, is first checked to hold data only (`safe_files`: a crafted
pickle is refused), then verified against its manifest and loaded; a damaged one is moved aside with a one-line
warning and the next newest is tried. The model is saved through megatron's sharded state dicts and the optimizer in
the format `checkpoint.optimizer_format` names (`saved_optimizer_format`): `dp_reshardable` by default, where every
rank writes its own shard of megatron's DistributedOptimizer buffers with no communication (a resume may change the
data-parallel size only), or `fully_reshardable`, which gathers the data-parallel group's optimizer state onto one rank
per save (about 37 GB of host memory per rank for 15A2B on 64 GPUs) and allows any TP/PP/EP change on resume.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megagate.checkpoint import failures, safe_files, writer
from megagate.checkpoint.background import BackgroundWrites
from megagate.checkpoint.manifest import MANIFEST, damage, first_reason, records
from megagate.checkpoint.naming import (
    DAMAGED,
    META,
    checkpoint_dirs,
    checkpoint_name,
    complete_checkpoints,
    latest,
    read_meta,
)
from megagate.checkpoint.rng import rng_state, set_rng_state
from megagate.checkpoint.space import check_free_space
from megagate.checkpoint.state import materialize_optimizer_state, saved_optimizer_format, sharded_state
from megagate.console import log, warn
from megagate.distributed import megatron_cpu
from megagate.distributed.utils import barrier, broadcast_object, gather_objects, get_rank, get_world_size, host_name
from megagate.errors import MegagateError
from megagate.files import publish_dir
from megagate.health import progress
from megagate.monitor import process_faults

_RANK0_FILES = (".metadata", "metadata.json", "common.pt", META)


@dataclass(frozen=True)
class _Pending:
    """A save whose shards are being written: finalised into `final` once every rank's writer is done."""

    step: int
    tmp: Path
    final: Path
    wrote: bool  # this rank had shards to write
    started: float
    background: bool


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a resume loaded: its path, metadata, and whether the parallel layout was the saved one."""

    path: Path
    meta: dict
    same_layout: bool


class Checkpointer:
    """Atomic, verified save / verified newest-good resume / keep-last-K for one run's checkpoint root.

    Every method is collective in a distributed run: every rank must call it.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        keep_last: int = 2,
        optimizer_format: str = "dp_reshardable",
        *,
        check_interval: int = 10,
        on_saved: Callable[[Path, int], None] | None = None,
    ):
        self.root = Path(root)
        self.keep_last = keep_last
        self.optimizer_format = optimizer_format
        self.on_saved = on_saved  # called on every rank when a checkpoint is complete (path, step)
        self._background = BackgroundWrites(check_interval)
        self._pending: _Pending | None = None

    @property
    def pending(self) -> bool:
        """A background save is being written (not yet a checkpoint)."""
        return self._pending is not None

    # --- save ------------------------------------------------------------------------------------------------------
    def _fail_if_any(self, error: str | None, tmp: Path) -> None:
        """Raise on every rank when any rank failed a step of the save; the temporary folder is removed. The reason
        that names a rank (its writer's own record) wins over the others' ("a write failed elsewhere")."""
        reasons = [r for r in gather_objects(error) if r]
        if not reasons:
            return
        error = next((r for r in reasons if r.startswith("rank ")), reasons[0])
        if get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        good = latest(self.root)
        kept = f"; the last good checkpoint {good} is unchanged" if good else ""
        raise MegagateError(f"cannot write checkpoint {tmp}: {error}{kept}")

    def save(self, step: int, model_chunks: list, optimizer: Any, meta: dict, background: bool = False) -> Path:
        """Save a checkpoint for `step`; returns its final path. Every rank must call it.

        `background`: the shards are written by a forked process while training goes on; the checkpoint is complete
        (manifest, rename, keep_last) when `poll()` or `wait()` finalises it. A pending save is finalised first.
        """
        self.wait()
        final = self.root / checkpoint_name(step)
        tmp = self.root / f".{checkpoint_name(step)}.tmp"
        check_free_space(self.root, final, model_chunks, optimizer)
        error = None
        if get_rank() == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                for stale in self.root.glob(".iter_*.tmp"):
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir()
            except OSError as exc:
                error = failures.os_message(exc)
        self._fail_if_any(error, tmp)
        optimizer_format = saved_optimizer_format(optimizer, self.optimizer_format)
        meta = {**meta, "optimizer_format": optimizer_format}  # what was written, not what was asked for
        state = sharded_state(model_chunks, optimizer, optimizer_format, is_loading=False)
        request = None
        try:
            request = writer.prepare(state, tmp, step)
            torch.save(rng_state(), tmp / f"rng_{get_rank()}.pt")
            if get_rank() == 0:
                (tmp / META).write_text(json.dumps({**meta, "step": step}, indent=1, default=str))
        except failures.FAILURES as exc:  # megatron and torch DCP wrap the OSError of a failed write
            error = failures.write_error(exc)
        self._fail_if_any(error, tmp)
        pending = _Pending(step, tmp, final, request.async_fn is not None, time.monotonic(), background)
        if background:
            self._background.start(request)
            self._pending = pending
            log(f"saving checkpoint {final} in the background")
            return final
        try:
            writer.run_now(request)
        except failures.FAILURES as exc:  # a rank's write failed: megatron raises on every rank after its own barrier
            error = failures.write_error(exc)
        self._finalize(pending, error)
        return final

    def poll(self) -> None:
        """Once per step on every rank: finalise a background save once every rank's writer has finished (the
        ranks compare notes every `check_interval` steps only). A no-op without a pending save."""
        if self._pending is not None and self._background.due():
            self._finish_pending()

    def wait(self) -> None:
        """Finalise a pending background save now, waiting for its writers (collective)."""
        if self._pending is not None:
            self._finish_pending()

    def abort(self) -> None:
        """Kill a pending background writer without a collective (the run is failing): the previous checkpoint
        stays the newest complete one."""
        self._background.abort()
        self._pending = None

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        error = None
        with progress.within("save"):  # the watchdog's save limit covers waiting for a writer
            try:
                self._background.finish()
            except failures.FAILURES as exc:  # a rank's write failed: megatron raises on every rank
                error = failures.write_error(exc)
            self._finalize(pending, error)

    def _finalize(self, pending: _Pending, error: str | None) -> None:
        """The manifest (each rank's writer checksummed its own files; rank 0 the small ones), the rename and
        keep_last, once every rank's shards are written (collective)."""
        tmp, rank = pending.tmp, get_rank()
        error = writer.own_error(tmp, rank) or error
        self._fail_if_any(error, tmp)
        share: dict[str, dict[str, int]] = {}
        try:
            share = writer.own_records(tmp, rank, pending.wrote)
            share.update(records(tmp, [f"rng_{rank}.pt"]))
            if rank == 0:  # megatron's metadata (written at its finalisation) and megagate's
                share.update(records(tmp, [n for n in _RANK0_FILES if (tmp / n).is_file()]))
        except (OSError, ValueError) as exc:
            error = f"rank {rank} ({host_name()}): cannot checksum its files: {exc}"
        self._fail_if_any(error, tmp)
        shares = gather_objects(share)
        if rank == 0:
            files = {name: record for part in shares for name, record in part.items()}
            manifest = {
                "step": pending.step,
                "world_size": get_world_size(),
                "total_bytes": sum(r["size"] for r in files.values()),
                "files": dict(sorted(files.items())),
            }
            try:
                writer.remove_own_files(tmp)
                with open(tmp / MANIFEST, "w") as f:
                    json.dump(manifest, f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
                # a re-save of the same step (e.g. stop request right after an interval save) replaces it
                publish_dir(tmp, pending.final)
            except OSError as exc:
                error = failures.os_message(exc)
        self._fail_if_any(error, tmp)
        if rank == 0:
            self._prune()  # only after a successful save: the new checkpoint is complete
        barrier()
        seconds = time.monotonic() - pending.started
        progress.PROGRESS.record("save", seconds)  # sizes the watchdog's save limit
        how = f"written in the background in {seconds:.1f} s" if pending.background else f"{seconds:.1f} s"
        log(f"saved checkpoint {pending.final} ({how})")
        if self.on_saved is not None:
            self.on_saved(pending.final, pending.step)

    def _prune(self) -> None:
        for _, path in complete_checkpoints(self.root)[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)

    # --- load ------------------------------------------------------------------------------------------------------
    def load(self, path: Path, model_chunks: list, optimizer: Any, same_layout: bool, strict: bool = False) -> dict:
        """Load model (and optimizer) state from `path`; RNG only if the parallel layout is unchanged; `strict`: a
        tensor of the checkpoint that the chunks do not ask for is an error (they hold the whole model).

        No verification here (see `resume`): a rollback loads a checkpoint this run has just written.
        """
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.validation import StrictHandling

        meta = read_meta(path)
        if optimizer is not None:
            materialize_optimizer_state(optimizer)
        # checkpoints from before the format was recorded were all written fully_reshardable (the old default)
        state = sharded_state(model_chunks, optimizer, meta.get("optimizer_format", "fully_reshardable"), True)
        handling = StrictHandling.RAISE_UNEXPECTED if strict else StrictHandling.ASSUME_OK_UNEXPECTED  # megatron's
        process_faults.checkpoint_io("read", int(meta.get("step", 0)), path)
        loaded = dist_checkpointing.load(state, str(path), strict=handling)
        for i, chunk in enumerate(model_chunks):
            chunk.load_state_dict(loaded["model" if len(model_chunks) == 1 else f"model{i}"])
        if optimizer is not None:
            # fp32 main parameters are views of the model parameters: copy into them without autograd
            with torch.no_grad():
                optimizer.load_state_dict(loaded["optimizer"])
            megatron_cpu.unshare_adam_steps(optimizer)
        rng_file = path / f"rng_{get_rank()}.pt"
        if same_layout:
            # data only (tensors, ints, tuples): a crafted file cannot run code here
            set_rng_state(safe_files.load_torch_data(rng_file, rng_file))
        return meta

    def load_weights(
        self, source: str | os.PathLike, model_chunks: list, check: Callable[[Path, dict], None] | None = None
    ) -> tuple[Path, dict]:
        """Another run's model weights into `model_chunks` (a fresh start from them: no optimizer, schedule, data
        position or RNG); (the checkpoint loaded, its metadata).

        `source`: a checkpoint (iter_NNNNNNN), a checkpoint root or a run folder (its newest complete checkpoint).
        It is scanned and verified first, like a resume, but never moved: it is not this run's to change; then
        `check(path, meta)` (e.g. that the architecture matches) before anything is loaded.
        """
        path = Path(source)
        for root in (path, path / "checkpoints"):
            newest = latest(root)
            if newest is not None:
                path = newest
                break
        if not (path / MANIFEST).is_file():
            raise MegagateError(
                f"checkpoint.init_from={str(source)!r} is not a complete checkpoint (iter_NNNNNNN with a "
                f"{MANIFEST}), nor a checkpoint root or run folder holding one"
            )
        reason = damage(path)
        if reason is not None:
            raise MegagateError(f"checkpoint.init_from: {path} is damaged ({reason})")
        if check is not None:
            check(path, read_meta(path))
        meta = self.load(path, model_chunks, None, same_layout=False)
        return path, meta

    def resume(
        self,
        model_chunks: list,
        optimizer: Any,
        layout: dict,
        *,
        check: Callable[[Path, dict], None] | None = None,
        load: Callable[[Path, bool], dict] | None = None,
    ) -> Resumed | None:
        """Load the newest good checkpoint under the root; None when there is none at all.

        Newest first, each candidate is checked for pickled code (a crafted file raises UnsafeFileError: refused,
        not skipped), verified against its manifest, passed to `check(path, meta)` (a config that cannot resume
        from it raises, and is the user's to fix: no fallback), and loaded (`load(path, same_layout)`, default
        `self.load` into model_chunks/optimizer). A checkpoint that fails verification or whose load raises is
        moved to <root>/damaged/ with a one-line warning, and the next newest is tried. When every one is damaged,
        a one-line MegagateError.
        """
        candidates = broadcast_object(
            [str(p) for _, p in reversed(checkpoint_dirs(self.root))] if get_rank() == 0 else None
        )
        if not candidates:
            return None
        moved: list[str] = []
        for i, name in enumerate(candidates):
            path = Path(name)
            reason = damage(path)  # pickled code refused (raises); the manifest names damage most precisely
            meta: dict = {}
            if reason is None:
                try:
                    meta = read_meta(path)
                except MegagateError as exc:
                    reason = str(exc)
                reason = first_reason(gather_objects(reason))
            if reason is None:
                if check is not None:
                    check(path, meta)  # a config that cannot resume from it: the user's error, no fallback
                same_layout = meta.get("layout") == layout
                try:
                    if load is not None:
                        load(path, same_layout)
                    else:
                        self.load(path, model_chunks, optimizer, same_layout)
                except failures.FAILURES as exc:  # damage the manifest cannot see (or a file megatron cannot parse)
                    failed = failures.failing_rank_error(exc)
                    if failed is not None:
                        # the file system failed a rank (an I/O error, a lost mount), not the checkpoint: say so now,
                        # without a collective (the others may be inside megatron's load, waiting for this rank:
                        # they leave when they see its failure, megagate.health), and move nothing aside
                        rank, cause = failed
                        who = f"rank {rank} ({host_name()})" if rank == get_rank() else f"rank {rank}"
                        raise MegagateError(
                            f"{who} cannot read checkpoint {path}: {failures.os_message(cause)}"
                            + (f": {cause.filename!r}" if cause.filename else "")
                        ) from None
                    first_line = (str(exc).strip().splitlines() or [""])[0][:200]
                    reason = f"loading it failed: {type(exc).__name__}: {first_line}"
                reason = first_reason(gather_objects(reason))
                if reason is None:
                    return Resumed(path, meta, same_layout)
            nxt = f"trying {Path(candidates[i + 1]).name}" if i + 1 < len(candidates) else "no older checkpoint"
            moved.append(self._move_aside(path, reason, nxt))
        raise MegagateError(
            f"no loadable checkpoint in {self.root}: {len(moved)} damaged checkpoint(s) moved to "
            f"{self.root / DAMAGED} ({', '.join(Path(m).name for m in moved)}); rerun to start from scratch, or "
            "restore a good checkpoint there"
        )

    def _move_aside(self, path: Path, reason: str, next_step: str) -> str:
        """Move a damaged checkpoint into <root>/damaged/ (never delete it); warn in one line. Returns where."""
        where = None
        if get_rank() == 0:
            target_dir = self.root / DAMAGED
            target = target_dir / path.name
            n = 1
            while target.exists():
                n += 1
                target = target_dir / f"{path.name}.{n}"
            try:
                target_dir.mkdir(exist_ok=True)
                os.replace(path, target)
                where = str(target)
            except OSError as exc:
                where = f"(not moved: {failures.os_message(exc)})"
        where = broadcast_object(where)
        warn(f"checkpoint {path} is damaged ({reason}); moved to {where}; {next_step}")
        return where
