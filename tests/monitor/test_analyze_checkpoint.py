"""`megagate analyze CHECKPOINT` on a checkpoint written by a real (short) training run.

`load_model_for_analysis` rebuilds the run's model from the config in the checkpoint, loads only the model
tensors with megatron's dist_checkpointing, and encodes text with the run's own (demo) tokenizer.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from helpers import forked

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, session_demo_dir: Path) -> Path:
    """The final checkpoint of an 8-step run of examples/tiny_cpu.yaml (G1 elementwise gate, demo text)."""
    demo = session_demo_dir
    out = tmp_path_factory.mktemp("analyze-run")
    args = [
        "--config",
        str(ROOT / "examples" / "tiny_cpu.yaml"),
        f"train.train_steps={STEPS}",
        "train.seq_length=64",
        "train.micro_batch_size=8",
        "train.global_batch_size=8",
        "train.warmup_steps=2",
        "train.eval_interval=0",
        "train.eval_iters=1",
        "logging.tensorboard=false",
        f"data.demo_dir={demo}",
        f"output.dir={out}",
        f"monitor={{diagnostics: {{interval: {STEPS}}}}}",
    ]
    proc = forked.run_cli(["train", *args], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = out / "checkpoints" / f"iter_{STEPS:07d}"
    assert path.is_dir()
    return path


def saved_model_tensors(path: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors read with torch DCP (independent of megatron's loading code)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(tmp / "ckpt.pt"))
    state = torch.load(tmp / "ckpt.pt", weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not k.startswith("optimizer")}


def test_load_model_for_analysis_has_the_trained_weights(trained: Path, megatron_world, tmp_path: Path) -> None:
    from megagate.analysis.analyze import SAMPLE_TEXT
    from megagate.commands.analyze import load_model_for_analysis
    from megagate.data.tokenizer import load_tokenizer

    model, encode = load_model_for_analysis(trained)
    assert not model.training
    saved = saved_model_tensors(trained, tmp_path)
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    compared = 0
    for sh in nested_values(model.sharded_state_dict()):
        if not isinstance(sh, ShardedTensor):
            continue
        expected = saved[sh.key]  # megatron's checkpoint key, the tensor as torch DCP reads it from disk
        for axis in range(sh.prepend_axis_num):  # layers are stacked along leading axes
            expected = expected[sh.global_offset[axis]]
        assert torch.equal(sh.data, expected), sh.key
        compared += 1
    assert compared == 2 * 7 + 2  # 7 tensors per layer (gate fused into linear_qkv), embedding, final norm
    from megagate import checkpoint as ckpt
    from megagate import config_reader

    cfg = config_reader.from_dict(ckpt.read_meta(trained)["config"])
    ids = encode(SAMPLE_TEXT)
    tok_path = Path(cfg.data.demo_dir) / "data-v2048-b1500000" / "tokenizer.json"
    assert ids == load_tokenizer(tok_path).encode(SAMPLE_TEXT).tolist()
    assert 20 < len(ids) < len(SAMPLE_TEXT) and max(ids) < cfg.model.vocab_size
    # the loaded model predicts real text better than chance (ln 2048 = 7.62) after 8 steps it is still close
    tokens = torch.tensor([ids[:64]])
    with torch.no_grad():
        losses = model(tokens, torch.arange(64)[None], None, labels=torch.tensor([ids[1:65]]))
    assert 5.0 < float(losses.float().mean()) < 7.62


def test_analyze_command_prints_table_and_writes_plots(trained: Path, megatron_world, tmp_path: Path, capsys) -> None:
    from megagate import cli

    out = tmp_path / "analysis"
    assert cli.main(["analyze", str(trained), "--out", str(out), "--seq-len", "32", "--batch", "2"]) == 0
    printed = capsys.readouterr().out
    table = (out / "table.txt").read_text()
    assert table.strip() in printed
    rows = {line.split()[0]: line.split() for line in table.splitlines() if re.match(r"\s*(\d+|all)\s", line)}
    assert sorted(rows) == ["0", "1", "all"]
    for key in ("0", "1", "all"):
        gate, sparsity, f_attn, sink, m_act, max_logit = map(float, rows[key][1:])
        assert 0 < gate < 1 and 0 <= sparsity <= 1 and 0 < f_attn < 1 and m_act > 0 and max_logit > 0
        assert 0 <= sink <= 1
    assert "Sink(T=32)" in table  # --seq-len 32: shorter than Gu et al.'s 64, and the header says so
    assert float(rows["all"][5]) == max(float(rows["0"][5]), float(rows["1"][5]))  # model M-Act = max over layers
    # the model's Sink is the mean over layers (equal heads and samples in each)
    assert float(rows["all"][4]) == pytest.approx((float(rows["0"][4]) + float(rows["1"][4])) / 2, abs=1e-3)
    for name in ("first_token_attention.png", "gate_scores.png", "max_activation.png", "attention_map.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_analysis_reproduces_the_live_diagnostics(trained: Path, megatron_world) -> None:
    """The checkpoint's model on the trainer's probe batch gives the numbers the trainer logged at that step."""
    import json

    from megagate import checkpoint as ckpt
    from megagate import config_reader, run_config
    from megagate.commands.analyze import load_model_for_analysis
    from megagate.monitor import diagnostics
    from megagate.train import components

    model, _ = load_model_for_analysis(trained)
    cfg = config_reader.from_dict(ckpt.read_meta(trained)["config"])
    _, valid, _ = components.build_data(cfg, run_config.layout(cfg, 1))
    probe = next(components.loader(cfg, valid, 0))  # the trainer's probe: the first validation micro-batch
    ours = diagnostics.records(STEPS, diagnostics.collect(model, probe["tokens"], probe["position_ids"]))
    lines = (trained.parent.parent / "diagnostics.jsonl").read_text().splitlines()
    logged = [json.loads(line) for line in lines]
    assert [r["step"] for r in logged] == [STEPS, STEPS] and len(ours) == 2
    for mine, theirs in zip(ours, logged):
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_analyze_rejects_a_folder_without_checkpoint(tmp_path: Path) -> None:
    from megagate.commands.analyze import load_model_for_analysis
    from megagate.errors import MegagateError

    with pytest.raises(MegagateError, match="megagate.json"):
        load_model_for_analysis(tmp_path)
