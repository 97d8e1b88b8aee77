"""Every reward against values computed by hand (the arithmetic is written out in each test)."""

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

import judge
from data import DataError, Example, Turn
from http_client import JudgeConfig
from rewards import (
    REWARDS,
    RewardSpec,
    Rollout,
    care,
    check_reward_data,
    clue,
    correctness,
    emollm,
    emollm_turn,
    evidence_format,
    iu_g,
    judge_rollouts,
    r_fmt,
    r_len,
    r_rep,
    r_win,
    repetition_ratio,
    score,
    social_r1,
    social_r1_reference_free,
)

REPO = Path(__file__).resolve().parents[1]

TURNS = [
    Turn("Ana", "I lost my job today."),
    Turn("Ben", "Oh no, what happened?"),
    Turn("Ana", "They said the company is closing."),
    Turn("Ben", "This turn is never shown."),
]


def example(task="meld_emotion", labels=("sadness",), target=2):
    return Example(id="x", task=task, turns=TURNS, target=target, labels=list(labels))


def rollout(completion, task="meld_emotion", labels=("sadness",), t_reason=100, **rest):
    return Rollout.from_completion(
        example(task, labels),
        completion,
        count_tokens=lambda _: t_reason,
        n_completion_tokens=t_reason + 5,
        **rest,
    )


# four blocks: a verified quote; no quote; a verified quote; a quote that is not in the conversation
BLOCKS = [
    "Ana opens with <evidence>I lost my job today</evidence>.",
    "Ben answers with concern.",
    "Her last turn adds <evidence>the company is closing</evidence>.",
    "She also says <evidence>they fired everyone</evidence>.",
]
COMPLETION = "<think>\n" + "\n\n".join(BLOCKS) + "\n</think>\n\nAnswer: sadness"


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


# ----------------------------------------------------------------------------- rollout and registry


def test_rollout_from_completion_parses_reasoning_blocks_and_answer():
    r = rollout(COMPLETION)
    assert r.blocks == BLOCKS
    assert r.reasoning == "\n\n".join(BLOCKS)
    assert r.answer == ["sadness"]
    assert rollout("no think close, Answer: sadness").answer is None


def test_registry_holds_every_reward_and_one_convention():
    # the built-in rewards (a reward of your own added beside them does not fail this)
    assert set(REWARDS) >= {
        "correctness",
        "accuracy_only",
        "evidence_format",
        "iu_g",
        "clue",
        "r_fmt",
        "r_len",
        "social_r1",
        "social_r1_reference_free",
        "emollm_turn",
        "emollm",
        "care",
        "care_generator",
    }
    r = rollout(COMPLETION, judged={"iu": [1, 1, 0, 1]})
    assert score(r, RewardSpec("clue", {"lambda_iu": 1.0})) == pytest.approx(1 + 1.0 * 1.0 * 2 / 4)
    assert REWARDS["accuracy_only"](r, {}) == 1.0
    assert clue.defaults == {"lambda_iu": 0.5, "budget": 150.0}


def test_unknown_reward_or_setting_is_an_error():
    r = rollout(COMPLETION, judged={"iu": [1, 1, 0, 1]})
    with pytest.raises(ValueError, match="unknown reward 'clu'.*clue"):
        score(r, RewardSpec("clu"))
    with pytest.raises(ValueError, match=r"'clue'.*\['lamda_iu'\].*lambda_iu"):
        clue(r, {"lamda_iu": 1.0})


# ----------------------------------------------------------------------------- CLUE


@pytest.mark.parametrize(
    "task,labels,answer,expected",
    [
        ("meld_emotion", ["sadness"], "sadness", 1.0),
        ("meld_emotion", ["sadness"], "Sadness", 1.0),
        ("meld_emotion", ["sadness"], "joy", 0.0),
        (
            "meld_emotion",
            ["sadness"],
            "joy, sadness",
            0.0,
        ),  # several labels on a single-label task: invalid
        ("meld_emotion", ["sadness"], "", 0.0),
        ("meld_emotion", ["sadness"], "happiness", 0.0),  # outside the label set
        ("ccu_emotion", ["Joy", "Trust"], "Joy, Trust", 1.0),
        ("ccu_emotion", ["Joy", "Trust"], "Joy, Anger", 0.5),  # F1 = 2*1 / (2 + 2)
        ("ccu_emotion", ["Joy", "Trust"], "Joy", 2 / 3),  # F1 = 2*1 / (1 + 2)
        ("ccu_emotion", ["Joy"], "Anger, Fear, Joy", 0.5),  # 2*1 / (3 + 1)
        ("ccu_emotion", ["Joy"], "Anger", 0.0),
    ],
)
def test_correctness(task, labels, answer, expected):
    r = rollout(f"reasoning</think>\nAnswer: {answer}", task, labels)
    assert correctness(r) == pytest.approx(expected)
    assert REWARDS["accuracy_only"](r) == pytest.approx(expected)


