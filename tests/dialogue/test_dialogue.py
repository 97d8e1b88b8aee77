"""dialogue/play.py and dialogue/rl.py, against the local judge server over real HTTP:
scenario seeds with located errors, the judges' parsers, episodes that end by the user or at the
turn limit, reasoning that never reaches the simulator, one generate call and one simulator batch
per turn, group shapes and advantages in both grouping modes, one CARE rubric per state, the
trajectory reward against a hand computation, a loss mask on assistant tokens only, a judge failing
mid-episode, the evaluation metrics (in-process and through a served policy), and whole runs of the
configs, one killed and resumed."""

import json
import math
import re
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (
    DEMO,
    assert_same_run,
    kill_after_checkpoint,
    read_jsonl,
)
from helpers import (
    DIALOGUE_WORDS as WORDS,
)
from helpers import grpo_checkpoint as write_checkpoint

import checkpoint as CK
import distributed as D
import grpo
import http_client
import judge
import model as M
from config import ConfigError, load_config
from data import DataError
from dialogue import evaluation as evaluate_dialogue
from dialogue import play as dialogue
from dialogue import rl as dialogue_rl
from dialogue.play import DialogueSettings, PolicyTurn, Scenario, State
from dialogue.rl import DialogueConfig
from http_client import JudgeConfig
from judge import CARE_RUBRIC_SYSTEM, RESPONSE_QUALITY_DIMENSIONS, RESPONSE_QUALITY_SYSTEM
from judge_server import ACTION, SCRIPTED_USER, Faults, JudgeServer, rules_backend
from tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
CPU = D.Ranks(0, 1, torch.device("cpu"))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dialogue") / "base", words=WORDS, hidden=16)


class Recorder:
    """A judge-server backend: the rules stand-in, every request kept; `fail(messages)` True answers
    HTTP 500."""

    def __init__(self, fail=lambda messages: False, answer=rules_backend):
        self.requests, self.fail, self.answer, self.lock = [], fail, answer, threading.Lock()

    def __call__(self, messages, params):
        with self.lock:
            self.requests.append(messages)
        if self.fail(messages):
            raise RuntimeError("injected judge failure")
        return self.answer(messages, params)

    def of(self, system: str) -> list[str]:
        """The user messages of the requests with this system prompt."""
        return [m[-1]["content"] for m in self.requests if m[0]["content"] == system]


@contextmanager
def serving(backend=rules_backend):
    with JudgeServer(backend).start() as server:
        yield JudgeConfig(base_url=server.url, retries=0, timeout=20, concurrency=8)


def section(text: str, tag: str) -> str:
    return re.search(rf"<{tag}>\n(.*?)\n</{tag}>", text, re.DOTALL).group(1)


STYLES = {
    # 3 comfort words: the scripted user thanks at once
    "kind": "I understand, I am so sorry, I hear you.",
    "slow": "I understand.",  # 1 comfort word a turn: thanks after the third
    "cold": "Noted.",
}  # never eased: the turn limit ends it


def scripted(style_of_row):
    """A policy stand-in: a reply in the style of its episode (decided at the first turn by the row
    index, kept later by the first assistant message) after private reasoning that must never reach
    the user."""
    calls = []

    def respond(chats, n, seed):
        calls.append(chats)
        out = []
        for i, chat in enumerate(chats):
            first = next((m["content"] for m in chat if m["role"] == "assistant"), None)
            turns = []
            for j in range(n):
                style = (
                    next(k for k, v in STYLES.items() if v == first)
                    if first
                    else style_of_row(i * n + j, chat)
                )
                text = f"<think>SECRET reasoning {len(chat)}</think>\n{STYLES[style]}"
                turns.append(
                    PolicyTurn(
                        [1], [2, 3], [0.0, 0.0], False, text, *dialogue.split_reply(text, False)
                    )
                )
            out.append(turns)
        return out

    respond.calls = calls
    return respond


def scenario(name: str) -> Scenario:
    return Scenario(
        name,
        f"Someone who is {name} about a deadline.",
        f"{name}: I feel overwhelmed by my deadline.",
    )


# ----------------------------------------------------------------------- scenario seeds and parsers


def test_scenarios_load_and_every_bad_line_is_located(tmp_path):
    good = {"id": "a", "scenario": "A student before exams.", "initial_prompt": "I cannot sleep."}
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(good | {"id": "b"}) + "\n")
    assert dialogue.load_scenarios(path) == [
        Scenario("a", "A student before exams.", "I cannot sleep."),
        Scenario("b", "A student before exams.", "I cannot sleep."),
    ]
    cases = [
        ({"id": "a", "scenario": "s"}, "field 'initial_prompt': missing"),
        (good | {"initial_prompt": 3}, "field 'initial_prompt': expected a string, got 3"),
        (
            good | {"mood": "low"},
            "field 'mood': unknown field (known: id, scenario, initial_prompt)",
        ),
        (good | {"scenario": "  "}, "field 'scenario': empty"),
        ([good], "expected a JSON object, got list"),
        (good, "field 'id': 'a' appears twice"),
    ]
    for bad, message in cases:
        path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(DataError) as error:
            dialogue.load_scenarios(path)
        assert str(error.value) == f"{path}:2: {message}"
    path.write_text(json.dumps(good) + '\n{"id": "b",\n')
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:2: not valid JSON"):
        dialogue.load_scenarios(path)
    path.write_text("\n")
    with pytest.raises(DataError, match="no scenarios"):
        dialogue.load_scenarios(path)


def test_parsers_take_exactly_their_format():
    good = (
        "cognitive: Grounded | 4\ntrace: All sections | 5\nlookahead: Plausible | "
        "3\noverthinking: None | 0"
    )
    assert judge.parse_turn_scores(good) == {
        "cognitive": 4,
        "trace": 5,
        "lookahead": 3,
        "overthinking": 0,
    }
    lines = good.splitlines()
    for answer in [
        good.replace("| 0", "| 3"),
        good.replace("| 4", "| 0"),
        "\n".join(lines[:3]),
        "\n".join([lines[1], lines[0], *lines[2:]]),
        good + "\nAll fine.",
        good.replace("| 5", "| 4.5"),
        '{"cognitive": 4, "trace": 5, "lookahead": 3, "overthinking": 0}',
    ]:
        assert judge.parse_turn_scores(answer) is None, answer
    assert judge.parse_emotional_state("Relieved after the advice | 4") == 4
    for answer in ["Calm | 0", "Calm | 6", "4", "Calm |", "Calm | 3.5", "Calm | 4\nCalm | 4"]:
        assert judge.parse_emotional_state(answer) is None, answer
    quality = (
        "sr_proxy: User still anxious | 0\nea: Warm and validating | 4\n"
        "fact_sensitive: Gives dosage advice | 1\nfa: No invented facts | 1"
    )
    assert judge.parse_turn_quality(quality) == {
        "sr_proxy": 0.0,
        "ea": 4.0,
        "fact_sensitive": 1.0,
        "fa": 1.0,
    }
    for answer in [
        quality.replace("| 4", "| 0"),
        quality.replace("| 0", "| 2"),
        quality.replace("Gives dosage advice | 1", "Gives dosage advice | 2"),
        "\n".join(quality.splitlines()[:3]),
        "\n".join(quality.splitlines()[i] for i in (0, 1, 3, 2)),
    ]:
        assert judge.parse_turn_quality(answer) is None, answer
    assert (
        judge.parse_user_turn("  I guess I could try that tonight.  ")
        == "I guess I could try that tonight."
    )
    for answer in [
        "",
        "   ",
        "Assistant: Here is a plan.",
        "Okay.\nUser: and then?",
        "<think>hmm</think> ok",
    ]:
        assert judge.parse_user_turn(answer) is None, answer
    assert judge.user_ends_dialogue("Thanks, that really helps.")
    assert judge.user_ends_dialogue("Okay, I\u2019m done.")
    assert not judge.user_ends_dialogue("I'm thankful you listened, but I still feel lost.")


