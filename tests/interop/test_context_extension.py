"""A context extension leaves and enters: train short, extend with YaRN (examples/context_extension_yarn_cpu.yaml,
checkpoint.init_from), export, load with transformers' AutoModelForCausalLM and compare logits on real text beyond
the original context; import that folder and continue training at the extended length."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import forked
from helpers import tiny_runs as T

pytestmark = pytest.mark.slow
RECIPE = T.ROOT / "examples" / "context_extension_yarn_cpu.yaml"
SHORT, LONG = 64, 256  # the short run's length; the extension's (YaRN x4 from 64)
NEXT = ["model.norm_zero_centered=true", "model.rotary_percent=0.5"]  # the form Qwen3-Next holds


def train(config: Path, out: Path, demo_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`megagate train --config CONFIG` with the tiny test sizes: 2 steps of 4 samples at LONG tokens."""
    args = [
        "--config", str(config), f"output.dir={out}", f"data.demo_dir={demo_dir}", f"model.max_sequence_length={LONG}",
        f"train.seq_length={LONG}", "train.train_steps=2", "train.warmup_steps=1", "logging.tensorboard=false",
        "logging.interval=1", *overrides,
    ]  # fmt: skip
    # forked from the preloaded server (helpers.forked): the quiet-console check sees what loading the init_from
    # checkpoint and training print (a fresh interpreter's import-time notices: tests/train/test_trainer.py)
    proc = forked.run_cli(["train", *args], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert T.foreign_console_lines(proc) == []  # a quiet console for an init_from run too
    return proc


@pytest.fixture(scope="module")
def extended(tmp_path_factory, session_demo_dir) -> Path:
    """The short run (4 steps at 64 tokens), extended by the shipped YaRN recipe: its step-2 checkpoint."""
    short = tmp_path_factory.mktemp("short")
    T.run_train(short, session_demo_dir, *NEXT, "train.train_steps=4", "train.warmup_steps=1")
    out = tmp_path_factory.mktemp("yarn")
    proc = train(
        RECIPE,
        out,
        session_demo_dir,
        f"checkpoint.init_from={short}",
        f"model.yarn_original_max_position_embeddings={SHORT}",
    )
    assert "initialised the model from" in proc.stdout
    return out / "checkpoints" / "iter_0000002"


@pytest.fixture(scope="module")
def exported(extended, tmp_path_factory, megatron_world) -> Path:
    from megagate.interop.hf_io import export_checkpoint

    out = tmp_path_factory.mktemp("hf") / "yarn"
    export_checkpoint(extended, out, log=lambda m: None)
    return out


def test_transformers_loads_the_extension_and_computes_its_logits_beyond_the_original_context(
    extended, exported, megatron_world
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megagate.commands.analyze import load_model_for_analysis

    config = json.loads((exported / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": SHORT}
    assert config["partial_rotary_factor"] == 0.5 and config["max_position_embeddings"] == LONG
    model, encode = load_model_for_analysis(extended)
    hf_model = AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(hf_model).__name__ == "Qwen3NextForCausalLM"
    text = Path(json.__file__).read_text()[:4000]  # real text: the standard library's json package (in the demo corpus)
    ids = encode(text)[:LONG]
    assert AutoTokenizer.from_pretrained(exported)(text)["input_ids"][:LONG] == ids
    diffs = {}
    for length in (2 * SHORT, 4 * SHORT):  # 2x and 4x the original context
        tokens = torch.tensor([ids[:length]])
        with torch.no_grad():
            theirs = hf_model(tokens).logits[0]
            mine = model(tokens, torch.arange(length).unsqueeze(0), None)[0]
        diffs[length] = (theirs - mine).abs().max().item()
        assert mine.abs().max() > 1.0
    print(f"max abs logit difference megagate vs transformers on the YaRN export: {diffs}")
    assert max(diffs.values()) < 1e-4


def test_an_import_with_rope_scaling_continues_training_at_the_extended_length(
    exported, tmp_path, megatron_world, session_demo_dir
):
    """The folder imported (its rope_scaling into the model section) and trained on at LONG tokens from exactly
    the imported weights (a vanishing LR: the step-2 weights are the import's to 1e-9)."""
    import yaml

    from megagate.interop.hf_io import import_hf

    imported = tmp_path / "imported"
    base = tmp_path / "base.yaml"  # the train / data sections `import --config` takes into the saved config
    base.write_text(yaml.safe_dump({"train": {"seq_length": LONG, "micro_batch_size": 1, "global_batch_size": 4},
                                    "data": {"demo": True, "split": "95,5,0"}}))  # fmt: skip
    import_hf(exported, imported, config=str(base), log=lambda m: None)
    section = yaml.safe_load((imported / "train_config.yaml").read_text())["model"]
    assert section["position_embedding"] == "yarn" and section["yarn_factor"] == 4.0
    assert section["yarn_original_max_position_embeddings"] == SHORT and section["rotary_percent"] == 0.5
    out = tmp_path / "continued"
    proc = train(imported / "train_config.yaml", out, session_demo_dir, "train.lr=1e-12", "train.min_lr=0")
    assert f"initialised the model from {imported / 'iter_0000000'}" in proc.stdout
    meta = json.loads((out / "checkpoints" / "iter_0000002" / "megagate.json").read_text())
    assert meta["config"]["model"]["position_embedding"] == "yarn" and meta["data_order"]["train.seq_length"] == LONG
    mine = T.checkpoint_tensors(out / "checkpoints" / "iter_0000002", tmp_path)
    theirs = T.checkpoint_tensors(imported / "iter_0000000", tmp_path)
    assert mine.keys() == theirs.keys() and len(mine) >= 9
    for key in mine:
        assert torch.allclose(mine[key], theirs[key], rtol=0, atol=1e-9), key
    assert sorted(T.losses(out)) == [1, 2] and all(0 < v < 8 for v in T.losses(out).values())
