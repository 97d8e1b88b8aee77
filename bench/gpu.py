"""One run on one H100 or H200 that answers for the GPU node (issue 50; issue 15's measurements
remain as --sections): a Qwen3-8B-shaped random-weight model in bfloat16 (--shapes adds
Qwen3.5-9B), with flash-attn, flash-linear-attention and vLLM used where they import and each row
saying what it ran with. The default sections, in this order:

  decode    GRPO's decode path: K = 8 rows continuing one shared 1,024-token prompt (a
            SharedPrefix), the policy with its LoRA, sampled at temperature 1: ms/step and
            tokens/s of model.generate, eager and static (`decode="static"`: one CUDA graph per
            step), each with the LoRA on its side path and merged (model.lora_merged, what
            GRPO's rollouts decode with), then static merged over 1,024 new tokens, each
            against the HBM roofline: a step
            reads every weight once, the prompt's K/V once and each row's own K/V (and, hybrid,
            each row's float32 DeltaNet state, read and written), so at most K x bandwidth / bytes
            per step tokens/s (nominal bandwidth, and a measured device copy's); --compiled adds
            `decode="compiled"` (torch.compile: minutes of compilation on an 8B model);
  packing   one GRPO update's training (reference pass, policy pass and backward, AdamW) on 4
            prompts x 8 completions of 512 + 64..1,024 tokens, right-padded in micro-batches of 8
            rows (grpo.py's default) and packed in micro-batches of at most as many tokens: the
            padding share, tokens/s and MFU;
  fsdp      full-parameter GRPO at world size 1 (FSDP2, float32 master weights, its frozen
            reference) on a Qwen3-4B shape, one update: tokens/s, MFU, peak memory; then the save
            a full-parameter vLLM sync runs before the server reloads (checkpoint.save_model of the
            sharded policy: every weight gathered and written as safetensors), GB/s;
  launches  launches per decoded token on the decode section's path from torch.profiler: the
            host's CUDA launch calls and the GPU kernels recorded, eager and static, the LoRA
            on its side path and merged (last:
            profiling CUDA graphs is what most likely breaks a CUDA context).

Each section is written to OUT_DIR/gpu_results.md as it is measured, row by row (each row also
printed with the seconds since the start), so a run cut short keeps what it measured; a section
that fails is marked so and the run goes on (then exits 1). Sized to finish in about 3 minutes on
an H200 after start-up (from issue 15's run: eager decode about 0.1 s a step, a GRPO update's
training about 10 s).

    bash bench/gpu.sh OUT_DIR          # on the GPU node: writes OUT_DIR/gpu_results.md
    bash bench/gpu.sh OUT_DIR --shapes qwen3-8b qwen3.5-9b --compiled    # more: about 10 minutes
    bash bench/gpu.sh OUT_DIR --sections batch-decode capacity sft grpo-update
                                       # issue 15's: decode at batch 64 on unique prompts, the
                                       # largest batch that fits, an SFT step (LoRA r16, activation
                                       # checkpointing), a GRPO update with its generation
    python bench/gpu.py --paper        # on paper (no GPU needed): the roofline for H100 and H200,
                                       # the per-GPU memory of full-parameter GRPO, and the
                                       # largest Qwen3 that fits on 1, 2 and 4 nodes (docs/fsdp.md)
    bash bench/gpu.sh OUT_DIR --tiny   # tiny shapes on the CPU: checks the script (test_bench.py)
    bash bench/gpu.sh OUT_DIR --vllm-python /venvs/vllm/bin/python
                                       # adds the rollout comparison: model.generate and a vLLM
                                       # server serving the same weights, tokens/s and log-prob gap

Model FLOPs of a token: 2N forward (N: the weights it is multiplied by; lm_head only where a
log-probability is read, the embedding lookup never) and 2N more in backward (the base is frozen:
gradients flow to the activations, LoRA's own are negligible; a full-parameter step adds 2N for the
layers' weight gradients), plus attention's 2 T H D per full-attention layer forward (causal, T the
sequence length) and twice that backward. Only real tokens count: a padded batch's padding is
work, not model FLOPs. Recomputation under activation checkpointing and the Gated DeltaNet
recurrence are not counted. Peak dense bf16: 989 TFLOP/s (H100 SXM, H200); HBM: 3.35 TB/s (H100
SXM), 4.8 TB/s (H200). On the CPU (--tiny) there is no allocator peak to read: the cache
arithmetic stands in for it (capacity), and the launches are aten operator calls.
"""

import argparse
import contextlib
import importlib.util
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import markdown_table  # noqa: E402
from instruments import VLLMServer

import distributed as D  # noqa: E402
import grpo  # noqa: E402
import model as M  # noqa: E402
import sft  # noqa: E402
import train as T
from tokenizer import load_tokenizer  # noqa: E402
from vllm_engine import (
    VLLMEngine,
    VLLMSettings,  # noqa: E402
)

SHAPES = {  # Hugging Face config fields
    "qwen3-8b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1e6,
        tie_word_embeddings=False,
    ),
    "qwen3.5-9b": dict(
        model_type="qwen3_5_text",
        vocab_size=248320,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        full_attention_interval=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
    ),
}
TINY = {  # the same families in miniature, for --tiny
    "qwen3-8b": dict(
        SHAPES["qwen3-8b"],
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "qwen3.5-9b": dict(
        SHAPES["qwen3.5-9b"],
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
}
GPUS = {"H100": (3.35e12, 989e12), "H200": (4.8e12, 989e12)}  # SXM: HBM bytes/s, dense bf16 FLOP/s


def random_model(raw: dict, dtype, device) -> M.Qwen:
    with torch.device("meta"):
        model = M.Qwen(M.QwenConfig.from_dict(raw, "shape"))
    if device.type == "meta":
        return model.to(dtype)
    model.to(dtype).to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0, 0.02)  # norms (and DeltaNet gates) at 1
    return model.eval()


def matmul_params(model: M.Qwen) -> tuple[int, int]:
    """(weights the layers multiply a token by, lm_head weights)."""
    body = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, nn.Linear))
    return body, model.head_weight().numel()