def test_split_reply_never_lets_reasoning_into_the_reply():
    assert dialogue.split_reply("<think>plan</think>\n\nHello there.", False) == (
        "plan",
        "Hello there.",
    )
    # the template opened <think>
    assert dialogue.split_reply("plan</think>Hello.", True) == ("plan", "Hello.")
    assert dialogue.split_reply("<think>still planning, cut off", False) == (
        "still planning, cut off",
        "",
    )
    assert dialogue.split_reply("still planning, cut off", True) == ("still planning, cut off", "")
    assert dialogue.split_reply("Just a reply.", False) == ("", "Just a reply.")


def test_rules_backend_scripts_the_user_and_the_states():
    def ask(call):
        return rules_backend(call.messages, {})

    dialogue_so_far = [("user", "I feel overwhelmed."), ("assistant", "I understand. I am sorry.")]
    assert ask(judge.user_turn_request("s", dialogue_so_far, 1, 8)) == SCRIPTED_USER["eased"]
    assert (
        ask(
            judge.user_turn_request(
                "s",
                dialogue_so_far + [("user", "x"), ("assistant", "I hear you.")],
                # three comfort words in all
                2,
                8,
            )
        )
        == SCRIPTED_USER["ends"]
    )
    assert (
        ask(judge.user_turn_request("s", [("user", "x"), ("assistant", "Noted.")], 1, 8))
        == SCRIPTED_USER["not eased"]
    )
    states = [
        judge.parse_emotional_state(ask(judge.emotional_state_request("ctx", SCRIPTED_USER[k])))
        for k in ("ends", "eased", "not eased")
    ]
    assert states == [5, 3, 1] and judge.user_ends_dialogue(SCRIPTED_USER["ends"])
    trace = (
        "Facts: a deadline.\nNeeds: rest.\nAppraisal: too much.\nEmotion: worried.\nStrategy: "
        "calm.\nLookahead 1: calmer.\nLookahead 2: calmer.\nLookahead 3: calmer.\nChoice: keep."
    )
    eased = "Needs: a next step\nAppraisal: manageable\nEmotion: calmer"
    scores = judge.parse_turn_scores(
        ask(
            judge.turn_scores_request(
                [("user", "My deadline is tomorrow.")],
                trace,
                "Your deadline sounds hard.",
                2,
                eased,
                SCRIPTED_USER["ends"],
            )
        )
    )
    # a shared content word (deadline); all five sections; an
    # eased forecast that came true; repeated steps, beyond n
    assert scores == {"cognitive": 5, "trace": 5, "lookahead": 5, "overthinking": 2}
    wrong = judge.parse_turn_scores(
        ask(
            judge.turn_scores_request(
                [("user", "My deadline is tomorrow.")],
                trace,
                "Noted.",
                2,
                eased,
                SCRIPTED_USER["not eased"],
            )
        )
    )
    assert wrong["lookahead"] == 2  # the forecast eased, the user did not
    forecast = ask(judge.predictor_request(dialogue_so_far[:1], "I understand.", None))
    assert judge.parse_prediction(forecast) == eased
    strained = ask(judge.predictor_request(dialogue_so_far[:1], "Noted.", None))
    assert judge.parse_prediction(strained).endswith("Emotion: worried")
    onward = ask(judge.predictor_request(dialogue_so_far[:1], "Noted.", eased))
    assert judge.parse_prediction(onward) == eased


# ----------------------------------------------------------------------------- the role-play


def test_episodes_end_by_the_user_or_the_turn_limit_and_reasoning_never_reaches_the_simulator(
    monkeypatch,
):
    batches = []
    chat_many = http_client.chat_many
    monkeypatch.setattr(
        http_client,
        "chat_many",
        lambda calls, cfg: batches.append(len(calls)) or chat_many(calls, cfg),
    )
    respond = scripted(lambda row, chat: chat[0]["content"].split(":")[0])
    recorder = Recorder()
    starts = [dialogue.as_state(scenario(name)) for name in ("kind", "slow", "cold")]
    with serving(recorder) as cfg:
        episodes, stats = dialogue.play(respond, starts, DialogueSettings(max_turns=4), cfg)
    assert [(e.ended_by, len(e.turns)) for e in episodes] == [
        ("user", 1),
        ("user", 3),
        ("turn limit", 4),
    ]
    # one policy call per turn, live episodes only
    assert [len(chats) for chats in respond.calls] == [3, 2, 2, 1]
    assert batches == [3, 2, 2, 1] and stats["calls"] == 8  # one simulator batch per turn
    kind, slow, cold = episodes
    assert kind.state.history == (
        ("user", "kind: I feel overwhelmed by my deadline."),
        ("assistant", STYLES["kind"]),
        ("user", SCRIPTED_USER["ends"]),
    )
    assert [m for role, m in slow.state.history if role == "user"][1:] == [
        SCRIPTED_USER["eased"]
    ] * 2 + [SCRIPTED_USER["ends"]]
    assert [cold.follow_up(k) for k in range(4)] == [SCRIPTED_USER["not eased"]] * 4
    # the exact messages the simulator got: the visible dialogue so far, no reasoning
    simulated = recorder.of(judge.USER_SIMULATOR_SYSTEM)
    assert len(simulated) == 8 and not any("SECRET" in m or "<think>" in m for m in simulated)
    finals = {e.start.scenario.id: e.state.history for e in episodes}
    for message in simulated:
        name = section(message, "dialogue").split(":")[1].strip()
        shown = section(message, "dialogue")
        assert any(shown == judge.dialogue_text(list(finals[name][:n])) for n in range(2, 9, 2)), (
            shown
        )
    assert not any(
        "SECRET" in m["content"] for chats in respond.calls for chat in chats for m in chat
    )
    assert all(t.candidates[0].reasoning.startswith("SECRET") for e in episodes for t in e.turns)


