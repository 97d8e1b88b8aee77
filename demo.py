"""The CPU demo: the whole two-stage method on a toy task, on a laptop, in minutes, with nothing
from outside (no download, no GPU, no API key).

    python demo.py [--out runs/demo] [--seed 0]      # one run
    python demo.py --seeds 0 1 2 3 4                # one run per seed, then mean ± SD of every
                                                      column

The toy task (data.py's `toy_emotion`, a compact prompt). Short conversations between two or three
people, in English and in Chinese. Early on, the target speaker says something that carries an
emotion (the cue: "My grandfather passed away on Sunday."); last, they say a noncommittal line that
is the same for every label ("Well, what can I say."). Only the cue tells the emotion of that last
turn, so a model that finds and quotes it can answer, and one that does not is at chance (1 in 4).
The SFT traces quote the cue and the target turn, then answer; half of them mark the quotations with
evidence tags, half with plain quotation marks. Both answer alike, but the CLUE reward pays IU_G
only for tagged quotations the verifier finds in the conversation: what GRPO learns here is to mark
its evidence.

What runs, in order:
  1. build (first run only, cached in --out): the examples (`data/`: SFT rows, RL prompts, held-out
     conversations that appear nowhere in training), a byte-level BPE tokenizer trained on them with
     Qwen's ChatML tokens, and a small Qwen3 model from a seeded random initialization (`base/`);
  2. `python sft.py configs/demo_sft.yaml ...`: LoRA SFT with the trainable `<evidence>` rows;
  3. `python grpo.py configs/demo_grpo.yaml ...`: GRPO with the CLUE reward, its IU_G judge served
     over HTTP by the local judge server's rules backend, started here on a free loopback port;
  4. the held-out evaluation of the random model, the SFT model and the GRPO model: accuracy,
     invalid answers, verified quotations and the mean CLUE reward, printed as one table and written
     to `results.md` / `results.json`, with the training curves in `training_curves.png`
     (`python -m tools.plots curves`).
Extra `key=value` settings reach the stages through --sft and --grpo (the test runs a few steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from config import atomic_write_text
from data import THINK_END, THINK_START, Example, Turn
from dataset import check_example, example_to_json, save_jsonl
from verifier import EVIDENCE_CLOSE, EVIDENCE_OPEN

REPO = Path(__file__).resolve().parent
TASK = "toy_emotion"

# ----------------------------------------------------------------------------- the toy task

_EN_CUES = {
    "joy": [
        "I got the job at the museum!",
        "We won the match last night!",
        "My sister just had a baby girl!",
    ],
    "sadness": [
        "My grandfather passed away on Sunday.",
        "Our old dog died this morning.",
        "I failed the exam again.",
    ],
    "anger": [
        "Someone scratched my car on purpose!",
        "He lied to me again, right to my face!",
        "They fired me without any reason!",
    ],
    "fear": [
        "I heard someone walking in the attic.",
        "The doctor wants to see me first thing tomorrow.",
        "A strange man followed me all the way home.",
    ],
}
_ZH_CUES = {
    "joy": ["我终于拿到驾照了！", "我们队昨天赢了比赛！", "我姐姐生了个女儿！"],
    "sadness": ["我爷爷上周去世了。", "陪了我很久的狗昨天死了。", "我考试又没过。"],
    "anger": ["有人故意划了我的车！", "他又当面骗了我！", "公司无缘无故把我开除了！"],
    "fear": ["我听见阁楼里有脚步声。", "医生让我明天一早去复查。", "有个陌生人一路跟着我回家。"],
}


@dataclass(frozen=True)
class Language:
    """What the conversations and traces of one language are made of."""

    names: tuple[str, ...]
    cues: dict[str, list[str]]  # label -> sentences that carry it
    fillers: tuple[str, ...]  # neutral turns anyone may say
    reactions: tuple[str, ...]  # the listener's neutral answer to the cue
    targets: tuple[str, ...]  # noncommittal last lines, the same for every label
    earlier: str  # the trace's first block: {speaker}, {cue}
    now: str  # its second block: {target}, {label}


LANGUAGES = {
    "en": Language(
        ("Anna", "Ben", "Chloe", "David", "Emma", "Frank"),
        _EN_CUES,
        (
            "Did you see the weather report?",
            "I am making some tea.",
            "The bus was late again today.",
            "What time is it now?",
            "Where did you park?",
            "Can you pass me the remote?",
            "I just got back from work.",
            "Is the kitchen window open?",
        ),
        ("Oh, really?", "Tell me more.", "Hmm, I see.", "Go on.", "Wait, what?"),
        ("Well, what can I say.", "Anyway, that is how it is.", "I guess it is what it is."),
        "Earlier {speaker} said {cue}, the news behind this turn.",
        "So {target} hides real feelings of {label}.",
    ),
    "zh": Language(
        ("小明", "小红", "李雷", "韩梅梅", "王芳", "张伟"),
        _ZH_CUES,
        (
            "你看天气预报了吗？",
            "我去泡杯茶。",
            "今天公交车又晚点了。",
            "现在几点了？",
            "你把车停哪儿了？",
            "把遥控器递给我一下。",
            "我刚下班回来。",
            "厨房的窗户开着吗？",
        ),
        ("真的吗？", "然后呢？", "嗯，我知道了。", "你接着说。", "啊？"),
        ("唉，我也不知道说什么好。", "反正就这样吧。", "还能怎么样呢。"),
        "{speaker}之前说{cue}，这是背后的原因，也是关键。",
        "所以{target}藏着真实的情绪：{label}。",
    ),
}


def toy_example(rng: random.Random, language: str, example_id: str) -> Example:
    """One toy conversation: up to two neutral turns, the target speaker's cue, a reaction, up to
    two more neutral turns, then the target speaker's noncommittal line (the target). The neutral
    turns and the reaction belong to the others: the target speaker says only the cue and the
    target. `difficulty` is the number of turns between the reaction and the target, over two."""
    lang = LANGUAGES[language]
    label = rng.choice(sorted(lang.cues))
    speaker, *others = rng.sample(lang.names, rng.choice((2, 3)))
    turns = [Turn(rng.choice(others), rng.choice(lang.fillers)) for _ in range(rng.randint(0, 2))]
    turns += [
        Turn(speaker, rng.choice(lang.cues[label])),
        Turn(rng.choice(others), rng.choice(lang.reactions)),
    ]
    between = [Turn(rng.choice(others), rng.choice(lang.fillers)) for _ in range(rng.randint(0, 2))]
    turns += between + [Turn(speaker, rng.choice(lang.targets))]
    return check_example(
        Example(
            id=example_id,
            task=TASK,
            turns=turns,
            target=len(turns) - 1,
            labels=[label],
            language=language,
            difficulty=len(between) / 2,
        )
    )


def conversation_key(example: Example) -> tuple:
    return tuple((t.speaker, t.text) for t in example.turns)


def draw_examples(n: int, rng: random.Random, make, prefix: str, key, exclude) -> list[Example]:
    """`n` examples `make(rng, language, id)`, alternating English and Chinese, their ids
    `<prefix>-<language>-<index>`; one whose `key(example)` is in `exclude` is drawn again."""
    examples = []
    while len(examples) < n:
        language = ("en", "zh")[len(examples) % 2]
        example = make(rng, language, f"{prefix}-{language}-{len(examples):05d}")
        if key(example) not in exclude:
            examples.append(example)
    return examples


def toy_examples(n: int, seed: int, split: str, exclude: set[tuple] = frozenset()) -> list[Example]:
    """`n` toy examples, deterministic for (seed, split) (draw_examples); a conversation in
    `exclude` (conversation_key) is drawn again, so held-out conversations never occur in
    training."""
    rng = random.Random(f"{seed}/{split}")
    return draw_examples(n, rng, toy_example, f"toy-{split}", conversation_key, exclude)


def toy_trace(example: Example, tagged: bool = True) -> str:
    """The SFT completion of a toy example: two reasoning blocks that quote the cue and the target
    turn, `</think>`, the answer line. Tagged, the quotations stand between evidence tags (each
    block then earns IU_G from the rules judge); untagged, between plain quotation marks, which no
    verifier reads. A quotation opens with a space, as the line `Speaker: text` has one before the
    text: byte-level BPE spells " I" and "I" as different tokens, so this way a quotation's tokens
    are the line's own."""
    lang, label = LANGUAGES[example.language], example.labels[0]
    target = example.turns[example.target]
    cue = next(
        t.text for t in example.turns if t.speaker == target.speaker and t.text in lang.cues[label]
    )
    open_, close = (EVIDENCE_OPEN, EVIDENCE_CLOSE) if tagged else ("\u201c", "\u201d")
    blocks = [
        lang.earlier.format(speaker=target.speaker, cue=f"{open_} {cue}{close}"),
        lang.now.format(target=f"{open_} {target.text}{close}", label=label),
    ]
    return f"{THINK_START}\n" + "\n\n".join(blocks) + f"\n{THINK_END}\n\nAnswer: {label}"