def step_bytes(model: M.Qwen, batch: int, context: float, shared: int = 0) -> tuple[float, float]:
    """(weight bytes, total bytes) one decode step reads at `batch` rows of `context` tokens of
    their own after `shared` prompt tokens they all continue (a GRPO group's SharedPrefix, read
    once): every weight but the embedding (a lookup, unless tied to lm_head), the K and V of every
    token, and each row's float32 DeltaNet state read and written (the conv state, 3 columns, is
    left out)."""
    cfg, size = model.config, model.dtype.itemsize
    weights = sum(p.numel() for p in model.parameters()) * size
    weights -= 0 if model.lm_head is None else model.model.embed_tokens.weight.numel() * size
    n_full = cfg.layer_types.count("full_attention")
    kv_per_token = 2 * n_full * cfg.num_kv_heads * cfg.head_dim * size
    state = (
        (len(cfg.layer_types) - n_full)
        * cfg.linear_v_heads
        * cfg.linear_k_dim
        * cfg.linear_v_dim
        * 4
    )
    return weights, weights + kv_per_token * (batch * context + shared) + batch * 2 * state


def model_flops(
    model: M.Qwen, lengths: list[int], head_tokens: int, backward: bool, weight_grads=False
) -> float:
    body, head = matmul_params(model)
    cfg = model.config
    attention = sum(2 * n * n * cfg.num_heads * cfg.head_dim for n in lengths)
    attention *= cfg.layer_types.count("full_attention")
    passes = 1 + backward  # forward, and backward to the activations
    flops = passes * 2 * (body * sum(lengths) + head * head_tokens) + (3 if backward else 1) * (
        attention
    )
    return flops + (2 * body * sum(lengths) if weight_grads else 0)


def paper_table(batch: int, context: float) -> str:
    rows = []
    for shape, raw in SHAPES.items():
        model = random_model(raw, torch.bfloat16, torch.device("meta"))
        weights, total = step_bytes(model, batch, context)
        for gpu, (bandwidth, _) in GPUS.items():
            rows.append(
                [
                    shape,
                    gpu,
                    batch,
                    f"{context:g}",
                    f"{weights / 1e9:.2f}",
                    f"{(total - weights) / 1e9:.2f}",
                    f"{total / 1e9:.2f}",
                    f"{total / bandwidth * 1e3:.2f}",
                    f"{batch * bandwidth / total:,.0f}",
                ]
            )
    return markdown_table(
        [
            "shape",
            "GPU",
            "batch",
            "mean context",
            "weights GB",
            "KV + state GB",
            "bytes/step GB",
            "ms/step",
            "roofline tokens/s",
        ],
        rows,
    )


def recomputed_layer_bytes(cfg: M.QwenConfig) -> int:
    """Bytes per token that autograd saves in one forward of a Qwen3 decoder layer (model.Block)
    in a 16-bit dtype with every weight trainable: what a checkpointed layer holds while its
    backward runs (tests/test_bench.py measures it with saved_tensors_hooks). Each RMSNorm keeps
    its float32 input, its float32 1/rms and its 16-bit normalized input (for the weight's
    gradient); each projection its input (q, k and v share one, gate and up another); q_norm and
    k_norm the same per head; attention q, k, v, its output and its float32 log-sum-exp per head;
    the SwiGLU gate, its SiLU, up and their product. RoPE keeps nothing (its tables need no
    gradient); the layer's input is the checkpoint's, counted once per layer elsewhere. Gated
    DeltaNet layers are not counted here."""
    if "linear_attention" in cfg.layer_types:
        raise ValueError("recomputed_layer_bytes: Gated DeltaNet layers are not counted")
    d, ffn, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    H, Hkv = cfg.num_heads, cfg.num_kv_heads
    norms = 2 * (4 * d + 4 + 2 * d)  # input_layernorm, post_attention_layernorm
    projection_inputs = 2 * 2 * d  # the two norms' outputs
    qk_norms = (4 + 2) * (H + Hkv) * D + 4 * (H + Hkv)
    attention = 2 * (H + 2 * Hkv) * D + 2 * H * D + 4 * H  # q, k, v; output; log-sum-exp
    mlp = 4 * 2 * ffn
    return norms + projection_inputs + qk_norms + attention + mlp


# The memory a GPU loses before any tensor: the CUDA context with PyTorch's kernels and cuBLAS
# workspaces, and NCCL's buffers (NCCL_BUFFSIZE, 4 MiB by default per channel and peer in NCCL's
# environment-variable documentation, times up to 32 channels over NVLink, more with NVLink SHARP).
# An assumed planning margin, not measured here (no GPU): replace it with a node's
# torch.cuda.mem_get_info() total - free - memory_reserved() after the first collective.
CUDA_NCCL_OVERHEAD = 3e9
# The memory CUDA reports (torch.cuda.get_device_properties().total_memory): H100 SXM 80 GB, H200.
HBM = {"H100 80GB": 79.6 * 2**30, "H200 141GB": 139.8 * 2**30}
USABLE = 0.95  # the share of a GPU a plan may fill: the caching allocator fragments the rest
QWEN3 = {  # the released Qwen3 dense sizes, their config.json shapes
    name: dict(SHAPES["qwen3-8b"], **shape)
    for name, shape in {
        "qwen3-0.6b": dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            tie_word_embeddings=True,
        ),
        "qwen3-1.7b": dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            tie_word_embeddings=True,
        ),
        "qwen3-4b": dict(
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=36,
            tie_word_embeddings=True,
        ),
        "qwen3-8b": {},
        "qwen3-14b": dict(
            hidden_size=5120,
            intermediate_size=17408,
            num_hidden_layers=40,
            num_attention_heads=40,
        ),
        "qwen3-32b": dict(
            hidden_size=5120,
            intermediate_size=25600,
            num_hidden_layers=64,
            num_attention_heads=64,
        ),
    }.items()
}


