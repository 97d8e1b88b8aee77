"""Decode throughput of model.generate on a GPU against the memory-bandwidth roofline.

    python bench/bench_generate_gpu.py                 # Qwen3-8B shape, bf16, batch 64
    python bench/bench_generate_gpu.py --shape qwen3.5-9b   # hybrid Gated DeltaNet + gated attention
    python bench/bench_generate_gpu.py --tiny          # a tiny shape on the CPU: checks the script

A random-weight model of the chosen shape is built directly on the device (no checkpoint). Each
decode step must read every weight once plus, per row, the KV cache of the attention layers and
(hybrid) read and write the float32 recurrent state of each Gated DeltaNet layer, so at batch B
the roofline is B / (bytes moved per step / bandwidth) tokens/s. Bandwidth is
measured with a device-to-device copy; the report gives the fraction of that roofline reached.
Decode time is the generate time minus a prefill-only run (max_new_tokens=1) of the same prompts.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import model as M  # noqa: E402

SHAPES = {  # Hugging Face config fields
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rope_theta=1e6, tie_word_embeddings=False),
    "qwen3.5-9b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                       num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                       linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_num_key_heads=16, linear_num_value_heads=32, full_attention_interval=4,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
                       tie_word_embeddings=False),
    "tiny": dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6, tie_word_embeddings=False),
    "tiny-hybrid": dict(model_type="qwen3_5_text", vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=4, rope_theta=1e7, tie_word_embeddings=False),
}


def random_model(raw: dict, dtype, device) -> M.Qwen:
    with torch.device("meta"):
        model = M.Qwen(M.QwenConfig.from_dict(raw, "shape"))
    model.to(dtype).to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norm weights
            else:
                p.normal_(0, 0.02)
    return model.eval()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device, nbytes=1 << 30):
    """Bytes moved per second by a large device-to-device copy (read + write)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * 10 / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="qwen3-8b")
    p.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU in float32, small batch")
    p.add_argument("--hybrid", action="store_true", help="with --tiny: the tiny hybrid (Qwen3.5) shape")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=256)
    args = p.parse_args()
    if args.tiny:
        args.shape, args.batch, args.prompt, args.new = "tiny-hybrid" if args.hybrid else "tiny", 4, 16, 8
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    torch.manual_seed(0)
    model = random_model(SHAPES[args.shape], dtype, device)
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(args.batch)]

    def run(new):
        sync(device)
        start = time.perf_counter()
        out = M.generate(model, prompts, max_new_tokens=new, temperature=1.0, top_p=0.95, seed=0)
        sync(device)
        return time.perf_counter() - start, out

    run(2)  # warm-up
    t_prefill, _ = run(1)
    t_total, out = run(args.new)
    steps = args.new - 1
    decoded = sum(len(o) - 1 for o in out)
    t_decode = t_total - t_prefill
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes -= cfg.vocab_size * cfg.hidden_size * model.model.embed_tokens.weight.element_size()  # a lookup
    n_full = cfg.layer_types.count("full_attention")
    kv_per_token = 2 * n_full * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8
    mean_context = args.prompt + args.new / 2
    state_bytes = (len(cfg.layer_types) - n_full) * cfg.linear_v_heads * cfg.linear_k_dim * cfg.linear_v_dim * 4
    row_bytes = mean_context * kv_per_token + 2 * state_bytes  # the recurrent state is read and written
    step_bytes = weight_bytes + args.batch * row_bytes
    bandwidth = copy_bandwidth(device)
    roofline = args.batch / (step_bytes / bandwidth)
    achieved = decoded / t_decode
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{args.shape} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params, {dtype}) on {name}; "
          f"batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, {steps} decode steps")
    print(f"prefill {t_prefill:.2f} s; decode {t_decode:.2f} s = {achieved:,.0f} tokens/s "
          f"({t_decode / steps * 1e3:.1f} ms/step)")
    print(f"bytes/step {step_bytes / 1e9:.2f} GB (weights {weight_bytes / 1e9:.2f}, KV at mean context "
          f"{args.batch * mean_context * kv_per_token / 1e9:.2f}, recurrent state "
          f"{args.batch * 2 * state_bytes / 1e9:.2f}); "
          f"measured copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"roofline {roofline:,.0f} tokens/s; achieved {achieved / roofline:.1%} of it")


if __name__ == "__main__":
    main()
