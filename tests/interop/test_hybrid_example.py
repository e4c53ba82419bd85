"""examples/hybrid_cpu.yaml end to end, as docs/hybrid.md walks through it: `megagate train` (a few steps) ->
`megagate export` (qwen3_next) -> transformers' `AutoModelForCausalLM` loads the folder and computes megagate's logits
-> `megagate import` gives the trained weights back bit for bit -> training continues from the import
(`checkpoint.init_from`) and the run itself resumes after `train.exit_after_steps`, bit-identically to a run that never stopped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import forked
from helpers import tiny_runs as T
from megagate.cli import main

pytestmark = pytest.mark.slow  # ~45 s of CPU: four short trainer runs of the 4-layer hybrid

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hybrid_cpu.yaml"
SHORT = [
    "train.seq_length=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.warmup_steps=1",
    "train.eval_interval=0",
    "train.eval_iters=1",
    "logging.interval=1",
    "logging.tensorboard=false",
]


def _train(out: Path, demo_dir: Path, *overrides: str) -> None:
    args = ["train", "--config", str(EXAMPLE), *SHORT, f"data.demo_dir={demo_dir}", f"output.dir={out}", *overrides]
    proc = forked.run_cli(args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_hybrid_example_train_export_transformers_import_continue(tmp_path, session_demo_dir, megatron_world):
    from transformers import AutoModelForCausalLM

    from megagate.commands.analyze import load_model_for_analysis

    run = tmp_path / "run"
    # 5 steps planned, 3 run now (checkpoint and exit): the same LR schedule as the uninterrupted run below
    _train(run, session_demo_dir, "train.train_steps=5", "train.exit_after_steps=3", "checkpoint.interval=0")
    trained = run / "checkpoints" / "iter_0000003"
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["shared_expert_intermediate_size"] == 64 and config["model_type"] == "qwen3_next"

    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf_model.model.layers[0].linear_attn).__name__ == "Qwen3NextGatedDeltaNet"
    model, encode = load_model_for_analysis(trained)
    ids = torch.tensor([encode("def read_file(path):\n    with open(path) as f:\n        return f.read()")])
    with torch.no_grad():
        theirs = hf_model(ids, use_cache=False).logits
        ours = model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)
    diff = (theirs - ours).abs().max().item()
    print(f"trained hybrid: max |logit difference| megagate vs transformers {diff:.2e}")
    assert diff < 1e-5
    # transformers' generate with its cache (the GDN layers' recurrent decode step) picks megagate's greedy tokens
    assert config["use_cache"] is True
    with torch.no_grad():
        generated = hf_model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, ids.shape[1] :]
        mine = ids
        for _ in range(6):
            logits = model(mine, torch.arange(mine.shape[1]).unsqueeze(0), None)
            mine = torch.cat([mine, logits[:, -1:].argmax(-1)], dim=1)
    assert generated.tolist() == mine[0, ids.shape[1] :].tolist()

    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")]) == 0
    before = {k: v for k, v in T.checkpoint_tensors(trained, tmp_path).items() if "_extra_state" not in k}
    back = T.checkpoint_tensors(tmp_path / "imported" / "iter_0000000", tmp_path)
    back = {k: v for k, v in back.items() if "_extra_state" not in k}
    assert sorted(before) == sorted(back) and all(torch.equal(before[k], back[k]) for k in before)

    _train(tmp_path / "tuned", session_demo_dir, "train.train_steps=2", f"checkpoint.init_from={tmp_path / 'imported'}")
    tuned = T.losses(tmp_path / "tuned")
    _train(run, session_demo_dir, "train.train_steps=5", "checkpoint.interval=0")  # resumes at step 3
    resumed = T.losses(run)
    print(f"continued from the import: {tuned}; resumed run: {resumed}")
    assert sorted(tuned) == [1, 2] and all(torch.isfinite(torch.tensor(v)) for v in tuned.values())
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    _train(tmp_path / "straight", session_demo_dir, "train.train_steps=5", "checkpoint.interval=0")
    assert T.losses(tmp_path / "straight") == resumed  # the resume continues bit-identically
    # the import starts where the run stood at step 3: its first loss is below the untrained run's first
    assert tuned[1] < resumed[1]