def memory_parts(raw: dict, ranks: int, rows: int, prompt: int, new: int, micro_batch: int):
    """Per-GPU memory of full-parameter GRPO (`finetune: full`, fsdp.py) on `ranks` GPUs, one group
    of `rows` samples per GPU, as (always held, rollout, training, vLLM) lists of (what, bytes):
    float32 master weights, gradients and AdamW moments sharded over the ranks; the frozen embedding
    and lm_head whole in bf16 (shared with the reference); the reference sharded in bf16; CUDA and
    NCCL's own memory. A local rollout holds the bf16 copy of everything but embedding and lm_head
    (fsdp.gathered) and the KV cache (the prompt once, each row's `new` slots). Training holds
    FSDP's buffers (two layers all-gathered in bf16, one layer's float32 gradients before the
    reduce-scatter) and the activations of a micro-batch of `micro_batch` sequences under gradient
    checkpointing: each layer's bf16 input, one recomputed layer (`recomputed_layer_bytes`), the
    final norm's saved tensors, what HeadLogprobs keeps of each completion token (its hidden state
    and the two gradients of the first pass, log-prob and entropy) and one lm_head chunk of 1,024
    positions (float32 logits and softmax, their bf16 gradient). The head's part and the recomputed
    layer never coexist (the head's backward runs first): summing them is an upper bound. A vLLM
    server on the same GPU (tensor parallel 1, no sleep mode) holds its own bf16 copy of every
    weight, the same KV cache and its own CUDA context for the whole run. Rollout and training never
    overlap."""
    model = random_model(raw, torch.bfloat16, torch.device("meta"))
    cfg = model.config
    frozen = sum(
        {id(p): p.numel() for p in (model.model.embed_tokens.weight, model.head_weight())}.values()
    )
    total = sum(p.numel() for p in model.parameters())
    trained = total - frozen
    layer = max(sum(p.numel() for p in block.parameters()) for block in model.model.layers)
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * (prompt + rows * new)
    tokens, d = micro_batch * (prompt + new), cfg.hidden_size
    activations = tokens * (2 * d * cfg.num_layers + recomputed_layer_bytes(cfg) + 6 * d + 4)
    activations += micro_batch * new * 3 * 2 * d + 1024 * cfg.vocab_size * (4 + 4 + 2)
    held = [
        (
            "parameters: float32 shards + bf16 embedding and lm_head",
            4 * trained / ranks + 2 * frozen,
        ),
        ("gradients: float32 shards", 4 * trained / ranks),
        ("AdamW moments: float32 shards", 8 * trained / ranks),
        ("reference: bf16 shards", 2 * trained / ranks),
        ("CUDA context and NCCL buffers (assumed)", CUDA_NCCL_OVERHEAD),
    ]
    rollout = [
        ("rollout copy: bf16, unsharded", 2 * trained),
        (f"KV cache: {rows} rows, {prompt} + {new} tokens", kv),
    ]
    training = [
        ("FSDP buffers (training): 2 bf16 layers + 1 float32 layer", 8 * layer),
        (f"activations: {micro_batch} x {prompt + new} tokens, checkpointed", activations),
    ]
    vllm = [
        ("vLLM: bf16 weights, unsharded", 2 * total),
        ("vLLM: KV cache", kv),
        ("vLLM: its CUDA context (assumed)", CUDA_NCCL_OVERHEAD),
    ]
    return held, rollout, training, vllm, (trained, frozen)


def peaks(raw: dict, ranks: int, **sizes) -> tuple[float, float]:
    """(per-GPU peak with local rollouts, with a vLLM server beside the trainer) in bytes."""
    held, rollout, training, vllm, _ = memory_parts(raw, ranks, **sizes)
    base, train = sum(b for _, b in held), sum(b for _, b in training)
    return base + max(sum(b for _, b in rollout), train), base + train + sum(b for _, b in vllm)


def memory_plan(shape: str, ranks: int, **sizes) -> str:
    held, rollout, training, vllm, (trained, frozen) = memory_parts(QWEN3[shape], ranks, **sizes)
    local, beside = peaks(QWEN3[shape], ranks, **sizes)
    gb = 1e9
    rows = [[name, f"{b / gb:.1f}"] for name, b in held + rollout + training + vllm]
    rows += [
        ["**peak in a rollout**", f"**{sum(b for _, b in held + rollout) / gb:.1f}**"],
        ["**peak in training**", f"**{sum(b for _, b in held + training) / gb:.1f}**"],
        ["**peak with vLLM rollouts (training + vLLM)**", f"**{beside / gb:.1f}**"],
    ]
    assert abs(local - max(sum(b for _, b in held + part) for part in (rollout, training))) < 1
    return (
        f"{shape}: {trained / 1e9:.2f}B trained + {frozen / 1e9:.2f}B frozen parameters, "
        f"{ranks} GPUs\n\n"
    ) + markdown_table(["per GPU", "GB"], rows)


