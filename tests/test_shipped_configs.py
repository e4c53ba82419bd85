"""Every shipped config is a complete trainer config, and every shipped batch script is what the code renders.

Discovered by glob, so a new file under examples/ or slurm/examples/ is covered without editing this test.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from megagate import config_reader, run_config
from megagate.cli import main
from megagate.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SLURM_EXAMPLES = ROOT / "slurm" / "examples"
CONFIGS = sorted([*(ROOT / "examples").rglob("*.yaml"), *SLURM_EXAMPLES.rglob("*.yaml")])
SCRIPTS = sorted(SLURM_EXAMPLES.glob("*.sbatch"))


def render_examples():
    """slurm/examples/render_examples.py as a module (its JOBS and examples())."""
    spec = importlib.util.spec_from_file_location("render_examples", SLURM_EXAMPLES / "render_examples.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def planned_world_sizes(path: Path) -> list[int]:
    """The world sizes a config is shipped for: those of the example jobs that run it, else the smallest that fits."""
    relative = str(path.relative_to(ROOT))
    worlds = sorted({job.request.world_size for job in render_examples().JOBS if job.config == relative})
    if worlds:
        return worlds
    cfg = config_reader.load(str(path))
    p = cfg.parallel
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    last = None
    for dp in range(1, 1025):  # the smallest DP with which EP and the batch divide
        try:
            run_config.layout(cfg, model_parallel * dp)
            return [model_parallel * dp]
        except ConfigError as exc:
            last = exc
    raise AssertionError(f"{relative}: no world size up to DP 1024 fits: {last}")


def test_discovery_finds_the_shipped_files():
    names = {str(p.relative_to(ROOT)) for p in CONFIGS}
    assert {
        "examples/tiny_cpu.yaml",
        "slurm/examples/configs/tiny.yaml",
        "slurm/examples/configs/15a2b_moe.yaml",
    } <= names
    assert {p.name for p in SCRIPTS} >= {"15a2b_8x8.sbatch", "tiny_2x2.sbatch"}


def test_world_sizes_are_the_jobs():
    assert planned_world_sizes(SLURM_EXAMPLES / "configs" / "15a2b_moe.yaml") == [64]
    assert planned_world_sizes(SLURM_EXAMPLES / "configs" / "tiny.yaml") == [4]
    assert planned_world_sizes(ROOT / "examples" / "tiny_cpu.yaml") == [1]


# configs that train on files a command of their header writes first: that command, run in the test's folder
PREPARE = {
    "examples/sink_repro_cpu.yaml": [
        "data", "synth", "--out", "runs/sink-data", "--documents", "4096", "--length", "64", "--vocab", "64",
        "--zipf", "1.0", "--triggers", "2",
    ],
}  # fmt: skip


def test_prepare_commands_are_the_configs_own():
    for name, argv in PREPARE.items():
        assert "megagate " + " ".join(argv) in (ROOT / name).read_text()


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT)) for p in CONFIGS])
def test_config_dry_runs(path: Path, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written, and relative paths in the config must not matter here
    prepare = PREPARE.get(str(path.relative_to(ROOT)))
    if prepare:
        assert main(prepare) == 0
    before = sorted(tmp_path.rglob("*"))
    for world in planned_world_sizes(path):
        rc = main(["train", "--config", str(path), "--dry-run", "--world-size", str(world)])
        assert rc == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert f"parallel: world {world} = " in out
    assert sorted(tmp_path.rglob("*")) == before


def test_15a2b_example_is_the_papers_model_on_8x8(capsys):
    assert (
        main(
            ["train", "--config", str(SLURM_EXAMPLES / "configs" / "15a2b_moe.yaml"), "--dry-run", "--world-size", "64"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "MoE 128 experts top-8" in out
    assert "parameters: 15,778,553,856 total, 2,189,008,896 active, 201,326,592 in gates" in out
    assert "world 64 = TP 1 x PP 1 x CP 1 x DP 64; EP 8" in out
    assert "precision bf16" in out


def test_every_shipped_script_is_rendered_from_its_config(monkeypatch):
    module = render_examples()
    monkeypatch.chdir(ROOT)  # the jobs name their configs relative to the repository root
    rendered = module.examples()
    assert sorted(rendered) == [p.name for p in SCRIPTS]  # no script on disk that the code does not render
    for path in SCRIPTS:
        stale = f"{path.name} is stale: python slurm/examples/render_examples.py"
        assert path.read_text() == rendered[path.name], stale
    for job in module.JOBS:
        assert (ROOT / job.config).is_file() and ROOT / job.config in CONFIGS
    assert module.main(["--check"]) == 0
