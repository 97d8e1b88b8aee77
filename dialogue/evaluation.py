"""The dialogue evaluation (EmoLLM Appendix F, CARE): every scenario seed played `runs` times by a
checkpoint or a served policy against the simulated user (dialogue.play), then scored by the judges:

    python -m dialogue.evaluation config.yaml [key=value ...]    # EmoLLM's metrics and CARE's
    rubric
                                                                 score

Writes episodes.jsonl (resumable), eval.json and table.md in output_dir."""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import evaluate
import http_client
import judge
import rewards
from config import (
    ConfigError,
    atomic_write_text,
    bounded,
    load_config,
    open_log,
    parse_cli,
    print0,
    read_log,
    redact_secrets,
    save_resolved_config,
)
from data import DataError
from dialogue.play import (
    DialogueSettings,
    Episode,
    PolicyTurn,
    Respond,
    as_state,
    ask_into,
    load_scenarios,
    local_policy,
    play,
    split_reply,
)
from http_client import STAND_IN, JudgeCall, JudgeConfig, JudgeError
from judge import (
    RESPONSE_QUALITY_DIMENSIONS,
    TURN_QUALITY_KEYS,
    dialogue_text,
    emotional_state_request,
    parse_emotional_state,
    parse_response_quality,
    parse_turn_quality,
    response_quality_request,
    turn_quality_request,
)
from sampling import SamplingConfig, endpoint_config
from tokenizer import CheckpointError, load_tokenizer


def endpoint_policy(endpoint: JudgeConfig, sampling: SamplingConfig) -> Respond:
    """A served policy (vLLM, a hosted API): each call is ONE concurrent `chat_many` batch; a failed
    request stops the evaluation (JudgeError). Serve it without a reasoning parser, so that the
    reasoning can be split off."""
    cfg = endpoint_config(endpoint, sampling)
    if line := cfg.not_sent():
        print0(f"endpoint: {line}")

    def respond(chats, n, seed):
        calls = [JudgeCall(chat, sampling.max_new_tokens) for chat in chats for _ in range(n)]
        texts, stats = http_client.chat_many(calls, cfg)
        if stats["failures"]:
            raise JudgeError(
                f"{stats['failures']} requests to the policy at {endpoint.base_url} failed "
                f"(first: {next(iter(stats['errors'].values()))})"
            )
        turns = [PolicyTurn([], [], [], False, text, *split_reply(text, False)) for text in texts]
        return [turns[i * n : (i + 1) * n] for i in range(len(chats))]

    return respond


# ------------------------------------------------------------- evaluation (EmoLLM Appendix F, CARE)

EPISODES, EVAL_JSON, TABLE = "episodes.jsonl", "eval.json", "table.md"


@dataclass
class DialogueEvalConfig:
    """A dialogue evaluation: every scenario seed played `runs` times by a checkpoint in-process
    (with an optional adapter merged in) or by a served policy, against the simulator, then scored
    by the judges."""

    output_dir: str
    scenarios: list[str]  # JSONL files of scenario seeds
    name: str | None = None  # the model's name in the table (default: output_dir's folder name)
    checkpoint: str | None = None
    adapter: str | None = None
    # a served policy instead of `checkpoint` (evaluate.EvalConfig's endpoint)
    endpoint: JudgeConfig | None = None
    tokenizer: str | None = None  # with an endpoint: counts the policy's output tokens
    device: str | None = None
    dtype: str | None = None
    runs: int = 3  # EmoLLM D.3: results averaged over three runs
    # EmoLLM's Best-of-N baseline (E.2): N replies a turn, each answered by the simulator and rated
    # by the turn judge; the one of highest EA goes on (best_of_n). 1: the policy's first reply
    best_of: int = bounded(1, ge=1)
    seed: int = 0
    care: bool = True  # also CARE's rubric score (a rubric and a scoring call per turn)
    # also EmoLLM's Figure 6: each reply rated on six dimensions, 1-5 (one more call per turn)
    response_quality: bool = False
    # the scaffold stays off: EmoLLM H
    dialogue: DialogueSettings = field(default_factory=DialogueSettings)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


