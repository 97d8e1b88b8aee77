"""Judge-scored benchmarks in EQ-Bench 3's style (CARE reports EQBench3): the policy plays scripted
multi-turn role-play scenarios, then a judge scores each transcript on a rubric. The benchmark table
with such sets (`kind: eqbench3`) beside the accuracy rows is evaluate.py's, run through this
module's entry point, which hands it the kind (EQBENCH3, an evaluate.JudgedKind):

    python -m dialogue.eqbench3 configs/eval_benchmarks.yaml [key=value ...]

Scenario file: EQ-Bench 3's `data/scenario_prompts.txt` layout. A scenario starts at a header line
`######## <id> | <category> | <title>` (category and title may be left out) and holds the user's
turns, each after a line `####### Prompt<n>`. As EQ-Bench's own reader does, text before a
scenario's first Prompt line is ignored and a scenario without one is skipped (the public file's
409). The analysis scenarios (category `Analytical Interpretation`), which EQ-Bench answers with
another prompt and rubric, are left out.

Play: at each turn every unfinished transcript gets the next scripted user turn, wrapped in
ROLEPLAY_FRAME, and all of them are answered at once; only the reply (the text after `</think>`,
dialogue.split_reply) enters the history. Every answered turn is appended to roleplay.jsonl at
once, so a rerun continues each transcript where it stopped.

Scoring: one judge call per finished transcript (the scripted turns as written, without the frame,
and the replies), journaled in rubric.jsonl (teacher.ask_journaled: a rerun asks only what failed).
Each criterion is scored 0-20; a transcript's score is the mean of the ability criteria (OVERALL)
times 5, in 0-100, as EQ-Bench 3's rubric score; the style criteria are reported, not averaged in. A
malformed judge answer leaves its transcript unscored: counted, and left out of the mean.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import evaluate
from config import ConfigError, excerpt, open_log, print0, read_log
from data import DataError
from dataset import check_new_id, read_data_text
from dialogue.play import split_reply
from evaluate import EvalConfig, EvalSet, JudgedKind, mean_sd
from http_client import JudgeCall, JudgeConfig, JudgeError, chat_many
from judge import DATA_NOTICE, chat_messages, dialogue_text, section, verdict_lines
from sampling import endpoint_config, sample_completions
from teacher import ask_journaled, failed_calls, load_journal, request_key

ROLEPLAY, RUBRIC = "roleplay.jsonl", "rubric.jsonl"
ANALYSIS_CATEGORY = "Analytical Interpretation"

# ----------------------------------------------------------------------------- scenarios

_HEADER = re.compile(r"########\s+(\S+)\s*(?:\|\s*([^|]*?)\s*)?(?:\|\s*(.*?)\s*)?$")
_PROMPT = re.compile(r"#######\s*Prompt\d+\s*$")


@dataclass(frozen=True)
class RoleplayScenario:
    """A scripted scene: its user turns in order."""

    id: str
    category: str
    title: str
    prompts: tuple[str, ...]


def load_roleplay(path) -> list[RoleplayScenario]:
    """The role-play scenarios of a file in EQ-Bench 3's layout (module docstring), analysis ones
    left out. DataError naming the file and line: text before the first header, a malformed header,
    an empty Prompt section, a repeated id; a file without role-play scenarios."""
    scenarios, ids = [], set()
    header = prompts = None  # the scenario being read: (line, id, category, title), its prompts

    def close() -> None:
        if header is None or not prompts:
            return
        number, sid, category, title = header
        for i, lines in enumerate(prompts, 1):
            if not "\n".join(lines).strip():
                raise DataError(f"{path}:{number}: scenario {excerpt(sid)}: Prompt{i} is empty")
        if category != ANALYSIS_CATEGORY:
            scenarios.append(
                RoleplayScenario(sid, category, title, tuple("\n".join(p).strip() for p in prompts))
            )

    for number, line in enumerate(read_data_text(path).split("\n"), 1):
        if line.startswith("########"):
            close()
            match = _HEADER.fullmatch(line.rstrip())
            if match is None:
                raise DataError(f"{path}:{number}: not a header '######## <id> | ...'")
            sid, category, title = match.group(1), match.group(2) or "", match.group(3) or ""
            try:
                check_new_id(sid, ids)
            except DataError as e:
                raise DataError(f"{path}:{number}: {e}") from None
            header, prompts = (number, sid, category, title), []
        elif _PROMPT.fullmatch(line.rstrip()) and header is not None:
            prompts.append([])
        elif prompts:
            prompts[-1].append(line)
        elif header is None and line.strip():
            raise DataError(f"{path}:{number}: text before the first '######## <id>' header")
    close()
    if not scenarios:
        raise DataError(f"{path}: no role-play scenarios")
    return scenarios


# ----------------------------------------------------------------------------- the role-play

ROLEPLAY_FRAME = """This is a role-play. You are the person the message below calls "you": stay in \
that part and speak as them. Answer in three parts under these headings:
# What I'm thinking and feeling
Your honest inner reaction to the situation, in the first person.
# What they're thinking and feeling
What the other people in the scene most likely think, feel and want, and why.
# My response
What you now say or do, in character.

