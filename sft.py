"""Stage 1 (CLUE A.1): supervised fine-tuning on reasoning traces that quote their evidence; also
free-form targets and plain text (`objective`, below). prepare/traces.py writes CLUE's traces,
prepare/emollm_rows.py EmoLLM's Stage I rows.

    python sft.py config.yaml [key=value ...]           # train; the same under torchrun

Data (`data` in the config), one JSON object per line, in either of two shapes:
    {"id", "task", "prompt": [chat messages], "completion", "labels"}
    an example of data.py's schema plus "completion" (and optionally the "prompt" it answered;
    without one the prompt is the task's own, `Task.messages(example)`)
The completion is reasoning, `</think>`, then `Answer: <labels>`, and must answer the row's labels.
Several rows may share an id (several traces of one example).

Loss. The prompt goes through the checkpoint's chat format and the completion follows it, ending
with the end-of-turn token. In completion i, with label tokens L_i (the final labels on the answer
line) and the other tokens O_i (end-of-turn included), each token t gets the weight
    w_t = label_share / |L_i| on L_i,   other_share / |O_i| on O_i,   0 on the prompt,
and one optimizer update over N completions (all ranks and accumulation steps together) minimizes
    loss = -(1 / N) sum_i sum_t w_t log p(y_t | y_<t),
so each completion counts equally whatever its length, and the value does not depend on how the
completions are split across ranks or micro-batches.

Selection. Some targets are held out (`selection.per_task` per task); every row sharing one (the
same id, or the same conversation up to the same target turn) is left out of training. At each
epoch end (and every `selection.every` steps) the held-out prompts are sampled and the adapter with
the best mean macro F1 across tasks is kept.

Objectives (`objective:`): `clue` is the above. `target` and `lm` add no `<evidence>` tokens and
select nothing: best/ is the last adapter (the runs they serve, EmoLLM's Stage I, select nothing; a
held-out loss would cost rows).
    target  {"id"?, "prompt": [messages], "target", "meta"?}: loss on the target and its
            end-of-turn. By default (target_weighting=token) each target token of the update weighs
            the same, -sum log p / (its target tokens): the usual SFT loss, so a long reasoning
            target counts by its length; `row`: 1 per row, as clue.
    lm      {"id"?, "text", "meta"?}: the text and `<|endoftext|>`, each token after the first
            weighing the same. Each row stays its own sequence, right-padded or packed
            (`micro_batch_tokens`: model.Packing keeps attention and positions within each row),
            so nothing attends across documents; prepared rows are cut to max_length already.
            `meta` is never read.

Outputs in output_dir: config.yaml, metrics.jsonl, ckpt-<step>/ (checkpoint.py; exact resume),
best/ (the selected adapter and `<evidence>` rows in PEFT format; the final ones when selection is
off), selection.json (step -> per-task macro F1), merged/ with save_merged=true.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from checkpoint import ModelCard, resume, save_checkpoint, save_final, save_model, trim_log
from config import (
    ConfigError,
    MetricsWriter,
    ReportTo,
    atomic_write_text,
    bounded,
    check_report_to,
    excerpt,
    parse_cli,
    print0,
    save_resolved_config,
)
from data import (
    THINK_END,
    THINK_START,
    DataError,
    Example,
    f1_scores,
    get_task,
    is_chat,
    parse_answer,
    split_completion,
    visible_turns,
)
from dataset import example_from_json, load_jsonl, read_jsonl, typed_field
from distributed import DistributedSettings, all_reduce_sum, setup_distributed
from fsdp import gathered, is_sharded, pad_batches, sharded_model
from model import (
    Packing,
    Qwen,
    add_lora,
    add_special_tokens,
    token_logprobs,
    train_token_rows,
)
from sampling import sample_completions, sampling_from
from tokenizer import CheckpointError, QwenTokenizer, load_tokenizer
from train import (
    LoraSettings,
    Progress,
    StopRequest,
    build_optimizer,
    check_compile,
    clip_gradients,
    finetune_settings,
    linear_warmup_decay,
    optimizer_parameters,
    set_lr,
    sync_gradients,
    token_budget_parts,
)
from verifier import EVIDENCE_CLOSE, EVIDENCE_OPEN

# ----------------------------------------------------------------------------- config


@dataclass
class SelectionConfig:
    """Checkpoint selection on held-out targets, sampled as the paper does (A.2, last paragraph)."""

    # held-out targets per task (the paper: 8 per task, 24 in all); 0 turns selection off
    per_task: int = bounded(8, ge=0)
    # examples (data.py's JSONL) to hold targets out from; default: the training rows
    data: str | None = None
    # also select every this many optimizer steps (0: at epoch ends only)
    every: int = bounded(0, ge=0)
    temperature: float = bounded(1.0, gt=0)
    top_p: float = bounded(1.0, gt=0, le=1)
    top_k: int = bounded(0, ge=0)  # 0: no top-k truncation
    max_new_tokens: int = bounded(8192, ge=1)
    batch_size: int = bounded(8, ge=1)  # prompts sampled together
    seed: int = 0


@dataclass
class SFTConfig:
    model: str  # base checkpoint folder (Hugging Face layout)
    data: str  # SFT rows (JSONL); prepare/traces.py or prepare/emollm_rows.py writes it
    output_dir: str = "runs/sft"
    # the rows and their loss (module docstring)
    objective: Literal["clue", "target", "lm"] = "clue"
    # objective=target: each token, or each row, weighs the same
    target_weighting: Literal["token", "row"] = "token"
    lr: float = bounded(1e-4, ge=0)  # Table 5 (lost): the usual peak LR for LoRA SFT at r = 16
    weight_decay: float = bounded(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)  # A.1 names none for SFT: AdamW's defaults
    row_lr_scale: float = bounded(10.0, gt=0)  # the <evidence> rows: 10x the LR, no weight decay
    warmup_fraction: float = bounded(0.01, ge=0, le=1)
    # a warm-up of this many steps instead of warmup_fraction
    warmup_steps: int | None = bounded(None, ge=0)
    epochs: int = bounded(2, ge=1)
    # rows of one optimizer update over all ranks, whatever their number: A.1's 1 example per
    # device x 4 accumulation steps on its one GPU. Each rank takes every world-th row and
    # accumulates them in micro-batches of batch_size.
    rows_per_update: int = bounded(4, ge=1)
    batch_size: int = bounded(1, ge=1)  # rows per device per micro-batch
    # set: this rank's rows of an update packed without padding into micro-batches of at most
    # this many tokens (`pack`), instead of batch_size padded rows each
    micro_batch_tokens: int | None = bounded(None, ge=2)
    seed: int = 42
    # Table 5 (lost): prompt + completion tokens; longer rows are skipped and counted
    max_length: int = bounded(16384, ge=1)
    # loss weight of each completion's final-label tokens ...
    label_share: float = bounded(0.15, ge=0)
    other_share: float = bounded(0.85, ge=0)  # ... and of its other tokens, end-of-turn included
    # not in the paper: the usual clip of the global gradient norm
    max_grad_norm: float = bounded(1.0, gt=0)
    gradient_checkpointing: bool = False  # recompute each layer in backward: less memory, more time
    # torch.compile each layer for the forwards and backwards (Qwen.compile_layers)
    compile: bool = False
    # None: bfloat16 on GPU, float32 on the CPU; LoRA factors and rows stay float32
    dtype: str | None = None
    device: str | None = None  # None: cuda:LOCAL_RANK when available, else the CPU
    # the chat format's thinking switch; None: the checkpoint's default
    enable_thinking: bool | None = None
    # full: all but embedding and lm_head, sharded; best/ a whole checkpoint
    finetune: Literal["lora", "full"] = "lora"
    lora: LoraSettings | None = None  # LoRA runs only; left out: LoraSettings()
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    distributed: DistributedSettings = field(default_factory=DistributedSettings)
    # optimizer steps between checkpoints (also at each epoch end and on a stop request)
    save_every: int = bounded(200, ge=1)
    keep_checkpoints: int | None = bounded(2, ge=1)
    resume: Literal["auto", "none"] = "auto"  # auto: continue from the newest complete checkpoint
    save_merged: bool = False  # also write merged/, a full checkpoint with the adapter folded in
    # live views beside metrics.jsonl: tensorboard, wandb (sinks.py; optional packages)
    report_to: ReportTo = field(default_factory=list)

    def __post_init__(self):  # a full-parameter run (fsdp.py) takes no LoRA-only key
        check_report_to(self.report_to, self.output_dir)
        # Table 5 (lost): PEFT's usual small dropout on r 16 / alpha 32, every projection
        self.lora = finetune_settings(
            self.finetune, self.lora, self.save_merged, LoraSettings(dropout=0.05)
        )
        if self.compile:
            check_compile("compile", self.finetune, self.micro_batch_tokens)


# ----------------------------------------------------------------------------- rows


@dataclass
class Row:
    """One SFT row. `example`: the example it answers, when the row carries it (then `turns` holds
    its visible (speaker, text) pairs)."""

    id: str
    task: str
    prompt: list[dict[str, str]]
    completion: str
    labels: list[str]
    turns: tuple[tuple[str, str], ...] | None = None
    example: Example | None = None

    def answer(self, completion: str) -> list[str] | None:
        """The labels `completion` answers, read by data.parse_answer (invalid: None)."""
        return parse_answer(completion, self.example or self.task)


def row_from_example(example: Example, completion: str, prompt: list[dict] | None = None) -> Row:
    turns = tuple((t.speaker, t.text) for t in visible_turns(example))
    messages = get_task(example.task).messages(example) if prompt is None else prompt
    return Row(example.id, example.task, messages, completion, example.labels, turns, example)


def _chat_messages(value) -> list[dict[str, str]]:
    if not is_chat(value):
        raise DataError(
            "field 'prompt': expected a non-empty list of {role: system/user/assistant, content}"
        )
    return value


def row_from_json(raw) -> Row:
    """Check one row (either shape of the module docstring); errors name the field."""
    if not isinstance(raw, dict):
        raise DataError(f"expected a JSON object, got {type(raw).__name__}")
    raw = dict(raw)
    completion = typed_field(raw, "completion", str)
    del raw["completion"]
    prompt = raw.pop("prompt", None)
    prompt = None if prompt is None else _chat_messages(prompt)
    if "turns" in raw:
        row = row_from_example(example_from_json(raw), completion, prompt)
    else:
        unknown = set(raw) - {"id", "task", "labels"}
        if unknown or prompt is None:
            raise DataError(
                f"field '{sorted(unknown)[0]}': unknown field"
                if unknown
                else "field 'prompt': missing"
            )
        task = get_task(typed_field(raw, "task", str), field="task")
        if task.choices:
            raise DataError(
                f"field 'turns': a {task.name} row needs its example (turns, meta.options), whose "
                f"options decide the valid answer letters"
            )
        given = typed_field(raw, "labels", list)
        labels = [task.canonical(x) if isinstance(x, str) else None for x in given]
        if not labels or None in labels:
            bad = given[labels.index(None)] if labels else "[]"
            raise DataError(
                f"field 'labels': {excerpt(bad)} is not a label of {task.name} "
                f"(labels: {', '.join(task.labels)})"
            )
        row = Row(typed_field(raw, "id", str), task.name, prompt, completion, labels)
    answer = row.answer(completion)
    if answer is None or set(answer) != set(row.labels):
        raise DataError(
            f"field 'completion': its final Answer line gives {answer}, the row's labels are "
            f"{row.labels}"
        )
    return row


@dataclass
class TextRow:
    """A `target` row (chat prompt + free-form target) or an `lm` row (plain text as `target`,
    prompt None)."""

    id: str
    target: str
    prompt: list[dict[str, str]] | None = None


def text_row_from_json(raw, objective: str) -> TextRow:
    """Check one `target` or `lm` row (module docstring); errors name the field."""
    if not isinstance(raw, dict):
        raise DataError(f"expected a JSON object, got {type(raw).__name__}")
    key = "target" if objective == "target" else "text"
    fields = {"id", key, "meta"} | ({"prompt"} if objective == "target" else set())
    if unknown := sorted(set(raw) - fields):
        raise DataError(
            f"field '{unknown[0]}': unknown field (a {objective} row has "
            f"{', '.join(sorted(fields))})"
        )
    text = typed_field(raw, key, str)
    if not text.strip():
        raise DataError(f"field '{key}': empty")
    typed_field(raw, "meta", dict, None)
    prompt = _chat_messages(typed_field(raw, "prompt", list)) if objective == "target" else None
    return TextRow(typed_field(raw, "id", str, ""), text, prompt)


def load_rows(path, objective: str = "clue") -> list[Row] | list[TextRow]:
    """Every row of a JSONL file; a bad line raises DataError naming the file, line and field."""
    path, rows = Path(path), []
    for number, raw in read_jsonl(path):
        try:
            rows.append(
                row_from_json(raw) if objective == "clue" else text_row_from_json(raw, objective)
            )
        except DataError as e:
            raise DataError(f"{path}:{number}: {e}") from None
    if not rows:
        raise DataError(f"{path}: no rows (the file is empty)")
    return rows


def shares_target(a: Row, b: Row) -> bool:
    """Same id, or the same conversation up to the same target turn (one context may be a shortened
    copy of the other, ending at the same turn)."""
    if a.id == b.id:
        return True
    if a.turns is None or b.turns is None:
        return False
    n = min(len(a.turns), len(b.turns))
    return a.turns[-n:] == b.turns[-n:]


def hold_out(pool: list[Row], per_task: int, seed: int) -> list[Row]:
    """Up to `per_task` rows of each task, with pairwise different targets, drawn with `seed`."""
    order = list(pool)
    random.Random(seed).shuffle(order)
    chosen, count = [], dict.fromkeys((r.task for r in pool), 0)
    for row in order:
        if count[row.task] < per_task and not any(shares_target(row, c) for c in chosen):
            chosen.append(row)
            count[row.task] += 1
    return chosen


# ----------------------------------------------------------------------------- tokens and the loss


def encode_text(tok: QwenTokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids of a completion's `text` and each id's character span. The completion format's tags
    (evidence and think) become their tokens where the tokenizer has them, as the model emits them;
    everything else is plain text, so no control token (`<|im_end|>`) can be forged."""
    tags = "|".join(
        re.escape(t)
        for t in (EVIDENCE_OPEN, EVIDENCE_CLOSE, THINK_START, THINK_END)
        if tok.tokenizer.token_to_id(t) is not None
    )
    ids, spans, at = [], [], 0
    for tag in [*(re.finditer(tags, text) if tags else ()), None]:
        end = len(text) if tag is None else tag.start()
        if end > at:
            tok.tokenizer.encode_special_tokens = True
            try:
                encoding = tok.tokenizer.encode(text[at:end], add_special_tokens=False)
            finally:
                tok.tokenizer.encode_special_tokens = False
            ids += encoding.ids
            spans += [(at + a, at + b) for a, b in encoding.offsets]
        if tag is not None:
            ids.append(tok.token_id(tag.group()))
            spans.append(tag.span())
            at = tag.end()
    return ids, spans