def dialogue_metrics(episodes: list[dict], response_quality: bool = False) -> dict:
    """EmoLLM's metrics (Appendix F) and CARE's rubric score over one run's episodes (records of
    `judge_episodes`):
    - SR, success rate (%): episodes with a success turn, the first turn the judge rates sr_proxy =
      1;
    - AT, average turns: the success turn's number (from 1), over the successful episodes;
    - ES, emotional state: the user's final state e_T (1-5);
    - EG/Turn, emotional gain per turn: (e_T - e_0) / T, T the episode's assistant turns;
    - EA, empathic appropriateness: the judge's 1-5 over all turns;
    - FA, factual accuracy (%): the share of the fact-sensitive turns (those the judge rates
      fact_sensitive = 1, Appendix F) rated reliable; None when no turn is fact-sensitive
      (`fa_turns`: how many there are);
    - CARE: the rubric score (rewards.care_score, 0-1) over all turns;
    - Tokens: the policy's output tokens per turn (EmoLLM's Table 7), over the turns counted;
    - Tokens/conv.: the policy's output tokens per episode, over the episodes whose every turn is
      counted (Table 7's per conversation);
    - response_quality: each of Figure 6's six dimensions (1-5) over the turns rated (asked for:
      `response_quality`).
    A judgement that is missing or malformed (a rating off its scale) leaves its episode or turn
    out of that metric (SR and AT: an episode whose success turn cannot be told), and is counted in
    `unjudged`. Every metric is None when nothing was judged."""

    def mean(values):
        return sum(values) / len(values) if values else None

    judged, success_turns = 0, []
    for e in episodes:
        flags = [t["sr_proxy"] for t in e["turns"]]
        # the first success, or a gap
        first = next((k for k, flag in enumerate(flags) if flag != 0), None)
        if first is not None and flags[first] is None:
            continue
        judged += 1
        success_turns += [] if first is None else [first + 1]
    turns = [t for e in episodes for t in e["turns"]]
    ends = [e for e in episodes if e["e_T"] is not None]
    gains = [
        (e["e_T"] - e["e_0"]) / e["n_turns"] for e in ends if e["e_0"] is not None and e["n_turns"]
    ]
    fa_turns = [t["fa"] for t in turns if t["fact_sensitive"] == 1 and t["fa"] is not None]
    fa = mean(fa_turns)
    return {
        "success_rate": 100 * len(success_turns) / judged if judged else None,
        "avg_turns": mean(success_turns),
        "emotional_state": mean([e["e_T"] for e in ends]),
        "eg_per_turn": mean(gains),
        "ea": mean([t["ea"] for t in turns if t["ea"] is not None]),
        "fa": None if fa is None else 100 * fa,
        "fa_turns": len(fa_turns),
        "care": mean([t["care"] for t in turns if t["care"] is not None]),
        "output_tokens": mean(
            [t["output_tokens"] for t in turns if t["output_tokens"] is not None]
        ),
        "conversation_tokens": mean(
            [
                sum(t["output_tokens"] for t in e["turns"])
                for e in episodes
                if e["turns"] and all(t["output_tokens"] is not None for t in e["turns"])
            ]
        ),
        "response_quality": {
            d: mean([t["dimensions"][d] for t in turns if t["dimensions"] is not None])
            for d in RESPONSE_QUALITY_DIMENSIONS
        },
        "episodes": len(episodes),
        "unjudged": {
            "success": len(episodes) - judged,
            "e_0": sum(e["e_0"] is None for e in episodes),
            "e_T": len(episodes) - len(ends),
            "turns": sum(t["ea"] is None for t in turns),
            "care": sum(t["care"] is None for t in turns),
        }
        | (
            {"response_quality": sum(t["dimensions"] is None for t in turns)}
            if response_quality
            else {}
        ),
    }


def output_tokens(turn: PolicyTurn, tok) -> int | None:
    """The tokens the policy wrote in a turn, reasoning and reply (EOS aside; EmoLLM's Table 7): its
    sampled ids in-process; for a served policy, `tok`'s count of its text (None without `tok`)."""
    if turn.completion:
        return len(turn.completion) - (not turn.truncated)
    return None if tok is None else len(tok.encode(turn.text, special_tokens=False))


