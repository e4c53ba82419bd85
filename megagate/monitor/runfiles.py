"""The files of one run directory: one schema shared by the trainer (writer) and report/analysis (readers).

    RUN_DIR/config.yaml        the resolved config (keys used here: train.lr, model.gate.preset or model.gate.*, seed)
    RUN_DIR/metrics.jsonl      {"step", "split": "train", "loss", "lr", "grad_norm", "tokens_per_s"}
                               {"step", "split": "valid", "loss", "ppl"}
    RUN_DIR/events.jsonl       spike events: {"step", "metric", "value", "baseline", "score", "action", "reason"}
    RUN_DIR/diagnostics.jsonl  {"step", "layer", "gate_score_mean", "gate_sparsity", "f_attn", "m_act", "max_logit",
                                "sink", "sink_length"} (Sink^eps_1 and its T: older runs lack them)
    RUN_DIR/precursors.jsonl   {"step", "update_ratio": {"0": .., "other": ..}, "update_ratio_max", "max_logit",
                                "log_z_mean", "log_z_max"} (spike precursors, at the diagnostics' probes)
    RUN_DIR/summary.json       {"steps", "final_loss", "final_valid_loss", "diverged", "aborted"?, "spikes"?,
                                "spike_score"? (monitor.spike_score: percent, spikes, judged per metric)}

JSONL lines are appended with one `os.write` on an O_APPEND descriptor (a line is never interleaved or half-written
by another writer on a local file system); whole files (summary, config) are written to a temporary name and renamed.
Non-finite floats are stored as the strings "nan", "inf", "-inf" (strict JSON) and read back as floats.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from megagate.errors import MegagateError
from megagate.files import write_atomic
from megagate.yamlfile import load_mapping

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
DIAGNOSTICS = "diagnostics.jsonl"
PRECURSORS = "precursors.jsonl"
SUMMARY = "summary.json"

TRAIN_KEYS = ("step", "split", "loss", "lr", "grad_norm", "tokens_per_s")
VALID_KEYS = ("step", "split", "loss", "ppl")
EVENT_KEYS = ("step", "metric", "value", "baseline", "score", "action", "reason")
DIAGNOSTIC_KEYS = ("step", "layer", "gate_score_mean", "gate_sparsity", "f_attn", "m_act", "max_logit")
SUMMARY_KEYS = ("steps", "final_loss", "final_valid_loss", "diverged")
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


# --- encoding ------------------------------------------------------------------------------------------------------
def _encode(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def dumps(record: Mapping[str, Any]) -> str:
    """One strict-JSON line (no NaN literals) for `record`."""
    return json.dumps(_encode(record), allow_nan=False, sort_keys=False)


# --- writers -------------------------------------------------------------------------------------------------------
def append_jsonl(path: str | os.PathLike, record: Mapping[str, Any]) -> None:
    """Append one record as one line, in a single write on an O_APPEND descriptor."""
    data = (dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        if written != len(data):  # practically never for a short line; fail loudly rather than leave half a line
            raise OSError(f"short write to {path}: {written} of {len(data)} bytes")
    finally:
        os.close(fd)


def write_json(path: str | os.PathLike, record: Mapping[str, Any]) -> None:
    write_atomic(path, json.dumps(_encode(record), allow_nan=False, indent=2) + "\n")


def write_metrics(run_dir: str | os.PathLike, step: int, split: str, **values: float) -> None:
    """Append a train or valid metrics line (keys as in TRAIN_KEYS / VALID_KEYS)."""
    if split not in ("train", "valid"):
        raise MegagateError(f"metrics split {split!r} is not one of train, valid")
    append_jsonl(
        Path(run_dir) / METRICS, {"step": int(step), "split": split, **{k: float(v) for k, v in values.items()}}
    )


def write_summary(
    run_dir: str | os.PathLike,
    steps: int,
    final_loss: float,
    final_valid_loss: float | None,
    diverged: bool,
    **extra: Any,
) -> None:
    write_json(
        Path(run_dir) / SUMMARY,
        {
            "steps": int(steps),
            "final_loss": float(final_loss),
            "final_valid_loss": None if final_valid_loss is None else float(final_valid_loss),
            "diverged": bool(diverged),
            **extra,
        },
    )


def is_diverged(
    first_loss: float | None, final_loss: float | None, aborted: bool = False, any_nonfinite: bool = False
) -> bool:
    """The project's definition: non-finite loss, final loss above the first loss, or an abort."""
    if aborted or any_nonfinite or final_loss is None or not math.isfinite(final_loss):
        return True
    return first_loss is not None and math.isfinite(first_loss) and final_loss > first_loss


