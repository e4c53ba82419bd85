"""Hugging Face folders in and out of checkpoints: `megagate export` (checkpoint -> HF folder) and `megagate import`
(HF folder -> checkpoint), plus an HF folder as an in-memory model for `megagate analyze`.

The tensor and config conversions are `megagate.interop.hf`'s, the folder files `megagate.interop.hf_folder`'s;
models are built and checkpoints loaded by the model factory (`megagate.model_factory`: verified, safety-scanned,
resharded) and saved by the trainer's `Checkpointer`. Every output folder is written under a temporary name next
to it and renamed when complete, so a failure leaves nothing half-written under the name asked for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from megagate.errors import ConfigError, MegagateError
from megagate.files import atomic_dir
from megagate.interop.hf_folder import (
    check_out,
    hf_tokenizer,
    known_format,
    parse_size,
    read_hf_folder,
    write_safetensors,
    write_tokenizer,
)
from megagate.sections import did_you_mean

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EXPORT_META = "megagate_export.json"
BLEND_PLACEHOLDER = "SET_DATA_BLEND"  # data.blend of an import's config until the user names a dataset
IMPORT_CONFIG = "train_config.yaml"  # a training config that starts from the imported weights (init_from)


# Transformer Engine fuses the pre-attention and pre-MLP norms into the following linear layer; interop.hf takes
# the names of megatron's local modules (a model exported on a GPU machine is built with TE).
_TE_NAMES = (
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
)


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors as interop.hf takes them: state_dict() without megatron/TE's `_extra_state` entries,
    under the local modules' names."""
    out = {}
    for key, value in model.state_dict().items():
        if key.endswith("_extra_state"):
            continue
        for te, local in _TE_NAMES:
            if key.endswith(te):
                key = key[: -len(te)] + local
        out[key] = value
    return out


