"""`plan --search` with no fitting layout says so, and why, in text and in JSON (exit 1)."""

from __future__ import annotations

import json
from pathlib import Path

from megagate.cli import main

BASE = str(Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml")
MOE = ["model.preset=15a2b-moe", "model.vocab_size=151936"]  # 15B parameters on one 80 GB GPU


def test_json_says_nothing_fits_and_why(capsys):
    assert main(["plan", BASE, "--nodes", "1", "--gpus-per-node", "1", "--search", "--json", *MOE]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["fitting_layouts"] == 0 and out["best"] is None
    why = out["nothing_fits"]
    assert why.startswith("the layout needing the least memory, TP1 PP1") and "of 80.0 GB per GPU" in why
    need = float(why.split("needs ")[1].split(" GB")[0])
    assert need > 80.0


def test_text_says_why_too(capsys):
    assert main(["plan", BASE, "--nodes", "1", "--gpus-per-node", "1", "--search", *MOE]) == 1
    assert capsys.readouterr().out.startswith("no layout fits: the layout needing the least memory")
