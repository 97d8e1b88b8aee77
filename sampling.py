"""How completions are decoded outside GRPO's rollouts, shared by evaluation, SFT's checkpoint
selection and the data-preparation scripts: the decoding settings (`SamplingConfig`), completions of
chat prompts from an in-process model (`sample_completions`), and a served model's endpoint with
those settings (`endpoint_config`)."""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

from http_client import JudgeConfig


@dataclass
class SamplingConfig:
    """How completions are decoded. The paper's sampling table (Table 7) was lost in extraction: the
    defaults are Qwen's published thinking-mode settings (temperature 0.6, top-p 0.95, top-k 20)."""

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20  # 0: no top-k truncation
    repetition_penalty: float = 1.0
    max_new_tokens: int = 8192
    # None: the chat template's default (Qwen3 and Qwen3.5 think)
    enable_thinking: bool | None = None


def sampling_from(settings, enable_thinking: bool | None) -> SamplingConfig:
    """The SamplingConfig of a config section that names temperature, top_p, top_k and
    max_new_tokens itself (sft.py's `selection`, prepare/traces.py's config)."""
    return SamplingConfig(
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        max_new_tokens=settings.max_new_tokens,
        enable_thinking=enable_thinking,
    )


def sample_completions(
    model,
    tok,
    prompts: list[list[dict]],
    keys: list[str],
    sampling: SamplingConfig,
    n: int = 1,
    seed: int = 0,
    batch_size: int = 32,
    on_batch=None,
) -> list[list[str]]:
    """`n` completions of each chat prompt (`tok.chat_ids`) from an in-process model
    (model.generate), longest prompts first, `batch_size` completions per call; returns them per
    prompt, special tokens kept, EOS removed. `keys` name the prompts (example ids): a batch's seed
    comes from its first key, so the samples do not depend on what else is sampled and a resumed run
    redraws exactly the batches an uninterrupted one would have drawn. `on_batch(indices,
    completions)` is called after each batch."""
    from model import generate  # torch only where a model runs

    ids = [tok.chat_ids(messages, enable_thinking=sampling.enable_thinking) for messages in prompts]
    order = sorted(range(len(prompts)), key=lambda i: (-len(ids[i]), i))
    eos, per_batch = set(tok.eos_token_ids), max(1, batch_size // n)
    out: list[list[str]] = [[] for _ in prompts]
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), per_batch):
            chunk = order[start : start + per_batch]
            rows = generate(
                model,
                [ids[i] for i in chunk for _ in range(n)],
                sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                repetition_penalty=sampling.repetition_penalty,
                eos_token_ids=tuple(eos),
                seed=zlib.crc32(f"{seed}/{keys[chunk[0]]}".encode()),
            )
            texts = [tok.decode(row[:-1] if row and row[-1] in eos else row) for row in rows]
            for j, i in enumerate(chunk):
                out[i] = texts[j * n : (j + 1) * n]
            if on_batch is not None:
                on_batch(chunk, [out[i] for i in chunk])
    finally:
        model.train(was_training)
    return out


def endpoint_config(endpoint: JudgeConfig, sampling: SamplingConfig) -> JudgeConfig:
    """The endpoint's connection settings with the evaluation's decoding. No per-request seed: the
    server's own seed applies (the paper: one engine, seed zero)."""
    extra = {
        "chat_template_kwargs": None
        if sampling.enable_thinking is None
        else {"enable_thinking": sampling.enable_thinking},
        "repetition_penalty": None
        if sampling.repetition_penalty == 1.0
        else sampling.repetition_penalty,
    }
    return dataclasses.replace(
        endpoint,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k or None,
        sampling=extra | endpoint.sampling,
    )
