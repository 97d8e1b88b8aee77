"""Peak memory and time of model.token_logprobs (forward and backward, with and without entropy)
against a naive full log-softmax and against the chunk-recomputing version it replaced, on one long
sequence with a Qwen-sized vocabulary, in one run.

    python bench/bench_logprobs.py                              # 4,096 tokens, vocab 151,936,
                                                                  hidden 128
    python bench/bench_logprobs.py --tokens 2048 --vocab 32768 --methods ours recomputed

The model is a random-weight one-layer Qwen3 shape in float32 with LoRA on every projection and two
trainable token rows (as in SFT), so the hidden states and the rows need gradients. Each case runs
in its own process, so its peak resident memory (ru_maxrss) is its own; the table shows the growth
over the model's footprint, beside the size of the float32 [T, vocab] tensor that the naive path
materializes. Times are the best of --repeats runs after a warm-up; on a shared machine compare the
ratios.
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import markdown_table, threads, verdict  # noqa: E402

import model as M  # noqa: E402

# issue 15: peak memory well below the naive full log-softmax's (here: at most half)
PEAK_GOAL = 2.0


def naive(model, ids, temperature, entropy):
    """The full [T, vocab] float32 log-softmax under plain autograd."""
    logp = F.log_softmax(model(ids)[:, :-1].float() / temperature, -1)
    return logp.gather(-1, ids[:, 1:, None])[..., 0], -(logp.exp() * logp).sum(
        -1
    ) if entropy else None


def recomputed(model, ids, temperature, entropy, chunk_size=1024):
    """token_logprobs before the fused gradient: each chunk's logits under checkpoint, recomputed in
    backward."""

    def chunk(h, t):
        logits = model.logits(h).float() / temperature
        lse = logits.logsumexp(-1)
        return logits.gather(-1, t[:, None])[:, 0] - lse, lse - (logits.softmax(-1) * logits).sum(
            -1
        )

    h, t = model.hidden_states(ids)[0, :-1], ids[0, 1:]
    parts = [
        checkpoint(chunk, h[i : i + chunk_size], t[i : i + chunk_size], use_reentrant=False)
        for i in range(0, len(t), chunk_size)
    ]
    return torch.cat([p[0] for p in parts])[None], torch.cat([p[1] for p in parts])[
        None
    ] if entropy else None


def ours(model, ids, temperature, entropy):
    out = M.token_logprobs(model, ids, temperature=temperature, entropy=entropy)
    return out if entropy else (out, None)


METHODS = {"naive": naive, "recomputed": recomputed, "ours": ours}


def build(args):
    raw = dict(
        model_type="qwen3",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        rope_theta=1e6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = M.Qwen(M.QwenConfig.from_dict(raw)).train()
    M.add_lora(model, rank=8, alpha=16)
    M.train_token_rows(model, [1, 2])
    return model, torch.randint(0, args.vocab, (1, args.tokens))


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def run_case(args) -> dict:
    """One method and entropy setting in this process: best forward / backward seconds and peak
    memory growth."""
    model, ids = build(args)
    fn, entropy = METHODS[args.case], args.entropy == "on"
    before = resident_bytes()
    forward, backward = [], []
    for _ in range(args.repeats + 1):
        start = time.perf_counter()
        logp, ent = fn(model, ids, args.temperature, entropy)
        loss = logp.sum() + (ent.sum() if entropy else 0)
        middle = time.perf_counter()
        loss.backward()
        forward.append(middle - start)
        backward.append(time.perf_counter() - middle)
        del logp, ent, loss
        model.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {
        "forward": min(forward[1:] or forward),
        "backward": min(backward[1:] or backward),
        "peak": peak - before,
    }


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument(
        "--repeats", type=int, default=2, help="timed runs after a warm-up (0: one run, timed)"
    )
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    # internal: run one case, print JSON
    p.add_argument("--case", choices=list(METHODS), help=argparse.SUPPRESS)
    p.add_argument("--entropy", choices=["on", "off"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        print(json.dumps(run_case(args)))
        return
    common = [
        f"--{k}={getattr(args, k)}" for k in ("tokens", "vocab", "hidden", "temperature", "repeats")
    ]
    full = args.tokens * args.vocab * 4 / 2**20
    rows, peaks = [], {}
    for entropy in ("off", "on"):
        results = {}
        for method in args.methods:
            cmd = [sys.executable, __file__, *common, f"--case={method}", f"--entropy={entropy}"]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"bench_logprobs: case {method} entropy {entropy} failed:\n{out.stderr}")
            r = results[method] = json.loads(out.stdout)
            total = r["forward"] + r["backward"]
            peaks[method, entropy] = r["peak"] / 2**20
            ratios = [
                f"{(results[m]['forward'] + results[m]['backward']) / total:.2f}x"
                if m in results
                else "-"
                for m in ("naive", "recomputed")
            ]
            rows.append(
                [
                    method,
                    entropy,
                    f"{r['forward']:.3f}",
                    f"{r['backward']:.3f}",
                    f"{total:.3f}",
                    f"{r['peak'] / 2**20:,.0f}",
                    f"{r['peak'] / 2**20 / full:.2f}",
                    *ratios,
                ]
            )
    for entropy in ("off", "on"):
        if ("naive", entropy) in peaks and ("ours", entropy) in peaks:
            verdict(
                f"logprobs peak memory naive/ours, entropy {entropy}",
                peaks["naive", entropy] / peaks["ours", entropy],
                PEAK_GOAL,
            )
    print(
        f"\ntoken_logprobs: {args.tokens} tokens, vocab {args.vocab}, hidden {args.hidden}, "
        f"float32, {threads(None)} threads, best of {max(args.repeats, 1)}; one float32 [T, "
        f"vocab] tensor is {full:,.0f} MiB; peak: growth of the process's peak RSS over the "
        f"model's footprint\n"
    )
    print(
        markdown_table(
            [
                "method",
                "entropy",
                "forward s",
                "backward s",
                "total s",
                "peak MiB",
                "peak / [T, vocab]",
                "speed vs naive",
                "speed vs recomputed",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
