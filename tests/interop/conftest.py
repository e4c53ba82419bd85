"""Shared fixtures of the Hugging Face interop tests."""

from __future__ import annotations

from pathlib import Path

import pytest

DEMO_VOCAB, DEMO_BYTES = 2048, 1_500_000  # examples/tiny_cpu.yaml's demo data (as tests/train/conftest.py)


@pytest.fixture(scope="session")
def session_demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo corpus + tokenizer, in the same session folder the trainer tests use (built once)."""
    from megagate.data.demo import prepare_demo_data

    root = tmp_path_factory.getbasetemp() / "megagate-demo-data"
    prepare_demo_data(root, DEMO_VOCAB, DEMO_BYTES)
    return root