def test_correctness_of_a_missing_answer_line_is_zero():
    assert correctness(rollout("reasoning only, no think close")) == 0.0


def test_iu_g_counts_grounded_gains_over_max_of_blocks_and_effort():
    # g = [1 (quote verifies), 1 (no quote, grounded by block 1), 0 (verdict 0), 0 (quote fails)]
    r = rollout(COMPLETION, t_reason=100, judged={"iu": [1, 1, 0, 1]})
    assert iu_g(r) == pytest.approx(2 / 4)  # T/B = 100/150 < N = 4
    r = rollout(COMPLETION, t_reason=1200, judged={"iu": [1, 1, 0, 1]})
    assert iu_g(r) == pytest.approx(2 / 8)  # T/B = 1200/150 = 8 > N = 4
    assert iu_g(r, {"budget": 600.0}) == pytest.approx(2 / 4)  # T/B = 2 < 4


def test_iu_g_needs_a_verified_quote_at_or_before_the_block():
    blocks = [
        "A gain claimed before any evidence.",
        "<evidence>I lost my job today</evidence> grounds it.",
        "A later gain with no quote of its own.",
    ]
    r = rollout("\n\n".join(blocks) + "</think>\nAnswer: sadness", judged={"iu": [1, 1, 1]})
    assert iu_g(r) == pytest.approx(2 / 3)


def test_iu_g_is_zero_when_no_quote_verifies():
    blocks = [
        "<evidence>I lost my whole career today</evidence>",
        "<evidence>the shop is closing</evidence>",
        "<evidence>Ben: Oh no</evidence>",
        "no quote",
    ]  # paraphrase, paraphrase, speaker name
    r = rollout("\n\n".join(blocks) + "</think>\nAnswer: sadness", judged={"iu": [1, 1, 1, 1]})
    assert iu_g(r) == 0.0


def test_iu_g_does_not_accept_text_after_the_target():
    r = rollout(
        "<evidence>This turn is never shown</evidence></think>\nAnswer: sadness", judged={"iu": [1]}
    )
    assert iu_g(r) == 0.0


def test_iu_g_incomplete_feedback_is_none_and_no_reasoning_is_zero():
    assert iu_g(rollout(COMPLETION)) is None
    assert iu_g(rollout(COMPLETION, judged={"iu": None})) is None
    assert iu_g(rollout(COMPLETION, judged={"iu": [1, 1, 0]})) is None  # 3 verdicts for 4 blocks
    assert iu_g(rollout(COMPLETION, judged={"iu": [1, 1, 0, 2]})) is None
    assert iu_g(rollout("</think>\nAnswer: sadness")) == 0.0


def test_clue_combines_correctness_format_and_iu_g():
    r = rollout(COMPLETION, judged={"iu": [1, 1, 0, 1]})
    assert clue(r) == pytest.approx(1 + 0.5 * 1.0 * 0.5)  # c = 1, f = 1, IU_G = 2/4
    # a stray closer in block 2 adds no quotation: f = 3 closed / (3 open + 1 stray)
    stray = COMPLETION.replace("with concern.", "with concern.</evidence>")
    r = rollout(stray, judged={"iu": [1, 1, 0, 1]})
    assert evidence_format(r) == pytest.approx(3 / 4)
    assert clue(r) == pytest.approx(1 + 0.5 * 0.75 * 0.5)
    r = rollout(stray.replace("Answer: sadness", "Answer: joy"), judged={"iu": [1, 1, 0, 1]})
    assert clue(r, {"lambda_iu": 2.0}) == pytest.approx(0 + 2.0 * 0.75 * 0.5)
    assert clue(rollout(COMPLETION)) is None  # no judge answer: incomplete, never 0


def test_evidence_format_with_nested_tags():
    r = rollout("<evidence>I lost <evidence>my job</evidence></evidence></think>\nAnswer: sadness")
    assert evidence_format(r) == pytest.approx(1 / 3)  # 1 closed / (2 open + 1 stray)
    assert evidence_format(rollout("no tags</think>\nAnswer: sadness")) == 1.0


# ----------------------------------------------------------------------------- Social-R1


