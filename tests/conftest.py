"""Shared test fixtures. Tests that read the public datasets find them through CLUE_DATA_DIR
(default ../shared/data beside the checkout) and skip with a reason where they are absent."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the oracles (transformers, peft) never reach a hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def shared_data() -> Path:
    root = Path(os.environ.get("CLUE_DATA_DIR", REPO.parent / "shared" / "data"))
    if not root.is_dir():
        pytest.skip(f"public datasets not found at {root} (set CLUE_DATA_DIR to the shared/data folder)")
    return root
