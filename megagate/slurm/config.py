"""The few training-config keys `megagate submit` needs (parallel sizes and expert count).

Kept in one small function so it can switch to the trainer's config loader once that exists; the keys are the
Megatron-LM names the trainer's config uses under `parallel:` and `model:`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from megagate.errors import ConfigError


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    num_experts: int = 0
    etp: int | None = None
    dp: int | None = None


_KEYS = {
    "tp": ("parallel", "tensor_model_parallel_size", 1),
    "pp": ("parallel", "pipeline_model_parallel_size", 1),
    "cp": ("parallel", "context_parallel_size", 1),
    "ep": ("parallel", "expert_model_parallel_size", 1),
    "etp": ("parallel", "expert_tensor_parallel_size", None),
    "dp": ("parallel", "data_parallel_size", None),
    "num_experts": ("model", "num_experts", 0),
}


def read_parallel_config(path: str | os.PathLike[str]) -> ParallelConfig:
    """Read parallel.* sizes and model.num_experts from a YAML training config (absent keys take defaults)."""
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config {str(p)!r} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {str(p)!r} is not valid YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {str(p)!r} must be a YAML mapping, not {type(data).__name__}")
    values: dict[str, int | None] = {}
    for field, (section, key, default) in _KEYS.items():
        block = data.get(section) or {}
        if not isinstance(block, dict):
            raise ConfigError(f"config {str(p)!r}: {section!r} must be a mapping, not {type(block).__name__}")
        value = block.get(key, default)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"config {str(p)!r}: {section}.{key}={value!r} must be an integer")
        values[field] = value
    return ParallelConfig(**values)  # type: ignore[arg-type]


def apply_overrides(config: ParallelConfig, overrides: list[str]) -> ParallelConfig:
    """Apply the `section.key=value` command-line overrides that touch the keys above (others are the trainer's)."""
    by_dotted = {f"{section}.{key}": field for field, (section, key, _) in _KEYS.items()}
    values = dict(config.__dict__)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not key=value")
        field = by_dotted.get(key.strip())
        if field is None:
            continue
        try:
            values[field] = int(raw)
        except ValueError:
            raise ConfigError(f"override {item!r}: {key.strip()} must be an integer") from None
    return ParallelConfig(**values)
