"""Tokens/s of model.generate against transformers' generate on the same random-weight checkpoint,
the same prompts (different lengths) and the same greedy settings, in one run; prints the ratio.

    python bench/bench_generate.py                      # Qwen3-shaped, batch 8 x 128 new tokens
    python bench/bench_generate.py --family qwen2 --hidden 512 --layers 8
    python bench/bench_generate.py --family qwen3_5     # hybrid Gated DeltaNet + gated attention

Both sides run in float32 on the CPU with the same torch thread count. No EOS is set, so every row
produces exactly --new tokens on both sides. Outputs are also compared token for token (greedy
paths may part after a near-tie, since the two implementations round differently).
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import model as M  # noqa: E402


def hf_config(args):
    import transformers
    shape = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                 num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                 max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                 tie_word_embeddings=True)
    if args.family == "qwen2":
        return transformers.Qwen2Config(**shape)
    if args.family == "qwen3_5":  # hybrid: three Gated DeltaNet layers per full-attention layer
        shape["rope_parameters"].update(rope_theta=1e7, partial_rotary_factor=0.25)
        heads = dict(linear_num_key_heads=args.heads // 2, linear_num_value_heads=args.heads,
                     linear_key_head_dim=args.head_dim, linear_value_head_dim=args.head_dim)
        return transformers.Qwen3_5TextConfig(**shape, **heads, head_dim=args.head_dim, full_attention_interval=4)
    return transformers.Qwen3Config(**shape, head_dim=args.head_dim)


def best_times(fns, repeats):
    """Best wall time and output of each function; runs alternate so that load from other processes
    on a shared machine hits both sides alike. The first round is a warm-up."""
    best, outs = [float("inf")] * len(fns), [None] * len(fns)
    for r in range(repeats + 1):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            outs[i] = fn()
            if r > 0:
                best[i] = min(best[i], time.perf_counter() - start)
    return best, outs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=["qwen2", "qwen3", "qwen3_5"], default="qwen3")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--prompt", type=int, default=64, help="longest prompt; the others are shorter")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import transformers
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(args)).float().eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = M.Qwen.from_pretrained(tmp, dtype="float32")
    g = torch.Generator().manual_seed(1)
    lengths = [args.prompt - (i * args.prompt) // (2 * args.batch) for i in range(args.batch)]
    prompts = [torch.randint(0, args.vocab, (n,), generator=g).tolist() for n in lengths]

    # transformers: left padding with an attention mask, its documented way to batch prompts
    T = max(lengths)
    input_ids = torch.zeros(args.batch, T, dtype=torch.long)
    mask = torch.zeros(args.batch, T, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, T - len(prompt):] = torch.tensor(prompt)
        mask[i, T - len(prompt):] = 1

    def run_hf():
        with torch.inference_mode():
            out = hf.generate(input_ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[:, T:].tolist()

    def run_ours():
        return M.generate(ours, prompts, max_new_tokens=args.new, temperature=0)

    (t_hf, t_ours), (out_hf, out_ours) = best_times([run_hf, run_ours], args.repeats)
    n = args.batch * args.new
    assert all(len(row) == args.new for row in out_ours + out_hf)
    agree = sum(a == b for ra, rb in zip(out_ours, out_hf) for a, b in zip(ra, rb)) / n
    params = sum(p.numel() for p in ours.parameters())
    print(f"{args.family} random model, {params / 1e6:.1f}M params, float32, {torch.get_num_threads()} threads; "
          f"batch {args.batch}, prompts {min(lengths)}-{max(lengths)} tokens, {args.new} new tokens, greedy")
    print(f"transformers {transformers.__version__}: {t_hf:.2f} s  {n / t_hf:8.1f} tokens/s")
    print(f"model.py:               {t_ours:.2f} s  {n / t_ours:8.1f} tokens/s")
    print(f"ratio (ours / transformers tokens/s): {t_hf / t_ours:.2f}x   greedy tokens equal: {agree:.1%}")


if __name__ == "__main__":
    main()
