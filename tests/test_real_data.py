"""docs/real-data-on-cpu.md's command block, extracted from the page and run as written (bash,
stopping at the first failure) on MELD's public files, in a folder that holds the repository's
code but none of its data or runs: the page and the test cannot drift apart. Slow (about three
minutes on 2 cores)."""

import json
import os
import re
import subprocess

import pytest
from helpers import REPO

DATA = os.environ.get("CLUE_DATA_DIR", str(REPO.parent / "shared" / "data"))


@pytest.mark.slow
def test_the_pages_commands_run_and_grpo_changes_what_compare_shows(tmp_path):
    meld = os.path.join(DATA, "meld")
    if not os.path.isfile(os.path.join(meld, "train_sent_emo.csv")):
        pytest.skip(f"MELD not found at {meld} (set CLUE_DATA_DIR to the shared/data folder)")
    page = (REPO / "docs" / "real-data-on-cpu.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```bash\n(.*?)```", page, re.DOTALL)
    for entry in REPO.iterdir():  # the code, not the data, runs or checkpoints of this checkout
        if entry.name not in ("data", "runs", "checkpoints") and not entry.name.startswith("."):
            (tmp_path / entry.name).symlink_to(entry)
    (tmp_path / "page.sh").write_text("set -euo pipefail\n" + block)
    env = {**os.environ, "CLUE_DATA_DIR": DATA}
    run = subprocess.run(
        ["bash", "page.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800
    )
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    assert "200 kept" in run.stdout  # the stand-in's refinements all verify
    sft, grpo = (
        json.loads((tmp_path / "runs" / "meld" / f"eval_{n}" / "eval.json").read_text())
        for n in ("sft", "grpo")
    )
    before, after = (e["sets"]["meld_emotion"] for e in (sft, grpo))
    # GRPO moved the model: the held-out answers differ in what compare prints
    assert (before["weighted_f1"]["mean"], before["invalid"]["mean"]) != (
        after["weighted_f1"]["mean"],
        after["invalid"]["mean"],
    )
    assert (tmp_path / "runs" / "meld" / "compare" / "table.md").is_file()