def export_checkpoint(
    source: str | os.PathLike,
    out: str | os.PathLike,
    fmt: str | None = None,
    *,
    dtype: str = "float32",
    max_shard_size: str | int = "5GB",
    force: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Write checkpoint `source` (any TP/PP/EP/VPP layout) as a Hugging Face folder `out`; returns `out`.

    The checkpoint is verified and scanned for pickled code, rebuilt at TP = PP = EP = 1 in this process (the
    model factory's `load_whole_model`: dist_checkpointing reshards it) and converted by `interop.hf`. float32
    keeps the trained values exactly; bfloat16 rounds every tensor. The run's tokenizer is copied when it is on this
    machine (nothing is built for it).
    """
    from megagate.data.demo import run_tokenizer
    from megagate.interop import hf
    from megagate.model_factory import load_whole_model, read_checkpoint

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}{did_you_mean(dtype, DTYPES)}")
    shard_bytes = parse_size(max_shard_size)
    known_format(fmt)
    out = check_out(out, force)
    path, meta, cfg = read_checkpoint(source)
    # an unknown format or a variant no format holds: before the model loads. Without --format, an import goes back
    # out in the format it came in (a Qwen3.5 folder as Qwen3.5, not as the first format that holds it)
    fmt = _check_format(cfg.model, fmt or _imported_format(meta, cfg.model))
    model, *_ = load_whole_model(path)  # verifies and safety-scans first
    tensors = hf.to_hf_state_dict(cfg.model, fmt, model_state(model))
    config = dict(hf.hf_config(cfg.model, fmt))
    config["dtype"] = dtype
    if fmt == "qwen3_next" and "linear_attention" not in config["layer_types"]:
        # transformers' Qwen3-Next cache looks up the last linear-attention layer and fails when every layer is full
        # attention (4.57.3; kept for 5.x readers, untested there): such a folder runs without a KV cache by default
        config["use_cache"] = False
    with atomic_dir(out) as tmp:
        write_safetensors(tmp, {k: v.to(DTYPES[dtype]) for k, v in tensors.items()}, shard_bytes)
        tok_note = write_tokenizer(tmp, run_tokenizer(cfg.data), cfg.model.max_sequence_length, config)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        step = meta.get("step")
        (tmp / EXPORT_META).write_text(
            json.dumps(
                {
                    "source": str(path.resolve()),
                    "step": step,
                    "format": fmt,
                    "dtype": dtype,
                    "variant": dataclasses.asdict(cfg.model.gate),
                    "tokenizer": tok_note,
                },
                indent=1,
            )
            + "\n"
        )
    log(f"exported {path} (step {step}) as {fmt} ({dtype}) to {out}; tokenizer: {tok_note}")
    return out


def _imported_format(meta: Mapping[str, Any], model: Any) -> str | None:
    """The format a checkpoint written by `megagate import` came from, when that format still holds the model."""
    from megagate.interop import hf

    fmt = (meta.get("imported_from") or {}).get("format")
    return fmt if fmt in hf.formats_for(model) else None


def _check_format(model: Any, fmt: str | None) -> str:
    from megagate.interop import hf

    known_format(fmt)
    if fmt is None:
        fmt = hf.default_format(model)
    hf.check_exportable(model, fmt)
    return fmt


def model_from_state(model_cfg: Any, state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A megagate model (HybridModel) at TP = PP = 1 (fp32, megatron's local modules, built by the model factory) holding
    exactly `state` (strict), in eval mode."""
    from megagate.distributed import megatron_cpu
    from megagate.distributed.parallel import ensure_single_process
    from megagate.model_factory import build_model
    from megagate.run_config import TrainConfig, TrainSection
    from megagate.run_setup import resolve

    megatron_cpu.install()
    ensure_single_process()
    # a run of this model alone: fp32, megatron's local modules (interop.hf's names), for loading
    cfg = TrainConfig(model=model_cfg, train=TrainSection(backend="local"))
    (model,) = build_model(resolve(cfg, None, training=False), initialise=False)
    own = model_state(model)
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        name = (missing or unexpected)[0]
        raise MegagateError(
            f"the converted weights do not fit the model: {name} is {'missing' if missing else 'unexpected'} "
            f"({len(missing)} missing, {len(unexpected)} unexpected)"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise MegagateError(
                f"weight {name} has shape {tuple(tensor.shape)}; the model in config.json needs {tuple(own[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor.to(own[name].dtype))
    model.eval()
    return model


def load_hf_for_analysis(hf_dir: str | os.PathLike) -> tuple[torch.nn.Module, Callable[[str], list[int]]]:
    """(model in eval mode, text -> token ids) from a Hugging Face folder: imported in memory, nothing written."""
    model_cfg, _, state = read_hf_folder(hf_dir)
    tokenizer = hf_tokenizer(Path(hf_dir))
    if tokenizer is None:
        raise MegagateError(f"{str(hf_dir)!r} has no tokenizer.json to encode the text with")
    model = model_from_state(model_cfg, state)  # on this machine's device

    def encode(text: str) -> list[int]:
        return [int(i) for i in tokenizer.encode(text)]

    return model, encode


def model_section(model_cfg: Any) -> dict[str, Any]:
    """The `model:` section of a training config that rebuilds `model_cfg` exactly (every field, no preset)."""
    return dataclasses.asdict(model_cfg)


def import_hf(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    fmt: str | None = None,
    *,
    config: str | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Write HF folder `hf_dir` as a megagate checkpoint root `out` (out/iter_0000000 + tokenizer + a training
    config starting from it); returns `out`.

    The checkpoint is saved by the trainer's own `Checkpointer` (dist_checkpointing, megagate.json with a run
    config the trainer's reader accepts, manifest.json), so `analyze`, `eval` and `checkpoint.init_from` at any
    TP/PP/EP layout read it. `config`: a YAML whose train/data/parallel/seed sections go into that run config.
    """
    out = check_out(out, force)
    base: dict[str, Any] = {}
    if config is not None:
        from megagate.yamlfile import load_mapping

        if not Path(config).is_file():
            raise MegagateError(f"--config {config}: no such file")
        base = {k: v for k, v in load_mapping(config).items() if k in ("train", "data", "parallel", "seed")}
    model_cfg, detected, state = read_hf_folder(hf_dir, fmt)
    folder = Path(hf_dir)
    tokenizer = folder / "tokenizer.json"
    model = model_from_state(model_cfg, state)
    write_checkpoint(
        model,
        model_cfg,
        out,
        base=base,
        tokenizer=tokenizer if tokenizer.is_file() else None,
        source={"folder": str(folder.resolve()), "format": detected},
        log=log,
    )
    return out


def _save_once(root: Path, model: torch.nn.Module, meta: Mapping[str, Any]) -> Path:
    """One checkpoint save outside a training run: megatron's writer needs a results queue (a Manager process);
    the one started here is stopped after the save, so an import in a long-lived process leaves no child behind."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megagate import checkpoint as ckpt
    from megagate.distributed import children

    ours = filesystem_async._results_queue is None
    if ours:
        children.install_checkpoint_writer_queue()
    try:
        # the checkpointer's "saved checkpoint ..." names the temporary folder; import_hf prints the final one
        with contextlib.redirect_stdout(io.StringIO()):
            return ckpt.Checkpointer(root, keep_last=1).save(0, [model], None, dict(meta))
    finally:
        if ours:
            children.shutdown()


def write_checkpoint(
    model: torch.nn.Module,
    model_cfg: Any,
    out: str | os.PathLike,
    *,
    base: Mapping[str, Any] | None = None,
    tokenizer: Path | None = None,
    source: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Save a TP = PP = 1 `model` of `model_cfg` as checkpoint root `out` (out/iter_0000000), atomically.

    megagate.json holds a run config the trainer's reader accepts (the model section with every field, `base`'s
    train/data/parallel/seed sections); `tokenizer` is copied to out/tokenizer.json and becomes data.tokenizer when
    `base` names none; out/train_config.yaml is a training config with checkpoint.init_from=out.
    """
    import yaml

    from megagate import checkpoint as ckpt
    from megagate import config_reader

    out = Path(out)
    raw: dict[str, Any] = {"model": model_section(model_cfg), **(base or {})}
    data = dict(raw.get("data") or {})
    if tokenizer is not None and not data.get("tokenizer") and not data.get("demo"):
        data["tokenizer"] = str(out.resolve() / "tokenizer.json")
    if not (data.get("blend") or data.get("demo") or data.get("mock")):
        # A run config needs a data source and an import has none: a named placeholder blend with a tokenizer (the
        # trainer refuses it in one line until it is set; analyze and eval --data read the tokenizer), else mock
        if data.get("tokenizer"):
            data["blend"] = [BLEND_PLACEHOLDER]
        else:
            data["mock"] = True
    raw["data"] = data
    train = dict(raw.get("train") or {})
    train.setdefault("seq_length", min(128, model_cfg.max_sequence_length))
    raw["train"] = train
    cfg = config_reader.from_dict(raw, environment=False)  # the trainer's reader must accept what is saved
    meta = {
        "consumed_samples": 0,
        "config": raw,
        "architecture": ckpt.architecture(cfg),
        "layout": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1},
        "optimizer_format": cfg.checkpoint.optimizer_format,
        "imported_from": dict(source or {}),
    }
    with atomic_dir(out) as tmp:
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        path = _save_once(tmp, model, meta)
        train_cfg = {**raw, "checkpoint": {"init_from": str(out.resolve())}}
        (tmp / IMPORT_CONFIG).write_text(
            "# a run that continues training from the imported weights (checkpoint.init_from)\n"
            "# set data.blend (a placeholder or data.mock here), data.tokenizer, train.* and output.dir;\n"
            "# keep the model section as it is\n" + yaml.safe_dump(train_cfg, sort_keys=False)
        )
    log(
        f"wrote checkpoint {out / path.name} ({', '.join(f'{k} {v}' for k, v in (source or {}).items())}); "
        f"a training config starting from it: {out / IMPORT_CONFIG}"
    )
    return out
