"""Checks that the pickle-bearing files of a checkpoint hold data only, before anything unpickles them.

A checkpoint folder is input like any other: someone can hand over a crafted one. Three kinds of file in it are
unpickled when it is loaded:

- `.metadata` (torch DCP's index of the shards) is read with plain `pickle.load` by torch;
- `rng_<rank>.pt` and a legacy `common.pt` are torch zip files (megatron's `load_common` reads `common.pt` without
  `weights_only`, i.e. with torch's default, which an environment variable can turn off);
- the byte items inside the `__*.distcp` shards (megatron's ShardedObjects: the common state, the layers' extra
  state) are torch zip files too, which torch's DCP load planner reads with `torch.load(weights_only=False)`.

`check_checkpoint` reads `.metadata` with an unpickler that resolves only the classes torch's checkpoint metadata
uses (found by scanning real checkpoints), and opens every torch zip, and every byte item the metadata points at,
with `torch.load(weights_only=True)`. Nothing is called that is not on an allowlist. A file that references
anything else raises `UnsafeFileError` (a user error: the CLI prints one line and exits 2); a file that cannot be
parsed at all raises `DamagedFileError` (the checkpoint is damaged, not crafted).
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

from megagate.errors import MegagateError

# Every global a torch 2.x DCP `.metadata` pickle references (scanned from checkpoints of dense and MoE runs).
METADATA_GLOBALS = frozenset(
    {
        "torch.distributed.checkpoint.metadata.Metadata",
        "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
        "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
        "torch.distributed.checkpoint.metadata.TensorProperties",
        "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
        "torch.distributed.checkpoint.metadata.MetadataIndex",
        "torch.distributed.checkpoint.metadata.StorageMeta",
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch.serialization._get_layout",
        "torch.Size",
        # harmless constructors a DCP index may hold (a Path checkpoint id, planner data)
        "pathlib.PosixPath",
        "pathlib.PurePosixPath",
        "collections.OrderedDict",
        # dtypes are module attributes of torch
        *(
            f"torch.{name}"
            for name in (
                "float32 float64 float16 bfloat16 int64 int32 int16 int8 uint8 bool complex64 complex128 "
                "float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz uint16 uint32 uint64"
            ).split()
        ),
    }
)


class UnsafeFileError(MegagateError):
    """A checkpoint file references code (a global outside the allowlist): it is refused, never loaded."""


class DamagedFileError(Exception):
    """A checkpoint file that cannot be parsed (truncated, overwritten): the checkpoint is damaged."""


def _refuse(path: str | os.PathLike, name: str) -> UnsafeFileError:
    return UnsafeFileError(f"refusing to load {path}: it references {name}, which is not data")


class _DataOnlyUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, label: str) -> None:
        super().__init__(file)
        self._label = label

    def find_class(self, module: str, name: str) -> Any:
        # every route to a callable (GLOBAL, STACK_GLOBAL, INST, OBJ) resolves through here, before any call
        if f"{module}.{name}" not in METADATA_GLOBALS:
            raise _refuse(self._label, f"{module}.{name}")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise _refuse(self._label, f"persistent id {str(pid)[:60]!r}")


def load_metadata_pickle(path: str | os.PathLike) -> Any:
    """Unpickle a DCP `.metadata` file, resolving only METADATA_GLOBALS (UnsafeFileError / DamagedFileError)."""
    try:
        with open(path, "rb") as f:
            return _DataOnlyUnpickler(f, str(path)).load()
    except UnsafeFileError:
        raise
    except OSError as exc:
        raise DamagedFileError(f"{Path(path).name}: cannot be read ({exc.strerror or exc})") from None
    except Exception as exc:  # any parse failure of a truncated or overwritten pickle
        raise DamagedFileError(f"{Path(path).name}: not a readable pickle ({type(exc).__name__})") from None


# torch words it "Unsupported global: GLOBAL m.n ..." or "... unsupported GLOBAL m.n whose module m is blocked"
_UNSUPPORTED_GLOBAL = re.compile(r"\bGLOBAL ([\w.]+)", re.IGNORECASE)


def load_torch_data(source: str | os.PathLike | bytes, label: str | os.PathLike) -> Any:
    """`torch.load(weights_only=True)` of a file or bytes; a reference to code raises UnsafeFileError naming it."""
    import torch

    stream = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        match = _UNSUPPORTED_GLOBAL.search(text)
        if "Weights only load failed" in text and match:  # torch's allowlist refused a global: a crafted file
            raise _refuse(label, match.group(1)) from None
        raise DamagedFileError(f"{Path(label).name}: not a readable torch file ({type(exc).__name__})") from None
    except OSError as exc:
        raise DamagedFileError(f"{Path(label).name}: cannot be read ({exc.strerror or exc})") from None
    except Exception as exc:  # a truncated zip, a bad record: damage
        raise DamagedFileError(f"{Path(label).name}: not a readable torch file ({type(exc).__name__})") from None


def _byte_items(metadata: Any) -> list[tuple[str, Any]]:
    """(key, storage info) of every byte item (pickled object) the DCP metadata places in the shard files."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    items = []
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            items.append((index.fqn, info))
    return items


def check_checkpoint(path: str | os.PathLike) -> None:
    """Refuse (UnsafeFileError) a checkpoint folder with any pickle-bearing part that is not data only.

    Raises DamagedFileError when such a part cannot be parsed. Reads `.metadata` files with the data-only
    unpickler, every `*.pt` with torch's weights-only loader, and every byte item inside the shards likewise.
    """
    root = Path(path)
    metadata = None
    for entry in sorted(root.iterdir()):
        if entry.name.endswith(".metadata") and entry.is_file():
            loaded = load_metadata_pickle(entry)
            if entry.name == ".metadata":
                metadata = loaded
        elif entry.suffix == ".pt" and entry.is_file():
            load_torch_data(entry, entry)
    if metadata is None:
        return  # nothing indexes byte items (the integrity check reports a missing .metadata)
    if not hasattr(metadata, "state_dict_metadata"):
        raise DamagedFileError(".metadata: not a torch checkpoint index")
    for key, info in _byte_items(metadata):
        if getattr(info, "transform_descriptors", None):
            # compressed/transformed items would need torch's transforms to read; none are written by megatron
            raise DamagedFileError(f"{info.relative_path}: item {key} has transforms this check cannot read")
        shard = root / str(info.relative_path)
        if Path(info.relative_path).name != str(info.relative_path):  # the index must not point outside
            raise _refuse(root / ".metadata", f"a file outside the checkpoint ({info.relative_path!r})")
        try:
            with open(shard, "rb") as f:
                f.seek(int(info.offset))
                data = f.read(int(info.length))
        except OSError as exc:
            raise DamagedFileError(f"{shard.name}: cannot be read ({exc.strerror or exc})") from None
        if len(data) != int(info.length):
            raise DamagedFileError(f"{shard.name}: item {key} is cut off (the file is truncated)")
        load_torch_data(data, f"{shard} (item {key})")
