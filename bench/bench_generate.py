"""Tokens/s of model.generate against transformers' generate on the same random-weight checkpoint,
the same prompts and the same settings, in one run; prints the ratio for each case.

    python bench/bench_generate.py                      # every case, Qwen3-shaped
    python bench/bench_generate.py --case ragged        # one case
    python bench/bench_generate.py --family qwen2 --hidden 512 --layers 8
    python bench/bench_generate.py --family qwen3_5     # hybrid Gated DeltaNet + gated attention
    python bench/bench_generate.py --threads 1 --profile   # one thread; profile a missed target
    python bench/bench_generate.py --hidden 64 --ffn 128 --layers 1 --repeats 0 --new 8  # smoke

Cases (batch 8 each; targets from issue 15 as ratios of tokens/s):
  default  prompts of 36-64 tokens, 128 new tokens, greedy
  ragged   prompts of 48-69 tokens, 96 new tokens, greedy                      target >= 1.5x
  group    a GRPO group: one ~1,000-token prompt sampled 8 times, 128 new    target >= 2.5x
           tokens, temperature 1 (model.generate prefills the shared prompt once, keeps its K/V
           once; transformers gets the batch of 8 copies)

Both sides run in float32 on the CPU with the same torch thread count. No EOS is set and the new
tokens are forced to the same count, so both sides produce exactly batch x new tokens. Greedy
outputs are also compared token for token (greedy paths may part after a near-tie, since the two
implementations round differently); sampled outputs cannot be compared. On a machine shared with
other jobs, run with OMP_NUM_THREADS=1: two-thread runs then measure thread contention, not the
code.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import best_times, markdown_table, profile_table, threads, verdict  # noqa: E402

import model as M  # noqa: E402

CASES = {  # prompt lengths, new tokens, temperature, target ratio (None: no target)
    "default": (lambda: [64 - (i * 64) // 16 for i in range(8)], 128, 0.0, None),
    "ragged": (lambda: [48 + (i * 21) // 7 for i in range(8)], 96, 0.0, 1.5),
    "group": (lambda: [1000] * 8, 128, 1.0, 2.5),
}


def hf_config(args):
    import transformers

    shape = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=True,
    )
    if args.family == "qwen2":
        return transformers.Qwen2Config(**shape)
    if args.family == "qwen3_5":  # hybrid: three Gated DeltaNet layers per full-attention layer
        shape["rope_parameters"].update(rope_theta=1e7, partial_rotary_factor=0.25)
        heads = dict(
            linear_num_key_heads=args.heads // 2,
            linear_num_value_heads=args.heads,
            linear_key_head_dim=args.head_dim,
            linear_value_head_dim=args.head_dim,
        )
        return transformers.Qwen3_5TextConfig(
            **shape, **heads, head_dim=args.head_dim, full_attention_interval=4
        )
    return transformers.Qwen3Config(**shape, head_dim=args.head_dim)


def run_case(name, hf, ours, args) -> list:
    """Time both sides on one case; returns its table row."""
    lengths_of, new, temperature, goal = CASES[name]
    new = args.new or new
    lengths = lengths_of()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, args.vocab, (n,), generator=g).tolist() for n in lengths]
    if name == "group":
        prompts = [prompts[0]] * len(prompts)

    # transformers: left padding with an attention mask, its documented way to batch prompts
    T = max(lengths)
    input_ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, T - len(prompt) :] = torch.tensor(prompt)
        mask[i, T - len(prompt) :] = 1
    sampling = (
        dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        if temperature
        else dict(do_sample=False)
    )

    def run_hf():
        with torch.inference_mode():
            out = hf.generate(
                input_ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                eos_token_id=None,
                pad_token_id=0,
                **sampling,
            )
        return out[:, T:].tolist()

    def run_ours():
        return M.generate(ours, prompts, max_new_tokens=new, temperature=temperature, seed=0)

    (t_hf, t_ours), (out_hf, out_ours) = best_times([run_hf, run_ours], args.repeats)
    n = len(prompts) * new
    assert all(len(row) == new for row in out_ours + out_hf)
    agree = sum(a == b for ra, rb in zip(out_ours, out_hf) for a, b in zip(ra, rb)) / n
    met = goal is None or verdict(f"generate {name}", t_hf / t_ours, goal)
    if args.profile and not met:
        profile_table(run_ours, f"model.generate, case {name}")
    return [
        name,
        f"{min(lengths)}-{max(lengths)}",
        new,
        f"{temperature:g}" if temperature else "greedy",
        f"{n / t_hf:,.0f}",
        f"{n / t_ours:,.0f}",
        f"**{t_hf / t_ours:.2f}x**",
        "-" if goal is None else f">= {goal}x",
        "-" if temperature else f"{agree:.1%}",
    ]


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--case", choices=list(CASES) + ["all"], default="all")
    p.add_argument("--family", choices=["qwen2", "qwen3", "qwen3_5"], default="qwen3")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--new", type=int, help="new tokens in every case (default: each case's own; a quick check)"
    )
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--profile", action="store_true", help="profile our side of a case that misses its target"
    )
    args = p.parse_args()
    n_threads = threads(args.threads)

    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(args)).float().eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = M.Qwen.from_pretrained(tmp, dtype="float32")
    rows = [
        run_case(name, hf, ours, args) for name in (CASES if args.case == "all" else [args.case])
    ]
    print(
        f"\n{args.family} random model, {sum(p.numel() for p in ours.parameters()) / 1e6:.1f}M "
        f"params (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), float32, "
        f"{n_threads} threads, batch 8, best of {args.repeats} after a warm-up; transformers "
        f"{transformers.__version__}\n"
    )
    print(
        markdown_table(
            [
                "case",
                "prompt tokens",
                "new tokens",
                "sampling",
                "transformers tok/s",
                "ours tok/s",
                "ratio",
                "target",
                "greedy tokens equal",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