def test_every_candidate_gets_its_own_reply_and_its_forecast_is_scored(monkeypatch):
    # EmoLLM H: at each turn the simulator answers each of the G candidates before the
    # turn rewards; the episode goes on with candidate 0. B.1: the predictor T, on its
    # own endpoint, forecasts n steps, s(k+1) = T(x, y, s(k)), and the turn judge scores
    # s(n) (R_RP); here the rules judge checks it against the candidate's own follow-up.
    respond = scripted(lambda row, chat: ("cold", "kind", "slow")[row % 3])
    settings = DialogueSettings(max_turns=2, lookahead=2)
    judges, predictor = Recorder(), Recorder()
    with serving(judges) as cfg, serving(predictor) as predictor_cfg:
        (episode,), stats = dialogue.play(
            respond, [dialogue.as_state(scenario("x"))], settings, cfg, candidates=3
        )
        first = episode.turns[0].candidates
        assert [c.follow_up for c in first] == [
            SCRIPTED_USER[k] for k in ("not eased", "ends", "eased")
        ]
        assert episode.state.history[1:3] == (
            ("assistant", STYLES["cold"]),
            ("user", SCRIPTED_USER["not eased"]),
        )
        # 3 candidates x 2 turns
        assert len(judges.of(judge.USER_SIMULATOR_SYSTEM)) == stats["calls"] == 6
        replies = [dialogue.turn_rollout(episode.turns[0].state, c) for c in first]
        settings.predictor = predictor_cfg
        dialogue.judge_groups(
            [(episode.turns[0].state, replies)],
            grpo.rewards.RewardSpec("emollm_turn"),
            settings,
            cfg,
        )
    asked = predictor.of(judge.PREDICTOR_SYSTEM)
    # n = 2 steps x 3 candidates, own URL
    assert len(asked) == 6 and not judges.of(judge.PREDICTOR_SYSTEM)
    assert sum("<previous>" in m for m in asked) == 3  # each second step goes on from its first
    scored = judges.of(judge.TURN_SCORES_SYSTEM)
    assert sorted(section(m, "follow_up") for m in scored) == sorted(c.follow_up for c in first)
    for r, c in zip(replies, first):
        eased = "calmer" if c.reply != STYLES["cold"] else "worried"
        assert r.judged["prediction"].endswith(f"Emotion: {eased}")
        # each forecast agrees with its own candidate's follow-up
        assert r.judged["turn_scores"]["lookahead"] == 5


def test_every_policy_turn_is_one_batched_generate_call(base, monkeypatch):
    calls = []
    generate = M.generate
    monkeypatch.setattr(
        M,
        "generate",
        lambda model, prompts, *a, **k: (
            calls.append(len(prompts)) or generate(model, prompts, *a, **k)
        ),
    )
    tok, policy = load_tokenizer(base), M.Qwen.from_pretrained(base, dtype="float32")
    sampling = grpo.RolloutSettings(max_new_tokens=6)
    settings = DialogueSettings(max_turns=3, arg_scaffold=True, lookahead=2)
    starts = [dialogue.as_state(scenario(name)) for name in ("a", "a", "b")]
    with serving() as cfg:
        episodes, _ = dialogue.play(
            dialogue.local_policy(policy, tok, sampling), starts, settings, cfg, 2, seed=3
        )
    live = [sum(len(e.turns) > t for e in episodes) for t in range(3)]
    # two candidates for each live episode, in one call per turn
    assert calls == [2 * n for n in live if n]
    for e in episodes:
        for turn in e.turns:
            assert len(turn.candidates) == 2
            # each sampled under the chat of the visible dialogue, scaffold first
            for c in turn.candidates:
                assert c.prompt == tok.chat_ids(dialogue.policy_messages(turn.state, settings))
                assert len(c.completion) == len(c.logp) <= 6
        assert e.state.history[1::2] == tuple(("assistant", t.candidates[0].reply) for t in e.turns)


def test_the_arg_scaffold_asks_for_n_lookahead_steps_and_for_none_at_zero():
    """EmoLLM's Figure 5 starts at n = 0: the config takes it, and the scaffold then asks for the
    appraisal and the strategy alone, no lookahead and no choice between strategies."""
    cfg = load_config(DEMO, ["dialogue.arg_scaffold=true", "dialogue.lookahead=0"], DialogueConfig)
    start = dialogue.as_state(Scenario("a", "A friend listens.", "I lost my job today."))
    [system, _] = dialogue.policy_messages(start, cfg.dialogue)
    assert cfg.dialogue.lookahead == 0 and "Lookahead" not in system["content"]
    assert "given all of the above.\nAfter </think>" in system["content"]
    settings = DialogueSettings(arg_scaffold=True, lookahead=3)
    [system, user] = dialogue.policy_messages(start, settings)
    lines = system["content"].splitlines()
    assert [line.split(":")[0] for line in lines[5:9]] == [
        "Strategy",
        "Lookahead 1",
        "Lookahead 2, 3, ...",
        "Choice",
    ]
    assert "at most 3 in all" in lines[7] and user == {
        "role": "user",
        "content": "I lost my job today.",
    }


def test_context_is_cut_at_turn_boundaries_for_sampling_and_for_the_update(base):
    # EmoLLM D.3: 2,048 tokens of dialogue context in generation, 896 in the update. Whole exchanges
    # go, oldest first; the system message and the latest user message stay; the update's rows use
    # their own (shorter) prompt, whose log-prob difference to the sampler's is grpo's logp_mismatch
    tok = load_tokenizer(base)
    history = [
        ("user", "I feel worried"),
        ("assistant", "I hear you"),
        ("user", "sorry"),
        ("assistant", "try one step"),
        ("user", "I understand the plan"),
    ]
    state = State(scenario("x"), tuple(history))
    settings = DialogueSettings(arg_scaffold=True)
    chat = dialogue.policy_messages(state, settings)
    # dropping 0, 1 or 2 exchanges
    size = [len(tok.chat_ids(chat[:1] + chat[1 + 2 * k :])) for k in range(3)]
    assert size[0] > size[1] > size[2]
    for limit, kept in (
        (None, 0),
        (size[0], 0),
        (size[0] - 1, 1),
        (size[1], 1),
        (size[2], 2),
        (1, 2),
    ):
        assert dialogue.fit_context(tok, chat, limit, None) == chat[:1] + chat[1 + 2 * kept :], (
            limit
        )
    settings.context_tokens, settings.update_context_tokens = size[1], size[2]
    policy = M.Qwen.from_pretrained(base, dtype="float32")
    ((turn,),) = dialogue.local_policy(
        policy, tok, grpo.RolloutSettings(max_new_tokens=3), settings
    )([chat], 1, 0)
    assert turn.prompt == tok.chat_ids(chat[:1] + chat[3:]) and len(turn.prompt) == size[1]
    assert (
        turn.train_prompt == tok.chat_ids(chat[:1] + chat[5:]) and len(turn.train_prompt) == size[2]
    )
    assert (
        dialogue._sample(turn).prompt == turn.train_prompt
        and dialogue._sample(turn).logp == turn.logp
    )


# ------------------------------------------------------------------------ dialogue/rl.py's runs


def demo_cfg(base, url, *overrides):
    return load_config(
        DEMO,
        [
            f"model.path={base}",
            f"judge.base_url={url}",
            "judge.retries=0",
            "rollout.max_new_tokens=8",
            *overrides,
        ],
        DialogueConfig,
    )


def slots_of(cfg, names):
    source = grpo.PromptSource([grpo.Segment("scenarios", [scenario(n) for n in names])])
    return source, [grpo.Slot(i, ex, seg) for i, (ex, seg) in enumerate(source.take(len(names)))]


# the demo config's loss.adv_std: population, sigma over 1/G as EmoLLM B.2 writes it
def hand_advantages(rewards):
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + 1e-6) for r in rewards]


