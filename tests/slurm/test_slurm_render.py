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
from megagate.distributed.layout import layout
from megagate.errors import ConfigError
from megagate.model.kernels import transformer_engine_available
from megagate.model.model_config import ParallelConfig
from megagate.slurm import (
    SlurmRequest,
    check_job,
    parse_time_limit,
    render_batch_script,
    write_script,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG_15A2B = REPO / "slurm" / "examples" / "configs" / "15a2b_moe.yaml"


def sizes(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, vpp: int | None = None) -> ParallelConfig:
    return ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        virtual_pipeline_model_parallel_size=vpp,
    )


# ---------------------------------------------------------------- layout (megagate.distributed.layout)
def test_layout_15a2b_on_8x8() -> None:
    lay = layout(sizes(ep=8), 64, micro_batch_size=2, global_batch_size=1024, num_experts=128)
    assert (lay.dp, lay.expert_dp, lay.world_size, lay.num_microbatches) == (64, 8, 64, 8)
    assert lay.describe() == "TP=1 PP=1 CP=1 DP=64 EP=8 ETP=1 expert-DP=8 experts=128 world=64"
    assert lay.describe_batch() == "global 1024 = micro 2 x DP 64 x 8 micro-batches"


def test_layout_resolves_dp() -> None:
    assert layout(sizes(2, 2, 2), 32, micro_batch_size=1, global_batch_size=4).dp == 4
    # EP divides DP x CP (not only DP): megatron's expert grid is ETP x EP x PP.
    lay = layout(sizes(tp=2, cp=2, ep=4), 8, micro_batch_size=1, global_batch_size=2, num_experts=8)
    assert (lay.dp, lay.expert_dp) == (2, 1)
    # The interleaved schedule takes micro-batches in groups of PP: 4 per step on PP=2 fits.
    assert (
        layout(sizes(pp=2, vpp=2), 2, micro_batch_size=1, global_batch_size=4).describe()
        == "TP=1 PP=2 CP=1 DP=1 VPP=2 world=2"
    )


@pytest.mark.parametrize(
    "parallel, world, batch, experts, message",
    [
        (sizes(2, 4), 12, (1, 12), 0, "world size 12 is not divisible by TP (2) x PP (4) x CP (1) = 8"),
        (
            sizes(),
            4,
            (4, 8),
            0,
            "train.global_batch_size (8) must be divisible by micro_batch_size (4) x data-parallel size (4) = 16",
        ),
        (sizes(ep=6), 64, (1, 64), 128, "parallel.expert_model_parallel_size (6) must divide model.num_experts (128)"),
        (
            sizes(tp=2, ep=8),
            8,
            (1, 4),
            64,
            "parallel.expert_model_parallel_size (8) must divide DP (4) x CP (1) = 4: megatron's expert grid "
            "ETP (2) x EP (8) x PP (1) = 16 must divide world size 8",
        ),
        (
            sizes(ep=2),
            8,
            (1, 8),
            0,
            "parallel.expert_model_parallel_size (2) needs an MoE model (model.num_experts > 0)",
        ),
        (sizes(tp=0), 8, (1, 8), 0, "parallel.tensor_model_parallel_size=0 must be >= 1"),
        (sizes(), 0, (1, 8), 0, "world size 0 must be a positive integer"),
        (
            sizes(pp=2, vpp=2),
            2,
            (1, 3),
            0,
            "train.global_batch_size (3) gives 3 micro-batches per step; the interleaved pipeline schedule "
            "(virtual_pipeline_model_parallel_size=2) needs a multiple of pipeline_model_parallel_size (2)",
        ),
    ],
)
def test_layout_errors(parallel, world, batch, experts, message) -> None:
    with pytest.raises(ConfigError) as info:
        layout(parallel, world, micro_batch_size=batch[0], global_batch_size=batch[1], num_experts=experts)
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
        ({"exclude_after_hangs": -1}, "exclude_after_hangs=-1 is invalid"),
    ],
)
def test_request_validation(kwargs, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        SlurmRequest(**kwargs)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value).replace("\\n", "")