# ----------------------------------------------------------------------------- tokenizer and model

CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # special tokens, as in Qwen's tokenizer


def train_tokenizer(texts: list[str], out_dir: Path, vocab_size: int) -> int:
    """Train a byte-level BPE on `texts` (words split by GPT-2's pattern, as Qwen's tokenizer splits
    them), add the ChatML tokens (special) and `<think>` / `</think>` (added, not special, as in
    Qwen3), and write tokenizer.json, tokenizer_config.json (with tokenizer.py's ChatML chat
    template, so vLLM's chat endpoint serves the checkpoint) and generation_config.json, which
    `tokenizer.load_tokenizer` reads as a Qwen3 tokenizer. The evidence tags are not in it: SFT
    adds them as special tokens. Returns the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from tokenizer import chat_template

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHATML),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tags = re.compile(
        "|".join(map(re.escape, (EVIDENCE_OPEN, EVIDENCE_CLOSE, THINK_START, THINK_END)))
    )
    tok.train_from_iterator((piece for text in texts for piece in tags.split(text)), trainer)
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in (THINK_START, THINK_END)]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in CHATML}
    files = {
        "tokenizer_config.json": {
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "chat_template": chat_template("qwen3"),
        },
        "generation_config.json": {
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"],
        },
    }
    for name, content in files.items():
        atomic_write_text(out_dir / name, json.dumps(content, indent=2) + "\n")
    return tok.get_vocab_size(with_added_tokens=True)


@dataclass
class ModelSize:
    """The demo model: a small Qwen3 (GQA attention with q/k norms, SwiGLU MLP), about 0.7M
    parameters. Two layers learn the toy task under LoRA faster per second of CPU than four (README,
    the demo)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    init_std: float = 0.02  # the initializer_range of Qwen's configs
    head_std: float = 0.3  # the lm_head's, see init_model