def fit_table(**sizes) -> str:
    """The largest Qwen3 whose per-GPU peak fits in USABLE of each GPU at 1, 2 and 4 nodes of 8,
    with local and with vLLM rollouts (vLLM's gpu_memory_utilization: its share of the GPU)."""
    out = []
    for nodes in (1, 2, 4):
        for gpu, capacity in HBM.items():
            row = [nodes, 8 * nodes, gpu]
            for vllm in (False, True):
                fits = [
                    (name, peak)
                    for name, raw in QWEN3.items()
                    if (peak := peaks(raw, 8 * nodes, **sizes)[vllm]) <= USABLE * capacity
                ]
                name, peak = fits[-1] if fits else ("none", 0.0)
                row += [name, f"{peak / 1e9:.1f}"]
                if vllm:
                    share = sum(b for _, b in memory_parts(QWEN3[name], 8 * nodes, **sizes)[3])
                    row.append(f"{share / capacity:.2f}" if fits else "-")
            out.append(row)
    return markdown_table(
        [
            "nodes",
            "GPUs",
            "GPU",
            "largest, local rollouts",
            "its peak GB",
            "largest, vLLM rollouts",
            "its peak GB",
            "vLLM gpu_memory_utilization",
        ],
        out,
    )


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def copy_bandwidth(device, nbytes=1 << 30) -> float:
    """Bytes moved per second (read + write) by a large device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds, _ = timed(lambda: [dst.copy_(src) for _ in range(10)], device)
    return 2 * src.nbytes * 10 / seconds


def prompts(model: M.Qwen, n: int, length: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (n, length), generator=g).tolist()


def decode(model, args, device, bandwidths: dict) -> list[list]:
    batch = prompts(model, args.batch, args.prompt)

    def run(new):
        return timed(
            lambda: M.generate(model, batch, max_new_tokens=new, temperature=1.0, seed=0), device
        )[0]

    run(2)  # warm-up
    prefill, total = run(1), run(args.new)
    steps = args.new - 1
    tokens_per_s = args.batch * steps / (total - prefill)
    _, nbytes = step_bytes(model, args.batch, args.prompt + args.new / 2)
    return [
        [
            args.batch,
            f"{args.prompt} + {args.new}",
            f"{prefill:.2f}",
            f"{(total - prefill) / steps * 1e3:.1f}",
            f"{tokens_per_s:,.0f}",
            f"{nbytes / 1e9:.2f}",
            name,
            f"{args.batch * bw / nbytes:,.0f}",
            f"{tokens_per_s / (args.batch * bw / nbytes):.1%}",
        ]
        for name, bw in bandwidths.items()
    ]


def capacity(model, args, device) -> list[list]:
    """Peaks of generate runs that allocate the full cache of prompt + new slots but stop after a
    few steps (every token an EOS); the largest batch is predicted from two of them, then run (down
    10% per out-of-memory, 3 tries)."""
    eos = range(model.config.vocab_size)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())

    def peak(n: int) -> float:
        batch = prompts(model, n, args.prompt, seed=n)
        if device.type != "cuda":
            M.generate(model, batch, args.new, temperature=1.0, seed=0, eos_token_ids=eos)
            return weights + n * cache_row_bytes(model, args.prompt + args.new)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        M.generate(model, batch, args.new, temperature=1.0, seed=0, eos_token_ids=eos)
        return torch.cuda.max_memory_allocated(device)

    small, large = max(1, args.batch // 2), args.batch
    p_small, p_large = peak(small), peak(large)
    per_row = (p_large - p_small) / (large - small)
    budget = (
        torch.cuda.get_device_properties(device).total_memory * USABLE
        if device.type == "cuda"
        # the CPU: a pretend device of 4x the batch, to run the path
        else p_large + 3 * large * per_row
    )
    best, measured = large + int((budget - p_large) // per_row), None
    for _ in range(3):
        try:
            measured = peak(best)
            break
        except torch.OutOfMemoryError:
            best = int(best * 0.9)
    return [
        [
            f"{args.prompt} + {args.new}",
            large,
            f"{p_large / 2**30:.2f}",
            f"{per_row / 2**20:.1f}",
            f"{budget / 2**30:.1f}",
            best,
            "-" if measured is None else f"{measured / 2**30:.2f}",
        ]
    ]


def cache_row_bytes(model: M.Qwen, slots: int) -> int:
    """Bytes of one row's generation cache: K and V of `slots` tokens per attention layer, DeltaNet
    states."""
    return sum(t[:1].nbytes for state in model.new_cache(1, slots).layers for t in state)


def sft_step(model, args, device, peak_flops) -> list[list]:
    optimizer = T.build_optimizer(model, 1e-4, 0.01, (0.9, 0.999))
    params = T.optimizer_parameters(optimizer)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(
        0, model.config.vocab_size, (args.sft_batch, args.sft_length), generator=g
    ).to(device)
    weights = torch.ones(args.sft_batch, args.sft_length - 1, device=device)
    model.train()

    def step():
        optimizer.zero_grad(set_to_none=True)
        sft.backward_update(model, [(ids, weights, None)], args.sft_batch)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    step()  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = min(timed(step, device)[0] for _ in range(args.repeats))
    tokens = args.sft_batch * args.sft_length
    flops = model_flops(
        model, [args.sft_length] * args.sft_batch, tokens - args.sft_batch, backward=True
    )
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return [
        [
            f"{args.sft_batch} x {args.sft_length}",
            f"{seconds:.3f}",
            f"{tokens / seconds:,.0f}",
            f"{flops / seconds / 1e12:.1f}",
            mfu(flops / seconds, peak_flops),
            "-" if peak is None else f"{peak:.1f}",
        ]
    ]


def grpo_update(model, args, device, peak_flops) -> list[list]:
    cfg = grpo.GRPOConfig(output_dir="", train_data=[], model=grpo.ModelSettings(path=""))
    cfg.loss.micro_batch_size = args.micro_batch
    optimizer = T.build_optimizer(model, cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.betas)
    group = [
        p for p in prompts(model, args.grpo_prompts, args.prompt, seed=3) for _ in range(args.k)
    ]

    def update(seed):
        model.eval()
        generated, (new, logp) = timed(
            lambda: M.generate(
                model, group, args.new, temperature=1.0, seed=seed, return_logprobs=True
            ),
            device,
        )
        rewards = torch.rand(len(new), generator=torch.Generator().manual_seed(seed))
        advantages = grpo.group_advantages(rewards, args.k).tolist()
        sequences = [
            grpo.Sequence(p + c, [False] * (len(p) - 1) + [True] * len(c), a, lp, 1.0)
            for p, c, a, lp in zip(group, new, advantages, logp)
        ]
        batches = grpo.micro_batches(sequences, cfg.loss.micro_batch_size, 0, device)
        trained, _ = timed(
            lambda: grpo.policy_update(model, optimizer, batches, cfg, D.Ranks(0, 1, device)),
            device,
        )
        return generated, trained, [len(s.ids) for s in sequences], sum(map(len, new))

    update(0)  # warm-up
    generated, trained, lengths, new_tokens = update(1)
    flops = model_flops(model, lengths, new_tokens, backward=False) * (
        cfg.loss.beta != 0
    ) + model_flops(model, lengths, new_tokens, backward=True)
    return [
        [
            f"{args.grpo_prompts} x {args.k}",
            f"{args.prompt} + {args.new}",
            f"{generated:.2f}",
            f"{trained:.2f}",
            f"{sum(lengths) / (generated + trained):,.0f}",
            f"{flops / trained / 1e12:.1f}",
            mfu(flops / trained, peak_flops),
        ]
    ]


def vllm_rollout(model, args, device) -> list[list]:
    """The rollout phase of one GRPO update by model.generate and by a vLLM server serving the same
    weights (written as a checkpoint with a word-level tokenizer over the vocabulary) with the LoRA
    loaded as an adapter."""
    folder = Path(tempfile.mkdtemp(prefix="gpu-vllm-"))
    M.save_merged(model, word_tokenizer(model.config.vocab_size, folder), folder)
    group = prompts(model, args.grpo_prompts, args.prompt, seed=3)
    settings = grpo.RolloutSettings(max_new_tokens=args.new)
    server = VLLMServer(
        args.vllm_python,
        folder,
        max_model_len=args.prompt + args.new + 8,
        log_path=str(folder / "log"),
        dtype=str(model.dtype).removeprefix("torch."),
        extra=() if device.type == "cpu" else ("--gpu-memory-utilization", "0.35"),
    )
    with server:
        engine = VLLMEngine(
            VLLMSettings(base_url=server.url, retries=0), "gpu", folder / "adapters"
        )
        engine.sync(model, 0, D.Ranks(0, 1, device))
        model.eval()
        local, (new, _) = timed(
            lambda: M.generate(
                model,
                [p for p in group for _ in range(args.k)],
                args.new,
                temperature=1.0,
                seed=1,
                return_logprobs=True,
            ),
            device,
        )
        served, (theirs, logp) = timed(
            lambda: engine.generate(group, args.k, settings, 1, []), device
        )
    gaps = []
    with torch.no_grad():
        for i, (row, lp) in enumerate(zip(theirs, logp)):
            ids = torch.tensor([group[i // args.k] + row], device=device)
            ours = M.token_logprobs(model, ids)[0, args.prompt - 1 :].float().cpu()
            gaps += (ours - torch.tensor(lp)).abs().tolist()
    return [
        [
            f"{args.grpo_prompts} x {args.k}",
            f"{args.prompt} + {args.new}",
            f"{server.startup_s:.0f}",
            f"{sum(map(len, new)) / local:,.0f}",
            f"{sum(map(len, theirs)) / served:,.0f}",
            f"{sum(gaps) / len(gaps):.2e}",
            f"{max(gaps):.2e}",
        ]
    ]


def word_tokenizer(vocab_size: int, folder: Path):
    """A word-level tokenizer over the vocabulary (w0, w1, ...), saved in `folder` and loaded: what
    a random-weight checkpoint needs beside its weights."""
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"w{vocab_size - 1}"}))
    return load_tokenizer(folder)


def optional_packages() -> str:
    """What this run could import of the optional kernels and engines."""
    found = [m for m in ("flash_attn", "fla", "vllm") if importlib.util.find_spec(m)]
    return ", ".join(found) or "none of flash_attn, fla, vllm"


def attention_path(device, dtype, packed: bool) -> str:
    """Which attention a training batch runs here (model.attention, model.packed_attention)."""
    half = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    if packed:
        if not half or M.varlen_kernel() is None:
            return "SDPA per sequence"
        flash = M.optional_kernel("flash_attn", "flash_attn_varlen_func")
        return "flash-attn varlen" if flash else "torch varlen_attn"
    return "SDPA causal"


def decode_path(decode: str, device) -> str:
    """What generate(decode=...) runs on this device (model.decode_step)."""
    graph = " in a CUDA graph" if device.type == "cuda" else " (no CUDA graph on the CPU)"
    return {
        "eager": "eager operators",
        "static": "static step" + graph,
        "compiled": "torch.compile" + graph,
    }[decode]


# how a decode step computes the policy's LoRA: its side path in every adapted projection
# (model.Linear), or merged into a copy of the weights, as GRPO's rollouts do (model.lora_merged)
LORA_PATHS = ("side path", "merged")


def lora_path(model, lora: str):
    return M.lora_merged(model) if lora == "merged" else contextlib.nullcontext()


def grpo_decode(model, args, device, bandwidths: dict, emit) -> None:
    """GRPO's decode path: args.k rows continuing one prompt of args.decode_prompt tokens (kept
    once, a SharedPrefix), sampled at temperature 1, eager, static and (--compiled) compiled; the
    static step again over a long generation. ms/step is the steady state: the difference of two
    runs of n/2 and n new tokens over their n/2 extra steps, so prefill, warm-up and capture
    cancel. The roofline reads the weights, the prompt's K/V once and each row's own (mean over the
    steps timed)."""
    rows = prompts(model, 1, args.decode_prompt, seed=5) * args.k
    modes = [(way, args.decode_new, lora) for way in ("eager", "static") for lora in LORA_PATHS]
    modes += [("compiled", args.decode_new, "merged")] if args.compiled else []
    modes += [("static", args.decode_long, "merged")]
    for decode, new, lora in modes:

        def run(n, decode=decode, lora=lora):
            with lora_path(model, lora):
                return timed(
                    lambda: M.generate(model, rows, n, temperature=1.0, seed=0, decode=decode),
                    device,
                )[0]

        warm = run(2)  # cuBLAS, the allocator, and for "compiled" the compilation
        half, full = run(new // 2), run(new)
        seconds = (full - half) / (new - new // 2)
        tokens_per_s = args.k / seconds
        own = (new // 2 + new) / 2  # each row's own tokens, mean over the steps timed
        _, nbytes = step_bytes(model, args.k, own, shared=args.decode_prompt)
        for name, bw in bandwidths.items():
            roof = args.k * bw / nbytes
            emit(
                [
                    decode,
                    lora,
                    f"{args.k} x ({args.decode_prompt} shared + {new})",
                    f"{seconds * 1e3:.2f}",
                    f"{tokens_per_s:,.0f}",
                    f"{nbytes / 1e9:.2f}",
                    name,
                    f"{roof:,.0f}",
                    f"{tokens_per_s / roof:.1%}",
                    f"{warm:.1f}",
                    decode_path(decode, device),
                ]
            )


# host calls that start GPU work: kernels, CUDA graphs, copies, memsets
LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
)


def launches(model, args, device, emit, ways=None) -> None:
    """Launches per decoded token on GRPO's path (grpo_decode's rows), from torch.profiler: the
    difference of two profiled runs of n and 2n new tokens over n, for each (decode, LORA_PATHS
    entry) of `ways` (default: eager and static on both paths, with --compiled compiled merged).
    On CUDA: the host's launch calls (LAUNCH_CALLS) and the GPU kernels, copies and memsets
    recorded; on the CPU: the aten operators called."""
    from torch.profiler import ProfilerActivity, profile

    rows = prompts(model, 1, args.decode_prompt, seed=5) * args.k
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if ways is None:
        ways = [(way, lora) for way in ("eager", "static") for lora in LORA_PATHS]
        ways += [("compiled", "merged")] if args.compiled else []
    for decode, lora in ways:
        with lora_path(model, lora):
            M.generate(model, rows, 2, temperature=1.0, seed=0, decode=decode)  # warm-up
        counts = []
        for n in (args.launch_steps, 2 * args.launch_steps):
            with lora_path(model, lora), profile(activities=activities) as prof:
                M.generate(model, rows, n, temperature=1.0, seed=0, decode=decode)
                sync(device)
            events = prof.events()
            host = sum(e.name in LAUNCH_CALLS for e in events)
            gpu = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events)
            ops = sum(e.name.startswith("aten::") for e in events)
            counts.append((host, gpu) if cuda else (ops, None))
        (a, ga), (b, gb) = counts
        per = args.launch_steps
        emit(
            [
                decode,
                lora,
                f"{args.k} x ({args.decode_prompt} shared + {2 * per})",
                f"{(b - a) / per:,.1f}",
                "-" if ga is None else f"{(gb - ga) / per:,.1f}",
                "CUDA launch calls" if cuda else "aten operator calls",
                decode_path(decode, device),
            ]
        )


def grpo_sequences(model, args, n_prompts: int, seed: int) -> list:
    """GRPO's training sequences without a rollout: n_prompts prompts of args.prompt tokens, K
    completions each of lengths uniform in [args.grpo_new / 16, args.grpo_new] (reasoning lengths
    spread widely; those reaching the cap are truncated ones), random advantages."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    out = []
    for prompt in prompts(model, n_prompts, args.prompt, seed=seed):
        lengths = torch.randint(
            max(1, args.grpo_new // 16), args.grpo_new + 1, (args.k,), generator=g
        )
        advantages = grpo.group_advantages(torch.rand(args.k, generator=g), args.k)
        for n, a in zip(lengths.tolist(), advantages.tolist()):
            completion = torch.randint(0, vocab, (n,), generator=g).tolist()
            mask = [False] * (len(prompt) - 1) + [True] * n
            out.append(grpo.Sequence(prompt + completion, mask, a, [0.0] * n, 1.0))
    return out


def computed_tokens(batches) -> int:
    """Token positions a forward computes: every row's width, padding included."""
    return sum(b.ids.numel() for b in batches)


def grpo_packing(model, args, device, peak_flops, emit) -> None:
    """One GRPO update's training (grpo.policy_update: the reference pass, the policy pass and
    backward, AdamW) on the same sequences (grpo_sequences), as grpo.py batches them by default
    (micro_batch_size rows in group order, right-padded) and packed (grpo.packed_micro_batches, a
    budget of micro_batch x (prompt + grpo_new) tokens: no more than a padded micro-batch can
    hold). Padding share: the computed positions that are padding. MFU counts the real tokens'
    model FLOPs only. A small update of each kind runs first (warm-up)."""
    cfg = grpo.GRPOConfig(output_dir="", train_data=[], model=grpo.ModelSettings(path=""))
    budget = args.micro_batch * (args.prompt + args.grpo_new)
    optimizer = T.build_optimizer(model, cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.betas)
    ranks = D.Ranks(0, 1, device)

    def batches(sequences, packed: bool):
        if packed:
            return grpo.packed_micro_batches(sequences, budget, device)
        return grpo.micro_batches(sequences, args.micro_batch, 0, device)

    warm = grpo_sequences(model, args, 1, seed=6)[:2]
    sequences = grpo_sequences(model, args, args.grpo_prompts, seed=7)
    lengths = [len(s.ids) for s in sequences]
    completion_tokens = sum(sum(s.mask) for s in sequences)
    flops = model_flops(model, lengths, completion_tokens, backward=True) + model_flops(
        model, lengths, completion_tokens, backward=False
    ) * (cfg.loss.beta != 0)
    for packed in (False, True):
        grpo.policy_update(model, optimizer, batches(warm, packed), cfg, ranks)
        parts = batches(sequences, packed)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds, _ = timed(lambda: grpo.policy_update(model, optimizer, parts, cfg, ranks), device)
        computed = computed_tokens(parts)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        emit(
            [
                "packed" if packed else "padded",
                f"{args.grpo_prompts} x {args.k}",
                f"{len(parts)} x "
                + (f"<= {budget:,} tokens" if packed else f"{args.micro_batch} rows"),
                f"{sum(lengths):,}",
                f"{computed:,}",
                f"{1 - sum(lengths) / computed:.1%}",
                f"{seconds:.2f}",
                f"{sum(lengths) / seconds:,.0f}",
                f"{flops / seconds / 1e12:.1f}",
                mfu(flops / seconds, peak_flops),
                "-" if peak is None else f"{peak:.1f}",
                attention_path(device, model.dtype, packed),
            ]
        )


def fsdp_step(args, device, dtype, peak_flops, emit) -> M.Qwen:
    """Full-parameter GRPO (`finetune: full`) at world size 1 on the --fsdp-shape model: the policy
    sharded by fsdp.shard_model (float32 master weights, compute in the model dtype, AdamW) and
    its frozen reference, one update (grpo.policy_update: reference pass, policy pass and backward
    with weight gradients, clip, AdamW) over grpo_sequences of --fsdp-prompts prompts, after a
    warm-up update. Returns the sharded policy (the reference and AdamW's state are freed)."""
    import fsdp as FS

    raw = (TINY if args.tiny else QWEN3)[args.fsdp_shape]
    torch.manual_seed(0)
    policy = random_model(raw, dtype, device)
    torch.manual_seed(0)
    reference = random_model(raw, dtype, device)
    FS.shard_model(policy, device)
    FS.shard_model(reference, device, like=policy)
    policy.gradient_checkpointing = True
    cfg = grpo.GRPOConfig(
        output_dir="", train_data=[], model=grpo.ModelSettings(path=""), finetune="full"
    )
    ranks = D.Ranks(0, 1, device)
    optimizer = T.build_optimizer(policy, 1e-6, cfg.optim.weight_decay, cfg.optim.betas)
    warm = grpo.micro_batches(grpo_sequences(policy, args, 1, seed=8)[:2], 2, 0, device)
    sequences = grpo_sequences(policy, args, args.fsdp_prompts, seed=9)
    parts = grpo.micro_batches(sequences, args.fsdp_micro_batch, 0, device)
    lengths = [len(s.ids) for s in sequences]
    completion_tokens = sum(sum(s.mask) for s in sequences)
    flops = model_flops(
        policy, lengths, completion_tokens, backward=True, weight_grads=True
    ) + model_flops(policy, lengths, completion_tokens, backward=False)
    grpo.policy_update(policy, optimizer, warm, cfg, ranks, reference)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds, _ = timed(
        lambda: grpo.policy_update(policy, optimizer, parts, cfg, ranks, reference), device
    )
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    trained = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    emit(
        [
            args.fsdp_shape,
            f"{trained / 1e9:.2f}B",
            f"{len(sequences)} in {len(parts)} x {args.fsdp_micro_batch} rows",
            f"{sum(lengths):,}",
            f"{seconds:.2f}",
            f"{sum(lengths) / seconds:,.0f}",
            f"{flops / seconds / 1e12:.1f}",
            mfu(flops / seconds, peak_flops),
            "-" if peak is None else f"{peak:.1f}",
            f"FSDP2 over 1 rank ({'nccl' if device.type == 'cuda' else 'gloo'}), "
            f"{attention_path(device, dtype, False)}",
        ]
    )
    return policy


def sync_save(policy: M.Qwen, args, device, out_dir: Path, emit) -> None:
    """The save a full-parameter vLLM sync runs before the server reloads
    (vllm_engine.sync_weights: checkpoint.save_model -> fsdp.export_full, every tensor gathered to
    the host and written as Hugging Face safetensors shards), of fsdp_step's policy into
    OUT_DIR/sync-weights: timed, then deleted."""
    import shutil

    import checkpoint as CK

    tok_dir = out_dir / "sync-tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok = word_tokenizer(policy.config.vocab_size, tok_dir)
    folder = out_dir / "sync-weights"
    seconds, _ = timed(lambda: CK.save_model(policy, tok, folder, D.Ranks(0, 1, device)), device)
    written = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    emit(
        [
            args.fsdp_shape,
            f"{written / 1e9:.3g}",
            f"{seconds:.3g}",
            f"{written / seconds / 1e9:.3g}",
            f"checkpoint.save_model (fsdp.export_full) into {out_dir}",
        ]
    )
    shutil.rmtree(folder)
    shutil.rmtree(tok_dir)


def mfu(flops_per_s: float, peak: float | None) -> str:
    return "-" if peak is None else f"{flops_per_s / peak:.1%}"


class Report:
    """The results file, written as the run goes: a section's heading and table header when it
    starts, each row as soon as it is measured (also printed, with the seconds since the start),
    so that a run stopped early keeps every row it measured. A section that raises is marked
    failed, with the error, and the run goes on to the next."""

    def __init__(self, path: Path, header: str):
        self.path, self.start, self.failed = path, time.perf_counter(), []
        path.write_text(header)
        print(header, flush=True)

    def text(self, text: str) -> None:
        with self.path.open("a") as f:
            f.write(text + "\n\n")
        print(text + "\n", flush=True)

    def section(self, title: str, header: list[str], measure) -> None:
        """Run measure(emit) under `title`, a table of `header` whose rows emit(row) writes."""
        began = time.perf_counter()
        lines = [f"### {title}", "", *markdown_table(header, []).splitlines()]
        with self.path.open("a") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)

        def emit(row: list) -> None:
            line = "| " + " | ".join(str(cell) for cell in row) + " |"
            with self.path.open("a") as f:
                f.write(line + "\n")
            print(f"{line}  [{time.perf_counter() - self.start:.0f} s]", flush=True)

        try:
            measure(emit)
        except Exception as e:  # the next section may still run: say what failed, go on
            self.failed.append(title)
            with self.path.open("a") as f:
                f.write(f"\n**failed**: {type(e).__name__}: {str(e)[:500]}\n")
            traceback.print_exc()
        self.text(f"\n({time.perf_counter() - began:.0f} s)")


