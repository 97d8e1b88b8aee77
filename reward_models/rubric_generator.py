"""CARE's rubric generator (Sections 3.2-3.3, Appendices H-K): the turn-level rubric targets it is
fine-tuned on, the human preference pairs its preference RL and its evaluation read, and the
chosen-response win rate.

    python -m reward_models.rubric_generator targets config.yaml [key=value ...]
    python -m reward_models.rubric_generator examples config.yaml [key=value ...]
    python -m reward_models.rubric_generator care_winrate config.yaml [key=value ...]
    python -m reward_models.rubric_generator care_priorities config.yaml [key=value ...]

`targets`: teacher rubrics, checked and screened, as SFT rows; `examples`: preference pairs as
grpo.py examples; `care_winrate`: a served generator's win rate on held-out pairs;
`care_priorities`: how the rubrics of that run weigh the three dimensions by turn and by the
seeker's emotion (the paper's Figures 3, 4 and 9), read from its journal.

The three stages (configs/care_generator_*.yaml):
1. `targets` writes sft.py rows of the free-form objective (`objective: target`): {"id", "prompt",
   "target"}, the prompt being judge.care_rubric_request(dialogue) (the very prompt a CARE run sends
   its rubric judge, so the served generator answers it unchanged) and the target the rubric JSON
   with a rationale per weight.
2. Preference RL with grpo.py (reward `care_generator`, rewards.py): the generator's completions are
   rubrics, scored by how well they let a frozen evaluator prefer the human-chosen reply
   (`preference_examples` turns the pairs into grpo.py examples of task care_rubric).
3. The win rate (`win_rate`): under each generated rubric the evaluator scores both replies of a
   held-out pair; a win is the chosen one scored strictly higher (the paper's Table 4 measure).

Turn records (`targets` input), JSONL: {"id", "dialogue": [{"role": "user" | "assistant",
"content"}, ...] ending with the seeker's message, "reference": the supporter's actual next reply,
"strategies": [its support strategies]}. Preference pairs, JSONL: {"id", "dialogue", "chosen",
"rejected", "strategies": [the chosen reply's strategies]}; either may carry "emotion", the
seeker's emotion label (ESConv's emotion_type), which care_priorities groups by. Strategy names
map to the three dimensions by `STRATEGY_DIMENSIONS` (Appendix H; extend it with
`strategy_map`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from config import ConfigError, atomic_write_text, check_output_file, parse_cli, print0
from data import DataError, Example, Turn
from dataset import read_jsonl, save_jsonl
from http_client import JudgeCall, JudgeConfig, JudgeError
from judge import (
    CARE_DIMENSIONS,
    DATA_NOTICE,
    care_rubric,
    care_rubric_request,
    care_scores_request,
    chat_messages,
    dialogue_text,
    parse_care_rubric,
    parse_care_scores,
    section,
    strict_json_object,
    verdict_lines,
)
from rewards import care_score
from teacher import ask_journaled, failed_calls, journal_key, load_journal, write_rows

# Appendix H maps ESConv's and MINT's strategies by their main function: making sense of
# the seeker's situation is cognitive, attuning to and validating feelings affective,
# guidance toward action proactive. Its Table 9 did not survive in our copy: this is our
# mapping of ESConv's eight strategies (Liu et al., 2021); "Others" maps to none.
STRATEGY_DIMENSIONS = {
    "question": "cognitive",
    "restatement or paraphrasing": "cognitive",
    "reflection of feelings": "affective",
    "self-disclosure": "affective",
    "affirmation and reassurance": "affective",
    "providing suggestions": "proactive",
    "information": "proactive",
    "others": None,
}


def dimension_counts(
    strategies: list[str], extra: dict[str, str | None] | None = None
) -> dict[str, int]:
    """How many of a reply's strategies fall in each dimension. An unknown strategy raises DataError
    (a typo must not silently drop a count); `extra` adds or overrides names (case-insensitive)."""
    mapping = STRATEGY_DIMENSIONS | {k.casefold(): v for k, v in (extra or {}).items()}
    counts = dict.fromkeys(CARE_DIMENSIONS, 0)
    for name in strategies:
        key = name.strip().casefold() if isinstance(name, str) else None
        if key not in mapping:
            raise DataError(
                f"field 'strategies': unknown strategy {name!r} (known: "
                f"{', '.join(sorted(mapping))}; add it under strategy_map)"
            )
        if mapping[key] is not None:
            counts[mapping[key]] += 1
    return counts


def _dialogue(raw: dict) -> list[tuple[str, str]]:
    messages = raw.get("dialogue")
    ok = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict)
            and set(m) == {"role", "content"}
            and m["role"] in ("user", "assistant")
            and isinstance(m["content"], str)
            and m["content"].strip()
            for m in messages
        )
    )
    if not ok:
        raise DataError(
            "field 'dialogue': expected a non-empty list of {role: user/assistant, content}"
        )
    if messages[-1]["role"] != "user":
        raise DataError("field 'dialogue': the last message must be the seeker's (role user)")
    return [(m["role"], m["content"]) for m in messages]


def _text(raw: dict, key: str) -> str:
    if not isinstance(raw.get(key), str) or not raw[key].strip():
        raise DataError(f"field '{key}': missing or not a non-empty string")
    return raw[key]


@dataclass
class Record:
    """A turn record or a preference pair (`chosen` then holds the preferred reply, `rejected` the
    other)."""

    id: str
    dialogue: list[tuple[str, str]]
    chosen: str  # a turn record's reference reply
    rejected: str | None
    counts: dict[str, int]  # the chosen reply's strategies per dimension
    emotion: str | None = None  # the seeker's emotion label, when the source has one (ESConv's)


def load_turns(
    path, pairs: bool, strategy_map: dict[str, str | None] | None = None
) -> list[Record]:
    """Turn records (pairs=False) or preference pairs (pairs=True); a bad line raises DataError
    naming the file, line and field."""
    out = []
    for number, raw in read_jsonl(path):
        try:
            if not isinstance(raw, dict):
                raise DataError(f"expected a JSON object, got {type(raw).__name__}")
            fields = {
                "id",
                "dialogue",
                "strategies",
                "emotion",
                *(("chosen", "rejected") if pairs else ("reference",)),
            }
            if unknown := sorted(set(raw) - fields):
                raise DataError(
                    f"field '{unknown[0]}': unknown field (known: {', '.join(sorted(fields))})"
                )
            strategies = raw.get("strategies")
            if not isinstance(strategies, list):
                raise DataError("field 'strategies': missing or not a list")
            turn = Record(
                _text(raw, "id"),
                _dialogue(raw),
                _text(raw, "chosen" if pairs else "reference"),
                _text(raw, "rejected") if pairs else None,
                dimension_counts(strategies, strategy_map),
                _text(raw, "emotion") if raw.get("emotion") is not None else None,
            )
            if pairs and turn.chosen.strip() == turn.rejected.strip():
                raise DataError("field 'rejected': identical to 'chosen'")
            out.append(turn)
        except DataError as e:
            raise DataError(f"{path}:{number}: {e}") from None
    if not out:
        raise DataError(f"{path}: no records (the file is empty)")
    return out


# ------------------------------------------------------------ targets (Sections 3.2, Appendix I, K)

_TARGET_SYSTEM = f"""You write the training target for a rubric generator in emotional-support \
conversations: the rubric that should score the supporter's next reply at this point of the \
conversation.