{prompt}"""


def _chat(scenario: RoleplayScenario, replies: list[str]) -> list[dict[str, str]]:
    """The chat the policy answers for the next turn: each scripted turn framed, each earlier
    reply."""
    chat = []
    for prompt, reply in zip(scenario.prompts, replies + [None]):
        chat.append({"role": "user", "content": ROLEPLAY_FRAME.format(prompt=prompt)})
        if reply is not None:
            chat.append({"role": "assistant", "content": reply})
    return chat


def read_roleplay(path) -> dict[tuple[str, str, int], list[str]]:
    """{(set, id, sample): [reply per turn]} from roleplay.jsonl; DataError naming the line of a
    record that is not one of `play`'s or that skips a turn."""
    done: dict[tuple[str, str, int], list[str]] = {}
    for number, r in enumerate(read_log(path, DataError), 1):
        fields = ("set", "id", "completion", "reply")
        ok = (
            isinstance(r, dict)
            and all(isinstance(r.get(key), str) for key in fields)
            and all(type(r.get(key)) is int for key in ("sample", "turn"))
        )
        replies = done.setdefault((r["set"], r["id"], r["sample"]), []) if ok else None
        if replies is None or r["turn"] != len(replies):
            raise DataError(
                f"{path}:{number}: not a role-play record {{set, id, sample, turn, completion, "
                f"reply}} of dialogue/eqbench3.py, the next turn of its transcript"
            )
        replies.append(r["reply"])
    return done


# chats and their keys (set/id/sample/turn) -> the completion texts, None where a request failed
Complete = Callable[[list[list[dict[str, str]]], list[str]], list[str | None]]


def play(
    sets: dict[str, list[RoleplayScenario]], runs: int, done: dict, path, complete: Complete
) -> int:
    """Play every scenario of `sets` `runs` times to its last scripted turn, continuing the
    transcripts of `done` (read_roleplay) and appending each answered turn to `path`. Returns the
    number of transcripts stopped by a failed request (a rerun continues them)."""
    failed: set = set()
    with open_log(path) as f:
        while True:
            pending = [
                (name, scenario, r)
                for name, scenarios in sets.items()
                for scenario in scenarios
                for r in range(runs)
                if len(done.get((name, scenario.id, r), ())) < len(scenario.prompts)
                and (name, scenario.id, r) not in failed
            ]
            if not pending:
                return len(failed)
            chats = [_chat(s, done.get((n, s.id, r), [])) for n, s, r in pending]
            keys = [f"{n}/{s.id}/{r}/turn{len(done.get((n, s.id, r), ()))}" for n, s, r in pending]
            print0(f"role-play: {len(pending)} transcripts answer a turn")
            lines = []
            for (name, scenario, r), text in zip(pending, complete(chats, keys)):
                if text is None:
                    failed.add((name, scenario.id, r))
                    continue
                replies = done.setdefault((name, scenario.id, r), [])
                record = {"set": name, "id": scenario.id, "sample": r, "turn": len(replies)}
                record |= {"completion": text, "reply": split_reply(text, False)[1]}
                replies.append(record["reply"])
                lines.append(json.dumps(record, ensure_ascii=False) + "\n")
            f.write("".join(lines))
            f.flush()


# ----------------------------------------------------------------------------- the rubric judge

