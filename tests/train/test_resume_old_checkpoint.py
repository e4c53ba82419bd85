"""A checkpoint written before the model moved to megatron's HybridModel (issue 37) resumes and continues bit for bit.

tests/golden/resume/ holds, per case, the run's config and the distributed checkpoint it saved at step `stop`, made
by tools/make_resume_fixture.py on main before the move (GPTModel's layout: `decoder.layers.N.{self_attention,mlp}`),
and losses.json the losses of continuing those runs to `steps` on that code. Here each fixture is resumed by
today's code and its continued losses must equal the stored ones exactly.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import forked
from helpers import tiny_runs as T

pytestmark = pytest.mark.slow

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "resume"
RECORD = json.loads((GOLDEN / "losses.json").read_text())


@pytest.mark.parametrize("case", ["dense", "hybrid"])
def test_old_checkpoint_continues_bit_identically(case: str, tmp_path: Path) -> None:
    stop, steps = RECORD["stop"], RECORD["steps"]
    name = f"iter_{stop:07d}"
    shutil.copytree(GOLDEN / case / name, tmp_path / "checkpoints" / name)
    args = ["train", "--config", str(GOLDEN / case / "config.yaml"), f"output.dir={tmp_path}"]
    proc = forked.run_cli(args, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "resumed from" in proc.stdout and name in proc.stdout, proc.stdout[-2000:]
    continued = {str(s): loss for s, loss in T.losses(tmp_path).items() if s > stop}
    assert sorted(continued, key=int) == [str(s) for s in range(stop + 1, steps + 1)]
    assert continued == RECORD[case]  # bitwise equal floats
