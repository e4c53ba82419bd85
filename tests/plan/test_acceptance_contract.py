"""The GPU acceptance (tools/acceptance, issue 21) reads `megagate plan --json` and runs `megagate calibrate
--budget-s`: the keys and flags it uses are the ones the commands have, and its reader gets every figure from a real
plan (a renamed key would first show as a null on the GPU machine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers.plan_profiles import cpu_profile
from megagate import cli
from megagate.plan import profile as profile_mod

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/ lives at the repository root
from tools.acceptance.calibrate import budget_s  # noqa: E402
from tools.acceptance.plan_part import has_option, plan_figures  # noqa: E402

CONFIG = "tools/acceptance/acceptance.yaml"
READ = ("fits", "peak_gb", "step_s", "tokens_per_s_per_gpu", "mfu", "device", "kernels")


def test_the_commands_have_the_flags_the_acceptance_passes() -> None:
    assert has_option("plan", "--json") and has_option("plan", "--profile") and has_option("plan", "--gpu")
    assert has_option("calibrate", "--out") and has_option("calibrate", "--budget-s")


def test_calibrate_part_budget_is_never_one_calibrate_refuses() -> None:
    """A 120 s share measures for 60 s; a short one (a --cap under 80 s) for calibrate's least, 20 s, where it once
    asked for 15 and calibrate refused; the smoke measures for the least whatever its share."""
    from megagate.commands.calibrate import MIN_BUDGET_S

    assert MIN_BUDGET_S == 20
    assert budget_s(120, smoke=False) == 60 and budget_s(300, smoke=False) == 240
    assert budget_s(70, smoke=False) == 20 and budget_s(30, smoke=False) == 20
    assert budget_s(600, smoke=True) == 20


def test_plan_part_reads_every_figure_from_the_json(capsys) -> None:
    figures = plan_figures(CONFIG, [], "h200")
    assert figures["read_from"] == "--json" and all(figures[k] is not None for k in READ), figures
    assert cli.main(["plan", CONFIG, "--nodes", "1", "--gpus-per-node", "1", "--gpu", "h200", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert figures["peak_gb"] == data["memory"]["peak_gb"] and figures["step_s"] == data["time"]["step_s"]
    assert figures["device"]["name"] == "h200" and figures["kernels"] == "gpu-sdpa"
    assert figures["tokens_per_s_per_gpu"] == pytest.approx(
        data["time"]["tokens_per_step"] / data["time"]["step_s"]  # one GPU: per GPU = the cluster
    )


def test_calibrate_part_plans_with_the_profile_file(tmp_path) -> None:
    """The calibrate part passes --gpu and --profile together: the profile's device wins (a CPU one: no MFU)."""
    path = tmp_path / "device_profile.json"
    profile_mod.save(cpu_profile(), str(path))
    figures = plan_figures(CONFIG, ["model.num_layers=2", "train.seq_length=256"], "h200", str(path))
    assert figures["device"]["kind"] == "cpu" and figures["device"]["name"] == "cpu: test (2 cores)"
    assert figures["step_s"] > 0 and figures["peak_gb"] > 0 and figures["mfu"] is None
    assert figures["kernels"] == "cpu-sdpa"
