import numpy as np
import pytest
import torch

from megagate.data.corpus import write_jsonl
from megagate.data.loader import build_datasets, build_loader, parse_blend
from megagate.data.preprocess import preprocess
from megagate.data.sampler import BATCH_KEYS, PretrainingSampler
from megagate.data.tokenizer import load_tokenizer
from megagate.errors import ConfigError, MegagateError


@pytest.fixture(scope="module")
def two_prefixes(small_docs, small_tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("blend")

    # paragraphs as documents: hundreds of documents, so every split gets some
    def paragraphs(docs):
        return [{"text": p} for x in docs for p in x["text"].split("\n\n") if p.strip()]

    prose = paragraphs(x for x in small_docs if x["source"] != "code")
    code = paragraphs(x for x in small_docs if x["source"] == "code")
    assert len(prose) > 200 and len(code) > 200
    a = preprocess([write_jsonl(prose, d / "prose.jsonl")], str(d / "prose"), small_tok, workers=0, progress=False)
    b = preprocess([write_jsonl(code, d / "code.jsonl")], str(d / "code"), small_tok, workers=0, progress=False)
    return a.prefixes["text"], b.prefixes["text"]


def test_parse_blend_forms():
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend(["0.7", "a", "0.3", "b"]) == (["a", "b"], [0.7, 0.3])
    assert parse_blend([(2, "a"), (1, "b")]) == (["a", "b"], [2.0, 1.0])
    with pytest.raises(ConfigError, match="blend weight '-1': must be a positive number"):
        parse_blend(["-1", "a", "1", "b"])


def test_blend_with_splits_and_cache_reuse(two_prefixes, small_tok, tmp_path):
    from megatron.core.datasets.blended_dataset import BlendedDataset

    tok = load_tokenizer(small_tok)
    kw = dict(
        tokenizer=tok, seq_length=64, num_samples=(400, 40, 20), split="90,5,5", seed=11, cache_dir=tmp_path / "cache"
    )
    blend = [(0.7, two_prefixes[0]), (0.3, two_prefixes[1])]
    train, valid, test = build_datasets(blend, **kw)
    assert isinstance(train, BlendedDataset) and len(train) >= 400 and len(valid) >= 40 and len(test) >= 20
    share = np.bincount(train.dataset_index[:400], minlength=2) / 400
    assert abs(share[0] - 0.7) < 0.02  # weights honoured
    cached = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*") if p.is_file()}
    assert len(cached) >= 10 and any(p.suffix == ".npy" for p in cached)
    train2, valid2, _ = build_datasets(blend, **kw)  # a second run: loads the cached indices
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*") if p.is_file()} == cached
    for i in (0, 17, 399):
        assert torch.equal(train[i]["tokens"], train2[i]["tokens"])
    assert torch.equal(valid[5]["labels"], valid2[5]["labels"])
    # a different seed is a different shuffle, in new cache files
    other, _, _ = build_datasets(blend, **{**kw, "seed": 12})
    assert not all(torch.equal(train[i]["tokens"], other[i]["tokens"]) for i in range(8))


def test_damaged_prefix_is_reported_by_name(two_prefixes, small_tok, tmp_path):
    import shutil

    for suffix in (".bin", ".idx"):
        shutil.copy(two_prefixes[0] + suffix, tmp_path / f"p{suffix}")
    with open(tmp_path / "p.bin", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(MegagateError, match=r"p\.bin: size 1000 bytes does not match its index"):
        build_datasets([str(tmp_path / "p")], tokenizer=small_tok, seq_length=32, num_samples=(10, 0, 0), split="1,0,0")


def test_split_without_documents_is_refused(small_tok, tmp_path):
    res = preprocess(
        [write_jsonl([{"text": f"doc {i}"} for i in range(5)], tmp_path / "c.jsonl")],
        str(tmp_path / "p"),
        small_tok,
        workers=0,
        progress=False,
    )
    with pytest.raises(
        ConfigError, match="split '90,5,5' gives the test split no documents of .*p_text_document \\(5 documents\\)"
    ):
        build_datasets(
            [res.prefixes["text"]], tokenizer=small_tok, seq_length=8, num_samples=(10, 2, 2), split="90,5,5"
        )


def test_sampler_resume_and_data_parallel_slices():
    full = [b for b in PretrainingSampler(50, 0, 3)]
    assert full[0] == [0, 1, 2] and len(full) == 16
    assert list(PretrainingSampler(50, 12, 3)) == full[4:]
    r0 = list(PretrainingSampler(50, 6, 3, 0, 2))
    r1 = list(PretrainingSampler(50, 6, 3, 1, 2))
    assert (
        r0[0] == [6, 7, 8]
        and r1[0] == [9, 10, 11]
        and len(r0) == len(r1) == len(PretrainingSampler(50, 6, 3, 1, 2)) == 7
    )
    with pytest.raises(ConfigError, match="consumed_samples=50: must be in"):
        PretrainingSampler(50, 50, 3)


@pytest.fixture(scope="module")
def train_ds(two_prefixes, small_tok, tmp_path_factory):
    train, _, _ = build_datasets(
        [two_prefixes[0]],
        tokenizer=small_tok,
        seq_length=128,
        num_samples=(300, None, None),
        split="1,0,0",
        seed=5,
        cache_dir=tmp_path_factory.mktemp("cache"),
    )
    return train


def test_torch_loader_batches(train_ds):
    loader = build_loader(train_ds, 4, kind="torch", consumed_samples=8, data_parallel_rank=1, data_parallel_size=2)
    batches = list(loader)
    assert len(batches) == len(loader) == (len(train_ds) - 8) // 8
    b = batches[0]
    assert set(b) == set(BATCH_KEYS)
    assert b["tokens"].shape == (4, 128) and b["tokens"].dtype == torch.int64 and b["loss_mask"].dtype == torch.float32
    assert torch.equal(b["tokens"][0], train_ds[12]["tokens"])  # rank 1 of the second global step of 8 samples
    assert torch.equal(b["labels"][3, :-1], train_ds[15]["tokens"][1:])


def test_dali_and_torch_loaders_give_identical_batches(train_ds):
    from megagate.data.dali_loader import dali_available

    ok, why = dali_available()
    if not ok:
        pytest.skip(why)
    args = dict(seed=3, consumed_samples=4, data_parallel_rank=0, data_parallel_size=2)
    ref = list(build_loader(train_ds, 4, kind="torch", **args))
    got = list(build_loader(train_ds, 4, kind="dali", **args))
    assert len(got) == len(ref) > 10
    for a, b in zip(ref, got):
        for k in BATCH_KEYS:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k].cpu())


