"""Qwen2/2.5, Qwen3 (dense), Qwen3.5 (hybrid Gated DeltaNet + gated attention) and Llama 3.x (dense,
with its RoPE frequency scaling) in plain PyTorch:
config, forward, safetensors loading, LoRA (inject, disable, merge, PEFT-format save/load),
trainable special-token rows, a preallocated generation cache, batched sampling and chunked token
log-probabilities. The tokenizer and the chat formats live in tokenizer.py (this file takes its
checkpoint helpers from there: CheckpointError, read_json); config's `excerpt` is the only other
project import; flash-attn, flash-linear-attention and torch's own varlen attention are optional
CUDA-only speed-ups, the plain PyTorch path is the reference.

Batches of different-length sequences: pad on the RIGHT. Every layer is causal (attention, the
causal conv and the delta-rule recurrence), so a real token never sees the padding after it and its
logits are those of the unpadded sequence; read logits or log-probabilities only at real positions
(a mask). Or pack them into one row without padding (`Packing`: positions, attention and the
recurrence kept within each sequence). `model(input_ids)` is the training forward; set
`model.gradient_checkpointing = True` (in train mode) to recompute each layer in backward.
Generation uses the padded layout, with a decode step that can be made static and captured as a
CUDA graph (`generate(..., decode=...)`)."""

import contextlib
import functools
import importlib
import inspect
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_tensors
from tokenizers import AddedToken
from torch import nn
from torch.utils.checkpoint import checkpoint

from config import excerpt
from tokenizer import CheckpointError, QwenTokenizer, read_json

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Qwen3.5's vision tower and multi-token-prediction head: not loaded
SKIPPED = ("model.visual.", "mtp.")
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# PEFT's trained token rows (their values, despite the name)
PEFT_ROWS = "token_adapter.trainable_tokens_delta"
# generate: decode steps between host reads (GPU syncs) of the live-row count
FINISHED_CHECK_EVERY = 8


# ----------------------------------------------------------------------------------------------
# Config


@dataclass
class QwenConfig:
    family: str  # "qwen2" | "qwen3" | "qwen3_5" (hybrid Gated DeltaNet + gated attention) | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int  # RoPE turns only the first rotary_dim dims of each head (Qwen3.5: a quarter)
    # Llama 3's frequency scaling (rope_type "llama3"): factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings; None for plain RoPE
    rope_scaling: dict | None
    tie_word_embeddings: bool
    # Qwen2: bias on q/k/v (hard-wired in the architecture); Qwen3, Llama: `attention_bias`
    qkv_bias: bool
    o_bias: bool
    layer_types: tuple  # per layer "full_attention" or "linear_attention"
    dtype: str | None  # the checkpoint's declared dtype
    raw: dict  # config.json as read, written back by save_merged
    # checkpoint name of our `model.` (Qwen3.5 image-text: model.language_model.)
    weight_prefix: str = "model."
    conv_kernel: int = 0  # Gated DeltaNet sizes (Qwen3.5 only)
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "QwenConfig":
        return cls.from_dict(read_json(Path(path)), str(path))

    @classmethod
    def from_dict(cls, raw: dict, src: str = "config.json") -> "QwenConfig":
        """Read a Hugging Face config dict; `src` names it in errors. Qwen3.5 comes as `qwen3_5`
        (image-text, the text model under `text_config`) or as `qwen3_5_text`."""
        family, text, prefix = raw.get("model_type"), raw, "model."
        if family == "qwen3_5":
            text, prefix = raw.get("text_config"), "model.language_model."
            if not isinstance(text, dict):
                raise CheckpointError(f"{src}: missing field 'text_config'")
            src = f"{src}: text_config"
        family = {"qwen3_5_text": "qwen3_5"}.get(family, family)
        if family not in ("qwen2", "qwen3", "qwen3_5", "llama"):
            raise CheckpointError(
                f"{src}: field 'model_type' = {excerpt(raw.get('model_type'))} is not supported "
                f"(qwen2, qwen3, qwen3_5, qwen3_5_text, llama)"
            )
        if text.get("hidden_act", "silu") != "silu":
            raise CheckpointError(
                f"{src}: field 'hidden_act' = {excerpt(text['hidden_act'])} is not supported (silu)"
            )
        for key in ("use_sliding_window", "quantization_config", "mlp_bias"):
            if value := text.get(key) or raw.get(key):
                raise CheckpointError(f"{src}: field '{key}' = {excerpt(value)} is not supported")
        hidden, heads = _int(text, "hidden_size", src), _int(text, "num_attention_heads", src)
        layers = _int(text, "num_hidden_layers", src)
        # Qwen2 has no head_dim key, nor has Llama 3.1's Hub config (transformers writes one)
        if family == "qwen2" or (family == "llama" and text.get("head_dim") is None):
            head_dim = hidden // heads
        else:
            head_dim = _int(text, "head_dim", src)
        bias = family != "qwen2" and bool(text.get("attention_bias", False))
        theta, partial, scaling = _rope(text, src, family)
        types, hybrid = ["full_attention"] * layers, {}
        if family == "qwen3_5":
            interval = text.get("full_attention_interval", 4)
            types = text.get("layer_types") or [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(layers)
            ]
            hybrid = {
                ours: _int(text, key, src)
                for ours, key in (
                    ("conv_kernel", "linear_conv_kernel_dim"),
                    ("linear_k_heads", "linear_num_key_heads"),
                    ("linear_v_heads", "linear_num_value_heads"),
                    ("linear_k_dim", "linear_key_head_dim"),
                    ("linear_v_dim", "linear_value_head_dim"),
                )
            }
        if len(types) != layers or set(types) - {"full_attention", "linear_attention"}:
            raise CheckpointError(
                f"{src}: field 'layer_types' = {excerpt(types)} needs {layers} entries of "
                f"full_attention / linear_attention"
            )
        return cls(
            family=family,
            vocab_size=_int(text, "vocab_size", src),
            hidden_size=hidden,
            intermediate_size=_int(text, "intermediate_size", src),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=_int(text, "num_key_value_heads", src),
            head_dim=head_dim,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rotary_dim=int(head_dim * partial),
            rope_scaling=scaling,
            tie_word_embeddings=bool(
                raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            ),
            qkv_bias=family == "qwen2" or bias,
            o_bias=bias,
            layer_types=tuple(types),
            dtype=raw.get("dtype", raw.get("torch_dtype", text.get("dtype"))),
            raw=raw,
            weight_prefix=prefix,
            **hybrid,
        )


def open_safetensors(file: Path, device="cpu"):
    """safe_open, with a file it cannot open or read (missing, truncated, not safetensors) an error
    naming it."""
    try:
        return safe_open(file, framework="pt", device=str(device))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from None


def _int(raw: dict, key: str, src: str) -> int:
    if key not in raw:
        raise CheckpointError(f"{src}: missing field '{key}'")
    if not isinstance(raw[key], int) or isinstance(raw[key], bool) or raw[key] <= 0:
        raise CheckpointError(
            f"{src}: field '{key}' must be a positive integer, got {excerpt(raw[key])}"
        )
    return raw[key]


LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(raw: dict, src: str, family: str) -> tuple[float, float, dict | None]:
    """(theta, partial_rotary_factor, Llama 3's scaling or None). Hub configs keep `rope_theta` at
    the top level (Llama 3.1's scaling in `rope_scaling`); transformers >= 5 writes
    `rope_parameters`. Qwen3.5's mrope fields reduce to plain RoPE for text."""
    field = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    params = raw.get(field) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3") or (rope_type == "llama3" and family != "llama"):
        raise CheckpointError(
            f"{src}: field 'rope_parameters.rope_type' = {excerpt(rope_type)} is not supported "
            f"('default'; 'llama3' for llama)"
        )
    scaling = None
    if rope_type == "llama3":
        if missing := [key for key in LLAMA3_ROPE if not isinstance(params.get(key), (int, float))]:
            raise CheckpointError(f"{src}: field 'rope_parameters.{missing[0]}' must be a number")
        scaling = {key: float(params[key]) for key in LLAMA3_ROPE}
        # the frequency formula divides by high - low and by the factor: NaN frequencies otherwise
        for key in ("factor", "low_freq_factor", "original_max_position_embeddings"):
            if not 0 < scaling[key] < math.inf:
                raise CheckpointError(f"{src}: field '{field}.{key}' = {params[key]} must be > 0")
        if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
            raise CheckpointError(
                f"{src}: field '{field}.high_freq_factor' = {params['high_freq_factor']} must be "
                f"above low_freq_factor {params['low_freq_factor']}"
            )
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise CheckpointError(f"{src}: missing field 'rope_theta'")
    partial = 0.25 if family == "qwen3_5" else 1.0
    return (
        float(theta),
        float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", partial))),
        scaling,
    )


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {excerpt(dtype)} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


# optional_kernel's and varlen_kernel's answers: a plain dict, which torch.compile reads (it cannot
# trace an import)
KERNELS: dict[tuple[str, str], object] = {}


def optional_kernel(module: str, name: str):
    """A function from an optional GPU package (flash_attn), or None when it is not installed."""
    if (module, name) not in KERNELS:
        try:
            KERNELS[module, name] = getattr(importlib.import_module(module), name)
        except ImportError:
            KERNELS[module, name] = None
    return KERNELS[module, name]


# ----------------------------------------------------------------------------------------------
# Layers


