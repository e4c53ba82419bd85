"""The few training-config keys `megagate submit` needs (parallel sizes, model preset and expert count).

Kept in one small module so it can switch to the trainer's config loader; the keys are the Megatron-LM names the
trainer's config uses under `parallel:` and `model:`. The expert count is the trainer's: `model.num_experts` when
given (file or override), else the one of `model.preset` (`megagate.model.config.model_preset`, e.g. 15a2b-moe -> 128),
else 0 (dense).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from megagate.errors import ConfigError


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    num_experts: int = 0  # resolved: explicit model.num_experts, else the preset's, else 0
    etp: int | None = None
    dp: int | None = None
    preset: str | None = None  # model.preset
    experts_explicit: bool = False  # model.num_experts was given (it wins over the preset's, as in the trainer)


_KEYS = {
    "tp": ("parallel", "tensor_model_parallel_size", 1),
    "pp": ("parallel", "pipeline_model_parallel_size", 1),
    "cp": ("parallel", "context_parallel_size", 1),
    "ep": ("parallel", "expert_model_parallel_size", 1),
    "etp": ("parallel", "expert_tensor_parallel_size", None),
    "dp": ("parallel", "data_parallel_size", None),
    "num_experts": ("model", "num_experts", 0),
}


def preset_num_experts(preset: str) -> int:
    """The expert count of a model preset, through the trainer's own preset table (ConfigError if unknown)."""
    from megagate.model.config import PRESETS, model_preset

    if preset not in PRESETS:  # model_preset says the same; checked first so the message names the submit config
        raise ConfigError(f"model.preset={preset!r} is unknown; known presets: {', '.join(PRESETS)}")
    return model_preset(preset).num_experts


def _resolved(config: ParallelConfig) -> ParallelConfig:
    if config.experts_explicit or config.preset is None:
        return config
    return replace(config, num_experts=preset_num_experts(config.preset))


def read_parallel_config(path: str | os.PathLike[str]) -> ParallelConfig:
    """Read parallel.* sizes, model.preset and model.num_experts from a YAML training config (absent: defaults)."""
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
    model = data.get("model") or {}
    preset = model.get("preset")
    if preset is not None and not isinstance(preset, str):
        raise ConfigError(f"config {str(p)!r}: model.preset={preset!r} must be a preset name")
    explicit = model.get("num_experts") is not None
    return _resolved(ParallelConfig(**values, preset=preset, experts_explicit=explicit))  # type: ignore[arg-type]


def apply_overrides(config: ParallelConfig, overrides: list[str]) -> ParallelConfig:
    """Apply the `section.key=value` command-line overrides that touch the keys above (others are the trainer's)."""
    by_dotted = {f"{section}.{key}": field for field, (section, key, _) in _KEYS.items()}
    values = dict(config.__dict__)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not key=value")
        key = key.strip()
        if key == "model.preset":
            values["preset"] = raw.strip() or None
            continue
        field = by_dotted.get(key)
        if field is None:
            continue
        try:
            values[field] = int(raw)
        except ValueError:
            raise ConfigError(f"override {item!r}: {key} must be an integer") from None
        if field == "num_experts":
            values["experts_explicit"] = True
    return _resolved(ParallelConfig(**values))