def test_trajectory_groups_advantages_and_a_loss_mask_on_assistant_tokens_only(base):
    with serving() as judge_cfg:
        cfg = demo_cfg(base, judge_cfg.base_url, "rollout.group_size=3", "filtering.enabled=false")
        policy, tok = grpo.build_policy(cfg, CPU)
        source, slots = slots_of(cfg, ["p", "q"])
        groups, counts = grpo.collect_groups(
            dialogue.DialogueSampler(policy, tok, cfg),
            source,
            slots,
            cfg,
            0,
            CPU,
            dialogue.play_slots,
        )
    assert [g.example.id for g in groups] == ["p", "q"] and counts["calls"] > 0
    advantages = grpo.advantages_by_group(groups, cfg.loss)
    sequences = grpo.training_sequences(groups, advantages)
    rows = iter(sequences)
    for g, adv in zip(groups, advantages):
        assert len(g.samples) == len(g.rollouts) == len(g.rewards) == 3
        assert all(r is not None for r in g.rewards) and not g.masked
        assert adv == pytest.approx(hand_advantages(g.rewards), abs=1e-5)
        for member, rollout, a in zip(g.samples, g.rollouts, adv):
            # a sample per assistant turn of the episode
            assert len(member) == len(rollout.turns) >= 1
            for sample, turn in zip(member, rollout.turns):
                seq = next(rows)
                share = len(sample.completion) / sum(len(s.completion) for s in member)
                assert seq.advantage == a and seq.row_weight == share
                assert seq.ids == sample.prompt + sample.completion
                assert [seq.ids[t + 1] for t, on in enumerate(seq.mask) if on] == sample.completion
                # the prompt, every user turn in it, untrained
                assert not any(seq.mask[: len(sample.prompt) - 1])
                *context, (_, reply) = turn.example.history  # the dialogue this turn closed
                state = State(g.example.scenario, tuple(context))
                assert sample.prompt == tok.chat_ids(dialogue.policy_messages(state, cfg.dialogue))
                kept = len(sample.completion) - (not sample.truncated)  # EOS off
                assert turn.completion == tok.decode(sample.completion[:kept])
                assert reply == dialogue.split_reply(turn.completion, False)[1]
    assert next(rows, None) is None


def test_an_episode_counts_once_in_the_loss_whatever_its_turns():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1], [-0.2, -0.4, -0.9]])
    old = logp + torch.tensor([[0.1, -0.1, 0.0], [0.0, 0.2, -0.3], [0.05, 0.0, 0.1]])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
    # rows 0 and 1: one episode of 2 + 3 tokens; row 2: another of 3 tokens
    adv = torch.tensor([1.0, 1.0, -0.5])
    loss, _ = grpo.grpo_loss(
        logp, old, None, adv, mask, beta=0.0, row_weight=torch.tensor([2 / 5, 3 / 5, 1.0])
    )

    def term(b, t):
        rho = math.exp(logp[b, t] - old[b, t])
        return -min(rho * adv[b].item(), min(max(rho, 0.8), 1.2) * adv[b].item())

    first = (term(0, 0) + term(0, 1) + term(1, 0) + term(1, 1) + term(1, 2)) / 5
    second = (term(2, 0) + term(2, 1) + term(2, 2)) / 3
    assert loss.item() == pytest.approx((first + second) / 2, rel=1e-6)


def test_turn_groups_share_one_rubric_per_state(base, monkeypatch):
    recorder = Recorder()
    with serving(recorder) as judge_cfg:
        cfg = demo_cfg(
            base,
            judge_cfg.base_url,
            "reward.name=care",
            "rollout.group_size=3",
            "dialogue.max_turns=3",
        )
        policy, tok = grpo.build_policy(cfg, CPU)
        source, slots = slots_of(cfg, ["p", "q"])
        groups, counts = grpo.collect_groups(
            dialogue.DialogueSampler(policy, tok, cfg),
            source,
            slots,
            cfg,
            0,
            CPU,
            dialogue.play_slots,
        )
    played = recorder.of(judge.USER_SIMULATOR_SYSTEM)
    # a group per state, a simulated reply per candidate
    assert len(groups) >= 4 and len(played) == 3 * len(groups)
    shown = sorted(section(m, "dialogue") for m in played)
    assert shown == sorted(
        judge.dialogue_text(list(r.example.history)) for g in groups for r in g.rollouts
    )
    assert all(r.judged["follow_up"] is not None for g in groups for r in g.rollouts)
    asked = [section(m, "dialogue") for m in recorder.of(CARE_RUBRIC_SYSTEM)]
    assert sorted(asked) == sorted(judge.dialogue_text(list(g.example.history)) for g in groups)
    assert len(recorder.of(judge.CARE_SCORES_SYSTEM)) == 3 * len(groups)
    for g in groups:
        rubric = g.example.judged["care_rubric"]
        assert rubric is not None and all(r.judged["care_rubric"] is rubric for r in g.rollouts)
        assert len(g.samples) == 3 and all(len(member) == 1 for member in g.samples)
        prompt = tok.chat_ids(dialogue.policy_messages(g.example, cfg.dialogue))
        assert all(member[0].prompt == prompt for member in g.samples)
        if not g.masked:
            advantages = grpo.advantages_by_group([g], cfg.loss)[0]
            assert advantages == pytest.approx(hand_advantages(g.rewards), abs=1e-5)
    # identical replies: each state is resampled twice, then replaced by another seed's opening,
    # then masked; a resample asks for no new rubric, a replacement (a new state) for its own
    monkeypatch.setattr(
        dialogue,
        "local_policy",
        lambda model, tok, sampling, settings=None: scripted(lambda row, chat: "cold"),
    )
    recorder = Recorder()
    with serving(recorder) as judge_cfg:
        cfg = load_config(
            DEMO,
            [
                f"judge.base_url={judge_cfg.base_url}",
                "reward.name=care",
                "rollout.group_size=3",
                "dialogue.max_turns=2",
                "filtering.resamples=2",
                "filtering.replacements=1",
            ],
            DialogueConfig,
        )
        source, _ = slots_of(cfg, ["p", "q"])
        groups, counts = grpo.collect_groups(
            dialogue.DialogueSampler(None, None, cfg),
            source,
            [grpo.Slot(0, scenario("p"), 0)],
            cfg,
            0,
            CPU,
            dialogue.play_slots,
        )
    assert (counts["resampled"], counts["replaced"], counts["masked"]) == (4, 2, 2) and len(
        groups
    ) == 2
    assert (
        len(recorder.of(CARE_RUBRIC_SYSTEM)) == 2 + 2
        and len(recorder.of(judge.CARE_SCORES_SYSTEM)) == 2 * 4 * 3
    )


def scripted_judge(messages, params):
    """The rules user, and fixed scores: e_0 = 2 (the opening, in the scenario), e_T = 4; at
    assistant turn t, cognitive min(5, t + 1), trace 6 - t, lookahead 3, overthinking t mod 3."""
    system, message = messages[0]["content"], messages[-1]["content"]
    if system == judge.EMOTIONAL_STATE_SYSTEM:
        return "opening | 2" if section(message, "context").startswith("Someone") else "final | 4"
    if system == judge.TURN_SCORES_SYSTEM:
        t = section(message, "dialogue").count("Assistant: ") + 1
        return (
            f"cognitive: c | {min(5, t + 1)}\ntrace: t | {6 - t}\nlookahead: l | 3\noverthinking: "
            f"o | {t % 3}"
        )
    return rules_backend(messages, params)


