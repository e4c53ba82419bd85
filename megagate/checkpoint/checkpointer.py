"""`Checkpointer`: checkpoints with megatron's dist_checkpointing: model, optimizer, scheduler, data position, RNG, step.

Layout under the checkpoint root:

    iter_0000040/            a complete checkpoint (dist_checkpointing files + megagate.json + rng_<rank>.pt +
                             manifest.json, written last: every file's name, size and CRC-32)
    .iter_0000060.tmp/       a save in progress (or killed): never loaded, removed by the next save
    damaged/iter_0000020/    a checkpoint that failed verification or loading on resume, moved aside (never deleted)

A save writes everything into the temporary folder, hashes it (each rank a share of the files) into the manifest,
then rank 0 renames it to its final name, so a crash during a save never damages the last good checkpoint and
`latest()` only ever sees complete ones. Before writing, the free space is compared with the checkpoint's expected
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

import errno
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megagate.checkpoint import safe_files
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
from megagate.console import warn
from megagate.distributed import megatron_cpu
from megagate.distributed.utils import barrier, broadcast_object, gather_objects, get_rank, get_world_size
from megagate.errors import MegagateError
from megagate.files import publish_dir


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

    def __init__(self, root: str | os.PathLike, keep_last: int = 2, optimizer_format: str = "dp_reshardable"):
        self.root = Path(root)
        self.keep_last = keep_last
        self.optimizer_format = optimizer_format

    # --- save ------------------------------------------------------------------------------------------------------
    def _fail_if_any(self, error: str | None, tmp: Path) -> None:
        """Raise on every rank when any rank failed a step of the save; the temporary folder is removed."""
        error = first_reason(gather_objects(error))
        if error is None:
            return
        if get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        good = latest(self.root)
        kept = f"; the last good checkpoint {good} is unchanged" if good else ""
        raise MegagateError(f"cannot write checkpoint {tmp}: {error}{kept}")

    def save(self, step: int, model_chunks: list, optimizer: Any, meta: dict) -> Path:
        """Save a checkpoint for `step`; returns its final path. Every rank must call it."""
        from megatron.core import dist_checkpointing

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
                error = _os_message(exc)
        self._fail_if_any(error, tmp)
        optimizer_format = saved_optimizer_format(optimizer, self.optimizer_format)
        meta = {**meta, "optimizer_format": optimizer_format}  # what was written, not what was asked for
        state = sharded_state(model_chunks, optimizer, optimizer_format, is_loading=False)
        try:
            dist_checkpointing.save(state, str(tmp))
            torch.save(rng_state(), tmp / f"rng_{get_rank()}.pt")
        except Exception as exc:  # megatron and torch DCP wrap the OSError of a failed write
            cause = _os_error_in(exc)
            if cause is None:
                raise
            error = _os_message(cause)
        self._fail_if_any(error, tmp)
        if get_rank() == 0:
            try:
                (tmp / META).write_text(json.dumps({**meta, "step": step}, indent=1, default=str))
            except OSError as exc:
                error = _os_message(exc)
        self._fail_if_any(error, tmp)
        # the manifest: rank 0 lists the folder, each rank checksums a share, rank 0 writes it and renames
        names = broadcast_object(sorted(e.name for e in tmp.iterdir() if e.is_file()) if get_rank() == 0 else None)
        share: dict[str, dict[str, int]] = {}
        try:
            share = records(tmp, names[get_rank() :: get_world_size()])
        except OSError as exc:
            error = _os_message(exc)
        self._fail_if_any(error, tmp)
        shares = gather_objects(share)
        if get_rank() == 0:
            files = {name: record for part in shares for name, record in part.items()}
            manifest = {
                "step": step,
                "world_size": get_world_size(),
                "total_bytes": sum(r["size"] for r in files.values()),
                "files": dict(sorted(files.items())),
            }
            try:
                with open(tmp / MANIFEST, "w") as f:
                    json.dump(manifest, f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
                # a re-save of the same step (e.g. stop request right after an interval save) replaces it
                publish_dir(tmp, final)
            except OSError as exc:
                error = _os_message(exc)
        self._fail_if_any(error, tmp)
        if get_rank() == 0:
            self._prune()  # only after a successful save: the new checkpoint is complete
        barrier()
        return final

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
                except Exception as exc:  # damage the manifest cannot see (or a file megatron cannot parse)
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
                where = f"(not moved: {_os_message(exc)})"
        where = broadcast_object(where)
        warn(f"checkpoint {path} is damaged ({reason}); moved to {where}; {next_step}")
        return where


def _os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind an exception (its cause/context chain, or a torch DCP CheckpointException's failures)."""
    seen = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(f for f in failures.values() if isinstance(f, BaseException))
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None


def _os_message(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{text} ({name})" if name else text
