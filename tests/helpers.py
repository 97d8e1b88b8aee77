"""The test suite's shared plumbing, as plain functions and constants (the fixtures are in
conftest.py). Test modules import from here, never from one another: pytest's default import mode
puts tests/ on sys.path, so `from helpers import ...` finds this file.

- write_tiny_checkpoint: the one builder of a tiny random-weight Qwen3 checkpoint with a word-level
  tokenizer; grpo_checkpoint and sft_checkpoint are its two presets (test_grpo's and test_sft's tiny
  models)
- read_jsonl: the records of a JSONL file
- model.py against transformers: CONFIGS, hf_checkpoint, randomize, ids, close, hf_greedy,
  check_cache_against_full_forward, Q35_TEXT
- model.py alone: FAMILIES, random_model (tiny random models of every family, no transformers)
- gloo ranks: gloo_rank (an mp.spawn target's torchrun environment)
- sft.py runs: SFT_WORDS, sad_row, write_rows, config_file, config, tensors, metrics, rank_run
- grpo.py runs: write_examples, run_config, full_policy, updated_weights (a full-parameter GRPO
  update), fixed_groups, kill_after_checkpoint, assert_same_run
- the dialogue demo: DEMO, DIALOGUE_WORDS
- report_to sinks: assert_sinks_hold_metrics (TensorBoard event files, a W&B offline run)
- stand-in HTTP servers: JSONHandler (a quiet handler that answers bytes as JSON), serve (on
  127.0.0.1 in a thread)
"""

import json
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from instruments import gloo_rank
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

import model as M
from tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]


def read_jsonl(path) -> list[dict]:
    """The records of a JSONL file, split on "\\n" only (U+2028 and other str.splitlines breaks may
    sit in a record)."""
    return [
        json.loads(line)
        for line in Path(path).read_text(encoding="utf-8").split("\n")
        if line.strip()
    ]


# ---------------------------------------------------------------------- the tiny checkpoint builder


def write_tiny_checkpoint(
    path: Path,
    words,
    specials,
    config: dict,
    *,
    added=(),
    pre_tokenizer="whitespace_split",
    wordpiece_decoder=False,
    pad_token="<|endoftext|>",
    eos_token="<|im_end|>",
    weights="spread",
    seed=0,
) -> Path:
    """A tiny random-weight Qwen3 checkpoint in `path`, with a word-level tokenizer: `words` in
    order (ids 0..; put "[UNK]" among them), then the ordinary `added` tokens, then the `specials`;
    `pre_tokenizer` "whitespace_split" (split on whitespace only) or "whitespace" (words and
    punctuation apart); with `wordpiece_decoder`, decoding joins words with spaces.
    tokenizer_config.json names `eos_token` (ChatML's) and `pad_token` (none when None). `config`
    holds the model's sizes (vocab_size None: the tokenizer's size). The weights, drawn after
    torch.manual_seed(seed), are one of three recipes:
      "spread": model.py's Qwen, every matrix N(0, 0.3), every vector N(1, 0.05); saved by
        model.save_merged
      "wide_head": model.py's Qwen as initialized, lm_head N(0, 1) (logits wide enough to memorize a
        few rows); its state dict saved as model.safetensors
      "transformers": transformers' Qwen3ForCausalLM(Qwen3Config(**config)) as initialized plus
        N(0, 0.5) noise on every parameter; saved by save_pretrained (its config.json)"""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = {
        "whitespace_split": pre_tokenizers.WhitespaceSplit,
        "whitespace": pre_tokenizers.Whitespace,
    }[pre_tokenizer]()
    if wordpiece_decoder:
        tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    if added:
        tok.add_tokens(list(added))
    tok.add_special_tokens(list(specials))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": eos_token, **({"pad_token": pad_token} if pad_token else {})})
    )
    config = {
        k: (tok.get_vocab_size() if k == "vocab_size" and v is None else v)
        for k, v in config.items()
    }
    torch.manual_seed(seed)
    if weights == "transformers":
        transformers = pytest.importorskip("transformers")
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config))
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(torch.randn(p.shape) * 0.5)
        hf.float().save_pretrained(path)
        return path
    (path / "config.json").write_text(json.dumps(config))
    model = M.Qwen(M.QwenConfig.from_dict(dict(config)))
    if weights == "spread":
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.3 if p.dim() > 1 else 0.05).add_(1.0 if p.dim() == 1 else 0.0)
        M.save_merged(model, load_tokenizer(path), path)
    elif weights == "wide_head":
        torch.nn.init.normal_(model.lm_head.weight, std=1.0)
        save_file(
            {k: v.contiguous() for k, v in model.state_dict().items()},
            str(path / "model.safetensors"),
        )
    else:
        raise ValueError(f"weights: {weights!r}")
    return path