def test_trajectory_reward_against_a_hand_computation(monkeypatch):
    params = {"l_cog": 2.0, "l_arg": 1.0, "l_rp": 0.5, "l_over": 1.0, "l_emo": 3.0}
    respond = scripted(lambda row, chat: ("slow", "kind")[row])
    monkeypatch.setattr(
        dialogue, "local_policy", lambda model, tok, sampling, settings=None: respond
    )

    def r(t):
        return 2.0 * min(4, t) / 4 + 1.0 * (5 - t) / 4 + 0.5 * 2 / 4 - 1.0 * (t % 3) / 2

    with serving(scripted_judge) as judge_cfg:
        cfg = load_config(
            DEMO,
            [
                f"judge.base_url={judge_cfg.base_url}",
                f"reward.params={json.dumps(params)}",
                "dialogue.max_turns=5",
            ],
            DialogueConfig,
        )
        groups = dialogue.sample_dialogue_groups(None, None, [scenario("p")], cfg, 0, {})
        grpo.score_groups(groups, cfg.reward, dialogue.DialogueSampler(None, None, cfg).judge)
    slow, kind = groups[0].rollouts
    # slow: thanked after the third reply; kind: after the first
    assert [len(slow.turns), len(kind.turns)] == [3, 1]
    assert groups[0].rewards == pytest.approx(
        [r(1) + r(2) + r(3) + 3.0 * (4 - 2) / 4, r(1) + 3.0 * (4 - 2) / 4]
    )
    assert groups[0].parts["R_emo"] == pytest.approx([0.5, 0.5])
    assert groups[0].parts["R_cog"] == pytest.approx([(1 / 4 + 2 / 4 + 3 / 4) / 3, 1 / 4])


def test_a_judge_failing_mid_episode_makes_the_reward_none_not_a_crash(monkeypatch):
    # different episodes: different rewards
    respond = scripted(lambda row, chat: ("cold", "slow")[row])
    monkeypatch.setattr(
        dialogue, "local_policy", lambda model, tok, sampling, settings=None: respond
    )
    failed = []

    # the simulator's answer to some episode's second reply, the first time only
    def second_turn_once(messages):
        hit = (
            messages[0]["content"] == judge.USER_SIMULATOR_SYSTEM
            and messages[-1]["content"].count("Assistant: ") == 2
            and not failed
        )
        failed.extend([1] if hit else [])
        return hit

    for filtering, expect_masked in (("false", True), ("true", False)):
        failed.clear()
        with serving(Recorder(second_turn_once)) as judge_cfg:
            cfg = load_config(
                DEMO,
                [
                    f"judge.base_url={judge_cfg.base_url}",
                    "judge.retries=0",
                    f"filtering.enabled={filtering}",
                    "filtering.resamples=1",
                    "dialogue.max_turns=3",
                ],
                DialogueConfig,
            )
            source, slots = slots_of(cfg, ["p"])
            groups, counts = grpo.collect_groups(
                dialogue.DialogueSampler(None, None, cfg),
                source,
                slots,
                cfg,
                0,
                CPU,
                dialogue.play_slots,
            )
        assert failed and counts["failures"] >= 1 and groups[0].masked is expect_masked
        if expect_masked:  # the broken-off episode ends on the assistant's reply, without a reward
            broken = [r for r in groups[0].rollouts if r.example.history[-1][0] == "assistant"]
            assert len(broken) == 1 and len(broken[0].turns) == 2
            assert groups[0].rewards[groups[0].rollouts.index(broken[0])] is None
            assert sum(v is None for v in groups[0].rewards) == 1
        else:
            assert counts["resampled"] == 1 and None not in groups[0].rewards
    with serving(Recorder(lambda m: m[0]["content"] == judge.TURN_SCORES_SYSTEM)) as judge_cfg:
        cfg = load_config(
            DEMO,
            [f"judge.base_url={judge_cfg.base_url}", "judge.retries=0", "filtering.enabled=false"],
            DialogueConfig,
        )
        groups = dialogue.sample_dialogue_groups(None, None, [scenario("p")], cfg, 0, {})
        grpo.score_groups(groups, cfg.reward, dialogue.DialogueSampler(None, None, cfg).judge)
    assert groups[0].rewards == [None, None]


# ----------------------------------------------------------------------------- evaluation


def test_dialogue_metrics_by_hand():
    def turn(sr, ea, fa, care, fact_sensitive=1, tokens=10, empathy=None):
        dimensions = None if empathy is None else dict.fromkeys(RESPONSE_QUALITY_DIMENSIONS, 3.0)
        return {
            "sr_proxy": sr,
            "ea": ea,
            "fact_sensitive": fact_sensitive,
            "fa": fa,
            "care": care,
            "output_tokens": tokens,
            "dimensions": dimensions and dimensions | {"empathy": empathy},
        }

    episodes = [
        {
            "n_turns": 3,
            "e_0": 2,
            "e_T": 5,
            "turns": [
                turn(0, 3, 1, 0.5, tokens=40, empathy=5),
                turn(1, 4, 1, 0.7, empathy=2),
                turn(0, 5, 0, None),
            ],
        },
        {
            "n_turns": 2,
            "e_0": 1,
            "e_T": 2,
            "turns": [turn(0, 2, 0, 0.1, tokens=None), turn(0, None, None, 0.3)],
        },
        {
            "n_turns": 2,
            "e_0": None,
            "e_T": 3,
            # two turns that are not fact-sensitive: FA leaves out their fa, 0 and 1
            "turns": [turn(None, 1, 0, None, 0), turn(1, 3, 1, 0.9, 0)],
        },
    ]
    m = evaluate_dialogue.dialogue_metrics(episodes)
    # the third episode's success turn cannot be told
    assert m["success_rate"] == pytest.approx(100 * 1 / 2)
    assert m["avg_turns"] == 2 and m["emotional_state"] == pytest.approx((5 + 2 + 3) / 3)
    assert m["eg_per_turn"] == pytest.approx(((5 - 2) / 3 + (2 - 1) / 2) / 2)
    # FA over the fact-sensitive turns with a verdict: 1, 1, 0, 0 -> 2 of 4 (every judged turn: 3
    # of 6)
    assert m["ea"] == pytest.approx((3 + 4 + 5 + 2 + 1 + 3) / 6) and m["fa"] == pytest.approx(
        100 * 2 / 4
    )
    assert m["fa_turns"] == 4
    assert m["care"] == pytest.approx((0.5 + 0.7 + 0.1 + 0.3 + 0.9) / 5)
    assert m["unjudged"] == {"success": 1, "e_0": 1, "e_T": 0, "turns": 1, "care": 2}
    # output tokens over the six turns counted (one unknown): 40 and five of 10
    assert m["output_tokens"] == pytest.approx((40 + 5 * 10) / 6)
    # Figure 6's dimensions over the two turns rated
    assert m["response_quality"]["empathy"] == 3.5 and m["response_quality"]["fluency"] == 3
    assert evaluate_dialogue.dialogue_metrics([])["success_rate"] is None
    # no fact-sensitive turn: FA is None, not 0 or 100
    none = evaluate_dialogue.dialogue_metrics([{**episodes[2], "e_0": 2}])
    assert (none["fa"], none["fa_turns"], none["ea"]) == (None, 0, 2)