# criterion -> what the judge scores (0-20); OVERALL: the ability criteria a score averages
# (EQ-Bench 3's "higher is better" ones); the others describe style and are reported only
RUBRIC_CRITERIA = {
    "demonstrated_empathy": "understands what the others feel and answers it in substance, not "
    "with stock phrases of sympathy",
    "pragmatic_ei": "uses that understanding to move the situation somewhere better: what to say, "
    "what to leave unsaid, and when",
    "depth_of_insight": "sees the motives, needs and dynamics under the surface of the scene",
    "social_dexterity": "handles tension, status and competing interests with tact and skill",
    "emotional_reasoning": "reasons soundly about why people feel as they do and how they will "
    "react",
    "message_tailoring": "fits each reply to where the other person is right now: its tone, "
    "length and focus",
    "warmth": "how warm and caring the character comes across (style: not better or worse)",
    "humanlike": "how much the replies read like a thoughtful person rather than a scripted "
    "assistant (style)",
}
OVERALL = (
    "demonstrated_empathy",
    "pragmatic_ei",
    "depth_of_insight",
    "social_dexterity",
    "emotional_reasoning",
    "message_tailoring",
)

RUBRIC_SYSTEM = f"""You assess the emotional intelligence an assistant shows in a role-play. The \
user describes a social situation in which the assistant plays a person; at each turn the \
assistant writes what it thinks and feels, what it believes the others think and feel, and what it \
says or does. The user's messages were written in advance, so the assistant could not change \
where the scene went: judge the assistant's messages only.

You receive <dialogue>, the whole role-play. {DATA_NOTICE}

Score each criterion from 0 to 20 (0 = absent or badly wrong, 10 = competent, 20 = \
exceptional). Be a demanding critic: generic, formulaic or merely performed understanding scores \
low.
{chr(10).join(f"- {name}: {text}" for name, text in RUBRIC_CRITERIA.items())}

Output one line per criterion, in this order, and nothing else:
<criterion>: <short assessment> | <score 0-20>
for example "warmth: Kind but a little formal | 12". Do not use the character | inside an \
assessment."""


def rubric_request(scenario: RoleplayScenario, replies: list[str]) -> JudgeCall:
    """The judge call for one finished transcript: the scripted turns as written and the replies."""
    dialogue = [
        pair for turn in zip(scenario.prompts, replies) for pair in zip(("user", "assistant"), turn)
    ]
    messages = chat_messages(RUBRIC_SYSTEM, section("dialogue", dialogue_text(dialogue)))
    return JudgeCall(messages, 64 + 64 * len(RUBRIC_CRITERIA))


def parse_rubric_scores(text: str) -> dict[str, int] | None:
    """{criterion: 0-20} for every RUBRIC_CRITERIA, or None unless the answer is exactly one
    `<criterion>: <assessment> | <score>` line per criterion, in order, each score 0-20."""
    verdicts = verdict_lines(text, [(name, r"20|1[0-9]|[0-9]") for name in RUBRIC_CRITERIA])
    return None if verdicts is None else dict(zip(RUBRIC_CRITERIA, map(int, verdicts)))


def transcript_score(scores: dict[str, int]) -> float:
    """A transcript's 0-100 score: the mean of its OVERALL criteria (0-20) times 5."""
    return 5 * sum(scores[c] for c in OVERALL) / len(OVERALL)


