"""bench/gpu.sh, the GPU node's measurements: its decode roofline arithmetic against a hand count of the Qwen3-8B
shape, and the whole script run end to end on tiny shapes on the CPU (--tiny), so that it cannot rot unseen."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import gpu  # noqa: E402


def test_decode_bytes_of_qwen3_8b_equal_a_hand_count():
    model = gpu.random_model(gpu.SHAPES["qwen3-8b"], torch.bfloat16, torch.device("meta"))
    d, kv, ffn, vocab, layers = 4096, 8 * 128, 12288, 151936, 36
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d + 2 * 128  # q, o; k, v; MLP; two norms; q/k norms
    weights = 2 * (layers * per_layer + d + vocab * d)  # bf16, the final norm and lm_head; the embedding not read
    kv_bytes = 64 * 640 * layers * 2 * kv * 2  # 64 rows of 640 tokens, K and V, bf16: 144 KiB per token
    assert gpu.step_bytes(model, 64, 640) == (weights, weights + kv_bytes)
    assert abs(64 * 4.8e12 / (weights + kv_bytes) - 14_507) < 1  # the H200 roofline RESULTS.md states


@pytest.mark.slow
def test_gpu_script_runs_tiny_on_the_cpu(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(["bash", str(REPO / "bench" / "gpu.sh"), str(tmp_path), "--tiny"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    text = (tmp_path / "gpu_results.md").read_text()
    sections = text.split("\n## ")[1:]
    assert [s.split(":")[0] for s in sections] == ["qwen3-8b (tiny)", "qwen3.5-9b (tiny)"]
    for section in sections:
        tables = re.findall(r"### (.+)\n\n\| .+\n\|[-|]+\n((?:\|.+\n)+)", section)
        assert [name for name, _ in tables] == ["decode", "capacity", "SFT step", "GRPO update"]
        tokens_per_s = [float(row.split("|")[5].replace(",", "")) for row in tables[0][1].splitlines()]
        assert tokens_per_s and min(tokens_per_s) > 0
        assert tables[2][1].split("|")[3].strip() != "0" and tables[3][1].split("|")[5].strip() != "0"
        assert tables[1][1].split("|")[6].strip() == "16"  # the CPU's pretend device holds 4x the batch of 4