def test_repetition_ratio():
    assert repetition_ratio("a b c d a b c d") == pytest.approx(1 / 5)  # 5 four-grams, 4 distinct
    assert repetition_ratio("a b c d a b c d", n=2) == pytest.approx(3 / 7)  # 7 bigrams, 4 distinct
    # case and punctuation ignored
    assert repetition_ratio("A, b. C d a B c D!") == pytest.approx(1 / 5)
    assert repetition_ratio("好好好好好") == pytest.approx(1 / 2)  # 2 four-grams, 1 distinct
    assert repetition_ratio("one two three") == 0.0
    assert repetition_ratio("the cat sat on the mat and the dog sat on the rug") == 0.0


def test_r_rep_boundary_at_rho_threshold():
    assert r_rep(0.0) == 1.0
    assert r_rep(0.1) == 1.0
    assert r_rep(0.1 + 1e-9) == pytest.approx(1.0)
    assert r_rep(0.2) == pytest.approx(math.exp(-0.8))
    assert r_rep(0.6) == pytest.approx(math.exp(-4.0))
    assert r_rep(0.3, threshold=0.2, beta=2.0) == pytest.approx(math.exp(-0.2))


def test_r_win_boundaries_at_400_and_2500():
    assert r_win(400) == pytest.approx(0.5 * sigmoid(42))  # sigmoid(0) * sigmoid(2100 / 50)
    assert r_win(2500) == pytest.approx(sigmoid(42) * 0.5)
    assert r_win(400) == pytest.approx(0.5, abs=1e-12)
    assert r_win(1450) == pytest.approx(sigmoid(21) ** 2)
    assert r_win(350) == pytest.approx(1 / (1 + math.e) * sigmoid(43))
    assert r_win(2550) == pytest.approx(sigmoid(43) / (1 + math.e))
    assert r_win(0) == pytest.approx(sigmoid(-8) * sigmoid(50))
    assert r_win(100000) == pytest.approx(0.0, abs=1e-100)


def test_r_len_multiplies_repetition_and_window():
    plain = "Ana lost her job and the company is closing so she is sad"
    r = rollout(f"{plain}</think>\nAnswer: sadness", t_reason=1450)
    assert r_len(r) == pytest.approx(1.0 * sigmoid(21) ** 2)
    looped = "she is sad she is sad she is sad"  # 9 words: 6 four-grams, 3 distinct: rho = 1/2
    r = rollout(f"{looped}</think>\nAnswer: sadness", t_reason=400)
    assert r_len(r) == pytest.approx(math.exp(-8 * (1 / 2 - 0.1)) * 0.5 * sigmoid(42))
    assert r_len(
        r, {"ngram": 2, "len_min": 300}
    ) == pytest.approx(  # 8 bigrams, 3 distinct: rho = 5/8
        math.exp(-8 * (5 / 8 - 0.1)) * sigmoid(2) * sigmoid(42)
    )


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("reasoning</think>\nAnswer: sadness", 1.0),
        ("<think>reasoning</think>\n\nAnswer: sadness\n", 1.0),
        ("reasoning</think>\nAnswer: not a label", 1.0),  # label validity is R_out's part
        ("reasoning</think>\nsadness", 0.0),
        ("reasoning</think>\nAnswer: sadness\nbecause she lost her job", 0.0),
        ("a</think>b</think>\nAnswer: sadness", 0.0),
        ("</think>\nAnswer: sadness", 0.0),  # no reasoning
        ("reasoning\nAnswer: sadness", 0.0),  # never closed
    ],
)
def test_r_fmt(completion, expected):
    assert r_fmt(rollout(completion)) == expected


def test_social_r1_only_r_out_in_both_readings():
    """Table 2's "only R_out" row (docs/open-choices.md): ours keeps R_fmt and R_len, so a right
    answer after 150 reasoning tokens (under len_min 400) earns 2 sigmoid(-5) sigmoid(47), about
    0.013; with use_len 0 as well, R_out alone: w_o = 2. No judge verdict is needed in either."""
    completion = (
        "Ana lost her job and the company is closing so she is sad</think>\nAnswer: sadness"
    )
    only_out = {"use_struct": 0.0, "use_content": 0.0}
    r = rollout(completion, t_reason=150, step=0, total_steps=600, judged={})
    assert social_r1(r, only_out) == pytest.approx(2 * sigmoid(-5) * sigmoid(47))
    assert social_r1(r, only_out | {"use_len": 0.0}) == 2.0
    wrong = rollout(completion.replace("sadness", "joy"), t_reason=150, judged={})
    assert social_r1(wrong, only_out | {"use_len": 0.0}) == 0.0
    malformed = rollout(completion + "\nextra line", t_reason=150, judged={})
    assert social_r1(malformed, only_out | {"use_len": 0.0}) == 0.0  # R_fmt gates both readings