# a tiny model's config and tokens as Llama 3's: RoPE's llama3 scaling, its chat tokens (in place of
# ChatML's), <|eot_id|> the EOS, no pad token
LLAMA_TINY = dict(
    model_type="llama",
    rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
)
LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
LLAMA_TOKENS = dict(pad_token=None, eos_token="<|eot_id|>")
# test_grpo's tiny model: every word of the prompts that
# is not in `words` is [UNK]; an answer line is one token
GRPO_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<evidence>",
    "</evidence>",
]
GRPO_WORDS = [
    "user",
    "assistant",
    "\n\n",
    "I",
    "won",
    "the",
    "prize",
    "lost",
    "my",
    "keys",
    "today",
    "so",
    "happy",
    "she",
    "said",
    "that",
]
# one token each
ANSWERS = ["</think>\nAnswer: joy", "</think>\nAnswer: sadness", "</think>\nAnswer: anger"]


def grpo_checkpoint(path: Path, words=GRPO_WORDS, seed=0, hidden=32, llama=False) -> Path:
    """A random Qwen3 checkpoint (with `llama`, Llama 3: LLAMA_TINY, LLAMA_TOKENS) with a word-level
    tokenizer: every word of the prompts that is not in `words` is [UNK]; an answer line is a single
    token."""
    config = dict(
        model_type="qwen3",
        vocab_size=None,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rope_theta=1e4,
        tie_word_embeddings=False,
    )
    if llama:
        return write_tiny_checkpoint(
            path,
            ["[UNK]", *words, *ANSWERS],
            LLAMA_SPECIALS + GRPO_SPECIALS[3:],  # the think and evidence tags
            config | LLAMA_TINY,
            seed=seed,
            **LLAMA_TOKENS,
        )
    return write_tiny_checkpoint(
        path, ["[UNK]", *words, *ANSWERS], GRPO_SPECIALS, config, seed=seed
    )


def sft_adapter(base: Path, out: Path) -> Path:
    """An SFT adapter for the tiny GRPO checkpoint as sft.py leaves one: LoRA on every projection
    and trained <evidence> rows, all far from zero."""
    model = M.Qwen.from_pretrained(base)
    ids = M.add_special_tokens(model, load_tokenizer(base), ["<evidence>", "</evidence>"])
    params = M.add_lora(model, rank=4, alpha=8) + M.train_token_rows(model, ids)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    M.save_adapter(model, out)
    return out


# test_sft's tiny model
TINY = dict(
    model_type="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rope_theta=1e4,
    tie_word_embeddings=False,
)
SFT_WORDS = (
    "[UNK] Answer : , . ! ? Ann Bo Cy Di is sad glad says so the exam I failed again We won bid "
    "knew you would How did it go today Oh no Whatever hello sadness joy anger neutral Joy Trust"
).split()
SFT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def sft_checkpoint(path: Path) -> Path:
    """A random qwen3 model (vocab 64: spare rows for the evidence tags) and a word-level tokenizer
    whose <think> / </think> are ordinary added tokens and whose ChatML tokens are special, as
    Qwen's."""
    return write_tiny_checkpoint(
        path,
        SFT_WORDS,
        [AddedToken(t, special=True, normalized=False) for t in SFT_SPECIALS],
        TINY,
        added=[
            AddedToken("<think>", special=False, normalized=False),
            AddedToken("</think>", special=False, normalized=False),
        ],
        pre_tokenizer="whitespace",
        weights="wide_head",
    )