def init_model(out_dir: Path, size: ModelSize, vocab_size: int, seed: int) -> None:
    """Write a Qwen3 checkpoint folder (config.json + model.safetensors) with seeded random weights:
    matrices from N(0, init_std^2) and norms at one, as Hugging Face initializes Qwen3, except the
    untied lm_head, drawn at head_std. LoRA keeps the lm_head and the final norm frozen, so the
    largest logit a unit-RMS hidden state can reach is hidden_size * std: 2.6 at 0.02, too little to
    ever be confident among a thousand tokens (measured: the SFT loss stalls at 4.5 nats); 38 at
    0.3, where sampling at temperature 1 stops drawing stray tokens. The vocabulary is padded to a
    multiple of 64, leaving spare rows for the evidence tags, as Qwen's is."""
    import torch

    from model import Qwen, QwenConfig, atomic_write

    raw = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": -(-(vocab_size + 2) // 64) * 64,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_layers,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "head_dim": size.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": size.init_std,
        "dtype": "float32",
    }
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in Qwen(QwenConfig.from_dict(raw)).state_dict().items():
        if tensor.dim() == 2:
            std = size.head_std if name == "lm_head.weight" else size.init_std
            tensor = torch.randn(tensor.shape, generator=generator) * std
        state[name] = tensor.contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    # the umask's permissions (safetensors' save_file: 0600)
    atomic_write(out_dir / "model.safetensors", state)
    atomic_write_text(out_dir / "config.json", json.dumps(raw, indent=2) + "\n")


# ----------------------------------------------------------------------------- the demo folder


