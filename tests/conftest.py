"""Shared test fixtures. Tests that read the public datasets find them through CLUE_DATA_DIR
(default ../shared/data beside the checkout) and skip with a reason where they are absent."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the oracles (transformers, peft) never reach a hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # bench/instruments.py: the test- and bench-only instruments


@pytest.fixture(scope="session")
def shared_data() -> Path:
    root = Path(os.environ.get("CLUE_DATA_DIR", REPO.parent / "shared" / "data"))
    if not root.is_dir():
        pytest.skip(f"public datasets not found at {root} (set CLUE_DATA_DIR to the shared/data folder)")
    return root


@pytest.fixture
def umask_022():
    """Run the test under umask 022 and return a check that every file under a folder is 0644 and every
    folder 0755: what any file written under that umask gets (safetensors' save_file makes 0600)."""
    old = os.umask(0o022)

    def check(root: Path) -> None:
        modes = {str(p.relative_to(root)): oct(p.stat().st_mode & 0o777) for p in [root, *root.rglob("*")]}
        wrong = {name: mode for name, mode in modes.items()
                 if mode != oct(0o755 if (root / name).is_dir() else 0o644)}
        assert len(modes) > 1 and not wrong, wrong

    yield check
    os.umask(old)
