"""bench/: every benchmark script run end to end on a tiny shape (a few seconds each, most of it
imports), checking that it exits 0 and prints the numbers it exists to print (ratios positive and
finite, both sides' tables), so that a signature that moves in the project breaks this suite rather
than the next `bash bench/run_all.sh`; that run_all.sh runs every one of them; and bench/gpu.sh, the
GPU node's measurements: its decode roofline arithmetic against a hand count of the Qwen3-8B shape,
and the whole script on tiny shapes on the CPU (--tiny). The numbers of a tiny run mean nothing as
measurements: only that they are there. bench_rollout.py needs the vLLM venv (VLLM_VENV, default
.venv-vllm), bench_verifier.py MELD (CLUE_DATA_DIR), bench_grpo.py TRL (bench/requirements.txt):
each skips with the reason when its input is missing. Run with --runslow."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import gpu  # noqa: E402

import model as M  # noqa: E402

VENV = Path(os.environ.get("VLLM_VENV", REPO / ".venv-vllm"))
VERDICT = re.compile(r"^target: (.+) ([0-9.]+)x \(goal >= ([0-9.]+)x\): (met|MISSED)$", re.M)


def run(script: str, *args: str, timeout: float = 300) -> str:
    """Run bench/SCRIPT with ARGS on one torch thread; returns its stdout after checking that it
    exited 0."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TRANSFORMERS_VERBOSITY="error",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_OFFLINE="1",
    )
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, f"{script} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return result.stdout