def test_social_r1_composite_with_time_dependent_weights():
    completion = (
        "Ana lost her job and the company is closing so she is sad</think>\nAnswer: sadness"
    )
    judged = {"sip_structure": 0.8, "sip_content": 0.6}
    r = rollout(completion, t_reason=1450, step=300, total_steps=600, judged=judged)
    # w_s = w_c = 1 + 1 * 300/600 = 1.5; R = 1 * (2 * 1 + 0.5 * (1.5 * 0.8 + 1.5 * 0.6)) * R_len
    assert social_r1(r) == pytest.approx((2 + 0.5 * 2.1) * sigmoid(21) ** 2)
    r = rollout(completion, t_reason=1450, step=0, total_steps=600, judged=judged)
    assert social_r1(r) == pytest.approx((2 + 0.5 * 1.4) * sigmoid(21) ** 2)
    r = rollout(completion, t_reason=1450, step=600, total_steps=600, judged=judged)
    assert social_r1(r, {"gamma": 3.0, "tau_process": 1.0, "w_out": 1.0}) == pytest.approx(
        (1 + 1.0 * (4 * 0.8 + 4 * 0.6)) * sigmoid(21) ** 2
    )
    wrong = rollout(
        completion.replace("sadness", "joy"), t_reason=1450, step=0, total_steps=600, judged=judged
    )
    assert social_r1(wrong) == pytest.approx((0 + 0.5 * 1.4) * sigmoid(21) ** 2)
    malformed = rollout(completion + "\nextra line", t_reason=1450, judged=judged)
    assert social_r1(malformed) == 0.0
    assert social_r1(rollout(completion, judged={"sip_structure": 0.8})) is None
    assert social_r1(rollout(completion, judged={"sip_structure": 0.8, "sip_content": 1.5})) is None
    # The reference-free variant: the same formula, R_content from the judge that sees no reference.
    free = rollout(
        completion,
        t_reason=1450,
        step=300,
        total_steps=600,
        judged={"sip_structure": 0.8, "sip_content_free": 0.6},
    )
    assert social_r1_reference_free(free) == pytest.approx((2 + 0.5 * 2.1) * sigmoid(21) ** 2)
    assert social_r1(free) is None and social_r1_reference_free(r) is None


def test_data_that_cannot_feed_the_reward_stops_the_run_with_one_line():
    with_reference = [
        dataclasses.replace(example(), id=f"ok{i}", meta={"reference": "Encoding: ..."})
        for i in range(3)
    ]
    without = [
        dataclasses.replace(example(), id=f"bare{i}", meta={"reference": "  "} if i else {})
        for i in range(7)
    ]
    check_reward_data(RewardSpec("social_r1"), with_reference)
    check_reward_data(RewardSpec("social_r1_reference_free"), without)  # needs no reference
    check_reward_data(RewardSpec("clue"), without)
    with pytest.raises(DataError) as error:
        check_reward_data(RewardSpec("social_r1"), with_reference + without)
    message = str(error.value)
    assert message == (
        "field 'meta.reference': reward social_r1 needs it in every example (the reference SIP "
        "analysis R_content is scored against; reward social_r1_reference_free needs none); 7 of "
        "10 lack it: bare0, bare1, bare2, bare3, bare4 and 2 more"
    )
    assert "\n" not in message
    # the trainer's batches are checked too
    with pytest.raises(DataError, match="1 of 1 lack it: x$"):
        judge_rollouts(
            [rollout(COMPLETION)],
            RewardSpec("social_r1"),
            JudgeConfig(base_url="http://127.0.0.1:9"),
        )


# ----------------------------------------------------------------------------- EmoLLM


def turn(cognitive=4, trace=3, lookahead=5, overthinking=0, state=None):
    judged = {
        "turn_scores": {
            "cognitive": cognitive,
            "trace": trace,
            "lookahead": lookahead,
            "overthinking": overthinking,
        }
    }
    return rollout(
        "reply</think>\nAnswer: sadness",
        judged=judged | ({} if state is None else {"emotional_state": state}),
    )


