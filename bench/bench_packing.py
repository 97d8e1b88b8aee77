"""Padded against packed training micro-batches (issue 50), in one run on the CPU: one GRPO update's
training (grpo.policy_update: the reference pass, the policy pass and backward, AdamW) on the same
sequences, right-padded in micro-batches of --micro-batch rows in group order (grpo.py's default,
`loss.micro_batch_size`) and packed into micro-batches of at most as many tokens as a padded one can
hold (grpo.packed_micro_batches, `loss.micro_batch_tokens`).

    python bench/bench_packing.py                 # 4 prompts x 8, 128-token prompts, up to 512 new
    python bench/bench_packing.py --new 64 --layers 1 --repeats 0     # a smoke test

The sequences are bench/gpu.py's grpo_sequences: completions of lengths uniform in [new / 16, new]
(reasoning completions spread widely within a group), random tokens and advantages. The model: a
random Qwen3 (hidden 256, 4 layers, vocab 1,024, as bench_grpo.py's) in float32 with a LoRA of rank
16 on every projection, KL weight 0.04. Reported: the update's tokens, the positions each way
computes (padding included) and their padding share, the time of an update (the two ways
alternating, best of --repeats after a warm-up) and the packed one's speed-up.
"""

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import best_times, markdown_table, qwen3_shape, threads  # noqa: E402
from gpu import computed_tokens, grpo_sequences  # noqa: E402

import distributed as D  # noqa: E402
import grpo  # noqa: E402
import model as M  # noqa: E402
import train as T  # noqa: E402


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=512, help="completions: up to this many tokens")
    p.add_argument("--micro-batch", type=int, default=8, help="padded rows per micro-batch")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    n_threads = threads(args.threads)
    torch.manual_seed(0)
    model = M.Qwen(M.QwenConfig.from_dict(qwen3_shape(args.vocab, args.hidden, args.layers, False)))
    M.add_lora(model, 16, 32)
    cfg = grpo.GRPOConfig(output_dir="", train_data=[], model=grpo.ModelSettings(path=""))
    optimizer = T.build_optimizer(model, cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.betas)
    ranks = D.Ranks(0, 1, torch.device("cpu"))
    shape = SimpleNamespace(prompt=args.prompt, grpo_new=args.new, k=args.k)
    sequences = grpo_sequences(model, shape, args.prompts, seed=7)
    budget = args.micro_batch * (args.prompt + args.new)
    sides = {
        "padded": grpo.micro_batches(sequences, args.micro_batch, 0, "cpu"),
        "packed": grpo.packed_micro_batches(sequences, budget, "cpu"),
    }
    seconds, _ = best_times(
        [lambda b=b: grpo.policy_update(model, optimizer, b, cfg, ranks) for b in sides.values()],
        args.repeats,
    )
    tokens = sum(len(s.ids) for s in sequences)
    lengths = sorted(len(s.ids) - args.prompt for s in sequences)
    print(
        f"one GRPO update's training: {args.prompts} prompts x {args.k} completions, "
        f"{args.prompt}-token prompts, completions of {lengths[0]}-{lengths[-1]} tokens (uniform "
        f"in [{args.new // 16}, {args.new}]); hidden {args.hidden}, {args.layers} layers, vocab "
        f"{args.vocab}, LoRA r16, beta {cfg.loss.beta}, float32, {n_threads} threads, "
        f"{f'best of {args.repeats} after a warm-up' if args.repeats else 'one run each'}, the "
        f"two ways alternating\n"
    )
    rows = []
    for (name, batches), s in zip(sides.items(), seconds):
        computed = computed_tokens(batches)
        size = f"<= {budget:,} tokens" if name == "packed" else f"{args.micro_batch} rows"
        rows.append(
            [
                name,
                f"{len(batches)} x {size}",
                f"{tokens:,}",
                f"{computed:,}",
                f"{1 - tokens / computed:.1%}",
                f"{s:.3f}",
                f"{tokens / s:,.0f}",
                f"**{seconds[0] / s:.2f}x**",
            ]
        )
    print(
        markdown_table(
            [
                "batches",
                "micro-batches",
                "tokens",
                "computed",
                "padding",
                "train s",
                "tokens/s",
                "speed vs padded",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
