"""EmoLLM Stage I data (section 3.2.1, D.1, Appendix H): the rows of its two parts, which sft.py
then trains.

    python -m prepare.emollm_rows configs/emollm_stage1_cpt_prepare.yaml
        # objective lm: CPT rows with knowledge prefixes
    python -m prepare.emollm_rows configs/emollm_stage1_sft_prepare.yaml
        # objective target: ARG SFT rows from a teacher
    python -m prepare.emollm_rows configs/emollm_sft_baseline_prepare.yaml
        # objective target, reply_only: the recorded replies (the SFT baseline)

The config (EmoLLMData) names the part by its `objective`, sft.py's objective that trains on the
rows, and the checkpoint (`model`) whose tokenizer measures `max_length` as sft.py encodes the rows.

Dialogues (`dialogues`: files in ESConv's layout, a JSON array as ESConv.json ships, or JSONL with
one dialogue per line, as prepare/convert.py writes for EmpatheticDialogues, MSDialog, MedDialog
and ICLR's review threads): each dialogue is
an object with `dialog`, a list of turns {"speaker": "seeker" | "supporter", "content": non-empty
text, "annotation"?: {"strategy"?: text}}, and optionally "id", "situation", "problem_type",
"emotion_type" (ESConv's own fields). Consecutive utterances of one speaker make one turn (their
texts joined by a space); the seeker is the user, the supporter the assistant. A context x_<=t is a
dialogue up to one of its user turns. The supporter's strategies are checked and kept in each row's
`meta` (the strategy of the supporter's next turn); neither G nor the teacher reads them, as in the
paper.

Knowledge (`knowledge`, ECoK's triples; its public layout is not certain, so ours is documented):
JSONL, one {"head", "relation", "tail"} object per line, each a non-empty string. `relations` maps
each relation name (case-insensitive) to the slot of g_t its tails fill (needs, appraisal or
emotion); other relations are unused.

G(x_<=t, K), our simple retrieval (the paper names what G yields, not how):
  - words: lower-case runs of letters of at least 3 letters, minus a short stop-word list, a final
    "s" dropped.
  - query: the words of the current user turn and of the dialogue's situation.
  - a triple matches when the share of its head's words found in the query is at least
    `min_overlap`; matches rank by that share, then by the number of shared words, then by file
    order; each slot keeps the tails of its first `per_slot` matches (distinct tails).
  - Facts: the dialogue's problem type and situation when given, and the current user turn (its
    first `fact_words` words). Emotion: the dialogue's emotion type when given, then the emotion
    tails.
  - an empty slot reads "(none retrieved)".
CPT row: {"id", "text": "<think>\\nFacts: ...\\nNeeds: ...\\nAppraisal: ...\\nEmotion:
...\\n</think>\\n" + "User: ...\\nAssistant: ...\\nUser: ...", "meta"}; the oldest turns are dropped
until the row fits max_length (as sft.py encodes it); a row whose current turn alone does not fit is
skipped and counted.

ARG SFT: `share` of each source's contexts (a source is one file of `dialogues`; EmoLLM C.2 samples
10% of each dataset) are drawn at random (seed; `sample_contexts`), and the teacher
(http_client.chat, concurrent, resumable: teacher.ask_journaled journals every answer in
`<out>.teacher.jsonl`) writes the ARG state in Appendix H's order (Facts, Needs, Appraisal, Emotion,
Strategy, then optionally up to `lookahead` reverse-perspective steps and the strategy chosen after
them, as the Stage II scaffold of dialogue/play.py names them), the gating label r_t and the reply.
An answer missing a section or the reply, or out of that format, is rejected and counted. Row:
{"id", "prompt": [the context as chat messages], "target", "meta": {"gate", ...}}, target =
"<think>\\n<ARG>\\n</think>\\n\\n<reply>" when r_t = 1, the reply alone when r_t = 0; a row longer
than max_length is dropped and counted.

Reply SFT (`reply_only: true`, Table 1's response-only SFT baseline): the same sampled contexts,
each with the supporter's recorded reply as its target; no teacher, no ARG.

Bad input (a turn without speaker or with empty content, a malformed triple) raises DataError naming
the file, the line (of the record; in a JSON array, the line where the dialogue starts) and the
field, before anything is written.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import sft
from config import (
    ConfigError,
    bounded,
    check_output_file,
    excerpt,
    parse_cli,
    print0,
)
from data import THINK_END, THINK_START, DataError
from dataset import check_new_id, parse_json, read_data_text, reject_json_constant, typed_field
from http_client import JudgeCall, JudgeConfig, JudgeError
from judge import ARG_SECTIONS, DATA_NOTICE, chat_messages, section
from teacher import ask_journaled, load_journal, raw_text, request_key, write_rows
from tokenizer import CheckpointError, load_tokenizer

# ----------------------------------------------------------------------------- config


@dataclass
class Relations:
    """ECoK relation names (case-insensitive) whose tails fill each slot of g_t (ours: ATOMIC-style
    names and plain ones; the paper does not list ECoK's)."""

    needs: tuple[str, ...] = ("xNeed", "xWant", "xIntent", "need", "want", "goal")
    appraisal: tuple[str, ...] = ("xAttr", "appraisal", "cause", "evaluation")
    emotion: tuple[str, ...] = ("xReact", "oReact", "emotion", "feeling")


@dataclass
class EmoLLMData:
    """`python -m prepare.emollm_rows` for EmoLLM's Stage I (module docstring); rows go to `out`
    (sft.py's `data`)."""

    dialogues: list[str]  # ESConv-layout files
    # sft.py's objective for the rows: lm (CPT) or target (ARG SFT)
    objective: Literal["lm", "target"]
    out: str  # the rows written (sft.py's `data`)
    model: str  # the checkpoint sft.py trains (its tokenizer measures max_length)
    # sft.py's max_length: CPT rows are cut to fit, longer ARG rows dropped
    max_length: int = bounded(16384, ge=1)
    # sft.py's enable_thinking (the chat format the rows are measured in)
    enable_thinking: bool | None = None
    knowledge: str | None = None  # objective lm: the ECoK-layout triples (JSONL)
    relations: Relations = field(default_factory=Relations)
    # share of a triple head's words that the query must hold
    min_overlap: float = bounded(0.5, ge=0, le=1)
    per_slot: int = bounded(2, ge=1)  # tails kept per slot of g_t
    fact_words: int = 25  # words of the current user turn kept among the facts
    # objective target: the share of each source's contexts sent to the teacher (None: all)
    share: float | None = bounded(None, gt=0, le=1)
    # objective target: each sampled context's recorded supporter reply as its target, no teacher
    # and no ARG (Table 1's response-only SFT baseline)
    reply_only: bool = False
    # most reverse-perspective steps the teacher may write (Appendix H: three)
    lookahead: int = bounded(3, ge=1)
    max_tokens: int = 1024  # the teacher's new tokens per answer
    seed: int = 0
    teacher: JudgeConfig = field(default_factory=JudgeConfig)

    def __post_init__(self):
        if self.objective == "lm" and self.knowledge is None:
            raise ConfigError("knowledge: the CPT rows (objective lm) need the knowledge triples")


# ----------------------------------------------------------------------------- dialogues


@dataclass(frozen=True)
class Dialogue:
    id: str
    # (role user/assistant, text, supporter strategies)
    turns: tuple[tuple[str, str, tuple[str, ...]], ...]
    situation: str | None = None
    problem: str | None = None
    emotion: str | None = None
    source: str = ""  # the file it came from: the ARG contexts are sampled per source


_ROLES = {"seeker": "user", "supporter": "assistant"}


_BETWEEN = re.compile(r"[\s,]*")  # what separates the records of a JSON array


def _records(path) -> list[tuple[int, object]]:
    """(line, value) of each record of a JSON array file (the line where it starts) or of a JSONL
    file."""
    text = read_data_text(path)
    if not text.lstrip().startswith("["):
        return [
            (n, parse_json(line, path, n))
            for n, line in enumerate(text.split("\n"), 1)
            if line.strip()
        ]
    parse_json(text, path)  # the file is strict JSON: the walk below cannot fail
    decoder, at, records = (
        json.JSONDecoder(parse_constant=reject_json_constant),
        text.index("[") + 1,
        [],
    )
    line, counted = 1, 0
    while True:
        at = _BETWEEN.match(text, at).end()
        if text[at] == "]":
            return records
        line, counted = line + text.count("\n", counted, at), at
        value, at = decoder.raw_decode(text, at)
        records.append((line, value))


def _text(raw: dict, key: str, where: str = "") -> str | None:
    value = typed_field(raw, key, str, None, where)
    if value is not None and not value.strip():
        raise DataError(f"field '{where}{key}': empty")
    return value


def dialogue_from_json(raw, default_id: str) -> Dialogue:
    if not isinstance(raw, dict):
        raise DataError(f"expected a dialogue object, got {type(raw).__name__}")
    turns = typed_field(raw, "dialog", list)
    if not turns:
        raise DataError("field 'dialog': empty")
    merged = []
    for i, turn in enumerate(turns):
        where = f"dialog[{i}]."
        if not isinstance(turn, dict):
            raise DataError(f"field 'dialog[{i}]': expected an object, got {type(turn).__name__}")
        speaker, text = _text(turn, "speaker", where), _text(turn, "content", where)
        if speaker is None or text is None:
            raise DataError(
                f"field '{where}{'speaker' if speaker is None else 'content'}': missing"
            )
        if speaker not in _ROLES:
            raise DataError(
                f"field '{where}speaker': {excerpt(speaker)} is neither 'seeker' nor 'supporter'"
            )
        annotation = typed_field(turn, "annotation", dict, {}, where)
        strategy = _text(annotation, "strategy", where + "annotation.")
        role, strategies = _ROLES[speaker], (strategy,) if strategy else ()
        if merged and merged[-1][0] == role:
            merged[-1] = (role, merged[-1][1] + " " + text.strip(), merged[-1][2] + strategies)
        else:
            merged.append((role, text.strip(), strategies))
    return Dialogue(
        _text(raw, "id") or default_id,
        tuple(merged),
        _text(raw, "situation"),
        _text(raw, "problem_type"),
        _text(raw, "emotion_type"),
    )


def load_dialogues(paths: list[str]) -> list[Dialogue]:
    """Every dialogue of the files (module docstring); ids default to <file stem>-<index>."""
    dialogues, seen = [], set()
    for path in paths:
        for index, (line, raw) in enumerate(_records(path)):
            try:
                dialogue = dialogue_from_json(raw, f"{Path(path).stem}-{index}")
                dialogues.append(dataclasses.replace(dialogue, source=path))
                check_new_id(dialogues[-1].id, seen)
            except DataError as e:
                raise DataError(f"{path}:{line}: {e}") from None
    if not dialogues:
        raise DataError(f"{', '.join(paths) or 'emollm.dialogues'}: no dialogues")
    return dialogues


def contexts(dialogue: Dialogue) -> list[int]:
    """Indices t of the user turns: x_<=t is turns[:t + 1]."""
    return [t for t, (role, _, _) in enumerate(dialogue.turns) if role == "user"]


def context_meta(dialogue: Dialogue, t: int) -> dict:
    after = dialogue.turns[t + 1] if t + 1 < len(dialogue.turns) else None
    return {"source": dialogue.id, "turn": t, "next_strategy": list(after[2]) if after else []}


def render_context(turns) -> str:
    """Appendix H's input layout: one `User: ...` / `Assistant: ...` paragraph per turn."""
    return "\n".join(f"{role.capitalize()}: {text}" for role, text, _ in turns)


# ----------------------------------------------------------------------------- knowledge and G


@dataclass(frozen=True)
class Triple:
    head: str
    relation: str
    tail: str


def load_knowledge(path) -> list[Triple]:
    triples = []
    for line, raw in _records(path):
        try:
            if not isinstance(raw, dict):
                raise DataError(
                    f"expected a {{head, relation, tail}} object, got {type(raw).__name__}"
                )
            if unknown := sorted(set(raw) - {"head", "relation", "tail"}):
                raise DataError(
                    f"field '{unknown[0]}': unknown field (a triple has head, relation, tail)"
                )
            values = [_text(raw, key) for key in ("head", "relation", "tail")]
            if None in values:
                raise DataError(
                    f"field '{('head', 'relation', 'tail')[values.index(None)]}': missing"
                )
        except DataError as e:
            raise DataError(f"{path}:{line}: {e}") from None
        triples.append(Triple(*(v.strip() for v in values)))
    if not triples:
        raise DataError(f"{path}: no triples")
    return triples


_STOP = set(
    (
        "the and for are but not you your yours with that this have has had was were been being "
        "from they them their what when where which who whom why how all any can could would "
        "should will just about into than then there here its it's i'm i've don't can't also very "
        "really much more most some such only own same too out off over under again once our ours "
        "she her hers him his myself yourself itself because while does did doing get got feel "
        "feeling"
    ).split()
)


def words(text: str) -> set[str]:
    found = (
        w.removesuffix("s") if len(w) > 3 else w
        for w in re.findall(r"[a-z]+(?:'[a-z]+)?", text.lower())
    )
    return {w for w in found if len(w) >= 3 and w not in _STOP}


class Knowledge:
    """The triples indexed by head word, for `retrieve`."""

    def __init__(
        self, triples: list[Triple], relations: Relations, min_overlap: float, per_slot: int
    ):
        slot_of = {
            r.lower(): slot
            for slot in ("needs", "appraisal", "emotion")
            for r in getattr(relations, slot)
        }
        self.entries = [
            (slot_of[t.relation.lower()], words(t.head), t.tail)
            for t in triples
            if t.relation.lower() in slot_of
        ]
        self.index: dict[str, list[int]] = {}
        for i, (_, head, _) in enumerate(self.entries):
            for w in head:
                self.index.setdefault(w, []).append(i)
        self.min_overlap, self.per_slot = min_overlap, per_slot

    def retrieve(self, query: set[str]) -> dict[str, list[str]]:
        """slot -> the tails of its best matches (module docstring)."""
        shared: dict[int, int] = {}
        for w in query:
            for i in self.index.get(w, ()):
                shared[i] = shared.get(i, 0) + 1
        ranked = sorted(
            (-n / len(self.entries[i][1]), -n, i)
            for i, n in shared.items()
            if n / len(self.entries[i][1]) >= self.min_overlap
        )
        found = {"needs": [], "appraisal": [], "emotion": []}
        for _, _, i in ranked:
            slot, _, tail = self.entries[i]
            if len(found[slot]) < self.per_slot and tail not in found[slot]:
                found[slot].append(tail)
        return found


def knowledge_tuple(
    dialogue: Dialogue, t: int, knowledge: Knowledge, fact_words: int
) -> tuple[list[tuple[str, str]], int]:
    """(g_t = (facts, needs, appraisal, emotion) for x_<=t as (section name, text) pairs, tails
    retrieved)."""
    current = dialogue.turns[t][1]
    found = knowledge.retrieve(words(current) | words(dialogue.situation or ""))
    said = current.split()
    said = " ".join(said[:fact_words]) + (" ..." if len(said) > fact_words else "")
    facts = [x.strip().rstrip(".") for x in (dialogue.problem, dialogue.situation) if x] + [
        f"the user says: {said}"
    ]
    emotion = ([dialogue.emotion] if dialogue.emotion else []) + found["emotion"]
    values = [facts, found["needs"], found["appraisal"], emotion]
    return (
        [(name, "; ".join(v) or "(none retrieved)") for name, v in zip(ARG_SECTIONS[:4], values)],
        sum(map(len, found.values())),
    )


def think(sections: list[tuple[str, str]]) -> str:
    return (
        f"{THINK_START}\n"
        + "\n".join(f"{name}: {text}" for name, text in sections)
        + f"\n{THINK_END}"
    )


def cpt_rows(
    dialogues: list[Dialogue],
    knowledge: Knowledge,
    settings: EmoLLMData,
    fits: Callable[[list | None, str], bool],
) -> tuple[list[dict], int]:
    """(CPT rows, contexts skipped because even their current turn alone is too long)."""
    rows, skipped = [], 0
    for dialogue in dialogues:
        for t in contexts(dialogue):
            g_t, found = knowledge_tuple(dialogue, t, knowledge, settings.fact_words)
            texts = (
                think(g_t) + "\n" + render_context(dialogue.turns[s : t + 1]) for s in range(t + 1)
            )
            text = next((x for x in texts if fits(None, x)), None)  # the longest context that fits
            if text is None:
                skipped += 1
                continue
            meta = context_meta(dialogue, t) | {"knowledge": found}
            rows.append({"id": f"{dialogue.id}/t{t}", "text": text, "meta": meta})
    return rows, skipped


# --------------------------------------------------------------------- the ARG teacher (Appendix H)

LOOKAHEAD, CHOICE, GATE, REPLY = "Lookahead", "Choice", "Reasoning needed", "Reply"

ARG_TEACHER_SYSTEM = f"""You annotate one turn of a supportive conversation, to train an assistant \
that works out a person's situation and feelings before it answers. You receive <dialogue>, the \
conversation so far, and <user_text>, the person's newest message, which the assistant answers \
next. {DATA_NOTICE}

Write the assistant's private reasoning in these sections, in this order, each starting on a new \
line with its name and a colon, one or two specific lines each, grounded in the conversation \
(invent nothing):
Facts: the events and circumstances the conversation establishes.
Needs: what the person needs, wants or is worried about right now.
Appraisal: how the person weighs those facts against those needs: for or against their goals, \
within their control or not, whose doing.
Emotion: the feelings that follow from that appraisal.
Strategy: how the assistant should answer given all of the above: its tone and what it \
concentrates on.
Only when thinking ahead usefully tests the strategy, add up to {{n}} steps, then the choice \
(never a choice without a step):
Lookahead 1: how the person would likely react to a reply that follows the strategy.
Lookahead 2 (and 3): the reaction one exchange further on.
Choice: the strategy kept, or how the lookahead changes it.
Then two last sections:
Reasoning needed: yes when this turn deserves explicit reasoning before the reply (distress, a \
tangled situation, a choice of approach that matters); no when a direct reply serves as well (a \
greeting, thanks, a simple question). Write the reasoning sections either way.
Reply: the assistant's answer to the newest message: natural, warm, specific and practical, with \
no section names and no tags.
Output nothing else."""

_HEADER = re.compile(
    rf"^({'|'.join(ARG_SECTIONS)}|{LOOKAHEAD} \d+|{CHOICE}|{GATE}|{REPLY})[ \t]*:", re.MULTILINE
)


@dataclass
class ArgAnswer:
    sections: list[tuple[str, str]]  # the ARG state, in order
    gate: int  # r_t
    reply: str

    def target(self) -> str:
        return f"{think(self.sections)}\n\n{self.reply}" if self.gate else self.reply


def arg_request(dialogue: Dialogue, t: int, settings: EmoLLMData) -> JudgeCall:
    history = render_context(dialogue.turns[:t]) or "(no earlier messages)"
    return JudgeCall(
        chat_messages(
            ARG_TEACHER_SYSTEM.format(n=settings.lookahead),
            section("dialogue", history),
            section("user_text", dialogue.turns[t][1]),
        ),
        settings.max_tokens,
    )


def parse_arg(text: str, lookahead: int) -> ArgAnswer | str:
    """The teacher's answer, or why it is rejected: "missing section", "missing reply" or
    "malformed" (a section out of order or repeated, text before the first section, more than
    `lookahead` steps, a choice without steps or steps without a choice, a gate other than yes/no, a
    tag in the reply)."""
    heads = list(_HEADER.finditer(text))
    parts = [
        (m.group(1), text[m.end() : nxt.start() if nxt else len(text)].strip())
        for m, nxt in zip(heads, heads[1:] + [None])
    ]
    present = {name for name, value in parts if value}
    if any(name not in present for name in (*ARG_SECTIONS, GATE)):
        return "missing section"
    if REPLY not in present:
        return "missing reply"
    steps = sum(name.startswith(LOOKAHEAD) for name, _ in parts)
    order = [
        *ARG_SECTIONS,
        *(f"{LOOKAHEAD} {k}" for k in range(1, steps + 1)),
        *([CHOICE] if steps else []),
        GATE,
        REPLY,
    ]
    gate, reply = parts[-2][1].lower().rstrip("."), parts[-1][1]
    if (
        text[: heads[0].start()].strip()
        or [n for n, _ in parts] != order
        or steps > lookahead
        or len(present) != len(parts)
        or gate not in ("yes", "no")
        or THINK_START in reply
        or THINK_END in reply
    ):
        return "malformed"
    return ArgAnswer(parts[:-2], int(gate == "yes"), reply)


def chat_prompt(turns) -> list[dict[str, str]]:
    return [{"role": role, "content": text} for role, text, _ in turns]


def sample_contexts(
    dialogues: list[Dialogue], share: float | None, seed: int
) -> list[tuple[Dialogue, int]]:
    """The (dialogue, t) contexts sent to the teacher: all of them when `share` is None, else from
    each source (file) on its own `share` of its contexts, rounded half up and at least one, drawn
    at random (one generator seeded with `seed`, sources in the order given), each source's kept in
    file order (EmoLLM C.2: 10% of each dataset's contexts)."""
    sources: dict[str, list[tuple[Dialogue, int]]] = {}
    for d in dialogues:
        sources.setdefault(d.source, []).extend((d, t) for t in contexts(d))
    if share is None:
        return [c for pool in sources.values() for c in pool]
    rng, picked = random.Random(seed), []
    for pool in sources.values():
        k = min(len(pool), max(1, math.floor(share * len(pool) + 0.5)))
        picked += [pool[i] for i in sorted(rng.sample(range(len(pool)), k))]
    return picked


def arg_rows(
    dialogues: list[Dialogue],
    settings: EmoLLMData,
    cache: Path,
    fits: Callable[[list | None, str], bool],
) -> tuple[list[dict], dict[str, int]]:
    """(ARG SFT rows, counts): sample the contexts (`sample_contexts`), ask the teacher, keep the
    answers `parse_arg` accepts."""
    pool = sample_contexts(dialogues, settings.share, settings.seed)
    calls = [arg_request(d, t, settings) for d, t in pool]
    keys = [
        request_key("arg", f"{d.id}/t{t}", settings.teacher, call)
        for (d, t), call in zip(pool, calls)
    ]
    done = load_journal(cache)
    asked = ask_journaled(
        [(k, call, raw_text) for k, call in zip(keys, calls)], settings.teacher, cache, done
    )
    answers = [done.get(k) for k in keys]
    rows, counts = (
        [],
        {
            "contexts": len(pool),
            "reused": len(pool) - asked["asked"],
            "teacher_failures": len(asked["errors"]),
            "missing section": 0,
            "missing reply": 0,
            "malformed": 0,
            "too long": 0,
        },
    )
    for (dialogue, t), answer in zip(pool, answers):
        parsed = None if answer is None else parse_arg(answer, settings.lookahead)
        if isinstance(parsed, str):
            counts[parsed] += 1
        elif parsed is not None:
            prompt = chat_prompt(dialogue.turns[: t + 1])
            if not fits(prompt, parsed.target()):
                counts["too long"] += 1
                continue
            rows.append(
                {
                    "id": f"{dialogue.id}/t{t}",
                    "prompt": prompt,
                    "target": parsed.target(),
                    "meta": context_meta(dialogue, t)
                    | {"gate": parsed.gate, "arg": think(parsed.sections)},
                }
            )
    return rows, counts | {"errors": asked["errors"]}


def reply_rows(
    dialogues: list[Dialogue], settings: EmoLLMData, fits: Callable[[list | None, str], bool]
) -> tuple[list[dict], dict[str, int]]:
    """(rows, counts) of Table 1's response-only SFT baseline: the contexts arg_rows samples, each
    with the supporter's recorded reply to it as the target (a context the dialogue never answers
    is counted under "no reply")."""
    pool = sample_contexts(dialogues, settings.share, settings.seed)
    rows, counts = [], {"contexts": len(pool), "no reply": 0, "too long": 0}
    for dialogue, t in pool:
        if t + 1 == len(dialogue.turns):
            counts["no reply"] += 1
            continue
        prompt, reply = chat_prompt(dialogue.turns[: t + 1]), dialogue.turns[t + 1][1]
        if not fits(prompt, reply):
            counts["too long"] += 1
            continue
        rows.append(
            {
                "id": f"{dialogue.id}/t{t}",
                "prompt": prompt,
                "target": reply,
                "meta": context_meta(dialogue, t),
            }
        )
    return rows, counts


# ----------------------------------------------------------------------------- the command


def prepare(
    settings: EmoLLMData, objective: str, out, fits: Callable[[list | None, str], bool]
) -> dict[str, int]:
    """Write the rows of `objective`'s part to `out` (JSONL) and return the counts it prints.
    `fits(prompt, text)`: whether sft.py's encoding of the row (prompt None for an lm row) is within
    max_length."""
    if objective not in ("lm", "target"):
        raise ConfigError(
            f"objective: prepare/emollm_rows.py builds rows for lm (CPT) or target (ARG SFT), not "
            f"{excerpt(objective)}"
        )
    if objective == "lm" and settings.knowledge is None:
        raise ConfigError("knowledge: the CPT rows (objective lm) need the knowledge triples")
    check_output_file(
        out, "out", {"dialogues": settings.dialogues, "knowledge": settings.knowledge}
    )
    dialogues = load_dialogues(settings.dialogues)
    if objective == "lm":
        knowledge = Knowledge(
            load_knowledge(settings.knowledge),
            settings.relations,
            settings.min_overlap,
            settings.per_slot,
        )
        rows, skipped = cpt_rows(dialogues, knowledge, settings, fits)
        counts = {
            "dialogues": len(dialogues),
            "rows": len(rows),
            "too long": skipped,
            "with knowledge": sum(r["meta"]["knowledge"] > 0 for r in rows),
        }
        errors, journal = [], None
    elif settings.reply_only:
        rows, counts = reply_rows(dialogues, settings, fits)
        counts["rows"] = len(rows)
        errors, journal = [], None
    else:
        journal = Path(str(out) + ".teacher.jsonl")
        rows, counts = arg_rows(dialogues, settings, journal, fits)
        errors = counts.pop("errors")
        counts |= {"rows": len(rows), "reasoned": sum(r["meta"]["gate"] for r in rows)}
    part = "CPT" if objective == "lm" else "reply SFT" if settings.reply_only else "ARG SFT"
    print0(f"emollm {part}: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + f" -> {out}")
    write_rows(out, [json.dumps(r, ensure_ascii=False) + "\n" for r in rows], errors, journal)
    return counts


def sft_fits(cfg: EmoLLMData) -> Callable[[list | None, str], bool]:
    """Whether a row (prompt None for an lm row) is within max_length as sft.py encodes it; the
    tokenizer is loaded on the first call, once the data have been checked."""
    trainer = sft.SFTConfig(
        model=cfg.model,
        data=cfg.out,
        objective=cfg.objective,
        max_length=cfg.max_length,
        enable_thinking=cfg.enable_thinking,
    )
    tok = functools.cache(lambda: load_tokenizer(cfg.model))
    return lambda prompt, text: (
        len(sft.encode_text_row(tok(), sft.TextRow("", text, prompt), trainer)[0]) <= cfg.max_length
    )


def main(argv=None) -> None:
    cfg = parse_cli(EmoLLMData, argv)
    try:
        prepare(cfg, cfg.objective, cfg.out, sft_fits(cfg))
    except (DataError, ConfigError, CheckpointError, JudgeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