# --- readers -------------------------------------------------------------------------------------------------------
def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a JSONL file ([] if absent). A torn last line (a crashed writer) is ignored; others must parse."""
    path = Path(path)
    if not path.exists():
        return []
    lines = _read_text(path).splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = _decode(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:
                break
            raise MegagateError(f"{path}:{i + 1}: not a JSON line ({exc.msg})") from None
        if not isinstance(record, dict):
            raise MegagateError(f"{path}:{i + 1}: a JSON {type(record).__name__}, not an object")
        records.append(record)
    return records


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise MegagateError(
            f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
        ) from None


def read_json(path: str | os.PathLike) -> dict[str, Any] | None:
    """The JSON object in `path` (None if absent); MegagateError naming the file if it is not one."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        record = _decode(json.loads(_read_text(path)))
    except json.JSONDecodeError as exc:
        raise MegagateError(f"{path}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(record, dict):
        raise MegagateError(f"{path}: a JSON {type(record).__name__}, not an object")
    return record


def read_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run's resolved config as the trainer wrote it, a plain mapping (empty if absent).

    Only the YAML is read (megagate.yamlfile, the package's one YAML reader), not validated: the readers look up a
    few keys (`lookup`), and a run written by an older megagate must stay readable.
    """
    path = Path(run_dir) / CONFIG
    return load_mapping(path) if path.exists() else {}


def lookup(config: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    """config['a']['b'] for 'a.b' (default when any part is missing)."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def gate_label(config: Mapping[str, Any]) -> str:
    """A short name for the run's gate variant: the preset name, or the explicit fields, or 'baseline'."""
    gate = lookup(config, "model.gate", {}) or {}
    if isinstance(gate, str):
        return gate
    preset = gate.get("preset")
    fields = [f"{k}={v}" for k, v in sorted(gate.items()) if k != "preset"]
    if preset and not fields:
        return str(preset)
    if preset:
        return f"{preset}+{','.join(fields)}"
    return ",".join(fields) or "g1-elementwise"


def train_metrics(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [dict(r) for r in records if r.get("split", "train") == "train"]


def valid_metrics(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [dict(r) for r in records if r.get("split") == "valid"]


def iter_run_files(run_dir: str | os.PathLike) -> Iterator[Path]:
    for name in (CONFIG, METRICS, EVENTS, DIAGNOSTICS, SUMMARY):
        path = Path(run_dir) / name
        if path.exists():
            yield path


def truncate_after(run_dir: str | os.PathLike, step: int) -> int:
    """Drop the records of steps after `step` from the run's step-keyed JSONL files (metrics, events, diagnostics,
    precursors);
    the number dropped.

    A resumed launch continues from its checkpoint's step: what an earlier launch logged after that step (it was
    killed before its next checkpoint) is replaced by what the resumed launch logs, not kept twice. Files are
    rewritten atomically, and only when something is dropped.
    """
    dropped = 0
    for name in (METRICS, EVENTS, DIAGNOSTICS, PRECURSORS):
        path = Path(run_dir) / name
        records = read_jsonl(path)
        kept = [r for r in records if int(r.get("step", 0)) <= step]
        if len(kept) != len(records) or (path.exists() and not path.read_bytes().endswith(b"\n")):
            write_atomic(path, "".join(dumps(r) + "\n" for r in kept))
            dropped += len(records) - len(kept)
    return dropped
