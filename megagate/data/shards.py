"""Sharded preprocessing: plan the units, process some of them, merge them into the single-process bytes.

    manifest = plan(inputs, output_prefix, spec, opts, unit_bytes, tasks)   # <prefix>.units/manifest.json
    records = run_units(output_prefix, spec, workers, ids)                  # any machine, any order, resumable
    result = merge(output_prefix)                                           # <prefix>_<key>_document.bin/.idx

A unit is tokenized by the same pipeline as a whole run (`preprocess.preprocess` over the unit's pieces), and the
merge appends the units' documents in manifest order, so the merged files are byte for byte those of one
`preprocess` over the same inputs (a document's tokens never depend on the chunk or unit it was read in). The merge
streams: each unit's `.bin` is copied in blocks, its lengths read in blocks; pointers are recomputed by the writer.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megagate.data import units as U
from megagate.data.indexed import IndexedWriter, read_index_header
from megagate.data.preprocess import (
    Options,
    TokenizerSpec,
    check_inputs,
    check_outputs,
    output_prefix_for,
    preprocess,
)
from megagate.data.readers import expand_inputs
from megagate.errors import ConfigError, MegagateError
from megagate.files import write_atomic

SUMMARY = "summary.json"


def settings_of(spec: TokenizerSpec, opts: Options) -> dict[str, Any]:
    """What decides the output bytes (the tokenizer by content, not by path alone); workers and engine do not."""
    tok = spec.load()
    return {
        "tokenizer": os.path.abspath(spec.path),
        "tokenizer_sha256": tok.fingerprint(),
        "eod_token": spec.eod_token,
        "tiktoken_pattern": spec.tiktoken_pattern,
        "keys": list(opts.keys),
        "append_eod": opts.append_eod,
        "text_mode": opts.text_mode,
        "bad_lines": opts.bad_lines,
        "chunk_bytes": opts.chunk_bytes,
    }


def plan(
    inputs: Sequence[str | os.PathLike],
    output_prefix: str,
    spec: TokenizerSpec,
    opts: Options,
    unit_bytes: int,
    tasks: int | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Cut the inputs into units and write the manifest (the same inputs and settings give the same plan)."""
    files = expand_inputs(inputs)
    check_inputs(files, opts.keys)
    manifest = U.make_plan(files, settings_of(spec, opts), unit_bytes, tasks)
    manifest["output_prefix"] = os.path.abspath(output_prefix)
    return U.write_manifest(U.units_dir(output_prefix), manifest, overwrite)


def select_units(manifest: dict[str, Any], unit: int | None = None, task: int | None = None) -> list[int]:
    """The unit ids of `--unit K` or of `--task-id K` (one line naming the allowed range otherwise)."""
    n, tasks = len(manifest["units"]), manifest["tasks"]
    if unit is not None:
        if not 0 <= unit < n:
            raise ConfigError(f"--unit {unit}: the plan has units 0..{n - 1}")
        return [unit]
    if task is not None:
        if not 0 <= task < tasks:
            raise ConfigError(f"--task-id {task}: the plan has tasks 0..{tasks - 1}")
        return [u["id"] for u in manifest["units"] if u["task"] == task]
    return [u["id"] for u in manifest["units"]]


@dataclass
class UnitRecord:
    """What one unit produced (its done record, and the summary's row)."""

    unit: int
    documents: int
    tokens: int
    text_bytes: int
    disk_bytes: int
    bad_lines: int
    seconds: float
    skipped: bool = False  # already done with unchanged inputs: not redone


def run_units(
    output_prefix: str,
    spec: TokenizerSpec,
    workers: int | None,
    ids: Sequence[int],
    progress: bool = True,
    log=None,
) -> list[UnitRecord]:
    """Process the units `ids` that are not done yet; each is published whole (its done record last) or not at all."""
    udir = U.units_dir(output_prefix)
    manifest = U.read_manifest(udir)
    settings = manifest["settings"]
    done = U.done_units(udir, manifest)
    out = []
    for k in ids:
        unit = manifest["units"][k]
        U.check_unchanged(unit)  # done or not: a unit's inputs must still be the planned ones
        if k in done:
            rec = {f: done[k][f] for f in ("documents", "tokens", "text_bytes", "disk_bytes", "bad_lines", "seconds")}
            out.append(UnitRecord(unit=k, skipped=True, **rec))
            continue
        res = preprocess(
            [p["path"] for p in unit["inputs"]],
            U.unit_prefix(udir, k),
            spec,
            keys=settings["keys"],
            append_eod=settings["append_eod"],
            workers=workers,
            text_mode=settings["text_mode"],
            bad_lines=settings["bad_lines"],
            chunk_bytes=settings["chunk_bytes"],
            overwrite=True,
            progress=progress,
            log=log,
            pieces=U.pieces(unit),
            allow_empty=True,
        )
        rec = UnitRecord(k, res.documents, res.total_tokens, res.text_bytes, unit["bytes"], res.bad_lines, res.seconds)
        U.write_done(udir, unit, {f: v for f, v in asdict(rec).items() if f not in ("unit", "skipped")})
        out.append(rec)
    return out


def missing_units(output_prefix: str) -> tuple[dict[str, Any], list[int]]:
    """(manifest, ids of the units not done: missing, interrupted, or planned from inputs that changed since)."""
    udir = U.units_dir(output_prefix)
    manifest = U.read_manifest(udir)
    done = U.done_units(udir, manifest)
    return manifest, [u["id"] for u in manifest["units"] if u["id"] not in done]


@dataclass
class MergeResult:
    prefixes: dict[str, str]
    documents: int = 0
    tokens: dict[str, int] = field(default_factory=dict)
    bytes_copied: int = 0
    seconds: float = 0.0
    units: list[dict[str, Any]] = field(default_factory=list)