def table(text: str, first_header: str) -> list[dict[str, str]]:
    """The rows of the Markdown table whose first column is headed FIRST_HEADER, as {header:
    cell}."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))))
    return rows


def number(cell: str) -> float:
    """A table cell as a float: '**1.35x**', '1,376', '5.25e-06' -> the number; anything else fails
    the test."""
    value = float(cell.strip("*").rstrip("x").replace(",", ""))
    assert math.isfinite(value), cell
    return value


def positive(cell: str) -> float:
    value = number(cell)
    assert value > 0, cell
    return value


def verdicts(text: str) -> dict[str, float]:
    """The `target:` lines run_all.sh collects: name -> the measured ratio (positive and finite)."""
    found = {m.group(1): float(m.group(2)) for m in VERDICT.finditer(text)}
    assert all(math.isfinite(v) and v > 0 for v in found.values()), found
    return found


def test_run_all_runs_every_benchmark():
    script = (REPO / "bench" / "run_all.sh").read_text()
    listed = set(re.findall(r'^\s+"python (bench/\S+\.py)', script, re.M))
    scripts = {f"bench/{p.name}" for p in (REPO / "bench").glob("bench_*.py")} | {"bench/gpu.py"}
    assert listed == scripts


def test_bench_generate_tiny():
    out = run(
        "bench_generate.py",
        "--vocab",
        "256",
        "--hidden",
        "64",
        "--ffn",
        "128",
        "--layers",
        "1",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--repeats",
        "0",
        "--new",
        "8",
        "--threads",
        "1",
    )
    rows = table(out, "case")
    assert [r["case"] for r in rows] == ["default", "ragged", "group"]
    for r in rows:
        assert r["new tokens"] == "8"
        positive(r["transformers tok/s"]), positive(r["ours tok/s"]), positive(r["ratio"])
    assert rows[0]["greedy tokens equal"].endswith("%")
    assert set(verdicts(out)) == {"generate ragged", "generate group"}


def test_bench_logprobs_tiny():
    out = run(
        "bench_logprobs.py",
        "--tokens",
        "128",
        "--vocab",
        "512",
        "--hidden",
        "32",
        "--repeats",
        "0",
        "--methods",
        "naive",
        "ours",
    )
    rows = table(out, "method")
    assert [(r["method"], r["entropy"]) for r in rows] == [
        ("naive", "off"),
        ("ours", "off"),
        ("naive", "on"),
        ("ours", "on"),
    ]
    for r in rows:
        positive(r["total s"]), number(r["peak MiB"]), positive(r["speed vs naive"])
    assert set(verdicts(out)) == {
        "logprobs peak memory naive/ours, entropy off",
        "logprobs peak memory naive/ours, entropy on",
    }


def test_bench_sft_tiny():
    out = run(
        "bench_sft.py",
        "--vocab",
        "256",
        "--hidden",
        "64",
        "--layers",
        "1",
        "--sequences",
        "2",
        "--length",
        "256",
        "--prompt",
        "64",
        "--repeats",
        "1",
        "--threads",
        "1",
    )
    [row] = table(out, "vocab")
    positive(row["transformers+peft tok/s"]), positive(row["ours tok/s"]), positive(row["ratio"])
    number(row["peft peak MiB"]), number(row["ours peak MiB"])
    theirs, ours = (float(x) for x in row["first-step loss (theirs / ours)"].split(" / "))
    assert abs(theirs - ours) < 1e-4 * theirs  # the same model, data and loss on both sides
    assert set(verdicts(out)) == {"sft vocab 256"}


def test_bench_grpo_tiny():
    pytest.importorskip("trl", reason="TRL not installed: pip install -r bench/requirements.txt")
    out = run(
        "bench_grpo.py",
        "--prompts",
        "2",
        "--k",
        "2",
        "--new",
        "8",
        "--vocab",
        "64",
        "--hidden",
        "64",
        "--layers",
        "1",
        "--updates",
        "1",
        "--threads",
        "1",
    )
    rows = {r["side"]: r for r in table(out, "side")}
    assert set(rows) == {"TRL GRPOTrainer", "ours", "ratio (TRL / ours)"}
    for side in ("TRL GRPOTrainer", "ours"):
        (
            positive(rows[side]["generate s"]),
            positive(rows[side]["train s"]),
            positive(rows[side]["total s"]),
        )
        assert 0 < number(rows[side]["mean length"]) <= 8
    ratio = positive(rows["ratio (TRL / ours)"]["total s"])
    assert verdicts(out) == {"grpo update": pytest.approx(ratio, abs=0.01)}


def test_bench_packing_tiny():
    out = run("bench_packing.py", "--new", "64", "--layers", "1", "--repeats", "0")
    padded, packed = table(out, "batches")
    assert (padded["batches"], packed["batches"]) == ("padded", "packed")
    assert (
        padded["tokens"] == packed["tokens"] == packed["computed"] and packed["padding"] == "0.0%"
    )
    assert number(padded["computed"]) > number(padded["tokens"])
    positive(padded["train s"]), positive(packed["speed vs padded"])


def test_bench_decode_tiny():
    out = run("bench_decode.py", "--new", "8", "--layers", "1", "--repeats", "0")
    rows = table(out, "decode")
    assert [r["decode"] for r in rows] == ["eager", "static", "compiled"]
    for r in rows:
        positive(r["ms/step"]), positive(r["speed vs eager"])
        assert r["tokens equal eager's"] == "yes" and positive(r["aten operators per token"]) > 10
    # Inductor fuses the elementwise operators: far fewer aten calls per token
    assert (
        number(rows[2]["aten operators per token"])
        < number(rows[0]["aten operators per token"]) / 2
    )


def test_bench_decode_tiny_with_a_lora_counts_fewer_operators_merged():
    out = run(
        "bench_decode.py",
        *("--new", "8", "--layers", "1", "--repeats", "0"),
        *("--lora", "4", "--dtype", "bfloat16"),
    )
    rows = {(r["decode"], r["LoRA"]): r for r in table(out, "decode")}
    assert list(rows) == [
        ("eager", "side path"),
        ("eager", "merged"),
        ("static", "side path"),
        ("static", "merged"),
        ("compiled", "merged"),
    ]
    for way in ("eager", "static"):  # per adapted projection: 2 products and 4 casts fewer
        side, merged = (number(rows[way, p]["aten operators per token"]) for p in gpu.LORA_PATHS)
        assert merged < side - 6 * 7


def test_bench_train_step_tiny():
    out = run("bench_train_step.py", "--layers", "1", "--length", "16", "--repeats", "0")
    rows = table(out, "setting")
    assert [r["setting"] for r in rows] == ["default", "lora.compute: model", "compile", "both"]
    for r in rows:
        positive(r["ms/step"]), positive(r["speed vs default"])
        # the base's bfloat16 rounding, not another loss
        assert number(r["loss gap"]) < 1e-2 and 0 < number(r["gradient gap"]) < 5e-2


def test_bench_verifier_tiny(shared_data):
    if not (shared_data / "meld" / "train_sent_emo.csv").is_file():
        pytest.skip(f"MELD not found under {shared_data}")
    out = run(
        "bench_verifier.py",
        "--data",
        str(shared_data),
        "--completions",
        "4",
        "--turns",
        "50",
        "--baseline-completions",
        "1",
    )
    assert "batch: 4 completions, 32 quotations" in out
    assert positive(re.search(r"^speed-up: (\S+)$", out, re.M).group(1))
    exact = json.loads(re.search(r"exact x5 (\[[\d, ]+\])", out).group(1))
    assert len(exact) == 5 and all(0 <= n <= 4 for n in exact)


def test_bench_verifier_bounds_tiny():
    report = json.loads(run("bench_verifier_bounds.py", "--turns", "500", "--json"))
    times = {
        k: v for k, v in report.items() if k not in ("exact fragments in repetitive", "peak_rss_mb")
    }
    assert len(times) == 2 + 6 + 3 and all(math.isfinite(v) and v >= 0 for v in times.values())
    assert report["exact fragments in repetitive"] is True and report["peak_rss_mb"] > 0


def test_bench_judge_tiny():
    out = run("bench_judge.py", "--n", "8", "--latency", "0.05", "--concurrency", "4", timeout=120)
    assert positive(
        re.search(r"measured / ideal = (\S+) \(target <= 1\.5: (met|MISSED)\)", out).group(1)
    )
    assert "parsed verdict lists: 8/8 and 8/8" in out
    assert re.search(r"results returned 8/8, parsed 8/8, retries \d+, failures 0", out)


def test_bench_fsdp_tiny():
    out = run(
        "bench_fsdp.py",
        "--hidden",
        "128",
        "--layers",
        "1",
        "--vocab",
        "512",
        "--tokens",
        "32",
        "--new",
        "4",
        "--repeats",
        "1",
    )
    rows = table(out, "ranks")
    assert [(r["ranks"], r["rank"]) for r in rows] == [("1", "0"), ("2", "0"), ("2", "1")]
    for r in rows:
        positive(r["state MiB"]), positive(r["step s"])
        assert r["collectives / token (gathered)"] == "0"
    # one layer + the final norm, each gathered per token
    assert number(rows[1]["(sharded, no gathered)"]) == 2
    assert verdicts(out)["fsdp per-rank state, replicated / 2 ranks"] > 1
    startup = table(out, "loading")
    assert [(r["loading"], r["rank"]) for r in startup] == [
        ("whole", "0"),
        ("whole", "1"),
        ("sharded", "0"),
        ("sharded", "1"),
    ]
    for r in startup:  # at this size the MiB are noise: numbers, not a comparison
        number(r["peak MiB (start-up)"]), positive(r["load s"])
    assert "target: fsdp collectives per decoded token under gathered 0 (goal 0): met" in out


def vllm_missing() -> str | None:
    python = VENV / "bin" / "python"
    if not python.is_file():
        return (
            f"no vLLM venv at {VENV} (build it with `bash .ci/vllm_venv.sh`, or point VLLM_VENV "
            f"at one)"
        )
    found = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('vllm') is not None)"],
        capture_output=True,
        text=True,
    )
    return (
        None
        if found.stdout.strip() == "True"
        else f"{python} cannot import vllm (rebuild: bash .ci/vllm_venv.sh)"
    )


def test_bench_rollout_tiny():
    if reason := vllm_missing():
        pytest.skip(reason)
    out = run(
        "bench_rollout.py",
        "--prompts",
        "2",
        "--k",
        "2",
        "--new",
        "8",
        "--repeats",
        "1",
        "--threads",
        "1",
        "--vllm-python",
        str(VENV / "bin" / "python"),
        timeout=900,
    )
    timing = table(out, "engine")
    assert [r["engine"] for r in timing] == ["local", "vllm"]
    for r in timing:
        assert r["prompts x K"] == "2 x 2" and 0 < number(r["new tokens"]) <= 2 * 2 * 8
        positive(r["seconds"]), positive(r["tokens/s"]), positive(r["local / this"])
    gaps = table(out.split("### Sampler/trainer mismatch")[1], "engine")
    assert [r["engine"] for r in gaps] == ["local", "vllm"]
    # float32 on both sides: the same distribution
    assert all(number(r["max"]) < 1e-3 for r in gaps)
    [greedy] = table(out, "prompts")
    assert greedy["prompts"] == "2" and 0 <= number(greedy["identical"]) <= 2


def test_bench_sync_tiny():
    out = run(
        "bench_sync.py", "--vocab", "512", "--hidden", "32", "--layers", "1", "--repeats", "1"
    )
    today, trained = table(out, "path")
    # vocab 512, hidden 32, FFN 96, 1 layer, 4 heads of 8 (2 KV): the hand count of the weights
    d, kv, ffn, vocab = 32, 2 * 8, 96, 512
    layer = 2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d + 2 * 8
    sharded = layer + d  # the layer and the final norm; embedding and lm_head frozen
    assert number(trained["gathered MB"]) == round(2 * sharded / 1e6, 1)
    assert number(today["gathered MB"]) == round(4 * sharded / 1e6, 1)
    assert number(trained["written MB"]) < number(today["written MB"])
    assert number(today["written MB"]) >= round(2 * (sharded + 2 * vocab * d) / 1e6, 1)
    found = verdicts(out)
    assert set(found) == {
        "sync bytes moved, today / trained only (measured)",
        "sync bytes moved, today / trained only (qwen3-8b, arithmetic)",
        "sync bytes moved, today / trained only (qwen3.5-9b, arithmetic)",
    }
    # qwen3-8b by hand: 36 layers sharded, float32 before and bf16 after; 2 x 151936 x 4096 frozen
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    sharded, frozen = 36 * per_layer + 4096, 2 * 151936 * 4096
    before = 4 * sharded + 2 * 2 * (sharded + frozen)
    after = 2 * sharded + 2 * 2 * sharded
    assert (
        abs(found["sync bytes moved, today / trained only (qwen3-8b, arithmetic)"] - before / after)
        < 0.01
    )


def test_decode_bytes_of_qwen3_8b_equal_a_hand_count():
    model = gpu.random_model(gpu.SHAPES["qwen3-8b"], torch.bfloat16, torch.device("meta"))
    d, kv, ffn, vocab, layers = 4096, 8 * 128, 12288, 151936, 36
    # q, o; k, v; MLP; two norms; q/k norms
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d + 2 * 128
    # bf16, the final norm and lm_head; the embedding not read
    weights = 2 * (layers * per_layer + d + vocab * d)
    # 64 rows of 640 tokens, K and V, bf16: 144 KiB per token
    kv_bytes = 64 * 640 * layers * 2 * kv * 2
    assert gpu.step_bytes(model, 64, 640) == (weights, weights + kv_bytes)
    # the H200 roofline RESULTS.md states
    assert abs(64 * 4.8e12 / (weights + kv_bytes) - 14_507) < 1
    # a GRPO group: 8 rows of 100 tokens of their own after a 1,024-token prompt read once
    assert gpu.step_bytes(model, 8, 100, shared=1024)[1] == weights + (800 + 1024) * 36 * 2 * kv * 2


def test_recomputed_layer_bytes_equal_a_hand_count_and_the_saved_tensors():
    """The memory plan's bytes per token of one checkpointed layer: a hand count from the tiny
    shapes, and what autograd actually saves in a bf16 forward of model.py's layer (every weight
    trainable), each distinct storage once, the weights, the layer input and the RoPE tables
    left out."""
    raw = gpu.TINY["qwen3-8b"]
    d, H, Hkv, D, ffn = 64, 4, 2, 16, 128
    norm = 4 * d + 4 + 2 * d  # float32 input, float32 1/rms, bf16 normalized input
    hand = (
        2 * norm
        + 2 * (2 * d)  # the norms' outputs, read by q/k/v and by gate/up
        + (4 * H * D + 4 * H + 2 * H * D)  # q_norm
        + (4 * Hkv * D + 4 * Hkv + 2 * Hkv * D)  # k_norm
        + 2 * H * D
        + 2 * 2 * Hkv * D  # attention's q, k, v
        + 2 * H * D
        + 4 * H  # attention's output (o_proj's input) and log-sum-exp
        + 4 * 2 * ffn  # gate, silu(gate), up, their product
    )
    torch.manual_seed(0)
    model = gpu.random_model(raw, torch.bfloat16, torch.device("cpu")).train()
    assert gpu.recomputed_layer_bytes(model.config) == hand == 3056
    B, T = 2, 8
    x = torch.randn(B, T, d, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = M.rope_tables(T, model.config, x.dtype, x.device)
    positions = torch.arange(T)[None].expand(B, T)
    step = M.ForwardState(
        cos[positions, None], sin[positions, None], None, positions, None, None, None
    )
    skip = {t.untyped_storage().data_ptr() for t in [x, step.cos, step.sin, *model.parameters()]}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](x, step)
    assert sum(saved.values()) == B * T * hand


def gpu_tables(section: str) -> dict[str, list[dict[str, str]]]:
    """The tables of one `## ` section of gpu_results.md: title -> rows as {header: cell}."""
    return {
        title: table(section[section.index(f"### {title}") :], first)
        for title, first in re.findall(r"### (.+)\n\n\| (.+?) \|", section)
    }


@pytest.mark.slow
def test_gpu_script_runs_tiny_on_the_cpu(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu.sh"), str(tmp_path), "--tiny"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    text = (tmp_path / "gpu_results.md").read_text()
    assert "optional packages: " in text.splitlines()[2]
    sections = text.split("\n## ")[1:]
    assert [s.split("\n")[0] for s in sections] == [
        "qwen3-8b (tiny): 0.11M multiplied weights, torch.float32",
        "qwen3.5-9b (tiny): 0.20M multiplied weights, torch.float32",
        "full-parameter GRPO at world size 1: qwen3-8b, torch.float32",
        "qwen3-8b (tiny): launches",
        "qwen3.5-9b (tiny): launches",
    ]
    for section in sections[:2]:
        tables = gpu_tables(section)
        assert list(tables) == [
            "decode on GRPO's path (a group sharing its prompt)",
            "GRPO update, padded and packed",
        ]
        decode, packing = tables.values()
        assert [(r["decode"], r["LoRA"]) for r in decode] == [
            ("eager", "side path"),
            ("eager", "merged"),
            ("static", "side path"),
            ("static", "merged"),
            ("static", "merged"),
        ]
        assert [r["rows x (prompt + new)"] for r in decode] == ["2 x (16 shared + 8)"] * 4 + [
            "2 x (16 shared + 16)"
        ]
        for r in decode:
            positive(r["ms/step"]), positive(r["tokens/s"]), positive(r["roofline tokens/s"])
            assert r["of roofline"].endswith("%") and r["ran with"]
        padded, packed = packing
        assert (padded["batches"], packed["batches"]) == ("padded", "packed")
        # the same sequences: packed computes exactly their tokens, padded more
        assert packed["tokens"] == padded["tokens"] == packed["computed"]
        assert number(padded["computed"]) > number(padded["tokens"]) and packed["padding"] == "0.0%"
        assert packed["ran with"] == "SDPA per sequence"
        positive(padded["train s"]), positive(packed["tokens/s"])
    tables = gpu_tables(sections[2])
    [fsdp] = tables["FSDP update"]
    positive(fsdp["s/update"]), positive(fsdp["tokens/s"])
    assert fsdp["ran with"].startswith("FSDP2 over 1 rank (gloo)")
    [sync] = tables["save of a full-parameter vLLM sync"]
    positive(sync["seconds"]), positive(sync["GB/s"])
    assert not (tmp_path / "sync-weights").exists()  # deleted once timed
    for section in sections[3:]:
        [launches] = gpu_tables(section).values()
        assert [(r["decode"], r["LoRA"]) for r in launches] == [
            ("eager", "side path"),
            ("eager", "merged"),
            ("static", "side path"),
            ("static", "merged"),
        ]
        for r in launches:
            assert positive(r["per token"]) > 100 and r["counted"] == "aten operator calls"
        for side, merged in (launches[:2], launches[2:]):  # no LoRA side path: fewer operators
            assert number(merged["per token"]) < number(side["per token"])
    # bench/gpu_runs.py: each trainer, LoRA and full, then resumed, on both shapes; all passed
    runs = table((tmp_path / "gpu_runs.md").read_text(), "run")
    assert [r["run"] for r in runs] == [
        f"{shape} {script} {mode}{resumed}"
        for shape in ("demo", "qwen3-0.6b")
        for script in ("sft", "grpo")
        for mode in ("lora", "full")
        for resumed in ("", " resumed")
    ]
    for r in runs:
        assert r["exit"] == "0" and r["check"] == "ok", r
        assert number(r["steps"]) == (2 if "resumed" in r["run"] else 1) * (
            1 if "grpo" in r["run"] else number(runs[0]["steps"])
        )


def test_a_failed_section_keeps_the_rows_before_it_and_the_run_goes_on(tmp_path):
    report = gpu.Report(tmp_path / "out.md", "# header\n\n")

    def measure(emit):
        emit([1, 2])
        raise RuntimeError("capture failed")

    report.section("first", ["a", "b"], measure)
    report.section("second", ["a", "b"], lambda emit: emit([3, 4]))
    text = (tmp_path / "out.md").read_text()
    assert report.failed == ["first"]
    assert "| 1 | 2 |\n\n**failed**: RuntimeError: capture failed" in text
    assert text.index("**failed**") < text.index("### second") < text.index("| 3 | 4 |")
