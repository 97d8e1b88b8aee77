"""EmoLLM's scenario seeds (C.2, C.3): a teacher model summarizes each dialogue into the seed an
episode of dialogue/rl.py or dialogue/evaluation.py starts from.

    python -m prepare.emollm_seeds configs/emollm_seeds_prepare.yaml [key=value ...]  # -> seeds

The dialogues are files in ESConv's layout (prepare/emollm_rows.py reads them; prepare/convert.py
writes them for EmpatheticDialogues, MSDialog, MedDialog and ICLR's review threads). From each
source (one file), `per_source` dialogues are drawn at random (seed; all when None; C.3: 100 per
dataset's test split), each with at least one user turn. The teacher (http_client.chat, concurrent;
teacher.ask_journaled keeps every answer in `<out>.teacher.jsonl`, so a rerun asks only for what
failed or was never asked) sees the whole dialogue and answers with one JSON object {"scenario",
"initial_prompt"}: who the assistant is and what the user faces, and the user's opening message,
carrying nothing from later turns. A seed is {"id": the dialogue's id, "scenario",
"initial_prompt"} as the teacher wrote them; an answer of any other shape is rejected and counted.

Offline, without a teacher: `python -m prepare.convert FORMAT IN OUT --seeds` builds seeds by rule
(the situation as the scenario, the user's first turn as the opening), not by the paper's summary.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from config import ConfigError, bounded, check_output_file, parse_cli, print0
from data import DataError
from http_client import JudgeCall, JudgeConfig, JudgeError
from judge import DATA_NOTICE, chat_messages, section
from prepare.emollm_rows import Dialogue, contexts, load_dialogues, render_context
from teacher import ask_journaled, load_journal, request_key, write_rows


@dataclass
class SeedSettings:
    """`python -m prepare.emollm_seeds config.yaml`: scenario seeds summarized by a teacher from
    ESConv-layout dialogues (module docstring), written to `out` (grpo.py's train_data,
    dialogue/evaluation.py's scenarios)."""

    dialogues: list[str]  # ESConv-layout files, one per source
    out: str  # the seeds (JSONL)
    # dialogues drawn from each source (None: all)
    per_source: int | None = bounded(None, ge=1)
    seed: int = 0
    max_tokens: int = bounded(512, ge=1)  # the teacher's new tokens per answer
    teacher: JudgeConfig = field(default_factory=JudgeConfig)


SEED_TEACHER_SYSTEM = f"""You turn a recorded conversation between a user and an assistant into \
the starting point of a role-play, in which a simulated user opens a new conversation with another \
assistant. You receive <dialogue>, the whole recorded conversation, and <context>, what is known \
about its situation. {DATA_NOTICE}

Write two things:
- scenario: one or two sentences saying what role the assistant plays and what the user is going \
through (their circumstances, their concern and how they feel), specific to this conversation.
- initial_prompt: the user's first message, in the user's own voice, as they would open the \
conversation. It may state only what the user knows at the start: nothing the assistant said, and \
nothing the conversation reveals only later.

Output one JSON object and nothing else: {{"scenario": "...", "initial_prompt": "..."}}"""


def seed_request(dialogue: Dialogue, max_tokens: int) -> JudgeCall:
    known = [
        f"{name}: {value}"
        for name, value in (
            ("Situation", dialogue.situation),
            ("Topic", dialogue.problem),
            ("Emotion", dialogue.emotion),
        )
        if value
    ]
    return JudgeCall(
        chat_messages(
            SEED_TEACHER_SYSTEM,
            section("dialogue", render_context(dialogue.turns)),
            section("context", "\n".join(known) or "(nothing beyond the conversation)"),
        ),
        max_tokens,
    )


def parse_seed(text: str) -> dict[str, str] | None:
    """{"scenario", "initial_prompt"} (stripped) from an answer that is exactly one JSON object with
    those two fields, each non-empty text; None otherwise."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    keys = ("scenario", "initial_prompt")
    if not isinstance(value, dict) or sorted(value) != sorted(keys):
        return None
    if not all(isinstance(value[k], str) and value[k].strip() for k in keys):
        return None
    return {k: value[k].strip() for k in keys}


def sample_dialogues(
    dialogues: list[Dialogue], per_source: int | None, seed: int
) -> list[Dialogue]:
    """The dialogues with a user turn, `per_source` of each source drawn at random (one generator
    seeded with `seed`, sources in the order given), each source's kept in file order."""
    sources: dict[str, list[Dialogue]] = {}
    for d in dialogues:
        sources.setdefault(d.source, []).extend([d] if contexts(d) else [])
    if per_source is None:
        return [d for pool in sources.values() for d in pool]
    rng, picked = random.Random(seed), []
    for pool in sources.values():
        keep = sorted(rng.sample(range(len(pool)), min(per_source, len(pool))))
        picked += [pool[i] for i in keep]
    return picked


def prepare(cfg: SeedSettings) -> dict[str, int]:
    """Write `out` from the dialogues through the teacher; returns (and prints) the counts."""
    out = Path(cfg.out)
    check_output_file(out, "out", {"dialogues": cfg.dialogues})
    chosen = sample_dialogues(load_dialogues(cfg.dialogues), cfg.per_source, cfg.seed)
    calls = [seed_request(d, cfg.max_tokens) for d in chosen]
    keys = [request_key("seed", d.id, cfg.teacher, c) for d, c in zip(chosen, calls)]
    journal = Path(str(out) + ".teacher.jsonl")
    done = load_journal(journal)
    asked = ask_journaled(
        [(k, c, parse_seed) for k, c in zip(keys, calls)], cfg.teacher, journal, done
    )
    seeds = [{"id": d.id} | done[k] for d, k in zip(chosen, keys) if done.get(k) is not None]
    counts = {
        "dialogues": len(chosen),
        "asked": asked["asked"],
        "reused": len(chosen) - asked["asked"],
        "failures": asked["failures"],
        "rejected": sum(k in done and done[k] is None for k in keys),
        "seeds": len(seeds),
    }
    print0("emollm seeds: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + f" -> {out}")
    write_rows(
        out, [json.dumps(s, ensure_ascii=False) + "\n" for s in seeds], asked["errors"], journal
    )
    return counts


def main(argv=None) -> None:
    cfg = parse_cli(SeedSettings, argv)
    try:
        prepare(cfg)
    except (DataError, ConfigError, JudgeError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