def merge(output_prefix: str, overwrite: bool = False) -> MergeResult:
    """All units, in manifest order, into `<prefix>_<key>_document.{bin,idx,meta.json}`; all keys or nothing."""
    t0 = time.perf_counter()
    udir = U.units_dir(output_prefix)
    manifest, missing = missing_units(output_prefix)
    n = len(manifest["units"])
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise MegagateError(
            f"merge: {len(missing)} of {n} units not done ({shown}: missing, interrupted, or their inputs changed); "
            "rerun the same command to process them; nothing written"
        )
    keys = manifest["settings"]["keys"]
    prefixes = {k: output_prefix_for(output_prefix, k) for k in keys}
    check_outputs(prefixes, overwrite)
    records = U.done_units(udir, manifest)
    result = MergeResult(prefixes, tokens={k: 0 for k in keys}, units=[records[i] for i in range(n)])
    result.documents = sum(r["documents"] for r in result.units)
    if result.documents == 0:
        raise MegagateError(f"merge: no valid documents in any of the {n} units of {udir}; nothing written")
    writers: dict[str, IndexedWriter] = {}
    metas: list[tuple[str, str]] = []
    try:
        for key, final in prefixes.items():
            sources = [output_prefix_for(U.unit_prefix(udir, i), key) for i in range(n)]
            writers[key] = w = IndexedWriter(final, read_index_header(sources[0] + ".idx")[0].type)
            for src in sources:
                w.append_dataset(src)
                result.bytes_copied += os.path.getsize(src + ".bin")
            result.tokens[key] = w.tokens
            w.write_index()
            metas.append(_merged_meta(sources[0], final, w))
        for w in writers.values():
            w.commit()
        for tmp, path in metas:
            os.replace(tmp, path)
    except BaseException:
        for w in writers.values():
            w.abort()
        for tmp, _ in metas:
            Path(tmp).unlink(missing_ok=True)
        raise
    result.seconds = time.perf_counter() - t0
    summary = {"output_prefix": os.path.abspath(output_prefix), "documents": result.documents}
    summary |= {"tokens": result.tokens, "merge_seconds": result.seconds, "units": result.units}
    write_atomic(udir / SUMMARY, json.dumps(summary, indent=1) + "\n")
    return result


def _merged_meta(unit_prefix: str, final: str, w: IndexedWriter) -> tuple[str, str]:
    """The single run's `.meta.json`: a unit's (same tokenizer and settings) with the merged counts."""
    with open(unit_prefix + ".meta.json") as f:
        meta = json.load(f)
    meta["documents"], meta["tokens"] = w.documents, w.tokens
    path = final + ".meta.json"
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps(meta, indent=2) + "\n")
    return tmp, path


def measure_rate(manifest: dict[str, Any], spec: TokenizerSpec, seconds: float = 1.0) -> dict[str, float]:
    """Tokens/s and input bytes/s of one worker, measured on the first unit's first chunks (about `seconds`):
    the figure the plan's ETA is made of. Input bytes are on-disk bytes (compressed for .gz, .zst, Parquet)."""
    import numpy as np

    from megagate.data import preprocess as P
    from megagate.data.indexed import token_dtype
    from megagate.data.readers import iter_chunks

    s = manifest["settings"]
    tok = spec.load()
    P._init_worker(spec, s["keys"], s["append_eod"], np.dtype(token_dtype(tok.vocab_size)), threads=False)
    disk = [0]
    pieces = U.pieces(manifest["units"][0])
    chunks = iter_chunks(pieces, s["text_mode"], s["chunk_bytes"], lambda b: disk.__setitem__(0, b), s["keys"])
    tokens = text = 0
    t0 = time.perf_counter()
    for chunk in chunks:
        res = P._work(chunk)
        tokens += sum(int(t.size) for t, _ in res.per_key)
        text += chunk.nbytes
        if time.perf_counter() - t0 >= seconds:
            break
    dt = max(time.perf_counter() - t0, 1e-9)
    # on-disk bytes per text byte of what was read (the reader reports its position between chunks: 1 until then)
    ratio = disk[0] / text if disk[0] and text else 1.0
    return {"tokens_per_s": tokens / dt, "disk_bytes_per_s": text * ratio / dt}


def write_blend(output_prefix: str) -> dict[str, Path]:
    """The merge's alternative: `<prefix>_<key>_blend.yaml` per key, a `data:` section whose `blend` lists every
    unit's dataset with its token count as the weight (sampling in proportion to size, as the merged file would);
    all units must be done, as for the merge."""
    import yaml

    udir = U.units_dir(output_prefix)
    manifest, missing = missing_units(output_prefix)
    if missing:
        raise MegagateError(
            f"blend: {len(missing)} of {len(manifest['units'])} units not done ({', '.join(map(str, missing[:10]))}); "
            "rerun the same command to process them; nothing written"
        )
    out = {}
    for key in manifest["settings"]["keys"]:
        blend: list[str] = []
        for unit in manifest["units"]:
            prefix = output_prefix_for(U.unit_prefix(udir, unit["id"]), key)
            dtype, n, _ = read_index_header(prefix + ".idx")
            tokens = os.path.getsize(prefix + ".bin") // dtype.itemsize
            if n:  # a unit that kept no document has nothing to sample
                blend += [str(tokens), prefix]
        path = Path(f"{output_prefix_for(output_prefix, key)[: -len('_document')]}_blend.yaml")
        doc = {"data": {"blend": blend, "tokenizer": manifest["settings"]["tokenizer"]}}
        write_atomic(path, yaml.safe_dump(doc, sort_keys=False))
        out[key] = path
    return out