def label_spans(completion: str, task: str | Example) -> list[tuple[int, int]] | None:
    """Character spans of the final labels on the answer line that `data.parse_answer` reads
    (`task`: the task's name, or the example for a multiple-choice task); None without a valid
    answer."""
    if parse_answer(completion, task) is None:
        return None
    _, answer = split_completion(completion)
    lines, at = [], len(completion) - len(answer)
    for line in answer.splitlines(keepends=True):
        lines.append((at, line))
        at += len(line)
    for at, line in reversed(lines):
        if parse_answer(THINK_END + "\n" + line, task) is not None:
            head = line.index(":") + 1
            # each label, outer spaces left out
            items = re.finditer(r"[^,\s](?:[^,]*[^,\s])?", line[head:])
            return [(at + head + m.start(), at + head + m.end()) for m in items]
    return None


def completion_weights(
    n_prompt: int, is_label: list[bool], label_share: float = 0.15, other_share: float = 0.85
) -> list[float]:
    """Loss weight of each token of prompt + completion: 0 on the prompt; over the completion
    (`is_label`, end-of-turn included) the label tokens share `label_share` equally and the others
    `other_share`. Raises ValueError when either group is empty."""
    n_label = sum(is_label)
    if n_label == 0 or n_label == len(is_label):
        raise ValueError(
            f"a completion needs label tokens and other tokens, got {n_label} of {len(is_label)}"
        )
    label, other = label_share / n_label, other_share / (len(is_label) - n_label)
    return [0.0] * n_prompt + [label if x else other for x in is_label]


