"""The one model factory: this rank's model chunks for a run set-up (`build_model`), and a model loaded from a
checkpoint after the safety check and the manifest verification (`load_verified`).

Training (megagate.train.components), evaluation, analysis, export/import and the benchmarks build their models
here and nowhere else:

    build_model(setup)                     this rank's chunks (one per virtual pipeline stage), initialised
                                           layout-independently (megagate.model.init)
    read_checkpoint(source)                (checkpoint folder, its metadata, its run config): what to build
    load_verified(path, cfg)               this rank's chunks of cfg's model under cfg.parallel, loaded from
                                           `path` (any saved layout: dist_checkpointing reshards) after refusing
                                           pickled code and checking every file against the manifest
    load_whole_model(source)               the whole model in one process (TP = PP = 1), for analysis and export
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from megagate import checkpoint as ckpt
from megagate.checkpoint.manifest import first_reason
from megagate.config_reader import from_dict
from megagate.distributed.utils import gather_objects
from megagate.errors import MegagateError
from megagate.model.model_config import ParallelConfig
from megagate.run_config import TrainConfig
from megagate.run_setup import RunSetup, resolve


def build_model(setup: RunSetup, *, initialise: bool = True) -> list[torch.nn.Module]:
    """This rank's model chunks of `setup` (one per virtual pipeline stage of its layout), on this machine's device;
    initialised layout-independently, or (`initialise=False`) left for a checkpoint to fill. Needs megatron's
    parallel state."""
    from megatron.core import parallel_state

    from megagate.model import init
    from megagate.model.build import build_gpt_model

    cfg = setup.cfg
    tconfig = setup.transformer_config()
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunk = build_gpt_model(
            cfg.model,
            tconfig,
            backend=setup.backend,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            vp_stage=stage,
            core_attention=setup.core_attention,
        )
        _norms_to(chunk, tconfig.params_dtype)
        if setup.machine.gpu:
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    if initialise:
        init.initialize(chunks, cfg.seed, cfg.model.init_method_std, cfg.model.num_layers)
    return chunks


def _norms_to(chunk: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give torch's norm modules the model's dtype. megatron's local spec builds them (WrappedTorchNorm) in fp32
    whatever params_dtype says; Megatron-LM's Float16Module casts them to bf16, and megatron's non-distributed
    mixed-precision optimizer assumes it: it checkpoints only its half-precision parameters, so an fp32 norm
    weight would stop the first save (`Param id ... does not match any model sharded param`)."""
    if dtype == torch.float32:
        return
    for module in chunk.modules():
        if isinstance(module, torch.nn.RMSNorm | torch.nn.LayerNorm):
            module.to(dtype)


def read_checkpoint(source: str | os.PathLike) -> tuple[Path, dict, TrainConfig]:
    """(the checkpoint `source` names, its megagate.json, its run config): `source` is an iter_NNNNNNN folder, a
    checkpoint root or a run folder (its newest complete checkpoint). The config is read with the trainer's reader
    and rules, not this machine's checks: the run's data need not be here."""
    path = ckpt.resolve(source)
    if not (path / ckpt.META).exists() and not (path / ckpt.MANIFEST).exists():
        raise MegagateError(
            f"checkpoint {str(path)!r} has no readable {ckpt.META} (nor {ckpt.MANIFEST}): it is not a checkpoint "
            "(iter_NNNNNNN), nor a checkpoint root or run folder with a complete one"
        )
    meta = ckpt.read_meta(path)
    if not isinstance(meta.get("config"), dict):
        raise MegagateError(f"checkpoint {str(path)!r}: {ckpt.META} has no run config")
    return path, meta, from_dict(meta["config"], environment=False)


def load_verified(path: Path, cfg: TrainConfig, *, collective: bool = True) -> list[torch.nn.Module]:
    """This rank's chunks of `cfg.model` under `cfg.parallel`, in eval mode, holding checkpoint `path`'s weights.

    Before anything unpickles it, pickled code is refused (UnsafeFileError) and damage is one line (no fallback:
    a tool reads the checkpoint it is given and moves nothing). The model is built for loading (`resolve(...,
    training=False)`: the storage dtype, megatron's default kernels); the optimizer state is not read. Collective
    (every rank checks a share, all agree) unless `collective` is False (one process reading on its own).
    """
    reason = ckpt.damage(path, collective)
    if reason is not None:
        raise MegagateError(f"checkpoint {str(path)!r} is damaged: {reason}")
    setup = resolve(cfg, None, training=False)
    chunks = build_model(setup, initialise=False)
    error = None
    try:
        # every tensor of the checkpoint is asked for when this rank holds every layer
        whole = cfg.parallel.pipeline_model_parallel_size == 1
        ckpt.Checkpointer(path.parent).load(path, chunks, None, same_layout=False, strict=whole)
    except Exception as exc:  # megatron raises CheckpointingException and others for a mismatched checkpoint
        error = " ".join(str(exc).split())[:300]
    if collective:
        error = first_reason(gather_objects(error))
    if error:
        raise MegagateError(f"cannot load the model from {str(path)!r} (backend {setup.backend}): {error}")
    for chunk in chunks:
        chunk.eval()
    return chunks


def load_whole_model(source: str | os.PathLike) -> tuple[torch.nn.Module, Path, dict, TrainConfig]:
    """(the whole model at TP = PP = 1 in this process, in eval mode; its checkpoint, metadata and run config) from
    a training checkpoint saved under any layout (megatron's dist_checkpointing reshards it)."""
    from megagate.distributed import megatron_cpu
    from megagate.distributed.parallel import ensure_single_process

    path, meta, cfg = read_checkpoint(source)
    megatron_cpu.install()
    ensure_single_process()
    whole = dataclasses.replace(cfg, parallel=ParallelConfig())
    (model,) = load_verified(path, whole, collective=False)
    return model, path, meta, cfg