def test_emollm_turn_reward_from_the_four_judged_aspects():
    # (c-1)/4 + (t-1)/4 + (l-1)/4 - o/2
    assert emollm_turn(turn()) == pytest.approx(3 / 4 + 2 / 4 + 4 / 4 - 0)
    assert emollm_turn(turn(overthinking=1)) == pytest.approx(2.25 - 0.5)
    assert emollm_turn(turn(overthinking=2)) == pytest.approx(2.25 - 1)
    assert emollm_turn(turn(1, 1, 1, 2)) == pytest.approx(-1.0)
    assert emollm_turn(turn(5, 5, 5, 0)) == pytest.approx(3.0)
    cfg = {"l_cog": 2.0, "l_arg": 0.5, "l_rp": 0.0, "l_over": 3.0}
    assert emollm_turn(turn(5, 3, 1, 1), cfg) == pytest.approx(2 * 1 + 0.5 * 0.5 + 0 - 3 * 0.5)
    assert emollm_turn.defaults == {"l_cog": 1.0, "l_arg": 1.0, "l_rp": 1.0, "l_over": 1.0}


@pytest.mark.parametrize(
    "scores",
    [
        None,
        {},
        {"cognitive": 4, "trace": 3, "lookahead": 5},
        {"cognitive": 6, "trace": 3, "lookahead": 5, "overthinking": 0},
        {"cognitive": 4, "trace": 0, "lookahead": 5, "overthinking": 0},
        {"cognitive": 4, "trace": 3, "lookahead": 5, "overthinking": 3},
        {"cognitive": 4.5, "trace": 3, "lookahead": 5, "overthinking": 0},
        {"cognitive": True, "trace": 3, "lookahead": 5, "overthinking": 0},
        {"cognitive": 4, "trace": 3, "lookahead": 5, "overthinking": 0, "extra": 1},
    ],
)
def test_emollm_turn_missing_or_malformed_judgement_is_none(scores):
    assert emollm_turn(rollout("x</think>\nAnswer: joy", judged={"turn_scores": scores})) is None


def test_emollm_trajectory_sums_turns_and_adds_the_emotional_gain():
    # the last turn carries e_T, the user's reply to it
    turns = [turn(4, 3, 5, 0), turn(2, 5, 1, 2, state=5)]
    episode = rollout("transcript", judged={"emotional_state": 2}, turns=turns)
    r1, r2 = 3 / 4 + 2 / 4 + 4 / 4 - 0, 1 / 4 + 4 / 4 + 0 - 1
    assert emollm(episode) == pytest.approx(r1 + r2 + 1.0 * (5 - 2) / 4)
    assert emollm(episode, {"l_emo": 4.0}) == pytest.approx(r1 + r2 + 3)
    worse = rollout("x", judged={"emotional_state": 5}, turns=[turn(1, 1, 1, 0, state=1)])
    assert emollm(worse) == pytest.approx(0 - 1.0)
    assert emollm(rollout("x", turns=turns)) is None  # no initial state
    # no final state
    assert emollm(rollout("x", judged={"emotional_state": 2}, turns=[turn(), turn()])) is None
    assert (
        emollm(rollout("x", judged={"emotional_state": 2}, turns=[turns[0], turn(None, state=4)]))
        is None
    )
    assert emollm(rollout("x", judged={"emotional_state": 2})) is None  # no turns


# ----------------------------------------------------------------------------- CARE

RUBRIC = {
    "cognitive": {"weight": 0.5, "criteria": ["names the problem", "checks understanding"]},
    "affective": {"weight": 0.3, "criteria": ["validates", "warm tone", "no judgement"]},
    "proactive": {"weight": 0.2, "criteria": ["next step", "resources", "follow-up", "safety"]},
}
SCORES = {"cognitive": [5, 3], "affective": [4, 4, 1], "proactive": [0, 5, 5, 2]}


def care_rollout(rubric, scores):
    return rollout("x</think>\nAnswer: joy", judged={"care_rubric": rubric, "care_scores": scores})


def test_care_rubric_weighted_score():
    # 0.5 * (8/2)/5 + 0.3 * (9/3)/5 + 0.2 * (12/4)/5 = 0.4 + 0.18 + 0.12
    assert care(care_rollout(RUBRIC, SCORES)) == pytest.approx(0.70)
    top = {k: [5] * len(v["criteria"]) for k, v in RUBRIC.items()}
    assert care(care_rollout(RUBRIC, top)) == pytest.approx(1.0)
    rounded = {k: dict(v, weight=w) for (k, v), w in zip(RUBRIC.items(), (0.33, 0.33, 0.34))}
    assert care(care_rollout(rounded, SCORES)) == pytest.approx(
        0.33 * 0.8 + 0.33 * 0.6 + 0.34 * 0.6
    )
    # sums to 0.99: renormalized, not refused
    thirds = {k: dict(v, weight=0.33) for k, v in RUBRIC.items()}
    assert care(care_rollout(thirds, SCORES)) == pytest.approx((0.8 + 0.6 + 0.6) / 3)


