"""tools/bootstrap_env.sh: each clone gets its own environment, so no clone runs another clone's code."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _imported_from(python: Path) -> str:
    # cwd "/": `python -c` puts the working directory first on sys.path, and this checkout's folder would win
    out = subprocess.run(
        [str(python), "-c", "import megagate; print(megagate.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    return out.stdout.strip()


@pytest.mark.slow  # ~9 s of CPU: two clones, two environments
def test_two_clones_run_their_own_code(tmp_path):
    # a second checkout of this working tree (what bootstrapping and importing need)
    clone = tmp_path / "clone"
    shutil.copytree(REPO / "megagate", clone / "megagate", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "tools", clone / "tools")
    for name in ("requirements.txt", "pyproject.toml"):
        shutil.copy(REPO / name, clone / name)
    (clone / "megagate" / "_clone_marker.py").write_text("WHERE = 'the temporary clone'\n")
    done = subprocess.run(["bash", "tools/bootstrap_env.sh"], cwd=clone, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(clone / ".venv")
    # the clone's interpreter imports the clone's package, and this checkout's still imports this checkout's
    assert _imported_from(clone / ".venv" / "bin" / "python") == str(clone / "megagate" / "__init__.py")
    assert _imported_from(REPO / ".venv" / "bin" / "python") == str(REPO / "megagate" / "__init__.py")
    # the heavy packages are shared, not copied: the clone's environment stays small
    size = sum(p.stat().st_size for p in (clone / ".venv").rglob("*") if p.is_file() and not p.is_symlink())
    assert size < 5_000_000
    run = subprocess.run(
        [
            str(clone / ".venv" / "bin" / "python"),
            "-c",
            "import megagate._clone_marker as m, torch, megatron.core; print(m.WHERE)",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    assert run.stdout.strip() == "the temporary clone"
    # commands of the heavy environment run with the clone's interpreter
    head = (clone / ".venv" / "bin" / "torchrun").read_text().splitlines()[0]
    assert head == f"#!{clone / '.venv' / 'bin' / 'python'}"