class RMSNorm(nn.Module):
    """x / rms(x) computed in float32, times w. With offset=True (Qwen3.5's zero-centred norms) the
    weight is stored as an offset: times (1 + w) in float32, then cast; else cast, then times w."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x):
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # one kernel where torch fuses it
        return (
            (h * (1 + self.weight.float())).to(x.dtype)
            if self.offset
            else self.weight * h.to(x.dtype)
        )


class Linear(nn.Linear):
    """nn.Linear with an optional LoRA delta: y = x W^T + b + (alpha / r) * dropout(x) A^T B^T.
    A [r, in] and B [out, r] are float32 (like PEFT), computed in float32, or with `lora_compute`
    "model" as copies cast to the base's dtype each forward (the float32 factors stay what AdamW
    trains; their gradients come back float32 through the casts)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.lora_A = self.lora_B = None  # nn.Parameter when added by add_lora
        self.lora_scale, self.lora_dropout, self.lora_enabled = 0.0, 0.0, True
        self.lora_compute = "float32"

    def forward(self, x):
        if self.lora_A is None or not self.lora_enabled:
            return F.linear(x, self.weight, self.bias)
        A, B = self.lora_A, self.lora_B
        if self.lora_compute == "model":
            A, B = A.to(self.weight.dtype), B.to(self.weight.dtype)
        xa = F.linear(F.dropout(x, self.lora_dropout, self.training).to(A.dtype), A)
        if xa.dtype != self.weight.dtype:  # float32 factors on a half-precision base
            return F.linear(x, self.weight, self.bias) + (F.linear(xa, B) * self.lora_scale).to(
                x.dtype
            )
        # y += s (x A^T) B^T in place, in one product
        y = F.linear(x.flatten(0, -2), self.weight, self.bias)
        return y.addmm_(xa.flatten(0, -2), B.T, alpha=self.lora_scale).view(*x.shape[:-1], -1)

    def merged_weight(self) -> torch.Tensor:
        if self.lora_A is None:
            return self.weight.data
        delta = (self.lora_B.float() @ self.lora_A.float()) * self.lora_scale
        return (self.weight.float() + delta).to(self.weight.dtype)


def rope_frequencies(cfg: QwenConfig, device=None) -> torch.Tensor:
    """RoPE's angular frequencies f_i = theta^(-2i/d), i < d/2 (d = rotary_dim), float32. Llama 3's
    scaling (cfg.rope_scaling) slows the long waves: with L = original_max_position_embeddings and
    s = (L f_i / 2 pi - low_freq_factor) / (high_freq_factor - low_freq_factor) clamped to [0, 1],
    f_i becomes f_i (1 - s) / factor + f_i s: divided by `factor` where the wavelength 2 pi / f_i
    exceeds L / low_freq_factor, kept below L / high_freq_factor, interpolated between."""
    d = cfg.rotary_dim
    freqs = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d)
    if cfg.rope_scaling is None:
        return freqs
    r = cfg.rope_scaling
    s = (r["original_max_position_embeddings"] * freqs / (2 * math.pi) - r["low_freq_factor"]) / (
        r["high_freq_factor"] - r["low_freq_factor"]
    )
    s = s.clamp(0, 1)
    return freqs / r["factor"] * (1 - s) + freqs * s


def rope_tables(n: int, cfg: QwenConfig, dtype: torch.dtype, device) -> tuple:
    """cos and signed sin [n, rotary_dim] for positions 0..n-1, computed in float32 (NeoX layout:
    frequency i drives dims i and i + rotary_dim/2). The sign folds rotate_half's negation in."""
    inv_freq = rope_frequencies(cfg, device)
    freqs = torch.arange(n, device=device).float()[:, None] * inv_freq
    return torch.cat([freqs, freqs], -1).cos().to(dtype), torch.cat(
        [-freqs.sin(), freqs.sin()], -1
    ).to(dtype)


def apply_rope(x, cos, sin_signed):
    """x' = x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1] (the halves swapped, the sign in
    sin_signed), on the first cos.shape[-1] dims of each head (all of them for the dense models); x:
    [B, T, H, D]."""
    rot = cos.shape[-1]
    xr = x[..., :rot]
    out = torch.addcmul(xr * cos, xr.roll(rot // 2, -1), sin_signed)
    return out if rot == x.shape[-1] else torch.cat([out, x[..., rot:]], -1)


@dataclass
class Packing:
    """Sequences concatenated into one row without padding (a packed training batch, [1, N]):
    `lens` their lengths in order, `seq` [N] each token's sequence, `positions` [N] its position in
    it (RoPE restarts at 0), `cu` [n + 1] the int32 offsets of the sequences (flash-attn's
    cu_seqlens). Attention stays within a sequence and Qwen3.5's conv and recurrence start from
    zeros at each one (`Attention`, `GatedDeltaNet`)."""

    lens: tuple[int, ...]
    seq: torch.Tensor
    positions: torch.Tensor
    cu: torch.Tensor

    @classmethod
    def of(cls, lens, device) -> "Packing":
        """Built on the host from the Python lengths (no device sync), then moved."""
        lens = tuple(int(n) for n in lens)
        if not lens or min(lens) < 1:
            raise ValueError(f"Packing: sequence lengths must be positive, got {list(lens)}")
        seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        starts = torch.tensor((0, *lens)).cumsum(0)
        return cls(
            lens,
            seq.to(device),
            (torch.arange(len(seq)) - starts[seq]).to(device),
            starts.int().to(device),
        )

    def padded_index(self) -> torch.Tensor:
        """Each token's index in the [n, max(lens)] right-padded layout, flattened."""
        return self.seq * max(self.lens) + self.positions

    def to_rows(self, x):
        """[1, N, ...] -> [n, max(lens), ...], each sequence in a row, zeros after it."""
        n, width = len(self.lens), max(self.lens)
        rows = x.new_zeros(n * width, *x.shape[2:]).index_copy(0, self.padded_index(), x[0])
        return rows.view(n, width, *x.shape[2:])

    def from_rows(self, rows):
        """The inverse of `to_rows`: [n, max(lens), ...] -> [1, N, ...]."""
        return rows.flatten(0, 1).index_select(0, self.padded_index())[None]


@dataclass
class ForwardState:
    """What every layer of one forward call shares: RoPE tables, the cache (or None), each query's
    cache slot [B, T] and, once the cache holds tokens or a prefix, the additive mask: 0 on the
    slots each query sees (its row's slots 0..slot), -inf elsewhere, [B, 1, G*T, S] for the G query
    heads sharing a KV head (row g*T + t is query t)."""

    cos: torch.Tensor
    sin: torch.Tensor
    cache: "Cache | None"
    slots: torch.Tensor
    mask: torch.Tensor | None
    lengths: torch.Tensor | None  # with a cache: real tokens of each row in this call
    # [B, T], False at the right padding of a prefill; None when all real
    valid: torch.Tensor | None
    packing: Packing | None = None  # a packed batch (no cache)


class Attention(nn.Module):
    """GQA self-attention. Qwen3/3.5: per-head RMSNorm on q and k before RoPE. Qwen3.5: q_proj also
    emits a gate per head ([q_h | gate_h]) and the output is multiplied by sigmoid(gate)."""

    def __init__(self, cfg: QwenConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.H = cfg.num_heads
        self.Hkv = cfg.num_kv_heads
        self.D = cfg.head_dim
        self.gated = cfg.family == "qwen3_5"
        d = cfg.hidden_size
        self.q_proj = Linear(d, self.H * self.D * (2 if self.gated else 1), bias=cfg.qkv_bias)
        self.k_proj = Linear(d, self.Hkv * self.D, bias=cfg.qkv_bias)
        self.v_proj = Linear(d, self.Hkv * self.D, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.H * self.D, d, bias=cfg.o_bias)
        if cfg.family in ("qwen3", "qwen3_5"):
            self.q_norm = RMSNorm(self.D, cfg.rms_norm_eps, offset=self.gated)
            self.k_norm = RMSNorm(self.D, cfg.rms_norm_eps, offset=self.gated)

    def new_state(self, batch: int, max_len: int, dtype, device) -> list:
        return [
            torch.zeros(batch, self.Hkv, max_len, self.D, dtype=dtype, device=device) for _ in "kv"
        ]

    def forward(self, x, step: ForwardState):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, -1)
        if self.gated:
            q, gate = q.chunk(2, -1)
        k = self.k_proj(x).view(B, T, self.Hkv, self.D)
        v = self.v_proj(x).view(B, T, self.Hkv, self.D)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, step.cos, step.sin)
        k = apply_rope(k, step.cos, step.sin)
        o = attention(q, k, v, step, self.layer_idx).reshape(B, T, self.H * self.D)
        return self.o_proj(o * torch.sigmoid(gate.reshape(B, T, -1)) if self.gated else o)


def attention(q, k, v, step: ForwardState, layer_idx: int):
    """q [B, T, H, D] over k, v [B, T, Hkv, D], causal; returns [B, T, H, D]. With a cache, k and v
    go to each row's step.slots, and the query in slot s sees slots 0..s of its row (and its whole
    prompt, if shared)."""
    cache = step.cache
    if step.packing is not None:
        return packed_attention(q, k, v, step.packing)
    if cache is not None:
        k_cache, v_cache = cache.layers[layer_idx]
        half = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
        flash = (
            optional_kernel("flash_attn", "flash_attn_with_kvcache")
            if half and cache.prefix is None
            else None
        )
        if flash is not None:
            return flash(
                q,
                k_cache.transpose(1, 2),
                v_cache.transpose(1, 2),
                k=k,
                v=v,
                cache_seqlens=cache.lens.int(),
                causal=True,
            )
        rows = torch.arange(q.shape[0], device=q.device)[:, None]
        k_cache[rows, :, step.slots] = k
        v_cache[rows, :, step.slots] = v
    if step.mask is None:  # no cache, or an empty one: plain causal attention over these tokens
        return F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True
        ).transpose(1, 2)
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    S = cache.width + q.shape[1]
    # GQA without copying K/V: the G query heads that share a KV head become G*T query rows.
    q = q.transpose(1, 2).reshape(B, Hkv, H // Hkv * T, D)
    keys = k_cache[:, :, :S]
    values = v_cache[:, :, :S]
    o = (
        F.scaled_dot_product_attention(q, keys, values, attn_mask=step.mask)
        if cache.prefix is None
        else cache.prefix.attend(q, layer_idx, *attend(q, keys, values, step.mask))
    )
    return o.view(B, H, T, D).transpose(1, 2)


def packed_attention(q, k, v, packing: Packing):
    """Causal attention within each sequence of a packed row, q [1, N, H, D] over k, v [1, N, Hkv,
    D]: one varlen kernel call where one runs (`packed_kernel`), else SDPA on each sequence in turn
    (no [N, N] mask, no work across sequences)."""
    varlen = packed_kernel(q)
    if varlen is not None:
        return varlen(q[0], k[0], v[0], packing.cu, max(packing.lens))[None]
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in parts), is_causal=True, enable_gqa=True
            ).transpose(1, 2)
            for parts in zip(*(t.split(packing.lens, 1) for t in (q, k, v)))
        ],
        1,
    )