def test_evaluation_runs_judges_resumes_and_writes_its_table(base, tmp_path, capsys):
    with serving() as judge_cfg:
        config = tmp_path / "eval.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "output_dir": str(tmp_path / "out"),
                    "scenarios": [str(REPO / "configs" / "dialogue_demo_scenarios.jsonl")],
                    "checkpoint": str(base),
                    "device": "cpu",
                    "runs": 2,
                    "dialogue": {"max_turns": 3},
                    "sampling": {"max_new_tokens": 8},
                    "judge": {"base_url": judge_cfg.base_url, "retries": 0},
                }
            )
        )
        evaluate_dialogue.main([str(config)])
        episodes = read_jsonl(tmp_path / "out" / "episodes.jsonl")
        summary = json.loads((tmp_path / "out" / "eval.json").read_text())
        # resumes: both runs are there, nothing is played again
        evaluate_dialogue.main([str(config)])
        assert read_jsonl(tmp_path / "out" / "episodes.jsonl") == episodes
    assert len(episodes) == 2 * 6 and {e["run"] for e in episodes} == {0, 1}
    state = {SCRIPTED_USER["ends"]: 5, SCRIPTED_USER["eased"]: 3, SCRIPTED_USER["not eased"]: 1}
    # the rules stand-in as the oracle: each judgement was asked about the right text
    for e in episodes:
        assert e["e_T"] == state[e["turns"][-1]["follow_up"]] and e["n_turns"] == len(e["turns"])
        assert e["ended_by"] == (
            "user" if e["turns"][-1]["follow_up"] == SCRIPTED_USER["ends"] else "turn limit"
        )
        for t in e["turns"]:
            assert t["sr_proxy"] == (t["follow_up"] == SCRIPTED_USER["ends"]) and t["fa"] == (
                t["reply"] != ""
            )
            # the rules stand-in: fact-sensitive when the reply gives advice (an ACTION word)
            assert t["fact_sensitive"] == any(
                w in ACTION for w in re.findall(r"[a-z]+", t["reply"].lower())
            )
            assert 0 <= t["care"] <= 1
    runs = [
        evaluate_dialogue.dialogue_metrics([e for e in episodes if e["run"] == r]) for r in (0, 1)
    ]
    assert summary["metrics"]["ea"]["mean"] == pytest.approx((runs[0]["ea"] + runs[1]["ea"]) / 2)
    assert (
        "| Model | SR (%) | AT | ES | EG/Turn | EA | FA (%) | CARE | Tokens | Tokens/conv. |"
        in (tmp_path / "out" / "table.md").read_text()
    )
    # in-process, a turn's output tokens are its sampled ids: at most max_new_tokens
    counts = [t["output_tokens"] for e in episodes for t in e["turns"]]
    assert all(0 <= n <= 8 for n in counts) and max(counts) > 0
    config.write_text(config.read_text().replace("max_turns: 3", "max_turns: 4"))
    with pytest.raises(SystemExit) as stop:
        evaluate_dialogue.main([str(config)])
    assert stop.value.code == 2 and "holds episodes of another" in capsys.readouterr().err
    # an older version's episodes (no fact_sensitive): one line, the file kept, nothing played
    config.write_text(config.read_text().replace("max_turns: 4", "max_turns: 3"))
    old = [
        e | {"turns": [{k: v for k, v in t.items() if k != "fact_sensitive"} for t in e["turns"]]}
        for e in episodes
    ]
    text = "".join(json.dumps(e) + "\n" for e in old)
    (tmp_path / "out" / "episodes.jsonl").write_text(text)
    with pytest.raises(SystemExit) as stop:
        evaluate_dialogue.main([str(config)])
    error = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and error == (
        f"error: {tmp_path / 'out' / 'episodes.jsonl'}:1: not an episode record of this "
        "dialogue/evaluation.py (another file, or an older version's); use a new output_dir"
    )
    assert (tmp_path / "out" / "episodes.jsonl").read_text() == text


def test_a_served_policy_is_evaluated_through_its_endpoint(tmp_path, capsys):
    # a served policy: private reasoning, then a reply with three comfort words
    def policy(messages, params):
        assert params["max_tokens"] == 64 and messages[-1]["role"] == "user"
        return f"<think>SECRET plan</think>\n{STYLES['kind']}"

    with serving() as judge_cfg, serving(policy) as policy_cfg:
        config = {
            "output_dir": str(tmp_path / "out"),
            "scenarios": [str(REPO / "configs" / "dialogue_demo_scenarios.jsonl")],
            "endpoint": {"base_url": policy_cfg.base_url, "retries": 0},
            "runs": 1,
            "care": False,
            "sampling": {"max_new_tokens": 64},
            "judge": {"base_url": judge_cfg.base_url, "retries": 0},
        }
        summary = evaluate_dialogue.evaluate_dialogues(load_config_dict(tmp_path, config))
    episodes = read_jsonl(tmp_path / "out" / "episodes.jsonl")
    # thanked after the first reply
    assert all(e["n_turns"] == 1 and e["ended_by"] == "user" for e in episodes)
    assert all(e["turns"][0]["reply"] == STYLES["kind"] for e in episodes)
    assert all(e["turns"][0]["reasoning"] == "SECRET plan" for e in episodes)
    assert (
        summary["metrics"]["success_rate"]["mean"] == 100
        and summary["metrics"]["avg_turns"]["mean"] == 1
    )
    assert summary["metrics"]["care"]["mean"] is None  # not asked
    # the policy fails: one line
    with serving() as judge_cfg, serving(Recorder(lambda m: True)) as policy_cfg:
        config |= {
            "output_dir": str(tmp_path / "out2"),
            "endpoint": {"base_url": policy_cfg.base_url, "retries": 0},
            "judge": {"base_url": judge_cfg.base_url, "retries": 0},
        }
        path = tmp_path / "eval2.yaml"
        path.write_text(yaml.safe_dump(config))
        with pytest.raises(SystemExit) as stop:
            evaluate_dialogue.main([str(path)])
    assert stop.value.code == 2 and "6 requests to the policy at" in capsys.readouterr().err


def test_each_test_set_has_its_row_and_the_row_over_all_follows(tmp_path):
    """EmoLLM reports each test set on its own: two scenario files, a served policy that comforts
    in the first file's scenarios (thanked after turn 1: SR 100, AT 1) and is cold in the second's
    (never eased: SR 0 over max_turns 2); the last row pools them (SR 2 of 6)."""
    lines = (REPO / "configs" / "dialogue_demo_scenarios.jsonl").read_text().splitlines()
    kind, cold = tmp_path / "kind.jsonl", tmp_path / "cold.jsonl"
    kind.write_text("\n".join(lines[:2]) + "\n")
    cold.write_text("\n".join(lines[2:]) + "\n")
    openings = {json.loads(line)["initial_prompt"] for line in lines[:2]}

    def policy(messages, params):
        first = next(m["content"] for m in messages if m["role"] == "user")
        return STYLES["kind"] if first in openings else STYLES["cold"]

    with serving() as judge_cfg, serving(policy) as policy_cfg:
        config = {
            "output_dir": str(tmp_path / "out"),
            "name": "m",
            "scenarios": [str(kind), str(cold)],
            "endpoint": {"base_url": policy_cfg.base_url, "retries": 0},
            "runs": 1,
            "care": False,
            "dialogue": {"max_turns": 2},
            "sampling": {"max_new_tokens": 64},
            "judge": {"base_url": judge_cfg.base_url, "retries": 0, "model": "rules"},
        }
        summary = evaluate_dialogue.evaluate_dialogues(load_config_dict(tmp_path, config))
    title = (tmp_path / "out" / "table.md").read_text().splitlines()[0]
    assert title.endswith("(the RULES STAND-IN: scripted scores and user, not a judge)"), title
    sets = summary["test_sets"]
    assert {n: s["n_scenarios"] for n, s in sets.items()} == {"kind": 2, "cold": 4}
    assert sets["kind"]["metrics"]["success_rate"]["mean"] == 100
    assert sets["kind"]["metrics"]["avg_turns"]["mean"] == 1
    assert sets["cold"]["metrics"]["success_rate"]["mean"] == 0
    assert summary["metrics"]["success_rate"]["mean"] == pytest.approx(100 * 2 / 6)
    rows = (tmp_path / "out" / "table.md").read_text().splitlines()[4:]
    assert [r.split(" | ")[0:2] for r in rows] == [
        ["| m: kind", "100.0"],
        ["| m: cold", "0.0"],
        ["| m: all", "33.3"],
    ]
    # one id in two files: one line before anything is played
    cold.write_text(lines[0] + "\n")
    with pytest.raises(ConfigError, match="'deadline' is in .*cold.jsonl and in an earlier file"):
        evaluate_dialogue.evaluate_dialogues(load_config_dict(tmp_path, config))


