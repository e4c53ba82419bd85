"""megagate.distributed.utils: the runtime helpers that work without a process group, on real sockets, processes
and (in a forked child) a real one-process gloo world."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import forked
from megagate.distributed import utils

ROOT = Path(__file__).resolve().parents[1]


def test_host_name_prefers_the_scheduler_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-node-017")
    assert utils.host_name() == "gpu-node-017"
    monkeypatch.delenv("SLURMD_NODENAME")
    assert utils.host_name() == socket.gethostname()


@pytest.mark.parametrize(
    ("env", "rank", "world"),
    [
        ({}, 0, 1),
        ({"RANK": "3", "WORLD_SIZE": "8"}, 3, 8),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "6"}, 5, 6),
        ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "7", "SLURM_NTASKS": "16"}, 1, 2),  # torchrun wins
    ],
)
def test_launcher_rank_and_world(env: dict[str, str], rank: int, world: int) -> None:
    assert (utils.launcher_rank(env), utils.launcher_world_size(env)) == (rank, world)
    assert utils.is_launched(env) == bool(env)


def test_free_port_can_be_bound() -> None:
    port = utils.free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # raises if the port was not free


def test_single_process_port(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "SLURM_PROCID", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    utils.single_process_port()
    port = int(os.environ["MASTER_PORT"])
    assert port > 0
    monkeypatch.setenv("MASTER_PORT", "29123")  # a launcher's (or the user's) choice stays
    utils.single_process_port()
    assert os.environ["MASTER_PORT"] == "29123"


def test_rank_helpers_without_a_process_group() -> None:
    # in a fresh interpreter: an earlier test of this pytest worker may have left a process group up
    code = """
from megagate.distributed import utils
calls = []
state = (utils.is_distributed(), utils.get_rank(), utils.get_world_size(), utils.is_global_rank0())
assert state == (False, 0, 1, True), state
assert utils.gather_objects({"a": 1}) == [{"a": 1}]
assert utils.broadcast_object([2, 3]) == [2, 3]
assert utils.rank0_first(lambda: calls.append(1) or len(calls)) == 1
assert calls == [1], calls  # once, not once per "rank"
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr


def test_children_module_imports_no_torch() -> None:
    """The trainer's spawned children import megagate.distributed.children (and through it utils) to run their
    initializer: torch must not come with it."""
    code = "import sys, megagate.distributed.children; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


_PARENT = """
import functools, signal, subprocess, sys, time
from megagate.distributed.utils import die_with_parent
import os
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         preexec_fn=functools.partial(die_with_parent, os.getpid(), signal.SIGTERM))
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie waiting for its new parent's wait() is dead


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_die_with_parent_ends_the_child_when_the_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)  # no handler of the parent runs: only the kernel can end the child
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        parent.kill()
        parent.wait()


def _in_process_group(out: str) -> None:
    """A forked child with no launcher variables: the command's world of one process, then its teardown."""
    import torch.distributed as dist

    from megagate.distributed.parallel import process_group

    with process_group() as env:
        inside = {"rank": env.rank, "world": env.world_size, "source": env.source, "up": dist.is_initialized()}
        inside["port"] = int(os.environ["MASTER_PORT"])
    inside["up_after"] = dist.is_initialized()
    Path(out).write_text(json.dumps(inside))


def test_process_group_starts_one_process_and_tears_down(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in forked.DIST_VARS and not k.startswith("SLURM_")}
    out = tmp_path / "pg.json"
    proc = forked.run(_in_process_group, str(out), envs=[env], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert (got["rank"], got["world"], got["source"], got["up"], got["up_after"]) == (0, 1, "single", True, False)
    assert got["port"] != 29500  # a free port, not the fixed default another job on the host may hold
