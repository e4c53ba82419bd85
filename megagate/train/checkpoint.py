"""Checkpoints with megatron's dist_checkpointing: model, optimizer, scheduler, data position, RNG, step.

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
import random
import re
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megagate.console import warn
from megagate.distributed import megatron_cpu
from megagate.distributed.utils import (
    barrier,
    broadcast_object,
    gather_objects,
    get_rank,
    get_world_size,
    is_distributed,
)
from megagate.errors import MegagateError
from megagate.files import publish_dir
from megagate.train import safe_files

_NAME = re.compile(r"^iter_(\d{7})$")
META = "megagate.json"
MANIFEST = "manifest.json"  # written last into the temporary folder: its presence makes a checkpoint complete
DAMAGED = "damaged"  # <root>/damaged/: checkpoints moved aside on resume
_BLOCK = 4 << 20  # CRC-32 read size
SPACE_MARGIN, SPACE_SLACK = 1.05, 1 << 20  # a save needs estimate * margin + slack bytes free
_LOADER_READS = (".distcp", ".metadata", ".pt")  # files megatron or torch read on load: never unlisted


def checkpoint_name(step: int) -> str:
    return f"iter_{step:07d}"


def complete_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint (one with a manifest) under root, oldest first."""
    return [(step, path) for step, path in _iter_dirs(root) if (path / MANIFEST).is_file()]


def _iter_dirs(root: str | os.PathLike) -> list[tuple[int, Path]]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under root, or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def resolve(source: str | os.PathLike) -> Path:
    """The checkpoint a user names: an iter_NNNNNNN folder as given, or the newest complete one of a checkpoint root
    or of a run folder (its checkpoints/). Whether the result is a checkpoint is the caller's check."""
    path = Path(source)
    if not path.is_dir():
        raise MegagateError(f"checkpoint {str(path)!r} is not a directory")
    for root in (path, path / "checkpoints"):
        newest = latest(root)  # None for a folder that is not there
        if newest is not None:
            return newest
    return path


def read_meta(path: str | os.PathLike) -> dict:
    """The megagate metadata of a checkpoint (step, consumed samples, scheduler, layout, config, ...)."""
    meta = Path(path) / META
    try:
        data = json.loads(meta.read_text())
    except (OSError, ValueError) as exc:
        raise MegagateError(f"checkpoint {str(path)!r} has no readable {META}: {exc}") from None
    if not isinstance(data, dict):
        raise MegagateError(f"checkpoint {str(path)!r}: {META} is not a JSON object")
    return data


def _first(reasons: list[str | None]) -> str | None:
    return next((r for r in reasons if r), None)


# --- manifest ----------------------------------------------------------------------------------------------------
def crc32(path: str | os.PathLike) -> int:
    """zlib CRC-32 of a file, read in 4 MiB blocks."""
    value = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            value = zlib.crc32(block, value)
    return value


def _records(folder: Path, names: list[str]) -> dict[str, dict[str, int]]:
    return {name: {"size": (folder / name).stat().st_size, "crc32": crc32(folder / name)} for name in names}


