"""Shared fixtures: a one-process megatron world for CPU unit tests."""

import os
import warnings

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")


@pytest.fixture(scope="session")
def megatron_world():
    """megatron's parallel state for a world of one process (gloo), shared by the unit tests of a session."""
    from megagate.distributed import parallel

    with parallel.single_process():
        yield
