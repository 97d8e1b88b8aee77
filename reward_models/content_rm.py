"""Social-R1's content reward model RM_content (Section 4, Appendix C.2, D): a Qwen with a scalar
value head, trained with LoRA on preference pairs, and the pairs it learns from.

    python -m reward_models.content_rm pairs config.yaml [key=value ...]   # rollouts -> teacher ->
    tiers ->
                                                                 pair file
    python -m reward_models.content_rm config.yaml [key=value ...]         # train on the pairs; the
    same under
                                                                 torchrun

Model. r(x, y) = w . h + b, where h is the final-norm hidden state of the last token of
    <|im_start|>user\\n{context}<|im_end|>\\n<|im_start|>assistant\\n{segment}<|im_end|>
(that last <|im_end|>), w [hidden] and b in float32. The context is the question as the policy saw
it, the task brief (question, options) above the conversation (`rm_context`); the segment is one
trajectory's SIP reasoning, the text before its final </think> (the paper's 42,000 segments are 700
instances x 10 checkpoints x 6 samples: one segment per trajectory). An input longer than
`max_length` keeps its last tokens when scored and is skipped (and counted) in training. In GRPO,
R_content = sigmoid(r) in (0, 1).

Loss (pairwise logistic, Bradley-Terry): L = -(1 / N) sum_pairs log sigmoid(r(x, y_chosen) - r(x,
y_rejected)) over the N pairs of one optimizer update, whatever their split over ranks and
micro-batches.

A trained RM is a folder: the LoRA adapter in PEFT's format (adapter_config.json,
adapter_model.safetensors) and beside it HEAD_FILE, value_head.safetensors, with tensors `weight`
[1, hidden] and `bias` [1] (float32; metadata: format = HEAD_FORMAT, hidden_size, base_model), plus
reward_model.json (base model, max_length, held-out accuracy) and its model card README.md.
`load_reward_model(path)` reads it back; `python -m reward_models.content_rm serve` serves it.

Pairs (Appendix C.2). A pair file is JSONL, one pair per line: {"context", "chosen", "rejected",
"tiers"} and optionally "id" (the instance); `tiers` names the rule of the priority scheme that made
it:
    P0 "S>C"  teacher reference over a hard negative    P1 "A>C"    P2 "A>B"    P3 "B>D"
    P4 "late>early"  a late-stage short trajectory over an early-stage long one
with the tiers of a segment: S the teacher's reference; A correct answer and score >= 0.8; B correct
and 0.6 <= score < 0.8; C correct and score < 0.6; D wrong answer and score <= `d_max` (the paper:
"very low"). `python -m reward_models.content_rm pairs` builds one from rollouts sampled from
policy checkpoints (evaluate.py's completions.jsonl of each): the teacher writes a reference SIP
analysis from the gold answer (examples with `meta.reference` keep theirs), the scorer rates every
segment against it with judge.py's R_content rubric, and the rules above pair them. Every teacher
answer is journaled as it arrives: a rerun asks only the rest.
"""

from __future__ import annotations

import json
import math
import random
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import judge_server
from checkpoint import ModelCard, resume, save_checkpoint, trim_log
from config import (
    ConfigError,
    MetricsWriter,
    ReportTo,
    atomic_write_text,
    bounded,
    check_output_file,
    check_report_to,
    parse_cli,
    print0,
    save_resolved_config,
)
from data import DataError, Example, parse_answer, render_conversation, split_completion, task_brief
from dataset import load_jsonl, read_jsonl
from distributed import DistributedSettings, all_reduce_sum, setup_distributed
from http_client import JudgeConfig, JudgeError
from judge import (
    JUDGES,
    parse_sip_content,
    parse_sip_reference,
    sip_content_request,
    sip_reference_request,
)
from judge_server import SECTION_RE, UnsupportedRequest
from model import Qwen, add_lora, load_adapter, open_safetensors, save_adapter
from teacher import ask_journaled, failed_calls, journal_key, load_journal
from tokenizer import CheckpointError, QwenTokenizer, load_tokenizer, read_json
from train import (
    LoraSettings,
    Progress,
    StopRequest,
    build_optimizer,
    linear_warmup_decay,
    set_lr,
    sync_gradients,
)

RM_INFO = "reward_model.json"  # what marks a folder as a reward model this module wrote


@dataclass
class ContentModelSettings:
    """reward_models/social_r1.py's `content_model:` section: social_r1's R_content from a trained
    RM instead of the prompted judge."""

    # the RM folder, scored in-process on the trainer's device (each rank holds a copy)
    path: str | None = None
    base: str | None = None  # its base checkpoint (default: the one its reward_model.json names)
    batch_size: int = 8  # segments scored together
    # or: a served RM (`python -m reward_models.content_rm serve`); then no path
    endpoint: JudgeConfig | None = None


