"""Tokenizers: train a byte-level BPE, load existing ones offline, and adapt them for megatron's datasets.

Training (`train_bpe`) uses HF `tokenizers`: byte-level pre-tokenizer (GPT-2 regex, no prefix space, no
normalizer, so decoding returns the exact input text), BPE model, special tokens `<|endoftext|>` (end of
document) and `<|pad|>` (padding), saved as one `tokenizer.json`.

Loading (`load_tokenizer(path, engine=...)`) accepts:

- an HF `tokenizer.json` (or a folder holding one): engine "hf" (HF `tokenizers`), "fast" (the rank-based
  engine of `megagate.data.fast_bpe`, identical ids) or "auto" (fast where the vocabulary allows it, else hf);
- a SentencePiece model (`*.model`), through the `sentencepiece` package;
- a tiktoken BPE file (`*.tiktoken`, lines of `base64-token rank`), with a named or explicit split regex.

Every loaded tokenizer is a `Tokenizer`: `encode_batch(texts) -> list[np.ndarray]`, `decode(ids)`,
`vocab_size`, `eod`, `pad` (or None). `MegatronTokenizerAdapter(tok)` wraps one for `GPTDatasetConfig`.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from megagate.errors import ConfigError, MegagateError, require
from megagate.files import atomic_path, check_writable_dir

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
ENGINES = ("auto", "hf", "fast")

# Split regexes of the public tiktoken encodings (facts about those formats, needed to load their files offline).
TIKTOKEN_PATTERNS = {
    "gpt2": r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    "cl100k": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",
    "o200k": "|".join(
        [
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]
    ),
}


class Tokenizer:
    """Common interface of all engines. Subclasses set `name`, `vocab_size`, `eod`, `pad`, `path`."""

    name: str = "base"
    path: str = ""
    vocab_size: int = 0
    eod: int = -1
    pad: int | None = None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text (no special tokens added), as int64 arrays."""
        raise NotImplementedError

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids; special tokens are rendered as their text."""
        raise NotImplementedError

    def fingerprint(self) -> str:
        """sha256 of the tokenizer file(s): identifies the vocabulary in caches and dataset metadata."""
        return file_sha256(self.path) if self.path and os.path.isfile(self.path) else self.name


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class HFTokenizer(Tokenizer):
    """HF `tokenizers` on a `tokenizer.json`."""

    name = "hf"

    def __init__(self, path: str, eod_token: str | None = None, pad_token: str | None = None) -> None:
        from tokenizers import Tokenizer as _HF

        self.path = str(path)
        try:
            self.hf = _HF.from_file(self.path)
        except Exception as exc:  # tokenizers raises plain Exception on malformed files
            raise MegagateError(f"{path}: not a readable HF tokenizer.json ({str(exc).splitlines()[0]})") from None
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        self.eod = _special_id(
            self.hf.token_to_id, eod_token, (EOD_TOKEN, "</s>", "<eos>", "<|end_of_text|>"), path, "end-of-document"
        )
        self.pad = _special_id(
            self.hf.token_to_id, pad_token, (PAD_TOKEN, "<pad>", "[PAD]"), path, "padding", required=False
        )

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self.hf.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)


class FastBPETokenizer(HFTokenizer):
    """The rank-based engine (`fast_bpe.FastBPE`) for encoding; HF `tokenizers` for decoding."""

    name = "fast"

    def __init__(self, path: str, eod_token: str | None = None, pad_token: str | None = None) -> None:
        from megagate.data.fast_bpe import FastBPE

        super().__init__(path, eod_token, pad_token)
        self.engine = FastBPE.from_tokenizer_json(self.path)  # raises UnsupportedVocabulary

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return self.engine.encode_batch(texts)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; end of document is the model's `</s>` (eos) unless named."""

    name = "sentencepiece"

    def __init__(self, path: str, eod_token: str | None = None, pad_token: str | None = None) -> None:
        import sentencepiece as spm

        self.path = str(path)
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(self.path)
        except Exception as exc:
            raise MegagateError(f"{path}: not a readable SentencePiece model ({str(exc).splitlines()[0]})") from None
        self.vocab_size = self.sp.GetPieceSize()

        def piece_id(piece: str) -> int | None:
            i = self.sp.PieceToId(piece)
            return None if i == self.sp.unk_id() and piece != self.sp.IdToPiece(i) else i

        eos = self.sp.eos_id()
        self.eod = _special_id(piece_id, eod_token, (), path, "end-of-document", default=eos if eos >= 0 else None)
        pad = self.sp.pad_id()
        self.pad = _special_id(
            piece_id, pad_token, (), path, "padding", required=False, default=pad if pad >= 0 else None
        )

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in self.sp.Encode(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        # SentencePiece drops control pieces (eos) when decoding; render them so round trips stay visible.
        out, run = [], []
        for i in (int(x) for x in ids):
            if self.sp.IsControl(i):
                out.append(self.sp.Decode(run))
                out.append(self.sp.IdToPiece(i))
                run = []
            else:
                run.append(i)
        out.append(self.sp.Decode(run))
        return "".join(out)


class TiktokenFileTokenizer(Tokenizer):
    """A tiktoken BPE file (`base64-token rank` per line) with a split regex; special tokens follow the ranks."""

    name = "tiktoken"

    def __init__(
        self, path: str, pattern: str = "cl100k", eod_token: str | None = None, pad_token: str | None = None
    ) -> None:
        import tiktoken

        self.path = str(path)
        ranks = read_tiktoken_bpe(self.path)
        pat = TIKTOKEN_PATTERNS.get(pattern, pattern)
        n = max(ranks.values()) + 1
        # tiktoken files carry no special tokens: end-of-document and padding follow the last rank
        specials = {eod_token or EOD_TOKEN: n, pad_token or PAD_TOKEN: n + 1}
        try:
            self.enc = tiktoken.Encoding(
                name=Path(path).stem, pat_str=pat, mergeable_ranks=ranks, special_tokens=specials
            )
        except Exception as exc:
            raise ConfigError(
                f"tiktoken pattern {pattern!r}: not a valid regex or name (allowed names: {', '.join(TIKTOKEN_PATTERNS)}) ({exc})"
            ) from None
        self.vocab_size = n + len(specials)
        self.eod = specials[eod_token or EOD_TOKEN]
        self.pad = specials.get(pad_token or PAD_TOKEN)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in self.enc.encode_ordinary_batch(list(texts), num_threads=1)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode([int(i) for i in ids])


def read_tiktoken_bpe(path: str) -> dict[bytes, int]:
    """Parse a tiktoken BPE file without touching the network (tiktoken's loader may try to fetch URLs)."""
    ranks: dict[bytes, int] = {}
    try:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):  # noqa: B007 (lineno names the bad line in the except below)
                if not line.strip():
                    continue
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MegagateError(
            f"{path}:{lineno}: not a tiktoken BPE file (expected 'base64-token rank' lines; {exc})"
        ) from None
    require(
        len(ranks) >= 256,
        f"{path}: a tiktoken BPE file needs at least the 256 single bytes, found {len(ranks)} tokens",
        MegagateError,
    )
    return ranks