def best_of_n(cfg: DialogueEvalConfig) -> Callable[[list[Episode], list[list]], list[int]]:
    """play()'s `choose` for Best-of-N: each candidate rated by the same turn judge the metrics use
    (its reply and the simulator's follow-up), the highest empathic appropriateness picked, the
    earliest among equals; a candidate without a rating (no follow-up, a failed call) ranks last."""

    def choose(live: list[Episode], drawn: list[list]) -> list[int]:
        asks = [
            (
                turn_quality_request(
                    e.start.scenario.scenario, list(e.state.history), r.reply, r.follow_up
                ),
                parse_turn_quality,
            )
            for e, replies in zip(live, drawn)
            for r in replies
            if r.follow_up is not None
        ]
        ratings = iter(http_client.ask(asks, cfg.judge)[0])
        picks = []
        for replies in drawn:
            ea = []
            for r in replies:
                rating = next(ratings) if r.follow_up is not None else None
                ea.append(-1.0 if rating is None else rating["ea"])
            picks.append(ea.index(max(ea)))
        return picks

    return choose


def judge_episodes(episodes: list[Episode], cfg: DialogueEvalConfig, tok=None) -> list[dict]:
    """Every judgement the metrics need, each batch at once: e_0 and e_T per episode and each turn's
    quality (sr_proxy, ea, fact_sensitive, fa; a turn without a follow-up has none), with `care`
    each state's rubric (the rubric judge), then each reply's scores. One record per episode: the
    dialogue, each turn's output tokens (`output_tokens`, `tok` for a served policy) and the
    judgements."""
    records, asks, rubrics = [], [], []
    for e in episodes:
        scenario = e.start.scenario
        record = {
            "id": scenario.id,
            "ended_by": e.ended_by,
            "n_turns": len(e.turns),
            "e_0": None,
            "e_T": None,
            "turns": [],
        }
        asks.append(
            (
                record,
                "e_0",
                emotional_state_request(scenario.scenario, scenario.initial_prompt),
                parse_emotional_state,
            )
        )
        if e.turns and e.state.history[-1][0] == "user":
            *context, (_, last) = e.state.history
            asks.append(
                (
                    record,
                    "e_T",
                    emotional_state_request(dialogue_text(context), last),
                    parse_emotional_state,
                )
            )
        for k, turn in enumerate(e.turns):
            reply = turn.candidates[0]
            row = {
                "user": turn.state.history[-1][1],
                "reasoning": reply.reasoning,
                "reply": reply.reply,
                "output_tokens": output_tokens(reply, tok),
                "follow_up": e.follow_up(k),
                "quality": None,
                "dimensions": None,
                "rubric": None,
                "scores": None,
            }
            if row["follow_up"] is not None:
                asks.append(
                    (
                        row,
                        "quality",
                        turn_quality_request(
                            scenario.scenario,
                            list(turn.state.history),
                            reply.reply,
                            row["follow_up"],
                        ),
                        parse_turn_quality,
                    )
                )
            if cfg.response_quality:
                asks.append(
                    (
                        row,
                        "dimensions",
                        response_quality_request(list(turn.state.history), reply.reply),
                        parse_response_quality,
                    )
                )
            if cfg.care:
                rubrics.append(
                    (
                        row,
                        "rubric",
                        judge.care_rubric_request(list(turn.state.history)),
                        judge.parse_care_rubric,
                    )
                )
            record["turns"].append(row)
        records.append(record)
    ask_into(asks, cfg.judge)
    ask_into(rubrics, cfg.dialogue.rubric_judge or cfg.judge)
    ask_into(
        [
            (
                row,
                "scores",
                judge.care_scores_request(list(turn.state.history), row["rubric"], row["reply"]),
                lambda text, rubric=row["rubric"]: judge.parse_care_scores(text, rubric),
            )
            for e, record in zip(episodes, records)
            for turn, row in zip(e.turns, record["turns"])
            if row["rubric"] is not None
        ],
        cfg.judge,
    )
    for row in (row for record in records for row in record["turns"]):
        row |= {
            key: None if row["quality"] is None else row["quality"][key]
            for key in TURN_QUALITY_KEYS
        }
        row["care"] = (
            None if row["scores"] is None else rewards.care_score(row["rubric"], row["scores"])
        )
    return records


