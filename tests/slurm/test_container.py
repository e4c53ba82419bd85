"""The container path: container/Dockerfile's pins against requirements.txt, the pyxis sbatch rendered from the
project's image, and the allocator default every rendered script sets (unless the submitting shell set one)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from pathlib import Path

from megagate.slurm import SlurmRequest, render_batch_script

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "container" / "Dockerfile"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s#]+)")


def _requirements() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        m = _PIN.match(line.strip())
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def _dockerfile() -> tuple[dict[str, str], dict[str, set[str]], str]:
    """(pins installed, the declared exclusions by reason, the base image)."""
    text = DOCKERFILE.read_text()
    pins = {m.group(1).lower(): m.group(2) for m in re.finditer(r"^\s+([A-Za-z0-9][\w.-]*)==(\S+) \\$", text, re.M)}
    excluded = {
        m.group(1): set(m.group(2).lower().split()) for m in re.finditer(r"^# (from-image|dev-only): (.*)$", text, re.M)
    }
    base = re.search(r"^ARG BASE=(\S+)$", text, re.M).group(1)
    return pins, excluded, base


def test_dockerfile_pins_are_requirements_pins() -> None:
    required = _requirements()
    pins, excluded, base = _dockerfile()
    assert pins and "megatron-core" in pins and pins["megatron-core"] == required["megatron-core"] == "0.19.2"
    for name, version in pins.items():  # every pin in the image is the project's
        assert required.get(name) == version, (name, version, required.get(name))
    left_out = excluded["from-image"] | excluded["dev-only"]
    assert "torch" in excluded["from-image"] and "torch" not in pins  # the image's CUDA build, never reinstalled
    assert not (left_out & pins.keys()) and left_out <= required.keys()
    assert pins.keys() | left_out == required.keys(), sorted(required.keys() - pins.keys() - left_out)
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", base), base  # a pinned NGC tag, not latest


def _example(name: str) -> str:
    spec = importlib.util.spec_from_file_location("render_examples", REPO / "slurm" / "examples" / "render_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    job = next(j for j in module.JOBS if j.name == name)
    cwd = os.getcwd()
    os.chdir(REPO)  # the examples name configs relative to the repository root
    try:
        return job.render()
    finally:
        os.chdir(cwd)


def test_container_sbatch_runs_the_image() -> None:
    script = _example("15a2b_8x8_container.sbatch")
    assert (REPO / "slurm" / "examples" / "15a2b_8x8_container.sbatch").read_text() == script
    step = [line.strip() for line in script.splitlines() if line.strip().startswith("srun ")]
    assert len(step) == 1
    flags = step[0].split()
    assert flags[:5] == [
        "srun",
        "--kill-on-bad-exit=1",
        "--container-image=/lustre/images/megagate-0.1.0.sqsh",
        "--container-mounts=/lustre:/lustre",
        "--container-workdir=/opt/megagate",
    ]
    assert flags[flags.index("--ntasks-per-node=8") + 1 : flags.index("--ntasks-per-node=8") + 4] == [
        "python",
        "-m",
        "megagate",
    ]  # the image's python: no venv, in the step or in the batch shell
    assert "/bin/activate" not in script and ".venv" not in step[0]
    assert "#SBATCH --nodes=8" in script and "#SBATCH --gpus-per-node=8" in script
    assert "expandable_segments:True" in script
    venv = _example("15a2b_8x8_torchrun.sbatch")  # the venv path stays
    assert "--container-image" not in venv and "source /shared/megagate/.venv/bin/activate" in venv


def _env_section(script: str) -> str:
    lines = script.splitlines()
    start = lines.index("# ---- NCCL / network knobs: the one place to tune the fabric ----")
    end = lines.index("# ---- software environment ----")
    return "\n".join(lines[start:end])


def _allocator_after(section: str, **preset: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTORCH_CUDA_ALLOC", "PYTORCH_ALLOC"))}
    env.update(preset)
    out = subprocess.run(
        ["bash", "-c", f'{section}\necho "${{PYTORCH_ALLOC_CONF-<unset>}}"'],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def test_rendered_allocator_default_yields_to_the_user() -> None:
    request = SlurmRequest(nodes=1, gpus_per_node=8, job_name="alloc")
    section = _env_section(render_batch_script(request, ["-m", "megagate", "train"]))
    assert _allocator_after(section) == "expandable_segments:True"
    assert _allocator_after(section, PYTORCH_ALLOC_CONF="max_split_size_mb:512") == "max_split_size_mb:512"
    assert _allocator_after(section, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False") == "<unset>"
    # SlurmRequest.env names the variable: exactly what it says, set or unset
    unset = SlurmRequest(nodes=1, gpus_per_node=8, job_name="alloc", env={"PYTORCH_ALLOC_CONF": None})
    section = _env_section(render_batch_script(unset, ["-m", "megagate", "train"]))
    assert _allocator_after(section, PYTORCH_ALLOC_CONF="expandable_segments:True") == "<unset>"