def write_tiktoken_bpe(ranks: dict[bytes, int], path: str | os.PathLike) -> None:
    """Write ranks in tiktoken's file format (atomically)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")


def _special_id(
    lookup,
    name: str | None,
    candidates: Sequence[str],
    path,
    what: str,
    required: bool = True,
    default: int | None = None,
) -> int | None:
    if name is not None:
        i = lookup(name)
        require(i is not None, f"{what} token {name!r} is not in the vocabulary of {path}")
        return int(i)
    for cand in candidates:
        i = lookup(cand)
        if i is not None:
            return int(i)
    if default is not None:
        return int(default)
    if required:
        raise ConfigError(
            f"{path}: no {what} token found (looked for {', '.join(candidates) or 'the model eos'}); name one with --eod-token"
        )
    return None


def detect_format(path: str | os.PathLike) -> str:
    """'hf', 'sentencepiece' or 'tiktoken', from the file name and its first bytes."""
    p = Path(path)
    if p.is_dir():
        require((p / "tokenizer.json").is_file(), f"{path}: folder has no tokenizer.json", MegagateError)
        return "hf"
    require(p.is_file(), f"tokenizer {str(path)!r}: no such file", MegagateError)
    with open(p, "rb") as f:
        head = f.read(256)
    if head.lstrip().startswith(b"{"):
        return "hf"
    first = head.split(b"\n", 1)[0].split()
    if len(first) == 2 and first[1].isdigit():
        return "tiktoken"
    if p.suffix == ".model" or head[:1] == b"\n":  # SentencePiece ModelProto starts with field 1 (pieces)
        return "sentencepiece"
    raise MegagateError(
        f"{path}: unknown tokenizer format (allowed: HF tokenizer.json, SentencePiece .model, tiktoken BPE file)"
    )


def load_tokenizer(
    path: str | os.PathLike,
    engine: str = "auto",
    eod_token: str | None = None,
    pad_token: str | None = None,
    tiktoken_pattern: str = "cl100k",
) -> Tokenizer:
    """Load any supported tokenizer file; `engine` applies to HF files: auto | hf | fast."""
    require(engine in ENGINES, f"tokenizer engine {engine!r}: allowed values are {', '.join(ENGINES)}")
    fmt = detect_format(path)
    if fmt == "sentencepiece":
        return SentencePieceTokenizer(str(path), eod_token, pad_token)
    if fmt == "tiktoken":
        return TiktokenFileTokenizer(str(path), tiktoken_pattern, eod_token, pad_token)
    path = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    if engine == "hf":
        return HFTokenizer(str(path), eod_token, pad_token)
    from megagate.data.fast_bpe import UnsupportedVocabulary

    try:
        return FastBPETokenizer(str(path), eod_token, pad_token)
    except UnsupportedVocabulary as exc:
        if engine == "fast":
            raise ConfigError(f"engine 'fast' cannot express {path}: {exc}; use --engine hf or auto") from None
        return HFTokenizer(str(path), eod_token, pad_token)


class NoTrainingText(MegagateError):
    """`train_bpe` got no texts at all (empty inputs, or only bad records)."""


def train_bpe(
    texts: Iterable[str],
    out_path: str | os.PathLike,
    vocab_size: int = 32000,
    min_frequency: int = 2,
    special_tokens: Sequence[str] = (EOD_TOKEN, PAD_TOKEN),
) -> Path:
    """Train a byte-level BPE on `texts` and save `tokenizer.json` atomically at `out_path`.

    Raises `NoTrainingText` (nothing written) when `texts` is empty.
    """
    from tokenizers import Tokenizer as _HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    require(
        vocab_size >= 256 + len(special_tokens) + 1,
        f"vocab_size={vocab_size}: must be at least {256 + len(special_tokens) + 1} (256 bytes + special tokens + 1 merge)",
    )
    require(vocab_size <= 2**31 - 1, f"vocab_size={vocab_size}: too large")
    require(min_frequency >= 1, f"min_frequency={min_frequency}: must be >= 1")
    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    out_path = Path(out_path)
    check_writable_dir(out_path.parent, f"tokenizer output {str(out_path)!r}: folder")
    counted = [0]

    def counting(items: Iterable[str]) -> Iterable[str]:
        for text in items:
            counted[0] += 1
            yield text

    tok.train_from_iterator(counting(texts), trainer=trainer)
    if counted[0] == 0:  # HF would save a tokenizer of the 256 bytes and the special tokens alone
        raise NoTrainingText("no text to train on; nothing written")
    with atomic_path(out_path) as tmp:
        try:
            tok.save(str(tmp))
        except Exception as exc:  # the Rust library raises a bare Exception ("No space left on device (os error 28)")
            raise MegagateError(f"cannot write {str(out_path)!r}: {exc}") from None
    return out_path


class MegatronTokenizerAdapter:
    """What megatron's `GPTDatasetConfig(tokenizer=...)` reads: `eod`, `pad`, `vocab_size`, `unique_identifiers`.

    `unique_identifiers` enters the hash of megatron's cached dataset indices, so it names the vocabulary by
    content (sha256), not by path: moving the tokenizer file keeps the caches valid.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.eod = tokenizer.eod
        self.eos = tokenizer.eod
        self.unique_identifiers = {
            "class": type(tokenizer).__name__,
            "sha256": tokenizer.fingerprint(),
            "eod": tokenizer.eod,
        }

    @property
    def pad(self) -> int:
        # megatron catches the exception and uses its own pad id (-1), which never occurs in the data.
        if self.tokenizer.pad is None:
            raise AttributeError("tokenizer has no padding token")
        return self.tokenizer.pad

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).tolist()

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)
