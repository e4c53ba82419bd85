"""The plan of the paper's 15A2B on 8 x 8 H100 (the issue's figures), the refusal, the command and the device table."""

from __future__ import annotations

import argparse
import json

from megagate import config_reader
from megagate.plan import plan
from megagate.plan.devices import GB, from_cuda_name

CONFIG = "slurm/examples/configs/15a2b_moe.yaml"


def _cfg(*overrides: str):
    return config_reader.load(CONFIG, ["train.micro_batch_size=1", *overrides], environment=False)


def test_15a2b_on_8x8_h100_fits_with_the_issue_figures() -> None:
    p = plan(_cfg(), 64, "h100")
    (role,) = p.roles
    assert (role.params, role.expert_params) == (3_094_978_560, 1_811_939_328)  # = the meta build (test_meta_build)
    assert round(role.items["weights (bf16)"] / GB, 2) == 6.19
    assert round(role.items["gradient buffer (fp32)"] / GB, 2) == 12.38
    assert round(role.items["optimizer shard (Adam + fp32 main)"] / GB, 2) == 2.96
    assert 40 * GB < role.total < 50 * GB and p.fits and p.refusal() == ""
    assert "fits" in p.table()


def test_without_te_the_unfused_scores_do_not_fit() -> None:
    p = plan(_cfg("train.backend=local", "perf.core_attention=local"), 64, "h100")
    assert p.kernels.name == "gpu-local" and not p.fits
    assert p.refusal().startswith("predicted out of memory: pipeline stage 0 needs 130.")
    assert "\n" not in p.refusal()


def test_without_te_sdpa_is_planned_and_fits() -> None:
    """Without TE the spec's default core attention is SDPA (flash-like: no [b, np, s, s] scores), so the same
    15A2B layout that OOMs with megatron's local attention fits, within a GB of the TE plan."""
    sdpa = plan(_cfg("train.backend=local"), 64, "h100")
    te = plan(_cfg(), 64, "h100")
    assert sdpa.kernels.name == "gpu-sdpa" and sdpa.fits
    assert abs(sdpa.peak.total - te.peak.total) < 1 * GB


def test_command_prints_every_stage(capsys) -> None:
    from megagate.commands import plan as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_intermixed_args(
        [CONFIG, "--nodes", "16", "--gpu", "h200", "parallel.pipeline_model_parallel_size=4"]
    )
    assert command.run(args) == 0
    out = capsys.readouterr().out
    assert "stage 3" in out and "h200, 141 GB" in out and "step time" in out


def test_trainer_peak_table_is_the_planner_table() -> None:
    assert from_cuda_name("NVIDIA H100 80GB HBM3").bf16_tflops == 989.0
    assert from_cuda_name("NVIDIA L40S").name == "l40s"
    assert from_cuda_name("NVIDIA GH200 480GB").name == "gh200"
    assert from_cuda_name("Tesla V100") is None


def test_submit_dry_run_shows_the_plan_and_refuses_what_does_not_fit(capsys, monkeypatch, tmp_path) -> None:
    """`megagate submit` plans every GPU job: the table on stderr with --dry-run; a predicted OOM is refused in
    one line (nothing rendered) unless --ignore-memory-plan."""
    from pathlib import Path

    from megagate import cli

    config = str(Path(CONFIG).resolve())
    monkeypatch.chdir(tmp_path)
    base = ["submit", config, "--nodes", "8", "--gpus-per-node", "8", "--dry-run"]
    assert cli.main(base) == 0
    out, err = capsys.readouterr()
    assert out.startswith("#!/bin/bash") and "memory plan:" in err and "-> fits" in err
    assert cli.main([*base, "train.backend=local", "perf.core_attention=local"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "predicted out of memory" in err and "pass --force" in err
    refusal = err.split("error: ", 1)[1].split("; see")[0]
    for flag in ("--force", "--ignore-memory-plan"):
        assert cli.main([*base, "train.backend=local", "perf.core_attention=local", flag]) == 0
        out, err = capsys.readouterr()
        assert out.startswith("#!/bin/bash") and "-> DOES NOT FIT: predicted out of memory" in err
        # the numbers come with it: the same refusal line (stage, GB needed of GB, largest item)
        assert f"warning: {refusal}; submitting anyway (--force)" in err


def test_train_dry_run_prints_the_plan(capsys) -> None:
    from megagate import cli

    assert cli.main(["train", "--config", CONFIG, "--dry-run", "--world-size", "64", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "parameters:" in out and "memory plan:" in out and "device: h200, 141 GB" in out


def test_plan_refusals_are_one_line_exit_2(capsys, tmp_path) -> None:
    """The issue's refusals through the command: a bad profile file (unreadable JSON, missing, a wrong field), an
    unknown GPU, a layout that does not divide the world. Each: exit 2, one line naming the bad value, no stdout."""
    from megagate import cli

    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json")
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"schema": 0}')
    from megagate.plan import profile
    from megagate.plan.devices import gpu_spec
    from megagate.plan.gpu_defaults import gpu_profile

    share = tmp_path / "share.json"
    share.write_text(json.dumps({**profile.to_dict(gpu_profile(gpu_spec("h100"))), "dispatch_compute_share": 1.5}))
    base = ["plan", CONFIG, "--nodes", "1"]
    cases = [
        ([*base, "--profile", str(garbled)], str(garbled)),
        ([*base, "--profile", str(tmp_path / "absent.json")], "absent.json"),
        ([*base, "--profile", str(wrong)], "schema 0"),
        ([*base, "--profile", str(share)], "dispatch_compute_share=1.5 must be a share in [0, 1)"),
        ([*base, "--gpu", "h1000"], "h1000"),
        ([*base, "parallel.tensor_model_parallel_size=3"], "tensor_model_parallel_size (3)"),
        ([*base, "parallel.expert_model_parallel_size=16"], "expert_model_parallel_size (16) must divide"),
    ]
    for argv, words in cases:
        assert cli.main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and words in err, (argv, err)
