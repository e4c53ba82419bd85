"""Hugging Face folders in and out: `megagate export` (checkpoint -> HF folder) and `megagate import` (HF folder ->
checkpoint), plus an HF folder as an in-memory model for `megagate analyze`.

The tensor and config conversions are `megagate.interop.hf`'s; this module reads and writes the files around them:
checkpoints through the trainer's own code (`train.checkpoint`, `train.load`), HF folders as `config.json`,
safetensors shards with `model.safetensors.index.json`, `generation_config.json` and tokenizer files. Every output
folder is written under a temporary name next to it and renamed when complete, so a failure leaves nothing
half-written under the name asked for.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from megagate.errors import ConfigError, MegagateError
from megagate.files import atomic_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
INDEX = "model.safetensors.index.json"
EXPORT_META = "megagate_export.json"
BLEND_PLACEHOLDER = "SET_DATA_BLEND"  # data.blend of an import's config until the user names a dataset
IMPORT_CONFIG = "train_config.yaml"  # a training config that starts from the imported weights (init_from)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(text: str | int) -> int:
    """Bytes of a size such as 5GB, 500MB, 2GiB or a plain integer (HF's --max-shard-size spelling)."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(str(text))
        if not match:
            raise ConfigError(f"--max-shard-size {text!r} is not a size (e.g. 5GB, 500MB, 2GiB, 1000000)")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if value <= 0:
        raise ConfigError(f"--max-shard-size {text!r} must be positive")
    return value


# --- output folders ------------------------------------------------------------------------------------------------
def check_out(out: str | os.PathLike, force: bool) -> Path:
    """The output folder, refused in one line when it holds something (unless `force`) or is a file."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise MegagateError(f"--out {str(out)!r} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise MegagateError(f"--out {str(out)!r} exists and is not empty (use --force to replace it)")
    return out


# --- checkpoints ---------------------------------------------------------------------------------------------------
def _run_config(path: Path) -> Any:
    from megagate import checkpoint as ckpt
    from megagate import config_reader

    meta = ckpt.read_meta(path)
    if not isinstance(meta.get("config"), dict):
        raise MegagateError(f"checkpoint {str(path)!r}: {ckpt.META} has no run config")
    return meta, config_reader.from_dict(meta["config"], environment=False)


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

    The checkpoint is verified and scanned for pickled code, rebuilt at TP = PP = EP = 1 in this process
    (`train.load.load_model_for_analysis`: dist_checkpointing reshards it) and converted by `interop.hf`.
    float32 keeps the trained values exactly; bfloat16 rounds every tensor.
    """
    from megagate import checkpoint as ckpt
    from megagate.interop import hf
    from megagate.train.load import load_model_for_analysis, run_tokenizer

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    shard_bytes = parse_size(max_shard_size)
    _known_format(fmt)
    out = check_out(out, force)
    path = ckpt.resolve(source)
    meta, cfg = _run_config(path) if (path / "megagate.json").is_file() else (None, None)
    if cfg is not None:  # refuse an unknown format or a variant no format holds before the model is loaded
        fmt = _check_format(cfg.model, fmt)
    model, _ = load_model_for_analysis(path, need_tokenizer=False)  # verifies and safety-scans first
    if cfg is None:
        meta, cfg = _run_config(path)
        fmt = _check_format(cfg.model, fmt)
    tensors = hf.to_hf_state_dict(cfg.model, fmt, model_state(model))
    config = dict(hf.hf_config(cfg.model, fmt))
    config["torch_dtype"] = dtype
    if fmt == "qwen3_next":
        # transformers 4.57.3's Qwen3NextDynamicCache looks up the last linear-attention layer and fails when every
        # layer is full attention: such a folder must run without a KV cache (forward and generate), by default
        config["use_cache"] = False
    with atomic_dir(out) as tmp:
        _write_safetensors(tmp, {k: v.to(DTYPES[dtype]) for k, v in tensors.items()}, shard_bytes)
        tok_note = _write_tokenizer(tmp, run_tokenizer(cfg.data), cfg.model.max_sequence_length, config)
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


def _known_format(fmt: str | None) -> None:
    from megagate.interop import hf

    if fmt is not None and fmt not in hf.FORMATS:
        raise ConfigError(f"--format {fmt!r} is not one of {', '.join(hf.FORMATS)}")


def _check_format(model: Any, fmt: str | None) -> str:
    from megagate.interop import hf

    _known_format(fmt)
    if fmt is None:
        fmt = hf.default_format(model)
    hf.check_exportable(model, fmt)
    return fmt


def _write_safetensors(folder: Path, tensors: Mapping[str, torch.Tensor], shard_bytes: int) -> None:
    """Shards model-0000N-of-0000M.safetensors of at most `shard_bytes` each (a larger tensor alone) + the index."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        # contiguous copies: safetensors refuses views and tensors that share storage (tied weights)
        shards[-1][name] = tensor.detach().contiguous().clone()
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        for name, tensor in shard.items():
            weight_map[name] = file
            total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _write_tokenizer(folder: Path, tokenizer_path: str | None, max_length: int, config: dict) -> str:
    """tokenizer.json + tokenizer_config.json + generation_config.json; one phrase saying what was written."""
    from megagate.data.tokenizer import EOD_TOKEN, PAD_TOKEN, load_tokenizer

    generation: dict[str, Any] = {"do_sample": False}
    if config.get("use_cache") is False:  # generate reads its own use_cache (see export_checkpoint)
        generation["use_cache"] = False
    if tokenizer_path is None:
        note = "none (the run has no tokenizer: mock data)"
    else:
        tok = load_tokenizer(tokenizer_path)
        # runs put an end-of-document token between documents and no BOS: it serves as BOS, EOS and (without a
        # pad token) padding, as in Qwen's own configs
        ids = {
            "bos_token_id": tok.eod,
            "eos_token_id": tok.eod,
            "pad_token_id": tok.pad if tok.pad is not None else tok.eod,
        }
        generation.update(ids)
        config.update(ids)
        source = Path(tokenizer_path)
        source = source / "tokenizer.json" if source.is_dir() else source
        if source.suffix == ".json":
            shutil.copyfile(source, folder / "tokenizer.json")
            pad = PAD_TOKEN if tok.pad is not None else EOD_TOKEN
            tok_config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": EOD_TOKEN,
                "pad_token": pad,
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": max_length,
            }
            (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
            note = "tokenizer.json + tokenizer_config.json (PreTrainedTokenizerFast)"
        else:
            # a SentencePiece or tiktoken file has no exact `tokenizers` equivalent written here: the ids are
            # in generation_config.json, the tokenizer file must be supplied by its own HF class
            note = f"not exported ({source.name} is not a `tokenizers` JSON file; only the special-token ids are)"
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return note


# --- reading HF folders --------------------------------------------------------------------------------------------
def read_hf_folder(hf_dir: str | os.PathLike, fmt: str | None = None) -> tuple[Any, str, dict[str, torch.Tensor]]:
    """(ModelConfig, format, megagate state dict at TP = PP = 1) of a Hugging Face folder of a supported format."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from megagate.interop import hf

    _known_format(fmt)
    folder = Path(hf_dir)
    if not folder.is_dir():
        raise MegagateError(f"{str(folder)!r} is not a folder")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise MegagateError(f"{str(folder)!r} has no config.json: it is not a Hugging Face model folder")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise MegagateError(f"{config_file}: unreadable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise MegagateError(f"{config_file}: not a JSON object")
    model_cfg, detected = hf.model_config_from_hf(config)
    if fmt is not None and fmt != detected:
        raise MegagateError(f"--format {fmt}: {config_file} describes a {detected} model")
    files = _weight_files(folder)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise MegagateError(f"{file}: not a readable safetensors file ({exc})") from None
    state = hf.from_hf_state_dict(model_cfg, detected, tensors)
    return model_cfg, detected, state


def _weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise MegagateError(f"{index}: unreadable ({type(exc).__name__}: {exc})") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise MegagateError(f"{index} names {missing[0]}, which is not in {str(folder)!r}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickled:
        raise MegagateError(
            f"{str(folder)!r} holds pickled weights ({pickled[0]}), which can run code when loaded; only safetensors "
            "are read (convert with transformers: model.save_pretrained(dir, safe_serialization=True))"
        )
    raise MegagateError(f"{str(folder)!r} has no *.safetensors weights")


def build_model(model_cfg: Any, state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A megagate GPTModel at TP = PP = 1 (fp32, megatron's local modules) holding exactly `state` (strict)."""
    from megagate.distributed import megatron_cpu
    from megagate.model.build import build_gpt_model, transformer_config
    from megagate.model.model_config import ParallelConfig
    from megagate.train.load import _ensure_single_process_world

    megatron_cpu.install()
    _ensure_single_process_world()
    tconfig = transformer_config(model_cfg, ParallelConfig(), params_dtype=torch.float32, perform_initialization=False)
    model = build_gpt_model(model_cfg, tconfig, backend="local")
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


def _hf_tokenizer(folder: Path) -> Any | None:
    from megagate.data.tokenizer import load_tokenizer

    path = folder / "tokenizer.json"
    return load_tokenizer(str(path)) if path.is_file() else None


def load_hf_for_analysis(hf_dir: str | os.PathLike) -> tuple[torch.nn.Module, Callable[[str], list[int]]]:
    """(model in eval mode, text -> token ids) from a Hugging Face folder: imported in memory, nothing written."""
    model_cfg, _, state = read_hf_folder(hf_dir)
    tokenizer = _hf_tokenizer(Path(hf_dir))
    if tokenizer is None:
        raise MegagateError(f"{str(hf_dir)!r} has no tokenizer.json to encode the text with")
    model = build_model(model_cfg, state)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())

    def encode(text: str) -> list[int]:
        return [int(i) for i in tokenizer.encode(text)]

    return model, encode


def is_hf_folder(path: str | os.PathLike) -> bool:
    """A folder with a config.json and no megagate checkpoint metadata (what `analyze` treats as HF input)."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / "megagate.json").is_file()


# --- import --------------------------------------------------------------------------------------------------------
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
    model = build_model(model_cfg, state)
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
    from megagate.train import children

    ours = filesystem_async._results_queue is None
    if ours:
        children.install_checkpoint_writer_queue()
    try:
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

    from megagate import config_reader
    from megagate.train import resume

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
        "architecture": resume.architecture(cfg),
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