def _after_prompt(tok: QwenTokenizer, text: str, cfg: SFTConfig) -> str:
    """The assistant's `text` without its opening `<think>` when the chat format's prompt already
    opened it."""
    if tok.chat([], enable_thinking=cfg.enable_thinking).endswith(THINK_START + "\n"):
        return text.removeprefix(THINK_START).lstrip("\n")
    return text


def encode_row(tok: QwenTokenizer, row: Row, cfg: SFTConfig) -> tuple[list[int], list[float]]:
    """(token ids, loss weights) of prompt + completion + end-of-turn."""
    prompt = tok.chat_ids(row.prompt, enable_thinking=cfg.enable_thinking)
    completion = _after_prompt(tok, row.completion, cfg)
    ids, spans = encode_text(tok, completion)
    wanted = label_spans(completion, row.example or row.task) or []
    is_label = [any(a < e and s < b for s, e in wanted) for a, b in spans]
    try:
        weights = completion_weights(
            len(prompt), is_label + [False], cfg.label_share, cfg.other_share
        )
    except ValueError:
        raise DataError(
            f"row {excerpt(row.id)}: the label tokens of its answer line cannot be located"
        ) from None
    return prompt + ids + [tok.end_of_turn], weights


def encode_text_row(
    tok: QwenTokenizer, row: TextRow, cfg: SFTConfig
) -> tuple[list[int], list[float]]:
    """(token ids, loss weights) of a `target` row (chat prompt at weight 0, then target +
    end-of-turn at 1 per token, or 1/n with target_weighting=row) or an `lm` row (text +
    `<|endoftext|>`, where the vocabulary has it, else the first EOS; 1 on every token after the
    first, which has nothing to be predicted from)."""
    if row.prompt is None:
        end = tok.tokenizer.token_to_id("<|endoftext|>")
        ids = encode_text(tok, row.target)[0] + [tok.eos_token_ids[0] if end is None else end]
        return ids, [0.0] + [1.0] * (len(ids) - 1)
    prompt = tok.chat_ids(row.prompt, enable_thinking=cfg.enable_thinking)
    target = encode_text(tok, _after_prompt(tok, row.target, cfg))[0] + [tok.end_of_turn]
    each = 1.0 / len(target) if cfg.target_weighting == "row" else 1.0
    return prompt + target, [0.0] * len(prompt) + [each] * len(target)