DECODE_HEADER = [
    "decode",
    "LoRA",
    "rows x (prompt + new)",
    "ms/step",
    "tokens/s",
    "bytes/step GB",
    "bandwidth",
    "roofline tokens/s",
    "of roofline",
    "warm-up s",
    "ran with",
]
LAUNCH_HEADER = ["decode", "LoRA", "rows x (prompt + new)", "per token", "GPU work per token"]
LAUNCH_HEADER += ["counted"]
LAUNCH_HEADER += ["ran with"]
PACKING_HEADER = [
    "batches",
    "prompts x K",
    "micro-batches",
    "tokens",
    "computed",
    "padding",
    "train s",
    "tokens/s",
    "TFLOP/s",
    "MFU",
    "peak GiB",
    "ran with",
]
FSDP_HEADER = ["shape", "trained", "sequences", "tokens", "s/update", "tokens/s", "TFLOP/s"]
FSDP_HEADER += ["MFU", "peak GiB", "ran with"]
SYNC_HEADER = ["shape", "GB written", "seconds", "GB/s", "ran with"]
DEFAULT_SECTIONS = ["decode", "packing", "fsdp", "launches"]  # run in this order
EARLIER_SECTIONS = ["batch-decode", "capacity", "sft", "grpo-update"]  # issue 15's


