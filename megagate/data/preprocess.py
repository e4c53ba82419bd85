"""Parallel, streaming, atomic preprocessing of text into megatron-core `IndexedDataset` files.

    preprocess(inputs, output_prefix, tokenizer, keys=("text",), append_eod=True, workers=2)

Pipeline: the main process cuts the inputs into ~1 MB chunks (`readers.iter_chunks`) and hands them to a pool
of worker processes (forked, each with its own tokenizer, single-threaded); workers decode, parse, validate
and tokenize a chunk and return compact token arrays; the main process writes results strictly in chunk order
(`indexed.IndexedWriter`). At most `2 x workers` chunks are in flight, so memory is bounded whatever the input
size, and the output bytes do not depend on the number of workers.

Outputs: one dataset per JSON key, named like Megatron-LM's tool: `<output_prefix>_<key>_document.{bin,idx}`,
plus `<...>.meta.json` naming the tokenizer (used by `megagate data inspect`). Every key's dataset is
finalized (Megatron-LM's `preprocess_data.py` finalized only the last key). Files are written under
temporary names and renamed when complete.

Bad records (invalid JSON, not an object, missing key, non-string, empty text, non-UTF-8; a null or blank
Parquet value) are counted by reason and reported with file and line (or row); `bad_lines="skip"` drops them,
`"error"` stops at the first one with nothing written.

The run is a record first: `check_options`, `check_inputs`, `check_outputs`, then `_Run` (open the writers,
tokenize in order, `account` each result, `commit` all keys or none) fills a `PreprocessResult`; the command
renders it (`megagate.commands.preprocess.render_result`). `pieces=` runs the same pipeline over parts of the
inputs: a work unit of a sharded run (`megagate.data.shards`).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megagate.data.indexed import IndexedWriter, name_write_errors, token_dtype
from megagate.data.readers import (
    TEXT_MODES,
    BadLine,
    Chunk,
    Piece,
    expand_inputs,
    input_kind,
    iter_chunks,
    parse_chunk,
    piece_disk_bytes,
)
from megagate.errors import ConfigError, MegagateError, require
from megagate.files import check_writable_dir

BAD_LINE_POLICIES = ("skip", "error")


@dataclass
class TokenizerSpec:
    """How workers load the tokenizer (they cannot receive the object: Rust tokenizers do not pickle)."""

    path: str
    engine: str = "auto"
    eod_token: str | None = None
    pad_token: str | None = None
    tiktoken_pattern: str = "cl100k"

    def load(self):
        from megagate.data.tokenizer import load_tokenizer

        return load_tokenizer(self.path, self.engine, self.eod_token, self.pad_token, self.tiktoken_pattern)


@dataclass
class ChunkResult:
    seq: int
    per_key: list[tuple[np.ndarray, np.ndarray]]  # (tokens, lengths) for each key
    documents: int
    text_bytes: int
    bad: list[BadLine]
    blank: int


@dataclass
class PreprocessResult:
    prefixes: dict[str, str]  # key -> output prefix
    documents: int = 0
    tokens: dict[str, int] = field(default_factory=dict)
    text_bytes: int = 0
    bad_lines: int = 0
    bad_by_reason: dict[str, int] = field(default_factory=dict)
    blank_lines: int = 0
    seconds: float = 0.0
    engine: str = ""

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens.values())


# ---------------------------------------------------------------- worker side
_W: dict = {}


def _init_worker(spec: TokenizerSpec, keys: Sequence[str], append_eod: bool, dtype, threads: bool) -> None:
    # One thread per worker: N workers use N cores; HF's own thread pool would oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads else "false"
    if not threads:  # a forked pool worker: the main process handles Ctrl-C and SIGTERM and then stops us
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    tok = spec.load()
    _W.update(tok=tok, keys=tuple(keys), append_eod=append_eod, dtype=np.dtype(dtype))


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    tok = _W["tok"]
    engine = getattr(tok, "engine", None)
    if engine is not None:
        flat, lengths = engine.encode_flat(texts)
    else:
        arrays = tok.encode_batch(texts)
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    if _W["append_eod"] and len(lengths):
        flat = np.insert(flat, np.cumsum(lengths), tok.eod)
        lengths = lengths + 1
    return flat.astype(_W["dtype"]), lengths


def _work(chunk: Chunk) -> ChunkResult:
    keys = _W["keys"]
    texts, bad, blank = parse_chunk(chunk, keys if chunk.kind in ("jsonl", "parquet") else keys[:1])
    per_key = [_encode(t) for t in texts]
    docs = len(texts[0])
    # A text that tokenizes to nothing cannot be stored (megatron needs >= 1 token per document); report it.
    empty = np.zeros(docs, dtype=bool)
    for _, lengths in per_key:
        empty |= lengths == 0
    if empty.any():
        idx = np.flatnonzero(empty)
        for i in idx:
            bad.append(BadLine(chunk.file, chunk.line0, f"text #{int(i)} of the chunk starting here has no tokens"))
        keep = ~empty
        new = []
        for tokens, lengths in per_key:
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            parts = [tokens[s : s + n] for s, n, k in zip(starts, lengths, keep) if k]
            new.append((np.concatenate(parts) if parts else tokens[:0], lengths[keep]))
        per_key, docs = new, int(keep.sum())
    return ChunkResult(chunk.seq, per_key, docs, chunk.nbytes, bad, blank)


# ---------------------------------------------------------------- main side
def _ordered(pool, chunks: Iterable[Chunk], window: int) -> Iterator[ChunkResult]:
    """Results in submission order with at most `window` chunks in flight (bounded memory)."""
    pending: deque = deque()
    for chunk in chunks:
        pending.append(pool.apply_async(_work, (chunk,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron-LM's naming: `<output_prefix>_<key>_document`."""
    return f"{output_prefix}_{key}_document"


