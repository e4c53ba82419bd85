"""A rank-based byte-level BPE engine (tiktoken's) that reproduces HF `tokenizers`' ids for a `tokenizer.json`.

Why: tokenization is the ceiling of preprocessing. HF's BPE walks a merge table per word and builds rich
`Encoding` objects; tiktoken's core merges by rank over raw bytes and returns bare ids, several times faster.

How the vocabulary is translated (`FastBPE.from_tokenizer_json`):

- each HF vocabulary string is turned back into bytes through GPT-2's byte<->unicode table;
- the 256 single bytes get ranks 0..255; merge number i (in `model.merges` order) gets rank 256 + i for the
  token it produces, so "lowest rank first" in tiktoken is "earliest merge first" in HF;
- HF's added tokens (special tokens) become tiktoken special tokens, matched in the text as HF matches them;
- the pre-tokenizer regex is HF's ByteLevel regex (GPT-2's) or the pattern of a `Split` before a regex-free
  ByteLevel;
- encoding returns ranks, mapped back to HF ids through one numpy lookup table.

The translation is exact only for vocabularies whose features it can express; anything else (normalizers,
dropout, byte fallback, subword prefixes, post-processors that add tokens, duplicate merges, ...) raises
`UnsupportedVocabulary` and `load_tokenizer(engine="auto")` falls back to HF. A check over the vocabulary
(`verify_vocabulary`) and tests on real text compare the two engines token for token.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

# HF's ByteLevel pre-tokenizer regex (GPT-2's), as tiktoken spells it.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class UnsupportedVocabulary(ValueError):
    """The tokenizer.json uses a feature the rank-based engine cannot reproduce exactly."""


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's printable-unicode stand-in for each byte, inverted (char -> byte)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _token_bytes(token: str) -> bytes:
    table = byte_decoder()
    try:
        return bytes(table[ch] for ch in token)
    except KeyError:
        raise UnsupportedVocabulary(f"vocabulary entry {token!r} is not byte-level") from None


def _pattern(pre: dict | None) -> str:
    """The split regex equivalent to the HF pre-tokenizer, or raise."""
    if pre is None:
        raise UnsupportedVocabulary("no pre-tokenizer (only byte-level BPE is supported)")
    kind = pre.get("type")
    if kind == "ByteLevel":
        if pre.get("add_prefix_space"):
            raise UnsupportedVocabulary("ByteLevel add_prefix_space=true")
        if not pre.get("use_regex", True):
            raise UnsupportedVocabulary("ByteLevel without regex and without a Split")
        return GPT2_PATTERN
    if kind == "Sequence":
        items = pre.get("pretokenizers", [])
        if (
            len(items) == 2
            and items[0].get("type") == "Split"
            and items[1].get("type") == "ByteLevel"
            and not items[1].get("use_regex", True)
            and not items[1].get("add_prefix_space")
            and items[0].get("behavior") == "Isolated"
            and not items[0].get("invert")
            and "Regex" in items[0].get("pattern", {})
        ):
            return items[0]["pattern"]["Regex"]
    raise UnsupportedVocabulary(f"pre-tokenizer {json.dumps(pre)[:120]}")


class FastBPE:
    """tiktoken `Encoding` in rank space plus the rank -> HF id table."""

    def __init__(self, encoding, rank_to_id: np.ndarray, use_specials: bool) -> None:
        self.encoding = encoding
        self.rank_to_id = rank_to_id
        self.use_specials = use_specials

    @classmethod
    def from_tokenizer_json(cls, path: str | os.PathLike) -> FastBPE:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        model = spec.get("model") if isinstance(spec, dict) else None
        if not isinstance(model, dict) or not isinstance(model.get("vocab"), dict):
            raise ValueError("no model mapping with a vocab")
        return cls.from_spec(spec)

    @classmethod
    def from_spec(cls, spec: dict) -> FastBPE:
        import tiktoken

        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise UnsupportedVocabulary(f"model type {model.get('type')!r} (only BPE)")
        for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
            if model.get(key):
                raise UnsupportedVocabulary(f"model.{key}={model[key]!r}")
        if model.get("byte_fallback"):
            raise UnsupportedVocabulary("model.byte_fallback=true")
        if model.get("ignore_merges"):
            raise UnsupportedVocabulary("model.ignore_merges=true")
        if spec.get("normalizer") is not None:
            raise UnsupportedVocabulary(f"normalizer {spec['normalizer'].get('type')!r}")
        post = spec.get("post_processor")
        if post is not None and post.get("type") != "ByteLevel":
            raise UnsupportedVocabulary(f"post-processor {post.get('type')!r} (adds tokens)")
        pattern = _pattern(spec.get("pre_tokenizer"))

        vocab: dict[str, int] = model["vocab"]
        ranks: dict[bytes, int] = {}
        rank_ids: list[int] = []
        decoder = byte_decoder()
        for ch, b in sorted(decoder.items(), key=lambda kv: kv[1]):
            if ch not in vocab:
                raise UnsupportedVocabulary(f"byte 0x{b:02x} ({ch!r}) missing from the vocabulary")
            ranks[bytes([b])] = b
            rank_ids.append(vocab[ch])
        for i, merge in enumerate(model.get("merges", [])):
            a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
            merged = a + b
            if merged not in vocab or a not in vocab or b not in vocab:
                raise UnsupportedVocabulary(f"merge #{i} {a!r}+{b!r} refers to tokens missing from the vocabulary")
            key = _token_bytes(merged)
            if key in ranks:
                # Two merges producing one token: HF can apply either, tiktoken knows one rank.
                raise UnsupportedVocabulary(f"merge #{i} produces {merged!r} again")
            ranks[key] = 256 + i
            rank_ids.append(vocab[merged])

        specials: dict[str, int] = {}
        added = spec.get("added_tokens") or []
        for tok in added:
            if tok.get("single_word") or tok.get("lstrip") or tok.get("rstrip"):
                raise UnsupportedVocabulary(f"added token {tok['content']!r} with single_word/lstrip/rstrip")
            if tok["content"] in specials:
                continue
            specials[tok["content"]] = len(rank_ids)
            rank_ids.append(int(tok["id"]))
        contents = list(specials)
        for x in contents:
            # HF matches added tokens leftmost-longest, tiktoken leftmost-first: equal when none prefixes another.
            if any(y != x and y.startswith(x) for y in contents):
                raise UnsupportedVocabulary(f"added token {x!r} is a prefix of another added token")
        try:
            enc = tiktoken.Encoding(
                name="megagate-fast-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
            )
        except Exception as exc:  # an HF (Oniguruma) regex that tiktoken's regex engine rejects
            raise UnsupportedVocabulary(f"pre-tokenizer regex not accepted by tiktoken ({exc})") from None
        return cls(enc, np.asarray(rank_ids, dtype=np.int64), bool(specials))

    def encode_ranks(self, texts: Sequence[str]) -> list[list[int]]:
        if self.use_specials:
            # HF recognises added tokens inside the text; so must we, to give the same ids.
            return self.encoding.encode_batch(list(texts), num_threads=1, allowed_special="all", disallowed_special=())
        return self.encoding.encode_ordinary_batch(list(texts), num_threads=1)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """HF ids of each text (as int64 arrays)."""
        table = self.rank_to_id
        return [table[np.asarray(r, dtype=np.int64)] if r else np.zeros(0, np.int64) for r in self.encode_ranks(texts)]

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """All ids concatenated plus per-text lengths: one table lookup for the whole batch."""
        ranks = self.encode_ranks(texts)
        lengths = np.fromiter((len(r) for r in ranks), dtype=np.int64, count=len(ranks))
        flat = np.fromiter((t for r in ranks for t in r), dtype=np.int64, count=int(lengths.sum()))
        return self.rank_to_id[flat], lengths


def verify_vocabulary(path: str | os.PathLike, fast: FastBPE | None = None, probe_step: int = 1) -> list[str]:
    """Encode every vocabulary entry's text and unicode probes with both engines; return the mismatches."""
    from tokenizers import Tokenizer as _HF

    hf = _HF.from_file(str(path))
    fast = fast or FastBPE.from_tokenizer_json(path)
    texts = []
    for token in hf.get_vocab():
        try:
            texts.append(_token_bytes(token).decode("utf-8"))
        except (UnsupportedVocabulary, UnicodeDecodeError):
            continue
    texts += unicode_probes(probe_step)
    mismatches = []
    for start in range(0, len(texts), 4096):
        chunk = texts[start : start + 4096]
        want = [e.ids for e in hf.encode_batch(chunk, add_special_tokens=False)]
        got = fast.encode_batch(chunk)
        mismatches += [t for t, w, g in zip(chunk, want, got) if list(w) != g.tolist()]
    return mismatches


def unicode_probes(step: int = 1) -> list[str]:
    """Short texts that put each assigned code point next to letters, digits, spaces and newlines.

    Regex engines disagree most on character classes (\\s, \\p{L}, \\p{N}); these probes exercise each class
    boundary once per code point.
    """
    import unicodedata

    probes = []
    for cp in range(0x80, 0x110000, step):
        ch = chr(cp)
        if unicodedata.category(ch) in ("Cn", "Cs", "Co"):
            continue
        probes.append(f"a{ch}b {ch}1 {ch}{ch}\n{ch} 'sx{ch}")
    # join into medium-sized documents so probes also interact across boundaries
    return ["  ".join(probes[i : i + 64]) for i in range(0, len(probes), 64)]