def shape_model(shape: str, args, device, dtype) -> M.Qwen:
    torch.manual_seed(0)
    return random_model((TINY if args.tiny else SHAPES)[shape], dtype, device)


def policy_model(model: M.Qwen) -> M.Qwen:
    """The policy as GRPO samples and trains it: LoRA r16 on every projection (B = 0),
    activation checkpointing."""
    M.add_lora(model, 16, 32)
    model.gradient_checkpointing = True
    return model


def measure(shape: str, args, device, dtype, gpu: str, report: Report) -> None:
    """The sections of one shape but the launches, into `report`."""
    model = shape_model(shape, args, device, dtype)
    bandwidth, peak_flops = GPUS.get(gpu, (None, None))
    bandwidths = {"measured copy": copy_bandwidth(device, 1 << 24 if args.tiny else 1 << 30)}
    bandwidths = ({f"{gpu} nominal": bandwidth} if bandwidth else {}) | bandwidths
    body, head = matmul_params(model)
    report.text(
        f"## {shape}{' (tiny)' if args.tiny else ''}: {(body + head) / 1e6:,.2f}M multiplied "
        f"weights, {dtype}"
    )
    run = set(args.sections)
    if "batch-decode" in run:
        report.section(
            "decode, unique prompts",
            [
                "batch",
                "prompt + new",
                "prefill s",
                "ms/step",
                "tokens/s",
                "bytes/step GB",
                "bandwidth",
                "roofline tokens/s",
                "of roofline",
            ],
            lambda emit: [emit(row) for row in decode(model, args, device, bandwidths)],
        )
    if "capacity" in run:
        report.section(
            "capacity",
            [
                "prompt + new",
                "batch",
                "peak GiB",
                "MiB per row",
                "budget GiB",
                "largest batch",
                "its peak GiB",
            ],
            lambda emit: [emit(row) for row in capacity(model, args, device)],
        )
    policy_model(model)
    if "decode" in run:
        report.section(
            "decode on GRPO's path (a group sharing its prompt)",
            DECODE_HEADER,
            lambda emit: grpo_decode(model, args, device, bandwidths, emit),
        )
    if "packing" in run:
        report.section(
            "GRPO update, padded and packed",
            PACKING_HEADER,
            lambda emit: grpo_packing(model, args, device, peak_flops, emit),
        )
    if "sft" in run:
        report.section(
            "SFT step",
            ["batch", "s/step", "tokens/s", "model TFLOP/s", "MFU", "peak GiB"],
            lambda emit: [emit(row) for row in sft_step(model, args, device, peak_flops)],
        )
    if "grpo-update" in run:
        report.section(
            "GRPO update",
            [
                "prompts x K",
                "prompt + new",
                "generate s",
                "train s",
                "tokens/s",
                "train TFLOP/s",
                "train MFU",
            ],
            lambda emit: [emit(row) for row in grpo_update(model, args, device, peak_flops)],
        )
    if args.vllm_python:
        report.section(
            "rollout: model.generate and vLLM",
            [
                "prompts x K",
                "prompt + new",
                "vLLM start s",
                "generate tokens/s",
                "vLLM tokens/s",
                "mismatch mean",
                "mismatch max",
            ],
            lambda emit: [emit(row) for row in vllm_rollout(model, args, device)],
        )