@dataclass
class DemoData:
    """The sizes of what the demo builds; recorded in demo.json, a different request rebuilds."""

    seed: int = 0
    train: int = 2400  # conversations: SFT rows (with their traces) and the RL prompts
    tagged: float = 0.5  # the share of SFT traces that mark their quotations as evidence
    heldout: int = 1000  # conversations for the evaluation, none of them in `train`
    # the BPE's target (the toy text has fewer distinct words: it stops short)
    vocab_size: int = 2048
    model: ModelSize = dataclasses.field(default_factory=ModelSize)


def toy_data(spec: DemoData) -> tuple[list[Example], list[Example], list[str]]:
    """The demo's (training examples, held-out examples, the training examples' SFT traces)."""
    train = toy_examples(spec.train, spec.seed, "train")
    heldout = toy_examples(
        spec.heldout, spec.seed, "heldout", exclude={conversation_key(e) for e in train}
    )
    rng = random.Random(f"{spec.seed}/traces")
    return train, heldout, [toy_trace(e, tagged=rng.random() < spec.tagged) for e in train]


def prepare(out: Path, spec, make=toy_data) -> None:
    """Build the data, tokenizer and model into `out` unless demo.json says they are there for
    `spec` (a dataclass with the fields `seed`, `vocab_size` and `model` that DemoData has; another
    toy task passes its own, and `make(spec)`, its (train, held-out, traces) as toy_data's)."""
    manifest = out / "demo.json"
    if manifest.is_file() and json.loads(
        manifest.read_text(encoding="utf-8")
    ) == dataclasses.asdict(spec):
        print(f"using the toy data and model in {out} (built earlier)")
        return
    start = time.perf_counter()
    train, heldout, traces = make(spec)
    (out / "data").mkdir(parents=True, exist_ok=True)
    save_jsonl(train, out / "data" / "train.jsonl")
    save_jsonl(heldout, out / "data" / "heldout.jsonl")
    rows = [example_to_json(e) | {"completion": t} for e, t in zip(train, traces)]
    atomic_write_text(
        out / "data" / "sft.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    )
    from data import build_prompt

    vocab = train_tokenizer(
        [build_prompt(e) for e in train] + traces, out / "base", spec.vocab_size
    )
    init_model(out / "base", spec.model, vocab, spec.seed)
    atomic_write_text(manifest, json.dumps(dataclasses.asdict(spec), indent=1) + "\n")
    print(
        f"built {len(train)} training and {len(heldout)} held-out conversations, a {vocab}-token "
        f"BPE and a random Qwen3 ({spec.model.num_layers} layers, hidden "
        f"{spec.model.hidden_size}) in {out} ({time.perf_counter() - start:.0f}s)"
    )


# ----------------------------------------------------------------------------- evaluation

# evaluate.py's defaults, shorter
EVAL_SAMPLING = dict(temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=96)
COLUMNS = (
    ("accuracy", "accuracy"),
    ("invalid", "invalid answers"),
    ("verified", "verified quotes"),
    ("reward", "mean reward"),
)


def evaluate_checkpoint(
    path: Path, examples: list[Example], spec, judge, seed: int
) -> tuple[dict, list[dict]]:
    """Sample one completion per held-out example from the checkpoint at `path` and score it:
    accuracy, invalid answers (data.parse_answer), verified quotes (the share of completions that
    quote and whose every quotation the verifier finds in the conversation) and the reward `spec`
    (rewards.RewardSpec), its judges asked over HTTP as `judge` (a http_client.JudgeConfig) says.
    Returns (the means, one record per completion: also the reward's logged parts and the reasoning
    tokens T, which tools/ablate.py averages)."""
    import rewards
    from data import count_tokens, get_task
    from evaluate import SamplingConfig, sample_completions
    from model import Qwen
    from tokenizer import load_tokenizer
    from verifier import extract_quotes, verify_quote

    model, tok = Qwen.from_pretrained(path), load_tokenizer(path)
    texts = sample_completions(
        model,
        tok,
        [get_task(e.task).messages(e) for e in examples],
        [e.id for e in examples],
        SamplingConfig(**EVAL_SAMPLING),
        seed=seed,
        batch_size=64,
    )
    rollouts = [
        rewards.Rollout.from_completion(
            e,
            text,
            n_completion_tokens=len(tok.encode(text)),
            count_tokens=lambda reasoning: count_tokens(reasoning, tok),
        )
        for e, [text] in zip(examples, texts)
    ]
    rewards.judge_rollouts(rollouts, spec, judge)
    records = []
    for r in rollouts:
        quotes = extract_quotes(r.reasoning)
        records.append(
            {
                "id": r.example.id,
                "labels": r.example.labels,
                "answer": r.answer,
                "verified": bool(quotes)
                and all(verify_quote(q, rewards.conversation_texts(r.example)) for q in quotes),
                "reward": rewards.score(r, spec),
                "parts": {
                    name: part(r, spec.params)
                    for name, part in rewards.REWARDS[spec.name].parts.items()
                },
                "reasoning_tokens": r.n_reasoning_tokens,
                "completion": r.completion,
            }
        )
    missing = sum(r["reward"] is None for r in records)
    if missing:
        raise RuntimeError(f"the judge left {missing} of {len(records)} rewards without feedback")
    means = {
        "accuracy": sum(r["answer"] == r["labels"] for r in records) / len(records),
        "invalid": sum(r["answer"] is None for r in records) / len(records),
        "verified": sum(r["verified"] for r in records) / len(records),
        "reward": sum(r["reward"] for r in records) / len(records),
    }
    return means, records


def results_table(results: dict[str, dict]) -> str:
    """The Markdown table of the stages' means: rates in percent, the reward as it is (0 to 1 +
    lambda_iu)."""
    lines = [
        "| model | " + " | ".join(title for _, title in COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 1) + "|",
    ]
    for stage, means in results.items():
        cells = [
            f"{means[key]:.3f}" if key == "reward" else f"{100 * means[key]:.1f}%"
            for key, _ in COLUMNS
        ]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the run


def run_stage(name: str, overrides: list[str]) -> None:
    """`python <name>.py configs/demo_<name>.yaml overrides...` from the repository folder; a
    failure ends the demo (the stage has printed why)."""
    script = f"{name}.py"
    command = [sys.executable, script, f"configs/demo_{name}.yaml", *overrides]
    start = time.perf_counter()
    print("\n$ python " + " ".join(command[1:]), flush=True)
    if subprocess.run(command, cwd=REPO).returncode != 0:
        raise SystemExit(f"demo: {script} failed (its message is above)")
    print(f"{script}: {time.perf_counter() - start:.0f}s", flush=True)


def stage_settings(out: Path, seed: int) -> dict[str, list[str]]:
    """The paths and seed demo.py gives each stage (the configs name runs/demo's, for running by
    hand)."""
    return {
        "sft": [
            f"model={out / 'base'}",
            f"data={out / 'data' / 'sft.jsonl'}",
            f"output_dir={out / 'sft'}",
            f"seed={seed}",
        ],
        "grpo": [
            f"model.path={out / 'base'}",
            f"model.sft_adapter={out / 'sft' / 'best'}",
            f"train_data=[{out / 'data' / 'train.jsonl'}]",
            f"output_dir={out / 'grpo'}",
            f"seed={seed}",
        ],
    }


STAGES = (
    ("random init", "base", None),
    ("after SFT", "sft/merged", "sft"),
    ("after GRPO", "grpo/merged", "grpo"),
)


def run(out: Path, spec: DemoData, settings: dict[str, list[str]], rl) -> dict[str, dict]:
    """Build (or reuse) the toy data and model, then evaluate the random model, run SFT and
    evaluate, run GRPO and evaluate, against one local judge server; write the table and the curves,
    and return the stages' means. `rl` is the resolved GRPO config, whose reward and judge settings
    the evaluation uses."""
    from dataset import load_jsonl
    from judge_server import JudgeServer, rules_backend

    start = time.perf_counter()
    prepare(out, spec)
    heldout = load_jsonl(out / "data" / "heldout.jsonl")
    for stage in ("sft", "grpo", "eval"):
        shutil.rmtree(out / stage, ignore_errors=True)  # a rerun runs every stage again
    (out / "eval").mkdir()
    results = {}
    with JudgeServer(rules_backend).start() as server:
        print(
            f"judge: the rules backend at {server.url} (a crude lexical stand-in for the IU_G "
            f"judge)"
        )
        judge = dataclasses.replace(rl.judge, base_url=server.url)
        for stage, checkpoint, name in STAGES:
            if name is not None:
                run_stage(
                    name,
                    settings[name] + ([f"judge.base_url={server.url}"] if name == "grpo" else []),
                )
            started = time.perf_counter()
            means, records = evaluate_checkpoint(
                out / checkpoint, heldout, rl.reward, judge, spec.seed
            )
            atomic_write_text(
                out / "eval" / f"{stage.split()[-1].lower()}.jsonl",
                "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
            )
            results[stage] = means
            print(
                f"\n{stage}: "
                + ", ".join(f"{title} {means[key]:.3f}" for key, title in COLUMNS)
                + f" (evaluated in {time.perf_counter() - started:.0f}s)",
                flush=True,
            )
    table = results_table(results)
    atomic_write_text(out / "results.md", table + "\n")
    atomic_write_text(out / "results.json", json.dumps(results, indent=1) + "\n")
    curves = out / "training_curves.png"
    runs = [str(out / "sft"), str(out / "grpo")]
    command = [sys.executable, "-m", "tools.plots", "curves", *runs, "--out", str(curves)]
    drawn = subprocess.run([*command, "--overwrite"], cwd=REPO, capture_output=True, text=True)
    why = drawn.stderr.strip().splitlines()[-1:] or ["tools.plots failed"]
    figure = f", {curves}" if drawn.returncode == 0 else f" (no figure: {why[0]})"
    print(
        f"\nheld-out toy conversations ({len(heldout)}, none seen in training; chance accuracy "
        f"25%):\n{table}\n\nwritten: {out / 'results.md'}, {out / 'results.json'}{figure}\ndemo "
        f"done in {time.perf_counter() - start:.0f}s"
    )
    return results


def seeds_table(per_seed: dict[int, dict[str, dict]]) -> str:
    """The several-seed Markdown tables: each stage's columns as mean ± sample SD over the seeds
    (evaluate.mean_sd), then one row per seed with each column after SFT -> after GRPO."""
    from evaluate import mean_sd

    def cell(key: str, value: float) -> str:
        return f"{value:.3f}" if key == "reward" else f"{100 * value:.1f}%"

    def stat(key: str, values: list[float]) -> str:
        m = mean_sd(values)
        scale, digits, unit = (1, 3, "") if key == "reward" else (100, 1, "%")
        sd = "" if m["sd"] is None else f" ± {scale * m['sd']:.{digits}f}"
        return f"{scale * m['mean']:.{digits}f}{sd}{unit}"

    seeds, stages = sorted(per_seed), list(per_seed[min(per_seed)])
    lines = [
        f"| model ({len(seeds)} seeds) | " + " | ".join(title for _, title in COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 1) + "|",
    ]
    lines += [
        f"| {stage} | "
        + " | ".join(stat(key, [per_seed[s][stage][key] for s in seeds]) for key, _ in COLUMNS)
        + " |"
        for stage in stages
    ]
    lines += [
        "",
        "| seed | " + " | ".join(f"{title}, SFT -> GRPO" for _, title in COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 1) + "|",
    ]
    lines += [
        f"| {s} | "
        + " | ".join(
            f"{cell(key, per_seed[s]['after SFT'][key])} -> "
            f"{cell(key, per_seed[s]['after GRPO'][key])}"
            for key, _ in COLUMNS
        )
        + " |"
        for s in seeds
    ]
    return "\n".join(lines)


def run_seeds(
    out: Path, specs: list[DemoData], settings: list[dict[str, list[str]]], configs: list
) -> None:
    """`run` once per seed, each into out/seed<N>, with an ETA after each; then the mean ± SD table,
    written to out/results.md and out/results.json (every seed's means)."""
    start, per_seed = time.perf_counter(), {}
    for i, (spec, setting, rl) in enumerate(zip(specs, settings, configs)):
        print(f"\n=== seed {spec.seed} ({i + 1} of {len(specs)}) ===", flush=True)
        per_seed[spec.seed] = run(out / f"seed{spec.seed}", spec, setting, rl)
        elapsed = time.perf_counter() - start
        left = elapsed / (i + 1) * (len(specs) - i - 1)
        print(
            f"=== {i + 1} of {len(specs)} seeds done in {elapsed / 60:.1f} min"
            + (f", ETA {left / 60:.1f} min more ===" if left else " ==="),
            flush=True,
        )
    table = seeds_table(per_seed)
    atomic_write_text(out / "results.md", table + "\n")
    atomic_write_text(out / "results.json", json.dumps(per_seed, indent=1) + "\n")
    print(
        f"\nheld-out toy conversations ({specs[0].heldout} per seed), seeds "
        f"{' '.join(str(s) for s in per_seed)}:\n{table}\n\nwritten: {out / 'results.md'}, "
        f"{out / 'results.json'}\nall seeds done in {(time.perf_counter() - start) / 60:.1f} min"
    )


MARKER = ".demo-output"  # what the demo writes first into its --out, to know the folder again


def out_folder_problem(out: Path, marker: str = MARKER, writer: str = "the demo") -> str | None:
    """Why `writer` must not write into `out` (None: absent, empty, or holding the `marker` file
    that writer writes first)."""
    if out.exists() and not out.is_dir():
        return "is a file, not a folder"
    if not out.is_dir() or (out / marker).is_file():
        return None
    foreign = next(out.iterdir(), None)
    return None if foreign is None else f"holds {foreign.name!r}, which {writer} did not write"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="demo.py", description="SFT then GRPO on a toy task, on the CPU."
    )
    parser.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the data, the model and both stages"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        metavar="SEED",
        help="run the whole demo once per seed, into OUT/seed<N>, and print mean ± SD",
    )
    parser.add_argument("--train", type=int, default=DemoData.train, help="training conversations")
    parser.add_argument(
        "--heldout", type=int, default=DemoData.heldout, help="held-out conversations"
    )
    parser.add_argument(
        "--sft", action="append", default=[], metavar="KEY=VALUE", help="a setting for sft.py"
    )
    parser.add_argument(
        "--grpo", action="append", default=[], metavar="KEY=VALUE", help="a setting for grpo.py"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into --out even when it holds files the demo did not write (its data/, base/, "
        "sft/, grpo/ and eval/ are then replaced)",
    )
    args = parser.parse_args(argv)
    for name in ("train", "heldout"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: at least 1 conversation, not {getattr(args, name)}")
    out = Path(args.out).resolve()
    problem = out_folder_problem(out)
    if problem and not args.overwrite:
        parser.error(f"--out {out}: {problem}; choose another folder, or pass --overwrite")
    # One thread per process unless the user sets OMP_NUM_THREADS (the stages
    # inherit it): the demo's matrices are small, and on a busy 2-core machine
    # two threads per process measured 14x slower per SFT step than one
    # (README, the demo). Set before torch is imported, which reads it then.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from config import ConfigError, load_config
    from grpo import GRPOConfig
    from sft import SFTConfig

    seeds = args.seeds or [args.seed]
    folders = [out / f"seed{seed}" if args.seeds else out for seed in seeds]
    settings, configs = [], []
    # every seed's configs are checked before anything runs
    for seed, folder in zip(seeds, folders):
        setting = stage_settings(folder, seed)
        setting = {"sft": setting["sft"] + args.sft, "grpo": setting["grpo"] + args.grpo}
        resolved = {}
        for name, schema in (("sft", SFTConfig), ("grpo", GRPOConfig)):
            try:
                resolved[name] = load_config(
                    REPO / "configs" / f"demo_{name}.yaml", setting[name], schema
                )
            except ConfigError as e:
                print(f"config error: {name}: {e}", file=sys.stderr)
                raise SystemExit(2) from None
        settings.append(setting)
        configs.append(resolved["grpo"])
    specs = [DemoData(seed=seed, train=args.train, heldout=args.heldout) for seed in seeds]
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by demo.py\n", encoding="utf-8")
    if args.seeds:
        run_seeds(out, specs, settings, configs)
    else:
        run(out, specs[0], settings[0], configs[0])


if __name__ == "__main__":
    main()
