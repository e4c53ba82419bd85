"""The first hour of a new user: a dry-run that describes this machine (or the named cluster) with its data and
tokenizer, outputs under the run, one clear line for two data sources, a warning for a vocabulary far below the one
asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megagate.cli import main
from megagate.commands.analyze import default_out, run_folder
from megagate.errors import MegagateError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny_cpu.yaml")
CPU = not torch.cuda.is_available()


def dry_run(capsys, *args: str) -> str:
    assert main(["train", "--config", TINY, "--dry-run", *args]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


@pytest.mark.skipif(not CPU, reason="describes a CPU machine")
def test_dry_run_describes_this_machine(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = dry_run(capsys)
    lines = out.splitlines()
    # what the real run on this CPU uses: SDPA, no Transformer Engine, the GPU fusions off, no memory plan
    assert "kernels: attention sdpa (torch scaled_dot_product_attention; CPU flash kernel)" in lines
    assert any(line.startswith("perf (on CPU, no Transformer Engine)") for line in lines)
    assert any(line.startswith("device: this machine's CPU (") and "parameters fp32" in line for line in lines)
    assert "memory plan: none (a CPU run); --gpu NAME plans one" in lines
    assert "h100" not in out and " te " not in out
    data = next(line for line in lines if line.startswith("data: "))
    assert data.startswith("data: demo corpus (") and "under runs/demo-data; split 95,5,0" in data
    assert "tokenizer: runs/demo-data/data-v2048-b1500000/tokenizer.json" in lines
    assert "output: runs/tiny-g1; checkpoints: runs/tiny-g1/checkpoints" in lines
    assert list(tmp_path.iterdir()) == []  # a dry-run writes nothing


def test_dry_run_of_a_named_cluster(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    lines = dry_run(capsys, "--gpu", "h200", "data.demo=false", "data.mock=true").splitlines()
    assert "kernels: attention te (Transformer Engine DotProductAttention)" in lines
    assert "device: a cluster of h200 GPUs (the target; --gpu / --world-size), parameters fp32" in lines
    assert "memory plan:" in lines and any(line.startswith("device: h200, ") for line in lines)
    assert (
        "data: mock (megatron's MockGPTDataset: synthetic tokens, no files); split 95,5,0 (train, valid, test); "
        "loader torch"
    ) in lines
    assert "tokenizer: none (mock data: token ids only)" in lines
    # --world-size alone names a cluster too: the default GPU
    assert "device: a cluster of h100-sxm GPUs" in dry_run(capsys, "--world-size", "2")
    assert main(["train", "--config", TINY, "--dry-run", "--gpu", "h100sxm"]) == 2
    assert capsys.readouterr().err.endswith("did you mean 'h100-sxm'?\n")


def test_own_data_from_jsonl_to_a_dry_run(capsys, tmp_path, monkeypatch) -> None:
    """The walk-through of docs/data.md up to the dry-run, on a tiny corpus: a vocabulary far below the one asked for
    is warned about; the dry-run names the blend and the tokenizer; data.demo with a blend is one line."""
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"document {i}: the gate opens and closes.\n"}) + "\n" for i in range(50))
    )
    assert main(["tokenizer", "train", "-i", str(corpus), "-o", "tok.json", "--vocab-size", "4096"]) == 0
    out, err = capsys.readouterr()
    vocab = int(out.split(": ")[1].split()[0])
    assert 259 < vocab < 2048, out
    assert err == (
        f"warning: {vocab} tokens, far below --vocab-size 4096: the corpus has too few repeated pairs "
        f"(--min-frequency 2); give more text or a smaller --vocab-size, and set model.vocab_size >= {vocab}\n"
    )
    assert main(["tokenizer", "train", "-i", str(corpus), "-o", "tok2.json", "--vocab-size", str(vocab)]) == 0
    assert capsys.readouterr().err == ""  # what the corpus can give: no warning
    assert main(["preprocess", "-i", str(corpus), "-o", "data/c", "-t", "tok.json", "--workers", "0"]) == 0
    capsys.readouterr()
    blend = ["data.blend=[data/c_text_document]", "data.tokenizer=tok.json", f"model.vocab_size={vocab}"]
    lines = dry_run(capsys, "data.demo=false", *blend).splitlines()
    assert "data: blend data/c_text_document; split 95,5,0 (train, valid, test); loader torch" in lines
    assert "tokenizer: tok.json" in lines
    assert main(["train", "--config", TINY, "--dry-run", *blend]) == 2
    assert capsys.readouterr().err == (
        "megagate train: error: data.demo=true and data.blend name two data sources: set data.demo=false to train "
        "on data.blend (or drop data.blend for the demo corpus)\n"
    )


def checkpoint(root: Path, step: int) -> Path:
    path = root / f"iter_{step:07d}"
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")  # what makes a checkpoint complete
    return path


def test_outputs_go_under_the_run(tmp_path) -> None:
    run = tmp_path / "runs" / "g1"
    newest = checkpoint(run / "checkpoints", 30)
    checkpoint(run / "checkpoints", 60)
    for source in (run, run / "checkpoints", newest):  # a run folder, its checkpoint root, one checkpoint
        assert run_folder(source) == run
        assert default_out([str(source)], "eval") == str(run / "eval")
    own = checkpoint(tmp_path / "imported", 0).parent  # a checkpoint root of its own (`megagate import --out`)
    assert run_folder(own) == own and default_out([str(own)], "analysis") == str(own / "analysis")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert run_folder(hf) == hf
    with pytest.raises(MegagateError, match=r"^the checkpoints are of 2 runs \(.*\): give --out FOLDER$"):
        default_out([str(run), str(own)], "eval")
    assert default_out([str(run), str(newest)], "eval") == str(run / "eval")  # one run named twice