def packed_kernel(q):
    """The varlen kernel a packed batch runs for q's device and dtype: `varlen_kernel` on CUDA in
    half precision (flash kernels, which run nowhere else), else None."""
    return varlen_kernel() if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else None


def varlen_kernel():
    """Causal varlen attention, f(q [N, H, D], k and v [N, Hkv, D], cu, longest) -> [N, H, D]:
    flash-attn's `flash_attn_varlen_func` when it is installed, else torch's own
    `torch.nn.attention.varlen.varlen_attn` where this torch has it with GQA (`enable_gqa`; its
    flash kernel runs on CUDA only), else None. Looked up once (KERNELS)."""
    if ("varlen", "causal") not in KERNELS:
        flash = optional_kernel("flash_attn", "flash_attn_varlen_func")
        native = optional_kernel("torch.nn.attention.varlen", "varlen_attn")
        kernel = None
        if flash is not None:

            def kernel(q, k, v, cu, n):
                return flash(q, k, v, cu, cu, n, n, causal=True)

        elif native is not None and "enable_gqa" in inspect.signature(native).parameters:

            def kernel(q, k, v, cu, n):
                return native(q, k, v, cu, cu, n, n, window_size=(-1, 0), enable_gqa=True)

        KERNELS["varlen", "causal"] = kernel
    return KERNELS["varlen", "causal"]


def attend(q, k, v, mask):
    """softmax(q k^T / sqrt(D) + mask) v, and the log-sum-exp of each query's scores (float32, [..,
    1])."""
    scores = (q @ k.transpose(-1, -2)).float().mul_(q.shape[-1] ** -0.5).add_(mask)
    lse = scores.logsumexp(-1, keepdim=True)
    return (scores - lse).exp_().to(v.dtype) @ v, lse


def l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule_recurrent(q, k, v, g, beta, state):
    """The gated delta rule one token at a time, in float32. q, k [B, H, T, dk]; v [B, H, T, dv];
    log-decay g and write strength beta [B, H, T]; state S [B, H, dk, dv]. Per token:
    S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t. Returns (o, S)."""
    out = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        delta = beta[:, :, t, None] * (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2))
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(out, 2), state


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The same recurrence, `chunk` tokens at a time (the form for prompts and training). Within a
    chunk, gamma = cumsum(g), D_ij = exp(gamma_i - gamma_j) for j <= i (0 above), and the writes
    solve (I + A) [u | w] = [beta v | beta k exp(gamma)] with A = tril(beta_i k_i.k_j D_ij, -1);
    then v' = u - w S; O = (q exp(gamma)) S + ((q k^T) * D) v'; S = exp(gamma_C) S + (k exp(gamma_C
    - gamma))^T v'. Zero padding to a multiple of `chunk` is inert: g = 0 does not decay and beta =
    0 writes nothing."""
    T = q.shape[2]
    dv = v.shape[-1]
    pad = -T % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)).unflatten(2, (-1, chunk)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)).unflatten(2, (-1, chunk)) for x in (g, beta))
    gamma = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    D = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    A = ((beta[..., None] * k) @ k.transpose(-1, -2) * D).tril(-1)
    rhs = torch.cat([beta[..., None] * v, beta[..., None] * k * gamma[..., None].exp()], -1)
    u, w = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split(
        [dv, k.shape[-1]], -1
    )
    out = []
    for n in range(q.shape[2]):
        qn = q[:, :, n]
        kn = k[:, :, n]
        gn = gamma[:, :, n]
        v_new = u[:, :, n] - w[:, :, n] @ state
        out.append(
            (qn * gn[..., None].exp()) @ state + (qn @ kn.transpose(-1, -2) * D[:, :, n]) @ v_new
        )
        last = gn[..., -1:]
        state = (
            state * last[..., None].exp()
            + (kn * (last - gn)[..., None].exp()).transpose(-1, -2) @ v_new
        )
    return torch.cat(out, 2)[:, :, :T], state


def kernel_inputs(q, k, v, g, beta, dtype) -> list:
    """The gated delta rule's inputs as flash-linear-attention's kernels take them: q, k, v and beta
    in the model's `dtype` (the kernels accumulate in float32), the log-decay g in float32."""
    return [t.to(dtype) for t in (q, k, v)] + [g, beta.to(dtype)]


def delta_rule(q, k, v, g, beta, state, dtype=torch.float32):
    """Dispatch on [B, H, T, *] float32 inputs: flash-linear-attention's kernels on CUDA when
    installed (`kernel_inputs` in the model's `dtype`, the state float32), else the recurrent form
    for a single token and the chunked form otherwise, in float32."""
    name = "fused_recurrent_gated_delta_rule" if q.shape[2] == 1 else "chunk_gated_delta_rule"
    fla = optional_kernel("fla.ops.gated_delta_rule", name) if q.is_cuda else None
    if fla is not None:
        o, state = fla(
            *(x.transpose(1, 2).contiguous() for x in kernel_inputs(q, k, v, g, beta, dtype)),
            scale=1.0,
            initial_state=state,
            output_final_state=True,
        )
        return o.transpose(1, 2), state
    return (delta_rule_recurrent if q.shape[2] == 1 else delta_rule_chunked)(
        q, k, v, g, beta, state
    )


