"""The one reader of a training config: YAML + `key=value` overrides → parsed tree (`run_config.parse`) → the rules
of any machine (`config_rules.check_rules`) → what it needs of this machine's libraries and files
(`check_environment`). The perf rules of the real GPU are judged where the settings are resolved for it
(`megagate.run_setup.resolve`).

`train` (and its --dry-run), `submit`, `sweep`, `analyze`, `eval`, `export` and `import` all read through `load` /
`from_dict`. `environment=False` skips the machine checks: for a config judged away from where it runs (a
container job's submission, an old run's checkpoint); the trainer always checks everything.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import yaml

from megagate.config_rules import check_rules
from megagate.errors import ConfigError, MegagateError
from megagate.run_config import TrainConfig, parse
from megagate.yamlfile import load_mapping


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides (values parsed as YAML) to a nested dict, returning a new dict."""
    import copy

    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        key, text = item.split("=", 1)
        try:
            value = yaml.safe_load(text) if text != "" else None
        except yaml.YAMLError:
            value = text
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def from_dict(data: Mapping[str, Any], *, environment: bool = True) -> TrainConfig:
    """A validated TrainConfig from the merged YAML mapping (`environment`: see `validate`)."""
    cfg = parse(data)
    validate(cfg, environment=environment)
    return cfg


def load(path: str, overrides: list[str] | None = None, *, environment: bool = True) -> TrainConfig:
    """Load a YAML config, apply overrides and validate (`environment`: see `validate`)."""
    return from_dict(apply_overrides(load_mapping(path), overrides or []), environment=environment)


def validate(cfg: TrainConfig, *, environment: bool = True) -> None:
    """The rules of any machine, then (`environment`) what the config needs of this one."""
    check_rules(cfg)
    if environment:
        check_environment(cfg)


def check_environment(cfg: TrainConfig) -> None:
    """What a config needs of the machine it runs on: Transformer Engine for fp8 / backend te, the data and tokenizer
    files on disk and intact, output/checkpoint/cache folders usable, the data cache intact. The perf rules of its
    GPU are judged where its settings are resolved for it, once (`megagate.run_setup.resolve`)."""
    t, d = cfg.train, cfg.data
    control = cfg.monitor.early_stop.control_file
    if control is not None and os.path.isdir(control):
        raise ConfigError(
            f"monitor.early_stop.control_file={control!r} is a folder: name a JSON file (it may not exist yet)"
        )
    if t.precision == "fp8":
        from megagate.model.kernels import transformer_engine_available

        if not transformer_engine_available():
            raise ConfigError(
                "train.precision='fp8' needs Transformer Engine, which is not installed; use bf16 or fp32"
            )
    if t.backend == "te":
        from megagate.model.kernels import check_backend

        check_backend("te")
    if d.blend and not d.mock:
        from megagate.data.indexed import strip_suffix
        from megagate.data.indexed import validate as validate_files
        from megagate.data.loader import parse_blend

        for prefix in parse_blend(d.blend)[0]:
            base = strip_suffix(prefix)
            for suffix in (".bin", ".idx"):
                if not os.path.exists(base + suffix):
                    raise ConfigError(
                        f"data.blend: missing data file {base + suffix!r} (preprocess with `megagate preprocess`)"
                    )
            try:  # a truncated or foreign file: refused with its name now, not inside megatron later
                validate_files(base)
            except MegagateError as exc:
                raise ConfigError(f"data.blend: {exc}") from None
        if not os.path.exists(d.tokenizer):
            raise ConfigError(f"data.tokenizer: missing tokenizer file {d.tokenizer!r}")
    # where the run writes: a file in the way or a read-only folder would fail after the model is built
    from megagate.files import check_writable_dir

    for key, path in (
        ("output.dir", cfg.output.dir),
        ("checkpoint.dir", cfg.checkpoint_dir),
        ("data.cache_dir", d.cache_dir),
        ("data.demo_dir", d.demo_dir if d.demo and not d.blend else None),
    ):
        if path is not None:
            try:
                check_writable_dir(path, key)
            except MegagateError as exc:
                raise ConfigError(str(exc)) from None
    from megagate.data.loader import check_cache_files

    check_cache_files(d.cache_dir or os.path.join(cfg.output.dir, "data_cache"))
