"""Shared test fixtures (the plain helpers are in helpers.py). Tests that read the public datasets
find them through CLUE_DATA_DIR (default ../shared/data beside the checkout) and skip with a reason
where they are absent.

Two tiers: `python -m pytest -q` runs the fast one; tests marked `slow` (the demo, the vLLM server,
torchrun and gloo ranks, SIGKILL-and-resume runs, the bench scripts, the heaviest whole runs) skip
unless `--runslow` is given."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the oracles (transformers, peft) never reach a hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]
# bench/instruments.py: the test- and bench-only instruments (helpers.py imports them too)
sys.path.insert(0, str(REPO / "bench"))
from helpers import grpo_checkpoint, write_examples  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--runslow", action="store_true", default=False, help="also run the tests marked slow"
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    root = Path(os.environ.get("CLUE_DATA_DIR", REPO.parent / "shared" / "data"))
    if not root.is_dir():
        pytest.skip(
            f"public datasets not found at {root} (set CLUE_DATA_DIR to the shared/data folder)"
        )
    return root


@pytest.fixture
def umask_022():
    """Run the test under umask 022 and return a check that every file under a folder is 0644 and
    every folder 0755: what any file written under that umask gets (safetensors' save_file makes
    0600)."""
    old = os.umask(0o022)

    def check(root: Path) -> None:
        modes = {
            str(p.relative_to(root)): oct(p.stat().st_mode & 0o777)
            for p in [root, *root.rglob("*")]
        }
        wrong = {
            name: mode
            for name, mode in modes.items()
            if mode != oct(0o755 if (root / name).is_dir() else 0o644)
        }
        assert len(modes) > 1 and not wrong, wrong

    yield check
    os.umask(old)


@pytest.fixture()
def judge():
    """The local rules judge (judge_server.JudgeServer with its rules backend) over real HTTP on
    127.0.0.1, an ephemeral port; yields the running server (its .url is the OpenAI-style base
    URL)."""
    from judge_server import JudgeServer, rules_backend

    with JudgeServer(rules_backend).start() as server:
        yield server


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """test_grpo's tiny checkpoint (helpers.grpo_checkpoint) and four training examples: (base,
    train.jsonl)."""
    root = tmp_path_factory.mktemp("grpo")
    return grpo_checkpoint(root / "base"), write_examples(root / "train.jsonl")
