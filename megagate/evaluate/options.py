"""What `megagate eval` is asked to do, checked before anything is built: lengths, `--rope` overrides, data specs,
and each checkpoint's config with the overrides applied (every refusal is one MegagateError line)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megagate.errors import ConfigError, MegagateError
from megagate.model import position
from megagate.model.model_config import POSITION_FIELDS, ModelConfig

RUN_DATA = "@run"  # the checkpoint's own validation split (its run's data, split and seed)
# --rope may set the position embedding and the length the model is declared for; nothing that defines a weight
ROPE_KEYS = (*POSITION_FIELDS, "max_sequence_length")


def parse_lengths(text: str) -> list[int]:
    """'512,1024' -> [512, 1024] (each >= 2, no repeats)."""
    lengths = []
    for item in text.split(","):
        item = item.strip()
        try:
            value = int(item)
        except ValueError:
            raise MegagateError(f"--seq-lengths {text!r}: {item!r} is not an integer") from None
        if value < 2:
            raise MegagateError(f"--seq-lengths {text!r}: {value} must be >= 2 tokens")
        if value in lengths:
            raise MegagateError(f"--seq-lengths {text!r}: {value} is given twice")
        lengths.append(value)
    return lengths


def parse_rope(items: list[str]) -> dict[str, Any]:
    """['rotary_base=1000000', 'position_embedding=yarn'] -> typed values (YAML-parsed, checked against the hints
    of ModelConfig); unknown keys and architecture fields are refused."""
    import yaml

    from megagate.sections import check_type

    hints = typing.get_type_hints(ModelConfig)
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise MegagateError(f"--rope {item!r}: expected key=value, e.g. rotary_base=1000000")
        if key not in ROPE_KEYS:
            if key in hints:
                raise MegagateError(
                    f"--rope {key}: changes the checkpoint's architecture, not its position embedding; "
                    f"--rope may set: {', '.join(ROPE_KEYS)}"
                )
            raise MegagateError(f"--rope {key}: unknown key; --rope may set: {', '.join(ROPE_KEYS)}")
        try:
            value = yaml.safe_load(text) if text != "" else None
        except yaml.YAMLError:
            raise MegagateError(f"--rope {item!r}: the value is not valid YAML") from None
        try:
            out[key] = check_type(value, hints[key], f"--rope {key}")
        except ConfigError as exc:
            raise MegagateError(str(exc)) from None
    return out


@dataclass(frozen=True)
class DataSpec:
    """One dataset to evaluate on: an indexed-file prefix, or RUN_DATA (each checkpoint's validation split)."""

    name: str
    prefix: str | None  # None: RUN_DATA
    tokens: int | None = None  # tokens in the files (prefixes only)


def parse_data(text: str, lengths: list[int], split: str) -> list[DataSpec]:
    """'a,b,@run' -> DataSpecs; each prefix is validated (both files, index against data) and must hold enough tokens
    for one sample of the longest length (split '0,1,0': every document is evaluation data)."""
    from megagate.data.indexed import strip_suffix, validate

    specs = []
    for item in [x.strip() for x in text.split(",")]:
        if not item:
            raise MegagateError(f"--data {text!r}: an empty entry")
        if item == RUN_DATA:
            specs.append(DataSpec(RUN_DATA, None))
            continue
        prefix = strip_suffix(item)
        info = validate(prefix)
        tokens = int(info["tokens"])
        need = max(lengths) + 1  # a sample is seq_length + 1 tokens (inputs and shifted labels)
        if split == "0,1,0" and tokens < need:
            raise MegagateError(
                f"--data {item}: {tokens} tokens, too few for one sample at length {max(lengths)} ({need} needed)"
            )
        specs.append(DataSpec(Path(prefix).name, prefix, tokens))
    if len({s.name for s in specs}) != len(specs):
        raise MegagateError(f"--data {text!r}: two datasets share a name")
    return specs


def with_overrides(model: ModelConfig, overrides: dict[str, Any], where: str) -> ModelConfig:
    """The checkpoint's model with the --rope overrides applied (ModelConfig's own checks, naming `where`)."""
    try:
        return dataclasses.replace(model, **overrides)
    except ConfigError as exc:
        shown = " ".join(f"{k}={v}" for k, v in overrides.items())
        raise MegagateError(f"{where}: --rope {shown}: {exc}") from None


def check_lengths(model: ModelConfig, lengths: list[int], where: str) -> None:
    """Refuse lengths the model's position embedding is not set up for (ModelConfig.context_length: every slow rotary
    dim kept to angles seen within the context its scaling starts from, megagate.model.position)."""
    too_long = [n for n in lengths if n > model.context_length]
    if too_long:
        hint = f"position_embedding=yarn yarn_factor={-(-too_long[0] // model.max_sequence_length)}"
        if model.rope_scaling and model.rope_scaling_original_max_position_embeddings > model.max_sequence_length:
            hint = f"rope_scaling_original_max_position_embeddings={model.max_sequence_length} (the length trained at)"
        raise MegagateError(
            f"{where}: length {too_long[0]} exceeds the {model.context_length} tokens the position embedding "
            f"addresses ({position.describe(model)}, max_sequence_length {model.max_sequence_length}); extend it "
            f"with --rope (e.g. {hint}, or max_sequence_length={too_long[0]} to extrapolate)"
        )
