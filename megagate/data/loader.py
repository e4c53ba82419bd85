"""Datasets and micro-batch loaders for the trainer.

API (the trainer's entry points):

    train, valid, test = build_datasets(
        blend,                      # ["prefix", ...] | [(weight, "prefix"), ...] | ["0.7", "a", "0.3", "b"] | None (mock)
        tokenizer=tok,              # a megagate Tokenizer, a tokenizer path, or None with mock=True
        seq_length=1024,
        num_samples=(train_samples, valid_samples, test_samples),   # None entries: one epoch of that split
        split="969,30,1", seed=1234, cache_dir="runs/x/data_cache", mock=False,
    )
    loader = build_loader(train, micro_batch_size=4, kind="torch" | "dali", seed=1234,
                          consumed_samples=0, data_parallel_rank=0, data_parallel_size=1)
    for batch in loader:   # {"tokens": int64[b,s], "labels": int64[b,s], "loss_mask": float32[b,s], "position_ids": int64[b,s]}
        ...

Datasets are megatron-core's: `GPTDataset` per prefix, `BlendedDataset` for weighted mixtures, built by
`BlendedMegatronDatasetBuilder` from a `GPTDatasetConfig` (mock: `MockGPTDataset`). With `cache_dir` the
document/sample/shuffle indices are saved there and reused by later runs with the same blend, seed, lengths and
tokenizer (megatron hashes all of them into the cache file names). Works with or without an initialised
`torch.distributed` process group: with one, rank 0 builds the cache first and the others read it.

Sampling (megagate.data.sampler) follows Megatron-LM's pretraining sampler: samples are taken in order from `consumed_samples`; each
global step takes `micro_batch_size x data_parallel_size` consecutive samples and rank r keeps the r-th
slice. Resuming with the `consumed_samples` of a checkpoint continues exactly where the run stopped.
Shuffling happens inside the datasets (seeded by `seed` in `build_datasets`), so the loaders need no RNG.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence

import numpy as np

from megagate.data.sampler import PretrainingSampler, collate
from megagate.errors import ConfigError, require

LOADER_KINDS = ("torch", "dali")


def parse_blend(blend) -> tuple[list[str], list[float] | None]:
    """Normalise a blend to (prefixes, weights or None)."""
    require(blend is not None and len(blend) > 0, "empty data blend: give at least one dataset prefix")
    items = list(blend)
    if isinstance(items[0], (tuple, list)):
        prefixes, weights = [], []
        for item in items:
            require(len(item) == 2, f"blend entry {item!r}: expected (weight, prefix)")
            weights.append(_weight(item[0]))
            prefixes.append(str(item[1]))
        return prefixes, weights
    if all(_is_number(x) for x in items[0::2]) and len(items) % 2 == 0 and not all(_is_number(x) for x in items):
        return [str(p) for p in items[1::2]], [_weight(w) for w in items[0::2]]
    require(
        not any(_is_number(x) for x in items), f"blend {items!r}: use either prefixes only or 'weight prefix' pairs"
    )
    return [str(p) for p in items], None


def _is_number(x) -> bool:
    if isinstance(x, (int, float)):
        return True
    try:
        float(x)
        return True
    except (TypeError, ValueError):
        return False


def _weight(x) -> float:
    try:
        w = float(x)
    except (TypeError, ValueError):
        raise ConfigError(f"blend weight {x!r}: must be a positive number") from None
    require(w > 0 and np.isfinite(w), f"blend weight {x!r}: must be a positive number")
    return w


def _tokenizer_adapter(tokenizer):
    from megagate.data.tokenizer import (
        MegatronTokenizerAdapter,
        Tokenizer,
        load_tokenizer,
    )

    if isinstance(tokenizer, MegatronTokenizerAdapter):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer, engine="hf")
    require(isinstance(tokenizer, Tokenizer), f"tokenizer {tokenizer!r}: expected a path or a megagate Tokenizer")
    return MegatronTokenizerAdapter(tokenizer)


class _MockTokenizer:
    """Enough of a tokenizer for megatron's MockGPTDataset (ids are synthetic)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.unique_identifiers = {"class": "mock", "vocab_size": vocab_size}

    @property
    def pad(self) -> int:
        raise AttributeError("mock tokenizer has no padding token")