def read_manifest(path: str | os.PathLike) -> dict:
    """A checkpoint's manifest: {"files": {name: {"size", "crc32"}}, "world_size", "total_bytes", ...}."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
        files = manifest["files"]
        if not isinstance(files, dict) or not all(
            isinstance(r, dict) and isinstance(r.get("size"), int) and isinstance(r.get("crc32"), int)
            for r in files.values()
        ):
            raise ValueError("bad file records")
        int(manifest["world_size"])
    except FileNotFoundError:
        raise MegagateError(f"{MANIFEST}: missing (an unfinished save, or written by an older megagate)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MegagateError(f"{MANIFEST}: unreadable ({type(exc).__name__}: {exc})") from None
    return manifest


def _required(world_size: int) -> list[str]:
    # `common.pt` is not among them: megatron-core 0.19 keeps the common state inside the shards ("common_state");
    # a legacy one, when present, must be listed like every other file
    return [".metadata", "metadata.json", META, *(f"rng_{r}.pt" for r in range(world_size))]


def verify(path: str | os.PathLike, collective: bool = True) -> str | None:
    """Why checkpoint `path` is damaged (one phrase), or None when every file matches its manifest.

    Collective (each rank checksums a share of the files and all ranks agree) unless `collective` is False.
    """
    path = Path(path)
    rank, world = (get_rank(), get_world_size()) if collective else (0, 1)
    reason = None
    try:
        manifest = read_manifest(path)
        files: dict[str, dict[str, int]] = manifest["files"]
        missing = [name for name in _required(int(manifest["world_size"])) if name not in files]
        if missing:
            raise MegagateError(f"{missing[0]}: not in the manifest")
        present = {entry.name for entry in path.iterdir()} if path.is_dir() else set()
        unlisted = sorted(n for n in present - set(files) - {MANIFEST} if n.endswith(_LOADER_READS))
        if unlisted:
            raise MegagateError(f"{unlisted[0]}: not in the manifest (added after the save)")
        for name in sorted(files)[rank::world]:
            record, file = files[name], path / name
            if not file.is_file():
                raise MegagateError(f"{name}: missing")
            size = file.stat().st_size
            if size != record["size"]:
                raise MegagateError(f"{name}: size {size}, manifest says {record['size']}")
            if crc32(file) != record["crc32"]:
                raise MegagateError(f"{name}: checksum differs from the manifest (same size {size})")
    except MegagateError as exc:
        reason = str(exc)
    except OSError as exc:
        reason = f"cannot be read ({exc.strerror or exc})"
    return _first(gather_objects(reason)) if collective else reason


def safety_check(path: str | os.PathLike, collective: bool = True) -> str | None:
    """Refuse a checkpoint with pickled code in it (UnsafeFileError on every rank); return a damage reason or None.

    Rank 0 scans (`safe_files.check_checkpoint`) and tells the others, so all raise or go on together.
    """
    result: tuple[str, str] | None = None
    if not collective or get_rank() == 0:
        try:
            safe_files.check_checkpoint(path)
        except safe_files.UnsafeFileError as exc:
            result = ("unsafe", str(exc))
        except safe_files.DamagedFileError as exc:
            result = ("damaged", str(exc))
        except OSError as exc:
            result = ("damaged", f"cannot be read ({exc.strerror or exc})")
    if collective:
        result = broadcast_object(result)
    if result is not None and result[0] == "unsafe":
        raise safe_files.UnsafeFileError(result[1])
    return None if result is None else result[1]


# --- RNG states: tensors, ints and tuples only, so torch.load(weights_only=True) reads them ----------------------
def rng_state() -> dict[str, Any]:
    """This rank's random number generator states (CPU, CUDA, numpy, python, megatron's model-parallel tracker)."""
    from megatron.core import tensor_parallel

    kind, key, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        # numpy's uint32 key as an int64 tensor (exact); the rest are python ints / a float
        "numpy": (str(kind), torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "python": random.getstate(),  # (version, tuple of ints, None)
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states of `rng_state()`."""
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    kind, key, pos, has_gauss, cached = state["numpy"]
    key = key.numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
    np.random.set_state((kind, key.astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --- state dicts -------------------------------------------------------------------------------------------------
def _model_state(model_chunks: list) -> dict:
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def _sharded_state(model_chunks: list, optimizer: Any, optimizer_format: str, is_loading: bool) -> dict:
    state = _model_state(model_chunks)
    if optimizer is not None:
        # the chunks' dicts stay separate (their keys repeat, with different layer offsets); megatron finds the
        # parameters in the nested dict
        model_sd = dict(state)
        metadata = {"distrib_optim_sharding_type": optimizer_format}
        if not torch.cuda.is_available():
            # without CUDA, gather the fully-reshardable optimizer state over gloo onto DP rank 0
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = True
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
        if not is_loading:
            _zero_dp_reshardable_padding(state["optimizer"])
    return state


def _zero_dp_reshardable_padding(sharded: Any) -> None:
    """Zero the padding between parameters in dp-reshardable optimizer buckets, in place.

    megatron fills that padding with `torch.empty`, so two identical runs wrote different bytes (seen: 1.7e38 in
    exp_avg) and checkpoints could not be compared or deduplicated; the values are never read back as state."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    if isinstance(sharded, dict):
        flag = sharded.get("padding")
        if isinstance(flag, LocalNonpersistentObject) and flag.unwrap() is True:
            for value in sharded.values():
                if isinstance(value, ShardedTensor):
                    value.data.zero_()
            return
        for value in sharded.values():
            _zero_dp_reshardable_padding(value)
    elif isinstance(sharded, list):
        for value in sharded:
            _zero_dp_reshardable_padding(value)


def saved_optimizer_format(optimizer: Any, requested: str) -> str:
    """The format the optimizer state of a save is in (recorded in the checkpoint's metadata, read on resume).

    Only megatron's DistributedOptimizer has a DP-bucket layout (`dp_reshardable`); the plain optimizer's state is
    per parameter, sharded like the model, and a checkpoint without optimizer state constrains nothing: both are
    recorded as `fully_reshardable`, so a later resume under another layout is not refused for a format they lack.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if optimizer is None:
        return "fully_reshardable"
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return requested if any(isinstance(opt, DistributedOptimizer) for opt in parts) else "fully_reshardable"


def _materialize_optimizer_state(optimizer: Any) -> None:
    # A fresh optimizer has no per-parameter state, and megatron's DistributedOptimizer (with torch's Adam, i.e.
    # without TE/apex) reads the Adam step from it while building the state dict to load into. megatron's own
    # helper fills it with placeholder values that the load then overwrites, as it does for FSDP checkpoints.
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None and not inner.state and hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            opt._init_optimizer_states_with_dummy_values()


# --- size estimate -----------------------------------------------------------------------------------------------
ADAM_BYTES_PER_PARAM = 12  # fp32 main parameter + two fp32 moments, saved by the fully/dp-reshardable formats


def tensor_estimate(model_bytes: int, model_params: int, with_optimizer: bool) -> int:
    """Expected checkpoint bytes from the model's parameters (global: summed over model-parallel shards)."""
    return model_bytes + (ADAM_BYTES_PER_PARAM * model_params if with_optimizer else 0)


def _local_parameters(model_chunks: list) -> tuple[int, int]:
    params = [p for chunk in model_chunks for p in chunk.parameters()]
    return sum(p.numel() * p.element_size() for p in params), sum(p.numel() for p in params)


def _data_parallel_size() -> int:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    return 1


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
    def estimate_bytes(self, model_chunks: list, optimizer: Any) -> tuple[int, str]:
        """(expected bytes of the next checkpoint, where the number comes from): the previous checkpoint's size
        from its manifest, else the model's parameters (plus Adam's state) summed over the job."""
        model_bytes, params = _local_parameters(model_chunks)
        totals = torch.tensor([model_bytes, params], dtype=torch.float64)
        if is_distributed():
            torch.distributed.all_reduce(totals)
        dp = _data_parallel_size()  # data-parallel replicas hold the same parameters
        estimate = tensor_estimate(int(totals[0]) // dp, int(totals[1]) // dp, optimizer is not None)
        source = "from the model and optimizer tensors"
        previous = latest(self.root)
        if previous is not None:
            try:
                manifest = read_manifest(previous)
                estimate = int(manifest.get("total_bytes") or sum(r["size"] for r in manifest["files"].values()))
                source = f"the size of {previous.name}"
            except MegagateError:
                pass
        return estimate, source

    def _check_free_space(self, final: Path, model_chunks: list, optimizer: Any) -> None:
        estimate, source = self.estimate_bytes(model_chunks, optimizer)
        message = None
        if get_rank() == 0:
            probe = self.root
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent
            free = shutil.disk_usage(probe).free
            needed = int(estimate * SPACE_MARGIN) + SPACE_SLACK
            if free < needed:
                kept = len(complete_checkpoints(self.root))
                hint = f"; the {kept} kept checkpoint(s) stay until it is written" if kept else ""
                message = (
                    f"not enough free space for checkpoint {final}: it needs about {needed:,} bytes ({source}, "
                    f"+5% and 1 MiB), {free:,} are free on {probe}{hint}"
                )
        message = broadcast_object(message)
        if message:
            raise MegagateError(message)

    def _fail_if_any(self, error: str | None, tmp: Path) -> None:
        """Raise on every rank when any rank failed a step of the save; the temporary folder is removed."""
        error = _first(gather_objects(error))
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
        self._check_free_space(final, model_chunks, optimizer)
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
        state = _sharded_state(model_chunks, optimizer, optimizer_format, is_loading=False)
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
            share = _records(tmp, names[get_rank() :: get_world_size()])
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
    def load(self, path: Path, model_chunks: list, optimizer: Any, same_layout: bool) -> dict:
        """Load model (and optimizer) state from `path`; RNG only if the parallel layout is unchanged.

        No verification here (see `resume`): a rollback loads a checkpoint this run has just written.
        """
        from megatron.core import dist_checkpointing

        meta = read_meta(path)
        if optimizer is not None:
            _materialize_optimizer_state(optimizer)
        # checkpoints from before the format was recorded were all written fully_reshardable (the old default)
        state = _sharded_state(model_chunks, optimizer, meta.get("optimizer_format", "fully_reshardable"), True)
        loaded = dist_checkpointing.load(state, str(path))
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
        scanned = safety_check(path)
        reason = _first(gather_objects(verify(path) or scanned))
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
        candidates = broadcast_object([str(p) for _, p in reversed(_iter_dirs(self.root))] if get_rank() == 0 else None)
        if not candidates:
            return None
        moved: list[str] = []
        for i, name in enumerate(candidates):
            path = Path(name)
            # pickled code is refused even in a damaged checkpoint; the manifest names damage most precisely
            scanned = safety_check(path)
            reason = verify(path) or scanned
            meta: dict = {}
            if reason is None:
                try:
                    meta = read_meta(path)
                except MegagateError as exc:
                    reason = str(exc)
                reason = _first(gather_objects(reason))
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
                reason = _first(gather_objects(reason))
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
