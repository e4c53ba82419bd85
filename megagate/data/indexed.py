"""megatron-core `IndexedDataset` files: a streaming, atomic writer and a validating opener.

File format (megatron/core/datasets/indexed_dataset.py, `_IndexWriter`): the `.bin` holds all token ids
back to back in one dtype; the `.idx` holds

    b"MMIDIDX\\x00\\x00" | <Q version=1> | <B dtype code> | <Q sequence count n> | <Q document count n+1>
    | int32 lengths[n] | int64 byte pointers[n] | int64 document indices[n+1]

(one sequence per document: document indices are 0..n). megatron's `IndexedDatasetBuilder` keeps every
length in a Python list and builds the pointers in a Python loop; `IndexedWriter` streams lengths to a side
file and writes pointers in numpy blocks, so memory stays bounded, and produces byte-identical files
(tests compare both). All files are written under temporary names and renamed only when complete; the
`.idx` is renamed last, so a `.bin` without `.idx` (or nothing) is what an interrupted run leaves.

`open_indexed(prefix)` checks both files against each other before handing back megatron's
`IndexedDataset`, turning megatron's asserts (or silent garbage) on damaged files into one-line
`MegagateError`s that name the file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from megagate.errors import MegagateError

INDEX_HEADER = b"MMIDIDX\x00\x00"
HEADER_BYTES = 9 + 8 + 1 + 8 + 8
# megatron's DType codes
DTYPE_CODES = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_BLOCK = 1 << 20  # sequences per numpy block when writing the index


def token_dtype(vocab_size: int) -> type[np.number]:
    """Smallest dtype megatron reads for these ids: uint16 up to 65536 ids, else int32 (GPTDatasetConfig's rule)."""
    return np.uint16 if vocab_size <= 65536 else np.int32


@contextlib.contextmanager
def name_write_errors(path: str) -> Iterator[None]:
    """Give a write error without a file name (a full disk on write or flush) the name of the file being written
    (the final name: the temporary one is removed on the way out)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), path) from exc
        raise


def tmp_name(path: str | os.PathLike) -> str:
    return f"{path}.tmp-{os.getpid()}"


def remove_stale_temps(final_path: str | os.PathLike) -> None:
    """Delete `<final>.tmp-<pid>` files left by killed runs (only those whose process is gone)."""
    final = Path(final_path)
    for cand in final.parent.glob(final.name + ".tmp-*"):
        try:
            pid = int(cand.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            cand.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class IndexedWriter:
    """Write one megatron IndexedDataset (`<prefix>.bin/.idx`) from a stream of documents."""

    def __init__(self, prefix: str | os.PathLike, dtype: type[np.number]) -> None:
        if dtype not in DTYPE_CODES:
            raise MegagateError(f"token dtype {dtype}: allowed are {', '.join(d.__name__ for d in DTYPE_CODES)}")
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        self.code = DTYPE_CODES[dtype]
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        for suffix in (".bin", ".idx", ".lengths"):
            remove_stale_temps(self.prefix + suffix)
        self.bin_tmp = tmp_name(self.prefix + ".bin")
        self.idx_tmp = tmp_name(self.prefix + ".idx")
        self.len_tmp = tmp_name(self.prefix + ".lengths")
        self._bin = open(self.bin_tmp, "wb")
        try:
            self._len = open(self.len_tmp, "wb")
        except BaseException:
            self._bin.close()
            Path(self.bin_tmp).unlink(missing_ok=True)
            raise
        self.documents = 0
        self.tokens = 0
        self.max_length = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as concatenated `tokens` and per-document `lengths`."""
        if len(lengths) == 0:
            return
        if int(lengths.min()) < 1:
            raise ValueError("documents must hold at least one token")  # a programming error, not user input
        if tokens.dtype != self.dtype:
            tokens = tokens.astype(self.dtype)
        with name_write_errors(self.prefix + ".bin"):
            self._bin.write(tokens.tobytes())
        with name_write_errors(self.prefix + ".idx"):
            self._len.write(np.asarray(lengths, dtype=np.int32).tobytes())
        self.documents += len(lengths)
        self.tokens += int(tokens.size)
        self.max_length = max(self.max_length, int(lengths.max()))

    def append_dataset(self, prefix: str) -> None:
        """Append every document of the dataset `prefix` (same dtype): its `.bin` copied as bytes in blocks (the
        kernel's copy where it can), its lengths read from the `.idx` (a merge never holds a dataset in memory)."""
        dtype, n, _ = read_index_header(prefix + ".idx")
        if dtype != self.dtype:
            raise MegagateError(
                f"{prefix}.idx: tokens stored as {dtype.name}, the merged dataset uses {self.dtype.name}"
            )
        with name_write_errors(self.prefix + ".bin"), open(prefix + ".bin", "rb") as src:
            self._bin.flush()
            size = os.fstat(src.fileno()).st_size
            copied = 0
            try:
                while copied < size:
                    sent = os.copy_file_range(src.fileno(), self._bin.fileno(), size - copied)
                    if sent == 0:
                        break
                    copied += sent
            except OSError as exc:  # no in-kernel copy across these file systems: a plain block copy
                if copied or exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                shutil.copyfileobj(src, self._bin, 16 << 20)
                copied = size
            if copied != size:
                raise MegagateError(f"{prefix}.bin: changed while it was merged ({copied} of {size} bytes copied)")
        with name_write_errors(self.prefix + ".idx"), open(prefix + ".idx", "rb") as idx:
            idx.seek(HEADER_BYTES)
            left, top = n, 0
            while left:
                lengths = np.frombuffer(idx.read(4 * min(left, _BLOCK)), dtype=np.int32)
                self._len.write(lengths.tobytes())
                top = max(top, int(lengths.max()))
                self.tokens += int(lengths.sum(dtype=np.int64))
                left -= lengths.size
        self.documents += n
        self.max_length = max(self.max_length, top)

    def add_document(self, tokens: np.ndarray) -> None:
        self.add_documents(np.asarray(tokens), np.asarray([len(tokens)]))

    def finalize(self) -> tuple[str, str]:
        """Write the index, then rename `.bin` and `.idx` (in that order) to their final names."""
        self.write_index()
        return self.commit()

    def write_index(self) -> None:
        """Close the token file and write the complete index, both still under their temporary names (a full disk
        fails here, before any final name exists)."""
        with name_write_errors(self.prefix + ".bin"):
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
        with name_write_errors(self.prefix + ".idx"):
            self._len.close()
        with name_write_errors(self.prefix + ".idx"):
            self._write_index_file()

    def _write_index_file(self) -> None:
        n = self.documents
        itemsize = self.dtype.itemsize
        with open(self.idx_tmp, "wb") as out, open(self.len_tmp, "rb") as lens:
            out.write(INDEX_HEADER + struct.pack("<Q", 1) + struct.pack("<B", self.code))
            out.write(struct.pack("<Q", n) + struct.pack("<Q", n + 1))
            while block := lens.read(4 * _BLOCK):
                out.write(block)
            lens.seek(0)
            offset = 0
            while block := lens.read(4 * _BLOCK):
                lengths = np.frombuffer(block, dtype=np.int32).astype(np.int64)
                ends = np.cumsum(lengths * itemsize) + offset
                out.write((ends - lengths * itemsize).tobytes())
                offset = int(ends[-1])
            for start in range(0, n + 1, _BLOCK):
                out.write(np.arange(start, min(n + 1, start + _BLOCK), dtype=np.int64).tobytes())
            out.flush()
            os.fsync(out.fileno())
        os.unlink(self.len_tmp)

    def commit(self) -> tuple[str, str]:
        """Rename the written `.bin` and `.idx` (in that order) to their final names."""
        final_bin, final_idx = self.prefix + ".bin", self.prefix + ".idx"
        # An old .idx next to a new .bin would look finished: drop it before anything is renamed.
        Path(final_idx).unlink(missing_ok=True)
        os.replace(self.bin_tmp, final_bin)
        os.replace(self.idx_tmp, final_idx)
        return final_bin, final_idx

    def abort(self) -> None:
        """Close and delete the temporary files (the final names are never touched)."""
        for f in (self._bin, self._len):
            try:
                f.close()
            except OSError:
                pass
        for p in (self.bin_tmp, self.idx_tmp, self.len_tmp):
            Path(p).unlink(missing_ok=True)


def strip_suffix(prefix: str) -> str:
    """Accept `data.bin`, `data.idx` or `data` for the prefix `data`."""
    return prefix[:-4] if prefix.endswith((".bin", ".idx")) else prefix


def read_index_header(idx_path: str) -> tuple[np.dtype, int, int]:
    """(dtype, sequence count, document count) of an .idx, or a MegagateError naming the file."""
    try:
        size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as exc:
        raise MegagateError(f"{idx_path}: cannot read index ({exc.strerror})") from None
    if len(head) < HEADER_BYTES:
        raise MegagateError(f"{idx_path}: truncated index: {size} bytes, a header alone is {HEADER_BYTES}")
    if head[:9] != INDEX_HEADER:
        raise MegagateError(f"{idx_path}: not a megatron index file (header {head[:9]!r}, expected {INDEX_HEADER!r})")
    version = struct.unpack("<Q", head[9:17])[0]
    if version != 1:
        raise MegagateError(f"{idx_path}: index version {version}, only version 1 is supported")
    code = head[17]
    if code not in CODE_DTYPES:
        raise MegagateError(f"{idx_path}: unknown token dtype code {code} (allowed: {sorted(CODE_DTYPES)})")
    n, d = struct.unpack("<QQ", head[18:34])
    expected = HEADER_BYTES + 4 * n + 8 * n + 8 * d
    if size != expected and size != expected + n:  # + n: multimodal files carry one mode byte per sequence
        raise MegagateError(
            f"{idx_path}: corrupt or truncated index: {size} bytes, header promises {expected} ({n} sequences, {d} documents)"
        )
    return np.dtype(CODE_DTYPES[code]), n, d


def validate(prefix: str, vocab_size: int | None = None) -> dict:
    """Check `.idx` and `.bin` against each other; return counts. Raises MegagateError naming the bad file."""
    prefix = strip_suffix(str(prefix))
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for p in (idx_path, bin_path):
        if not os.path.isfile(p):
            raise MegagateError(
                f"{p}: missing (a dataset prefix needs both .bin and .idx; was preprocessing interrupted?)"
            )
    dtype, n, d = read_index_header(idx_path)
    mm = np.memmap(idx_path, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(mm, dtype=np.int32, count=n, offset=HEADER_BYTES)
    pointers = np.frombuffer(mm, dtype=np.int64, count=n, offset=HEADER_BYTES + 4 * n)
    docs = np.frombuffer(mm, dtype=np.int64, count=d, offset=HEADER_BYTES + 12 * n)
    if n and (lengths.min() < 0):
        raise MegagateError(f"{idx_path}: corrupt index: negative sequence length")
    expected_ptr = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize)]) if n else pointers
    if n and not np.array_equal(pointers, expected_ptr):
        bad = int(np.argmax(pointers != expected_ptr))
        raise MegagateError(
            f"{idx_path}: corrupt index: pointer of sequence {bad} is {int(pointers[bad])}, lengths say {int(expected_ptr[bad])}"
        )
    if d == 0 or docs[0] != 0 or docs[-1] != n or (d > 1 and np.any(np.diff(docs) < 0)):
        raise MegagateError(f"{idx_path}: corrupt index: document indices must rise from 0 to {n}")
    total = int(lengths.astype(np.int64).sum())
    bin_size = os.path.getsize(bin_path)
    if bin_size != total * dtype.itemsize:
        raise MegagateError(
            f"{bin_path}: size {bin_size} bytes does not match its index ({total} tokens x {dtype.itemsize} bytes = {total * dtype.itemsize}); truncated or from another run"
        )
    if vocab_size is not None and total:
        top = _max_token(bin_path, dtype, total)
        if top >= vocab_size:
            raise MegagateError(
                f"{bin_path}: token id {top} >= vocabulary size {vocab_size} (wrong tokenizer or corrupt data)"
            )
    return {"dtype": dtype, "sequences": n, "documents": d - 1, "tokens": total, "lengths": np.array(lengths)}