# ---------------------------------------------------------------- config (the trainer's reader)
def test_check_job_reads_the_config_as_the_trainer(tmp_path: Path) -> None:
    cfg, lay = check_job(SlurmRequest(nodes=8, gpus_per_node=8), str(CONFIG_15A2B), [])
    p = cfg.parallel
    assert (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.context_parallel_size,
        p.expert_model_parallel_size,
        cfg.model.num_experts,
    ) == (1, 1, 1, 8, 128)
    assert (lay.dp, lay.num_microbatches, cfg.train.precision) == (64, 8, "bf16")
    cfg, lay = check_job(
        SlurmRequest(nodes=8, gpus_per_node=8), str(CONFIG_15A2B), ["parallel.tensor_model_parallel_size=2"]
    )
    assert (cfg.parallel.tensor_model_parallel_size, lay.dp, lay.ep) == (2, 32, 8)
    request = SlurmRequest(nodes=8, gpus_per_node=8)
    # A key the trainer does not know is refused, not ignored.
    with pytest.raises(ConfigError, match=r"^optimizer is not a config section; sections: model, parallel"):
        check_job(request, str(CONFIG_15A2B), ["optimizer.lr=1e-3"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {preset: tiny}\nparallel:\n  tensor_model_parallel_size: two\n")
    with pytest.raises(ConfigError, match="^parallel.tensor_model_parallel_size='two' must be an integer$"):
        check_job(request, str(bad), [])
    with pytest.raises(ConfigError, match=r"^config file '.*missing.yaml' does not exist$"):
        check_job(request, str(tmp_path / "missing.yaml"), [])
    with pytest.raises(ConfigError, match="^parallel.context_parallel_size='x' must be an integer$"):
        check_job(request, str(CONFIG_15A2B), ["parallel.context_parallel_size=x"])


@pytest.mark.skipif(transformer_engine_available(), reason="Transformer Engine is installed here")
def test_container_jobs_leave_machine_checks_to_the_ranks(tmp_path: Path, monkeypatch, capsys) -> None:
    """fp8 and a blend need TE and files on the machine that runs the job: with an image, that is not this one."""
    from megagate import cli

    monkeypatch.chdir(tmp_path)
    machine = [
        "train.precision=fp8",
        "data.mock=false",
        "data.blend=[/lustre/data/web_text_document]",
        "data.tokenizer=/lustre/tokenizers/qwen3/tokenizer.json",
    ]
    argv = ["submit", str(CONFIG_15A2B), *machine, "--nodes", "8", "--gpus-per-node", "8", "--dry-run"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        "megagate submit: error: train.precision='fp8' needs Transformer Engine, which "
        "is not installed; use bf16 or fp32\n"
    )
    assert cli.main([*argv, "train.precision=bf16"]) == 2
    assert capsys.readouterr().err == (
        "megagate submit: error: data.blend: missing data file "
        "'/lustre/data/web_text_document.bin' (preprocess with `megagate preprocess`)\n"
    )
    assert cli.main([*argv, "--container-image", "nvcr.io#nvidia/pytorch:25.01-py3"]) == 0
    assert "train.precision=fp8" in capsys.readouterr().out
    # what is no property of the machine is still refused with an image
    assert cli.main([*argv, "--container-image", "img", "train.precison=bf16"]) == 2
    assert capsys.readouterr().err.startswith("megagate submit: error: train.precison is not a known key; allowed:")
    assert list(tmp_path.iterdir()) == []


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
    script = _dry_run(
        capsys,
        [
            str(CONFIG_15A2B),
            "--nodes",
            "8",
            "--gpus-per-node",
            "8",
            "--partition",
            "gpu",
            "--account",
            "proj",
            "--time",
            "12:00:00",
            "--signal-lead",
            "900",
            "--container-image",
            "nvcr.io#nvidia/pytorch:25.01-py3",
            "--container-mounts",
            "/lustre:/lustre,/scratch:/scratch",
            "--env",
            "NCCL_SOCKET_IFNAME=ib0",
            "--env",
            "NCCL_IB_TIMEOUT=",
            "--dry-run",
        ],
    )
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
    for knob in (
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        "export NCCL_SOCKET_IFNAME=ib0",
        "unset NCCL_IB_TIMEOUT",
        "export PYTHONUNBUFFERED=1",
    ):
        assert knob in lines
    step = [line.strip() for line in lines if line.strip().startswith("srun ")]
    assert step == [
        "srun --kill-on-bad-exit=1 --container-image='nvcr.io#nvidia/pytorch:25.01-py3' "
        "--container-mounts=/lustre:/lustre,/scratch:/scratch --ntasks-per-node=8 python -m megagate train "
        f'--config {CONFIG_15A2B} "${{SWEEP_ARGS[@]}}" 2> >(tee -a "$STEP_ERR" >&2) &'
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
    assert (
        "srun --kill-on-bad-exit=1 --cpus-per-task=32 --ntasks-per-node=1 python -m torch.distributed.run "
        '--nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node=8 --rdzv-backend=c10d '
        '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" --max-restarts=0 '
        "-m megagate train --config c.yaml"
    ) in script
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
        out = subprocess.run(
            ["bash", "-c", "case x in x) ;; esac\n" + "# ----" + block + '\nIFS="|"; echo "${SWEEP_ARGS[*]}"'],
            env={"SLURM_ARRAY_TASK_ID": task},
            capture_output=True,
            text=True,
        )
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
    rc = cli.main(
        ["submit", str(CONFIG_15A2B), "--nodes", "8", "--gpus-per-node", "8", "parallel.expert_model_parallel_size=6"]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert (
        err == "megagate submit: error: parallel.expert_model_parallel_size (6) must divide model.num_experts (128)\n"
    )
    assert list(tmp_path.iterdir()) == []  # refused before anything was written or submitted


@pytest.mark.parametrize(
    "srun_errors, progress, reason, key",
    [
        # A peer's gloo error (exit 1) reported before the culprit's exit 3: the culprit still names the failure.
        (
            [
                "node2: task 2: Exited with exit code 1",
                "node1: task 0: Terminated",
                "node1: task 1: Exited with exit code 3",
                "node2: task 3: Exited with exit code 1",
            ],
            None,
            "Exited with exit code 3",
            "Exited with exit code 3",
        ),
        (
            ["node1: tasks 0-1: Terminated", "node2: task 2: Killed", "node2: task 3: Exited with exit code 1"],
            None,
            "Killed",
            "Killed",
        ),
        # A slow peer SIGKILLed by Slurm after KillWait is collateral; the culprit's exit code 7 names the failure.
        (
            ["node2: task 3: Exited with exit code 7", "node1: task 1: Terminated", "node1: task 0: Killed"],
            None,
            "Exited with exit code 7",
            "Exited with exit code 7",
        ),
        (
            ["node1: task 0: Segmentation fault", "node2: tasks 2-3: Killed", "node1: task 1: Exited with exit code 1"],
            None,
            "Segmentation fault",
            "Segmentation fault",
        ),
        # With a progress file the key is the checkpoint, whatever srun reported first.
        (
            ["node1: task 0: Exited with exit code 1", "node2: tasks 2-3: Terminated"],
            '{"step": 7}\n',
            "Exited with exit code 1",
            'no progress past checkpoint {"step": 7}',
        ),
        (["node1: task 0: Aborted"], "missing", "Aborted", "no checkpoint written yet"),
        ([], None, "step exit code 143", "step exit code 143"),
    ],
)
def test_failure_reason_and_key(tmp_path: Path, srun_errors, progress, reason, key) -> None:
    script = render_batch_script(SlurmRequest(gpus_per_node=0, tasks_per_node=2), ["t.py"])
    functions = script[script.index("failure_reason() {") :]
    functions = functions[: functions.index("\nif (( signalled ))")]
    err = tmp_path / "step.err"
    err.write_text("".join(f"srun: error: {line}\n" for line in srun_errors) + "other noise\n")
    progress_file = ""
    if progress is not None:
        progress_file = str(tmp_path / "progress")
        if progress != "missing":
            (tmp_path / "progress").write_text(progress)
    out = subprocess.run(
        ["bash", "-c", functions + '\nwhy=$(failure_reason 143); echo "$why"; failure_key "$why"'],
        capture_output=True,
        text=True,
        env={"STEP_ERR": str(err), "PROGRESS_FILE": progress_file, "PATH": os.environ["PATH"]},
    )
    assert out.stdout == f"{reason}\n{key}\n", out.stderr


def test_hang_accounting_excludes_a_host_after_repeated_hangs(tmp_path: Path) -> None:
    """The requeue protocol's `exclude_hung_hosts`: a host blamed for exclude_after_hangs hangs (the attempts file's
    fifth column) joins the exclusion list once; other failures and other hosts do not count."""
    script = render_batch_script(SlurmRequest(gpus_per_node=0, tasks_per_node=2, exclude_after_hangs=2), ["t.py"])
    assert "MEGAGATE_EXCLUDE_AFTER_HANGS=2" in script and 'export MEGAGATE_FAILURE_FILE="$STATE_DIR/job-' in script
    functions = script[script.index("exclude_hung_hosts() {") :]
    functions = functions[: functions.index("\nfailure_key() {")]
    attempts, excluded = tmp_path / "attempts", tmp_path / "excluded"
    attempts.write_text(
        "0\t75\thang on node1\thang: rank 0 (node1) did not arrive\tnode1\n"
        "1\t1\tExited with exit code 1\tExited with exit code 1\t\n"
        "2\t75\thang on node1,node3\thang: ranks 0,5 did not arrive\tnode1,node3\n"
    )
    env = {"FAILURES": str(attempts), "EXCLUDED": str(excluded), "PATH": os.environ["PATH"]}

    def run(hosts: str, limit: int) -> str:
        proc = subprocess.run(
            ["bash", "-c", f"{functions}\nMEGAGATE_EXCLUDE_AFTER_HANGS={limit}; exclude_hung_hosts {hosts}"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert run("node1,node3", 0) == "" and not excluded.exists()  # 0: never
    out = run("node1,node3", 2)
    assert out == "megagate-slurm: excluding node1 from this job: 2 hangs there (exclude_after_hangs=2)\n"
    assert excluded.read_text() == "node1\n"  # node3 hung once only
    assert run("node1", 2) == "" and excluded.read_text() == "node1\n"  # listed once
