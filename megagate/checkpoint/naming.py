"""Where checkpoints are and what they are called: `iter_NNNNNNN` folders under a checkpoint root, the complete ones
(with a manifest), the newest, the one a user names, and the megagate metadata each holds (megagate.json, with the
model's `architecture`: what a resume, an init_from or an import must match)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

from megagate.errors import MegagateError
from megagate.run_config import TrainConfig

_NAME = re.compile(r"^iter_(\d{7})$")
META = "megagate.json"
MANIFEST = "manifest.json"  # written last into the temporary folder: its presence makes a checkpoint complete
DAMAGED = "damaged"  # <root>/damaged/: checkpoints moved aside on resume


def checkpoint_name(step: int) -> str:
    return f"iter_{step:07d}"


def complete_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint (one with a manifest) under root, oldest first."""
    return [(step, path) for step, path in checkpoint_dirs(root) if (path / MANIFEST).is_file()]


def checkpoint_dirs(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every iter_NNNNNNN folder under root (complete or not), oldest first."""
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


# Fields of ModelConfig that define the weights (their shapes or their meaning); the others (init, rotary base,
# maximum length, MoE loss coefficients) may change between launches.
ARCHITECTURE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "vocab_size",
    "tie_embeddings",
    "qk_layernorm",
    "normalization",
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
)
HYBRID_FIELDS = (
    "layer_pattern",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
)


def architecture(cfg: TrainConfig) -> dict[str, Any]:
    """What defines the model's weights, as stored in a checkpoint (flat keys named like the config's)."""
    m = cfg.model
    arch: dict[str, Any] = {f"model.{name}": getattr(m, name) for name in ARCHITECTURE_FIELDS}
    arch["model.ffn_hidden_size (built)"] = m.effective_ffn_hidden_size
    # hybrid and shared-expert fields only where set: a record written before they existed stays equal
    defaults = type(m).__dataclass_fields__
    for name in HYBRID_FIELDS:
        if getattr(m, name) != defaults[name].default:
            arch[f"model.{name}"] = getattr(m, name)
    for f in dataclasses.fields(m.gate):
        arch[f"model.gate.{f.name}"] = getattr(m.gate, f.name)
    return arch