def full_parameter(args, device, dtype, gpu: str, report: Report) -> None:
    """The full-parameter step and the sync's save (fsdp_step, sync_save), into `report`."""
    peak_flops = GPUS.get(gpu, (None, None))[1]
    report.text(f"## full-parameter GRPO at world size 1: {args.fsdp_shape}, {dtype}")
    policy = []
    report.section(
        "FSDP update",
        FSDP_HEADER,
        lambda emit: policy.append(fsdp_step(args, device, dtype, peak_flops, emit)),
    )
    if policy:
        report.section(
            "save of a full-parameter vLLM sync",
            SYNC_HEADER,
            lambda emit: sync_save(policy[0], args, device, args.out, emit),
        )


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, help="folder for gpu_results.md")
    p.add_argument(
        "--tiny", action="store_true", help="tiny shapes in float32 on the CPU, small sizes"
    )
    p.add_argument("--paper", action="store_true", help="print the roofline on paper and exit")
    p.add_argument(
        "--shapes", nargs="+", choices=list(SHAPES), help="default: qwen3-8b (--tiny: both)"
    )
    p.add_argument(
        "--sections",
        nargs="+",
        choices=DEFAULT_SECTIONS + EARLIER_SECTIONS,
        default=DEFAULT_SECTIONS,
        help="fsdp: the full-parameter update and the vLLM sync's save, once (--fsdp-shape)",
    )
    p.add_argument("--k", type=int, default=8, help="GRPO group size: rows sharing a prompt")
    p.add_argument("--decode-prompt", type=int, default=1024, help="the group's shared prompt")
    p.add_argument("--decode-new", type=int, default=128, help="new tokens, eager vs static")
    p.add_argument("--decode-long", type=int, default=1024, help="new tokens, static, long")
    p.add_argument("--launch-steps", type=int, default=4, help="profiled: runs of n and 2n")
    p.add_argument("--compiled", action="store_true", help="also decode through torch.compile")
    p.add_argument("--grpo-prompts", type=int, default=4)
    p.add_argument("--prompt", type=int, default=512, help="GRPO prompt tokens")
    p.add_argument("--grpo-new", type=int, default=1024, help="GRPO completions: up to this")
    p.add_argument("--micro-batch", type=int, default=8, help="GRPO sequences per forward/backward")
    p.add_argument("--fsdp-shape", choices=list(QWEN3), default="qwen3-4b")
    p.add_argument("--fsdp-prompts", type=int, default=1)
    p.add_argument("--fsdp-micro-batch", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="batch-decode, capacity")
    p.add_argument("--new", type=int, default=256, help="batch-decode, capacity, grpo-update")
    p.add_argument("--sft-batch", type=int, default=4)
    p.add_argument("--sft-length", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--vllm-python", help="a Python whose venv holds vLLM: adds the rollout comparison"
    )
    args = p.parse_args()
    if args.paper:
        print(paper_table(args.batch, args.prompt + args.new / 2))
        sizes = dict(rows=8, prompt=1024, new=4096, micro_batch=4)
        print(
            "\nFull-parameter GRPO (finetune: full), the CLUE config's rollout (8 prompts x K 8: "
            "one group per GPU, 4,096 new tokens after a 1,024-token prompt, micro-batches of 4), "
            "per GPU on 8 GPUs:\n"
        )
        print(memory_plan("qwen3-8b", 8, **sizes))
        print("\nThe largest Qwen3 that fits, one group per GPU at every node count:\n")
        print(fit_table(**sizes))
        return
    if args.out is None:
        p.error("--out is required (or --paper)")
    args.shapes = args.shapes or (list(SHAPES) if args.tiny else ["qwen3-8b"])
    if args.tiny:
        args.batch, args.prompt, args.new, args.sft_batch, args.sft_length = 4, 16, 8, 2, 32
        args.grpo_prompts, args.k, args.micro_batch, args.repeats = 2, 2, 2, 1
        args.decode_prompt, args.decode_new, args.decode_long, args.launch_steps = 16, 8, 16, 4
        args.grpo_new, args.fsdp_shape, args.fsdp_micro_batch = 16, "qwen3-8b", 2
    elif not torch.cuda.is_available():
        sys.exit("gpu.py: no CUDA device (use --tiny to check the script on the CPU)")
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda":  # the profiler must start once before any CUDA graph exists
        from torch.profiler._utils import _init_for_cuda_graphs  # (pytorch#100441)

        _init_for_cuda_graphs()
    dtype = torch.float32 if args.tiny else torch.bfloat16
    gpu = "cpu" if args.tiny else torch.cuda.get_device_name(device)
    # SXM parts
    known = next((name for name in GPUS if name in gpu and ("H200" in gpu or "HBM3" in gpu)), gpu)
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(
        args.out / "gpu_results.md",
        f"# GPU measurements\n\n{gpu}, torch {torch.__version__}, optional packages: "
        f"{optional_packages()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"`python bench/gpu.py {' '.join(sys.argv[1:])}`\n\n",
    )
    for shape in args.shapes:
        measure(shape, args, device, dtype, known, report)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "fsdp" in args.sections:
        full_parameter(args, device, dtype, known, report)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # last: profiling CUDA graphs is the step most likely to break the CUDA context
    for shape in args.shapes if "launches" in args.sections else []:
        model = policy_model(shape_model(shape, args, device, dtype))
        report.text(f"## {shape}{' (tiny)' if args.tiny else ''}: launches")
        report.section(
            "launches per decoded token",
            LAUNCH_HEADER,
            lambda emit, model=model: launches(model, args, device, emit),
        )
        del model
    print(f"wrote {report.path} in {time.perf_counter() - report.start:.0f} s")
    if report.failed:
        sys.exit(f"gpu.py: failed sections: {', '.join(report.failed)} (errors in {report.path})")


if __name__ == "__main__":
    main()
