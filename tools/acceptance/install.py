"""Part `install`: megatron-core from the carried wheels (`make gpu-wheels` makes them), else the machine's own.

The wheels go into a private folder under /tmp (`pip install --target`, no index, no dependencies, nothing written
into the machine's environment) that the later parts put first on PYTHONPATH. Then megatron-core is imported in a
fresh interpreter, as the parts will import it, and its version checked against requirements.txt's pin.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tools.acceptance import child

PIN = re.compile(r"^megatron-core==(\S+)", re.M)


def pinned_version() -> str | None:
    """The megatron-core version requirements.txt pins."""
    match = PIN.search((child.ROOT / "requirements.txt").read_text())
    return match.group(1) if match else None


def duplicates(wheels: list[Path]) -> dict[str, list[str]]:
    """Distributions present in more than one version ({name: [files]}): pip would refuse the whole install."""
    by_name: dict[str, list[str]] = {}
    for wheel in wheels:
        by_name.setdefault(wheel.name.split("-")[0].lower(), []).append(wheel.name)
    return {name: files for name, files in by_name.items() if len(files) > 1}


def import_megatron(site: Path | None) -> tuple[str | None, str]:
    """(version, where) of megatron-core imported by a fresh interpreter, or (None, the import error)."""
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    code = "import megatron.core as m; print(m.__version__); print(m.__file__)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        return None, lines[-1] if lines else f"exit code {proc.returncode}"
    version, where = proc.stdout.split()[-2:]
    return version, where


def body(args, record: child.Record) -> None:
    wheels = sorted(args.wheels.glob("*.whl")) if args.wheels.is_dir() else []
    pin = pinned_version()
    record.update(wheels=[w.name for w in wheels], wheels_dir=str(args.wheels), pinned=pin)
    site = None
    if wheels:
        twice = duplicates(wheels)
        if twice:
            record.fail(f"several versions of one package in {args.wheels}: {twice} (make gpu-wheels keeps one)")
            return
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        cmd += ["--no-cache-dir", "--upgrade", "--target", str(args.site), *map(str, wheels)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        print(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
            record.fail(f"pip install of {', '.join(w.name for w in wheels)} failed: {' | '.join(lines[-3:])}")
            return
        site = args.site
        record.update(site=str(site))
    version, where = import_megatron(site)
    if version is None:
        how = f"the wheels in {args.wheels} installed but" if wheels else f"no wheel in {args.wheels}, and"
        record.fail(
            f"{how} megatron-core does not import ({where}); run 'make gpu-wheels' where pip reaches PyPI and carry "
            ".whl with the tree"
        )
        return
    record.update(megatron_core=version, megatron_core_path=where, source="wheel" if site else "machine")
    if pin and version.split(".")[:2] != pin.split(".")[:2]:
        record.fail(f"megatron-core {version} imports, megagate needs {pin} (requirements.txt): carry its wheel")


def options(p) -> None:
    p.add_argument("--wheels", type=Path, required=True, help="folder of carried wheels (.whl)")
    p.add_argument("--site", type=Path, required=True, help="private folder to install them into")


if __name__ == "__main__":
    child.main(__doc__.splitlines()[0], body, options)
