"""docs/data.md's "Your own data" walk-through, end to end, as pasted: the commands of its shell block run in order
(in a scratch folder that has the repository's examples/), the two trainings shortened by key=value overrides
appended to them (the only change), and each output the doc names is checked."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.doc_blocks import shell_blocks

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Your own data: from JSONL to a compared result"
# a short version of steps 4-5: 4 steps, an evaluation at step 2, a checkpoint at the end
SHORT_TRAIN = ["train.train_steps=4", "train.warmup_steps=1", "train.eval_interval=2", "train.eval_iters=1"]


def walkthrough() -> list[str]:
    """The walk-through block's command lines (continuations joined, comments dropped), in order."""
    text = (ROOT / "docs" / "data.md").read_text()
    return [command for _, command in shell_blocks(text[text.index(SECTION) :])[0]]


def test_the_block_is_the_one_documented() -> None:
    lines = walkthrough()
    assert lines[0].startswith("mkdir -p runs/mydata") and lines[1].startswith("python -c ")
    names = [shlex.split(line)[1] for line in lines if line.startswith("megagate ")]
    assert names == ["tokenizer", "preprocess", "data", "train", "train", "train", "report", "analyze", "eval"]


@pytest.mark.slow
def test_the_walkthrough_runs_as_pasted(tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MEGAGATE_VERBOSE": "0"}
    bindir = Path(sys.executable).parent
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"  # `python` and `megagate` of this environment
    for line in walkthrough():
        argv = shlex.split(line)
        if argv[0] == "megagate":
            argv = [sys.executable, "-m", "megagate", *argv[1:]]
            if argv[3] == "train" and "--dry-run" not in argv:
                argv += SHORT_TRAIN
        elif argv[0] == "python":
            argv[0] = sys.executable
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{line}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    runs = tmp_path / "runs"
    assert (runs / "mydata" / "corpus_text_document.bin").stat().st_size > 1_000_000  # the stdlib corpus
    for name in ("mydata-baseline", "mydata-g1"):
        summary = json.loads((runs / name / "summary.json").read_text())
        assert summary["steps"] == 4
        assert any((runs / name / "checkpoints").iterdir())
    report = (runs / "mydata-report" / "report.txt").read_text()
    assert "mydata-baseline" in report and "mydata-g1" in report and "g1-elementwise" in report
    assert (runs / "mydata-report" / "loss_curves.png").stat().st_size > 0
    assert any((runs / "mydata-g1" / "analysis").iterdir())
    assert any((runs / "mydata-eval").iterdir())