HEAD_FILE = "value_head.safetensors"
HEAD_FORMAT = "clue-mini-value-head/1"

# ----------------------------------------------------------------------------- the model


def rm_context(example: Example) -> str:
    """The RM's context x: the task brief (question, options or labels) above the rendered
    conversation."""
    return f"{task_brief(example)}\n\n{render_conversation(example)}"


def rm_segment(completion: str) -> str:
    """The RM's segment y of a completion: its reasoning (data.split_completion), the rollout's
    `reasoning`."""
    return split_completion(completion)[0]


def encode_pair_input(tok: QwenTokenizer, context: str, segment: str) -> list[int]:
    """Token ids of (context, segment) in the module docstring's format; texts are plain text (no
    forged tokens)."""
    prompt = tok.chat_ids([{"role": "user", "content": context}])
    return prompt + tok.encode(segment, special_tokens=False) + [tok.end_of_turn]


class RewardModel(torch.nn.Module):
    """A Qwen (with its LoRA) and a float32 linear value head on the last token's final hidden
    state."""

    def __init__(self, qwen: Qwen, seed: int = 0):
        super().__init__()
        self.qwen = qwen
        d = qwen.config.hidden_size
        self.head = torch.nn.Linear(d, 1, device=qwen.device, dtype=torch.float32)
        g = torch.Generator().manual_seed(seed)
        # std 1/sqrt(d+1), as TRL's value heads; a zero head would give LoRA no gradient
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(1, d, generator=g) / math.sqrt(d + 1))
            self.head.bias.zero_()

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Rewards [B] (float32) of right-padded `ids` [B, T] whose rows hold `lengths` [B] real
        tokens."""
        h = self.qwen.hidden_states(ids)
        last = h[torch.arange(len(ids), device=ids.device), lengths - 1]
        return self.head(last.float()).squeeze(-1)

    @torch.no_grad()
    def score_ids(
        self, rows: list[list[int]], batch_size: int = 8, max_length: int | None = None
    ) -> list[float]:
        """r of each token row, longest first in batches; a row over `max_length` keeps its last
        tokens."""
        rows = [r[-max_length:] if max_length else r for r in rows]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        out = [0.0] * len(rows)
        was_training = self.training
        self.eval()
        try:
            for start in range(0, len(order), batch_size):
                chunk = order[start : start + batch_size]
                ids, lengths = pad([rows[i] for i in chunk], 0, self.qwen.device)
                for i, r in zip(chunk, self(ids, lengths).tolist()):
                    out[i] = r
        finally:
            self.train(was_training)
        return out

    def save_head(self, out_dir, base_model: str) -> None:
        """HEAD_FILE beside the adapter (format in the module docstring), written atomically."""
        out = Path(out_dir)
        tmp = out / (HEAD_FILE + ".tmp")
        meta = {
            "format": HEAD_FORMAT,
            "hidden_size": str(self.head.in_features),
            "base_model": base_model,
        }
        save_file(
            {
                "weight": self.head.weight.detach().float().cpu().contiguous(),
                "bias": self.head.bias.detach().float().cpu().contiguous(),
            },
            str(tmp),
            metadata=meta,
        )
        tmp.replace(out / HEAD_FILE)

    def load_head(self, path) -> None:
        path = Path(path)
        with open_safetensors(path) as f:
            meta = f.metadata() or {}
            if meta.get("format") != HEAD_FORMAT or set(f.keys()) != {"weight", "bias"}:
                raise CheckpointError(
                    f"{path}: not a value head (expected format {HEAD_FORMAT} with tensors "
                    f"weight, bias; got {meta.get('format')!r}, {sorted(f.keys())})"
                )
            weight, bias = f.get_tensor("weight"), f.get_tensor("bias")
        if tuple(weight.shape) != tuple(self.head.weight.shape) or tuple(bias.shape) != (1,):
            raise CheckpointError(
                f"{path}: tensor 'weight' has shape {list(weight.shape)}, the model expects "
                f"{list(self.head.weight.shape)}"
            )
        with torch.no_grad():
            self.head.weight.copy_(weight)
            self.head.bias.copy_(bias)


def pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and the row lengths [B]."""
    ids = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    return ids.to(device), torch.tensor([len(r) for r in rows], device=device)


def bt_loss(
    r_chosen: torch.Tensor, r_rejected: torch.Tensor, n_pairs: int | None = None
) -> torch.Tensor:
    """-(1 / N) sum log sigmoid(r_chosen - r_rejected); N = `n_pairs` (the whole update's), default
    the batch's."""
    return -F.logsigmoid(r_chosen - r_rejected).sum() / (
        len(r_chosen) if n_pairs is None else n_pairs
    )


