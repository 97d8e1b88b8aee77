"""Multi-turn dialogue: scenario seeds, the role-play between a policy and a simulated user, asking
the judges of a whole dialogue (their prompts and parsers: judge.py), the grouping that
dialogue/rl.py trains with (EmoLLM, CARE); the dialogue evaluation is dialogue/evaluation.py.

Role-play (EmoLLM 3.2.2 and Appendix H, CARE 3.4). An episode starts from a scenario seed's opening
user message. Every turn, the policy answers all live episodes at once (ONE batched `model.generate`
call, or one `chat_many` batch for a served policy); the reasoning of a reply (the text before
`</think>`) is kept for the judges but never enters the dialogue; then the simulated user answers
all live episodes at once (ONE `chat_many` batch). An episode ends when the user's message holds an
end-of-conversation phrase (`user_ends_dialogue`), after `max_turns` assistant turns, or when the
simulator gives no usable answer (a judge failure: the rewards that need the rest of the dialogue
are then None).

Grouping: the reward decides it (rewards.DIALOGUE_GROUPING).
- trajectory (`emollm`): G whole episodes from the same seed; R(tau) = sum_t r_t + lambda_emo R_emo.
  An episode's loss covers the tokens of every assistant turn it sampled, each under the prompt it
  was sampled with, and no user token; its mean runs over all of them (each row weighs its share of
  the episode's tokens: grpo_loss's `row_weight`).
- turn (`emollm_turn`, `care`): one episode per seed; at every state the policy draws G candidate
  replies, the simulated user answers each, and the episode goes on with the first (`play` says
  why); the G candidates are a group, scored by r_t (its judge sees each candidate's own follow-up)
  or by CARE's rubric, one rubric written per state and shared by its group (kept on the state for
  resampling).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

import data
import dataset
import http_client
import judge
import rewards
from config import bounded
from data import THINK_END, THINK_START, DataError
from fsdp import GatheredSampler, is_sharded
from grpo import Segment, Slot
from http_client import JudgeCall, JudgeConfig
from judge import (
    dialogue_text,
    emotional_state_request,
    parse_emotional_state,
    parse_prediction,
    parse_turn_scores,
    parse_user_turn,
    predictor_request,
    turn_scores_request,
    user_ends_dialogue,
    user_turn_request,
)
from rewards import DIALOGUE_GROUPING
from rollout import Group, Sample, Sampler

# ----------------------------------------------------------------------------- config


# ----------------------------------------------------------------------------- scenario seeds


@dataclass
class DialogueSettings:
    """A dialogue run's role-play (the config's `dialogue:` section): how long episodes run, what
    the policy is asked to write, who plays the user."""

    max_turns: int = bounded(8, ge=1)  # assistant turns per episode at most (EmoLLM D.2, CARE A: 8)
    # ask the policy for an ARG trace with lookahead steps (EmoLLM's training prompt)
    arg_scaffold: bool = False
    # n: the reverse-perspective steps the scaffold asks for at most (EmoLLM: 3; 0: none, the
    # first point of its Figure 5)
    lookahead: int = bounded(3, ge=0)
    # the user simulator's endpoint and sampling (None: the judge's)
    simulator: JudgeConfig | None = None
    rubric_judge: JudgeConfig | None = None  # CARE's rubric generator (None: the judge's)
    # CARE's fixed-criteria ablation (Table 3): these 2-4 criteria per dimension replace every
    # generated rubric's, its weights kept (None: the generated criteria)
    fixed_criteria: dict[str, list[str]] | None = None
    # EmoLLM's reverse-perspective predictor T (B.1; None: the judge's)
    predictor: JudgeConfig | None = None
    # the prompt the policy samples under, cut at turn boundaries (None: whole)
    context_tokens: int | None = None
    # the prompt the update's log-probs use, cut the same way (None: whole)
    update_context_tokens: int | None = None


SCENARIO_FIELDS = ("id", "scenario", "initial_prompt")


@dataclass(frozen=True)
class Scenario:
    """A role-play seed (EmoLLM C.3): the situation (the assistant's role and what the user faces)
    and the user's opening message."""

    id: str
    scenario: str
    initial_prompt: str


def load_scenarios(path) -> list[Scenario]:
    """Scenario seeds from JSONL, one `{"id", "scenario", "initial_prompt"}` object per line, each a
    non-empty string, no other field. A bad line, a repeated id or a file without seeds raises
    DataError naming the file (the line and the field)."""
    scenarios, ids = [], set()
    for number, raw in dataset.read_jsonl(path):
        try:
            if not isinstance(raw, dict):
                raise DataError(f"expected a JSON object, got {type(raw).__name__}")
            if unknown := sorted(set(raw) - set(SCENARIO_FIELDS)):
                raise DataError(
                    f"field '{unknown[0]}': unknown field (known: {', '.join(SCENARIO_FIELDS)})"
                )
            values = [dataset.typed_field(raw, key, str) for key in SCENARIO_FIELDS]
            if empty := [key for key, value in zip(SCENARIO_FIELDS, values) if not value.strip()]:
                raise DataError(f"field '{empty[0]}': empty")
            dataset.check_new_id(values[0], ids)
        except DataError as e:
            raise DataError(f"{path}:{number}: {e}") from None
        scenarios.append(Scenario(*values))
    if not scenarios:
        raise DataError(f"{path}: no scenarios")
    return scenarios


@dataclass
class State:
    """A point of a dialogue: its scenario and the messages both sides have seen, as (role, text)
    pairs, usually ending with the user's. Assistant messages are replies only, never reasoning.
    `judged` keeps what a judge said about the state itself (CARE's rubric; an opening's emotional
    state), so that a resampled group at the state shares it."""

    scenario: Scenario
    history: tuple[tuple[str, str], ...]
    judged: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def turn(self) -> int:
        """The assistant turn this state waits for, from 1."""
        return 1 + sum(role == "assistant" for role, _ in self.history)

    @property
    def id(self) -> str:
        return self.scenario.id if self.turn == 1 else f"{self.scenario.id}/turn{self.turn}"

    def then(self, role: str, text: str) -> State:
        return State(self.scenario, self.history + ((role, text),))


def as_state(item: Scenario | State) -> State:
    """A state as given, or a scenario's opening state (the user's first message)."""
    return item if isinstance(item, State) else State(item, (("user", item.initial_prompt),))


# -------------------------------------------------------------- what the policy and the judges read

ARG_SCAFFOLD = """You are talking with someone who may be going through something difficult. \
Before each reply, think it through privately between <think> and </think>; the person never sees \
that part. Write one or two short lines per section, in this order:
Facts: what the conversation has established about the person's situation.
Needs: what the person needs or is trying to achieve right now.
Appraisal: how the person seems to judge the situation against those needs: does it go with or \
against their goals, can they influence it, who do they hold responsible.
Emotion: the feelings that follow from that appraisal.
Strategy: how you will respond (tone, and what to focus on) given all of the above.
{lookahead}After </think>, write only your reply to the person: natural, warm and practical, \
usually two to five sentences."""

LOOKAHEAD_LINES = """Lookahead 1: how the person's needs, appraisal and feelings would likely \
change after a reply with this strategy.
Lookahead 2, 3, ...: each one exchange further ahead, at most {n} in all; stop as soon as the \
prediction settles.
Choice: the strategy you keep, or the change the lookahead calls for.
"""


def arg_scaffold(n: int) -> str:
    """The ARG scaffold asking for at most `n` lookahead steps; with n = 0 the lookahead and the
    choice it informs are left out."""
    return ARG_SCAFFOLD.format(lookahead=LOOKAHEAD_LINES.format(n=n) if n else "")


def fit_context(
    tok, chat: list[dict[str, str]], max_tokens: int | None, thinking: bool | None
) -> list[dict[str, str]]:
    """`chat` cut to at most `max_tokens` prompt tokens at turn boundaries (EmoLLM D.3 keeps 2,048
    in generation and 896 in the update): the oldest exchange goes first, a user message with the
    assistant's reply to it, while the system message and the latest user message always stay; no
    message is ever cut inside, so a chat whose system message and last message alone are longer is
    kept at that. None: the whole chat."""
    head = chat[:1] if chat and chat[0]["role"] == "system" else []
    body = chat[len(head) :]
    while (
        max_tokens is not None
        and len(body) > 1
        and len(tok.chat_ids(head + body, enable_thinking=thinking)) > max_tokens
    ):
        body = body[2:]
    return head + body


def policy_messages(state: State, settings: DialogueSettings) -> list[dict[str, str]]:
    """The chat the policy answers: the ARG scaffold as the system message when asked for, then the
    dialogue."""
    system = (
        [{"role": "system", "content": arg_scaffold(settings.lookahead)}]
        if settings.arg_scaffold
        else []
    )
    return system + [{"role": role, "content": text} for role, text in state.history]


def split_reply(text: str, opened: bool) -> tuple[str, str]:
    """(reasoning, reply) of an assistant turn: the reply is the text after the final `</think>`,
    the reasoning the text before it (data.split_completion). Without a `</think>`, a turn whose
    prompt (`opened`) or text opened a think block never finished reasoning: all of it is reasoning
    and the reply is empty, so none of it can reach the user. A text with no think tag at all is all
    reply."""
    if THINK_END in text or THINK_START in text or opened:
        reasoning, reply = data.split_completion(text)
        return reasoning, reply.strip()
    return "", text.strip()


# ----------------------------------------------------------------------------- the role-play


@dataclass
class PolicyTurn:
    """One assistant turn the policy sampled: the prompt it answered (token ids), its new tokens
    with the sampler's log-probabilities (all empty for a served policy), and its text split into
    reasoning and reply."""

    prompt: list[int]
    completion: list[int]  # ending with EOS unless truncated
    logp: list[float]
    truncated: bool
    text: str
    reasoning: str  # for the judges only
    reply: str  # what the user sees
    n_reasoning_tokens: int = 0
    # the prompt the update's log-probs use (update_context_tokens; None: prompt)
    train_prompt: list[int] | None = None
    # the simulated user's answer to this reply (play); None: none usable
    follow_up: str | None = None


# (chats, samples each, seed)
Respond = Callable[[list[list[dict[str, str]]], int, int], list[list[PolicyTurn]]]


def local_policy(model, tok, sampling, settings: DialogueSettings | None = None) -> Respond:
    """A policy run in-process: each call is ONE batched `model.generate` over every chat, `n`
    samples each (identical prompts prefilled once). `sampling` holds temperature, top_p, top_k,
    repetition_penalty, max_new_tokens and enable_thinking (grpo's RolloutSettings, evaluate's
    SamplingConfig). With `settings`, each chat is cut to its `context_tokens` before sampling and
    to its `update_context_tokens` for the update (`fit_context`); where the update's cut is
    shorter, the trainer's log-probs differ from the sampler's, and grpo logs that difference as
    logp_mismatch (mean and max per token): the mismatch the setting accepts."""
    from model import generate  # torch only where a model runs

    eos, thinking = set(tok.eos_token_ids), sampling.enable_thinking
    # the template opens <think>
    opened = tok.chat([], enable_thinking=thinking).endswith(THINK_START + "\n")

    limits = (
        (None, None)
        if settings is None
        else (settings.context_tokens, settings.update_context_tokens)
    )

    def respond(chats, n, seed):
        shown = [fit_context(tok, chat, limits[0], thinking) for chat in chats]
        prompts = [tok.chat_ids(chat, enable_thinking=thinking) for chat in shown]
        trained = [
            tok.chat_ids(fit_context(tok, c, limits[1], thinking), enable_thinking=thinking)
            for c in shown
        ]
        model.eval()
        new, logp = generate(
            model,
            [p for p in prompts for _ in range(n)],
            sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            repetition_penalty=sampling.repetition_penalty,
            eos_token_ids=tok.eos_token_ids,
            seed=seed,
            return_logprobs=True,
        )
        turns = []
        for i, tokens in enumerate(new):
            ended = bool(tokens) and tokens[-1] in eos
            text = tok.decode(tokens[:-1] if ended else tokens)
            reasoning, reply = split_reply(text, opened)
            turns.append(
                PolicyTurn(
                    prompts[i // n],
                    tokens,
                    logp[i],
                    not ended,
                    text,
                    reasoning,
                    reply,
                    data.count_tokens(reasoning, tok),
                    trained[i // n],
                )
            )
        return [turns[i * n : (i + 1) * n] for i in range(len(prompts))]

    return respond


@dataclass
class EpisodeTurn:
    """One assistant turn of an episode."""

    state: State  # what the policy answered
    # the replies drawn there, each with its own follow-up; the episode took the first
    candidates: list[PolicyTurn]


@dataclass
class Episode:
    """One role-played dialogue, from its start state to its end."""

    start: State
    state: State  # the dialogue so far (when the episode is over: as it ended)
    turns: list[EpisodeTurn] = field(default_factory=list)
    ended_by: str | None = None  # "user", "turn limit" or "simulator" (no usable simulator answer)

    def follow_up(self, k: int) -> str | None:
        """The user's reply to assistant turn k (0-based), None when the simulator gave none."""
        at = len(self.turns[k].state.history) + 1
        return self.state.history[at][1] if at < len(self.state.history) else None


def add_stats(total: dict, stats: dict) -> dict:
    """Add the call counts of `stats` (http_client.ask's) into `total`."""
    for key in ("calls", "retries", "failures", "malformed"):
        total[key] = total.get(key, 0) + stats.get(key, 0)
    return total


def play(
    respond: Respond,
    starts: list[State],
    settings: DialogueSettings,
    simulator: JudgeConfig,
    candidates: int = 1,
    seed: int = 0,
    choose: Callable[[list[Episode], list[list[PolicyTurn]]], list[int]] | None = None,
) -> tuple[list[Episode], dict]:
    """Play an episode from each start state, all at once, until every one has ended (see the module
    docstring); every turn draws `candidates` replies per live episode in one `respond` call, then
    the simulator answers every candidate, in one `chat_many` batch (EmoLLM H: each candidate gets
    its own user reply before the turn rewards). The episode goes on with candidate 0 and its reply:
    the candidates are exchangeable draws, so the first is a random one and the episode visits the
    states the policy itself reaches; taking the best-judged would need the turn's rewards before
    the next turn and steer later states toward what the judge already favours. `choose(live,
    drawn)`, when given, picks each live episode's candidate instead (an evaluation's Best-of-N),
    which is then put first. Returns the episodes and the simulator's call statistics."""
    episodes = [Episode(start, start) for start in starts]
    live, stats = list(episodes), {}
    while live:
        turn_seed = random.Random(f"{seed}/{live[0].state.turn}").getrandbits(63)
        drawn = respond([policy_messages(e.state, settings) for e in live], candidates, turn_seed)
        calls = [
            user_turn_request(
                e.start.scenario.scenario,
                list(e.state.then("assistant", r.reply).history),
                len(e.turns) + 1,
                settings.max_turns,
            )
            for e, replies in zip(live, drawn)
            for r in replies
        ]
        messages, asked = http_client.ask([(call, parse_user_turn) for call in calls], simulator)
        add_stats(stats, asked)
        answers = iter(messages)
        for replies in drawn:
            for reply in replies:
                reply.follow_up = next(answers)
        if choose is not None:
            picks = choose(live, drawn)
            drawn = [[r[k], *r[:k], *r[k + 1 :]] for r, k in zip(drawn, picks)]
        for episode, replies in zip(live, drawn):
            episode.turns.append(EpisodeTurn(episode.state, replies))
            episode.state = episode.state.then("assistant", replies[0].reply)
            message = replies[0].follow_up
            if message is None:
                episode.ended_by = "simulator"
                continue
            episode.state = episode.state.then("user", message)
            if user_ends_dialogue(message):
                episode.ended_by = "user"
            elif len(episode.turns) == settings.max_turns:
                episode.ended_by = "turn limit"
        live = [e for e in live if e.ended_by is None]
    return episodes, stats


# ---------------------------------------------------------- training groups (dialogue/rl.py's runs)


def turn_rollout(state: State, turn: PolicyTurn) -> rewards.Rollout:
    """A reply drawn at `state`, as the rewards read it: `example` is the dialogue the reply closes,
    and `judged["follow_up"]` the simulated user's answer to it."""
    return rewards.Rollout(
        state.then("assistant", turn.reply),
        turn.text,
        turn.reasoning,
        data.split_blocks(turn.reasoning),
        None,
        turn.n_reasoning_tokens,
        len(turn.completion),
        judged={"follow_up": turn.follow_up},
    )


def transcript(episode: Episode) -> str:
    """The episode as text, each assistant turn with its reasoning (for completions.jsonl; the user
    never saw it)."""
    texts = iter(turn.candidates[0].text for turn in episode.turns)
    return "\n\n".join(
        f"{role.capitalize()}: {next(texts) if role == 'assistant' else text}"
        for role, text in episode.state.history
    )


def episode_rollout(episode: Episode) -> rewards.Rollout:
    """A whole episode for a trajectory reward: `example` is the dialogue as it ended, `turns` its
    assistant turns."""
    turns = [turn_rollout(t.state, t.candidates[0]) for t in episode.turns]
    return rewards.Rollout(
        episode.state,
        transcript(episode),
        "",
        [],
        None,
        sum(r.n_reasoning_tokens for r in turns),
        sum(r.n_completion_tokens for r in turns),
        turns=turns,
    )


def predict(turns: list[rewards.Rollout], settings: DialogueSettings, cfg: JudgeConfig) -> dict:
    """R_RP's forecast (EmoLLM B.1): n = settings.lookahead steps of the predictor for each turn,
    s^(1) = T(x, y) and s^(k+1) = T(x, y, s^(k)), step k of every turn in one batch on
    `settings.predictor` (None: `cfg`, the judge's); s^(n) goes to judged["prediction"] (None when a
    step failed). Returns the call statistics."""
    stats, live = {}, list(turns)
    for turn in turns:
        turn.judged["prediction"] = None
    for _ in range(max(1, settings.lookahead)):
        asks = [
            (
                t.judged,
                "prediction",
                predictor_request(
                    list(t.example.history[:-1]), t.example.history[-1][1], t.judged["prediction"]
                ),
                parse_prediction,
            )
            for t in live
        ]
        add_stats(stats, ask_into(asks, settings.predictor or cfg))
        live = [t for t in live if t.judged["prediction"] is not None]
    return stats


def _turn_scores_asks(turns: list[rewards.Rollout], settings: DialogueSettings) -> list:
    """The turn judge's calls for the turns whose forecast arrived (the others keep turn_scores
    None)."""
    asks = []
    for turn in turns:
        turn.judged["turn_scores"] = None
        if turn.judged["prediction"] is not None:
            *context, (_, reply) = turn.example.history
            asks.append(
                (
                    turn.judged,
                    "turn_scores",
                    turn_scores_request(
                        context,
                        turn.reasoning,
                        reply,
                        settings.lookahead,
                        turn.judged["prediction"],
                        turn.judged.get("follow_up"),
                    ),
                    parse_turn_scores,
                )
            )
    return asks


def judge_groups(
    groups: list[tuple[State, list[rewards.Rollout]]],
    spec: rewards.RewardSpec,
    settings: DialogueSettings,
    cfg: JudgeConfig,
) -> dict:
    """Ask the judges that the dialogue reward `spec` reads about every group at once, storing each
    parsed answer in `judged` (None where missing). A group is (start, rollouts): the episodes
    played from one opening state (a trajectory reward) or the replies drawn at one state (a turn
    reward).
    - emollm: e_0 once per start state, and per episode that ran to its end e_T and each turn's
      scores (an episode the simulator broke off gets None: its R_emo is unknown);
    - emollm_turn: each reply's turn scores;
    - care: a rubric for each state that has none yet (`settings.rubric_judge`), then, in a second
      batch, each reply's scores against its state's rubric (none asked where the rubric is missing:
      the reward is None).
    Returns the summed call statistics."""
    asks, ask_cfg, scored = [], cfg, []
    if DIALOGUE_GROUPING[spec.name] == "trajectory":
        for start, episodes in groups:
            if start.judged.get("emotional_state") is None:
                asks.append(
                    (
                        start.judged,
                        "emotional_state",
                        emotional_state_request(
                            start.scenario.scenario, start.scenario.initial_prompt
                        ),
                        parse_emotional_state,
                    )
                )
            for episode in (r for r in episodes if r.example.history[-1][0] == "user"):
                *context, (_, last) = episode.example.history
                asks.append(
                    (
                        episode.turns[-1].judged,
                        "emotional_state",
                        emotional_state_request(dialogue_text(context), last),
                        parse_emotional_state,
                    )
                )
                scored += episode.turns
    elif spec.name == "emollm_turn":
        scored = [r for _, replies in groups for r in replies]
    else:
        states = {
            id(state): state for state, _ in groups if state.judged.get("care_rubric") is None
        }.values()
        asks += [
            (
                s.judged,
                "care_rubric",
                judge.care_rubric_request(list(s.history)),
                judge.parse_care_rubric,
            )
            for s in states
        ]
        ask_cfg = settings.rubric_judge or cfg
    stats = predict(scored, settings, cfg)  # the forecasts first: the turn judge scores them
    add_stats(stats, ask_into(asks + _turn_scores_asks(scored, settings), ask_cfg))
    if DIALOGUE_GROUPING[spec.name] == "trajectory":
        for start, episodes in groups:
            for episode in episodes:
                episode.judged["emotional_state"] = start.judged["emotional_state"]
    elif spec.name == "care":
        scores = []
        for state, replies in groups:
            rubric = with_criteria(state.judged["care_rubric"], settings.fixed_criteria)
            for r in replies:
                r.judged |= {"care_rubric": rubric, "care_scores": None}
                if rubric is not None:
                    *context, (_, reply) = r.example.history
                    scores.append(
                        (
                            r.judged,
                            "care_scores",
                            judge.care_scores_request(context, rubric, reply),
                            lambda text, rubric=rubric: judge.parse_care_scores(text, rubric),
                        )
                    )
        add_stats(stats, ask_into(scores, cfg))
    return stats


def judge_probes(
    spec: rewards.RewardSpec, settings: DialogueSettings, cfg: JudgeConfig, scenario: Scenario
) -> list[tuple[str, JudgeConfig, JudgeCall]]:
    """(config key, endpoint, call): one request of each kind a dialogue run of `spec` sends each
    of its endpoints, about `scenario`'s opening and a stand-in reply, for http_client.probe before
    the run."""
    opening = as_state(scenario)
    reply = "I am sorry to hear that. What happened?"
    history = list(opening.then("assistant", reply).history)
    probes = [
        (
            "dialogue.simulator" if settings.simulator else "judge",
            settings.simulator or cfg,
            user_turn_request(scenario.scenario, history, 1, settings.max_turns),
        )
    ]
    if spec.name == "care":
        probes.append(
            (
                "dialogue.rubric_judge" if settings.rubric_judge else "judge",
                settings.rubric_judge or cfg,
                judge.care_rubric_request(list(opening.history)),
            )
        )
        rubric = {
            name: {"weight": 1 / 3, "criteria": ["one point", "another point"]}
            for name in judge.CARE_DIMENSIONS
        }
        probes.append(("judge", cfg, judge.care_scores_request(history[:-1], rubric, reply)))
        return probes
    probes.append(
        (
            "dialogue.predictor" if settings.predictor else "judge",
            settings.predictor or cfg,
            predictor_request(history[:-1], reply, None),
        )
    )
    forecast = "Needs: to be heard\nAppraisal: it is hard\nEmotion: a little calmer"
    probes.append(
        (
            "judge",
            cfg,
            turn_scores_request(history[:-1], "", reply, settings.lookahead, forecast, None),
        )
    )
    if DIALOGUE_GROUPING[spec.name] == "trajectory":
        probes.append(
            ("judge", cfg, emotional_state_request(scenario.scenario, scenario.initial_prompt))
        )
    return probes


def with_criteria(rubric: dict | None, criteria: dict[str, list[str]] | None) -> dict | None:
    """A generated rubric with each dimension's criteria replaced by `criteria`'s (its weights
    kept); the rubric itself without `criteria` or a rubric."""
    if rubric is None or criteria is None:
        return rubric
    return {name: dimension | {"criteria": criteria[name]} for name, dimension in rubric.items()}


def ask_into(asks: list[tuple[dict, str, JudgeCall, Callable]], cfg: JudgeConfig) -> dict:
    """http_client.ask the calls at once, storing each parsed answer as target[key]."""
    if not asks:
        return {}
    values, stats = http_client.ask([(call, parse) for _, _, call, parse in asks], cfg)
    for (target, key, _, _), value in zip(asks, values):
        target[key] = value
    return add_stats({}, stats)


# trained under the update's context, the sampler's log-probs kept
def _sample(turn: PolicyTurn) -> Sample:
    return Sample(turn.train_prompt or turn.prompt, turn.completion, turn.logp, turn.truncated)


def _turn_group(state: State, replies: list[PolicyTurn]) -> Group:  # K replies at one state
    return Group(state, [[_sample(r)] for r in replies], [turn_rollout(state, r) for r in replies])


def sample_dialogue_groups(policy, tok, items: list, cfg, seed: int, counts: dict) -> list[Group]:
    """grpo.py's step 1 in a dialogue run (`cfg`: its GRPOConfig): K candidate replies at each state
    (a turn reward), or K episodes played from each seed (a trajectory reward; an episode's samples
    are its assistant turns). The simulator's calls are added to `counts`."""
    states = [as_state(item) for item in items]
    k = cfg.rollout.group_size
    respond = local_policy(policy, tok, cfg.rollout, cfg.dialogue)
    if DIALOGUE_GROUPING[cfg.reward.name] == "turn":
        replies = respond([policy_messages(s, cfg.dialogue) for s in states], k, seed)
        return [_turn_group(s, r) for s, r in zip(states, replies)]
    episodes, simulated = play(
        respond,
        [s for s in states for _ in range(k)],
        cfg.dialogue,
        cfg.dialogue.simulator or cfg.judge,
        1,
        seed,
    )
    add_stats(counts, simulated)
    members = [episodes[g * k : (g + 1) * k] for g in range(len(states))]
    return [
        Group(
            s,
            [[_sample(t.candidates[0]) for t in e.turns] for e in m],
            [episode_rollout(e) for e in m],
        )
        for s, m in zip(states, members)
    ]


def played_slots(policy, tok, slots: list[Slot], cfg, seed: int, counts: dict) -> list[Slot]:
    """Before step 1 of a dialogue run with a turn reward: one episode from each slot's seed, K
    candidate replies drawn at each state (the episode goes on with the first). Each state becomes a
    slot whose first group is those K. The simulator's calls are added to `counts`."""
    respond = local_policy(policy, tok, cfg.rollout, cfg.dialogue)
    episodes, simulated = play(
        respond,
        [as_state(s.example) for s in slots],
        cfg.dialogue,
        cfg.dialogue.simulator or cfg.judge,
        cfg.rollout.group_size,
        seed,
    )
    add_stats(counts, simulated)
    return [
        Slot(
            slot.index * cfg.dialogue.max_turns + k,
            turn.state,
            slot.segment,
            group=_turn_group(turn.state, turn.candidates),
        )
        for slot, episode in zip(slots, episodes)
        for k, turn in enumerate(episode.turns)
    ]


class DialogueSampler(Sampler):
    """Dialogue rollouts (rollout.py's interface; the sampler of dialogue/rl.py's runs, `cfg` its
    DialogueConfig): `play` turns the update's slots into the ones sampled, `sample` draws groups
    (sample_dialogue_groups), `judge` asks the dialogue judges (judge_groups)."""

    def __init__(self, policy, tok, cfg):
        self.policy, self.tok, self.cfg = policy, tok, cfg

    def play(self, slots: list[Slot], seed: int, counts: dict) -> list[Slot]:
        """A turn reward's slots played into one per state (played_slots); a trajectory reward's
        as they are. Either way a slot stays on the rank that holds it: it may hold a state played
        there."""
        if DIALOGUE_GROUPING[self.cfg.reward.name] != "turn":
            return slots
        return played_slots(self.policy, self.tok, slots, self.cfg, seed, counts)

    def sample(self, items: list, update: int, seed: int, counts: dict) -> list[Group]:
        return sample_dialogue_groups(self.policy, self.tok, items, self.cfg, seed, counts)

    def judge(self, groups: list[Group]) -> dict:
        return judge_groups(
            [(g.example, g.rollouts) for g in groups],
            self.cfg.reward,
            self.cfg.dialogue,
            self.cfg.judge,
        )


def scenario_segments(cfg, scenarios: list[Scenario]) -> list[Segment]:
    """grpo.train's `segments_for` of a dialogue run: the scenario seeds as one segment."""
    return [Segment("scenarios", scenarios)]


def play_slots(sampler, slots: list[Slot], seed: int, counts: dict) -> list[Slot]:
    """grpo.collect_groups' `play` of a dialogue run: the run's sampler's DialogueSampler.play."""
    return sampler.play(slots, seed, counts)


def dialogue_sampler(cfg, policy, tok, ranks, out_dir) -> DialogueSampler | GatheredSampler:
    """grpo.train's `sampler_for` of a dialogue run: a DialogueSampler, a sharded policy gathered
    whole for it."""
    sampler = DialogueSampler(policy, tok, cfg)
    return GatheredSampler(sampler, policy) if is_sharded(policy) else sampler
