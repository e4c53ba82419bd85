"""Typed sections from mappings (YAML, JSON): the one reader of a frozen dataclass from a mapping.

`build_section(cls, values, path)` = `cls(**read_fields(cls, values, path))`: unknown keys refused, each value
checked against its field's type hint and converted (`check_type`; a list to a tuple, a mapping to a dict, JSON's
text keys of a `dict[int, float]` to numbers, a nested dataclass read the same way). A section with rules across its
fields (which metric a mapping may name, which bounds a number has) calls `read_fields` and applies them to the
checked keywords before it builds itself; bounds of one field stay in the class's `__post_init__`.

Used by `megagate.run_config` (every training-config section), `megagate.health.config`,
`megagate.monitor.spike`'s section, `megagate.frontier.state` and `megagate.plan.profile` (the device profiles); it sits at the bottom layer so every layer can.
Every refusal is a one-line `ConfigError` naming the key path and what is allowed.
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
    """A frozen dataclass section from a mapping, refusing unknown keys and wrong types (`read_fields`)."""
    return cls(**read_fields(cls, values, name))


def read_fields(cls: type, values: Any, path: str, *, item: str | None = None, scalars: bool = True) -> dict:
    """The keyword arguments of the dataclass `cls` from the mapping `values` (None: empty), checked and converted.

    Subsections (fields whose type is a dataclass) are read first, each by its class's own `from_dict` when it has
    one, else by this reader; then unknown keys are refused; then every other value is converted:
    - `tuple[X, ...]`: a list or tuple (a single string when X is str);
    - `Mapping[K, V]`: any mapping, as a dict; `dict[K, V]` of numbers and text: keys and values converted (JSON
      keys are text);
    - anything else through `check_type` (bools always; ints, floats and text unless `scalars` is False: a section
      whose `__post_init__` names each number's bounds keeps its own words for them).
    `item` names what the keys of a mapping (and the entries of a tuple) are, for the refusals ("metric").
    """
    values = as_mapping(values, path)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    out: dict = {}
    for name in names:
        sub = _dataclass_of(hints[name])
        if sub is not None and name in values:
            value = values.pop(name)
            if value is None and sub is not hints[name]:  # Optional[Section] given as null
                out[name] = None
            else:
                out[name] = (
                    sub.from_dict(value)
                    if hasattr(sub, "from_dict")
                    else sub(**read_fields(sub, value, f"{path}.{name}", item=item, scalars=scalars))
                )
    refuse_unknown(values, names, path)
    for name, value in values.items():
        out[name] = _convert(value, hints[name], f"{path}.{name}", item, scalars)
    return out


def _dataclass_of(hint: Any) -> type | None:
    """The dataclass a field holds (`Section` or `Section | None`), None for any other type."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        found = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = found[0] if len(found) == 1 else None
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


_PLURAL = {int: "integers", float: "numbers", str: "strings"}  # what a dict[K, V]'s keys and values are converted to


def _convert(value: Any, hint: Any, path: str, item: str | None, scalars: bool) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if isinstance(value, str) and args[0] is str:
            return (value,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}={value!r} must be " + (f"a {item} name or a list of them" if item else "a list"))
        return tuple(value)
    if origin is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}={value!r} must be a mapping" + (f" of {item} -> value" if item else ""))
        return dict(value)
    if origin is dict and len(args) == 2 and all(a in _PLURAL for a in args):
        key_type, value_type = args
        value = check_type(value, dict, path)
        try:
            return {key_type(k): value_type(v) for k, v in value.items()}
        except (TypeError, ValueError):
            bad = next(k for k, v in value.items() if not _converts(k, key_type) or not _converts(v, value_type))
            raise ConfigError(
                f"{path}.{bad}={value[bad]!r}: keys must be {_PLURAL[key_type]}, values {_PLURAL[value_type]}"
            ) from None
    if hint is bool or scalars:
        return check_type(value, hint, path)
    return value


def _converts(value: Any, kind: type) -> bool:
    try:
        kind(value)
    except (TypeError, ValueError):
        return False
    return True