def collate(
    samples: list[tuple[list[int], list[float]]], pad_id: int, device
) -> tuple[torch.Tensor, torch.Tensor, None]:
    """A micro-batch: right-padded ids [B, T], the weights of each next-token target [B, T-1] (0 on
    padding), and no packing."""
    width = max(len(ids) for ids, _ in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    weights = torch.zeros(len(samples), width)
    for i, (row_ids, row_weights) in enumerate(samples):
        ids[i, : len(row_ids)] = torch.tensor(row_ids)
        weights[i, : len(row_weights)] = torch.tensor(row_weights)
    return ids.to(device), weights[:, 1:].to(device), None


def pack(
    samples: list[tuple[list[int], list[float]]], max_tokens: int, device
) -> list[tuple[torch.Tensor, torch.Tensor, Packing]]:
    """Packed micro-batches of at most `max_tokens` tokens (train.token_budget_parts): the ids
    [1, N] of their samples one after another, the weights of each next-token target [1, N-1] (0
    at a sample's last token, whose next token opens the next sample), and the Packing."""
    batches = []
    for part in token_budget_parts([len(ids) for ids, _ in samples], max_tokens):
        ids = [t for i in part for t in samples[i][0]]
        weights = [w for i in part for w in [*samples[i][1][1:], 0.0]][:-1]
        batches.append(
            (
                torch.tensor([ids], device=device),
                torch.tensor([weights], device=device),
                Packing.of([len(samples[i][0]) for i in part], device),
            )
        )
    return batches


def sft_loss(logp: torch.Tensor, weights: torch.Tensor, n_completions: float) -> torch.Tensor:
    """-(1 / N) sum w_t log p_t: this micro-batch's part of the update's loss (N over the whole
    update: its rows, or its loss tokens when each token weighs the same, `update_norm`)."""
    return -(weights * logp).sum() / n_completions


def backward_update(model: Qwen, micro_batches, n_completions: int) -> float:
    """Forward and backward over this rank's micro-batches of one optimizer update (gradients add up
    in .grad); returns this rank's part of the update's loss."""
    loss = 0.0
    for ids, weights, packing in micro_batches:  # `collate`'s or `pack`'s
        logp = token_logprobs(model, ids, mask=weights > 0, packing=packing)
        part = sft_loss(logp, weights, n_completions)
        part.backward()
        loss += part.item()
    return loss


def update_norm(samples, update: list[int], cfg: SFTConfig) -> float:
    """N of `sft_loss` for one update: its number of rows when each row shares weight 1 (clue,
    target with target_weighting=row), else its number of weighted tokens (lm, target by token)."""
    by_row = cfg.objective == "clue" or (
        cfg.objective == "target" and cfg.target_weighting == "row"
    )
    return float(len(update) if by_row else sum(sum(w > 0 for w in samples[i][1]) for i in update))


def rank_rows(update: list[int], rank: int, world: int) -> list[int]:
    """The rows of an update that `rank` of `world` trains: every world-th, from its own."""
    return update[rank::world]


def update_rows(n_rows: int, step: int, group: int, seed: int) -> list[int]:
    """Row indices of optimizer update `step`: each epoch a fresh permutation (seed + epoch), cut
    into consecutive groups of `group` = rows_per_update (the last may be short)."""
    per_epoch = math.ceil(n_rows / group)
    epoch, position = divmod(step, per_epoch)
    order = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return order[position * group : (position + 1) * group]


# --------------------------------------------------------------------------- sampling and selection


def heldout_macro_f1(
    model: Qwen, tok: QwenTokenizer, heldout: list[Row], cfg: SFTConfig, rank: int, world: int
) -> dict[str, float]:
    """Sample every held-out prompt once (each rank its share, sampling.sample_completions) and
    score macro F1 per task (data.f1_scores). Predictions travel between ranks as label
    indicators."""
    s = cfg.selection
    mine = list(range(rank, len(heldout), world))
    texts = sample_completions(
        model,
        tok,
        [heldout[i].prompt for i in mine],
        [heldout[i].id for i in mine],
        sampling_from(s, cfg.enable_thinking),
        seed=s.seed,
        batch_size=s.batch_size,
    )
    width = 1 + max(len(get_task(r.task).labels) for r in heldout)
    found = torch.zeros(len(heldout), width, device=model.device)  # column 0: the answer is valid
    for i, [text] in zip(mine, texts):
        answer = heldout[i].answer(text)
        if answer is not None:
            found[i, 0] = 1
            for label in answer:
                found[i, 1 + get_task(heldout[i].task).labels.index(label)] = 1
    found = all_reduce_sum(found).tolist()
    scores = {}
    for task in dict.fromkeys(r.task for r in heldout):
        spec, items = get_task(task), [(r, f) for r, f in zip(heldout, found) if r.task == task]
        pred = [[n for n, x in zip(spec.labels, f[1:]) if x] if f[0] else None for _, f in items]
        macro = f1_scores([r.labels for r, _ in items], pred, list(spec.labels), spec.catch_all)[
            "macro"
        ]
        # None: every held-out target is the catch-all
        scores[task] = 0.0 if macro is None else macro
    return scores


# ----------------------------------------------------------------------------- training


def _dtype(cfg: SFTConfig, device: torch.device) -> str:
    return cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32")


def split_rows(cfg: SFTConfig) -> tuple[list[Row], list[Row]]:
    """(training rows, held-out targets): the targets are drawn from `selection.data` or the rows,
    and every row sharing one is left out of training (the count is printed). Objectives other than
    clue hold nothing out."""
    if cfg.objective != "clue":
        rows = load_rows(cfg.data, cfg.objective)  # a bad row stops before any line is printed
        print0(f"objective {cfg.objective}: no checkpoint selection, best/ is the last adapter")
        return rows, []
    rows = load_rows(cfg.data)
    pool = (
        rows
        if cfg.selection.data is None
        else [row_from_example(e, "") for e in load_jsonl(cfg.selection.data)]
    )
    heldout = hold_out(pool, cfg.selection.per_task, cfg.seed) if cfg.selection.per_task > 0 else []
    kept = [r for r in rows if not any(shares_target(r, h) for h in heldout)]
    counts = ", ".join(
        f"{t} {sum(h.task == t for h in heldout)}" for t in dict.fromkeys(h.task for h in heldout)
    )
    print0(
        f"held out {len(heldout)} targets ({counts or 'selection off'}); {len(rows) - len(kept)} "
        f"of {len(rows)} rows share one and are left out of training"
    )
    if not kept:
        raise DataError(
            f"{cfg.data}: every row shares a held-out target; add rows or lower selection.per_task"
        )
    return kept, heldout


def build_model(cfg: SFTConfig, tok: QwenTokenizer, ranks) -> Qwen:
    """The model SFT trains: the base with a fresh LoRA (after torch.manual_seed(seed)), or with
    `finetune: full` every weight but embedding and lm_head, sharded (fsdp.sharded_model); the clue
    objective adds the <evidence> tokens to `tok` and trains their embedding and lm_head rows."""
    tags = [EVIDENCE_OPEN, EVIDENCE_CLOSE] if cfg.objective == "clue" else []
    dtype = _dtype(cfg, ranks.device)
    if cfg.finetune == "full":
        d = cfg.distributed
        model = sharded_model(
            cfg.model,
            dtype,
            ranks.device,
            tok,
            tags,
            train_rows=True,
            seed=cfg.seed,
            replicas=d.replicas,
            timeout_s=d.timeout_s,
        )
    else:
        model = Qwen.from_pretrained(cfg.model, dtype=dtype, device=ranks.device)
        tag_ids = add_special_tokens(model, tok, tags) if tags else []
        torch.manual_seed(cfg.seed)
        lora = cfg.lora
        add_lora(model, lora.rank, lora.alpha, lora.dropout, lora.targets, lora.compute)
        if tag_ids:
            train_token_rows(model, tag_ids)
    model.gradient_checkpointing = cfg.gradient_checkpointing
    if cfg.compile:
        model.compile_layers()
    return model


def train(cfg: SFTConfig) -> Path:
    """Run SFT as configured; returns the output folder. Data are checked before the model loads."""
    ranks = setup_distributed(cfg.device, cfg.distributed, cfg.output_dir)
    out = Path(cfg.output_dir)
    kept, heldout = split_rows(cfg)
    tok = load_tokenizer(cfg.model)
    model = build_model(cfg, tok, ranks)
    encode = encode_row if cfg.objective == "clue" else encode_text_row
    samples = [s for s in (encode(tok, r, cfg) for r in kept) if len(s[0]) <= cfg.max_length]
    print0(
        f"{len(samples)} training rows ({len(kept) - len(samples)} longer than "
        f"max_length={cfg.max_length} skipped)"
    )
    if not samples:
        raise DataError(f"{cfg.data}: no training rows left")
    # the data position is the update count, at any world size (checkpoint.py)
    group = cfg.rows_per_update
    if ranks.world_size > group:
        print0(
            f"rows_per_update {group} over {ranks.world_size} ranks: {ranks.world_size - group} "
            "rank(s) hold no row of an update (more ranks than rows do not speed it up)"
        )
    optimizer, meta, checkpoint = resume(
        out,
        model,
        lambda: build_optimizer(model, cfg.lr, cfg.weight_decay, cfg.betas, cfg.row_lr_scale),
        group,
        cfg.resume == "auto",
    )
    params = optimizer_parameters(optimizer)
    first, state = 0, {"rows": len(samples), "selection": [], "best": None}
    if meta is None:
        torch.manual_seed(cfg.seed + ranks.rank)  # dropout masks differ across ranks
    else:
        if meta["trainer"]["rows"] != len(samples):
            raise DataError(
                f"{checkpoint}: written for {meta['trainer']['rows']} training rows, the data now "
                f"give {len(samples)}; resume needs the same data (or resume=none)"
            )
        first, state = meta["step"], meta["trainer"]
        print0(f"resuming from {checkpoint} (step {first})")
    per_epoch = math.ceil(len(samples) / group)
    total = cfg.epochs * per_epoch
    save_resolved_config(cfg, out)
    trim_log(out / "metrics.jsonl", first, ranks)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_ids[0]
    progress = Progress(total, first)
    model.train()
    with MetricsWriter(out / "metrics.jsonl", cfg.report_to, cfg) as metrics, StopRequest() as stop:
        for step in range(first, total):
            lr = linear_warmup_decay(step, total, cfg.lr, cfg.warmup_fraction, cfg.warmup_steps)
            set_lr(optimizer, lr)
            update = update_rows(len(samples), step, group, cfg.seed)
            mine = [samples[i] for i in rank_rows(update, ranks.rank, ranks.world_size)]
            batches = (
                [
                    collate(mine[j : j + cfg.batch_size], pad, ranks.device)
                    for j in range(0, len(mine), cfg.batch_size)
                ]
                if cfg.micro_batch_tokens is None
                else pack(mine, cfg.micro_batch_tokens, ranks.device)
            )
            # every rank runs the same forwards and backwards: pad with ones weighing 0
            if is_sharded(model):
                batches = pad_batches(
                    batches, collate([([pad, pad], [0.0, 0.0])], pad, ranks.device), ranks.device
                )
            optimizer.zero_grad(set_to_none=True)
            loss = backward_update(model, batches, update_norm(samples, update, cfg))
            sync_gradients(params)
            grad_norm = clip_gradients(params, cfg.max_grad_norm)
            optimizer.step()
            tokens = sum(len(samples[i][0]) for i in update)
            loss = all_reduce_sum(
                torch.tensor([loss], dtype=torch.float64, device=ranks.device)
            ).item()
            done = step + 1
            record = {
                "step": done,
                "epoch": done / per_epoch,
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
            }
            metrics.write(
                record | progress.log(step, tokens, loss=loss, lr=lr, grad_norm=grad_norm)
            )
            epoch_end = done % per_epoch == 0
            if heldout and (epoch_end or (cfg.selection.every and done % cfg.selection.every == 0)):
                _select(model, tok, heldout, cfg, ranks, done, state, metrics)
            stopping = stop.requested(ranks.device)
            if stopping or epoch_end or done % cfg.save_every == 0:
                save_checkpoint(
                    out, done, model, optimizer, state, group, keep=cfg.keep_checkpoints
                )
            if stopping:
                print0(f"stopped after step {done}; run again with resume=auto to continue")
                return out
    merged = out / "merged" if cfg.save_merged else None
    save_final(
        model,
        tok,
        out / "best",
        ranks,
        model_card(cfg),
        merged,
        with_tokenizer=True,
        saved=bool(heldout),
    )
    if ranks.main:
        best = (
            f" (step {state['best']['step']}, mean macro F1 {state['best']['mean_macro_f1']:.4f})"
            if state["best"]
            else ""
        )
        print0(f"done: {out / 'best'}{best}")
    return out


def model_card(cfg: SFTConfig) -> ModelCard:
    method = {
        "clue": "SFT on reasoning traces that quote their evidence (CLUE, stage 1)",
        "target": "SFT on target completions (EmoLLM Stage I)",
        "lm": "continued pre-training, a language-model loss on every token (EmoLLM Stage I)",
    }[cfg.objective]
    return ModelCard(cfg.model, method, [cfg.data], cfg, Path(cfg.output_dir) / "metrics.jsonl")


def _select(model, tok, heldout, cfg, ranks, step: int, state: dict, metrics) -> None:
    """Score the held-out targets at `step`, log them, and keep the adapter when it is the best so
    far."""
    # a full-parameter run samples from whole weights: no collective per token
    with gathered(model) if is_sharded(model) else contextlib.nullcontext(model) as decoder:
        scores = heldout_macro_f1(decoder, tok, heldout, cfg, ranks.rank, ranks.world_size)
    mean = sum(scores.values()) / len(scores)
    state["selection"].append({"step": step, "macro_f1": scores, "mean_macro_f1": mean})
    metrics.write(
        {
            "step": step,
            **{f"eval/{t}/macro_f1": f for t, f in scores.items()},
            "eval/mean_macro_f1": mean,
        }
    )
    better = state["best"] is None or mean > state["best"]["mean_macro_f1"]
    if better:
        state["best"] = {"step": step, "mean_macro_f1": mean}
        save_model(
            model,
            tok,
            Path(cfg.output_dir) / "best",
            ranks,
            base_model_name_or_path=cfg.model,
            with_tokenizer=True,
            card=model_card(cfg),
        )
    if ranks.main:
        table = {"best_step": state["best"]["step"], "steps": state["selection"]}
        atomic_write_text(
            Path(cfg.output_dir) / "selection.json", json.dumps(table, indent=1) + "\n"
        )
    shown = ", ".join(f"{t} {f:.4f}" for t, f in scores.items())
    print0(
        f"selection at step {step}: mean macro F1 {mean:.4f} "
        f"({shown}){' (best so far)' if better else ''}"
    )


# ----------------------------------------------------------------------------- command line


def main(argv=None) -> None:
    cfg = parse_cli(SFTConfig, argv)
    try:
        train(cfg)
    except (DataError, ConfigError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
