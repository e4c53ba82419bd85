"""A model from a training checkpoint, outside training (one process): for `megagate analyze` and other tools."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from megagate.errors import MegagateError

_WORLD: list = []  # the single-process megatron world opened for analysis (kept until the process exits)


def _ensure_single_process_world() -> None:
    """A one-process megatron world with TP = PP = 1: the caller's if one is active, else one opened here."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if tp != 1 or pp != 1:
            raise MegagateError(
                f"analysis builds the whole model in one process; the active parallel state has TP={tp}, PP={pp}"
            )
        return
    import atexit
    import contextlib

    from megagate.distributed import parallel

    stack = contextlib.ExitStack()
    stack.enter_context(parallel.single_process())
    _WORLD.append(stack)
    atexit.register(stack.close)


def run_tokenizer(data: object) -> str | None:
    """The tokenizer file of a run's data section (the demo tokenizer for `data.demo` runs without a blend)."""
    if data.demo and not data.blend:
        from megagate.data.demo import prepare_demo_data

        tokenizer, _ = prepare_demo_data(data.demo_dir, data.demo_vocab_size, data.demo_max_bytes)
        return tokenizer
    return data.tokenizer


def load_model_for_analysis(
    checkpoint_dir: str | Path, need_tokenizer: bool = True
) -> tuple[torch.nn.Module, Callable[[str], list[int]] | None]:
    """(model in eval mode, text -> token ids) from a trainer checkpoint (iter_NNNNNNN folder); the encoder is
    None for a run without a tokenizer when `need_tokenizer` is False (an export of weights only).

    The run's config (saved in the checkpoint's megagate.json) rebuilds the model as one TP = PP = 1 module in
    this process; megatron's dist_checkpointing reshards the saved model tensors into it (any training layout),
    and the optimizer state is not read.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from megagate import checkpoint as ckpt
    from megagate import config_reader
    from megagate.data.tokenizer import load_tokenizer
    from megagate.distributed import megatron_cpu
    from megagate.model.build import build_gpt_model, transformer_config
    from megagate.model.model_config import ParallelConfig
    from megagate.train.components import precision_kwargs, resolve_backend

    path = ckpt.resolve(checkpoint_dir)
    # before anything unpickles it: pickled code is refused (UnsafeFileError), damage is one line (no fallback here:
    # analysis reads the checkpoint it is given and moves nothing)
    if not (path / ckpt.META).exists() and not (path / ckpt.MANIFEST).exists():
        raise MegagateError(
            f"checkpoint {str(path)!r} has no readable {ckpt.META} (nor {ckpt.MANIFEST}): it is not a checkpoint "
            "(iter_NNNNNNN), nor a checkpoint root or run folder with a complete one"
        )
    scanned = ckpt.safety_check(path, collective=False)
    reason = ckpt.verify(path, collective=False) or scanned
    if reason is not None:
        raise MegagateError(f"checkpoint {str(path)!r} is damaged: {reason}")
    meta = ckpt.read_meta(path)
    if not isinstance(meta.get("config"), dict):
        raise MegagateError(f"checkpoint {str(path)!r}: {ckpt.META} has no run config")
    # The trainer's reader and checks, minus this machine's: the run's data files need not be here to analyse it.
    cfg = config_reader.from_dict(meta["config"], environment=False)
    tokenizer_path = run_tokenizer(cfg.data)
    if tokenizer_path is None and need_tokenizer:
        raise MegagateError(f"checkpoint {str(path)!r}: the run has no tokenizer (mock data?) to encode text with")
    tokenizer = None if tokenizer_path is None else load_tokenizer(tokenizer_path)

    megatron_cpu.install()
    _ensure_single_process_world()
    dtype, _ = precision_kwargs(cfg)  # fp8 recipes are a training setting: analysis runs in the storage dtype
    backend = resolve_backend(cfg)
    tconfig = transformer_config(cfg.model, ParallelConfig(), params_dtype=dtype, perform_initialization=False)
    model = build_gpt_model(cfg.model, tconfig, backend=backend)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    try:
        loaded = dist_checkpointing.load(
            {"model": model.sharded_state_dict()}, str(path), strict=StrictHandling.RAISE_UNEXPECTED
        )
    except Exception as exc:  # megatron raises CheckpointingException and others for a mismatched checkpoint
        raise MegagateError(f"cannot load the model from {str(path)!r} (backend {backend}): {exc}") from None
    model.load_state_dict(loaded["model"])
    model.eval()

    def encode(text: str) -> list[int]:
        return [int(i) for i in tokenizer.encode(text)]

    return model, (None if tokenizer is None else encode)