def test_a_served_policys_output_tokens_are_counted_with_the_given_tokenizer(base, tmp_path):
    """EmoLLM's Table 7 for a served policy: its reply "I understand sorry you" is four words of
    the tiny vocabulary, so four tokens a turn; without `tokenizer` the count is unknown."""

    def policy(messages, params):
        return "I understand sorry you"

    found = {}
    with serving() as judge_cfg, serving(policy) as policy_cfg:
        for name, tokenizer in (("counted", str(base)), ("unknown", None)):
            config = {
                "output_dir": str(tmp_path / name),
                "scenarios": [str(REPO / "configs" / "dialogue_demo_scenarios.jsonl")],
                "endpoint": {"base_url": policy_cfg.base_url, "retries": 0},
                "tokenizer": tokenizer,
                "runs": 1,
                "care": False,
                "dialogue": {"max_turns": 2},
                "sampling": {"max_new_tokens": 64},
                "judge": {"base_url": judge_cfg.base_url, "retries": 0},
            }
            found[name] = evaluate_dialogue.evaluate_dialogues(load_config_dict(tmp_path, config))
    turns = [t for e in read_jsonl(tmp_path / "counted" / "episodes.jsonl") for t in e["turns"]]
    assert turns and all(t["output_tokens"] == 4 for t in turns)
    assert found["counted"]["metrics"]["output_tokens"]["mean"] == 4
    assert found["unknown"]["metrics"]["output_tokens"]["mean"] is None
    assert (tmp_path / "unknown" / "table.md").read_text().splitlines()[4].endswith(" – | – |")
    # per conversation (Table 7): four tokens times the episode's assistant turns, averaged by hand
    episodes = read_jsonl(tmp_path / "counted" / "episodes.jsonl")
    per_episode = [4 * len(e["turns"]) for e in episodes]
    assert found["counted"]["metrics"]["conversation_tokens"]["mean"] == pytest.approx(
        sum(per_episode) / len(per_episode)
    )


def response_quality_run(tmp_path, judge_backend) -> dict:
    """eval.json of one run of the demo scenarios, two turns each, `response_quality: true`, a
    served policy answering "Noted. Sorry." and `judge_backend` as the judge."""
    with serving(judge_backend) as judge_cfg, serving(lambda m, p: "Noted. Sorry.") as policy:
        config = {
            "output_dir": str(tmp_path / "out"),
            "name": "m",
            "scenarios": [str(REPO / "configs" / "dialogue_demo_scenarios.jsonl")],
            "endpoint": {"base_url": policy.base_url, "retries": 0},
            "runs": 1,
            "care": False,
            "response_quality": True,
            "dialogue": {"max_turns": 2},
            "sampling": {"max_new_tokens": 64},
            "judge": {"base_url": judge_cfg.base_url, "retries": 0},
        }
        return evaluate_dialogue.evaluate_dialogues(load_config_dict(tmp_path, config))


def test_response_quality_rates_each_reply_on_figure_6s_six_dimensions(tmp_path):
    """response_quality: true asks one more judge call per turn; a scripted judge rates a reply
    of two words 2 on every dimension and fluency 4, so eval.json and the second table hold
    exactly those (one run: no SD)."""

    def judge_backend(messages, params):
        if messages[0]["content"] == RESPONSE_QUALITY_SYSTEM:
            scores = dict.fromkeys(RESPONSE_QUALITY_DIMENSIONS, 2) | {"fluency": 4}
            return "\n".join(f"{d}: scripted | {v}" for d, v in scores.items())
        return rules_backend(messages, params)

    summary = response_quality_run(tmp_path, judge_backend)
    found = {d: stat["mean"] for d, stat in summary["response_quality"].items()}
    assert found == dict.fromkeys(RESPONSE_QUALITY_DIMENSIONS, 2.0) | {"fluency": 4.0}
    table = (tmp_path / "out" / "table.md").read_text().splitlines()
    assert table[-1] == "| m | 2.00 | 2.00 | 2.00 | 2.00 | 4.00 | 2.00 |"
    # a served judge: the title names it, and nothing says stand-in
    assert table[0] == (
        "### Dialogue evaluation, mean ± SD over 1 runs: judge judge, user simulator judge"
    )


def test_a_rating_off_the_scale_is_counted_in_unjudged_and_said(tmp_path, capsys):
    """A judge that rates a reply's empathy 7 on the 1-5 scale of every other turn: those turns'
    ratings are left out of Figure 6's means, counted in each run's unjudged.response_quality and
    said in one line (was: exit 0, the means over the rest, the dropped ratings counted nowhere)."""
    asked = []

    def judge_backend(messages, params):
        if messages[0]["content"] == RESPONSE_QUALITY_SYSTEM:
            asked.append(1)
            scores = dict.fromkeys(RESPONSE_QUALITY_DIMENSIONS, 3)
            scores["empathy"] = 7 if len(asked) % 2 else 4
            return "\n".join(f"{d}: scripted | {v}" for d, v in scores.items())
        return rules_backend(messages, params)

    summary = response_quality_run(tmp_path, judge_backend)
    off_scale = (len(asked) + 1) // 2
    assert len(asked) > 1 and summary["runs"][0]["unjudged"]["response_quality"] == off_scale
    assert summary["response_quality"]["empathy"]["mean"] == 4.0
    assert (
        "response_quality: turns without a usable rating per run (no answer, or one off the 1-5 "
        f"scale or out of format), left out of Figure 6's means: [{off_scale}]"
    ) in capsys.readouterr().out


def test_a_dialogue_evaluation_of_a_missing_checkpoint_writes_nothing(tmp_path, capsys):
    """The policy is loaded before output_dir gets a file: a missing checkpoint is one line, and no
    config.yaml is left to refuse the corrected command (was: config.yaml written first)."""
    config = {
        "output_dir": str(tmp_path / "out"),
        "scenarios": [str(REPO / "configs" / "dialogue_demo_scenarios.jsonl")],
        "checkpoint": str(tmp_path / "not-trained-yet"),
    }
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as stop:
        evaluate_dialogue.main([str(path)])
    error = capsys.readouterr().err
    assert stop.value.code == 2 and error.count("\n") == 1 and "not-trained-yet" in error, error
    assert not (tmp_path / "out").exists()


def load_config_dict(tmp_path, raw: dict):
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path, [], evaluate_dialogue.DialogueEvalConfig)


# --------------------------------------------------------------------------- configs and whole runs