You receive <dialogue> (the conversation so far, ending with the seeker's latest message), <reply> \
(the reply a skilled supporter actually gave, for calibration) and <strategies> (how many of that \
reply's support strategies serve each dimension). {DATA_NOTICE}

The rubric has the three dimensions cognitive (understanding and reframing the seeker's \
situation), affective (recognizing and validating feelings) and proactive (supporting agency and \
next steps). Weight them by what this turn needs: the strategy counts are a coarse signal of the \
priorities, not a formula. Give each weight a one-sentence rationale tied to the seeker's latest \
message, and each dimension two to four criteria, more where it matters more: specific to this \
conversation, checkable in a reply, and not repeating one another. Do not quote or paraphrase the \
calibration reply, and do not mention it, these instructions or the strategy counts.

Output exactly one JSON object and nothing else:
{{"cognitive": {{"weight": w, "rationale": "...", "criteria": ["...", "..."]}}, "affective": \
{{...}}, "proactive": {{...}}}}
with the weights between 0 and 1, summing to 1."""

_SCREEN_SYSTEM = f"""You check a rubric written to score the supporter's next reply in an \
emotional-support conversation. You receive <dialogue> (the conversation so far) and <rubric> \
(each dimension with its weight, the reason for it and its criteria). {DATA_NOTICE}

For each dimension answer PASS only when all three hold: its criteria fit this turn of this \
conversation rather than any conversation; each criterion is clear enough to be checked in a \
reply; no criterion repeats another, in this dimension or in another. Otherwise answer FAIL.

Output exactly three lines, in this order, and nothing else:
cognitive: <short assessment> | PASS or FAIL
affective: <short assessment> | PASS or FAIL
proactive: <short assessment> | PASS or FAIL
Do not use the character | inside an assessment."""


def target_request(turn: Record) -> JudgeCall:
    """The teacher call writing the rubric target of one turn record."""
    counts = "\n".join(f"{d}: {n}" for d, n in turn.counts.items())
    return JudgeCall(
        chat_messages(
            _TARGET_SYSTEM,
            section("dialogue", dialogue_text(turn.dialogue)),
            section("reply", turn.chosen),
            section("strategies", counts),
        ),
        4096,
    )


def rubric_listing(rubric: dict[str, dict[str, Any]]) -> str:
    return "\n\n".join(
        f"{d} (weight {rubric[d]['weight']:.2f}): {rubric[d].get('rationale', '')}\n"
        + "\n".join(f"- {c}" for c in rubric[d]["criteria"])
        for d in CARE_DIMENSIONS
    )


def screen_request(turn: Record, rubric: dict[str, dict[str, Any]]) -> JudgeCall:
    """A screening judge's call: does each dimension pass the turn-specificity, clarity and
    non-redundancy check?"""
    return JudgeCall(
        chat_messages(
            _SCREEN_SYSTEM,
            section("dialogue", dialogue_text(turn.dialogue)),
            section("rubric", rubric_listing(rubric)),
        ),
        384,
    )


def parse_screen(text: str) -> bool | None:
    """True when every dimension passes, False when one fails, None for an answer out of format."""
    verdicts = verdict_lines(text, [(d, "PASS|FAIL") for d in CARE_DIMENSIONS])
    return None if verdicts is None else all(v == "PASS" for v in verdicts)


@dataclass
class TargetsConfig:
    """`targets`: teacher-written rubrics for turn records, kept when the rubric check and every
    screener pass."""

    # turn records (module docstring); the paper: MINT and ESConv, emotion-related dialogues
    turns: str
    out: str = "data/care_rubric_sft.jsonl"
    journal: str | None = None  # default <out>.journal.jsonl
    teacher: JudgeConfig = field(default_factory=JudgeConfig)  # the paper: DeepSeek-V4-Pro
    screeners: list[JudgeConfig] = field(default_factory=list)  # the paper: two judges
    # the screeners' aggregate scores of the reference reply (0-5) differ by at most this
    agreement: float = 0.2


@dataclass
class WinRateConfig:
    """`reward_models/rubric_generator.py care_winrate`: the generator writes a rubric per held-out
    pair, the evaluator scores both."""

    pairs: str  # held-out preference pairs (module docstring); the paper: 166
    # the served generator (vLLM, judge_server.py)
    generator: JudgeConfig = field(default_factory=JudgeConfig)
    evaluator: JudgeConfig = field(default_factory=JudgeConfig)  # the paper: DeepSeek-V4-Flash
    output_dir: str = "runs/care_winrate"


@dataclass
class RLDataConfig:
    """`examples`: preference pairs -> grpo.py examples of task care_rubric (reward
    care_generator)."""

    pairs: str  # the paper: 2.8K majority-voted pairs
    out: str = "data/care_generator_rl.jsonl"


@dataclass
class GeneratorDataConfig:
    targets: TargetsConfig | None = None
    rl: RLDataConfig | None = None
    winrate: WinRateConfig | None = None
    # extra strategy -> dimension names
    strategy_map: dict[str, str | None] = field(default_factory=dict)


def aggregate(rubric: dict, scores: Any) -> float | None:
    """The reply's rubric score on the 0-5 scale: 5 x rewards.care_score (None when the scores do
    not fit)."""
    value = care_score(rubric, scores)
    return None if value is None else 5 * value


def build_targets(cfg: GeneratorDataConfig) -> dict[str, int]:
    """Teacher rubrics -> the rubric check (judge.care_rubric with rationales; failures rejected and
    counted) -> every screener's PASS on all three dimensions and aggregate scores of the reference
    reply within `agreement` -> SFT rows in `out`. Every answer is journaled; failed calls stop the
    run (rerun to continue)."""
    t = cfg.targets
    journal = Path(t.journal or t.out + ".journal.jsonl")
    check_output_file(t.out, "targets.out", {"targets.turns": t.turns})
    check_output_file(journal, "targets.journal")
    turns = load_turns(t.turns, pairs=False, strategy_map=cfg.strategy_map)
    done = load_journal(journal)
    keys = [journal_key("target", x.id, json.dumps(x.dialogue), x.chosen) for x in turns]
    errors = ask_journaled(
        [(k, target_request(x), strict_json_object) for k, x in zip(keys, turns)],
        t.teacher,
        journal,
        done,
        "targets.teacher",
    )["errors"]
    rubrics = [care_rubric(done.get(k), rationale=True) for k in keys]
    checks = []  # (turn index, screener index, what) per screening call
    for i, (turn, rubric) in enumerate(zip(turns, rubrics)):
        for j, screener in enumerate(t.screeners):
            if rubric is not None:
                base = journal_key("screen", str(j), screener.model, keys[i])
                checks += [
                    (i, j, base + "/pass", screen_request(turn, rubric), parse_screen),
                    (
                        i,
                        j,
                        base + "/score",
                        care_scores_request(turn.dialogue, rubric, turn.chosen),
                        lambda text, rubric=rubric: parse_care_scores(text, rubric),
                    ),
                ]
    for j, screener in enumerate(t.screeners):
        mine = [(key, call, parse) for _, s, key, call, parse in checks if s == j]
        errors += ask_journaled(mine, screener, journal, done, f"targets.screeners[{j}]")["errors"]
    if errors:
        raise JudgeError(failed_calls(errors, journal))
    rows, screened_out = [], 0
    for i, (turn, rubric) in enumerate(zip(turns, rubrics)):
        if rubric is None:
            continue
        mine = [c for c in checks if c[0] == i]
        passes = [done.get(key) for _, _, key, _, _ in mine if key.endswith("/pass")]
        scores = [
            aggregate(rubric, done.get(key)) for _, _, key, _, _ in mine if key.endswith("/score")
        ]
        if (
            not all(p is True for p in passes)
            or None in scores
            or (scores and max(scores) - min(scores) > t.agreement)
        ):
            screened_out += 1
            continue
        rows.append(
            {
                "id": turn.id,
                "prompt": care_rubric_request(turn.dialogue).messages,
                "target": json.dumps(rubric, ensure_ascii=False),
            }
        )
    counts = {
        "turns": len(turns),
        "rubric_check_rejected": rubrics.count(None),
        "screened_out": screened_out,
        "kept": len(rows),
    }
    print0("targets: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + f" -> {t.out}")
    write_rows(t.out, [json.dumps(r, ensure_ascii=False) + "\n" for r in rows], [], journal)
    return counts


# ---------------------------------------------------------------------- preference RL (Section 3.3)


def preference_examples(cfg: GeneratorDataConfig) -> list[Example]:
    """The pairs as grpo.py examples of task care_rubric: the dialogue as turns (speaker = role),
    the generator's prompt (judge.care_rubric_request, as in SFT and in a CARE run) in meta.prompt,
    and what care_generator reads: meta chosen, rejected and dimension_counts. Written to
    `rl.out`."""
    check_output_file(cfg.rl.out, "rl.out", {"rl.pairs": cfg.rl.pairs})
    pairs = load_turns(cfg.rl.pairs, pairs=True, strategy_map=cfg.strategy_map)
    examples = [
        Example(
            p.id,
            "care_rubric",
            [Turn(role, text) for role, text in p.dialogue],
            None,
            [],
            meta={
                "prompt": care_rubric_request(p.dialogue).messages,
                "chosen": p.chosen,
                "rejected": p.rejected,
                "dimension_counts": p.counts,
            },
        )
        for p in pairs
    ]
    save_jsonl(examples, cfg.rl.out)
    print0(f"examples: {len(examples)} preference pairs -> {cfg.rl.out}")
    return examples


# --------------------------------------------------------------------------- the win rate (Table 4)


def win_rate(cfg: GeneratorDataConfig) -> dict[str, Any]:
    """The chosen-response win rate on held-out pairs: the share of pairs whose chosen reply the
    evaluator scores strictly above the rejected one under the rubric the generator wrote. A pair
    without a valid rubric or without both scores counts as no win (and is counted). Writes
    winrate.json in output_dir; answers are journaled there."""
    w = cfg.winrate
    out = Path(w.output_dir)
    check_output_file(out / "winrate.json", "winrate.output_dir")
    pairs = load_turns(w.pairs, pairs=True, strategy_map=cfg.strategy_map)
    out.mkdir(parents=True, exist_ok=True)
    journal = out / "journal.jsonl"
    done = load_journal(journal)
    keys = [journal_key("rubric", w.generator.model, p.id, json.dumps(p.dialogue)) for p in pairs]
    errors = ask_journaled(
        [(k, care_rubric_request(p.dialogue), parse_care_rubric) for k, p in zip(keys, pairs)],
        w.generator,
        journal,
        done,
        "winrate.generator",
    )["errors"]
    scoring = [
        (
            journal_key("score", w.evaluator.model, k, side),
            care_scores_request(p.dialogue, done[k], reply),
            lambda text, rubric=done[k]: parse_care_scores(text, rubric),
        )
        for k, p in zip(keys, pairs)
        if done.get(k)
        for side, reply in (("c", p.chosen), ("r", p.rejected))
    ]
    errors += ask_journaled(scoring, w.evaluator, journal, done, "winrate.evaluator")["errors"]
    if errors:
        raise JudgeError(failed_calls(errors, journal))
    wins = ties = unscored = 0
    for k, p in zip(keys, pairs):
        rubric = done.get(k)
        sides = [
            None
            if rubric is None
            else aggregate(rubric, done.get(journal_key("score", w.evaluator.model, k, s)))
            for s in "cr"
        ]
        if None in sides:
            unscored += 1
        else:
            wins, ties = wins + (sides[0] > sides[1]), ties + (sides[0] == sides[1])
    result = {
        "pairs": len(pairs),
        "win_rate": wins / len(pairs),
        "ties": ties,
        "unscored": unscored,
        "invalid_rubrics": sum(done.get(k) is None for k in keys),
        "generator": w.generator.model,
        "evaluator": w.evaluator.model,
    }
    atomic_write_text(out / "winrate.json", json.dumps(result, indent=1) + "\n")
    print0(
        f"chosen-response win rate {result['win_rate']:.4f} over {len(pairs)} pairs ({ties} ties, "
        f"{unscored} unscored) -> {out / 'winrate.json'}"
    )
    return result


# --------------------------------------------------- rubric priorities (Figures 3, 4 and 9)


def rubric_priorities(rubrics: list[tuple[Record, dict]]) -> dict[str, dict]:
    """How the generated rubrics weigh the three dimensions, as CARE's analyses show them: per
    dialogue turn (the seeker's messages so far; Figures 3 and 9) and per seeker emotion (Figure 4),
    the rubrics' count, each dimension's mean weight and the share of rubrics whose strict largest
    weight it has (`dominant`; a tie for the largest is counted under "tie")."""

    def summary(group: list[dict]) -> dict:
        dominant = dict.fromkeys([*CARE_DIMENSIONS, "tie"], 0)
        for rubric in group:
            top = max(rubric[d]["weight"] for d in CARE_DIMENSIONS)
            leaders = [d for d in CARE_DIMENSIONS if rubric[d]["weight"] == top]
            dominant[leaders[0] if len(leaders) == 1 else "tie"] += 1
        return {
            "n": len(group),
            "weights": {
                d: sum(r[d]["weight"] for r in group) / len(group) for d in CARE_DIMENSIONS
            },
            "dominant": {k: v / len(group) for k, v in dominant.items()},
        }

    by: dict[str, dict[str, list]] = {"turn": {}, "emotion": {}}
    for record, rubric in rubrics:
        turn = str(sum(role == "user" for role, _ in record.dialogue))
        by["turn"].setdefault(turn, []).append(rubric)
        by["emotion"].setdefault(record.emotion or "(none)", []).append(rubric)
    return {
        "turn": {k: summary(v) for k, v in sorted(by["turn"].items(), key=lambda kv: int(kv[0]))},
        "emotion": {k: summary(v) for k, v in sorted(by["emotion"].items())},
    }


def priorities_table(priorities: dict[str, dict], by: str) -> str:
    """One Markdown table of rubric_priorities: a row per turn or emotion."""
    heads = [f"w {d}" for d in CARE_DIMENSIONS] + [f"top {d}" for d in (*CARE_DIMENSIONS, "tie")]
    lines = [f"| {by} | rubrics | {' | '.join(heads)} |", "|---" * (len(heads) + 2) + "|"]
    for key, s in priorities[by].items():
        cells = [f"{s['weights'][d]:.3f}" for d in CARE_DIMENSIONS]
        cells += [f"{100 * s['dominant'][d]:.1f}%" for d in (*CARE_DIMENSIONS, "tie")]
        lines.append(f"| {key} | {s['n']} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def care_priorities(cfg: GeneratorDataConfig) -> dict[str, dict]:
    """The rubric priorities of the rubrics a care_winrate run's generator wrote for the held-out
    pairs (read from its journal, nothing asked): priorities.json in winrate.output_dir, and the
    tables by turn and by emotion printed."""
    w = cfg.winrate
    out = Path(w.output_dir)
    pairs = load_turns(w.pairs, pairs=True, strategy_map=cfg.strategy_map)
    done = load_journal(out / "journal.jsonl")
    rubrics = [
        (p, done[k])
        for p in pairs
        if done.get(k := journal_key("rubric", w.generator.model, p.id, json.dumps(p.dialogue)))
    ]
    if not rubrics:
        raise DataError(
            f"{out / 'journal.jsonl'}: no rubric of {w.generator.model} for the pairs of "
            f"{w.pairs}: run care_winrate with the same config first"
        )
    priorities = rubric_priorities(rubrics)
    result = {"generator": w.generator.model, "rubrics": len(rubrics), "pairs": len(pairs)}
    atomic_write_text(out / "priorities.json", json.dumps(result | priorities, indent=1) + "\n")
    print0(
        f"rubric priorities of {w.generator.model} ({len(rubrics)} rubrics of {len(pairs)} pairs)"
        f"\n\nby turn (Figures 3 and 9):\n\n{priorities_table(priorities, 'turn')}"
        f"\nby the seeker's emotion (Figure 4):\n\n{priorities_table(priorities, 'emotion')}"
    )
    return priorities


# ----------------------------------------------------------------------------- command line


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "targets": ("targets", build_targets),
        "examples": ("rl", preference_examples),
        "care_winrate": ("winrate", win_rate),
        "care_priorities": ("winrate", care_priorities),
    }
    command = argv.pop(0) if argv[:1] and argv[0] in commands else None
    try:
        if command is None:
            raise ConfigError(
                "usage: python -m reward_models.rubric_generator targets | examples | care_winrate "
                "| care_priorities config.yaml"
            )
        cfg = parse_cli(GeneratorDataConfig, argv)
        section, run = commands[command]
        if getattr(cfg, section) is None:
            raise ConfigError(f"{argv[0]}: missing section '{section}'")
        run(cfg)
    except (DataError, ConfigError, JudgeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
