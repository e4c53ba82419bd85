"""RNG states of a rank (CPU, CUDA, numpy, python, megatron's model-parallel tracker) as tensors, ints and tuples
only, so `torch.load(weights_only=True)` reads them back."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """This rank's random number generator states (CPU, CUDA, numpy, python, megatron's model-parallel tracker)."""
    from megatron.core import tensor_parallel

    kind, key, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        # numpy's uint32 key as an int64 tensor (exact); the rest are python ints / a float
        "numpy": (str(kind), torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "python": random.getstate(),  # (version, tuple of ints, None)
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states of `rng_state()`."""
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    kind, key, pos, has_gauss, cached = state["numpy"]
    key = key.numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
    np.random.set_state((kind, key.astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
