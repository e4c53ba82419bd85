"""Helpers for the Slurm tests: the local cluster module and a harness that submits jobs and follows them.

(A uniquely named module rather than conftest.py: several conftest.py files share the module name "conftest".)
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from megagate.slurm import SlurmRequest, render_batch_script, submit

REPO = Path(__file__).resolve().parents[2]
STAND_IN = Path(__file__).resolve().parent / "stand_in.py"
PYTHON = sys.executable


def _load_cluster_module():
    spec = importlib.util.spec_from_file_location("megagate_local_cluster", REPO / "slurm" / "local" / "cluster.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


cluster_mod = _load_cluster_module()


class SlurmHarness:
    """Submit rendered jobs to the local cluster and follow them to the end (releasing requeued ones)."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.env = cluster.env
        # The jobs run the working tree's megagate, whatever the shared venv's editable install points at.
        self.env["PYTHONPATH"] = str(REPO) + os.pathsep + self.env.get("PYTHONPATH", "")

    def request(self, job_name: str, **kw) -> SlurmRequest:
        """A 2-node x 2-task CPU job on the local cluster (node names do not resolve: rendezvous on 127.0.0.1)."""
        base = dict(
            nodes=2,
            gpus_per_node=0,
            tasks_per_node=2,
            time="10:00",
            signal_lead_s=60,
            job_name=job_name,
            master_addr="127.0.0.1",
            python=PYTHON,
            env={"GLOO_SOCKET_IFNAME": "lo"},
        )
        base.update(kw)
        return SlurmRequest(**base)

    def submit(
        self,
        request: SlurmRequest,
        workdir: Path,
        args: Sequence[str],
        launcher: str = "srun",
        program: Sequence[str] = (str(STAND_IN),),
    ) -> int:
        """Render and submit `python PROGRAM --config none.yaml ARGS` (the stand-in trainer by default)."""
        script = render_batch_script(request, [*program, "--config", "none.yaml", *args], launcher=launcher)
        return submit(request, script, cwd=workdir, env=self.env, script_path=workdir / f"{request.job_name}.sbatch")

    def show(self, job_id: int) -> dict[str, str]:
        out = self.cluster.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out.stdout))

    def job_ids(self) -> set[str]:
        """Every job the controller remembers (finished ones stay for MinJobAge = 10 min)."""
        out = self.cluster.run("scontrol", "show", "job", "-o", check=False)
        return set(re.findall(r"^JobId=(\d+)", out.stdout, flags=re.M))

    def wait(
        self,
        job_id: int,
        timeout: float = 120,
        release: bool = True,
        until: Sequence[str] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"),
    ) -> dict[str, str]:
        """Poll until the job reaches one of `until`; a requeued job held by its BeginTime is started now."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        released: set[str] = set()
        while time.monotonic() < deadline:
            info = self.show(job_id)
            state = info.get("JobState", "")
            if state in until:
                return info
            restarts = info.get("Restarts", "")
            if release and state == "PENDING" and info.get("Reason") == "BeginTime" and restarts not in released:
                # A requeued job waits ~2 min before it may start again; the tests wait 3 s. Not 0: a job restarted
                # within the second of its requeue is refused by slurmd ("Job credential revoked") and FAILS.
                self.cluster.run("scontrol", "update", f"jobid={job_id}", "starttime=now+3", check=False)
                released.add(restarts)
            time.sleep(0.25)
        raise AssertionError(f"job {job_id} did not reach {until} in {timeout} s; last: {info}")

    def log(self, workdir: Path, request: SlurmRequest, job_id: int) -> str:
        path = workdir / request.log_dir / f"{request.job_name}-{job_id}.out"
        return path.read_text() if path.exists() else ""
