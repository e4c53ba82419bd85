"""Fixtures of the evaluation tests: the session's demo corpus (the same folder the trainer tests use)."""

from __future__ import annotations

from pathlib import Path

import pytest

DEMO_VOCAB, DEMO_BYTES = 2048, 1_500_000  # examples/tiny_cpu.yaml's demo data (DataSection defaults)


@pytest.fixture(scope="session")
def eval_demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A demo corpus + tokenizer built once per session (before any trainer process can race to build it)."""
    from megagate.data.demo import prepare_demo_data

    root = tmp_path_factory.getbasetemp() / "megagate-demo-data"
    prepare_demo_data(root, DEMO_VOCAB, DEMO_BYTES)
    return root
