"""The trainers end to end on the device (issue 60), the half of bench/gpu.sh that bench/gpu.py's
measurements do not cover: `torchrun sft.py` and `torchrun grpo.py` for a few steps, LoRA and
`finetune: full`, each resumed once, GRPO against the local rules judge (judge_server.py), on two
random-weight checkpoints with the demo's toy data and tokenizer: the demo's small Qwen3 and a
Qwen3-0.6B-shaped one (28 layers, hidden 1,024, vocabulary 151,936). The settings are the shipped
defaults but the sizes: bfloat16 and `rollout.decode: auto` (static on CUDA), filtering off and
equal-reward groups kept (a random model's groups are often all equal; a plumbing check must
still train every update).

    python bench/gpu_runs.py --out OUT_DIR           # on the GPU node (bash bench/gpu.sh runs it)
    python bench/gpu_runs.py --out OUT_DIR --tiny    # tiny sizes in float32 on the CPU (the
                                                     # 0.6B shape replaced by a 2-layer stand-in)

Each run is one row of OUT_DIR/gpu_runs.md, written when it ends: its exit status, wall seconds,
the metrics.jsonl steps it left and whether they are the expected 1..N, its final folder and (a
resumed run) its "resuming from" line; a GRPO run's last update's generation and training seconds,
an SFT run's tokens/s. Each run's log is OUT_DIR/runs/<name>.log. A run whose check fails does not
stop the others (a resumed run needs its first one); the script exits 1 when any failed.
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from common import markdown_table  # noqa: E402

import demo  # noqa: E402

# demo.ModelSize fields; vocabulary: Qwen3-0.6B's 151,936 (init_model pads to a multiple of 64)
SHAPES = {
    "demo": (demo.ModelSize(), None),
    "qwen3-0.6b": (
        demo.ModelSize(
            hidden_size=1024,
            intermediate_size=3072,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
        ),
        151934,
    ),
}
TINY = {  # --tiny: the same runs at the sizes of a CPU
    "demo": (demo.ModelSize(hidden_size=64, intermediate_size=128), None),
    "qwen3-0.6b": (demo.ModelSize(hidden_size=64, intermediate_size=128, head_dim=16), 4030),
}
HEADER = ["run", "exit", "wall s", "steps", "check", "generate s", "train s", "tokens/s"]


def build(work: Path, tiny: bool) -> dict[str, Path]:
    """The toy data and tokenizer (demo.prepare), and a random checkpoint of each shape with that
    tokenizer."""
    spec = demo.DemoData(train=64 if tiny else 256, heldout=8, model=TINY["demo"][0])
    demo.prepare(work / "demo", spec)
    base = work / "demo" / "base"
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    folders = {}
    for i, (name, (size, shape_vocab)) in enumerate((TINY if tiny else SHAPES).items()):
        folder = work / name
        demo.init_model(folder, size, shape_vocab or vocab - 2, seed=i + 1)
        for file in base.glob("*.json"):
            if file.name != "config.json":
                shutil.copy(file, folder / file.name)
        folders[name] = folder
    return folders


def sft_config(base: Path, data: Path, out: Path, full: bool, tiny: bool) -> dict:
    return {
        "model": str(base),
        "data": str(data),
        "output_dir": str(out),
        "lr": 1.0e-5 if full else 2.0e-3,
        "epochs": 1,
        "batch_size": 4 if tiny else 8,
        "rows_per_update": 4 if tiny else 8,  # one micro-batch an update on its one process
        "selection": {"per_task": 2, "max_new_tokens": 16, "batch_size": 8},
        "save_every": 1000,
        "seed": 0,
        **({"finetune": "full"} if full else {"lora": {"rank": 16, "alpha": 32}}),
        **({"device": "cpu", "dtype": "float32"} if tiny else {}),
    }


def grpo_config(base, adapter, data, out: Path, judge: str, full: bool, tiny: bool) -> dict:
    return {
        "output_dir": str(out),
        "train_data": [str(data)],
        "model": {
            "path": str(base),
            "sft_adapter": str(adapter),
            "gradient_checkpointing": True,
            **({"device": "cpu", "dtype": "float32"} if tiny else {}),
        },
        "updates": 1,
        "reward": {"name": "clue", "params": {"lambda_iu": 0.5}},
        "judge": {"base_url": judge, "model": "rules", "concurrency": 32},
        "rollout": {
            "prompts_per_update": 2 if tiny else 8,
            "group_size": 4 if tiny else 8,
            "max_new_tokens": 16 if tiny else 96,
        },
        "filtering": {"enabled": False, "mask_equal": False},
        "loss": {"beta": 0.04, "micro_batch_size": 8},
        "optim": {"lr": 1.0e-6 if full else 1.0e-4, "warmup_updates": 0},
        "save_every": 1,
        **({"finetune": "full"} if full else {"lora": {"rank": 16, "alpha": 32}}),
    }


def steps_of(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [r for r in map(json.loads, filter(str.strip, lines)) if "loss" in r]


def run_one(script, config: Path, overrides, logs: Path, name: str, records, final, resumed):
    """torchrun SCRIPT CONFIG OVERRIDES on one process; returns its row, whether it passed and
    the steps it left. `records`: the steps metrics.jsonl must hold after it (None: any, at
    least one)."""
    log = logs / f"{name.replace(' ', '-')}.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "1", str(REPO / script), str(config), *overrides]
    start = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(command, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    run_dir = Path(yaml.safe_load(config.read_text())["output_dir"])
    steps = steps_of(run_dir)
    problems = [] if code == 0 else [f"exit {code}"]
    expected = list(range(1, (records or max(1, len(steps))) + 1))
    if [r["step"] for r in steps] != expected:
        problems.append(f"steps {[r['step'] for r in steps]}, expected 1..{expected[-1]}")
    if not (run_dir / final).is_dir():
        problems.append(f"no {final}/")
    if resumed and "resuming from" not in log.read_text(errors="replace"):
        problems.append("no 'resuming from' line")
    if script == "grpo.py" and not sum(r.get("tokens/trained") or 0 for r in steps):
        problems.append("no token trained")
    last = steps[-1] if steps else {}

    def cell(key, fmt):
        return format(last[key], fmt) if isinstance(last.get(key), (int, float)) else "-"

    row = [name, code, f"{wall:.0f}", len(steps), "; ".join(problems) or "ok"]
    row += [cell("time/generate_s", ".2f"), cell("time/train_s", ".2f")]
    return row + [cell("tokens_per_s", ",.0f")], not problems, len(steps)


def plans(shape: str, base: Path, work: Path, url: str, tiny: bool) -> list[tuple]:
    """(name, script, config file, ...) of one shape's runs in order: SFT LoRA and full, each
    then resumed to a second epoch; GRPO LoRA and full from the SFT LoRA adapter, each one update
    then resumed to a second."""
    data = work / "demo" / "data"
    out = []
    for script in ("sft.py", "grpo.py"):
        for mode in ("lora", "full"):
            full, stem = mode == "full", f"{shape}-{script[:-3]}-{mode}"
            config = work / f"{stem}.yaml"
            if script == "sft.py":
                settings = sft_config(base, data / "sft.jsonl", work / stem, full, tiny)
                again, final = ["epochs=2"], "best"
            else:
                adapter = work / f"{shape}-sft-lora" / "best"
                settings = grpo_config(
                    base, adapter, data / "train.jsonl", work / stem, url, full, tiny
                )
                again, final = ["updates=2"], "model" if full else "adapter"
            config.write_text(yaml.safe_dump(settings))
            name = f"{shape} {script[:-3]} {mode}"
            out += [
                (name, script, config, [], final),
                (f"{name} resumed", script, config, again, final),
            ]
    return out


def judge_url(log: Path, wait_s: float = 60) -> str:
    """The rules judge's address, from the line judge_server.py prints once it listens."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if " at http" in line:
                return line.rsplit(" at ", 1)[-1].strip()
        time.sleep(0.2)
    raise SystemExit(f"gpu_runs.py: the rules judge did not start ({log})")


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="tiny sizes in float32 on the CPU")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = p.parse_args()
    work, logs = args.out / "runs", args.out / "runs" / "logs"
    if work.exists():
        shutil.rmtree(work)
    logs.mkdir(parents=True)
    report = args.out / "gpu_runs.md"
    began = time.perf_counter()
    folders = build(work, args.tiny)
    judge_log = logs / "judge_server.log"
    with judge_log.open("w") as f:
        judge = subprocess.Popen(
            [sys.executable, str(REPO / "judge_server.py"), "--backend", "rules", "--port", "0"],
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    failed, steps = [], {}
    try:
        url = judge_url(judge_log)
        report.write_text(
            f"# End-to-end runs (bench/gpu_runs.py{' --tiny' if args.tiny else ''})\n\n"
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; the rules judge at {url}\n\n"
            + markdown_table(HEADER, [])
            + "\n"
        )
        for shape in args.shapes:
            for name, script, config, again, final in plans(
                shape, folders[shape], work, url, args.tiny
            ):
                first = name.removesuffix(" resumed")
                if again and first not in steps:
                    row, ok = (
                        [name, "-", "-", "-", f"skipped: {first} failed", "-", "-", "-"],
                        False,
                    )
                else:
                    # resumed: a second epoch (SFT), a second update (GRPO)
                    records = 2 * steps[first] if again else (1 if script == "grpo.py" else None)
                    row, ok, n = run_one(
                        script, config, again, logs, name, records, final, bool(again)
                    )
                    if ok and not again:
                        steps[name] = n
                failed += [] if ok else [name]
                text = "| " + " | ".join(str(c) for c in row) + " |"
                with report.open("a") as f:
                    f.write(text + "\n")
                print(f"{text}  [{time.perf_counter() - began:.0f} s]", flush=True)
    finally:
        judge.terminate()
        judge.wait(timeout=30)
    print(f"wrote {report} in {time.perf_counter() - began:.0f} s")
    if failed:
        sys.exit(f"gpu_runs.py: failed runs: {', '.join(failed)} (logs in {logs})")


if __name__ == "__main__":
    main()
