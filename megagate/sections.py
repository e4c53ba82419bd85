"""Typed config sections from YAML mappings: the one set of from-mapping helpers (unknown keys, types, mappings).

Used by `megagate.run_config` (every training-config section) and `megagate.monitor.settings` (the monitor's); it sits at
the bottom layer so both can. Every refusal is a one-line `ConfigError` naming the key path and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Union

from megagate.errors import ConfigError


def as_mapping(values: Any, path: str) -> dict:
    """`values` as a dict (None: empty); ConfigError if it is not a mapping."""
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ConfigError(f"{path} must be a mapping, not {values!r}")
    return dict(values)


def closest(value: Any, allowed: Iterable[Any]) -> str | None:
    """The allowed name a mistyped `value` most likely meant, or None: difflib's closest match (case and `-`/`_`
    ignored), else an abbreviation either way (`learning_rate` for `lr`: the initials of the words), else a name
    that contains the other (`warmup` for `warmup_steps`)."""
    if not isinstance(value, str) or not value:
        return None
    names = [a for a in allowed if isinstance(a, str)]

    def norm(text: str) -> str:
        return text.lower().replace("-", "_")

    by_norm = {norm(a): a for a in names}
    match = difflib.get_close_matches(norm(value), list(by_norm), n=1, cutoff=0.75)
    if match:
        return by_norm[match[0]]

    def initials(text: str) -> str:
        words = [w for w in re.split(r"[_\-. ]+", norm(text)) if w]
        return "".join(w[0] for w in words) if len(words) > 1 else ""

    for a in names:
        if initials(value) == norm(a) or initials(a) == norm(value):
            return a
    if len(value) >= 3:
        contained = [a for a in names if norm(value) in norm(a) or (len(a) >= 3 and norm(a) in norm(value))]
        if len(contained) == 1:
            return contained[0]
    return None


def did_you_mean(value: Any, allowed: Iterable[Any]) -> str:
    """`; did you mean 'x'?` for the closest allowed name (`closest`), or "" when nothing is close: appended at the
    end of a refusal, after the list of what is allowed."""
    match = closest(value, allowed)
    return f"; did you mean {match!r}?" if match is not None else ""


def refuse_unknown(values: Mapping, allowed: Iterable[str], path: str) -> None:
    """ConfigError naming the first key of `values` not in `allowed` (YAML keys need not be strings), with the
    closest allowed key."""
    allowed = set(allowed)
    unknown = sorted(set(values) - allowed, key=str)
    if unknown:
        hint = did_you_mean(unknown[0], allowed)
        raise ConfigError(f"{path}.{unknown[0]} is not a known key; allowed: {', '.join(sorted(allowed))}{hint}")


def check_choice(value: Any, allowed: tuple[str, ...], path: str) -> None:
    """ConfigError unless `value` is one of `allowed` (with the closest one)."""
    if value not in allowed:
        raise ConfigError(f"{path}={value!r} is not one of {', '.join(allowed)}{did_you_mean(value, allowed)}")


def check_type(value: Any, annotation: Any, path: str) -> Any:
    """`value` checked against the type hint `annotation` (floats: finite, numeric text accepted); ConfigError."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return check_type(value, arg, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}={value!r} must be true or false")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}={value!r} must be an integer")
        return value
    if annotation is float:
        number = value
        if isinstance(value, str):
            # YAML 1.1 reads 3e-4 (no dot) as a string: a number written as text is the number
            try:
                number = float(value)
            except ValueError:
                raise ConfigError(f"{path}={value!r} must be a number") from None
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ConfigError(f"{path}={value!r} must be a number")
        if not math.isfinite(number):  # YAML's .inf / .nan: no setting of the trainer means anything with them
            raise ConfigError(f"{path}={value!r} must be a finite number")
        return float(number)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}={value!r} must be a string")
        return value
    if annotation is list or origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}={value!r} must be a list")
        return value
    if annotation is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}={value!r} must be a mapping")
        return value
    return value


def build_section(cls: type, values: Any, name: str) -> Any:
    """A frozen dataclass section from a mapping, refusing unknown keys and wrong types."""
    values = as_mapping(values, name)
    hints = typing.get_type_hints(cls)
    refuse_unknown(values, [f.name for f in dataclasses.fields(cls)], name)
    return cls(**{k: check_type(v, hints[k], f"{name}.{k}") for k, v in values.items()})
