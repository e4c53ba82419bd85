"""Part `plan`: `megagate plan`'s prediction for the acceptance's training config on this machine's device.

Read from the command's public output: its `--json` where the command has it (the keys `fits`, `memory.peak_gb`,
`time.step_s`, `time.tokens_per_s_per_gpu`, `time.mfu`, `device`), else the printed table (the `total` and
`workspace margin` rows, `step time ~X s`). The orchestrator sets the prediction beside the training's measured
step time and peak memory.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from typing import Any

from tools.acceptance import child

GB = 1e9  # the planner's unit


def has_option(command: str, option: str) -> bool:
    """Whether `megagate COMMAND` takes `option` (its argparse definition, without running it)."""
    from megagate.cli import command_module

    parser = argparse.ArgumentParser()
    command_module(command).add_arguments(parser)
    return any(option in action.option_strings for action in parser._actions)


def from_json(data: dict[str, Any]) -> dict[str, Any]:
    memory, step = data.get("memory") or {}, data.get("time") or {}
    return {
        "fits": data.get("fits"),
        "peak_gb": memory.get("peak_gb"),
        "step_s": step.get("step_s"),
        "tokens_per_s_per_gpu": step.get("tokens_per_s_per_gpu"),
        "mfu": step.get("mfu"),
        "device": data.get("device"),
        "kernels": (data.get("layout") or {}).get("kernels"),
    }


def from_table(text: str) -> dict[str, Any]:
    """The figures of a one-stage table: every `name  value` row (GB), the step time and tokens/s."""
    rows = {m.group(1).strip(): float(m.group(2)) for m in re.finditer(r"^(\S.*?)\s{2,}(-?[\d.]+)\s*$", text, re.M)}
    step = re.search(r"step time ~([\d.]+) s", text)
    tokens = re.search(r"([\d,]+) tokens/s", text)
    kernels = re.search(r"kernels (\S+);", text)
    return {
        "fits": "-> fits" in text,
        "peak_gb": rows.get("total"),
        "workspace_margin_gb": rows.get("workspace margin"),
        "step_s": float(step.group(1)) if step else None,
        "tokens_per_s_per_gpu": float(tokens.group(1).replace(",", "")) if tokens else None,
        "kernels": kernels.group(1) if kernels else None,
    }


def plan_figures(config: str, sets: list[str], gpu: str, profile: str | None = None) -> dict[str, Any]:
    """Run `megagate plan` in this process for one GPU and read its figures."""
    from megagate.cli import main

    use_json = has_option("plan", "--json")
    argv = ["plan", config, *sets, "--nodes", "1", "--gpus-per-node", "1", "--gpu", gpu]
    if profile:
        argv += ["--profile", profile]
    if use_json:
        argv.append("--json")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    text = out.getvalue()
    figures: dict[str, Any] = {"command": "megagate " + " ".join(argv), "read_from": "--json" if use_json else "table"}
    if rc != 0:
        raise RuntimeError(f"megagate plan exited {rc}: {(err.getvalue() or text).strip()[-500:]}")
    figures.update(from_json(json.loads(text)) if use_json else from_table(text))
    if figures.get("peak_gb") is not None:
        figures["peak_gib"] = round(figures["peak_gb"] * GB / 2**30, 2)
    if figures.get("workspace_margin_gb") is not None and figures.get("peak_gb") is not None:
        figures["peak_gib_without_margin"] = round(
            (figures["peak_gb"] - figures["workspace_margin_gb"]) * GB / 2**30, 2
        )
    if not use_json:
        figures["table"] = text.splitlines()[:40]
    return figures


def body(args, record: child.Record) -> None:
    record.update(**plan_figures(str(args.config), args.set, args.gpu))


def options(p) -> None:
    p.add_argument("--config", required=True, help="the acceptance's YAML config")
    p.add_argument("--set", action="append", default=[], help="a config override key=value (repeatable)")
    p.add_argument("--gpu", default="h200", help="the planner's device name")


if __name__ == "__main__":
    child.main(__doc__.splitlines()[0], body, options)