def with_dimension(name, **change):
    return {k: (dict(v, **change) if k == name else v) for k, v in RUBRIC.items()}


@pytest.mark.parametrize(
    "rubric",
    [
        with_dimension("proactive", weight=0.1),  # weights sum to 0.9
        with_dimension("proactive", weight=0.3),  # 1.1
        with_dimension("cognitive", criteria=["only one"]),
        with_dimension("proactive", criteria=["a", "b", "c", "d", "e"]),
        with_dimension("affective", criteria=["validates", "", "no judgement"]),
        with_dimension("affective", weight=True),
        with_dimension("affective", weight="0.3"),
        {k: v for k, v in RUBRIC.items() if k != "proactive"},
        RUBRIC | {"spiritual": {"weight": 0.0, "criteria": ["a", "b"]}},
        {"cognitive": 0.5, "affective": 0.3, "proactive": 0.2},
        None,
    ],
)
def test_care_malformed_rubric_is_none(rubric):
    assert care(care_rollout(rubric, SCORES)) is None


@pytest.mark.parametrize(
    "scores",
    [
        SCORES | {"cognitive": [5]},  # one score for two criteria
        SCORES | {"cognitive": [5, 6]},
        SCORES | {"cognitive": [5, -1]},
        SCORES | {"cognitive": [5, 2.5]},
        {k: v for k, v in SCORES.items() if k != "affective"},
        None,
    ],
)
def test_care_malformed_scores_are_none(scores):
    assert care(care_rollout(RUBRIC, scores)) is None


def test_care_reads_the_rubric_as_the_judge_parser_does():
    # One check, one tolerance (judge.care_rubric): weights summing to
    # 0.999 are renormalized to thirds, criteria are stripped, and a rubric
    # the parser would reject (duplicate criteria) scores None here too.
    thirds = {k: dict(v, weight=0.333) for k, v in RUBRIC.items()}
    assert care(care_rollout(thirds, SCORES)) == pytest.approx((0.8 + 0.6 + 0.6) / 3)
    assert judge.parse_care_rubric(json.dumps(thirds))["cognitive"]["weight"] == pytest.approx(
        1 / 3
    )
    # sums to 0.98: outside CARE_WEIGHT_TOLERANCE (0.015)
    loose = with_dimension("proactive", weight=0.18)
    assert (
        care(care_rollout(loose, SCORES)) is None
        and judge.parse_care_rubric(json.dumps(loose)) is None
    )
    doubled = with_dimension("cognitive", criteria=["reframes", " reframes "])
    assert care(care_rollout(doubled, {**SCORES, "cognitive": [5, 5]})) is None
    assert judge.parse_care_rubric(json.dumps(doubled)) is None
    with pytest.raises(ValueError, match="unknown setting"):
        care(care_rollout(RUBRIC, SCORES), {"weight_tolerance": 0.1})


# ----------------------------------------------------------------------------- your own reward


def guide_code(heading: str | None = None) -> list[str]:
    """The Python blocks of docs/adding-a-reward.md's section `heading` (None: the text above the
    first section), in order."""
    text = (REPO / "docs" / "adding-a-reward.md").read_text(encoding="utf-8")
    section = text.split(f"## {heading}\n", 1)[1] if heading else text
    return re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], re.DOTALL)


def test_a_reward_of_your_own_is_one_function_and_one_config_line(tmp_path, monkeypatch):
    """The guide's first example, as the guide writes it, and its config line read through the
    config loader."""
    from dataclasses import dataclass, field

    import rewards
    from config import load_config

    monkeypatch.setattr(rewards, "REWARDS", dict(REWARDS))
    (code,) = guide_code()
    exec(code, dict(vars(rewards)))

    @dataclass
    class RunConfig:
        reward: RewardSpec = field(default_factory=RewardSpec)

    path = tmp_path / "run.yaml"
    path.write_text("reward: {name: quoted_blocks, params: {min_quotes: 2}}\n")
    spec = load_config(path, [], RunConfig).reward
    two_quotes = "<evidence>I lost my job today</evidence> and <evidence>Oh no</evidence>"
    r = rollout(f"{two_quotes}\n\n{BLOCKS[0]}\n\nno quote</think>\nAnswer: sadness")
    assert rewards.score(r, spec) == pytest.approx(1 / 3)  # only the first block has 2 quotes
    # default min_quotes = 1
    assert rewards.score(r, RewardSpec("quoted_blocks")) == pytest.approx(2 / 3)
    assert RewardSpec() == RewardSpec("clue", {})