def read_episodes(path) -> list[dict]:
    """The records of an episodes.jsonl (read_log); EvalError naming the line of one that
    `judge_episodes` did not write, or wrote before a turn key (fact_sensitive, output_tokens,
    dimensions) existed."""
    records = read_log(path, evaluate.EvalError)
    for number, r in enumerate(records, 1):
        if not (
            isinstance(r, dict)
            and type(r.get("run")) is int
            and {"e_0", "e_T", "n_turns"} <= set(r)
            and isinstance(r.get("turns"), list)
            and all(
                isinstance(t, dict)
                and {*TURN_QUALITY_KEYS, "care", "output_tokens", "dimensions"} <= set(t)
                for t in r["turns"]
            )
        ):
            raise evaluate.EvalError(
                f"{path}:{number}: not an episode record of this dialogue/evaluation.py (another "
                f"file, or an older version's); use a new output_dir"
            )
    return records


def _generation_identity(cfg: DialogueEvalConfig) -> dict:
    return {
        key: dataclasses.asdict(cfg)[key]
        for key in ("checkpoint", "adapter", "endpoint", "seed", "sampling", "dialogue", "best_of")
    }


def _policy(cfg: DialogueEvalConfig) -> Respond:
    if cfg.endpoint is not None:
        return endpoint_policy(cfg.endpoint, cfg.sampling)
    model, tok = evaluate.load_model(cfg)
    return local_policy(model, tok, cfg.sampling, cfg.dialogue)


METRICS = (
    ("success_rate", "SR (%)", 1),
    ("avg_turns", "AT", 2),
    ("emotional_state", "ES", 2),
    ("eg_per_turn", "EG/Turn", 3),
    ("ea", "EA", 2),
    ("fa", "FA (%)", 1),
    ("care", "CARE", 3),
    ("output_tokens", "Tokens", 1),
    ("conversation_tokens", "Tokens/conv.", 1),
)


def _cell(stat: dict, digits: int) -> str:
    if stat["mean"] is None:
        return "–"
    sd = "" if stat["sd"] is None else f" ± {stat['sd']:.{digits}f}"
    return f"{stat['mean']:.{digits}f}{sd}"


def markdown_table(summary: dict) -> str:
    """EmoLLM's Table 1 layout, with EG/Turn, FA and CARE beside it: mean ± SD over runs; a row per
    test set (scenario file) when there are several, then the row over all of them."""

    def row(label: str, metrics: dict) -> str:
        return f"| {label} | {' | '.join(_cell(metrics[k], d) for k, _, d in METRICS)} |"

    heads = [head for _, head, _ in METRICS]
    sets = summary.get("test_sets", {})
    judges = summary["judges"]
    title = (
        f"### Dialogue evaluation, mean ± SD over {len(summary['runs'])} runs: judge "
        f"{judges['judge']}, user simulator {judges['simulator']}"
    )
    if STAND_IN in judges.values():
        title += " (the RULES STAND-IN: scripted scores and user, not a judge)"
    rows = [row(f"{summary['name']}: {n}", s["metrics"]) for n, s in sets.items()]
    rows.append(row(summary["name"] + (": all" if sets else ""), summary["metrics"]))
    lines = [title, "", f"| Model | {' | '.join(heads)} |", "|---" * (len(heads) + 1) + "|", *rows]
    if summary.get("response_quality"):  # Figure 6
        cells = [_cell(summary["response_quality"][d], 2) for d in RESPONSE_QUALITY_DIMENSIONS]
        lines += [
            "",
            "Response quality (1-5, EmoLLM Figure 6), mean ± SD over runs:",
            "",
            "| Model | " + " | ".join(RESPONSE_QUALITY_DIMENSIONS) + " |",
            "|---" * (len(RESPONSE_QUALITY_DIMENSIONS) + 1) + "|",
            f"| {summary['name']} | {' | '.join(cells)} |",
        ]
    return "\n".join(lines) + "\n"


