"""Layout checks, requests, rendered scripts and `megagate submit --dry-run` (no cluster needed)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import stat
import subprocess
from pathlib import Path

import pytest

from megagate.commands import submit as submit_cmd
from megagate.errors import ConfigError
from megagate.slurm import (
    SlurmRequest,
    apply_overrides,
    check_layout,
    parse_time_limit,
    read_parallel_config,
    render_batch_script,
    write_script,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG_15A2B = REPO / "slurm" / "examples" / "configs" / "15a2b_moe.yaml"


# ---------------------------------------------------------------- layout
def test_layout_15a2b_on_8x8() -> None:
    layout = check_layout(tp=1, pp=1, cp=1, ep=8, dp=None, num_experts=128, nodes=8, gpus_per_node=8)
    assert (layout.dp, layout.expert_dp, layout.world_size) == (64, 8, 64)
    assert layout.describe() == "TP=1 PP=1 CP=1 DP=64 EP=8 ETP=1 expert-DP=8 experts=128 world=64"


def test_layout_resolves_dp_and_accepts_matching_dp() -> None:
    assert check_layout(2, 2, 2, 1, None, 0, 4, 8).dp == 4
    assert check_layout(2, 2, 2, 1, 4, 0, 4, 8).dp == 4
    # EP divides DP x CP (not only DP): megatron's expert grid is ETP x EP x PP.
    assert check_layout(2, 1, 2, 4, None, 8, 1, 8).expert_dp == 1


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((2, 4, 1, 1, None, 0, 2, 6), {},
         "TP(2) x PP(4) x CP(1) = 8 does not divide nodes x gpus-per-node = 2 x 6 = 12"),
        ((1, 1, 1, 1, 3, 0, 1, 4), {},
         "TP(1) x PP(1) x CP(1) x DP(3) = 3 does not equal nodes x gpus-per-node = 1 x 4 = 4 (DP would be 4)"),
        ((1, 1, 1, 6, None, 128, 8, 8), {}, "EP(6) does not divide the number of experts (128)"),
        ((2, 1, 1, 8, None, 64, 1, 8), {},
         "ETP(2) x EP(8) x PP(1) = 16 does not divide nodes x gpus-per-node = 1 x 8 = 8 (EP must divide DP x CP = 4)"),
        ((1, 1, 1, 2, None, 0, 1, 8), {}, "EP(2) > 1 needs a mixture-of-experts model, but model.num_experts is 0"),
        ((0, 1, 1, 1, None, 0, 1, 8), {}, "TP=0 is invalid: it must be an integer >= 1"),
        ((1, 1, 1, 1, None, 0, 2, 3), {"per_node_name": "tasks-per-node", "dp": 4},
         "TP(1) x PP(1) x CP(1) x DP(4) = 4 does not equal nodes x tasks-per-node = 2 x 3 = 6 (DP would be 6)"),
    ],
)
def test_layout_errors(args, kwargs, message) -> None:
    if "dp" in kwargs:
        args = args[:4] + (kwargs.pop("dp"),) + args[5:]
    with pytest.raises(ConfigError) as info:
        check_layout(*args, **kwargs)
    assert str(info.value) == message


# ---------------------------------------------------------------- request
@pytest.mark.parametrize(
    "text, seconds",
    [("90", 5400), ("1:30", 90), ("04:00:00", 14400), ("2-00", 172800), ("1-2:3", 93780), ("1-00:00:10", 86410)],
)
def test_time_limits(text: str, seconds: int) -> None:
    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"time": "4h"}, "time '4h' is not a Slurm time limit"),
        ({"time": "00:05:00", "signal_lead_s": 300}, "signal_lead_s=300 is not shorter than the time limit '00:05:00'"),
        ({"array": "0-3%"}, "array='0-3%' is not a Slurm array spec"),
        ({"gpus_per_node": 8, "tasks_per_node": 4}, "tasks_per_node=4 with gpus_per_node=8"),
        ({"gpus_per_node": 0}, "gpus_per_node=0 (a CPU job) needs tasks_per_node"),
        ({"nodes": 0}, "nodes=0 is invalid"),
        ({"job_name": "my job"}, "job_name='my job' is invalid"),
        ({"env": {"BAD-KEY": "1"}}, "environment variable name 'BAD-KEY' is invalid"),
        ({"container_mounts": ("/a:/a,/b:/b",)}, "container mount '/a:/a,/b:/b' is invalid"),
        ({"partition": "gpu\n#SBATCH --x"}, "partition='gpu\\n#SBATCH --x' is invalid"),
        ({"signal_lead_s": 70000}, "signal_lead_s=70000 is too large"),
    ],
)
def test_request_validation(kwargs, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        SlurmRequest(**kwargs)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value).replace("\\n", "")


# ---------------------------------------------------------------- config
def test_read_parallel_config(tmp_path: Path) -> None:
    cfg = read_parallel_config(CONFIG_15A2B)
    assert (cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.num_experts) == (1, 1, 1, 8, 128)
    empty = tmp_path / "empty.yaml"
    empty.write_text("model: {}\n")
    assert read_parallel_config(empty).num_experts == 0  # absent -> dense
    over = apply_overrides(cfg, ["parallel.tensor_model_parallel_size=2", "optimizer.lr=1e-3"])
    assert (over.tp, over.ep) == (2, 8)
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallel:\n  tensor_model_parallel_size: two\n")
    with pytest.raises(ConfigError, match="parallel.tensor_model_parallel_size='two' must be an integer"):
        read_parallel_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        read_parallel_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="must be an integer"):
        apply_overrides(cfg, ["parallel.context_parallel_size=x"])


# ---------------------------------------------------------------- rendering
def _bash_syntax_ok(script: str, tmp_path: Path) -> None:
    path = tmp_path / "s.sbatch"
    path.write_text(script)
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _dry_run(capsys, argv: list[str]) -> str:
    parser = argparse.ArgumentParser()
    submit_cmd.add_arguments(parser)
    assert submit_cmd.run(parser.parse_intermixed_args(argv)) == 0
    return capsys.readouterr().out


def test_dry_run_15a2b_8x8(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # nothing may be written by a dry run
    script = _dry_run(capsys, [str(CONFIG_15A2B), "--nodes", "8", "--gpus-per-node", "8", "--partition", "gpu",
                               "--account", "proj", "--time", "12:00:00", "--signal-lead", "900",
                               "--container-image", "nvcr.io#nvidia/pytorch:25.01-py3",
                               "--container-mounts", "/lustre:/lustre,/scratch:/scratch",
                               "--env", "NCCL_SOCKET_IFNAME=ib0", "--env", "NCCL_IB_TIMEOUT=", "--dry-run"])
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    sbatch = [line for line in lines if line.startswith("#SBATCH")]
    assert sbatch == [
        "#SBATCH --job-name=15a2b_moe",
        "#SBATCH --nodes=8",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=12:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --output=logs/%x-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --signal=B:USR1@900",
        "#SBATCH --requeue",
    ]
    assert "# layout: TP=1 PP=1 CP=1 DP=64 EP=8 ETP=1 expert-DP=8 experts=128 world=64" in lines
    for knob in ("export CUDA_DEVICE_MAX_CONNECTIONS=1", "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
                 "export NCCL_SOCKET_IFNAME=ib0", "unset NCCL_IB_TIMEOUT", "export PYTHONUNBUFFERED=1"):
        assert knob in lines
    step = [line.strip() for line in lines if line.strip().startswith("srun ")]
    assert step == [
        "srun --kill-on-bad-exit=1 --container-image='nvcr.io#nvidia/pytorch:25.01-py3' "
        "--container-mounts=/lustre:/lustre,/scratch:/scratch --ntasks-per-node=8 python -m megagate train "
        f"--config {CONFIG_15A2B} \"${{SWEEP_ARGS[@]}}\" 2> >(tee -a \"$STEP_ERR\" >&2) &"
    ]
    assert 'kill -s USR1 "$step_pid"' in script and "trap on_warning USR1" in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert "MEGAGATE_MAX_RESTARTS=50" in lines and "MEGAGATE_MAX_SAME_FAILURES=3" in lines
    assert "source " not in script  # container: no venv activation on the host
    _bash_syntax_ok(script, tmp_path)
    assert list(tmp_path.iterdir()) == [tmp_path / "s.sbatch"]  # the dry run wrote nothing


def test_torchrun_variant(tmp_path: Path) -> None:
    req = SlurmRequest(nodes=4, gpus_per_node=8, venv="/opt/venv", cpus_per_task=4, job_name="tr")
    script = render_batch_script(req, ["-m", "megagate", "train", "--config", "c.yaml"], launcher="torchrun")
    assert "#SBATCH --ntasks-per-node=1" in script
    assert "#SBATCH --cpus-per-task=32" in script  # the node's torchrun gets the CPUs of its 8 ranks
    assert "source /opt/venv/bin/activate" in script
    assert ('srun --kill-on-bad-exit=1 --cpus-per-task=32 --ntasks-per-node=1 python -m torch.distributed.run '
            '--nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node=8 --rdzv-backend=c10d '
            '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" --max-restarts=0 '
            '-m megagate train --config c.yaml') in script
    assert 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert 'scancel --signal=TERM "$SLURM_JOB_ID"' in script  # torchrun forwards TERM, not USR1
    assert "SIGNAL_EXIT_OK=1" in script
    _bash_syntax_ok(script, tmp_path)


def test_array_and_sweep(tmp_path: Path) -> None:
    req = SlurmRequest(gpus_per_node=0, tasks_per_node=2, job_name="sw")
    script = render_batch_script(req, ["t.py"], sweep=[["lr=1"], ["lr=2", "name=it's"]])
    assert "#SBATCH --array=0-1" in script and "#SBATCH --output=logs/%x-%A_%a.out" in script
    assert "    1) SWEEP_ARGS=(lr=2 'name=it'\"'\"'s') ;;" in script
    assert "--gpus-per-node" not in script
    _bash_syntax_ok(script, tmp_path)
    # The sweep case statement hands each array task its own overrides.
    for task, expected in (("0", "lr=1"), ("1", "lr=2|name=it's")):
        block = script.split("# ---- sweep")[1].split("# ---- requeue")[0]
        out = subprocess.run(["bash", "-c", "case x in x) ;; esac\n" + "# ----" + block + '\nIFS="|"; echo "${SWEEP_ARGS[*]}"'],
                             env={"SLURM_ARRAY_TASK_ID": task}, capture_output=True, text=True)
        assert out.stdout.strip() == expected
    with pytest.raises(ConfigError, match="sweep is empty"):
        render_batch_script(req, ["t.py"], sweep=[])
    with pytest.raises(ConfigError, match="launcher 'mpirun' is not supported"):
        render_batch_script(req, ["t.py"], launcher="mpirun")


def test_write_script_is_atomic(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "job.sbatch"
    write_script("#!/bin/bash\necho one\n", target)
    write_script("#!/bin/bash\necho two\n", target)
    assert target.read_text() == "#!/bin/bash\necho two\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert [p.name for p in target.parent.iterdir()] == ["job.sbatch"]  # no temp files left


def test_examples_are_up_to_date() -> None:
    spec = importlib.util.spec_from_file_location("render_examples", REPO / "slurm" / "examples" / "render_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cwd = os.getcwd()
    os.chdir(REPO)  # the examples name configs relative to the repository root
    try:
        rendered = module.examples()
    finally:
        os.chdir(cwd)
    for name, text in rendered.items():
        assert (REPO / "slurm" / "examples" / name).read_text() == text, f"re-render slurm/examples/{name}"


def test_cli_refuses_bad_layout_in_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    from megagate import cli

    monkeypatch.chdir(tmp_path)
    rc = cli.main(["submit", str(CONFIG_15A2B), "--nodes", "8", "--gpus-per-node", "8",
                   "parallel.expert_model_parallel_size=6"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == "megagate submit: error: EP(6) does not divide the number of experts (128)\n"
    assert list(tmp_path.iterdir()) == []  # refused before anything was written or submitted


@pytest.mark.parametrize(
    "srun_errors, progress, reason, key",
    [
        # A peer's gloo error (exit 1) reported before the culprit's exit 3: the culprit still names the failure.
        (["node2: task 2: Exited with exit code 1", "node1: task 0: Terminated",
          "node1: task 1: Exited with exit code 3", "node2: task 3: Exited with exit code 1"], None,
         "Exited with exit code 3", "Exited with exit code 3"),
        (["node1: tasks 0-1: Terminated", "node2: task 2: Killed", "node2: task 3: Exited with exit code 1"], None,
         "Killed", "Killed"),
        # A slow peer SIGKILLed by Slurm after KillWait is collateral; the culprit's exit code 7 names the failure.
        (["node2: task 3: Exited with exit code 7", "node1: task 1: Terminated", "node1: task 0: Killed"], None,
         "Exited with exit code 7", "Exited with exit code 7"),
        (["node1: task 0: Segmentation fault", "node2: tasks 2-3: Killed", "node1: task 1: Exited with exit code 1"],
         None, "Segmentation fault", "Segmentation fault"),
        # With a progress file the key is the checkpoint, whatever srun reported first.
        (["node1: task 0: Exited with exit code 1", "node2: tasks 2-3: Terminated"], '{"step": 7}\n',
         "Exited with exit code 1", 'no progress past checkpoint {"step": 7}'),
        (["node1: task 0: Aborted"], "missing", "Aborted", "no checkpoint written yet"),
        ([], None, "step exit code 143", "step exit code 143"),
    ],
)
def test_failure_reason_and_key(tmp_path: Path, srun_errors, progress, reason, key) -> None:
    script = render_batch_script(SlurmRequest(gpus_per_node=0, tasks_per_node=2), ["t.py"])
    functions = script[script.index("failure_reason() {"):]
    functions = functions[: functions.index("\nif (( signalled ))")]
    err = tmp_path / "step.err"
    err.write_text("".join(f"srun: error: {line}\n" for line in srun_errors) + "other noise\n")
    progress_file = ""
    if progress is not None:
        progress_file = str(tmp_path / "progress")
        if progress != "missing":
            (tmp_path / "progress").write_text(progress)
    out = subprocess.run(["bash", "-c", functions + '\nwhy=$(failure_reason 143); echo "$why"; failure_key "$why"'],
                         capture_output=True, text=True,
                         env={"STEP_ERR": str(err), "PROGRESS_FILE": progress_file, "PATH": os.environ["PATH"]})
    assert out.stdout == f"{reason}\n{key}\n", out.stderr