def llama_sft_checkpoint(path: Path) -> Path:
    """sft_checkpoint's words and sizes as a Llama 3 model (LLAMA_TINY, LLAMA_TOKENS)."""
    return write_tiny_checkpoint(
        path,
        SFT_WORDS,
        [AddedToken(t, special=True, normalized=False) for t in LLAMA_SPECIALS],
        TINY | LLAMA_TINY,
        added=[
            AddedToken("<think>", special=False, normalized=False),
            AddedToken("</think>", special=False, normalized=False),
        ],
        pre_tokenizer="whitespace",
        weights="wide_head",
        **LLAMA_TOKENS,
    )


# -------------------------------------------------------------------- model.py against transformers


def _transformers():
    return pytest.importorskip("transformers")


TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
CONFIGS = {
    "qwen2": lambda: _transformers().Qwen2Config(
        **TEXT,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False,
    ),
    "qwen3_tied": lambda: _transformers().Qwen3Config(
        **TEXT,
        head_dim=32,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    # odd sizes, 3 query heads per KV head, head_dim unrelated to hidden/heads, attention bias on
    "qwen3_odd": lambda: _transformers().Qwen3Config(
        **dict(
            TEXT,
            vocab_size=211,
            hidden_size=48,
            intermediate_size=71,
            num_attention_heads=6,
            num_key_value_heads=2,
        ),
        head_dim=24,
        attention_bias=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    ),
    # Llama 3.1's layout (no head_dim key, no bias, untied) with its RoPE scaling, sized so the
    # tiny model's frequencies fall in all three bands: wavelengths 6.3 (kept), 19.9 and 62.8
    # (interpolated), 199 and above (divided by 8)
    "llama": lambda: _transformers().LlamaConfig(
        **dict(TEXT, rms_norm_eps=1e-5),
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 1e4,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    ),
}
Q35_TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)


# tiny configs of the four families model.py reads, for models built without transformers
FAMILIES = {
    "qwen2": dict(TINY, model_type="qwen2"),
    "qwen3": TINY,
    "qwen3_5": dict(Q35_TEXT, model_type="qwen3_5_text", tie_word_embeddings=False),
    "llama": TINY | LLAMA_TINY,
}


def random_model(family: str, seed=0) -> M.Qwen:
    """model.py's Qwen of FAMILIES[family], every matrix N(0, 0.3) and every vector N(1, 0.05)
    (write_tiny_checkpoint's "spread" recipe), float32, in eval mode."""
    torch.manual_seed(seed)
    model = M.Qwen(M.QwenConfig.from_dict(dict(FAMILIES[family])))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.05).add_(1.0 if p.dim() == 1 else 0.0)
    return model.eval()


def prompt_sampler(model, group_size: int, max_new_tokens: int, temperature: float, decode: str):
    """rollout.PromptSampler over `model` with only the settings its `complete` reads (no EOS)."""
    from rollout import PromptSampler

    rollout = SimpleNamespace(
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        repetition_penalty=1.0,
        decode=decode,
    )
    return PromptSampler(model, SimpleNamespace(eos_token_ids=()), rollout, None, None, 1)


def randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() == 1 else 0.02))


def hf_checkpoint(tmp_path_factory, name):
    """transformers' model of CONFIGS[name], every parameter moved off its init, and the folder it
    is saved in."""
    path = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    hf = _transformers().AutoModelForCausalLM.from_config(CONFIGS[name]()).float().eval()
    randomize(hf)
    hf.save_pretrained(path)
    return hf, path


def ids(batch, length, vocab=200, seed=1):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def close(a, b, tol=1e-4):
    assert a.shape == b.shape
    assert (a - b).abs().max().item() < tol, (a - b).abs().max().item()


def hf_greedy(hf, prompt, n, eos):
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=eos or None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def check_cache_against_full_forward(model, lengths, steps, chunk):
    """Prefill rows of `lengths` real tokens right-padded with other tokens, decode `steps` single
    tokens, then one `chunk`-token continuation: every real position's logits must equal those of
    a full forward of that row alone (so padding never reaches the cache or the state)."""
    width = max(lengths)
    seqs = ids(len(lengths), width + steps + chunk, seed=3)
    padded = torch.where(
        torch.arange(width) < torch.tensor(lengths)[:, None], seqs[:, :width], ids(1, width, seed=4)
    )
    with torch.no_grad():
        cache = model.new_cache(len(lengths), width + steps + chunk)
        prefill = model(padded, cache, torch.tensor(lengths))
        decoded = [
            model(torch.stack([seqs[r, n + i] for r, n in enumerate(lengths)])[:, None], cache)
            for i in range(steps)
        ]
        continued = model(
            torch.stack([seqs[r, n + steps : n + steps + chunk] for r, n in enumerate(lengths)]),
            cache,
        )
        for r, n in enumerate(lengths):
            ref = model(seqs[r : r + 1, : n + steps + chunk])[0]
            close(prefill[r, :n], ref[:n])
            close(torch.stack([d[r, 0] for d in decoded]), ref[n : n + steps])
            close(continued[r], ref[n + steps :])


