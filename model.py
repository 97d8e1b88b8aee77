"""Qwen2/2.5, Qwen3 and Qwen3.5 in plain PyTorch: config, forward, safetensors loading, tokenizer
and chat format, LoRA (inject, disable, merge, PEFT-format save/load), trainable special-token rows,
KV cache and batched sampling. Imports nothing from the project."""
