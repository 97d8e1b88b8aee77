"""docs/real-data-on-cpu.md's command blocks (MELD, then CPED), extracted from the page and run as
written (bash, stopping at the first failure) on the datasets' public files, each in a folder that
holds the repository's code but none of its data or runs: the page and the test cannot drift
apart. Slow (about four minutes a block on 2 cores)."""

import collections
import json
import os
import re
import socket
import subprocess

import pytest
from helpers import REPO

DATA = os.environ.get("CLUE_DATA_DIR", str(REPO.parent / "shared" / "data"))
# block on the page -> (dataset, the public file it reads, the held-out examples per label)
BLOCKS = {"meld": ("meld/train_sent_emo.csv", 15), "cped": ("cped/valid_split.csv", 8)}


def page_blocks() -> dict[str, str]:
    page = (REPO / "docs" / "real-data-on-cpu.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", page, re.DOTALL)
    assert len(blocks) == len(BLOCKS), f"the page has {len(blocks)} bash blocks"
    return dict(zip(BLOCKS, blocks))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def majority_weighted_f1(labels: list[str]) -> float:
    """Always answering the most frequent gold label, by hand: its precision is its share s, its
    recall 1, every other label's F1 is 0, so the support-weighted F1 is s * 2s / (1 + s)."""
    share = collections.Counter(labels).most_common(1)[0][1] / len(labels)
    return share * 2 * share / (1 + share)


@pytest.mark.slow
@pytest.mark.parametrize("dataset", BLOCKS)
def test_the_pages_block_runs_and_grounding_fires_during_grpo(tmp_path, dataset):
    source, per_label = BLOCKS[dataset]
    if not os.path.isfile(os.path.join(DATA, source)):
        pytest.skip(f"{source} not found in {DATA} (set CLUE_DATA_DIR to the shared/data folder)")
    block = page_blocks()[dataset]
    for entry in REPO.iterdir():  # the code, not the data, runs or checkpoints of this checkout
        if entry.name not in ("data", "runs", "checkpoints") and not entry.name.startswith("."):
            (tmp_path / entry.name).symlink_to(entry)
    (tmp_path / "page.sh").write_text("set -euo pipefail\n" + block)
    env = {**os.environ, "CLUE_DATA_DIR": DATA, "PORT": str(free_port())}
    run = subprocess.run(
        ["bash", "page.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800
    )
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    assert "200 kept" in run.stdout  # the stand-in's refinements all verify
    runs = tmp_path / "runs" / dataset

    # GRPO's rollouts quote, and the IU_G judge credits some of them at some update
    updates = [json.loads(line) for line in (runs / "grpo" / "metrics.jsonl").open()]
    assert len(updates) == 8
    assert max(u["completions/quoting"] for u in updates) > 0
    assert max(u["rewards/IU_G/mean"] for u in updates) > 0
    credited = [
        json.loads(line)
        for line in (runs / "grpo" / "completions.jsonl").open()
        if json.loads(line)["IU_G"]
    ]
    assert credited and all("<evidence>" in c["completion"] for c in credited)

    # the held-out set is label-balanced: per_label examples of each label it holds
    held_out_file = tmp_path / "data" / f"{dataset}_eval.jsonl"
    held_out = [json.loads(line)["labels"][0] for line in held_out_file.open()]
    counts = collections.Counter(held_out)
    assert len(counts) > 5 and set(counts.values()) == {per_label}

    sft, grpo = (
        json.loads((runs / f"eval_{n}" / "eval.json").read_text())["sets"][f"{dataset}_emotion"]
        for n in ("sft", "grpo")
    )
    # GRPO moved the model: the held-out answers differ in what compare prints
    assert (sft["weighted_f1"]["mean"], sft["invalid"]["mean"]) != (
        grpo["weighted_f1"]["mean"],
        grpo["invalid"]["mean"],
    )
    # compare's table: the grounding tables, and the baseline rows computed on this held-out set
    table = (runs / "compare" / "table.md").read_text(encoding="utf-8")
    assert "### Completions that quote their evidence (%)" in table
    assert "### Quotations the verifier finds in the conversation (%)" in table
    majority = re.search(r"\| \*majority label \(baseline\)\* \| ([\d.]+) \|", table)
    assert majority and float(majority.group(1)) == round(100 * majority_weighted_f1(held_out), 2)
    assert "| *uniform random (baseline)* |" in table
