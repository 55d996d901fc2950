"""Fixtures shared by every test folder."""

from __future__ import annotations

from pathlib import Path

import pytest

# The dev cluster, up once per session for every test that asks for it (dev cluster, operator,
# helm tests); see kubeinfer.devcluster.testing.
from kubeinfer.devcluster.testing import dev_cluster  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_DIR = REPO / ".cache" / "models" / "smollm2-135m"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct in HF format, made by `make model` (the Makefile runs it first)."""
    if not (SMOLLM2_DIR / "model.safetensors").exists():
        pytest.fail(f"{SMOLLM2_DIR} is missing: run `make model`", pytrace=False)
    return SMOLLM2_DIR