def _max_token(bin_path: str, dtype: np.dtype, total: int) -> int:
    mm = np.memmap(bin_path, mode="r", dtype=dtype)
    top = 0
    for start in range(0, total, 1 << 24):
        top = max(top, int(mm[start : start + (1 << 24)].max()))
    return top


def read_document(prefix: str, i: int) -> np.ndarray:
    """Tokens of sequence `i`, read with numpy alone (no torch/megatron import: fast for CLI tools)."""
    prefix = strip_suffix(str(prefix))
    dtype, n, _ = read_index_header(prefix + ".idx")
    mm = np.memmap(prefix + ".idx", mode="r", dtype=np.uint8)
    length = int(np.frombuffer(mm, dtype=np.int32, count=1, offset=HEADER_BYTES + 4 * i)[0])
    pointer = int(np.frombuffer(mm, dtype=np.int64, count=1, offset=HEADER_BYTES + 4 * n + 8 * i)[0])
    return np.array(np.memmap(prefix + ".bin", mode="r", dtype=dtype, offset=pointer, shape=(length,)))


def open_indexed(prefix: str, vocab_size: int | None = None):
    """Validate, then return megatron's `IndexedDataset` for `prefix`."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = strip_suffix(str(prefix))
    validate(prefix, vocab_size)
    return IndexedDataset(prefix, multimodal=False, mmap=True)