@dataclass(frozen=True)
class Options:
    """The checked settings of one preprocessing run (everything but the inputs and the outputs)."""

    keys: tuple[str, ...]
    append_eod: bool
    workers: int
    text_mode: str
    bad_lines: str
    chunk_bytes: int


def check_options(
    keys: Sequence[str],
    append_eod: bool = True,
    workers: int | None = None,
    text_mode: str = "file",
    bad_lines: str = "skip",
    chunk_bytes: int = 1 << 20,
) -> Options:
    """Validate the settings (one line naming the bad value and what is allowed); `workers=None`: one per core."""
    keys = tuple(keys)
    require(len(keys) >= 1, "no JSON key given (--json-keys needs at least one key)")
    require(len(set(keys)) == len(keys), f"JSON keys {list(keys)}: each key may appear once")
    for k in keys:
        require(bool(k) and "/" not in k, f"JSON key {k!r}: must be non-empty and contain no '/'")
    require(
        bad_lines in BAD_LINE_POLICIES,
        f"bad-line policy {bad_lines!r}: allowed values are {', '.join(BAD_LINE_POLICIES)}",
    )
    workers = (os.cpu_count() or 1) if workers is None else workers
    require(0 <= workers <= 1024, f"workers={workers}: must be between 0 and 1024")
    require(chunk_bytes >= 1024, f"chunk_bytes={chunk_bytes}: must be at least 1024")
    require(text_mode in TEXT_MODES, f"text mode {text_mode!r}: allowed values are {', '.join(TEXT_MODES)}")
    return Options(keys, append_eod, workers, text_mode, bad_lines, chunk_bytes)


def check_inputs(files: Sequence[Path], keys: Sequence[str]) -> None:
    """Several JSON keys need JSONL or Parquet inputs (a text file has one text per document); every Parquet
    footer is readable and has a string column per key (refused here, before any worker starts)."""
    from megagate.data.formats import check_columns, open_parquet

    for f in files:
        if input_kind(f) == "parquet":
            check_columns(f, open_parquet(f), keys)
    if len(keys) > 1:
        text_files = [str(f) for f in files if input_kind(f) == "text"]
        require(
            not text_files,
            f"input {text_files[0] if text_files else ''!r} is plain text, which has one text per document; several JSON keys need JSONL or Parquet inputs",
        )


def check_outputs(prefixes: dict[str, str], overwrite: bool) -> None:
    """No output is a folder; existing outputs only with `overwrite`."""
    for p in prefixes.values():
        for suffix in (".bin", ".idx", ".meta.json"):
            if os.path.isdir(p + suffix):
                raise ConfigError(f"output {p + suffix!r} is a folder; choose another --output-prefix")
        for suffix in (".bin", ".idx"):
            if os.path.exists(p + suffix) and not overwrite:
                raise ConfigError(f"output {p + suffix!r} already exists; pass --overwrite to replace it")


