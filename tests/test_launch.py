"""megagate.distributed.launch: Slurm node lists, torchrun/srun environments, and a real gloo group started from srun variables."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from helpers import forked
from megagate.distributed.launch import (
    DistEnv,
    LaunchError,
    cuda_device_index,
    derive_master_port,
    distributed_timeout_minutes,
    expand_nodelist,
    gpus_per_task,
    parse_tasks_per_node,
    resolve_env,
    set_allocator_defaults,
    visible_devices,
)
from megagate.errors import MegagateError


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[1-3,7],gpu-a[01-02]", ["node1", "node2", "node3", "node7", "gpu-a01", "gpu-a02"]),
        ("gpu[008-011]", ["gpu008", "gpu009", "gpu010", "gpu011"]),
        ("n[9-11]", ["n9", "n10", "n11"]),  # no padding: widths grow
        ("n[09-11]", ["n09", "n10", "n11"]),
        ("a,b,c", ["a", "b", "c"]),
        ("x[1,3,5]", ["x1", "x3", "x5"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("pre[7]post", ["pre7post"]),
        ("login,cn[1-2],gpu-b[10-11,20]", ["login", "cn1", "cn2", "gpu-b10", "gpu-b11", "gpu-b20"]),
        ("node-1.cluster.local", ["node-1.cluster.local"]),
        (" node[1-2] ", ["node1", "node2"]),
        ("c[0001-0003]", ["c0001", "c0002", "c0003"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "nodelist, fragment",
    [
        ("", "empty"),
        ("node[1-3", "unclosed"),
        ("node1-3]", "unmatched ']'"),
        ("node[3-1]", "runs backwards"),
        ("node[a-b]", "is not N or N-M"),
        ("node[]", "is not N or N-M"),
        ("a,,b", "empty host name"),
        ("n[[1]]", "nested"),
        ("node[1-2,]", "is not N or N-M"),
    ],
)
def test_expand_nodelist_rejects(nodelist: str, fragment: str) -> None:
    with pytest.raises(LaunchError, match=fragment.replace("[", r"\[").replace("]", r"\]")) as info:
        expand_nodelist(nodelist)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, MegagateError)


def test_tasks_per_node() -> None:
    assert parse_tasks_per_node("4") == [4]
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("8(x8)") == [8] * 8
    with pytest.raises(LaunchError, match="SLURM_TASKS_PER_NODE"):
        parse_tasks_per_node("2x3")


def _srun_env(**kw: str) -> dict[str, str]:
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_JOB_NODELIST": "gpu[07-10]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x4)",
    }
    env.update(kw)
    return env


def test_srun_environment() -> None:
    env = resolve_env(_srun_env())
    assert env == DistEnv(
        rank=5,
        world_size=8,
        local_rank=1,
        local_world_size=2,
        node_rank=2,
        num_nodes=4,
        master_addr="gpu07",
        master_port=derive_master_port(4242),
        source="srun",
    )
    assert env.master_port == 20000 + (4242 * 4) % 40000
    # Explicit MASTER_ADDR / MASTER_PORT win over the node list and the job id.
    env2 = resolve_env(_srun_env(MASTER_ADDR="10.0.0.1", MASTER_PORT="12345"))
    assert (env2.master_addr, env2.master_port) == ("10.0.0.1", 12345)


def test_srun_port_moves_after_requeue() -> None:
    ports = {resolve_env(_srun_env(SLURM_RESTART_COUNT=str(r))).master_port for r in range(4)}
    assert len(ports) == 4
    assert all(20000 <= p < 60000 for p in ports)
    # Different jobs get different ports (no collision for neighbouring ids).
    assert len({derive_master_port(j) for j in range(1000, 1100)}) == 100


def test_srun_uneven_tasks_per_node() -> None:
    env = resolve_env(
        _srun_env(
            SLURM_PROCID="6",
            SLURM_LOCALID="0",
            SLURM_NODEID="2",
            SLURM_NTASKS="7",
            SLURM_STEP_NUM_TASKS="7",
            SLURM_JOB_NODELIST="n[1-3]",
            SLURM_STEP_TASKS_PER_NODE="3,3,1",
        )
    )
    assert (env.rank, env.local_world_size, env.num_nodes) == (6, 1, 3)


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"SLURM_PROCID": "8"}, "rank 8 is outside 0..7"),
        ({"SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not an integer"),
        ({"SLURM_LOCALID": "2"}, "local rank 2 is outside 0..1"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, "sum to 6, but the step has 8 tasks"),
        ({"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "4,4"}, "SLURM_NODEID=2 is outside 0..1"),
        ({"SLURM_JOB_NODELIST": "gpu[07-09]"}, "has 3 hosts but tasks per node '2(x4)' names 4"),
        ({"SLURM_JOB_NODELIST": "gpu[07-10"}, "unclosed"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    ],
)
def test_srun_environment_errors(change: dict[str, str], fragment: str) -> None:
    with pytest.raises(LaunchError) as info:
        resolve_env(_srun_env(**change))
    assert fragment in str(info.value)


def test_srun_missing_variables() -> None:
    env = _srun_env()
    del env["SLURM_JOB_NODELIST"]
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST is not set"):
        resolve_env(env)
    env = _srun_env()
    del env["SLURM_JOB_ID"]
    with pytest.raises(LaunchError, match="SLURM_JOB_ID is not set"):
        resolve_env(env)


def test_batch_shell_is_not_a_rank() -> None:
    # The batch script has SLURM_PROCID=0 and SLURM_NTASKS=4 but no step: running python there would claim rank 0.
    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]"}
    with pytest.raises(LaunchError, match="not an srun task"):
        resolve_env(env)


def test_torchrun_environment_wins_over_slurm() -> None:
    # torchrun inside an allocation: SLURM_PROCID is the node index, RANK the global rank.
    env = _srun_env(
        RANK="3",
        WORLD_SIZE="8",
        LOCAL_RANK="3",
        LOCAL_WORLD_SIZE="4",
        GROUP_RANK="0",
        MASTER_ADDR="gpu07",
        MASTER_PORT="29400",
        SLURM_PROCID="0",
    )
    assert resolve_env(env) == DistEnv(3, 8, 3, 4, 0, 2, "gpu07", 29400, "torchrun")


@pytest.mark.parametrize(
    "env, fragment",
    [
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "1"}, "MASTER_ADDR is not set"),
        ({"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "WORLD_SIZE is not set"),
        (
            {"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "rank 2 is outside 0..1",
        ),
        (
            {
                "RANK": "0",
                "WORLD_SIZE": "6",
                "LOCAL_WORLD_SIZE": "4",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "h",
                "MASTER_PORT": "1",
            },
            "not a multiple of LOCAL_WORLD_SIZE=4",
        ),
    ],
)
def test_torchrun_environment_errors(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(LaunchError) as info:
        resolve_env(env)
    assert fragment in str(info.value)


def test_single_process() -> None:
    env = resolve_env({})
    assert (env.rank, env.world_size, env.source) == (0, 1, "single")
    with pytest.raises(LaunchError, match="no launcher environment"):
        resolve_env({}, allow_single=False)


def test_bash_port_formula_matches_python() -> None:
    from megagate.slurm.render import bash_master_port_expr

    for job_id, restart in [(1, 0), (4242, 0), (4242, 1), (9999, 3), (123456789, 2), (10000, 5)]:
        out = subprocess.run(
            ["bash", "-c", f"echo {bash_master_port_expr()}"],
            text=True,
            capture_output=True,
            env={"SLURM_JOB_ID": str(job_id), "SLURM_RESTART_COUNT": str(restart)},
            check=True,
        )
        assert int(out.stdout) == derive_master_port(job_id, restart)


def _srun_rank(out_dir: str) -> None:
    """One rank (a process forked by helpers.forked, its environment srun-style): join the group, all-reduce."""
    import torch
    import torch.distributed as dist

    from megagate.distributed.launch import init_process_group

    env = init_process_group()
    t = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(t)
    timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    result = {"rank": env.rank, "node": env.node_rank, "local": env.local_rank, "sum": t.item(),
              "backend": dist.get_backend(), "source": env.source, "timeout": timeout,
              "alloc": os.environ.get("PYTORCH_ALLOC_CONF")}  # fmt: skip
    (Path(out_dir) / f"r{env.rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_gloo_group_from_srun_variables(tmp_path: Path) -> None:
    """Four processes given only srun-style variables (2 'nodes' x 2) form a real gloo group and all-reduce."""
    with socket.socket() as s:  # a free port for MASTER_PORT; the node list's first host is replaced by MASTER_ADDR
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    envs = []
    for rank in range(4):
        drop = (
            "SLURM_",
            "RANK",
            "WORLD_SIZE",
            "LOCAL_",
            "MEGAGATE_DIST_TIMEOUT",
            "PYTORCH_CUDA_ALLOC",
            "PYTORCH_ALLOC",
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        if rank == 3:
            env["PYTORCH_ALLOC_CONF"] = "garbage_collection_threshold:0.6"  # the user's own setting stays
        env.update(
            _srun_env(
                SLURM_PROCID=str(rank),
                SLURM_LOCALID=str(rank % 2),
                SLURM_NODEID=str(rank // 2),
                SLURM_NTASKS="4",
                SLURM_STEP_NUM_TASKS="4",
                SLURM_JOB_NODELIST="node[1-2]",
                SLURM_STEP_TASKS_PER_NODE="2(x2)",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        )
        env["GLOO_SOCKET_IFNAME"] = "lo"
        envs.append(env)
    proc = forked.run(_srun_rank, str(tmp_path), envs=envs, timeout=120)  # four processes at once
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted((json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(4)), key=lambda d: d["rank"])
    assert [(d["rank"], d["node"], d["local"]) for d in results] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert {d["sum"] for d in results} == {10.0}
    assert {d["backend"] for d in results} == {"gloo"}
    assert {d["source"] for d in results} == {"srun"}
    assert {d["timeout"] for d in results} == {30 * 60.0}  # the save-safe default, not torch's 10 minutes
    assert [d["alloc"] for d in results] == ["expandable_segments:True"] * 3 + ["garbage_collection_threshold:0.6"]


# --- cluster defaults: the collectives' timeout, the allocator, the CUDA device under Slurm's GPU bindings ---------
def test_timeout_minutes() -> None:
    assert distributed_timeout_minutes({}) == 30.0
    assert distributed_timeout_minutes({"MEGAGATE_DIST_TIMEOUT_MINUTES": " 90 "}) == 90.0
    assert distributed_timeout_minutes({"MEGAGATE_DIST_TIMEOUT_MINUTES": "0.5"}) == 0.5


@pytest.mark.parametrize("value", ["0", "-5", "ten", "nan", "inf"])
def test_timeout_minutes_refuses(value: str) -> None:
    with pytest.raises(LaunchError) as err:
        distributed_timeout_minutes({"MEGAGATE_DIST_TIMEOUT_MINUTES": value})
    message = str(err.value)
    assert "\n" not in message and f"MEGAGATE_DIST_TIMEOUT_MINUTES={value!r}" in message and "positive" in message


def test_allocator_defaults() -> None:
    env: dict[str, str] = {}
    set_allocator_defaults(env)
    assert env == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):  # torch 2.9 reads either: the user's wins
        env = {name: "expandable_segments:False"}
        set_allocator_defaults(env)
        assert env == {name: "expandable_segments:False"}


@pytest.mark.parametrize(
    "local_rank, tasks, visible, own, device",
    [
        (5, 8, ["5"], None, 0),  # --gpu-bind=single:1 / a per-task CUDA_VISIBLE_DEVICES
        (5, 8, ["GPU-8f1e2a"], 1, 0),  # --gpus-per-task=1: a UUID, the task's own
        (3, 4, ["6", "7"], 2, 0),  # --gpus-per-task=2: both its own, the first
        (5, 8, [str(i) for i in range(8)], None, 5),  # no binding: every task sees the node
        (1, 2, [str(i) for i in range(8)], None, 1),  # fewer tasks than GPUs
        (6, 8, ["4", "5", "6", "7"], None, 2),  # --gpu-bind=closest: the socket's GPUs, shared by its tasks
        (2, 8, ["0", "1", "2", "3"], None, 2),
    ],
)
def test_cuda_device_index(local_rank: int, tasks: int, visible: list[str], own: int | None, device: int) -> None:
    assert cuda_device_index(local_rank, tasks, visible, own) == device


def test_cuda_device_index_shared_sets_are_distinct() -> None:
    """Eight tasks, two sockets of four GPUs (block distribution): each task a different physical GPU."""
    sets = {rank: [str(i) for i in range(4 * (rank // 4), 4 * (rank // 4) + 4)] for rank in range(8)}
    physical = [sets[r][cuda_device_index(r, 8, sets[r])] for r in range(8)]
    assert physical == [str(r) for r in range(8)]


@pytest.mark.parametrize(
    "local_rank, tasks, visible, fragment",
    [
        (0, 8, [], "local rank 0 has no GPU: no CUDA device is visible"),
        (
            1,
            8,
            ["4", "5", "6", "7"],
            "local rank 1 of 8 sees 4 GPUs (CUDA_VISIBLE_DEVICES=4,5,6,7), none of them GPU 1",
        ),
        (2, 4, ["GPU-a", "GPU-b"], "--gpus-per-task=1"),
    ],
)
def test_cuda_device_index_impossible(local_rank: int, tasks: int, visible: list[str], fragment: str) -> None:
    with pytest.raises(LaunchError) as err:
        cuda_device_index(local_rank, tasks, visible)
    assert "\n" not in str(err.value) and fragment in str(err.value), str(err.value)


def test_visible_devices_and_gpus_per_task() -> None:
    assert visible_devices({}, 2) == ["0", "1"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "3, 1"}, 2) == ["3", "1"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "3,1,bad"}, 2) == ["3", "1"]  # CUDA stops at a bad entry
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}, 0) == []
    assert [gpus_per_task({"SLURM_GPUS_PER_TASK": v}) for v in ("1", "h100:2", "gpu:a100:4")] == [1, 2, 4]
    assert gpus_per_task({}) is None