def delta_rule_packed(q, k, v, g, beta, packing: Packing, dtype=torch.float32):
    """The gated delta rule over each sequence of a packed row from a zero state: q, k [1, N, H,
    dk], v [1, N, H, dv], g, beta [1, N, H] (float32); returns o [1, N, H, dv].
    flash-linear-attention's chunked kernel with cu_seqlens on CUDA when installed (its inputs in
    the model's `dtype`, `kernel_inputs`); else the sequences as right-padded rows (padding inert:
    g = 0, beta = 0) through `delta_rule_chunked`, in float32, so the recurrence, not the rest of
    the layer, pays for the padding of its longest sequence."""
    fla = (
        optional_kernel("fla.ops.gated_delta_rule", "chunk_gated_delta_rule") if q.is_cuda else None
    )
    if fla is not None:
        inputs = kernel_inputs(q, k, v, g, beta, dtype)
        return fla(*inputs, scale=1.0, cu_seqlens=packing.cu.long())[0]
    rows = [packing.to_rows(t).transpose(1, 2) for t in (q, k, v, g, beta)]
    zero = q.new_zeros(len(packing.lens), q.shape[2], q.shape[3], v.shape[3])
    return packing.from_rows(delta_rule_chunked(*rows, zero)[0].transpose(1, 2))


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention mixer: project q|k|v, z, b, a; causal depthwise conv (no bias) and
    SiLU over q|k|v; beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias); l2-normalized q, k
    (q also scaled by dk^-0.5), key heads shared by value heads as repeat_interleave; the gated
    delta rule; a plain (not zero-centred) RMSNorm of each head's output times silu(z); out_proj."""

    def __init__(self, cfg: QwenConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        d = cfg.hidden_size
        self.Hk = cfg.linear_k_heads
        self.Hv = cfg.linear_v_heads
        self.dk = cfg.linear_k_dim
        self.dv = cfg.linear_v_dim
        self.channels = 2 * self.Hk * self.dk + self.Hv * self.dv
        self.in_proj_qkv = Linear(d, self.channels)
        self.in_proj_z = Linear(d, self.Hv * self.dv)
        self.in_proj_b = Linear(d, self.Hv)
        self.in_proj_a = Linear(d, self.Hv)
        self.conv1d = nn.Conv1d(
            self.channels, self.channels, cfg.conv_kernel, groups=self.channels, bias=False
        )
        self.A_log = nn.Parameter(torch.zeros(self.Hv))
        self.dt_bias = nn.Parameter(torch.ones(self.Hv))
        self.norm = RMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.Hv * self.dv, d)

    def new_state(self, batch: int, max_len: int, dtype, device) -> list:
        K = self.conv1d.kernel_size[0]
        return [
            torch.zeros(batch, self.channels, K - 1, dtype=dtype, device=device),
            torch.zeros(batch, self.Hv, self.dk, self.dv, dtype=torch.float32, device=device),
        ]

    def conv(self, qkv, state, step: ForwardState):
        """The causal depthwise conv of qkv [B, C, T]: over zeros before each row, before each
        sequence of a packed row (K-1 zero columns spread ahead of each, the outputs read at the
        tokens' columns), or, with a cache, over state[0], the inputs of the row's last K-1 real
        tokens, which it then advances."""
        B, C, T = qkv.shape
        K = self.conv1d.kernel_size[0]
        if step.packing is not None:
            before = step.packing.seq * (K - 1) + torch.arange(T, device=qkv.device)
            spread = qkv.new_zeros(B, C, T + len(step.packing.lens) * (K - 1))
            spread = spread.index_copy(-1, before + K - 1, qkv)
            return F.conv1d(spread, self.conv1d.weight, groups=C).index_select(-1, before)
        full = torch.cat([qkv.new_zeros(B, C, K - 1) if state is None else state[0], qkv], -1)
        if state is not None:
            index = step.lengths[:, None, None] + torch.arange(K - 1, device=qkv.device)
            state[0].copy_(full.gather(-1, index.expand(B, C, K - 1)))
        return F.conv1d(full, self.conv1d.weight, groups=C)

    def forward(self, x, step: ForwardState):
        B, T, _ = x.shape
        state = None if step.cache is None else step.cache.layers[self.layer_idx]
        qkv = F.silu(self.conv(self.in_proj_qkv(x).transpose(1, 2), state, step)).transpose(1, 2)
        q, k, v = qkv.split([self.Hk * self.dk, self.Hk * self.dk, self.Hv * self.dv], -1)
        r = self.Hv // self.Hk
        q = (
            l2norm(q.reshape(B, T, self.Hk, self.dk).float()).repeat_interleave(r, 2)
            * self.dk**-0.5
        )
        k = l2norm(k.reshape(B, T, self.Hk, self.dk).float()).repeat_interleave(r, 2)
        v = v.reshape(B, T, self.Hv, self.dv).float()
        beta = self.in_proj_b(x).sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        if step.valid is not None:  # right padding: no decay, no write
            beta = beta * step.valid[..., None]
            g = g * step.valid[..., None]
        if step.packing is not None:
            o = delta_rule_packed(q, k, v, g, beta, step.packing, x.dtype)
        else:
            initial = (
                torch.zeros(B, self.Hv, self.dk, self.dv, device=x.device)
                if state is None
                else state[1]
            )
            inputs = (t.transpose(1, 2) for t in (q, k, v, g, beta))
            o, final = delta_rule(*inputs, initial, x.dtype)
            o = o.transpose(1, 2)
            if state is not None:
                state[1].copy_(final)
        z = self.in_proj_z(x).view(B, T, self.Hv, self.dv)
        o = (self.norm(o.to(x.dtype)) * F.silu(z.float())).to(x.dtype)
        return self.out_proj(o.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: QwenConfig, layer_idx: int):
        super().__init__()
        offset = cfg.family == "qwen3_5"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.mixer_name = (
            "linear_attn" if cfg.layer_types[layer_idx] == "linear_attention" else "self_attn"
        )
        mixer = GatedDeltaNet if self.mixer_name == "linear_attn" else Attention
        setattr(self, self.mixer_name, mixer(cfg, layer_idx))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.mlp = MLP(cfg)

    def forward(self, x, step: ForwardState):
        x = x + getattr(self, self.mixer_name)(self.input_layernorm(x), step)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class Cache:
    """Generation state of B rows. Attention layers: K and V [B, Hkv, S_max, D] after RoPE, slot s
    of a row holding its token at position s (plus its prompt's length, under a shared `prefix`).
    Gated DeltaNet layers: the last kernel-1 conv inputs [B, C, K-1] and the float32 state [B, Hv,
    dk, dv]. `lens` [B]: slots filled per row; `width`: a Python int >= max(lens), the slots a query
    may look at; `rope`: the tables of every position."""

    layers: list
    lens: torch.Tensor
    width: int
    rope: tuple
    prefix: "SharedPrefix | None" = None
    static: bool = False  # `make_static`

    def make_static(self, slots: int) -> None:
        """From here on every single-token step has the same shapes, so it can be captured (a CUDA
        graph, torch.compile): each query looks at all `slots` slots of its row (`width` stays
        slots - 1; the mask hides the slots past the row's own), and every write is in place.
        Rows must then stay: no `select`."""
        self.width, self.static = slots - 1, True

    def select(self, rows: torch.Tensor) -> None:
        """Keep rows `rows` in place (reorder, drop finished rows), one tensor at a time, each old
        one freed before the next is copied: a copy needs one more tensor, not a second cache."""
        if self.static:
            raise ValueError("Cache.select: a static cache keeps its rows")
        for layer in self.layers:
            for i, t in enumerate(layer):
                layer[i] = t.index_select(0, rows)
        self.lens = self.lens.index_select(0, rows)
        if self.prefix is not None:
            self.prefix.lens = self.prefix.lens[rows]
            self.prefix.slot = self.prefix.slot[rows]


@dataclass
class SharedPrefix:
    """U prompts that several rows continue (GRPO groups), their attention K/V [U, Hkv, P, D] kept
    once per layer in `layers`, `mask` [U, 1, 1, P] hiding their right padding. Row b continues
    prompt slot[b] // group_width from position lens[b]; slot[b] is its place in the [U,
    group_width] grid where a group's queries meet their prompt."""

    layers: dict
    mask: torch.Tensor
    lens: torch.Tensor
    slot: torch.Tensor
    group_width: int

    def attend(self, q, layer_idx: int, o, lse):
        """Attention of q [B, Hkv, GT, D] over its prompt, merged with `o` over its own slots
        (log-sum-exp `lse`)."""
        k, v = self.layers[layer_idx]
        U, Hkv, _, D = k.shape
        GT = q.shape[2]
        grid = q.new_zeros(U * self.group_width, Hkv, GT, D).index_copy_(0, self.slot, q)
        grid = (
            grid.view(U, self.group_width, Hkv, GT, D)
            .transpose(1, 2)
            .reshape(U, Hkv, self.group_width * GT, D)
        )
        po, plse = (
            t.view(U, Hkv, self.group_width, GT, -1)
            .transpose(1, 2)
            .flatten(0, 1)
            .index_select(0, self.slot)
            for t in attend(grid, k, v, self.mask)
        )
        total = torch.logaddexp(lse, plse)
        return (o * (lse - total).exp() + po * (plse - total).exp()).to(q.dtype)


# ----------------------------------------------------------------------------------------------
# The model