def preprocess(
    inputs: Sequence[str | os.PathLike],
    output_prefix: str,
    tokenizer: str | TokenizerSpec,
    keys: Sequence[str] = ("text",),
    append_eod: bool = True,
    workers: int | None = None,
    text_mode: str = "file",
    bad_lines: str = "skip",
    chunk_bytes: int = 1 << 20,
    overwrite: bool = False,
    progress: bool = True,
    max_reported: int = 20,
    log=None,
    pieces: Sequence[Piece] | None = None,
    allow_empty: bool = False,
) -> PreprocessResult:
    """Tokenize `inputs` into one IndexedDataset per key; see the module docstring.

    `workers=0` tokenizes in this process (HF may then use its own threads); `None` means one per CPU core.
    `pieces`: read only these parts of the inputs (a work unit); `allow_empty`: a unit may keep no document.
    """
    opts = check_options(keys, append_eod, workers, text_mode, bad_lines, chunk_bytes)
    spec = tokenizer if isinstance(tokenizer, TokenizerSpec) else TokenizerSpec(str(tokenizer))
    files = expand_inputs(inputs)
    check_writable_dir(os.path.dirname(os.path.abspath(output_prefix)), f"output prefix {output_prefix!r}: folder")
    check_inputs(files, opts.keys)
    prefixes = {k: output_prefix_for(output_prefix, k) for k in opts.keys}
    check_outputs(prefixes, overwrite)
    run = _Run(opts, spec, prefixes, log or (lambda msg: print(msg, file=sys.stderr, flush=True)), max_reported)
    work = list(pieces) if pieces is not None else [Piece(f) for f in files]
    run.execute(work, progress, allow_empty, inputs)
    return run.result