def test_a_judge_backed_reward_written_as_the_guide_says_trains(
    tmp_path, assets, monkeypatch, capsys
):
    """docs/adding-a-reward.md's judge-backed example as written: its judge's prompt, builder and
    parser in judge.py's namespace, its line in JUDGES, its reward; two GRPO updates against a
    local judge server answering the prompt (a politeness from the reply's length) ask the judge
    and train groups; the same reward declaring a misspelled judge stops at start-up."""
    from helpers import read_jsonl, run_config

    import grpo
    import rewards
    from http_client import ask
    from judge_server import JudgeServer

    judge_code, entry, reward_code, offline_code = guide_code("Rewards that need a judge")
    namespace = dict(vars(judge))
    exec(judge_code, namespace)
    monkeypatch.setattr(judge, "JUDGES", judge.JUDGES | eval("{" + entry + "}", namespace))
    monkeypatch.setattr(rewards, "REWARDS", dict(REWARDS))
    exec(reward_code, dict(vars(rewards)))
    asked = []

    def politeness_judge(messages, params):
        assert messages[0]["content"] == namespace["POLITENESS_SYSTEM"]
        asked.append(messages[-1]["content"])
        return f"scripted | {1 + len(messages[-1]['content']) % 5}"

    with JudgeServer(politeness_judge).start() as server:
        overrides = {"reward.name": "polite_and_right", "updates": 2}
        grpo.main([str(run_config(tmp_path, assets, server.url, **overrides))])
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and asked
    assert sum(m["judge/calls"] for m in metrics) + 1 == len(asked)  # + the start-up probe
    assert all(m["judge/failures"] == m["judge/malformed"] == 0 for m in metrics)
    assert sum(m["tokens/trained"] for m in metrics) > 0  # groups trained, not masked

    # the guide's offline judge: a JudgeServer of a function, asked over HTTP in the judge's format
    offline = {}
    exec(offline_code, offline)
    with JudgeServer(offline["politeness_judge"]).start() as server:
        cfg = JudgeConfig(base_url=server.url, retries=0, timeout=5)
        values, _ = ask(
            [(namespace["politeness_request"]("Thank you!"), namespace["parse_politeness"])], cfg
        )
    assert values == [4]

    misspelled = reward_code.replace('judges=("politeness",)', 'judges=("politness",)')
    exec(misspelled.replace("polite_and_right", "polite_misspelled"), dict(vars(rewards)))
    config = run_config(tmp_path / "b", assets, server.url, **{"reward.name": "polite_misspelled"})
    with pytest.raises(SystemExit) as stop:
        grpo.main([str(config)])
    err = capsys.readouterr().err
    line = next(n for n, t in enumerate(config.read_text().splitlines(), 1) if "name:" in t)
    assert stop.value.code == 2 and err.startswith(
        f"error: {config}:{line}: 'reward.name': reward polite_misspelled declares the judge "
        "'politness', which judge.JUDGES does not hold (known: iu, "
    ), err


def test_a_reward_outside_rewards_py_runs_from_its_own_entry_point(tmp_path, assets):
    """docs/adding-a-reward.md's fork file as written, beside nothing of the repository's: its
    entry point registers the reward and runs grpo.py's trainer, one update, exit 0, the reward
    logged; grpo.py itself does not know the name (exit 2 at start-up, before any model loads)."""
    import os

    from helpers import read_jsonl, run_config

    (code,) = guide_code("A reward outside rewards.py")
    script = tmp_path / "my_rewards.py"
    script.write_text(code)
    # a short budget splits the group: some completions end early (EOS), some run to 6 tokens
    overrides = {"updates": 2, "reward.params": {"max_tokens": 5}}
    config = run_config(tmp_path, assets, "http://127.0.0.1:9/v1", **overrides)
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def run(*command):
        return subprocess.run(
            [sys.executable, *command, str(config), "reward.name=correct_and_brief"],
            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
        )  # fmt: skip

    done = run(str(script))
    assert done.returncode == 0, done.stderr
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["reward"] is not None for m in metrics)
    assert sum(m["tokens/trained"] for m in metrics) > 0, metrics
    refused = run(str(REPO / "grpo.py"))
    assert refused.returncode == 2 and "unknown reward 'correct_and_brief'" in refused.stderr


# ------------------------------------------------------------------------ judging a batch over HTTP

