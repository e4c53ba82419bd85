"""Checkpoints: megatron's dist_checkpointing folders with megagate's metadata, a manifest, and safe, verified loads.

One module per job, re-exported here (`from megagate import checkpoint as ckpt`):

- `naming`       iter_NNNNNNN folders, the complete / newest one, the one a user names, megagate.json and the
                 model's architecture record
- `manifest`     the manifest (name, size, CRC-32 of every file) and the checks before a load: verify, safety_check,
                 damage (both)
- `safe_files`   data-only unpickling: a crafted pickle in a checkpoint is refused before anything loads it
- `rng`          every RNG state of a rank, saved as data
- `state`        the sharded state dicts (model chunks, optimizer format) and megatron's optimizer quirks
- `space`        the next checkpoint's size and the free-space refusal
- `writer`       megatron's save as an AsyncRequest, its writer wrapped: each rank checksums what it wrote and
                 records a failure naming itself; the cluster faults' injection point
- `background`   asynchronous saves: megatron's AsyncCallsQueue (a forked writer per save), when the ranks agree a
                 write is done
- `checkpointer` `Checkpointer`: atomic verified save (synchronous or in the background), newest-good resume with
                 fallback, keep-last-K, init_from
"""

from megagate.checkpoint.checkpointer import Checkpointer, Resumed
from megagate.checkpoint.manifest import crc32, damage, read_manifest, safety_check, verify
from megagate.checkpoint.naming import (
    DAMAGED,
    MANIFEST,
    META,
    architecture,
    checkpoint_dirs,
    checkpoint_name,
    complete_checkpoints,
    latest,
    read_meta,
    resolve,
)
from megagate.checkpoint.rng import rng_state, set_rng_state
from megagate.checkpoint.space import estimate_bytes, tensor_estimate
from megagate.checkpoint.state import saved_optimizer_format

__all__ = [
    "DAMAGED",
    "MANIFEST",
    "META",
    "Checkpointer",
    "Resumed",
    "architecture",
    "checkpoint_dirs",
    "checkpoint_name",
    "complete_checkpoints",
    "crc32",
    "damage",
    "estimate_bytes",
    "latest",
    "rng_state",
    "read_manifest",
    "read_meta",
    "resolve",
    "safety_check",
    "saved_optimizer_format",
    "set_rng_state",
    "tensor_estimate",
    "verify",
]