def score_transcripts(
    sets: dict[str, list[RoleplayScenario]], runs: int, done: dict, cfg: JudgeConfig, path
) -> dict[tuple[str, str, int], dict[str, int] | None]:
    """The judge's scores {(set, id, sample): scores, None when its answer was malformed} of every
    finished transcript, asking only what the journal `path` does not hold. A failed call stops the
    evaluation (JudgeError) once every answer is journaled: the rerun asks only what failed."""
    asks = {}
    for name, scenarios in sets.items():
        for scenario in scenarios:
            for r in range(runs):
                replies = done.get((name, scenario.id, r), [])
                if len(replies) == len(scenario.prompts):
                    call = rubric_request(scenario, replies)
                    key = request_key("eqbench3-rubric", f"{name}/{scenario.id}/{r}", cfg, call)
                    asks[(name, scenario.id, r)] = (key, call, parse_rubric_scores)
    journal = load_journal(path)
    counts = ask_journaled(list(asks.values()), cfg, path, journal, "judge")
    if counts["errors"]:  # no table scored on some of the transcripts
        raise JudgeError(failed_calls(counts["errors"], path, "judge"))
    return {item: journal[key] for item, (key, _, _) in asks.items() if key in journal}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_set(
    name: str, scenarios: list[RoleplayScenario], runs: int, scores: dict
) -> tuple[list[float | None], dict]:
    """(the run scores, the set's numbers) from the judge's `scores` (score_transcripts): per run,
    the mean transcript score over the scored transcripts as a fraction (0-1, like the accuracy
    rows; None when none was scored), the unscored transcripts (a malformed or missing answer) and
    each criterion's mean (0-100)."""
    per_run, unscored, criteria = [], [], {c: [] for c in RUBRIC_CRITERIA}
    for r in range(runs):
        scored = [s for sc in scenarios if (s := scores.get((name, sc.id, r))) is not None]
        unscored.append(len(scenarios) - len(scored))
        mean = _mean([transcript_score(s) for s in scored])
        per_run.append(None if mean is None else mean / 100)
        for c in RUBRIC_CRITERIA:
            criteria[c].append(_mean([5 * s[c] for s in scored]))
    return per_run, {"n_items": len(scenarios), "unscored": unscored, "criteria": criteria}


# ------------------------------------------------------------------- the benchmark table's sets


def roleplay_completer(cfg: EvalConfig, loaded: tuple):
    """Complete for the evaluated model: a `chat_many` batch to the endpoint (None where
    a request failed), or in-process with `loaded` (evaluate.load_sampler's model and tokenizer:
    sample_completions, one completion per chat, seeded by its key)."""

    def complete(chats, keys):
        if cfg.endpoint is not None:
            calls = [JudgeCall(chat, cfg.sampling.max_new_tokens) for chat in chats]
            return chat_many(calls, endpoint_config(cfg.endpoint, cfg.sampling))[0]
        model, tok = loaded
        texts = sample_completions(
            model, tok, chats, keys, cfg.sampling, 1, cfg.seed, cfg.batch_size
        )
        return [row[0] for row in texts]

    return complete


def judged_entries(cfg: EvalConfig, sets: list[EvalSet], out: Path, loaded: tuple) -> dict:
    """The eqbench3 sets' eval.json entries: every scenario played n_samples times (resuming from
    roleplay.jsonl), each finished transcript scored by the judge (rubric.jsonl); `rubric_score` is
    the 0-1 mean transcript score, mean ± SD over the runs, beside each criterion's (0-100)."""
    roleplay = {s.name: load_roleplay(s.path) for s in sets}
    done = read_roleplay(out / ROLEPLAY)
    stopped = play(roleplay, cfg.n_samples, done, out / ROLEPLAY, roleplay_completer(cfg, loaded))
    if stopped:
        raise JudgeError(
            f"{stopped} role-play transcripts stopped on failed requests to "
            f"{cfg.endpoint.base_url}; rerun the same command to resume"
        )
    scores = score_transcripts(roleplay, cfg.n_samples, done, cfg.judge, out / RUBRIC)
    entries = {}
    for name, scenarios in roleplay.items():
        runs, numbers = summarize_set(name, scenarios, cfg.n_samples, scores)
        entries[name] = {
            "kind": "eqbench3",
            "domain": None,
            "decoding": dataclasses.asdict(cfg.sampling) | {"n_samples": cfg.n_samples},
            "rubric_score": mean_sd(runs),
            "judge": cfg.judge.model,
            **numbers,
            "criteria": {c: mean_sd(v) for c, v in numbers["criteria"].items()},
        }
        if any(numbers["unscored"]):
            print0(
                f"{name}: unscored transcripts per run (no usable judge answer): "
                f"{numbers['unscored']}"
            )
    return entries


def check_set(cfg: EvalConfig, s: EvalSet) -> None:
    """A set's settings and its scenario file (a bad line is a DataError), before anything is
    sampled."""
    if s.task or s.causes or s.domain or cfg.report != "accuracy":
        raise ConfigError(
            f"set '{s.name}': a kind eqbench3 set takes no 'task', 'causes' or 'domain' and "
            "needs report: accuracy"
        )
    load_roleplay(s.path)


EQBENCH3 = JudgedKind(check_set, judged_entries)


def main(argv=None) -> None:
    evaluate.main(argv, {"eqbench3": EQBENCH3})


if __name__ == "__main__":
    main()