JUDGED_BLOCKS = [
    "Ana states <evidence>I lost my job today</evidence>, which signals sudden hardship and "
    "distress.",
    "Ben answers with concern.",
    "She repeats <evidence>the company is closing</evidence>, signals sudden hardship.",
    "She claims <evidence>they fired everyone</evidence> showing anger toward management.",
]


def test_judge_rollouts_fills_verdicts_from_a_real_server_and_feeds_clue():
    from http_client import JudgeConfig
    from judge_server import Faults, JudgeServer, rules_backend
    from rewards import judge_rollouts

    completion = "\n\n".join(JUDGED_BLOCKS) + "\n</think>\nAnswer: sadness"
    batch = [
        rollout(completion),
        rollout("</think>\nAnswer: sadness"),
        rollout(completion),
        rollout(completion),
    ]
    with JudgeServer(rules_backend, port=0).start() as server:
        cfg = JudgeConfig(base_url=server.url, retries=0, timeout=5)
        stats = judge_rollouts(batch[:2], RewardSpec("clue"), cfg)
    # no reasoning: no call
    assert stats["calls"] == 1 and stats["failures"] == 0 and stats["malformed"] == 0
    # rules backend by hand: block 1 quotes the conversation and adds 5 new content words -> GAIN;
    # block 2 has no quote; block 3 adds one new word; block 4's quote is not in the conversation
    assert batch[0].judged["iu"] == [1, 0, 0, 0]
    assert "iu" not in batch[1].judged
    # c = 1, f = 1, IU_G = 1 / max(4, 100/150)
    assert clue(batch[0]) == pytest.approx(1 + 0.5 * 1.0 * 1 / 4)
    assert clue(batch[1]) == pytest.approx(1.0)  # no reasoning: IU_G = 0
    with JudgeServer(rules_backend, port=0, faults=Faults(script=("503",))).start() as server:
        stats = judge_rollouts(
            batch[2:3], RewardSpec("clue"), JudgeConfig(base_url=server.url, retries=0, timeout=5)
        )
    assert stats["failures"] == 1 and batch[2].judged["iu"] is None and clue(batch[2]) is None
    with JudgeServer(rules_backend, port=0, faults=Faults(script=("malformed",))).start() as server:
        stats = judge_rollouts(
            batch[3:], RewardSpec("clue"), JudgeConfig(base_url=server.url, retries=0, timeout=5)
        )
    assert stats["failures"] == 0 and stats["malformed"] == 1 and clue(batch[3]) is None
    assert judge_rollouts(
        batch, RewardSpec("correctness"), JudgeConfig(base_url="http://127.0.0.1:9")
    ) == {
        # a reward without judges sends nothing
        "calls": 0,
        "retries": 0,
        "failures": 0,
        "malformed": 0,
    }


def test_judge_rollouts_asks_the_social_r1_judges_with_and_without_a_reference():
    from judge_server import JudgeServer

    seen = []

    def sip_backend(messages, params):
        seen.append(messages[-1]["content"])
        if "Encoding: <short assessment>" in messages[0]["content"]:
            return "Encoding: a | YES\nInterpretation: b | YES\nGoal: c | NO\nResponse: d | YES"
        return "Matches | 0.6"

    completion = (
        "Ana lost her job and the company is closing so she is sad</think>\nAnswer: sadness"
    )
    referenced = Rollout.from_completion(
        dataclasses.replace(example(), meta={"reference": "REF-ANALYSIS"}),
        completion,
        count_tokens=lambda _: 1450,
        n_completion_tokens=1460,
    )
    bare = rollout(completion, t_reason=1450)
    with JudgeServer(sip_backend, port=0).start() as server:
        cfg = JudgeConfig(base_url=server.url, retries=0, timeout=5)
        assert judge_rollouts([referenced], RewardSpec("social_r1"), cfg)["calls"] == 2
        # content, not structure
        assert sum("<reference>\nREF-ANALYSIS\n</reference>" in text for text in seen) == 1
        assert judge_rollouts([bare], RewardSpec("social_r1_reference_free"), cfg)["calls"] == 2
        assert not any("<reference>" in text for text in seen[2:])
    assert referenced.judged == {"sip_structure": 0.75, "sip_content": 0.6}
    assert bare.judged == {"sip_structure": 0.75, "sip_content_free": 0.6}
    # (2 + 0.5 * (0.75 + 0.6)) * R_len at step 0, both variants alike
    assert (
        social_r1(referenced)
        == social_r1_reference_free(bare)
        == pytest.approx((2 + 0.5 * 1.35) * sigmoid(21) ** 2)
    )