# ----------------------------------------------------------------------------- sft.py runs


def conversation(i: int):
    from data import Turn

    return [
        Turn("Ann", f"How did it go today {'!' * (i + 1)}"),
        Turn("Bo", "I failed the exam again ."),
        Turn("Ann", "Oh no ."),
        Turn("Bo", "Whatever ."),
    ]


def sad_row(i: int, task="meld_emotion", label="sadness", short_prompt=True) -> dict:
    """An example with a completion; with short_prompt, a few words stand in for the task's long
    prompt."""
    from data import Example
    from dataset import example_to_json

    completion = (
        f"<think>\nBo says <evidence>I failed the exam again</evidence> so Bo is sad "
        f".\n</think>\n\nAnswer: {label}"
    )
    example = Example(id=f"ex-{i}", task=task, turns=conversation(i), target=3, labels=[label])
    prompt = (
        [{"role": "user", "content": f"How is {SFT_WORDS[7 + i % 4]} ?"}] if short_prompt else None
    )
    return (
        example_to_json(example)
        | {"completion": completion}
        | ({"prompt": prompt} if prompt else {})
    )


def write_rows(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config_file(checkpoint, tmp_path, **overrides) -> Path:
    """A config.yaml in tmp_path over four rows, for a short CPU run; `a.b=value` overrides nest."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = overrides.get("data") or str(
        write_rows(tmp_path / "rows4.jsonl", [sad_row(i) for i in range(4)])
    )
    raw = dict(
        model=str(checkpoint),
        data=data,
        output_dir=str(tmp_path / "run"),
        lr=1e-2,
        epochs=1,
        rows_per_update=1,
        lora={"rank": 4, "alpha": 8, "dropout": 0.0},
        selection={"per_task": 0},
    )
    for key, value in overrides.items():
        node, *path = key.split(".")
        if path:
            raw[node] = {**raw.get(node, {}), path[0]: value}
        else:
            raw[node] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def config(checkpoint, tmp_path, **overrides):
    import sft

    return sft.parse_cli(sft.SFTConfig, [str(config_file(checkpoint, tmp_path, **overrides))])


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def rank_run(rank, port, cfg, world_size=2):
    """One of `world_size` gloo ranks of sft.train(cfg) (an mp.spawn target)."""
    import sft

    gloo_rank(rank, port, world_size)
    sft.train(cfg)
    torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- grpo.py runs


def write_examples(path: Path, n=4) -> Path:
    texts = [
        "I won the prize today",
        "I lost my keys today",
        "she said that I won",
        "so happy that I won",
    ]
    lines = []
    for i in range(n):
        turns = [
            {"speaker": "A", "text": texts[i % 4]},
            {"speaker": "B", "text": texts[(i + 1) % 4]},
        ]
        lines.append(
            json.dumps(
                {
                    "id": f"ex{i}",
                    "task": "meld_emotion",
                    "turns": turns,
                    "target": 1,
                    "labels": ["joy"],
                    "difficulty": i / n,
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def run_config(tmp_path, assets, judge_url, **overrides) -> Path:
    base, examples = assets
    cfg = {
        "output_dir": str(tmp_path / "run"),
        "train_data": [str(examples)],
        "updates": 3,
        "seed": 1,
        "model": {"path": str(base), "dtype": "float32", "device": "cpu"},
        "reward": {"name": "clue"},
        "judge": {"base_url": judge_url, "concurrency": 8, "retries": 0, "timeout": 10},
        "lora": {"rank": 4, "alpha": 8},
        "rollout": {"prompts_per_update": 2, "group_size": 4, "max_new_tokens": 6},
        "filtering": {"resamples": 1, "replacements": 1},
        "loss": {"micro_batch_size": 3},
        "optim": {"lr": 1e-2, "warmup_updates": 1, "hold_until": 100},
        "save_every": 1,
    }
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = cfg
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def full_policy(base, **overrides):
    """A full-parameter GRPO policy and its reference on the tiny checkpoint; returns (cfg, policy,
    reference)."""
    settings = {
        "finetune": "full",
        "lora": "null",
        "save_merged": "false",
        "model.sft_adapter": "null",
        "model.path": str(base),
        "model.dtype": "float32",
        "optim.grad_clip": "1e9",
        "seed": "3",
        "loss.beta": "0.04",
        "loss.passes": "2",
    } | overrides
    import distributed as D
    import grpo
    from config import load_config

    cfg = load_config(
        REPO / "configs" / "clue_qwen3_5_9b.yaml",
        [f"{k}={v}" for k, v in settings.items()],
        grpo.GRPOConfig,
    )
    ranks = D.setup_distributed("cpu")
    policy, _ = grpo.build_policy(cfg, ranks)
    reference = grpo.build_policy(cfg, ranks, like=policy)[0]
    # one frozen copy a rank
    assert reference.model.embed_tokens.weight is policy.model.embed_tokens.weight
    return cfg, ranks, policy, reference


def updated_weights(base, groups, micro_batch_size, **overrides) -> dict[str, torch.Tensor]:
    """The full weights after one GRPO update (two passes, so two AdamW steps) over `groups` on this
    rank."""
    import grpo
    import train as T

    overrides["loss.micro_batch_size"] = micro_batch_size
    cfg, ranks, policy, reference = full_policy(base, **overrides)
    sequences = grpo.training_sequences(groups, grpo.advantages_by_group(groups, cfg.loss))
    batches = grpo.micro_batches(sequences, micro_batch_size, 0, ranks.device)
    optimizer = T.build_optimizer(policy, 1e-3, 0.01, (0.9, 0.99))
    out = grpo.policy_update(policy, optimizer, batches, cfg, ranks, reference)
    assert out["grad_norm"] > 0 and out["kl"] >= 0
    return {
        n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
        for n, p in policy.named_parameters()
    }


def fixed_groups(n_groups=4, k=3, seed=0):
    """Groups of random prompts and completions of different lengths, rewards varying within
    groups."""
    import data
    import rollout

    g = torch.Generator().manual_seed(seed)
    groups = []
    for i in range(n_groups):
        prompt = torch.randint(1, 20, (3 + i,), generator=g).tolist()
        comps = [torch.randint(1, 20, (2 + (i + j) % 4,), generator=g).tolist() for j in range(k)]
        sampler = [(-torch.rand(len(c), generator=g)).tolist() for c in comps]
        ex = data.Example(f"e{i}", "meld_emotion", [data.Turn("A", "hi")], 0, ["joy"])
        samples = [[rollout.Sample(prompt, c, s, False)] for c, s in zip(comps, sampler)]
        groups.append(rollout.Group(ex, samples, [], [float((i + j) % 3) for j in range(k)]))
    return groups


def kill_after_checkpoint(argv: list[str], run: Path, checkpoint: str, entry=("grpo.py",)) -> None:
    """Start `python *entry *argv` (grpo.py, or an extension's `-m folder.script`) and SIGKILL it
    as soon as `run` holds `checkpoint`, before the run ends."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, *entry, *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 120
    while not (run / checkpoint).is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run / "adapter").exists()


def assert_same_run(a: Path, b: Path) -> None:
    """Two runs' output_dirs hold the same adapter weights, metrics (timings aside) and
    completions."""
    adapter_a, adapter_b = (
        load_file(run / "adapter" / "adapter_model.safetensors") for run in (a, b)
    )
    assert adapter_a.keys() == adapter_b.keys() and all(
        torch.equal(adapter_a[k], adapter_b[k]) for k in adapter_a
    )
    timing = ("time/", "tokens_per_s")
    ma, mb = (
        [
            {k: v for k, v in m.items() if not k.startswith(timing)}
            for m in read_jsonl(run / "metrics.jsonl")
        ]
        for run in (a, b)
    )
    assert ma == mb
    assert read_jsonl(a / "completions.jsonl") == read_jsonl(b / "completions.jsonl")


# ----------------------------------------------------------------------------- the dialogue demo

DEMO = REPO / "configs" / "dialogue_demo.yaml"
DIALOGUE_WORDS = [
    "user",
    "assistant",
    "I",
    "understand",
    "sorry",
    "hear",
    "you",
    "try",
    "one",
    "step",
    "Facts:",
    "Needs:",
    "Appraisal:",
    "Emotion:",
    "Strategy:",
    "Lookahead",
    "1:",
    "2:",
    "Choice:",
    "worried",
    "calmer",
    "the",
    "plan",
]


# ----------------------------------------------------------------------------- report_to sinks


def assert_sinks_hold_metrics(run: Path, wandb_run: bool = False) -> None:
    """The TensorBoard event files under run/tensorboard, read back by tensorboard's own reader,
    hold every number of every metrics.jsonl record under its key at its step; with `wandb_run`,
    the offline W&B run's summary holds each key's last value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    expected = {}  # key -> {step: value}
    for record in read_jsonl(run / "metrics.jsonl"):
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                expected.setdefault(key, {})[record["step"]] = value
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    found = {
        tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]
    }
    assert set(found) == set(expected) and len(expected) > 3, set(found) ^ set(expected)
    for key, by_step in expected.items():
        assert found[key] == pytest.approx(by_step, rel=1e-6), key  # TensorBoard keeps float32
    if wandb_run:
        _, summary = wandb_offline_run(run)
        last = {key: by_step[max(by_step)] for key, by_step in expected.items()}
        assert {k: summary[k] for k in last} == pytest.approx(last, rel=1e-9)


def wandb_offline_run(run: Path) -> tuple[dict, dict]:
    """(config, summary) of the one offline W&B run under run/wandb, read from its run-<id>.wandb
    file: a 7-byte header, then LevelDB-log chunks (in 32 KiB blocks: checksum u32, length u16,
    type u8; 1 a whole record, 2/3/4 its first/middle/last piece) of wandb Record protobufs.
    The summary merges every summary update in order."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    config, summary, pending, pos = {}, {}, b"", 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            kind_name = record.WhichOneof("record_type")
            items = {
                "run": lambda: record.run.config.update,
                "summary": lambda: record.summary.update,
            }
            for item in items[kind_name]() if kind_name in items else []:
                key = item.key or "/".join(item.nested_key)
                (config if kind_name == "run" else summary)[key] = json.loads(item.value_json)
    return config, summary


class JSONHandler(BaseHTTPRequestHandler):
    """A request handler for stand-in servers: `answer` sends bytes as a JSON response, and no
    request is logged."""

    def answer(self, status: int, content: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    def log_message(self, *args):
        pass


def serve(handler) -> tuple[ThreadingHTTPServer, str]:
    """`handler` served on a free port of 127.0.0.1 from a daemon thread: (the server, its /v1
    URL). Stop it with shutdown() and server_close()."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


# ------------------------------------------------------------------------ the docs' commands

# The pages whose commands the tests read: the README, docs/, the configs' comments and the
# scripts' docstrings.
DOC_PAGES = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "configs").glob("*.yaml")),
    *sorted(p for p in REPO.glob("*.py")),
    *sorted(p for p in REPO.glob("*/*.py") if p.parent.name != "tests"),
]
# a command with a shipped config: `python X.py configs/C.yaml [key=value ...]`, `... -m a.b
# configs/C.yaml ...`, its overrides on the same line or after a backslash line break
WITH_CONFIG = re.compile(
    r"(?:\bpython3?|\btorchrun(?:\s+--?[\w-]+(?:[ =](?!-m\b)[^\s-][^\s]*)?)*)\s+"
    r"(?:-m\s+(?P<module>[A-Za-z_][\w.]*)|(?P<script>[\w/.-]+\.py))\s+(?P<config>configs/[\w.-]+\.yaml)"
    r"(?P<overrides>(?:[ \t]+(?:\\\n[ \t]*)?[a-z_][\w.]*=[^\s`|]+)*)"
)


# entry points that read another script's config (dialogue.eqbench3 runs evaluate.py's main)
SCHEMA_OF = {"dialogue/eqbench3.py": "evaluate.py"}


def documented_config_commands():
    """(page, script, config, overrides) of every documented command with a shipped config whose
    script has a config schema (tools.config_reference.SCRIPTS); `script` as a path (a module's
    `a/b.py`), the one whose schema the config has (SCHEMA_OF)."""
    from tools.config_reference import SCRIPTS

    for page in DOC_PAGES:
        text = page.read_text(encoding="utf-8")
        # a shell variable the page sets (PORT=8000) stands for its value in the commands
        shell = {
            name: re.sub(r"^\$\{\w+:-(.*)\}$", r"\1", value)  # ${PORT:-8000}: its default
            for name, value in re.findall(r"^(?:export )?([A-Z_]+)=(\S+)", text, re.MULTILINE)
        }
        for match in WITH_CONFIG.finditer(text):
            script = match.group("script") or match.group("module").replace(".", "/") + ".py"
            script = SCHEMA_OF.get(script, script)
            if script in SCRIPTS:
                overrides = [
                    re.sub(r"\$\{?([A-Z_]+)\}?", lambda m: shell.get(m[1], m[0]), o)
                    for o in re.findall(r"[a-z_][\w.]*=[^\s`|]+", match.group("overrides"))
                ]
                yield page, script, match.group("config"), overrides


def load_documented_config(script: str, config: str, overrides: list[str]):
    """A documented command's config, loaded with its overrides as its script loads it."""
    import importlib

    from config import load_config
    from tools.config_reference import SCRIPTS

    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    return load_config(REPO / config, overrides, getattr(module, SCRIPTS[script]))


# ------------------------------------------------------- a stub of OpenAI's chat completions API

# The request fields OpenAI's Chat Completions API documents (written out here, not read from
# judge.py: the stub is the oracle), and the models it treats as reasoning models.
OPENAI_REQUEST_FIELDS = set(
    """model messages audio frequency_penalty logit_bias logprobs max_completion_tokens max_tokens
    metadata modalities n parallel_tool_calls prediction presence_penalty reasoning_effort
    response_format seed service_tier stop store stream stream_options temperature tool_choice tools
    top_logprobs top_p user verbosity web_search_options""".split()
)
OPENAI_REASONING_MODEL = re.compile(r"^(o\d|gpt-5)")


def openai_stub_backend(messages, request: dict) -> str:
    """A judge_server backend that refuses a request as OpenAI's API does (HTTP 400,
    invalid_request_error): a field it does not know; for a reasoning model, max_tokens, and a
    temperature or top_p other than 1. Otherwise it answers "ok"."""
    from judge_server import UnsupportedRequest

    for key in request:
        if key not in OPENAI_REQUEST_FIELDS:
            raise UnsupportedRequest(f"Unrecognized request argument supplied: {key}")
    if OPENAI_REASONING_MODEL.match(str(request.get("model"))):
        if "max_tokens" in request:
            raise UnsupportedRequest(
                "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                "'max_completion_tokens' instead."
            )
        for key in ("temperature", "top_p"):
            if request.get(key, 1) != 1:
                raise UnsupportedRequest(
                    f"Unsupported value: '{key}' does not support {request[key]} with this "
                    "model. Only the default (1) value is supported."
                )
    return "ok"


def fake_eval(name, f1_in, f1_out, tokens_in, tokens_out, sd=0.01):
    """An eval.json summary of two sets, one per domain, with the given weighted F1 and tokens."""
    import evaluate as ev

    def stat(mean, runs=3):
        return {"mean": mean, "sd": sd if runs > 1 else None, "runs": [mean] * runs}

    def entry(domain, f1, tokens):
        return {
            "domain": domain,
            "decoding": {"n_samples": 3},
            "weighted_f1": stat(f1),
            "macro_f1": stat(f1 - 0.05),
            "invalid": stat(0.02),
            "reasoning_tokens": stat(tokens),
            "quoting": stat(0.5),
            "verified": stat(0.75),
        }

    sets = {
        "ccu_zh_emotion": entry("in", f1_in, tokens_in),
        "meld": entry("out", f1_out, tokens_out),
    }
    averages = {
        d: {k: s[k] for k in ev.AVERAGED}
        for d, s in (("in", sets["ccu_zh_emotion"]), ("out", sets["meld"]))
    }
    return {"name": name, "sets": sets, "averages": averages}
