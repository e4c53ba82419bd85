"""A tiny real megatron GPTModel built through megagate.model, and real-text token batches, for unit tests.

Call inside a megatron world (the `megatron_world` fixture or `megagate.distributed.parallel.single_process`):
the model is initialised by the trainer's own layout-independent initialiser (megagate.model.init).
"""

from __future__ import annotations

import sysconfig
from functools import cache
from pathlib import Path

import torch

from megagate.model import gate as gates
from megagate.model import init
from megagate.model.build import build_gpt_model, transformer_config
from megagate.model.presets import model_preset

STDLIB_FILES = ("argparse.py", "textwrap.py", "difflib.py", "pathlib.py", "json/decoder.py", "inspect.py")


def build(preset: str = "g1-elementwise", seed: int = 0, **overrides: object) -> torch.nn.Module:
    """The `tiny` model (2 layers, hidden 64, 4/2 heads x 16, vocabulary 512) with gate `preset`, in train mode."""
    mc = model_preset("tiny", gate=gates.preset(preset), **overrides)
    model = build_gpt_model(mc, transformer_config(mc))
    init.initialize([model], seed, mc.init_method_std, mc.num_layers)
    return model


@cache
def _text_bytes() -> torch.Tensor:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"\n".join((stdlib / name).read_bytes() for name in STDLIB_FILES if (stdlib / name).exists())
    return torch.tensor(list(data[:400_000]), dtype=torch.long)


def text_tokens(batch: int, seq: int, index: int = 0) -> torch.Tensor:
    """[batch, seq] byte tokens (< 256, within the tiny vocabulary) of the Python standard library's own sources,
    from deterministic positions that depend on `index`."""
    data = _text_bytes()
    gen = torch.Generator().manual_seed(index)
    starts = torch.randint(0, len(data) - seq, (batch,), generator=gen).tolist()
    return torch.stack([data[s : s + seq] for s in starts])