class Qwen(nn.Module):
    """Decoder-only Qwen, or Llama 3 (the Qwen2 skeleton with `attention_bias`, no q/k norms).
    Parameter names follow the Hugging Face checkpoint (`model.layers.0...`).
    Trainable token rows (see `train_token_rows`): `row_ids` [n] with `embed_rows` [n, d] and
    `head_rows` [n, d] (the same tensor when the embeddings are tied) replace those rows of the
    embedding and lm_head in the forward pass without touching the frozen matrices."""

    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=cfg.family == "qwen3_5")
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.register_buffer("row_ids", None)
        self.embed_rows = self.head_rows = None  # nn.Parameter when trained (train_token_rows)
        self.rows_enabled = True
        self.gradient_checkpointing = False  # recompute each layer in backward (training only)
        self.compiled_layers = None  # `compile_layers`

    @classmethod
    def from_pretrained(cls, path, dtype=None, device=None, on_meta=None) -> "Qwen":
        """Load a Hugging Face checkpoint folder (config.json + model.safetensors or the shards of
        its index) into `dtype` (default: the config's) on `device`, one tensor at a time: host
        memory holds one tensor at most. The parameters whose names `on_meta(name)` accepts are
        checked but stay on the meta device, for fsdp.shard_model to fill shard by shard."""
        path = Path(path)
        cfg = QwenConfig.from_json(path / "config.json")
        dtype = parse_dtype(dtype) or parse_dtype(cfg.dtype) or torch.float32
        device = torch.device(device or "cpu")
        files = checkpoint_files(path)
        found = {
            name: file
            for file, names in files.items()
            for name in names
            if not name.startswith(SKIPPED)
        }
        if cfg.family == "qwen3_5" and "lm_head.weight" not in found:
            # small Qwen3.5 exports tie without saying so at the top level
            cfg.tie_word_embeddings = True
        if cfg.tie_word_embeddings:
            found.pop("lm_head.weight", None)  # some exports keep the tied copy; it is not used
        with torch.device("meta"):
            model = cls(cfg)
        expected = {checkpoint_name(cfg, k): (k, v.shape) for k, v in model.state_dict().items()}
        missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
        if missing or unexpected:
            raise CheckpointError(
                f"{path}: checkpoint names disagree with config.json: missing {missing}, "
                f"unexpected {unexpected}"
            )
        for file in files:
            state = {}
            with open_safetensors(file, device) as f:
                for name in [name for name in f.keys() if found.get(name) == file]:
                    ours, shape = expected[name]
                    if tuple(f.get_slice(name).get_shape()) != tuple(shape):
                        raise CheckpointError(
                            f"{file.name}: tensor '{name}' has shape "
                            f"{f.get_slice(name).get_shape()} but config.json implies "
                            f"{list(shape)}"
                        )
                    keep_fp32 = name.endswith(("A_log", "dt_bias"))  # the decay stays in float32
                    target = torch.float32 if keep_fp32 else dtype
                    state[ours] = (
                        torch.empty(shape, dtype=target, device="meta")
                        if on_meta is not None and on_meta(ours)
                        else f.get_tensor(name).to(target)
                    )
            model.load_state_dict(state, strict=False, assign=True)
        model.source = path
        return model.eval()

    def compile_layers(self) -> None:
        """torch.compile each decoder layer's forward for the forwards without a cache (training,
        log-probabilities): Inductor fuses its norms, RoPE, activations and casts, forward and
        backward; each new input shape compiles once (a second one makes it dynamic). Decoding
        stays as it is (`generate(decode="compiled")` compiles its own step). No module hook runs
        inside: not for a sharded model."""
        self.compiled_layers = [torch.compile(layer.forward) for layer in self.model.layers]

    device = property(lambda self: self.model.embed_tokens.weight.device)
    dtype = property(lambda self: self.model.embed_tokens.weight.dtype)

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, input_ids):
        x = self.model.embed_tokens(input_ids)
        if self.embed_rows is None or not self.rows_enabled:
            return x
        hit = (input_ids[..., None] == self.row_ids).to(self.embed_rows.dtype)  # [B, T, n]
        base = self.model.embed_tokens.weight[self.row_ids].to(self.embed_rows.dtype)
        return x + (hit @ (self.embed_rows - base)).to(x.dtype)

    def logits(self, h):
        """lm_head on final hidden states h [..., d] (model dtype). A few rows on the CPU (decoding)
        go as (W h^T)^T: MKL runs it 1.4-1.8x faster than h W^T (it splits it over threads by
        vocabulary rows, too)."""
        few_rows = h.device.type == "cpu" and h.dim() == 2 and h.shape[0] <= 64
        out = (self.head_weight() @ h.T).T if few_rows else F.linear(h, self.head_weight())
        if self.head_rows is None or not self.rows_enabled:
            return out
        return out.index_copy_(-1, self.row_ids, F.linear(h, self.head_rows.to(h.dtype)))

    def hidden_states(
        self, input_ids, cache: Cache | None = None, lengths=None, packing: Packing | None = None
    ):
        """Final-norm hidden states [B, T, d]. Without a cache: a causal forward from position 0,
        or, with `packing`, of each sequence packed in the row input_ids [1, N]. With a cache: row
        b continues in slot cache.lens[b] (its position, plus its prompt's length under a shared
        prefix); `lengths` [B] (default T) counts the real tokens of each right-padded row, and
        cache.lens advances by it."""
        B, T = input_ids.shape
        if packing is not None and (cache is not None or B != 1 or len(packing.seq) != T):
            raise ValueError(
                f"hidden_states: a packed batch is one row of sum(lens) = {len(packing.seq)} "
                f"tokens and no cache, got {B} x {T}"
            )
        slots = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        if cache is not None:
            slots = slots + cache.lens[:, None]
        positions = (
            slots if cache is None or cache.prefix is None else slots + cache.prefix.lens[:, None]
        )
        positions = positions if packing is None else packing.positions[None]
        cfg = self.config
        x = self.embed(input_ids)
        width = T if packing is None else max(packing.lens)
        rope = rope_tables(width, cfg, x.dtype, x.device) if cache is None else cache.rope
        cos, sin = (table[positions, None] for table in rope)  # [B, T, 1, rot_dim]
        mask = None
        valid = None
        if cache is not None:
            if cache.width > 0 or cache.prefix is not None:
                mask = (
                    (torch.arange(cache.width + T, device=x.device) <= slots[:, :, None])
                    .to(x.dtype)
                    .log()
                )
                mask = (mask if T == 1 else mask.repeat(1, cfg.num_heads // cfg.num_kv_heads, 1))[
                    :, None
                ]
            valid = None if lengths is None else torch.arange(T, device=x.device) < lengths[:, None]
            lengths = torch.full((B,), T, device=x.device) if lengths is None else lengths
        step = ForwardState(cos, sin, cache, slots, mask, lengths, valid, packing)
        recompute = (
            self.gradient_checkpointing
            and self.training
            and torch.is_grad_enabled()
            and cache is None
        )
        compiled = cache is None and self.compiled_layers is not None
        for layer in self.compiled_layers if compiled else self.model.layers:
            x = checkpoint(layer, x, step, use_reentrant=False) if recompute else layer(x, step)
        if cache is not None:
            cache.lens += lengths  # in place, as every cache write: a captured step replays them
            cache.width += 0 if cache.static else T
        return self.model.norm(x)

    def forward(self, input_ids, cache: Cache | None = None, lengths=None, packing=None):
        """Logits [B, T, vocab] in the model dtype (see `hidden_states` for the arguments)."""
        return self.logits(self.hidden_states(input_ids, cache, lengths, packing))

    def new_cache(self, batch: int, max_len: int) -> Cache:
        layers = [
            getattr(layer, layer.mixer_name).new_state(batch, max_len, self.dtype, self.device)
            for layer in self.model.layers
        ]
        rope = rope_tables(max_len, self.config, self.dtype, self.device)
        return Cache(layers, torch.zeros(batch, dtype=torch.long, device=self.device), 0, rope)


def checkpoint_name(cfg: QwenConfig, name: str) -> str:
    """The checkpoint's name for our parameter or module `name` (Qwen3.5 image-text checkpoints keep
    the text model under model.language_model.)."""
    return cfg.weight_prefix + name.removeprefix("model.") if name.startswith("model.") else name


def checkpoint_files(path: Path) -> dict[Path, list[str]]:
    """{safetensors file: tensor names it holds} from model.safetensors or the sharded index. A
    shard must lie in the folder, symlinks resolved (a Hugging Face cache snapshot's point into
    ../../blobs)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: missing field 'weight_map'")
        root = path.resolve()
        inside = (root, root.parents[1] / "blobs") if root.parent.name == "snapshots" else (root,)
        files: dict[Path, list[str]] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or not any(
                (path / file).resolve().is_relative_to(d) for d in inside
            ):
                raise CheckpointError(
                    f"{index}: field 'weight_map.{name}' = {excerpt(file)} is not a file in {path}"
                )
            files.setdefault(path / file, []).append(name)
    elif (path / "model.safetensors").is_file():
        files = {path / "model.safetensors": None}
    else:
        raise FileNotFoundError(
            f"{path}: neither model.safetensors nor model.safetensors.index.json found"
        )
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file}: file not found (listed in {index.name})")
        if files[file] is None:
            with open_safetensors(file) as f:
                files[file] = list(f.keys())
    return files


# ----------------------------------------------------------------------------------------------
# LoRA, trainable token rows, adapters in the PEFT format


def lora_modules(model: Qwen) -> dict[str, Linear]:
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, Linear) and m.lora_A is not None
    }


def add_lora(
    model: Qwen, rank=16, alpha=32, dropout=0.0, targets=LORA_TARGETS, compute="float32"
) -> list[nn.Parameter]:
    """Freeze every base parameter and give each Linear whose name ends in one of `targets` float32
    factors `lora_A` (Kaiming-uniform, as PEFT) and `lora_B` (zeros, so the model is unchanged),
    computed in `compute` ("float32", or "model": cast to the base's dtype, `Linear`). Returns the
    new trainable parameters."""
    if compute not in ("float32", "model"):
        raise ValueError(f"add_lora: compute {excerpt(compute)} is not float32 or model")
    model.requires_grad_(False)
    params = []
    for name, m in model.named_modules():
        if isinstance(m, Linear) and name.rsplit(".", 1)[-1] in targets:
            A = torch.empty(rank, m.in_features, device=m.weight.device)
            nn.init.kaiming_uniform_(A, a=math.sqrt(5))
            m.lora_A, m.lora_B = (
                nn.Parameter(A),
                nn.Parameter(torch.zeros(m.out_features, rank, device=A.device)),
            )
            m.lora_scale, m.lora_dropout, m.lora_enabled = alpha / rank, dropout, True
            m.lora_compute = compute
            params += [m.lora_A, m.lora_B]
    if not params:
        raise ValueError(f"add_lora: no module matches targets {list(targets)}")
    model.lora_settings = {
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n in lora_modules(model)}),
    }
    return params


@contextlib.contextmanager
def lora_disabled(model: Qwen):
    """The base model (the reference policy): LoRA deltas and trainable token rows switched off; on
    exit each switch returns to its previous state, so the context nests."""
    switches = [(model, "rows_enabled")] + [
        (m, "lora_enabled") for m in lora_modules(model).values()
    ]
    previous = [getattr(owner, name) for owner, name in switches]
    try:
        for owner, name in switches:
            setattr(owner, name, False)
        yield model
    finally:
        for (owner, name), state in zip(switches, previous):
            setattr(owner, name, state)


@contextlib.contextmanager
def lora_merged(model: Qwen):
    """Decoding off LoRA's side path (two products and their casts in every adapted projection of
    every step): in the block each enabled LoRA projection computes with a weight of its own,
    W + (alpha / r) B A rounded to the model dtype (`Linear.merged_weight`), and leaves its factors
    alone. Nothing is un-merged: on exit each projection gets back its own weight, a tensor the
    block never wrote, so training's weights are bit for bit those before; the merged copies are
    freed. While the block runs they cost one more copy of the adapted weights."""
    merged = [m for m in lora_modules(model).values() if m.lora_enabled]
    weights = [m.weight for m in merged]
    try:
        with torch.no_grad():
            for m in merged:
                m.weight = nn.Parameter(m.merged_weight(), requires_grad=False)
                m.lora_enabled = False
        yield model
    finally:
        for m, weight in zip(merged, weights):
            m.weight, m.lora_enabled = weight, True


def train_token_rows(model: Qwen, token_ids) -> list[nn.Parameter]:
    """Make the embedding and lm_head rows of `token_ids` trainable (float32 copies; the frozen
    matrices are untouched until `merge_lora`). Returns the new parameters."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=model.device)
    if ids.numel() == 0 or ids.min() < 0 or ids.max() >= model.config.vocab_size:
        raise ValueError(
            f"train_token_rows: token ids {ids.tolist()} outside [0, {model.config.vocab_size})"
        )
    model.row_ids = ids
    model.embed_rows = nn.Parameter(model.model.embed_tokens.weight.detach()[ids].float())
    tied = model.lm_head is None
    model.head_rows = (
        model.embed_rows if tied else nn.Parameter(model.lm_head.weight.detach()[ids].float())
    )
    return [model.embed_rows] if tied else [model.embed_rows, model.head_rows]


def merge_lora(model: Qwen) -> Qwen:
    """Fold every LoRA delta (W += (alpha / r) B A) and the trainable token rows into the base
    weights, then remove them: the result is a plain model."""
    for m in lora_modules(model).values():
        m.weight.data = m.merged_weight()
        m.lora_A = m.lora_B = None
    for name, rows in row_targets(model):
        model.get_parameter(name).data[model.row_ids] = rows.detach().to(model.dtype)
    model.row_ids = model.embed_rows = model.head_rows = None
    model.__dict__.pop("lora_settings", None)
    return model


def row_targets(model: Qwen) -> list[tuple[str, nn.Parameter]]:
    """(base weight name, trainable rows) pairs, empty without trainable rows."""
    if model.row_ids is None:
        return []
    pairs = [("model.embed_tokens.weight", model.embed_rows)]
    return pairs if model.lm_head is None else pairs + [("lm_head.weight", model.head_rows)]


def peft_name(model: Qwen, module_name: str) -> str:
    return f"base_model.model.{checkpoint_name(model.config, module_name)}"


def save_adapter(model: Qwen, out_dir, base_model_name_or_path: str | None = None) -> None:
    """The LoRA factors as PEFT writes them (`base_model.model.<module>.lora_A.weight`), and token
    rows in its format: `trainable_token_indices` {"embed_tokens": ids, "lm_head": ids} (tied:
    embed_tokens only), `<module>.PEFT_ROWS`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    modules = lora_modules(model)
    if not modules:
        raise ValueError("save_adapter: the model has no LoRA parameters (call add_lora first)")
    tensors = {
        f"{peft_name(model, name)}.lora_{ab}.weight": getattr(m, f"lora_{ab}")
        for name, m in modules.items()
        for ab in "AB"
    }
    tensors |= {
        f"{peft_name(model, n.removesuffix('.weight'))}.{PEFT_ROWS}": r
        for n, r in row_targets(model)
    }
    indices = {
        name.split(".")[-2]: model.row_ids.tolist() for name, _ in row_targets(model)
    } or None
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        **model.lora_settings,
        "bias": "none",
        "base_model_name_or_path": base_model_name_or_path,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "trainable_token_indices": indices,
    }
    atomic_write(out / ADAPTER_WEIGHTS, tensors)
    atomic_write(out / ADAPTER_CONFIG, json.dumps(config, indent=2) + "\n")


def load_adapter(model: Qwen, path) -> Qwen:
    """Load a PEFT LoRA adapter (ours or PEFT's) into `model`, adding LoRA first when absent, and
    the token rows its `trainable_token_indices` names (one id list for embed_tokens and lm_head). A
    mismatch is an error naming both."""
    path = Path(path)
    cfg_path, weights_path = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    cfg = read_json(cfg_path)
    for key, allowed in (
        ("peft_type", ("LORA",)),
        ("bias", ("none",)),
        ("use_dora", (False,)),
        ("use_rslora", (False,)),
        ("modules_to_save", (None,)),
    ):
        if cfg.get(key, allowed[0]) not in allowed:
            raise CheckpointError(
                f"{cfg_path}: field '{key}' = {excerpt(cfg[key])} is not supported"
            )
    targets = cfg.get("target_modules")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise CheckpointError(
            f"{cfg_path}: field 'target_modules' must be a list of names, got {excerpt(targets)}"
        )
    indices = (
        {"embed_tokens": ids}
        if isinstance(ids := cfg.get("trainable_token_indices"), list)
        else ids or {}
    )
    if not (
        isinstance(indices, dict)
        and set(indices) <= {"embed_tokens", "lm_head"}
        and all(
            isinstance(v, list)
            and all(type(i) is int for i in v)
            and v == indices.get("embed_tokens")
            for v in indices.values()
        )
    ):
        raise CheckpointError(
            f"{cfg_path}: field 'trainable_token_indices' must be token ids, or the same ids for "
            f"embed_tokens and lm_head, got {excerpt(indices)}"
        )
    if not lora_modules(model):
        add_lora(
            model,
            _int(cfg, "r", str(cfg_path)),
            cfg.get("lora_alpha", 8),
            cfg.get("lora_dropout", 0.0),
            targets,
        )
    if indices:
        try:
            train_token_rows(model, indices["embed_tokens"])
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{cfg_path}: field 'trainable_token_indices': {e}") from None
    copy_tensors(
        weights_path,
        {
            f"{peft_name(model, name)}.lora_{ab}.weight": getattr(m, f"lora_{ab}")
            for name, m in lora_modules(model).items()
            for ab in "AB"
        }
        | {
            f"{peft_name(model, n.removesuffix('.weight'))}.{PEFT_ROWS}": r
            for n, r in row_targets(model)
            if n.split(".")[-2] in indices
        },
    )
    return model


def copy_tensors(file: Path, expected: dict[str, torch.Tensor]) -> None:
    """Copy each tensor of `file` into expected[name]; names and shapes must agree exactly."""
    with open_safetensors(file) as f:
        missing, unexpected = (
            sorted(set(expected) - set(f.keys())),
            sorted(set(f.keys()) - set(expected)),
        )
        if missing or unexpected:
            raise CheckpointError(
                f"{file}: tensor names disagree with the model: missing {missing}, "
                f"unexpected {unexpected}"
            )
        for name, param in expected.items():
            if f.get_slice(name).get_shape() != list(param.shape):
                raise CheckpointError(
                    f"{file}: tensor '{name}' has shape {f.get_slice(name).get_shape()}, "
                    f"the model expects {list(param.shape)}"
                )
            param.data.copy_(f.get_tensor(name))


def atomic_write(path, data: str | bytes | dict, meta: dict[str, str] | None = None) -> None:
    """Text, bytes or tensors to `.<name>.tmp` beside `path`, renamed into place, with the umask's
    permissions (safetensors' save_file makes 0600 files and leaves `.tmpXXXXXX` behind when
    killed). A temporary left by a failed or killed write is overwritten by the next write of the
    same file. A write that fails (a full disk) removes the temporary and names `path`."""
    path, tmp = Path(path), Path(path).with_name(f".{Path(path).name}.tmp")
    if isinstance(data, dict):
        data = save_tensors(
            {k: v.detach().contiguous().cpu() for k, v in data.items()},
            dict(meta or {}, format="pt"),
        )
    try:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from None


def save_merged(model: Qwen, tok: QwenTokenizer, out_dir, shard_bytes: int = 4 << 30) -> None:
    """A Hugging Face checkpoint of the model with LoRA and token rows folded in (the model is not
    changed): config, shards + index, tokenizer files; tensors the loader skipped (Qwen3.5's vision
    tower, MTP head) copied over."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lora, rows = lora_modules(model), dict(row_targets(model))
    tensors = {}
    for name, t in model.state_dict().items():
        if name in ("row_ids", "embed_rows", "head_rows") or ".lora_" in name:
            continue
        if name.removesuffix(".weight") in lora:
            t = lora[name.removesuffix(".weight")].merged_weight()
        if name in rows:
            t = t.clone().index_copy_(0, model.row_ids, rows[name].detach().to(t.dtype))
        tensors[checkpoint_name(model.config, name)] = t
    if getattr(model, "source", None) is not None:
        for file, names in checkpoint_files(model.source).items():
            with safe_open(file, framework="pt") as f:
                tensors.update({n: f.get_tensor(n) for n in names if n.startswith(SKIPPED)})
    shards, size = [{}], 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards, size = shards + [{}], 0
        shards[-1][name], size = t, size + t.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        atomic_write(out / file, shard)
        weight_map.update(dict.fromkeys(shard, file))
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": weight_map,
    }
    atomic_write(out / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
    config = json.loads(json.dumps(model.config.raw))
    text = config.get("text_config", config)
    text["vocab_size"], config["dtype"] = (
        model.config.vocab_size,
        str(model.dtype).removeprefix("torch."),
    )
    config.pop("torch_dtype", None)
    atomic_write(out / "config.json", json.dumps(config, indent=2) + "\n")
    tok.save(out)


# ----------------------------------------------------------------------------------------------
# Log-probabilities for training and evaluation


def token_logprobs(
    model: Qwen,
    input_ids,
    mask=None,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_size: int = 1024,
    packing: Packing | None = None,
):
    """logp[b, t] = log softmax(logits[b, t] / temperature)[input_ids[b, t + 1]], shape [B, T-1],
    float32: the log-probability of each next token given its prefix. `mask` [B, T-1] (bool) selects
    the positions to compute (completion tokens, say); the others are 0 and cost no lm_head work.
    Pad right-padded batches on the right and mask the padding out. The softmax runs in float32 on
    `chunk_size` positions at a time, each forming its gradient at once (`HeadLogprobs`), so no [B,
    T, vocab] float32 tensor ever exists. With entropy=True also returns the entropy [B, T-1] of
    each position's temperature-scaled distribution. With `packing`, input_ids [1, N] holds
    sequences packed one after another (`Packing`): the last token of each predicts nothing (its
    next token opens the next sequence), so a mask must leave it out; the default mask does."""
    if temperature <= 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    h = model.hidden_states(input_ids, packing=packing)[:, :-1]
    targets = input_ids[:, 1:]
    if mask is None and packing is not None:
        last = packing.cu[1:-1].long() - 1  # each sequence's last token but the row's
        mask = torch.ones_like(targets, dtype=torch.bool).index_fill_(1, last, False)
    where = (torch.ones_like(targets, dtype=torch.bool) if mask is None else mask).nonzero(
        as_tuple=True
    )
    h = h[where]
    t = targets[where]
    parts = []
    rows = model.head_rows if model.rows_enabled else None
    for i in range(0, max(len(t), 1), chunk_size):  # one empty chunk when nothing is selected
        chunk = h[i : i + chunk_size], t[i : i + chunk_size]
        parts.append(
            # a trainable head: recomputed in backward
            checkpoint(plain_logprobs, model, *chunk, temperature, use_reentrant=False)
            if model.head_weight().requires_grad
            else HeadLogprobs.apply(
                *chunk, rows, model, temperature, entropy, torch.is_grad_enabled()
            )
        )
    logp, ent = (
        torch.zeros(targets.shape, device=h.device).index_put(where, torch.cat(x))
        for x in zip(*parts)
    )
    return (logp, ent) if entropy else logp


def plain_logprobs(model: Qwen, h, targets, temperature: float):
    """(log p of each target, entropy) for hidden states h [N, d], by autograd through a float32
    log-softmax."""
    logp = F.log_softmax(model.logits(h).float() / temperature, -1)
    return logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


class HeadLogprobs(torch.autograd.Function):
    """plain_logprobs with the gradients formed in forward, through the frozen lm_head W whose rows
    model.row_ids the trainable `rows` (or None) replace. With z = logits / T and p = softmax(z): d
    log p_y / dz = onehot(y) - p, dH / dz_i = -p_i (z_i - sum_j p_j z_j), dL/dh = (dL/dz) W / T, and
    dL/dz at the rows' columns is kept for their gradient. Backward only scales these per token: two
    lm_head products where recomputation takes three (the entropy, zeros unless asked for, adds
    one), and no [N, vocab] tensor outlives the forward."""

    @staticmethod
    def forward(ctx, h, targets, rows, model, temperature, entropy, grad_enabled):
        z = model.logits(h).float().div_(temperature)
        p = z.softmax(-1)
        top, top_id = z.max(-1)
        lse = top - p.gather(1, top_id[:, None])[:, 0].log()  # p at the argmax is >= 1 / V, never 0
        logp = z.gather(1, targets[:, None])[:, 0] - lse
        mean_z = z.mul_(p).sum(-1) if entropy else lse  # sum_j p_j z_j; z now holds p_j z_j
        if grad_enabled and any(ctx.needs_input_grad):
            W = model.head_weight()
            ids = model.row_ids
            dz = (
                [z.mul_(-1 / temperature).addcmul_(p, mean_z[:, None] / temperature)]
                if entropy
                else []
            )  # dH/dlogits
            ones = torch.full_like(p[:, :1], 1 / temperature)
            # (onehot - p) / T
            dz.insert(0, p.mul_(-1 / temperature).scatter_add_(1, targets[:, None], ones))
            grads = torch.stack([d.to(W.dtype) @ W for d in dz])  # [k, N, d]
            coefs = None if rows is None else torch.stack([d[:, ids] for d in dz])  # [k, N, n]
            # those logits use rows
            grads += 0 if rows is None else coefs @ (rows.float() - W[ids].float())
            ctx.save_for_backward(h, grads, coefs)
        return logp, lse - mean_z

    @staticmethod
    def backward(ctx, d_logp, d_ent):
        h, grads, coefs = ctx.saved_tensors
        scale = torch.stack([d_logp, d_ent])[: len(grads), :, None]  # [k, N, 1]
        d_rows = None if coefs is None else (scale * coefs).sum(0).T @ h.float()
        return (scale * grads.float()).sum(0).to(h.dtype), None, d_rows, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Sampling


def apply_repetition_penalty(logits, seen, penalty: float):
    """Hugging Face semantics: a token already in the row (prompt or output) has its logit divided
    by `penalty` when positive and multiplied by it when negative."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def filter_top_k(logits, k: int):
    kth = logits.topk(min(k, logits.shape[-1]), -1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits, p: float):
    """Keep the smallest set of most likely tokens whose probability reaches p (at least one)."""
    sorted_logits, order = logits.sort(-1)
    drop_sorted = sorted_logits.softmax(-1).cumsum(-1) <= 1 - p
    drop_sorted[:, -1] = False
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def sample_next(logits, temperature, top_k, top_p, uniform):
    """Next tokens [B] from float32 logits [B, V]: the first maximum at temperature 0, else a draw
    from softmax(logits / temperature) restricted by top-k then top-p, by inverse CDF: the first
    token whose cumulative probability exceeds `uniform` [B] (float64 in [0, 1), so the sum cannot
    round past the end)."""
    if temperature == 0:
        return logits.max(-1).indices  # argmax, cheaper on the CPU
    logits = logits / temperature
    logits = filter_top_k(logits, top_k) if top_k > 0 else logits
    cdf = (filter_top_p(logits, top_p) if top_p < 1.0 else logits).softmax(-1).double().cumsum(-1)
    return torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)[:, 0]


def decode_logits(model: Qwen, token, cache: Cache, live):
    """One decode step: float32 next-token logits [B, V] after feeding `token` [B] to the rows of
    `cache`; a row not `live` is frozen (nothing advances: its slot count, its DeltaNet state)."""
    return model.logits(model.hidden_states(token[:, None], cache, live.long())[:, 0]).float()


@functools.cache
def compiled_decode_logits():
    """decode_logits through torch.compile (Inductor: the norms, RoPE, mask and shared-prefix merge
    fused into fewer kernels), made once per process so that its compiled graphs are reused."""
    return torch.compile(decode_logits)


class CapturedStep:
    """`step(token, live) -> logits` of a static cache (`Cache.make_static`) on CUDA, captured as a
    CUDA graph: the first call runs the step eagerly on a side stream (real work, which also warms
    up cuBLAS, resolves optional kernels and compiles), then captures it; later calls copy their
    inputs into the graph's own tensors and replay it, a whole layer stack for one launch. The
    logits returned are the graph's output tensor, overwritten by the next call."""

    def __init__(self, model: Qwen, cache: Cache, fn):
        self.model, self.cache, self.fn = model, cache, fn
        self.graph = None

    def __call__(self, token, live):
        if self.graph is not None:
            self.token.copy_(token)
            self.live.copy_(live)
            self.graph.replay()
            return self.logits
        self.token, self.live = token.clone(), live.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            first = self.fn(self.model, self.token, self.cache, self.live)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.fn(self.model, self.token, self.cache, self.live)
        return first


DECODE = ("auto", "eager", "static", "compiled")


def resolve_decode(decode: str, device) -> str:
    """The decode step `generate` runs on `device` for the setting `decode` (DECODE): "auto" is
    "static" on CUDA (one CUDA graph a step: 6.2x eager on an H200, bench/RESULTS.md) and "eager"
    elsewhere (on a CPU the static step is no faster); the others are themselves."""
    if decode != "auto":
        return decode
    return "static" if torch.device(device).type == "cuda" else "eager"


def compile_problem(device: str | None) -> str | None:
    """Why torch.compile cannot build the decode step on `device` (default: CUDA when available),
    or None: Inductor needs Triton on CUDA, and on the CPU a C++ compiler that builds a shared
    library (its own search: $CXX, then g++), tried here on an empty program."""
    import subprocess
    import tempfile

    if (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
        from torch.utils._triton import has_triton

        return None if has_triton() else "torch.compile on CUDA needs Triton, not installed"
    from torch._inductor import cpp_builder, exc

    try:
        compiler = cpp_builder.get_cpp_compiler()
        with tempfile.TemporaryDirectory() as folder:
            subprocess.run(
                [compiler, "-x", "c++", "-shared", "-fPIC", "-o", f"{folder}/probe.so", "-"],
                input=b"int probe() { return 0; }\n",
                capture_output=True,
                check=True,
                timeout=120,
            )
    except exc.InvalidCxxCompiler:
        return "torch.compile on the CPU needs a C++ compiler ($CXX or g++): none found"
    except (OSError, subprocess.SubprocessError) as e:
        return f"torch.compile on the CPU needs a C++ compiler that works: {compiler} failed ({e})"
    return None


def decode_step(model: Qwen, cache: Cache, decode: str):
    """The decode step `generate` runs, step(token, live) -> logits (`decode_logits`): "eager" as
    is; "static" on a static cache, captured as a CUDA graph on CUDA (`CapturedStep`), run as is on
    the CPU; "compiled" the same through torch.compile (`compiled_decode_logits`)."""
    fn = compiled_decode_logits() if decode == "compiled" else decode_logits
    if decode == "eager" or not cache.lens.is_cuda:
        return lambda token, live: fn(model, token, cache, live)
    return CapturedStep(model, cache, fn)


@torch.inference_mode()
def generate(
    model: Qwen,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    repetition_penalty: float = 1.0,
    eos_token_ids=(),
    seed: int | None = None,
    return_logprobs: bool = False,
    max_rows: int | None = None,
    compact_below: float = 0.5,
    decode: str = "eager",
):
    """Sample continuations of token-id prompts of any lengths; returns the new tokens of each
    prompt (ending with the EOS token when one was produced), and with return_logprobs=True also
    each token's log-probability under log_softmax(logits / temperature) (raw logits when greedy):
    the same quantity `token_logprobs` computes, before penalty and top-k/top-p filtering.

    The KV cache holds at most `max_rows` rows (default all; the rest run in later chunks) of
    longest prompt + max_new_tokens slots; identical prompts (a GRPO group) in a chunk are prefilled
    once and their K/V kept once (SharedPrefix), each row then holding only its max_new_tokens. A
    row that ends stays in the batch, frozen (nothing written, its cache not advanced), until fewer
    than `compact_below` of the cache's rows are live (0: never; 1: at any end); then the cache
    keeps only the live rows, so B rows are copied O(log B) times. Ends are read on the host (a GPU
    sync) only every FINISHED_CHECK_EVERY steps, so a batch may run a few steps past its last end.
    Row i samples step t with the uniform U[i, t] of a table drawn up front (from `seed` when
    given): its tokens depend on its prompt, i and the settings, not on the other rows, on max_rows
    or on compaction.

    `decode` (DECODE, `decode_step`): "eager" runs each step's operators one by one; "static" makes
    the cache static after the prefill (`Cache.make_static`: every step the same shapes, no
    compaction, each query over all of its row's slots) and on CUDA replays the step as one CUDA
    graph; "compiled" also runs it through torch.compile; "auto" is static on CUDA, eager elsewhere
    (`resolve_decode`). The tokens are the same (greedy: equal;
    sampled: up to float rounding of the logits)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: prompts must be a non-empty list of non-empty token lists")
    if (
        temperature < 0
        or not 0 < top_p <= 1
        or top_k < 0
        or repetition_penalty <= 0
        or max_new_tokens < 1
        or not 0 <= compact_below <= 1
        or (max_rows is not None and max_rows < 1)
        or decode not in DECODE
    ):
        raise ValueError(
            f"generate: invalid settings {temperature=} {top_p=} {top_k=} {repetition_penalty=} "
            f"{max_new_tokens=} {max_rows=} {compact_below=} {decode=}"
        )
    decode = resolve_decode(decode, model.device)
    rng = torch.Generator().manual_seed(seed) if seed is not None else None
    uniform = (
        torch.rand(len(prompts), max_new_tokens, generator=rng, dtype=torch.float64)
        if temperature > 0
        else torch.zeros(len(prompts), max_new_tokens)
    )  # greedy leaves the global RNG alone
    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=model.device)
    n = max_rows or len(prompts)
    params = SamplingParams(
        temperature, top_p, top_k, repetition_penalty, eos, return_logprobs, compact_below, decode
    )
    chunks = [
        generate_rows(model, prompts[i : i + n], uniform[i : i + n].to(model.device), params)
        for i in range(0, len(prompts), n)
    ]
    tokens = [t for c in chunks for t in c[0]]
    logps = [lp for c in chunks for lp in c[1]]
    return (tokens, logps) if return_logprobs else tokens


@dataclass(frozen=True)
class SamplingParams:
    """How `generate` samples, checked there (`eos`: a tensor of the EOS ids on the model's
    device; `decode` resolved)."""

    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    eos: torch.Tensor
    return_logprobs: bool
    compact_below: float
    decode: str


def generate_rows(model, prompts, uniform, params: SamplingParams):
    """`generate` for rows that share one cache; uniform [rows, max_new_tokens] on the model's
    device. `rows`: the prompt of each cache row (uniform, live, token and seen follow the cache
    rows)."""
    temperature, top_p, top_k = params.temperature, params.top_p, params.top_k
    repetition_penalty, eos, decode = params.repetition_penalty, params.eos, params.decode
    return_logprobs, compact_below = params.return_logprobs, params.compact_below
    device = model.device
    max_new_tokens = uniform.shape[1]
    unique = {}
    group = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
    row_of = torch.tensor(group, device=device)
    shared = len(unique) < len(prompts)
    lens = torch.tensor([len(p) for p in unique], device=device)
    # right padding repeats a prompt's first token: harmless, and already "seen"
    width = int(lens.max())
    ids = torch.tensor([list(p) + [p[0]] * (width - len(p)) for p in unique], device=device)
    cache = model.new_cache(len(unique), width + (0 if shared else max_new_tokens))
    h = model.hidden_states(ids, cache, lens)[torch.arange(len(unique), device=device), lens - 1]
    logits = model.logits(h)[row_of].float()
    if shared:
        cache = share_prompts(model, cache, group, max_new_tokens)
    if decode != "eager":
        cache.make_static(max_new_tokens if shared else width + max_new_tokens)
        compact_below = 0.0
    step_logits = decode_step(model, cache, decode)
    penalize = repetition_penalty != 1.0
    seen = (
        torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids[row_of], True)
        if penalize
        else None
    )
    out = torch.full((len(prompts), max_new_tokens), -1, dtype=torch.long, device=device)
    out_logp = torch.zeros(out.shape, device=device)
    rows = torch.arange(len(prompts), device=device)
    live = torch.ones(len(prompts), dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        if return_logprobs:
            logp = (logits / temperature if temperature > 0 else logits).log_softmax(-1)
        if penalize:
            logits = apply_repetition_penalty(logits, seen, repetition_penalty)
        token = sample_next(logits, temperature, top_k, top_p, uniform[:, step])
        out[rows, step] = token.where(live, -1)
        if return_logprobs:  # a frozen row's value lies past its end: never read
            out_logp[rows, step] = logp.gather(-1, token[:, None])[:, 0]
        live &= ~torch.isin(token, eos)
        # a host sync
        n_live = int(live.sum()) if (step + 1) % FINISHED_CHECK_EVERY == 0 else len(live)
        if step == max_new_tokens - 1 or n_live == 0:
            break
        if n_live < compact_below * len(live):
            cache.select(keep := live.nonzero()[:, 0])
            rows = rows[keep]
            live = live[keep]
            token = token[keep]
            uniform = uniform[keep]
            seen = seen[keep] if penalize else None
        if penalize:
            seen[torch.arange(len(token), device=device), token] = True
        logits = step_logits(token, live)
    tokens = [[t for t in row if t >= 0] for row in out.tolist()]
    return tokens, [row[: len(t)] for t, row in zip(tokens, out_logp.tolist())]


def share_prompts(model: Qwen, cache: Cache, group: list[int], new_slots: int) -> Cache:
    """The cache of rows that continue the prompts prefilled in `cache` (row b: prompt group[b]):
    the prompts' attention K/V become a SharedPrefix, each row gets `new_slots` slots of its own,
    and copies of the Gated DeltaNet states."""
    device = model.device
    P = cache.width
    cfg = model.config
    group_width = max(map(group.count, group))  # the most rows continuing one prompt
    rows = torch.tensor(group, device=device)
    slot = [u * group_width + group[:b].count(u) for b, u in enumerate(group)]
    attention = {
        i: state for i, state in enumerate(cache.layers) if cfg.layer_types[i] == "full_attention"
    }
    layers = [
        getattr(layer, layer.mixer_name).new_state(len(group), new_slots, model.dtype, device)
        if i in attention
        else [t.index_select(0, rows) for t in cache.layers[i]]
        for i, layer in enumerate(model.model.layers)
    ]
    mask = (
        (torch.arange(P, device=device) < cache.lens[:, None]).to(model.dtype).log()[:, None, None]
    )
    prefix = SharedPrefix(
        attention, mask, cache.lens[rows], torch.tensor(slot, device=device), group_width
    )
    rope = rope_tables(P + new_slots, cfg, model.dtype, device)
    return Cache(layers, torch.zeros(len(group), dtype=torch.long, device=device), 0, rope, prefix)


# ----------------------------------------------------------------------------------------------
# Special tokens (the tokenizer and ChatML: tokenizer.py)


def add_special_tokens(model: Qwen, tok: QwenTokenizer, tokens: list[str]) -> list[int]:
    """Add `tokens` as special tokens; returns their ids. A new id takes a spare embedding row when
    the vocabulary is padded (Qwen's is), else the embedding and lm_head grow; new rows start at the
    mean of the existing tokens' rows."""
    n_before = len(tok)
    tok.tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in tokens]
    )
    ids = [tok.token_id(t) for t in tokens]
    new = [i for i in ids if i >= n_before]
    if not new:
        return ids
    rows = max(max(new) + 1, model.config.vocab_size)
    with torch.no_grad():
        for owner in (model.model.embed_tokens, model.lm_head):
            if owner is not None:
                old = owner.weight
                weight = torch.cat(
                    [old.data, old.data.new_zeros(rows - old.shape[0], old.shape[1])]
                )
                weight[new] = old.data[:n_before].float().mean(0).to(old.dtype)
                owner.weight = nn.Parameter(weight, requires_grad=old.requires_grad)
    model.model.embed_tokens.num_embeddings = rows
    if model.lm_head is not None:
        model.lm_head.out_features = rows
    model.config.vocab_size = rows
    return ids