def test_mock_datasets():
    train, valid, _ = build_datasets(
        None, mock=True, seq_length=32, num_samples=(64, 8, 0), split="1,1,0", mock_vocab_size=500
    )
    b = next(iter(build_loader(train, 8)))
    assert b["tokens"].shape == (8, 32) and int(b["tokens"].max()) < 500


def test_build_with_initialised_process_group(two_prefixes, small_tok, tmp_path):
    import torch.distributed as dist

    # the session's megatron world (tests/conftest.py) may already hold the default group in this process
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        train, _, _ = build_datasets(
            [two_prefixes[1]],
            tokenizer=small_tok,
            seq_length=32,
            num_samples=(50, 0, 0),
            split="1,0,0",
            cache_dir=tmp_path / "c",
        )
        assert len(train) >= 50 and next(iter(build_loader(train, 2)))["tokens"].shape == (2, 32)
    finally:
        if own:
            dist.destroy_process_group()


def test_loader_argument_errors(train_ds):
    with pytest.raises(ConfigError, match="data.loader 'jax': allowed values are torch, dali"):
        build_loader(train_ds, 2, kind="jax")
    with pytest.raises(ConfigError, match="data_parallel_rank=2: must be in \\[0, 2\\)"):
        build_loader(train_ds, 2, data_parallel_rank=2, data_parallel_size=2)
