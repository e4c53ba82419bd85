import json

import numpy as np
import pytest

from megagate.data.fast_bpe import FastBPE, unicode_probes, verify_vocabulary
from megagate.data.tokenizer import (
    EOD_TOKEN,
    FastBPETokenizer,
    HFTokenizer,
    MegatronTokenizerAdapter,
    load_tokenizer,
    write_tiktoken_bpe,
)
from megagate.errors import ConfigError, MegagateError


def test_trained_tokenizer_specials_and_exact_decoding(small_tok, small_docs):
    tok = load_tokenizer(small_tok, engine="hf")
    assert tok.vocab_size == 2048
    assert (tok.eod, tok.pad) == (0, 1)
    texts = [d["text"] for d in small_docs]
    for text, ids in zip(texts, tok.encode_batch(texts)):
        assert tok.decode(ids) == text  # byte-level, no normalizer: lossless
    assert load_tokenizer(small_tok).name == "fast"  # auto picks the fast engine for this vocabulary


@pytest.mark.slow  # ~16 s of CPU with the 32k tokenizer trained on the whole corpus
def test_fast_engine_equals_hf_on_whole_corpus(big_tok, full_docs):
    texts = [d["text"] for d in full_docs]
    hf = HFTokenizer(big_tok)
    fast = FastBPETokenizer(big_tok)
    want = hf.encode_batch(texts)
    got = fast.encode_batch(texts)
    n = sum(a.size for a in want)
    assert n > 2_000_000  # the whole ~10 MB corpus
    mismatched = [i for i, (a, b) in enumerate(zip(want, got)) if not np.array_equal(a, b)]
    assert mismatched == []
    flat, lengths = fast.engine.encode_flat(texts[:50])
    assert np.array_equal(flat, np.concatenate(want[:50])) and lengths.tolist() == [a.size for a in want[:50]]


@pytest.mark.slow  # ~12 s of CPU (the 32k tokenizer)
def test_fast_engine_equals_hf_on_vocabulary_and_unicode_probes(big_tok):
    assert len(unicode_probes()) > 1000  # every assigned non-ASCII code point, 64 per text
    assert verify_vocabulary(big_tok) == []


def test_special_token_text_inside_documents(small_tok):
    texts = [f"a{EOD_TOKEN}b", f"{EOD_TOKEN}", "x <|pad|> y <|endoftext", "<|endoftext|><|pad|>"]
    hf, fast = HFTokenizer(small_tok), FastBPETokenizer(small_tok)
    for a, b in zip(hf.encode_batch(texts), fast.encode_batch(texts)):
        assert a.tolist() == b.tolist()
    assert 0 in hf.encode(texts[0]).tolist()  # HF does match the special token inside text


def test_unsupported_vocabulary_falls_back_to_hf(small_tok, tmp_path):
    spec = json.load(open(small_tok))
    spec["normalizer"] = {"type": "NFC"}
    path = tmp_path / "nfc.json"
    path.write_text(json.dumps(spec))
    assert type(load_tokenizer(path, engine="auto")) is HFTokenizer
    with pytest.raises(ConfigError, match="cannot express .*normalizer 'NFC'"):
        load_tokenizer(path, engine="fast")
    with pytest.raises(ConfigError, match="engine 'turbo': allowed values are auto, hf, fast"):
        load_tokenizer(small_tok, engine="turbo")


def test_duplicate_merge_is_unsupported(small_tok):
    spec = json.load(open(small_tok))
    merges = spec["model"]["merges"]
    spec["model"]["merges"] = merges + [merges[-1]]
    with pytest.raises(ValueError, match="produces .* again"):
        FastBPE.from_spec(spec)


def test_tiktoken_file_round_trip(small_tok, small_docs, tmp_path):
    # Write the fast engine's ranks in tiktoken's file format, load it back as a tiktoken tokenizer.
    fast = FastBPE.from_tokenizer_json(small_tok)
    ranks = fast.encoding._mergeable_ranks
    path = tmp_path / "vocab.tiktoken"
    write_tiktoken_bpe(ranks, path)
    tok = load_tokenizer(path, tiktoken_pattern="gpt2")
    assert tok.name == "tiktoken" and tok.vocab_size == len(ranks) + 2 and tok.eod == len(ranks)
    texts = [d["text"] for d in small_docs[:40]]
    for text, ids, ranks_ref in zip(texts, tok.encode_batch(texts), fast.encode_ranks(texts)):
        assert ids.tolist() == ranks_ref
        assert tok.decode(ids) == text


def test_sentencepiece_model(tmp_path, small_docs):
    import sentencepiece as spm

    texts = [d["text"] for d in small_docs[:60]]
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(texts),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=800,
        model_type="bpe",
        byte_fallback=True,
        minloglevel=2,
        max_sentence_length=1 << 20,
    )
    tok = load_tokenizer(tmp_path / "sp.model")
    assert tok.name == "sentencepiece" and tok.vocab_size == 800
    assert tok.eod == tok.sp.eos_id() == 2
    ids = tok.encode("The quick brown fox.")
    assert tok.decode(np.append(ids, tok.eod)) == "The quick brown fox.</s>"


def test_bad_tokenizer_files(tmp_path):
    junk = tmp_path / "junk.json"
    junk.write_text("{ not json")
    with pytest.raises(MegagateError, match="junk.json: not a readable HF tokenizer.json"):
        load_tokenizer(junk)
    with pytest.raises(MegagateError, match="no such file"):
        load_tokenizer(tmp_path / "missing.json")


def test_megatron_adapter(small_tok):
    a = MegatronTokenizerAdapter(load_tokenizer(small_tok))
    assert (a.eod, a.pad, a.vocab_size) == (0, 1, 2048)
    assert len(a.unique_identifiers["sha256"]) == 64
    assert a.detokenize(a.tokenize("hello world")) == "hello world"
