"""model.generate's decode step on GRPO's path (K rows continuing one shared prompt, a SharedPrefix)
in one run on the CPU (issue 50): eager, static (`decode="static"`: the same step with fixed shapes
and in-place writes, what a CUDA graph captures on a GPU; on the CPU it runs as is) and compiled
(`decode="compiled"`: torch.compile of the static step, Inductor's C++ kernels on the CPU).

    python bench/bench_decode.py                  # Qwen3-shaped, 8 rows, 512-token prompt, 128 new
    python bench/bench_decode.py --family qwen3_5 # hybrid Gated DeltaNet + gated attention
    python bench/bench_decode.py --new 8 --layers 1 --repeats 0        # a smoke test
    python bench/bench_decode.py --lora 16 --dtype bfloat16
        # with GRPO's LoRA (r16, float32 factors, B not zero) on a bfloat16 base: each way with the
        # LoRA on its side path and merged (model.lora_merged, what GRPO's rollouts decode with)

The model: a random Qwen3 (hidden 256, 4 layers, vocab 8,192, as bench_generate.py's) in float32
(--dtype). Greedy, no EOS: every row decodes --new tokens. Reported per way: the seconds of its
first call (warm-up: for compiled, the compilation), the decode step's ms and tokens/s (the
difference of runs of --new / 2 and --new tokens over the extra steps, so the prefill cancels; the
ways alternating, best of --repeats), the speed against the first row (eager), whether the tokens
equal its tokens, and the aten operators per decoded token from torch.profiler (bench/gpu.py's
`launches`: the difference of two profiled runs over their extra steps; a compiled step's fused
kernels are not aten operators, its matrix products are).
"""

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import best_times, markdown_table, qwen3_shape, threads  # noqa: E402
from gpu import LORA_PATHS, launches, lora_path  # noqa: E402

import model as M  # noqa: E402

WAYS = ("eager", "static", "compiled")


def cases(lora: int) -> list[tuple[str, str]]:
    """(decode, LoRA path) of each row: without a LoRA the three ways; with one, eager and static
    on both paths and compiled merged."""
    if not lora:
        return [(way, "none") for way in WAYS]
    return [(way, path) for way in WAYS[:2] for path in LORA_PATHS] + [("compiled", "merged")]


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--family", choices=["qwen3", "qwen3_5"], default="qwen3")
    p.add_argument("--k", type=int, default=8, help="rows sharing the prompt")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: none)")
    p.add_argument("--dtype", choices=list(M.DTYPES), default="float32")
    args = p.parse_args()
    n_threads = threads(args.threads)
    raw = qwen3_shape(args.vocab, args.hidden, args.layers, tied=True)
    if args.family == "qwen3_5":
        raw |= dict(
            model_type="qwen3_5_text",
            linear_conv_kernel_dim=4,
            linear_key_head_dim=args.hidden // 4,
            linear_value_head_dim=args.hidden // 4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            full_attention_interval=4,
        )
    torch.manual_seed(0)
    model = M.Qwen(M.QwenConfig.from_dict(raw))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02) if param.dim() > 1 else param.fill_(1.0)
    model.to(M.DTYPES[args.dtype]).eval()
    if args.lora:
        M.add_lora(model, args.lora, 2 * args.lora)
        with torch.no_grad():
            for m in M.lora_modules(model).values():
                m.lora_B.normal_(0, 0.02)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, args.vocab, (args.prompt,), generator=g).tolist()] * args.k
    ways = cases(args.lora)

    def run(way, lora, new=args.new):
        with lora_path(model, lora):
            return M.generate(model, rows, new, temperature=0, decode=way)

    first, outputs = {}, {}
    half = args.new // 2
    for case in ways:
        start = time.perf_counter()
        outputs[case] = run(*case)
        first[case] = time.perf_counter() - start
        run(*case, half)  # compiled: the other cache size's graph too
    times, _ = best_times(
        [lambda case=case, n=n: run(*case, n) for case in ways for n in (half, args.new)],
        args.repeats,
    )
    # the decode steps alone: the prefill and the first steps cancel
    seconds = [(full - part) / (args.new - half) for part, full in zip(times[::2], times[1::2])]
    operators = []
    launches(
        model,
        SimpleNamespace(k=args.k, decode_prompt=args.prompt, launch_steps=8),
        torch.device("cpu"),
        operators.append,
        [(way, "side path" if lora == "none" else lora) for way, lora in ways],
    )
    lora = f"LoRA r{args.lora} (float32 factors, B ~ N(0, 0.02^2))" if args.lora else "no LoRA"
    print(
        f"{args.family} random model, hidden {args.hidden}, {args.layers} layers, vocab "
        f"{args.vocab}, {args.dtype}, {lora}, {n_threads} threads; {args.k} rows sharing one "
        f"{args.prompt}-token prompt, {args.new} new tokens each, greedy; ms/step from runs of "
        f"{half} and {args.new} new tokens (their difference over the extra steps), best of "
        f"{args.repeats} after the first call, the ways alternating\n"
    )
    print(
        markdown_table(
            [
                "decode",
                "LoRA",
                "first call s",
                "ms/step",
                "tokens/s",
                "speed vs eager",
                "tokens equal eager's",
                "aten operators per token",
            ],
            [
                [
                    *case,
                    f"{first[case]:.2f}",
                    f"{s * 1e3:.2f}",
                    f"{args.k / s:,.0f}",
                    f"**{seconds[0] / s:.2f}x**",
                    "yes" if outputs[case] == outputs[ways[0]] else "NO",
                    row[3],
                ]
                for case, s, row in zip(ways, seconds, operators)
            ],
        )
    )


if __name__ == "__main__":
    main()
