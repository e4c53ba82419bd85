"""The trials of a grid: each point one training run with `key=value` overrides on the same config and its own run
directory (`OUT/<variant>_lr<lr>_s<seed>`), which the trainer fills with the runfiles schema and `megagate report`
reads. Every point is read and checked by the trainer's own loader and layout rules before anything runs or is
rendered; OUT/sweep.json records the grid for `megagate report`.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megagate.errors import ConfigError, MegagateError

TRAIN_COMMAND = (sys.executable, "-m", "megagate", "train")


@dataclass(frozen=True)
class RunSpec:
    """One grid point: its name, its config overrides (`key=value`), and its run directory."""

    name: str
    overrides: tuple[str, ...]
    run_dir: str

    def argv(self, config_path: str) -> list[str]:
        """Arguments after the train command: the config, the overrides, the output directory."""
        return ["--config", str(config_path), *self.overrides, f"output.dir={self.run_dir}"]


def _lr_label(lr: float) -> str:
    return f"{lr:g}".replace("+", "")


def expand_grid(
    base_overrides: Sequence[str],
    lrs: Sequence[float],
    variants: Sequence[str],
    seeds: Sequence[int],
    out_dir: str = "runs/sweep",
) -> list[RunSpec]:
    """The grid in a fixed order (variant, lr, seed); the grid's own keys override any in `base_overrides`."""
    from megagate.model import gate as gates

    if not lrs or not variants or not seeds:
        raise ConfigError(f"sweep grid is empty: lrs={list(lrs)}, variants={list(variants)}, seeds={list(seeds)}")
    for lr in lrs:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
            raise ConfigError(f"sweep learning rate {lr!r} must be a positive finite number")
    for variant in variants:
        if variant not in gates.PRESETS:
            raise ConfigError(f"sweep variant {variant!r} is not a gate preset; presets: {', '.join(gates.PRESETS)}")
    for override in base_overrides:
        if "=" not in override:
            raise ConfigError(f"override {override!r} is not key=value")
    grid_keys = {"train.lr", "model.gate.preset", "seed", "output.dir"}
    base = [o for o in base_overrides if o.split("=", 1)[0] not in grid_keys]
    names: set[str] = set()
    specs = []
    for variant, lr, seed in itertools.product(variants, lrs, seeds):
        name = f"{variant}_lr{_lr_label(lr)}_s{seed}"
        if name in names:
            raise ConfigError(f"sweep grid has a duplicate point {name!r} (repeated lr, variant or seed)")
        names.add(name)
        overrides = (*base, f"train.lr={lr!r}", f"model.gate.preset={variant}", f"seed={int(seed)}")
        specs.append(RunSpec(name, overrides, str(Path(out_dir) / name)))
    return specs


def check_grid(specs: Sequence[RunSpec], config_path: str, world_size: int = 1) -> None:
    """Read every grid point with the trainer's loader and check its layout on `world_size` ranks.

    A ConfigError names the first bad point: the grid's own keys (variant, learning rate) can clash with the base.
    """
    from megagate import config_reader, run_config

    for spec in specs:
        try:
            cfg = config_reader.load(config_path, [*spec.overrides, f"output.dir={spec.run_dir}"])
            run_config.layout(cfg, world_size)
        except ConfigError as exc:
            raise ConfigError(f"sweep point {spec.name}: {exc}") from None


SWEEP_FILE = "sweep.json"  # megagate.analysis.aggregate.SWEEP_FILE: how `report` tells which sweep a run is in


def write_sweep_file(
    out_dir: str | Path,
    config_path: str,
    base_overrides: Sequence[str],
    lrs: Sequence[float],
    variants: Sequence[str],
    seeds: Sequence[int],
    specs: Sequence[RunSpec],
) -> Path:
    """OUT/sweep.json (atomically): the config, the base overrides, the grid and its run names. `megagate report`
    groups the runs under this folder as one sweep; a later sweep into the same folder (more variants or LRs) writes
    its own grid and keeps the earlier ones under "earlier", oldest first."""
    from megagate.monitor import runfiles

    path = Path(out_dir) / SWEEP_FILE
    record: dict = {
        "config": str(config_path),
        "overrides": list(base_overrides),
        "grid": {"lrs": [float(x) for x in lrs], "variants": list(variants), "seeds": [int(x) for x in seeds]},
        "runs": [spec.name for spec in specs],
    }
    try:
        previous = runfiles.read_json(path)
    except MegagateError:  # an unreadable file is replaced, not fatal: it only labels the folder
        previous = None
    if previous:
        earlier = previous.pop("earlier", [])
        record["earlier"] = [*(earlier if isinstance(earlier, list) else []), previous]
    runfiles.write_json(path, record)
    return path
