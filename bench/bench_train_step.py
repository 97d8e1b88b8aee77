"""One training micro-step, the forward and backward of a token-weighted loss through
model.token_logprobs to the LoRA's gradients, with each of issue 60's training speed settings, in
one run on the CPU: the default (the float32 LoRA side path), `lora.compute: model` (the factors
cast to the base's dtype, one fused product), `compile` (Qwen.compile_layers: each layer through
torch.compile) and both.

    python bench/bench_train_step.py                 # bfloat16 base, hidden 256, 4 layers, 4 x 256
    python bench/bench_train_step.py --dtype float32 # lora.compute: model is the default's math
    python bench/bench_train_step.py --layers 1 --length 32 --repeats 0      # a smoke test

The model: a random Qwen3 (vocab 8,192, weights N(0, 0.02^2)) with a LoRA r16 on every projection
(B ~ N(0, 0.02^2), so its delta counts). Reported per setting: the seconds of its first step
(for compile, the compilation), the ms of a step (best of --repeats after it, the settings
alternating), the speed against the default, and how far its loss and its LoRA gradients (all
together) lie from a float32 oracle (the same weights, computed in float32 throughout), relative;
the default's own gap is the base dtype's rounding. On a CPU, bfloat16 matrix products are no
faster than float32 ones, and Inductor's kernels are C++: what the settings buy on a GPU is for
bench/gpu.sh to measure.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import best_times, markdown_table, qwen3_shape, threads  # noqa: E402

import model as M  # noqa: E402

SETTINGS = [  # (name, lora.compute, compile)
    ("default", "float32", False),
    ("lora.compute: model", "model", False),
    ("compile", "float32", True),
    ("both", "model", True),
]


def policy(args, dtype: torch.dtype, compute: str) -> M.Qwen:
    """The benchmark's model and LoRA, the same weights on every call."""
    torch.manual_seed(0)
    model = M.Qwen(M.QwenConfig.from_dict(qwen3_shape(args.vocab, args.hidden, args.layers, True)))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.to(dtype).train()
    M.add_lora(model, 16, 32, compute=compute)
    with torch.no_grad():
        for m in M.lora_modules(model).values():
            m.lora_B.normal_(0, 0.02)
    return model


def step(model: M.Qwen, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss and the LoRA gradients, flattened into one vector."""
    weights = torch.linspace(0.1, 1.0, ids.shape[1] - 1).expand(ids.shape[0], -1)
    loss = -(weights * M.token_logprobs(model, ids)).sum() / weights.sum()
    factors = [p for m in M.lora_modules(model).values() for p in (m.lora_A, m.lora_B)]
    return loss.detach(), torch.cat([g.flatten() for g in torch.autograd.grad(loss, factors)])


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dtype", choices=list(M.DTYPES), default="bfloat16")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    n_threads = threads(args.threads)
    dtype = M.DTYPES[args.dtype]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.length), generator=g)
    oracle_loss, oracle = step(policy(args, dtype, "float32").float(), ids)
    models, first, gaps = [], [], []
    for _, compute, compiled in SETTINGS:
        model = policy(args, dtype, compute)
        if compiled:
            model.compile_layers()
        start = time.perf_counter()
        loss, grads = step(model, ids)
        first.append(time.perf_counter() - start)
        gaps.append(
            (
                abs(loss - oracle_loss).item() / abs(oracle_loss).item(),
                ((grads - oracle).norm() / oracle.norm()).item(),
            )
        )
        models.append(model)
    times, _ = best_times([lambda m=m: step(m, ids) for m in models], args.repeats)
    print(
        f"qwen3 random model, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
        f"{args.dtype} base, LoRA r16 (float32 factors), {n_threads} threads; one micro-step of "
        f"{args.batch} x {args.length} tokens (forward and backward to the LoRA's gradients), "
        f"best of {args.repeats} after the first, the settings alternating; gaps relative to a "
        f"float32 oracle of the same weights\n"
    )
    print(
        markdown_table(
            ["setting", "first step s", "ms/step", "speed vs default", "loss gap", "gradient gap"],
            [
                [
                    name,
                    f"{f:.2f}",
                    f"{t * 1e3:.1f}",
                    f"**{times[0] / t:.2f}x**",
                    f"{loss_gap:.1e}",
                    f"{grad_gap:.1e}",
                ]
                for (name, _, _), f, t, (loss_gap, grad_gap) in zip(SETTINGS, first, times, gaps)
            ],
        )
    )


if __name__ == "__main__":
    main()
