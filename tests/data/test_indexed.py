import filecmp

import numpy as np
import pytest

from megagate.data import indexed
from megagate.data.indexed import IndexedWriter, open_indexed, read_document, validate
from megagate.errors import MegagateError


def _docs(n=2500, seed=0, high=60000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=int(rng.integers(1, 300))) for _ in range(n)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_writer_is_byte_identical_to_megatron_builder(tmp_path, monkeypatch, dtype):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    docs = _docs()
    ref = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype)
    for d in docs:
        ref.add_document(torch.from_numpy(d), [len(d)])
    ref.finalize(str(tmp_path / "ref.idx"))
    monkeypatch.setattr(indexed, "_BLOCK", 333)  # exercise the block-wise pointer computation
    w = IndexedWriter(tmp_path / "mine", dtype)
    for i in range(0, len(docs), 97):
        part = docs[i : i + 97]
        w.add_documents(np.concatenate(part), np.array([len(d) for d in part]))
    w.finalize()
    for suffix in (".bin", ".idx"):
        assert filecmp.cmp(tmp_path / f"ref{suffix}", tmp_path / f"mine{suffix}", shallow=False)
    ds = open_indexed(str(tmp_path / "mine"))
    assert len(ds) == len(docs)
    assert all(np.array_equal(ds[i], docs[i]) for i in (0, 1, 1234, len(docs) - 1))
    assert np.array_equal(read_document(str(tmp_path / "mine"), 1234), docs[1234])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.bin", "mine.idx", "ref.bin", "ref.idx"]


def _write(tmp_path, name="d", docs=None):
    w = IndexedWriter(tmp_path / name, np.uint16)
    for d in docs or _docs(200):
        w.add_document(d)
    w.finalize()
    return str(tmp_path / name)


def test_damaged_files_give_one_line_errors_naming_the_file(tmp_path):
    prefix = _write(tmp_path)
    info = validate(prefix, vocab_size=60000)
    assert info["documents"] == 200
    bin_bytes = open(prefix + ".bin", "rb").read()
    idx_bytes = open(prefix + ".idx", "rb").read()

    open(prefix + ".bin", "wb").write(bin_bytes[:-10])
    with pytest.raises(MegagateError, match=r"d\.bin: size .* does not match its index"):
        validate(prefix)
    open(prefix + ".bin", "wb").write(bin_bytes)

    open(prefix + ".idx", "wb").write(idx_bytes[:-8])
    with pytest.raises(MegagateError, match=r"d\.idx: corrupt or truncated index"):
        validate(prefix)
    open(prefix + ".idx", "wb").write(idx_bytes[:20])
    with pytest.raises(MegagateError, match=r"d\.idx: truncated index"):
        validate(prefix)
    open(prefix + ".idx", "wb").write(b"XXXXXXXXX" + idx_bytes[9:])
    with pytest.raises(MegagateError, match=r"d\.idx: not a megatron index file"):
        validate(prefix)
    # same size, scrambled pointer table
    bad = bytearray(idx_bytes)
    bad[34 + 4 * 200 + 8 * 5] ^= 0x40
    open(prefix + ".idx", "wb").write(bytes(bad))
    with pytest.raises(MegagateError, match=r"d\.idx: corrupt index: pointer of sequence 5"):
        validate(prefix)
    open(prefix + ".idx", "wb").write(idx_bytes)
    with pytest.raises(MegagateError, match=r"d\.bin: token id \d+ >= vocabulary size 100"):
        validate(prefix, vocab_size=100)
    (tmp_path / "d.idx").unlink()
    with pytest.raises(MegagateError, match=r"d\.idx: missing"):
        open_indexed(prefix)


def test_abort_leaves_nothing(tmp_path):
    w = IndexedWriter(tmp_path / "x", np.uint16)
    w.add_document(np.arange(10))
    assert any(p.name.startswith("x.bin.tmp-") for p in tmp_path.iterdir())
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    stale = tmp_path / "x.bin.tmp-999999999"
    stale.write_bytes(b"half")
    _write(tmp_path, "x")
    assert not stale.exists()