def evaluate_dialogues(cfg: DialogueEvalConfig) -> dict:
    """Play, judge and score `cfg.runs` runs (resuming: a run whose episodes are in output_dir is
    not replayed), and write episodes.jsonl (every episode with its judgements), eval.json and
    table.md. Returns eval.json."""
    if (cfg.checkpoint is None) == (cfg.endpoint is None):
        raise ConfigError(
            "give exactly one of 'checkpoint' (in-process) and 'endpoint' (a served policy)"
        )
    for key, value in (("runs", cfg.runs), ("dialogue.max_turns", cfg.dialogue.max_turns)):
        if value < 1:
            raise ConfigError(f"'{key}' must be at least 1, got {value}")
    out = Path(cfg.output_dir)
    source: dict[str, str] = {}  # scenario id -> its file's name, a test set of its own
    scenarios = []
    for path in cfg.scenarios:
        for seed in load_scenarios(path):
            if seed.id in source:
                raise ConfigError(
                    f"scenario id {seed.id!r} is in {path} and in an earlier file of 'scenarios' "
                    f"({source[seed.id]}): each test set's ids must differ"
                )
            source[seed.id] = Path(path).stem
            scenarios.append(as_state(seed))
    if (out / EPISODES).exists() and (out / "config.yaml").exists():
        old = load_config(out / "config.yaml", [], DialogueEvalConfig)
        if _generation_identity(old) != _generation_identity(cfg):
            raise ConfigError(
                f"{out}: holds episodes of another model, seed, decoding or role-play; "
                "use a new output_dir"
            )
    done: dict[int, list[dict]] = {}
    for record in read_episodes(out / EPISODES):
        done.setdefault(record["run"], []).append(record)
    missing = [r for r in range(cfg.runs) if r not in done]
    # the policy (a checkpoint loaded, its adapters merged) before output_dir gets a file
    respond = _policy(cfg) if missing else None
    tok = load_tokenizer(cfg.tokenizer) if cfg.endpoint is not None and cfg.tokenizer else None
    save_resolved_config(cfg, out)
    for run in missing:
        seed = random.Random(f"{cfg.seed}/run{run}").getrandbits(63)
        episodes, _ = play(
            respond,
            scenarios,
            cfg.dialogue,
            cfg.dialogue.simulator or cfg.judge,
            cfg.best_of,
            seed,
            best_of_n(cfg) if cfg.best_of > 1 else None,
        )
        done[run] = [record | {"run": run} for record in judge_episodes(episodes, cfg, tok)]
        with open_log(out / EPISODES) as f:  # a run's episodes at once: a run is whole or absent
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in done[run]))
        print0(
            f"run {run + 1}/{cfg.runs}: {len(episodes)} episodes, ended by "
            + ", ".join(
                f"{why} {sum(e.ended_by == why for e in episodes)}"
                for why in ("user", "turn limit", "simulator")
            )
        )
    runs = [dialogue_metrics(done[r], cfg.response_quality) for r in range(cfg.runs)]
    unrated = [run["unjudged"].get("response_quality", 0) for run in runs]
    if any(unrated):
        print0(
            "response_quality: turns without a usable rating per run (no answer, or one off the "
            f"1-5 scale or out of format), left out of Figure 6's means: {unrated}"
        )
    summary = {
        "name": cfg.name or out.resolve().name,
        "model": evaluate.model_identity(cfg),
        "n_scenarios": len(scenarios),
        "judges": {
            "judge": cfg.judge.model,
            "simulator": (cfg.dialogue.simulator or cfg.judge).model,
        },
        "metrics": {key: evaluate.mean_sd([run[key] for run in runs]) for key, _, _ in METRICS},
        "response_quality": {
            d: evaluate.mean_sd([run["response_quality"][d] for run in runs])
            for d in RESPONSE_QUALITY_DIMENSIONS
        }
        if cfg.response_quality
        else None,
        "runs": runs,
        "config": redact_secrets(dataclasses.asdict(cfg)),
    }
    if len(cfg.scenarios) > 1:  # EmoLLM reports each test set on its own
        summary["test_sets"] = {}
        for name in dict.fromkeys(source.values()):
            mine = [
                dialogue_metrics([e for e in done[r] if source[e["id"]] == name])
                for r in range(cfg.runs)
            ]
            summary["test_sets"][name] = {
                "n_scenarios": sum(v == name for v in source.values()),
                "metrics": {k: evaluate.mean_sd([run[k] for run in mine]) for k, _, _ in METRICS},
            }
    atomic_write_text(out / EVAL_JSON, json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    atomic_write_text(out / TABLE, markdown_table(summary))
    print0(markdown_table(summary))
    return summary


def main(argv: list[str]) -> None:
    """`python -m dialogue.evaluation config.yaml [key=value ...]`: bad input, or a server that
    keeps failing, is one line and exit status 2."""
    cfg = parse_cli(DialogueEvalConfig, argv)
    try:
        evaluate_dialogues(cfg)
    except ConfigError as e:
        print(f"config error: {argv[0]}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (CheckpointError, DataError, evaluate.EvalError, JudgeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main(sys.argv[1:])