class ContentRM:
    """A trained RM ready to score: `scores(pairs)` -> R_content = sigmoid(r) for (context, segment)
    pairs."""

    def __init__(self, rm: RewardModel, tok: QwenTokenizer, max_length: int, batch_size: int = 8):
        self.rm, self.tok, self.max_length, self.batch_size = rm, tok, max_length, batch_size

    def rewards(self, pairs: list[tuple[str, str]]) -> list[float]:
        rows = [encode_pair_input(self.tok, c, s) for c, s in pairs]
        return self.rm.score_ids(rows, self.batch_size, self.max_length)

    def scores(self, pairs: list[tuple[str, str]]) -> list[float]:
        return [
            1 / (1 + math.exp(-r)) if r >= 0 else math.exp(r) / (1 + math.exp(r))
            for r in self.rewards(pairs)
        ]


def save_reward_model(rm: RewardModel, out_dir, base_model: str, max_length: int, **info) -> None:
    """The RM folder of the module docstring: adapter, HEAD_FILE and RM_INFO (holding `info`
    too)."""
    out = Path(out_dir)
    save_adapter(rm.qwen, out, base_model)
    rm.save_head(out, base_model)
    info = {
        "base_model": base_model,
        "max_length": max_length,
        "head": HEAD_FILE,
        "format": HEAD_FORMAT,
        "input": (
            "ChatML user=context, assistant=segment; the reward is read at the final <|im_end|>"
        ),
        **info,
    }
    atomic_write_text(out / RM_INFO, json.dumps(info, indent=1) + "\n")


def load_reward_model(
    path, base: str | None = None, device=None, dtype=None, batch_size: int = 8
) -> ContentRM:
    """The RM folder `path` (adapter + HEAD_FILE + RM_INFO) on the base checkpoint `base` (default:
    the one it was trained from, as RM_INFO records it), frozen, in eval mode."""
    path = Path(path)
    if not (path / RM_INFO).is_file():
        raise CheckpointError(
            f"{path}: no {RM_INFO} (not a reward-model folder reward_models/content_rm.py wrote)"
        )
    info = read_json(path / RM_INFO)
    for key, kind in (("base_model", str), ("max_length", int)):
        if not isinstance(info.get(key), kind):
            raise CheckpointError(
                f"{path / RM_INFO}: field '{key}': missing or not a {kind.__name__}"
            )
    base = base or info["base_model"]
    qwen = Qwen.from_pretrained(base, dtype=dtype, device=device)
    load_adapter(qwen, path)
    rm = RewardModel(qwen)
    rm.load_head(path / HEAD_FILE)
    rm.requires_grad_(False)
    return ContentRM(rm.eval(), load_tokenizer(base), int(info["max_length"]), batch_size)


def content_scorer(settings: ContentModelSettings, device=None, dtype=None):
    """What rewards.judge_rollouts takes as `content`: the served RM's endpoint, or a function
    scoring rollouts in-process, R_content = sigmoid(r(rm_context(example), reasoning))."""
    if settings.endpoint is not None:
        return settings.endpoint
    rm = load_reward_model(settings.path, settings.base, device, dtype, settings.batch_size)
    return lambda rollouts: rm.scores([(rm_context(r.example), r.reasoning) for r in rollouts])


class RewardModelBackend:
    """A judge_server.py backend answering the R_content judge prompts (judge.sip_content_request,
    with a reference or without) with a trained content RM instead of a prompted judge: `<r> |
    <sigmoid(r), two decimals>`, the prompted judge's own format, so a trainer reaches a served RM
    through http_client.chat and reads it with parse_sip_content, the one HTTP client and the one
    parser. The RM's context is rebuilt from the request's <task> and <conversation> sections
    (rm_context's layout; the reference, when sent, is not read). Refuses every other prompt."""

    def __init__(self, path: str, base: str | None = None, device: str | None = None):
        self.rm = load_reward_model(path, base, device)
        self.lock = threading.Lock()

    def __call__(self, messages: list[dict[str, str]], params: dict[str, Any]) -> str:
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        if system not in (JUDGES["sip_content"].system, JUDGES["sip_content_free"].system):
            raise UnsupportedRequest(
                "the reward_model backend answers only the SIP content (R_content) prompt"
            )
        parts = {m.group(1): m.group(3) for m in SECTION_RE.finditer(messages[-1]["content"])}
        if not {"task", "conversation", "reasoning"} <= set(parts):
            raise UnsupportedRequest(
                "an R_content prompt without its task, conversation or reasoning section"
            )
        with self.lock:
            [r] = self.rm.rewards(
                [(f"{parts['task']}\n\n{parts['conversation']}", parts["reasoning"])]
            )
        score = 1 / (1 + math.exp(-r)) if r >= 0 else math.exp(r) / (1 + math.exp(r))
        return f"reward model r = {r:.4f} | {score:.2f}"


# ----------------------------------------------------------------------------- pair files