def test_paper_configs_carry_the_papers_settings():
    emollm = load_config(REPO / "configs" / "emollm_qwen3_8b.yaml", [], DialogueConfig)
    assert (emollm.lora.rank, emollm.lora.alpha, emollm.lora.dropout) == (16, 32, 0.1)
    assert (emollm.optim.lr, emollm.rollout.group_size, emollm.loss.beta, emollm.updates) == (
        1e-5,
        4,
        0.01,
        50,
    )
    ro = emollm.rollout
    assert (ro.temperature, ro.top_p, ro.top_k, ro.repetition_penalty, ro.max_new_tokens) == (
        0.8,
        0.9,
        50,
        1.1,
        256,
    )
    assert (
        emollm.dialogue.max_turns == 8
        and emollm.dialogue.lookahead == 3
        and emollm.reward.name == "emollm"
    )
    assert grpo.lr_at(1, emollm.optim, 50) == grpo.lr_at(50, emollm.optim, 50) == 1e-5
    care = load_config(REPO / "configs" / "care_qwen2_5_7b.yaml", [], DialogueConfig)
    assert care.model.path.endswith("Qwen2.5-7B-Instruct") and care.reward.name == "care"
    assert (
        care.rollout.prompts_per_update,
        care.optim.lr,
        care.updates,
        care.rollout.group_size,
    ) == (8, 2e-6, 100, 6)
    assert care.rollout.temperature == 1.0 and care.dialogue.max_turns == 8


@pytest.mark.slow
@pytest.mark.parametrize("reward", ["emollm", "care"])
def test_demo_config_trains_against_the_local_server(base, tmp_path, reward):
    with serving() as judge_cfg:
        dialogue_rl.main(
            [
                str(DEMO),
                f"model.path={base}",
                f"output_dir={tmp_path / 'run'}",
                f"judge.base_url={judge_cfg.base_url}",
                "updates=2",
                "rollout.max_new_tokens=8",
                f"reward.name={reward}",
            ]
        )
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["judge/calls"] > 0 for m in metrics)
    if reward == "emollm":
        assert {"rewards/R_emo/mean", "rewards/R_cog/mean", "rewards/R_overthink/mean"} <= set(
            metrics[0]
        )
    records = read_jsonl(tmp_path / "run" / "completions.jsonl")
    assert records and all(r["completion"].startswith("User: ") for r in records) == (
        reward == "emollm"
    )
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("reward", ["emollm", "care"])
def test_a_killed_dialogue_run_resumes_to_the_same_result(tmp_path, reward):
    """Both grouping modes: SIGKILL once the first checkpoint is written, then `resume: auto` ends
    with the adapter, metrics and completions of a run never stopped. Two of the six seeds an
    update, so a scenario cursor not restored would replay the first two; LoRA dropout draws from
    the torch generator the checkpoint restores; the policy can write U+2028, a line break to
    str.splitlines inside a completions.jsonl record."""
    base = write_checkpoint(tmp_path / "base", words=[*WORDS, "\u2028"], hidden=16)
    with JudgeServer(rules_backend, faults=Faults(latency=0.02)).start() as server:

        def argv(name):
            return [
                str(DEMO),
                f"model.path={base}",
                f"output_dir={tmp_path / name}",
                f"judge.base_url={server.url}",
                f"reward.name={reward}",
                "updates=3",
                "save_every=1",
                "rollout.max_new_tokens=8",
                "lora.dropout=0.1",
            ]

        dialogue_rl.main(argv("straight"))
        kill_after_checkpoint(
            argv("killed"), tmp_path / "killed", "ckpt-000001", ("-m", "dialogue.rl")
        )
        assert CK.latest_checkpoint(tmp_path / "killed").name in (
            "ckpt-000001",
            "ckpt-000002",
            "ckpt-000003",
        )
        dialogue_rl.main(argv("killed"))  # resume: auto
    assert_same_run(tmp_path / "straight", tmp_path / "killed")


def test_bad_dialogue_inputs_are_one_line(base, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"id": "a", "scenario": "s", "initial_prompt": "p"}\n{"id": "b", "scenario": "s"}\n'
    )
    cases = [
        (
            ["reward.name=clue"],
            "'reward.name': a dialogue run trains emollm, emollm_turn, care, not clue "
            "(single-turn rewards run with grpo.py)",
        ),
        ([f"train_data=[{bad}]"], f"{bad}:2: field 'initial_prompt': missing"),
        (["dialogue.lookahead=-1"], "'dialogue.lookahead' must be >= 0, got -1"),
    ]
    for overrides, message in cases:
        with pytest.raises(SystemExit) as stop:
            dialogue_rl.main(
                [str(DEMO), f"model.path={base}", f"output_dir={tmp_path / 'run'}", *overrides]
            )
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and len(err.splitlines()) == 1 and message in err, err
    plain = tmp_path / "plain.yaml"
    plain.write_text(
        yaml.safe_dump(
            {
                "output_dir": str(tmp_path / "r"),
                "train_data": [str(bad)],
                "model": {"path": str(base)},
                "reward": {"name": "emollm"},
            }
        )
    )
    with pytest.raises(SystemExit):
        grpo.main([str(plain)])
    assert (
        "'reward.name': emollm trains on role-played dialogues: run `python -m dialogue.rl`"
        in capsys.readouterr().err
    )


def test_the_documented_emollm_and_care_evaluations_name_the_papers_judges():
    """EmoLLM judges and role-plays the user with gpt-5-mini (D.3); CARE scores EQBench3 with
    DeepSeek-V4-Pro, Gemini-2.5-Pro and GPT-5.5: every documented dialogue evaluation, and every
    EQBench3 evaluation of CARE's rows, names such a judge with its key's variable, not the rules
    stand-in or an unnamed local server."""
    from helpers import documented_config_commands, load_documented_config

    care_judges = {"deepseek-v4-pro", "gemini-2.5-pro", "gpt-5.5"}
    seen = {"emollm": 0, "care": 0}
    for page, script, config, overrides in documented_config_commands():
        cfg = load_documented_config(script, config, overrides)
        where = f"{page.name}: {config} {' '.join(overrides)}"
        if script == "dialogue/evaluation.py":
            simulator = cfg.dialogue.simulator or cfg.judge
            assert (cfg.judge.model, simulator.model) == ("gpt-5-mini",) * 2, where
            assert cfg.judge.api_key_env, where
            seen["emollm"] += 1
        elif page.name == "paper-configs.md" and "eval_benchmarks" in config:
            if any(o.startswith("judge.") for o in overrides):
                assert cfg.judge.model in care_judges and cfg.judge.api_key_env, where
                seen["care"] += 1
    assert seen["emollm"] >= 3 and seen["care"] >= 2, seen


def test_best_of_n_goes_on_with_the_reply_the_turn_judge_rates_highest():
    """EmoLLM's Best-of-N (E.2): three replies a turn (cold, kind, slow), each answered by the
    simulator and rated by the turn judge (the rules stand-in: EA = 1 + comfort words, so 1, 4 and
    2); the kind one goes on, put first, and the scripted user thanks at once. The policy's first
    reply (best_of 1) is the cold one, which never eases the user."""
    styles = ["cold", "kind", "slow"]
    respond = scripted(lambda row, chat: styles[row % 3])
    with serving() as judge_cfg:
        cfg = evaluate_dialogue.DialogueEvalConfig("out", [], judge=judge_cfg, best_of=3)
        starts = [dialogue.as_state(scenario("kind"))]
        settings = DialogueSettings(max_turns=2)
        (best,), _ = dialogue.play(
            respond, starts, settings, judge_cfg, 3, 0, evaluate_dialogue.best_of_n(cfg)
        )
        (first,), _ = dialogue.play(respond, starts, settings, judge_cfg, 3, 0)
    assert [c.reply for c in best.turns[0].candidates] == [
        STYLES[s] for s in ("kind", "cold", "slow")
    ]
    assert (best.ended_by, len(best.turns)) == ("user", 1)
    assert first.turns[0].candidates[0].reply == STYLES["cold"]
    assert (first.ended_by, len(first.turns)) == ("turn limit", 2)
