"""A checkpoint write or read that fails on one rank only (torchrun, 2 ranks over gloo): every rank exits within
seconds, one line names the rank, its host and the error, and the newest verified checkpoint is unchanged.

Injected with the cluster faults `fail_save` / `fail_load` (OSError EIO on that rank: what a failing disk or a lost
mount gives). Three launches: a synchronous save that fails on rank 1, a rerun whose resume fails to read on rank 1
(the checkpoint is not moved aside as damaged: the disk failed, not the checkpoint), and a background save that
fails on rank 1 in its writer process.
"""

from __future__ import annotations

import pytest

from helpers import fault_runs as F
from megagate import checkpoint as ckpt
from megagate.health import watchdog

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
# From the failure to the last rank's exit: the others leave at their next heartbeat (1 s); a rank's exit takes a few
# seconds more (megatron's parallel state, the writer's Manager); 16.5 s was measured at a load average of 44 on the
# shared 2-core machine. The bound tells a prompt exit from the alternative, the others hanging until the collective
# timeout (30 minutes); the figure itself is printed.
SECONDS = 45.0


def error_lines(log: str) -> list[str]:
    return [
        line[line.index("megagate train: error:") :] for line in log.splitlines() if "megagate train: error:" in line
    ]


def check_exit(launch: F.Launch, out, expected: str) -> None:
    assert launch.rc != 0, launch.log[-3000:]
    lines = error_lines(launch.log)
    assert lines and all(line == lines[0] for line in lines), lines  # the same line from every rank that printed it
    assert expected in lines[0], lines[0]
    assert launch.log.count("Traceback (most recent call last)") == 1  # torchrun's own summary only
    fault = F.events(out, "fault")[-1]
    elapsed = launch.workers_ended - fault["time"]
    print(f"{fault['fault']['kind']} on rank {fault['rank']}: every rank ended {elapsed:.1f} s after the failure")
    assert elapsed < SECONDS, elapsed
    assert F.live_processes(str(out)) == {}


def test_failed_save_and_load_on_one_rank(tmp_path, session_demo_dir):
    out = tmp_path / "run"
    host = watchdog.host_name()
    base = ["checkpoint.interval=2", "checkpoint.keep_last=3", *F.WATCHDOG]
    root = out / "checkpoints"

    save = F.torchrun(out, session_demo_dir, 2, *base, "monitor.faults=[{step: 4, kind: fail_save, rank: 1}]")
    check_exit(
        save,
        out,
        f"cannot write checkpoint {root}/.iter_0000004.tmp: rank 1 ({host}): Input/output error (injected fail_save "
        f"on rank 1) (EIO); the last good checkpoint {root}/iter_0000002 is unchanged",
    )
    assert [p.name for p in root.iterdir()] == ["iter_0000002"]  # nothing half-written left
    before = (root / "iter_0000002" / ckpt.MANIFEST).read_bytes()

    load = F.torchrun(out, session_demo_dir, 2, *base, "monitor.faults=[{step: 0, kind: fail_load, rank: 1}]")
    check_exit(
        load,
        out,
        f"rank 1 ({host}) cannot read checkpoint {root}/iter_0000002: Input/output error (injected fail_load on rank "
        f"1) (EIO): '{root}/iter_0000002'",
    )
    assert [p.name for p in root.iterdir()] == ["iter_0000002"]  # not moved to damaged/
    assert (root / "iter_0000002" / ckpt.MANIFEST).read_bytes() == before
    assert ckpt.verify(root / "iter_0000002", collective=False) is None

    background = F.torchrun(
        tmp_path / "async",
        session_demo_dir,
        2,
        *base,
        "checkpoint.async_save=true",
        "checkpoint.async_check_interval=1",
        "monitor.faults=[{step: 4, kind: fail_save, rank: 1}]",
    )
    aroot = tmp_path / "async" / "checkpoints"
    check_exit(
        background,
        tmp_path / "async",
        f"cannot write checkpoint {aroot}/.iter_0000004.tmp: rank 1 ({host}): Input/output error (injected fail_save "
        f"on rank 1) (EIO)",
    )
    assert [p.name for p in aroot.iterdir()] == ["iter_0000002"]
    assert ckpt.verify(aroot / "iter_0000002", collective=False) is None
