"""Which samples each rank reads: Megatron-LM's pretraining sampler, and micro-batch assembly (shared by the loaders).

Samples are taken in order from `consumed_samples`; each global step takes `micro_batch_size x data_parallel_size`
consecutive samples and rank r keeps the r-th slice, so resuming from a checkpoint's `consumed_samples` continues
exactly where the run stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from megagate.errors import require

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass
class PretrainingSampler:
    """Megatron-LM's pretraining batch sampler: sequential from `consumed_samples`, DP-sliced global steps."""

    total_samples: int
    consumed_samples: int
    micro_batch_size: int
    data_parallel_rank: int = 0
    data_parallel_size: int = 1
    drop_last: bool = True

    def __post_init__(self) -> None:
        require(self.total_samples > 0, f"dataset has {self.total_samples} samples; nothing to load")
        require(self.micro_batch_size > 0, f"micro_batch_size={self.micro_batch_size}: must be > 0")
        require(self.data_parallel_size > 0, f"data_parallel_size={self.data_parallel_size}: must be > 0")
        require(
            0 <= self.data_parallel_rank < self.data_parallel_size,
            f"data_parallel_rank={self.data_parallel_rank}: must be in [0, {self.data_parallel_size})",
        )
        require(
            0 <= self.consumed_samples < self.total_samples,
            f"consumed_samples={self.consumed_samples}: must be in [0, {self.total_samples}) for a dataset of {self.total_samples} samples",
        )

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        left = self.total_samples - self.consumed_samples
        full = left // self.global_batch
        return full + (
            0 if self.drop_last or left % self.global_batch <= self.data_parallel_rank * self.micro_batch_size else 1
        )

    def __iter__(self) -> Iterator[list[int]]:
        start = self.data_parallel_rank * self.micro_batch_size
        batch: list[int] = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.global_batch:
                yield batch[start : start + self.micro_batch_size]
                batch = []
        if batch and not self.drop_last and batch[start : start + self.micro_batch_size]:
            yield batch[start : start + self.micro_batch_size]


def sample_arrays(dataset, idx: int) -> tuple[np.ndarray, ...]:
    """One sample's four arrays (the dataset returns torch tensors; DALI wants numpy)."""
    s = dataset[int(idx)]
    return tuple(np.asarray(s[k].numpy()) for k in BATCH_KEYS)


def collate(samples: list[dict]) -> dict:
    """Stack the four keys of megatron samples into a micro-batch (other keys are dropped)."""
    import torch

    return {k: torch.stack([s[k] for s in samples]) for k in BATCH_KEYS}