class _Run:
    """One run's phases: open writers, tokenize in order, account each result, commit everything or nothing."""

    def __init__(self, opts: Options, spec: TokenizerSpec, prefixes: dict[str, str], log, max_reported: int) -> None:
        self.opts, self.spec, self.prefixes, self.log, self.max_reported = opts, spec, prefixes, log, max_reported
        self.tok = spec.load()  # in the main process only for metadata (vocabulary size, eod) and early errors
        self.dtype = token_dtype(self.tok.vocab_size)
        self.result = PreprocessResult(prefixes=prefixes, tokens={k: 0 for k in opts.keys}, engine=self.tok.name)
        self.reasons: Counter = Counter()
        self.skipped: list[str] = []  # the first bad records' messages: printed once a document is kept
        self.writers: dict[str, IndexedWriter] = {}
        self.metas: list[tuple[Path, Path]] = []

    def execute(self, work: Sequence[Piece], progress: bool, allow_empty: bool, inputs) -> None:
        from megagate.data.progress import Progress

        opts = self.opts
        self.prog = prog = Progress(sum(piece_disk_bytes(p) for p in work), enabled=progress)
        reader_pos = [0]
        chunks = iter_chunks(work, opts.text_mode, opts.chunk_bytes, lambda b: reader_pos.__setitem__(0, b), opts.keys)
        pool = None
        try:
            for k, p in self.prefixes.items():  # one at a time: a failure on the second still aborts the first
                self.writers[k] = IndexedWriter(p, self.dtype)
            if opts.workers == 0:
                _init_worker(self.spec, opts.keys, opts.append_eod, self.dtype, threads=True)
                results: Iterator[ChunkResult] = map(_work, chunks)
            else:
                # fork: starts in milliseconds and works from unguarded scripts (spawn re-runs `__main__`). Workers
                # set TOKENIZERS_PARALLELISM=false, so HF never uses a thread pool inherited from this process.
                ctx = mp.get_context("fork")
                initargs = (self.spec, opts.keys, opts.append_eod, self.dtype, False)
                pool = ctx.Pool(opts.workers, initializer=_init_worker, initargs=initargs)
                results = _ordered(pool, chunks, window=2 * opts.workers)
            for res in results:
                self.account(res, reader_pos[0])
            if self.result.documents == 0 and not allow_empty:
                first = f", first: {self.skipped[0].removeprefix('skipped ')}" if self.skipped else ""
                raise MegagateError(
                    f"no valid documents in {', '.join(map(str, inputs))} ({self.result.bad_lines} bad records{first}); "
                    "nothing written"
                )
            self.commit()
        except BaseException:
            if prog.enabled and prog.tty and prog.last_draw:  # end the redrawn progress line before the error
                prog.stream.write("\n")
            for w in self.writers.values():
                w.abort()
            for tmp, _ in self.metas:
                tmp.unlink(missing_ok=True)
            raise
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
        prog.update(disk_done=prog.total_bytes)  # the reader reports its last position after the last result
        prog.close()
        self.result.seconds = prog.elapsed
        self.result.bad_by_reason = dict(self.reasons)
        if self.result.bad_lines > self.max_reported:
            self.log(f"... {self.result.bad_lines - self.max_reported} more bad records not shown")

    def account(self, res: ChunkResult, disk_done: int) -> None:
        """Write one chunk's documents and count it (bad records first: `error` stops before anything is kept)."""
        result = self.result
        for bad in res.bad:
            self.reasons[bad.reason.split(" (")[0]] += 1
            if self.opts.bad_lines == "error":
                raise MegagateError(f"bad input record {bad} (pass --bad-lines skip to skip such records)")
            if result.bad_lines < self.max_reported:
                self.skipped.append(f"skipped {bad}")
            result.bad_lines += 1
        for key, (tokens, lengths) in zip(self.opts.keys, res.per_key):
            self.writers[key].add_documents(tokens, lengths)
            result.tokens[key] += int(tokens.size)
        result.documents += res.documents
        if result.documents and self.skipped:
            for line in self.skipped:
                self.log(line)
            self.skipped.clear()
        result.text_bytes += res.text_bytes
        result.blank_lines += res.blank
        _test_hold(res.seq, next(iter(self.prefixes.values())))
        if not result.documents:  # nothing kept yet: no display (an input that fails at once prints one line)
            return
        self.prog.update(
            docs=res.documents,
            tokens=sum(int(t.size) for t, _ in res.per_key),
            text_bytes=result.text_bytes - self.prog.text_bytes,  # with what came before the first kept document
            bad=result.bad_lines - self.prog.bad,
            disk_done=disk_done,
        )

    def commit(self) -> None:
        """Everything is written under temporary names first (a full disk fails here), then renamed: no output of
        any key appears unless all of them are complete."""
        for key, w in self.writers.items():
            w.write_index()
            self.metas.append(_write_meta(self.prefixes[key], self.spec, self.tok, key, self.opts.append_eod, w))
        for w in self.writers.values():
            w.commit()
        for tmp, path in self.metas:
            os.replace(tmp, path)


def _test_hold(seq: int, prefix: str) -> None:
    """Fault injection for the kill tests: with MEGAGATE_PREPROCESS_HOLD=TEXT:FILE, a run whose output prefix
    contains TEXT creates FILE once its first chunk is written (its temporary files exist) and waits to be killed;
    a real run never sets it."""
    text, _, hold = os.environ.get("MEGAGATE_PREPROCESS_HOLD", "").partition(":")
    if hold and seq == 0 and text in prefix:
        import time

        from megagate.files import write_atomic

        write_atomic(hold, str(os.getpid()))  # atomically: the test reads the pid as soon as the file exists
        while True:
            time.sleep(1)


def _write_meta(
    prefix: str, spec: TokenizerSpec, tok, key: str, append_eod: bool, w: IndexedWriter
) -> tuple[Path, Path]:
    """Write `<prefix>.meta.json` under a temporary name; (temporary, final) path for the caller to rename."""
    meta = {
        "tokenizer": os.path.abspath(spec.path),
        "tokenizer_sha256": tok.fingerprint(),
        "tiktoken_pattern": spec.tiktoken_pattern,
        "eod": tok.eod,
        "vocab_size": tok.vocab_size,
        "json_key": key,
        "append_eod": append_eod,
        "documents": w.documents,
        "tokens": w.tokens,
    }
    path = Path(prefix + ".meta.json")
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    try:
        with name_write_errors(str(path)), open(tmp, "w") as f:
            f.write(json.dumps(meta, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp, path
