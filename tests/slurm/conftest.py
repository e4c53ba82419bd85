"""The real local Slurm cluster for the tests in this folder: started once per session, always stopped.

Without the Slurm binaries the tests skip, except in CI (CI=true), where a missing cluster is a failure.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from helpers.slurm_harness import SlurmHarness, cluster_mod


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[object]:
    in_ci = os.environ.get("CI", "").lower() == "true"
    if not cluster_mod.slurm_installed():
        if in_ci:
            pytest.fail("Slurm binaries not found in CI: .ci/run must run slurm/local/install.sh first")
        pytest.skip("Slurm binaries not installed (run slurm/local/install.sh)")
    if os.geteuid() != 0:
        if in_ci:
            pytest.fail("the local Slurm cluster needs root (slurmd runs jobs as root)")
        pytest.skip("the local Slurm cluster needs root")
    # A short path under /tmp: Slurm and munge keep sockets and spool files there.
    state_dir = tempfile.mkdtemp(prefix="mg-slurm-")
    cluster = cluster_mod.LocalCluster(state_dir)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        if os.environ.get("MEGAGATE_KEEP_SLURM_STATE") != "1":
            shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm(slurm_cluster) -> SlurmHarness:
    return SlurmHarness(slurm_cluster)
