"""model.generate's decode step on GRPO's path (K rows continuing one shared prompt, a SharedPrefix)
in one run on the CPU (issue 50): eager, static (`decode="static"`: the same step with fixed shapes
and in-place writes, what a CUDA graph captures on a GPU; on the CPU it runs as is) and compiled
(`decode="compiled"`: torch.compile of the static step, Inductor's C++ kernels on the CPU).

    python bench/bench_decode.py                  # Qwen3-shaped, 8 rows, 512-token prompt, 128 new
    python bench/bench_decode.py --family qwen3_5 # hybrid Gated DeltaNet + gated attention
    python bench/bench_decode.py --new 8 --layers 1 --repeats 0        # a smoke test

The model: a random Qwen3 (hidden 256, 4 layers, vocab 8,192, as bench_generate.py's) in float32.
Greedy, no EOS: every row decodes --new tokens. Reported per way: the seconds of its first call
(warm-up: for compiled, the compilation), the decode step's ms and tokens/s (the difference of runs
of --new / 2 and --new tokens over the extra steps, so the prefill cancels; the three ways
alternating, best of --repeats), the speed against eager, whether the tokens equal eager's, and
the aten operators per decoded token from torch.profiler (bench/gpu.py's `launches`: the
difference of two profiled runs over their extra steps; a compiled step's fused kernels are not
aten operators, its matrix products are).
"""

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import best_times, markdown_table, qwen3_shape, threads  # noqa: E402
from gpu import launches  # noqa: E402

import model as M  # noqa: E402

WAYS = ("eager", "static", "compiled")


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
    model.eval()
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, args.vocab, (args.prompt,), generator=g).tolist()] * args.k

    def run(way, new=args.new):
        return M.generate(model, rows, new, temperature=0, decode=way)

    first, outputs = {}, {}
    half = args.new // 2
    for way in WAYS:
        start = time.perf_counter()
        outputs[way] = run(way)
        first[way] = time.perf_counter() - start
        run(way, half)  # compiled: the other cache size's graph too
    times, _ = best_times(
        [lambda way=way, n=n: run(way, n) for way in WAYS for n in (half, args.new)], args.repeats
    )
    # the decode steps alone: the prefill and the first steps cancel
    seconds = [(full - part) / (args.new - half) for part, full in zip(times[::2], times[1::2])]
    operators = []
    launches(
        model,
        SimpleNamespace(k=args.k, decode_prompt=args.prompt, launch_steps=8, compiled=True),
        torch.device("cpu"),
        operators.append,
    )
    print(
        f"{args.family} random model, hidden {args.hidden}, {args.layers} layers, vocab "
        f"{args.vocab}, float32, {n_threads} threads; {args.k} rows sharing one "
        f"{args.prompt}-token prompt, {args.new} new tokens each, greedy; ms/step from runs of "
        f"{half} and {args.new} new tokens (their difference over the extra steps), best of "
        f"{args.repeats} after the first call, the three ways alternating\n"
    )
    print(
        markdown_table(
            [
                "decode",
                "first call s",
                "ms/step",
                "tokens/s",
                "speed vs eager",
                "tokens equal eager's",
                "aten operators per token",
            ],
            [
                [
                    way,
                    f"{first[way]:.2f}",
                    f"{s * 1e3:.2f}",
                    f"{args.k / s:,.0f}",
                    f"**{seconds[0] / s:.2f}x**",
                    "yes" if outputs[way] == outputs["eager"] else "NO",
                    row[2],
                ]
                for way, s, row in zip(WAYS, seconds, operators)
            ],
        )
    )


if __name__ == "__main__":
    main()
