"""Hugging Face folders on disk: safetensors shards with their index, tokenizer files, `config.json`, the output
folder checks, and a folder read back as megagate tensors. `hf_io` (export/import) writes and reads through here;
the conversions themselves are `megagate.interop.hf`'s."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from megagate.errors import ConfigError, MegagateError
from megagate.sections import did_you_mean

INDEX = "model.safetensors.index.json"
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


def check_out(out: str | os.PathLike, force: bool) -> Path:
    """The output folder, refused in one line when it holds something (unless `force`) or is a file."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise MegagateError(f"--out {str(out)!r} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise MegagateError(f"--out {str(out)!r} exists and is not empty (use --force to replace it)")
    return out


def known_format(fmt: str | None) -> None:
    from megagate.interop import hf

    if fmt is not None and fmt not in hf.FORMATS:
        raise ConfigError(f"--format {fmt!r} is not one of {', '.join(hf.FORMATS)}{did_you_mean(fmt, hf.FORMATS)}")


def write_safetensors(folder: Path, tensors: Mapping[str, torch.Tensor], shard_bytes: int) -> None:
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


def write_tokenizer(folder: Path, tokenizer_path: str | None, max_length: int, config: dict) -> str:
    """tokenizer.json + tokenizer_config.json + generation_config.json; one phrase saying what was written."""
    from megagate.data.tokenizer import EOD_TOKEN, PAD_TOKEN, load_tokenizer

    generation: dict[str, Any] = {"do_sample": False}
    if config.get("use_cache") is False:  # generate reads its own use_cache (see export_checkpoint)
        generation["use_cache"] = False
    if tokenizer_path is None:
        note = "none (the run has no tokenizer: mock data)"
    elif not Path(tokenizer_path).exists():
        note = f"not exported (the run's tokenizer {tokenizer_path} is not on this machine)"
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


def read_hf_folder(hf_dir: str | os.PathLike, fmt: str | None = None) -> tuple[Any, str, dict[str, torch.Tensor]]:
    """(ModelConfig, format, megagate state dict at TP = PP = 1) of a Hugging Face folder of a supported format."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from megagate.interop import hf

    known_format(fmt)
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
    from megagate.console import warn
    from megagate.interop import hf_qwen35

    if hf_qwen35.is_vision_language(config):
        # a Qwen3.5 vision-language folder: its text model, as transformers' Qwen3_5ForCausalLM loads it
        tensors, dropped = hf_qwen35.text_tensors(tensors)
        parts = ", ".join(f"{n} tensors of {what}" for what, n in dropped.items()) or "no other tensors"
        warn(
            f"{folder}: a {config['model_type']} vision-language folder: took its text model ({detected}), dropped {parts}"
        )
    mtp = sorted(k for k in tensors if k.startswith("mtp.")) if detected in hf.GATED else []
    if mtp:
        # the released Qwen3-Next / Qwen3.5 checkpoints carry a multi-token-prediction head that transformers does not
        # build either; megagate trains the main model only, and an export of it has no mtp.* tensors
        warn(f"{folder}: dropped {len(mtp)} mtp.* tensors (the MTP head, not built by megagate or transformers)")
        tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
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


def hf_tokenizer(folder: Path) -> Any | None:
    from megagate.data.tokenizer import load_tokenizer

    path = folder / "tokenizer.json"
    return load_tokenizer(str(path)) if path.is_file() else None


def is_hf_folder(path: str | os.PathLike) -> bool:
    """A folder with a config.json and no megagate checkpoint metadata (what `analyze` treats as HF input)."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / "megagate.json").is_file()