SCHEME = {"P0": "S>C", "P1": "A>C", "P2": "A>B", "P3": "B>D", "P4": "late>early"}
_PAIR_FIELDS = ("context", "chosen", "rejected", "tiers")


@dataclass
class Pair:
    context: str
    chosen: str
    rejected: str
    tiers: str
    id: str | None = None


def pair_from_json(raw) -> Pair:
    """One pair checked: the four fields present and non-empty strings, chosen != rejected, `tiers`
    in SCHEME."""
    if not isinstance(raw, dict):
        raise DataError(f"expected a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {*_PAIR_FIELDS, "id"})
    if unknown:
        raise DataError(
            f"field '{unknown[0]}': unknown field (a pair has {', '.join(_PAIR_FIELDS)} and id)"
        )
    for key in _PAIR_FIELDS:
        if key not in raw or raw[key] is None:
            raise DataError(f"field '{key}': missing")
        if not isinstance(raw[key], str) or not raw[key].strip():
            raise DataError(f"field '{key}': expected a non-empty string, got {raw[key]!r}"[:200])
    if raw["chosen"].strip() == raw["rejected"].strip():
        raise DataError(
            "field 'rejected': identical to 'chosen' (a pair needs two different segments)"
        )
    if raw["tiers"] not in SCHEME.values():
        raise DataError(
            f"field 'tiers': {raw['tiers']!r} is not a pair of the priority scheme "
            f"({', '.join(f'{k} {v}' for k, v in SCHEME.items())})"
        )
    if raw.get("id") is not None and not isinstance(raw["id"], str):
        raise DataError(f"field 'id': expected a string, got {raw['id']!r}")
    return Pair(raw["context"], raw["chosen"], raw["rejected"], raw["tiers"], raw.get("id"))


def load_pairs(path) -> list[Pair]:
    """Every pair of a JSONL file; a bad line raises DataError naming the file, line and field."""
    path, pairs = Path(path), []
    for number, raw in read_jsonl(path):
        try:
            pairs.append(pair_from_json(raw))
        except DataError as e:
            raise DataError(f"{path}:{number}: {e}") from None
    if not pairs:
        raise DataError(f"{path}: no pairs (the file is empty)")
    return pairs


def split_heldout(pairs: list[Pair], fraction: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    """(training, held-out) with whole contexts held out (about `fraction` of them), so no held-out
    context is trained on."""
    contexts = sorted({p.context for p in pairs})
    random.Random(seed).shuffle(contexts)
    n = min(len(contexts) - 1, max(1, round(fraction * len(contexts)))) if fraction > 0 else 0
    held = set(contexts[:n])
    return [p for p in pairs if p.context not in held], [p for p in pairs if p.context in held]


# -------------------------------------------------------------------- tiers and the priority scheme


@dataclass
class TierRule:
    """Tier boundaries (Appendix C.2). The paper's B and C ranges meet at 0.6 and 0.8 inclusive on
    both sides: a score on a boundary goes to the higher tier (ours). "Very low" for D is ours: at
    most 0.2, the rubric's perception-failure ceiling (Table 5)."""

    a_min: float = 0.8
    b_min: float = 0.6
    d_max: float = 0.2


@dataclass
class RatedSegment:
    """One sampled trajectory's SIP reasoning, with what tiering reads."""

    id: str  # the instance (example id)
    step: int  # the policy checkpoint it was sampled from
    text: str
    correct: bool
    score: float | None = None  # the scorer's rating against the reference; None: not rated

    @property
    def words(self) -> int:
        return len(self.text.split())


def tier_of(segment: RatedSegment, rule: TierRule) -> str | None:
    """A, B, C (correct answer) or D (wrong, score <= d_max); None for a wrong answer scored above
    d_max or an unrated segment: those join no pair."""
    if segment.score is None:
        return None
    if segment.correct:
        return "A" if segment.score >= rule.a_min else "B" if segment.score >= rule.b_min else "C"
    return "D" if segment.score <= rule.d_max else None


@dataclass
class SchemeSettings:
    """How many pairs each instance contributes. The paper gives the totals only: 20K training pairs
    from 700 instances (29 each, ours) and 2K held-out pairs from the 100 test instances (20)."""

    per_instance: int = 29
    # P4: the early segment has at least this many times the late one's words
    p4_length_ratio: float = 1.5
    seed: int = 0


def instance_pairs(
    reference: str | None, segments: list[RatedSegment], rule: TierRule, s: SchemeSettings
) -> list[dict]:
    """The pairs of one instance as {chosen, rejected, tiers} by the priority scheme, in its order.
    P0-P3 pair tiers; P4 (our reading) pairs a segment of the later half of the checkpoints (step
    above the instance's median step) with an A or B tier over one from the earlier half with at
    least p4_length_ratio x its words and no higher score, so a concise late trajectory beats a
    verbose early one on length alone, never on a worse reading. Up to `per_instance` pairs are
    drawn round-robin, one per rule in priority order and round, so every rule that has pairs gets
    its share before any rule gets more, and a rule with too few leaves its share to the others."""
    rng = random.Random(f"{s.seed}/{segments[0].id if segments else ''}")
    by_tier = {t: [x.text for x in segments if tier_of(x, rule) == t] for t in "ABCD"}
    by_tier["S"] = [reference] if reference else []
    steps = sorted(x.step for x in segments)
    median = steps[len(steps) // 2] if steps else 0
    candidates = {}
    for name, tiers in SCHEME.items():
        if name == "P4":
            late = [
                x
                for x in segments
                if x.step >= median and x.step > steps[0] and tier_of(x, rule) in ("A", "B")
            ]
            early = [x for x in segments if x.step < median and x.score is not None]
            options = [
                (a.text, b.text)
                for a in late
                for b in early
                if b.words >= s.p4_length_ratio * a.words and b.score <= a.score
            ]
        else:
            high, low = tiers.split(">")
            options = [(a, b) for a in by_tier[high] for b in by_tier[low]]
        options = sorted({(a, b) for a, b in options if a.strip() != b.strip()})
        rng.shuffle(options)
        candidates[name] = options
    taken = dict.fromkeys(SCHEME, 0)
    while sum(taken.values()) < s.per_instance:
        open_rules = [n for n in SCHEME if taken[n] < len(candidates[n])]
        if not open_rules:
            break
        for name in open_rules[: s.per_instance - sum(taken.values())]:
            taken[name] += 1
    return [
        {"chosen": a, "rejected": b, "tiers": SCHEME[name]}
        for name in SCHEME
        for a, b in candidates[name][: taken[name]]
    ]


# --------------------------------------------------------------------------- building the pair file


@dataclass
class RolloutFile:
    step: int  # the policy checkpoint's training step
    # JSONL with "id" (an example's) and "completion" per line: evaluate.py's completions.jsonl
    path: str


@dataclass
class PairsConfig:
    """`python -m reward_models.content_rm pairs`: rate sampled rollouts with a teacher and write
    the pair file (`out`)."""

    # gold examples (data.py's JSONL); meta.reference, where present, is the S-tier reference
    examples: str
    rollouts: list[RolloutFile] = field(default_factory=list)
    out: str = "data/social_pairs.jsonl"
    journal: str | None = None  # teacher answers so far; default <out>.journal.jsonl
    # writes the references (the paper: o3)
    teacher: JudgeConfig = field(default_factory=JudgeConfig)
    scorer: JudgeConfig | None = None  # rates the segments (the paper: GPT-5); default the teacher
    tiers: TierRule = field(default_factory=TierRule)
    scheme: SchemeSettings = field(default_factory=SchemeSettings)


def load_segments(p: PairsConfig, examples: dict[str, Example]) -> list[RatedSegment]:
    segments = []
    for source in p.rollouts:
        records = list(read_jsonl(source.path))
        if not records:  # a checkpoint's rollouts missing, not a checkpoint with none
            raise DataError(
                f"{source.path}: no completion (step {source.step}'s evaluation not run, or "
                "stopped before it sampled: run it, or drop the entry)"
            )
        for number, raw in records:
            where = f"{source.path}:{number}"
            if not isinstance(raw, dict) or not isinstance(raw.get("completion"), str):
                raise DataError(f"{where}: field 'completion': missing or not a string")
            if not isinstance(raw.get("id"), str) or raw["id"] not in examples:
                raise DataError(
                    f"{where}: field 'id': {raw.get('id')!r} is not an example of {p.examples}"
                )
            example = examples[raw["id"]]
            answer = parse_answer(raw["completion"], example)
            text = rm_segment(raw["completion"])
            if text:
                segments.append(
                    RatedSegment(
                        example.id,
                        source.step,
                        text,
                        answer is not None and set(answer) == set(example.labels),
                    )
                )
    return segments


def build_pairs(p: PairsConfig) -> dict[str, int]:
    """References, segment ratings, tiers, pairs: writes `p.out` and returns (and prints) the
    counts. Stops with JudgeError when calls failed (the answers so far are journaled; rerun to
    continue)."""
    check_output_file(
        p.out,
        "build.out",
        {"build.examples": p.examples, "build.rollouts": [r.path for r in p.rollouts]},
    )
    examples = {e.id: e for e in load_jsonl(p.examples)}
    segments = load_segments(p, examples)
    if not segments:
        files = ", ".join(source.path for source in p.rollouts) or "(none given)"
        raise DataError(f"rollouts: no completion with a reasoning segment in {files}")
    journal = Path(p.journal or str(p.out) + ".journal.jsonl")
    done = load_journal(journal)
    references = {
        i: e.meta["reference"]
        for i, e in examples.items()
        if isinstance(e.meta.get("reference"), str) and e.meta["reference"].strip()
    }
    wanted = sorted({s.id for s in segments} - set(references))
    ref_keys = {i: journal_key("reference", i) for i in wanted}
    asked = ask_journaled(
        [
            (
                ref_keys[i],
                sip_reference_request(examples[i]),
                lambda text, e=examples[i]: parse_sip_reference(text, e),
            )
            for i in wanted
        ],
        p.teacher,
        journal,
        done,
        "build.teacher",
    )
    references |= {i: done[ref_keys[i]] for i in wanted if done.get(ref_keys[i])}
    rated = [s for s in segments if s.id in references]
    keys = [journal_key("score", s.id, references[s.id], s.text) for s in rated]
    calls = [
        (k, sip_content_request(examples[s.id], s.text, references[s.id]), parse_sip_content)
        for k, s in zip(keys, rated)
    ]
    scored = ask_journaled(
        calls, p.scorer or p.teacher, journal, done, "build.scorer" if p.scorer else "build.teacher"
    )
    if asked["errors"] or scored["errors"]:
        raise JudgeError(failed_calls(asked["errors"] + scored["errors"], journal))
    for s, k in zip(rated, keys):
        s.score = done.get(k)
    rows = []
    for i in sorted({s.id for s in rated}):
        mine = [s for s in rated if s.id == i]
        context = rm_context(examples[i])
        rows += [
            {"id": i, "context": context, **pair}
            for pair in instance_pairs(references[i], mine, p.tiers, p.scheme)
        ]
    atomic_write_text(p.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    counts = {
        "segments": len(segments),
        "references_missing": len({s.id for s in segments} - set(references)),
        "unrated": sum(s.score is None for s in rated),
        "pairs": len(rows),
        **{f"tier_{t}": sum(tier_of(s, p.tiers) == t for s in rated) for t in "ABCD"},
        **{name: sum(r["tiers"] == t for r in rows) for name, t in SCHEME.items()},
        "malformed": asked["malformed"] + scored["malformed"],
    }
    print0("pairs: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + f" -> {p.out}")
    return counts


# ----------------------------------------------------------------------------- training


@dataclass
class RMConfig:
    """Training settings. Appendix D gives the initialization (Qwen3-4B-Instruct-2507), LoRA, the
    pairwise loss and two epochs; every other value is ours and says so."""

    model: str  # base checkpoint (the paper: Qwen3-4B-Instruct-2507)
    pairs: str  # the pair file (`pairs` writes it)
    heldout: str | None = None  # a held-out pair file; default: `heldout_fraction` of the contexts
    # ours (the paper holds out 2K pairs built from test instances)
    heldout_fraction: float = bounded(0.1, gt=0, le=0.5)
    output_dir: str = "runs/rm"
    epochs: int = bounded(2, ge=1)  # Appendix D
    lr: float = bounded(5e-5, ge=0)  # ours: a common LoRA reward-model peak LR
    # ours: the freshly initialized head learns at 10x the LoRA LR, no weight decay
    head_lr_scale: float = bounded(10.0, gt=0)
    weight_decay: float = bounded(0.01, ge=0)  # ours, as the project's other trainers
    betas: tuple[float, float] = (0.9, 0.999)
    # ours; then linear decay to 0 (train.linear_warmup_decay)
    warmup_fraction: float = bounded(0.03, ge=0, le=1)
    batch_size: int = bounded(4, ge=1)  # pairs per device per micro-batch (ours)
    # ours: 4 ranks x 4 x 2 = 32 pairs per update on the paper's four GPUs
    grad_accum: int = bounded(2, ge=1)
    max_length: int = bounded(4096, ge=1)  # ours: context + segment tokens
    max_grad_norm: float = bounded(1.0, gt=0)
    # also report held-out accuracy every this many updates (0: at epoch ends only)
    eval_every: int = bounded(0, ge=0)
    # updates between checkpoints (also at each epoch end and on a stop request), as sft.py
    save_every: int = bounded(200, ge=1)
    keep_checkpoints: int | None = bounded(2, ge=1)
    # auto: continue from the newest complete checkpoint (exact resume)
    resume: Literal["auto", "none"] = "auto"
    seed: int = 42
    distributed: DistributedSettings = field(default_factory=DistributedSettings)
    # None: bfloat16 on GPU, float32 on the CPU; LoRA and the head stay float32
    dtype: str | None = None
    device: str | None = None
    gradient_checkpointing: bool = False
    # sft.py's defaults: ours
    lora: LoraSettings = field(default_factory=lambda: LoraSettings(dropout=0.05))
    build: PairsConfig | None = None  # the `pairs` command's settings
    # the held-out pairs, built the same way from other instances (the paper: 2K pairs from the
    # test instances); `pairs` writes them to `heldout` after `build`
    build_heldout: PairsConfig | None = None
    # live views beside metrics.jsonl: tensorboard, wandb (sinks.py; optional packages)
    report_to: ReportTo = field(default_factory=list)

    def __post_init__(self):
        check_report_to(self.report_to, self.output_dir)


def encode_pairs(
    tok: QwenTokenizer, pairs: list[Pair], max_length: int
) -> list[tuple[list[int], list[int]]]:
    rows = [
        (encode_pair_input(tok, p.context, p.chosen), encode_pair_input(tok, p.context, p.rejected))
        for p in pairs
    ]
    return [r for r in rows if max(len(r[0]), len(r[1])) <= max_length]


def pairwise_accuracy(
    rm: RewardModel,
    rows: list[tuple[list[int], list[int]]],
    rank: int = 0,
    world: int = 1,
    batch_size: int = 8,
) -> float:
    """The share of pairs with r(chosen) > r(rejected) (a tie counts half), over every rank's
    share."""
    mine = rows[rank::world]
    r = rm.score_ids([x for pair in mine for x in pair], batch_size)
    wins = sum(1.0 if c > j else 0.5 if c == j else 0.0 for c, j in zip(r[0::2], r[1::2]))
    total = all_reduce_sum(
        torch.tensor([wins, len(mine)], dtype=torch.float64, device=rm.qwen.device)
    ).tolist()
    return total[0] / max(total[1], 1)


def train(cfg: RMConfig) -> dict:
    """Train the RM as configured; returns {heldout_accuracy_before, heldout_accuracy, ...} (also in
    RM_INFO)."""
    ranks = setup_distributed(cfg.device, cfg.distributed, cfg.output_dir)
    pairs = load_pairs(cfg.pairs)
    train_pairs, heldout = (
        (pairs, load_pairs(cfg.heldout))
        if cfg.heldout
        else split_heldout(pairs, cfg.heldout_fraction, cfg.seed)
    )
    tok = load_tokenizer(cfg.model)
    rows, held = (
        encode_pairs(tok, train_pairs, cfg.max_length),
        encode_pairs(tok, heldout, cfg.max_length),
    )
    print0(
        f"{len(rows)} training pairs, {len(held)} held out ({len(train_pairs) - len(rows)} and "
        f"{len(heldout) - len(held)} longer than max_length={cfg.max_length} skipped)"
    )
    if not rows:
        raise DataError(f"{cfg.pairs}: no training pairs left")
    dtype = cfg.dtype or ("bfloat16" if ranks.device.type == "cuda" else "float32")
    qwen = Qwen.from_pretrained(cfg.model, dtype=dtype, device=ranks.device)
    torch.manual_seed(cfg.seed)
    lora = cfg.lora
    add_lora(qwen, lora.rank, lora.alpha, lora.dropout, lora.targets, lora.compute)
    qwen.gradient_checkpointing = cfg.gradient_checkpointing
    rm = RewardModel(qwen, cfg.seed)
    out = Path(cfg.output_dir)

    def make_optimizer():
        optimizer = build_optimizer(qwen, cfg.lr, cfg.weight_decay, cfg.betas)
        optimizer.add_param_group(
            {
                "params": list(rm.head.parameters()),
                "weight_decay": 0.0,
                "lr_scale": cfg.head_lr_scale,
            }
        )
        return optimizer

    group = cfg.batch_size * cfg.grad_accum * ranks.world_size  # pairs per update, all ranks
    optimizer, meta, checkpoint = resume(out, qwen, make_optimizer, group, cfg.resume == "auto")
    if meta is not None:
        rm.load_head(checkpoint / HEAD_FILE)
        if meta["trainer"]["training_pairs"] != len(rows):
            raise DataError(
                f"{checkpoint}: written for {meta['trainer']['training_pairs']} training pairs, "
                f"the pair files now give {len(rows)}; resume needs the same pairs (or "
                f"resume=none)"
            )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    per_epoch = math.ceil(len(rows) / group)
    total = cfg.epochs * per_epoch
    save_resolved_config(cfg, out)
    if meta is not None:
        first, state = meta["step"], meta["trainer"]
        print0(f"resuming from {checkpoint} (step {first})")
    else:
        before = pairwise_accuracy(rm, held, ranks.rank, ranks.world_size) if held else None
        first, state = (
            0,
            {
                "training_pairs": len(rows),
                "heldout_pairs": len(held),
                "heldout_accuracy_before": before,
                "heldout_accuracy": before,
            },
        )
        if held:
            print0(f"held-out pairwise accuracy before training: {before:.4f} ({len(held)} pairs)")
    trim_log(out / "metrics.jsonl", first, ranks)
    progress = Progress(total, first)
    rm.train()
    with MetricsWriter(out / "metrics.jsonl", cfg.report_to, cfg) as metrics, StopRequest() as stop:
        for step in range(first, total):
            lr = linear_warmup_decay(step, total, cfg.lr, cfg.warmup_fraction)
            set_lr(optimizer, lr)
            epoch, position = divmod(step, per_epoch)
            order = torch.randperm(
                len(rows), generator=torch.Generator().manual_seed(cfg.seed + epoch)
            ).tolist()
            update = order[position * group : (position + 1) * group]
            mine = update[ranks.rank :: ranks.world_size]
            optimizer.zero_grad(set_to_none=True)
            loss = correct = 0.0
            for j in range(0, len(mine), cfg.batch_size):
                batch = [rows[i] for i in mine[j : j + cfg.batch_size]]
                ids, lengths = pad(
                    [x for pair in batch for x in pair], tok.pad_token_id or 0, ranks.device
                )
                r = rm(ids, lengths)
                part = bt_loss(r[0::2], r[1::2], len(update))
                part.backward()
                loss, correct = loss + part.item(), correct + (r[0::2] > r[1::2]).sum().item()
            sync_gradients(params)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item()
            optimizer.step()
            loss, correct = all_reduce_sum(
                torch.tensor([loss, correct], dtype=torch.float64, device=ranks.device)
            ).tolist()
            done = step + 1
            tokens = sum(len(x) for i in update for x in rows[i])
            record = {
                "step": done,
                "epoch": done / per_epoch,
                "loss": loss,
                "train_accuracy": correct / len(update),
                "lr": lr,
                "grad_norm": grad_norm,
            }
            metrics.write(
                record | progress.log(step, tokens, loss=loss, lr=lr, grad_norm=grad_norm)
            )
            epoch_end = done % per_epoch == 0
            if held and (epoch_end or (cfg.eval_every and done % cfg.eval_every == 0)):
                state["heldout_accuracy"] = pairwise_accuracy(
                    rm, held, ranks.rank, ranks.world_size
                )
                metrics.write({"step": done, "eval/heldout_accuracy": state["heldout_accuracy"]})
                print0(
                    f"held-out pairwise accuracy at step {done}: {state['heldout_accuracy']:.4f}"
                )
            stopping = stop.requested(ranks.device)
            if stopping or epoch_end or done % cfg.save_every == 0:
                save_checkpoint(
                    out,
                    done,
                    qwen,
                    optimizer,
                    state,
                    group,
                    keep=cfg.keep_checkpoints,
                    write_extra=lambda folder: rm.save_head(folder, cfg.model),
                )
            if stopping:
                print0(f"stopped after step {done}; run again with resume=auto to continue")
                return state
    if ranks.main:
        save_reward_model(rm, out, cfg.model, cfg.max_length, **state)
        card = ModelCard(
            cfg.model,
            "a pairwise (Bradley-Terry) reward model of reasoning segments, Social-R1's "
            "RM_content (Appendix D)",
            [cfg.pairs, *([cfg.heldout] if cfg.heldout else [])],
            cfg,
            out / "metrics.jsonl",
        )
        atomic_write_text(out / "README.md", card.text())
        print0(f"done: {out} (held-out pairwise accuracy {state['heldout_accuracy']})")
    return state


# ----------------------------------------------------------------------------- command line


def check_heldout(cfg: RMConfig, path: str) -> None:
    """`build_heldout` writes the `heldout` file training reads, from instances `build` has not."""
    if cfg.build_heldout.out != cfg.heldout:
        raise ConfigError(
            f"{path}: 'build_heldout.out' ({cfg.build_heldout.out}) must be 'heldout' "
            f"({cfg.heldout}), the file training reads its held-out pairs from"
        )
    shared = {e.id for e in load_jsonl(cfg.build.examples)} & {
        e.id for e in load_jsonl(cfg.build_heldout.examples)
    }
    if shared:
        raise DataError(
            f"{cfg.build_heldout.examples}: {len(shared)} held-out instances are also training "
            f"instances of {cfg.build.examples}, e.g. {sorted(shared)[0]!r}"
        )


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        serve = {"reward_model": lambda a: RewardModelBackend(a.model, a.base, a.device)}
        return judge_server.main(["--backend", "reward_model", *argv[1:]], serve)
    command = argv.pop(0) if argv[:1] == ["pairs"] else "train"
    try:
        cfg = parse_cli(RMConfig, argv)
        if command == "pairs":
            if cfg.build is None:
                raise ConfigError(
                    f"{argv[0]}: missing section 'build' (what `python -m reward_models.content_rm "
                    "pairs` reads)"
                )
            held = cfg.build_heldout
            if held is not None:
                check_heldout(cfg, argv[0])
            build_pairs(cfg.build)
            if held is not None:
                build_pairs(held)
        else:
            train(cfg)
    except (DataError, ConfigError, CheckpointError, JudgeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