def build_datasets(
    blend=None,
    *,
    tokenizer=None,
    seq_length: int,
    num_samples: Sequence[int | None] = (None, None, None),
    split: str = "969,30,1",
    seed: int = 1234,
    cache_dir: str | os.PathLike | None = None,
    mock: bool = False,
    mock_vocab_size: int = 32000,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    quiet: bool = True,
):
    """(train, valid, test) megatron datasets (any may be None when its split weight is 0). See module docstring."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import (
        GPTDataset,
        GPTDatasetConfig,
        MockGPTDataset,
    )

    from megagate.data.indexed import name_write_errors, strip_suffix, validate

    require(seq_length >= 1, f"seq_length={seq_length}: must be >= 1")
    require(len(num_samples) == 3, f"num_samples={num_samples!r}: give (train, valid, test)")
    for n in num_samples:
        require(n is None or n >= 0, f"num_samples={num_samples!r}: entries must be >= 0 or None")
    _check_split(split)
    if quiet:
        # megatron logs every index it builds at INFO; the trainer prints its own summary.
        for name in ("megatron.core.datasets", "megatron.core.datasets.indexed_dataset"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if mock:
        adapter = _tokenizer_adapter(tokenizer) if tokenizer is not None else _MockTokenizer(mock_vocab_size)
        blend_cfg, cls = None, MockGPTDataset
    else:
        require(tokenizer is not None, "build_datasets needs a tokenizer (or mock=True)")
        adapter = _tokenizer_adapter(tokenizer)
        prefixes, weights = parse_blend(blend)
        prefixes = [os.path.abspath(strip_suffix(p)) for p in prefixes]
        # a damaged file fails here with its name, not deep inside megatron
        infos = {p: validate(p) for p in prefixes}
        blend_cfg, cls = (prefixes, weights), GPTDataset
    if cache_dir is not None:
        os.makedirs(cache_dir, exist_ok=True)
        # megatron builds on rank 0 while the others wait at a barrier; another rank reading the cache now could
        # catch a file rank 0 is still writing and call it damaged
        from megagate.distributed.utils import is_global_rank0

        if is_global_rank0():
            check_cache_files(cache_dir)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend_cfg,
        split=split,
        path_to_cache=None if cache_dir is None else str(cache_dir),
        tokenizer=adapter,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=False,  # causal kernels build their own mask
        mmap_bin_files=True,
    )
    if not mock:
        _check_split_sizes(infos, config.split_matrix, split)
    builder = BlendedMegatronDatasetBuilder(cls, list(num_samples), lambda: True, config)
    # megatron writes its cache with np.save: a full disk there is an OSError without a file name; name the cache
    with name_write_errors(str(cache_dir)) if cache_dir is not None else contextlib.nullcontext():
        train, valid, test = builder.build()
    return train, valid, test


def check_cache_files(cache_dir: str | os.PathLike) -> None:
    """ConfigError naming the first damaged index file in megatron's dataset cache (a run killed while writing it,
    a full disk): megatron would load it as garbage or fail with numpy's error. Deleting the file is safe: megatron
    rebuilds a cache entry that is incomplete."""
    if not os.path.isdir(cache_dir):
        return
    for name in sorted(os.listdir(cache_dir)):
        if not name.endswith(".npy"):
            continue
        path = os.path.join(cache_dir, name)
        try:
            np.load(path, mmap_mode="r", allow_pickle=False)  # reads the header; mmap checks the size against it
        except (ValueError, OSError, EOFError) as exc:
            raise ConfigError(
                f"data cache file {path!r} is damaged ({' '.join(str(exc).split())}); delete it and it is rebuilt"
            ) from None


def _check_split_sizes(infos: dict, split_matrix, split: str) -> None:
    """Refuse splits that get no tokens: megatron's epoch count loops forever on an empty split."""
    names = ("train", "valid", "test")
    for prefix, info in infos.items():
        n = info["sequences"]
        lengths = info["lengths"]
        for i, bounds in enumerate(split_matrix):
            if bounds is None:
                continue
            beg, end = int(round(bounds[0] * n)), int(round(bounds[1] * n))
            if int(lengths[beg:end].sum()) == 0:
                raise ConfigError(
                    f"split {split!r} gives the {names[i]} split no documents of {prefix} ({n} documents); "
                    f"use more data or a split with weight 0 for {names[i]}"
                )


def _check_split(split: str) -> None:
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(
            f"split {split!r}: expected up to three comma-separated non-negative weights, e.g. 969,30,1"
        ) from None
    require(
        1 <= len(parts) <= 3 and all(p >= 0 for p in parts) and sum(parts) > 0,
        f"split {split!r}: expected up to three comma-separated non-negative weights with a positive sum",
    )


def build_loader(
    dataset,
    micro_batch_size: int,
    *,
    kind: str = "torch",
    seed: int = 0,
    consumed_samples: int = 0,
    data_parallel_rank: int = 0,
    data_parallel_size: int = 1,
    num_workers: int = 0,
    drop_last: bool = True,
    device: str | None = None,
    worker_init_fn=None,
):
    """An iterable of micro-batch dicts (see module docstring); `len()` is the number of micro-batches.

    kind="torch": a `torch.utils.data.DataLoader` over the sampler (`num_workers` processes, each starting with
                  `worker_init_fn(worker_id)`: the trainer's makes them ignore stop signals and die with it).
    kind="dali":  a DALI pipeline (CPU here; with a GPU it prefetches batches into GPU memory; `device="cpu"`
                  forces CPU). Both yield identical batches for the same dataset and arguments.
    """
    require(kind in LOADER_KINDS, f"data.loader {kind!r}: allowed values are {', '.join(LOADER_KINDS)}")
    require(num_workers >= 0, f"num_workers={num_workers}: must be >= 0")
    sampler = PretrainingSampler(
        len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size, drop_last
    )
    if kind == "dali":
        from megagate.data.dali_loader import DaliLoader

        return DaliLoader(dataset, sampler, seed=seed, device=device, num_threads=max(1, num_workers))
    import torch

    g = torch.Generator()
    g.manual_seed(seed)
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate,
        generator=g,
        worker_init_fn=worker_init_fn,
        pin_memory=device not in (None, "cpu") and torch.cuda.is_available(),
        persistent_workers=False,
    )
