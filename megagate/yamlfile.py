"""Reading a YAML mapping from a file, with one-line errors: the one YAML reader of the package.

Used by `megagate.config_reader` (training configs) and `megagate.monitor.runfiles` (a run directory's resolved
config.yaml); it sits at the bottom layer so that both can use it.
"""

from __future__ import annotations

import os

import yaml

from megagate.errors import ConfigError


def load_mapping(path: str | os.PathLike) -> dict:
    """The YAML mapping in `path` ({} for an empty file); ConfigError if missing, not YAML, or not a mapping."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ConfigError(f"config file {path!r} is a folder, not a YAML file")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r} is not valid YAML: {' '.join(str(exc).split())}") from None
    except UnicodeDecodeError as exc:  # a binary file, or text in another encoding
        raise ConfigError(
            f"config file {path!r} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of sections, not {type(data).__name__}")
    return data
