"""The DALI loader behind `build_loader(kind="dali")`.

The megatron dataset (Python, memory-mapped) produces each sample's four arrays; a DALI pipeline ingests them
through `external_source` (one batch per iteration, in the sampler's order) and hands them out through
`DALIGenericIterator`. On a machine without a GPU the pipeline runs CPU-only (`device_id=None`); with a GPU
the outputs are copied to the device inside the pipeline, which runs `prefetch` batches ahead of the
training step, so the host-to-device copy overlaps compute. The batches are those of the torch loader, bit
for bit: same sampler, same dataset calls, no transformation in between.

`nvidia-dali-cuda120` ships Linux x86_64/aarch64 wheels only; where it does not import, `build_loader`
raises a `ConfigError` that says so.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from megagate.data.sampler import BATCH_KEYS, PretrainingSampler, sample_arrays
from megagate.errors import ConfigError


def dali_available() -> tuple[bool, str]:
    """(True, version) or (False, why not)."""
    try:
        import nvidia.dali as dali
        from nvidia.dali.plugin.pytorch import DALIGenericIterator  # noqa: F401
    except Exception as exc:  # ImportError, or OSError from a missing shared library
        return False, f"nvidia-dali does not import here ({type(exc).__name__}: {exc})"
    return True, dali.__version__


class _BatchSource:
    """`external_source` callback: batch i of the sampler as four lists of arrays."""

    def __init__(self, dataset, batches: list[list[int]]) -> None:
        self.dataset = dataset
        self.batches = batches

    def __call__(self, info) -> tuple[list[np.ndarray], ...]:
        i = info.iteration
        if i >= len(self.batches):
            raise StopIteration
        samples = [sample_arrays(self.dataset, j) for j in self.batches[i]]
        return tuple([s[k] for s in samples] for k in range(len(BATCH_KEYS)))


class DaliLoader:
    """Iterable of micro-batch dicts produced by a DALI pipeline (a fresh pipeline per iteration pass)."""

    def __init__(
        self,
        dataset,
        sampler: PretrainingSampler,
        seed: int = 0,
        device: str | None = None,
        num_threads: int = 1,
        prefetch: int = 2,
    ) -> None:
        ok, why = dali_available()
        if not ok:
            raise ConfigError(f"data.loader 'dali': {why}; install nvidia-dali-cuda120 or use data.loader 'torch'")
        import torch

        self.dataset = dataset
        self.sampler = sampler
        self.seed = seed
        self.num_threads = num_threads
        self.prefetch = prefetch
        use_gpu = device != "cpu" and torch.cuda.is_available()
        if device not in (None, "cpu") and not torch.cuda.is_available():
            raise ConfigError(f"DALI loader device {device!r}: no CUDA device here (allowed: cpu)")
        self.device_id = (
            (torch.device(device).index or 0 if device not in (None, "cpu") else torch.cuda.current_device())
            if use_gpu
            else None
        )

    def __len__(self) -> int:
        return len(self.sampler)

    def _pipeline(self):
        from nvidia.dali import fn, pipeline_def

        batches = list(self.sampler)
        source = _BatchSource(self.dataset, batches)
        gpu = self.device_id is not None

        @pipeline_def(
            batch_size=self.sampler.micro_batch_size,
            num_threads=self.num_threads,
            device_id=self.device_id,  # None: CPU-only pipeline, runs without any GPU
            seed=self.seed,
            prefetch_queue_depth=self.prefetch,
            exec_dynamic=True,
        )
        def pipe():
            outs = fn.external_source(source=source, num_outputs=len(BATCH_KEYS), batch=True, batch_info=True)
            return tuple(o.gpu() for o in outs) if gpu else tuple(outs)

        p = pipe()
        p.build()
        return p, len(batches)

    def __iter__(self) -> Iterator[dict]:
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        pipe, n = self._pipeline()
        if n == 0:
            return
        it = DALIGenericIterator(
            [pipe],
            list(BATCH_KEYS),
            auto_reset=False,
            last_batch_policy=LastBatchPolicy.PARTIAL,
            prepare_first_batch=False,
        )
        for out in it:
            yield {k: out[0][k] for k in BATCH_KEYS}
