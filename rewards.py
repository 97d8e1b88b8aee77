"""Every reward as a plain function behind one registry: task correctness, IU_G and the CLUE
combined reward, and the Social-R1, EmoLLM and CARE reward families.

One calling convention: a reward is `fn(rollout, cfg) -> float | None`, registered in REWARDS under
its function name by the `@reward(**defaults)` decorator, which also declares the parts of a
composite reward that a trainer logs beside it (`parts=`). `cfg` holds the reward's settings;
missing ones take the defaults given to the decorator and unknown ones are an error, so a typo in a
config never silently falls back to a default. None means the feedback is incomplete (a judge answer
the reward needs is missing or malformed): the trainer resamples the group, it never reads None as
0.

Judge-backed rewards read already-parsed judge outputs from `rollout.judged`; `judge_rollouts` fills
it for a batch of single-turn rollouts through judge.py, in one concurrent batch of HTTP calls
(dialogue/play.py's `judge_groups` does the same for role-played dialogues: EmoLLM and CARE). A
trainer calls `check_reward_data(spec, examples)` at start-up: data a reward cannot use (Social-R1
without reference analyses) stops the run there, with one line, instead of masking every group.

The judges a reward declares (`@reward(judges=...)`; judge.JUDGES builds and parses each), and
the parsed answer each leaves in `rollout.judged[name]`:

| judge | parsed answer | declared by |
|---|---|---|
| `iu` | list[int]: J_j per reasoning block, 1 = GAIN, 0 = NO_GAIN | iu_g, clue |
| `sip_structure` | float in [0, 1]: SIP stages | social_r1, social_r1_reference_free |
| `sip_content` | float in [0, 1]: SIP content against the reference analysis | social_r1 |
| `sip_content_free` | float in [0, 1]: SIP content, no reference | social_r1_reference_free |
| `prediction` | str: the predictor's forecast s^(n) after the reply | emollm_turn, emollm |
| `turn_scores` | {cognitive, trace, lookahead: 1-5; overthinking: 0-2} | emollm, emollm_turn |
| `emotional_state` | int 1-5: the user's state (an episode's: at its opening) | emollm |
| `care_rubric` | {cognitive / affective / proactive: {"weight", "criteria"}} | care |
| `care_scores` | {cognitive / affective / proactive: [int 0-5 per criterion]} | care |
| `care_chosen_scores`, `care_rejected_scores` | a pair's care_scores | care_generator |

(tests/test_judge.py holds this table to the rewards' declarations.)
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import data
import http_client
import judge
import verifier
from config import config_error, excerpt


@dataclass
class Rollout:
    """One sampled completion and everything a reward may look at. For a role-played dialogue
    (dialogue/play.py) `example` is its dialogue.State, and an episode's `turns` hold one Rollout
    per assistant turn, in order."""

    example: data.Example
    completion: str
    reasoning: str  # the text before the final </think>
    blocks: list[str]  # r_1..r_N
    answer: list[str] | None  # parsed labels; None = invalid answer
    n_reasoning_tokens: int  # T
    n_completion_tokens: int
    step: int = 0  # t, the current update counted from 1 (1..T_total); 0 outside training
    total_steps: int = 1  # T_total, the number of updates of the run
    judged: dict[str, Any] = field(default_factory=dict)
    turns: list[Rollout] = field(default_factory=list)

    @classmethod
    def from_completion(
        cls,
        example: data.Example,
        completion: str,
        *,
        count_tokens: Callable[[str], int],
        n_completion_tokens: int,
        **rest,
    ) -> Rollout:
        """A rollout with its reasoning, blocks and answer parsed from the completion text
        (data.py's rules; a multiple-choice answer is checked against the example's own options)
        and T = count_tokens(reasoning)."""
        reasoning, _ = data.split_completion(completion)
        return cls(
            example,
            completion,
            reasoning,
            data.split_blocks(reasoning),
            data.parse_answer(completion, example),
            count_tokens(reasoning),
            n_completion_tokens,
            **rest,
        )


@dataclass
class RewardSpec:
    """The reward a run optimizes, as a config names it: `reward: {name: clue, params: {lambda_iu:
    0.5}}`."""

    name: str = "clue"
    params: dict[str, float] = field(default_factory=dict)


RewardFn = Callable[[Rollout, dict], float | None]
REWARDS: dict[str, RewardFn] = {}


PartFn = Callable[[Rollout, dict], float | None]


def reward(parts: dict[str, PartFn] | None = None, judges: tuple[str, ...] = (), **defaults: float):
    """Register the decorated `fn(rollout, cfg)` in REWARDS under its name, with its settings'
    defaults. `parts`: the components of a composite reward that a trainer logs beside it (metrics
    `rewards/<part>/mean`, completions.jsonl), each `part(rollout, params)` with the run's reward
    settings. `judges`: the names (judge.JUDGES) of the judges whose parsed answers it reads from
    `rollout.judged`; a run asks exactly these (judges_needed)."""

    def register(fn):
        @functools.wraps(fn)
        def with_settings(rollout: Rollout, cfg: dict | None = None) -> float | None:
            unknown = sorted(set(cfg or {}) - set(defaults))
            if unknown:
                raise ValueError(
                    f"reward '{fn.__name__}': unknown setting(s) {unknown} "
                    f"(known: {', '.join(sorted(defaults)) or 'none'})"
                )
            return fn(rollout, defaults | (cfg or {}))

        with_settings.defaults = defaults
        with_settings.parts = parts or {}
        with_settings.judges = tuple(judges)
        REWARDS[fn.__name__] = with_settings
        return with_settings

    return register


def computed_by(name: str) -> PartFn:
    """A part computed by the registered reward `name`, given the settings of the run's reward that
    it accepts."""
    fn = REWARDS[name]
    return lambda rollout, params: fn(
        rollout, {k: v for k, v in params.items() if k in fn.defaults}
    )


def judge_output(key: str) -> PartFn:
    """A part that is a judge's parsed output, `rollout.judged[key]`."""
    return lambda rollout, params: rollout.judged.get(key)


def score(rollout: Rollout, spec: RewardSpec) -> float | None:
    """The reward a config names, with the config's settings."""
    if spec.name not in REWARDS:
        raise ValueError(f"unknown reward '{spec.name}' (known: {', '.join(sorted(REWARDS))})")
    return REWARDS[spec.name](rollout, spec.params)


def _number_in(value: Any, low: float, high: float) -> bool:
    """A judge output that is a real number (not a bool) within [low, high]."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


# ----------------------------------------------------------------------------- CLUE


def task_correctness(predicted: list[str] | None, gold: list[str], multi_label: bool) -> float:
    """c: single-label 1 if Y_hat = Y* else 0; multi-label the F1 of the two label sets; invalid
    0."""
    if predicted is None:
        return 0.0
    p = set(predicted)
    g = set(gold)
    if not multi_label:
        return float(p == g)
    return 2 * len(p & g) / (len(p) + len(g)) if p or g else 1.0


def iu_g_score(
    verdicts: list[int], quotes_verified: list[list[bool]], n_reasoning_tokens: int, budget: float
) -> float:
    """IU_G = sum_j g_j / max(N, T / B), g_j = J_j * [every quotation in r_j verifies] *
    [a verified quotation exists in r_1..r_j]; 0 without reasoning blocks."""
    if not verdicts:
        return 0.0
    grounded = False
    gained = 0
    for verdict, verified in zip(verdicts, quotes_verified, strict=True):
        grounded = grounded or any(verified)
        gained += bool(verdict) and all(verified) and grounded
    return gained / max(len(verdicts), n_reasoning_tokens / budget)


def conversation_texts(example: data.Example) -> list[str]:
    """C for the verifier: the texts of the turns the model was shown (no speakers, no time
    markers)."""
    return [turn.text for turn in data.visible_turns(example)]


@reward()
def correctness(rollout, cfg):
    """c, the task correctness of the parsed answer."""
    return task_correctness(
        rollout.answer, rollout.example.labels, data.get_task(rollout.example.task).multi_label
    )


REWARDS["accuracy_only"] = correctness  # the paper's Accuracy-Only RL baseline: R = c


@reward()
def evidence_format(rollout, cfg):
    """f, the evidence-tag format term of the whole completion."""
    return verifier.format_score(rollout.completion)


# B: the paper's Table 6 value was lost in extraction. 150 tokens
# is about one paragraph per credited inference: reasoning whose
# blocks average under 150 tokens is not scaled down, padding is.
_IU = dict(budget=150.0)


@reward(judges=("iu",), **_IU)
def iu_g(rollout, cfg):
    """IU_G from the judge's per-block verdicts (`judged["iu"]`), the verifier and the effort budget
    B (`budget`, tokens per credited inference). None when the verdicts are missing or do not cover
    exactly the N blocks."""
    if not rollout.blocks:
        return 0.0
    verdicts = rollout.judged.get("iu")
    if (
        verdicts is None
        or len(verdicts) != len(rollout.blocks)
        or any(v not in (0, 1) for v in verdicts)
    ):
        return None
    quotes = verifier.quotes_by_block(rollout.blocks, conversation_texts(rollout.example))
    verified = [[ok for _, ok in block] for block in quotes]
    return iu_g_score(verdicts, verified, rollout.n_reasoning_tokens, cfg["budget"])


@reward(
    parts={
        "c": computed_by("correctness"),
        "f": computed_by("evidence_format"),
        "IU_G": computed_by("iu_g"),
    },
    judges=("iu",),
    lambda_iu=0.5,
    **_IU,
)
def clue(rollout, cfg):
    """R = c + lambda_iu * f * IU_G (None when IU_G is)."""
    iu = iu_g(rollout, {k: cfg[k] for k in _IU})
    if iu is None:
        return None
    return correctness(rollout) + cfg["lambda_iu"] * evidence_format(rollout) * iu


# ----------------------------------------------------------------------------- Social-R1


def repetition_ratio(text: str, n: int = 4) -> float:
    """rho: the share of the text's word n-grams that repeat an earlier one, 1 - distinct / total
    (seq-rep-n of Welleck et al., 2019; Chinese and Japanese count characters as words). 0 for a
    text shorter than n words. The paper does not give n; 4 is the usual choice for seq-rep-n."""
    words = verifier.word_tokens(text)
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def r_rep(rho: float, threshold: float = 0.1, beta: float = 8.0) -> float:
    """R_rep = 1 if rho <= threshold else exp(-beta (rho - threshold))."""
    return 1.0 if rho <= threshold else math.exp(-beta * (rho - threshold))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def r_win(length: float, low: float = 400, high: float = 2500, k: float = 50) -> float:
    """R_win(L) = sigmoid((L - L_min) / k) * sigmoid((L_max - L) / k)."""
    return _sigmoid((length - low) / k) * _sigmoid((high - length) / k)


def process_weight(step: int, total_steps: int, gamma: float) -> float:
    """w_struct(t) = w_content(t) = 1 + gamma t / T, t the update counted from 1: 1 + gamma at the
    last one."""
    return 1 + gamma * step / total_steps


_LENGTH = dict(ngram=4, rep_threshold=0.1, rep_beta=8.0, len_min=400.0, len_max=2500.0, len_k=50.0)


@reward()
def r_fmt(rollout, cfg):
    """R_fmt in our completion format: 1 when the completion keeps it exactly (`data.well_formed`:
    reasoning, one `</think>`, then only the `Answer:` line), else 0. (Whether the labels are valid
    is R_out's business.)"""
    return float(data.well_formed(rollout.completion))


@reward(**_LENGTH)
def r_len(rollout, cfg):
    """R_len = R_rep(rho) * R_win(L), rho the n-gram repetition of the reasoning (n = `ngram`) and
    L = T, its length in tokens."""
    rho = repetition_ratio(rollout.reasoning, int(cfg["ngram"]))
    return r_rep(rho, cfg["rep_threshold"], cfg["rep_beta"]) * r_win(
        rollout.n_reasoning_tokens, cfg["len_min"], cfg["len_max"], cfg["len_k"]
    )


# tau and gamma are not given in the paper. tau = 0.5 keeps the outcome term (w_o = 2) ahead of the
# two process terms (at most 2 tau = 1) early in training; gamma = 1 doubles the process weights by
# the last update, where they catch up with it.
_SOCIAL_R1 = dict(w_out=2.0, tau_process=0.5, gamma=1.0, **_LENGTH)
# Table 2's ablations, each term on (1) or off (0): w/o R_struct, w/o R_content, w/o R_len, and
# only R_out (R_struct and R_content off). A term switched off needs no judge.
SOCIAL_R1_SWITCHES = dict(use_struct=1.0, use_content=1.0, use_len=1.0)
# the reward settings that are switches, 0 (off) or 1 (on): Social-R1's and CARE's ablations
SWITCHES = (*SOCIAL_R1_SWITCHES, "uniform_weights")


def social_r1_total(rollout: Rollout, cfg: dict, content: Any) -> float | None:
    """R_total = R_fmt * (w_o R_out + tau (u_s w_struct(t) R_struct + u_c w_content(t) R_content))
    * R_len^u_l with R_out = c, R_struct = `judged["sip_structure"]`, the given R_content and the
    switches u = use_struct, use_content, use_len (0 or 1); None when a judge output a switched-on
    term reads is missing or outside [0, 1]."""
    terms = [
        (cfg["use_struct"], rollout.judged.get("sip_structure")),
        (cfg["use_content"], content),
    ]
    if not all(_number_in(value, 0, 1) for on, value in terms if on):
        return None
    w = process_weight(rollout.step, rollout.total_steps, cfg["gamma"])
    process = cfg["tau_process"] * sum(w * value for on, value in terms if on)
    length = r_len(rollout, {k: cfg[k] for k in _LENGTH}) if cfg["use_len"] else 1.0
    return r_fmt(rollout) * (cfg["w_out"] * correctness(rollout) + process) * length


@reward(
    parts={
        "R_fmt": computed_by("r_fmt"),
        "R_out": computed_by("correctness"),
        "R_struct": judge_output("sip_structure"),
        "R_content": judge_output("sip_content"),
        "R_len": computed_by("r_len"),
    },
    judges=("sip_structure", "sip_content"),
    **_SOCIAL_R1,
    **SOCIAL_R1_SWITCHES,
)
def social_r1(rollout, cfg):
    """Social-R1's R_total (social_r1_total), with R_content = `judged["sip_content"]`: by default
    the prompted judge against the example's reference SIP analysis in `meta["reference"]`
    (check_reward_data requires one); with reward_models/social_r1.py, the paper's way, the trained
    content RM (reward_models/content_rm.py) without one."""
    return social_r1_total(rollout, cfg, rollout.judged.get("sip_content"))


@reward(judges=("sip_structure", "sip_content_free"), **_SOCIAL_R1, **SOCIAL_R1_SWITCHES)
def social_r1_reference_free(rollout, cfg):
    """Our variant for data without reference analyses, not the paper's: R_total as in social_r1,
    with R_content = `judged["sip_content_free"]`, the same tiered judge rubric applied against the
    conversation alone. Without a reference the judge can only check the reasoning against the
    story, not against the intended reading of it, so expect a weaker signal than social_r1's."""
    return social_r1_total(rollout, cfg, rollout.judged.get("sip_content_free"))


# ----------------------------------------------------------------------------- EmoLLM

# What EmoLLM's turn judge (judge.turn_scores_request) rates, with each
# score's range: cognitive reliability, the ARG trace's quality and the plausibility
# of the predictor's reverse-perspective forecast (1-5), and overthinking (0 none, 1
# some, 2 heavy). judge.parse_turn_scores reads exactly these.
EMOLLM_TERMS = ("R_cog", "R_ARG", "R_RP", "R_overthink")


def emollm_terms(scores: Any) -> dict[str, float] | None:
    """The four turn terms of EmoLLM (section 3.2.2, Appendix A), each in [0, 1], from the turn
    judge's scores: R_cog = (cognitive - 1) / 4, R_ARG = (trace - 1) / 4, R_RP = (lookahead - 1) /
    4, R_overthink = overthinking / 2. None unless `scores` holds exactly the judge.EMOLLM_SCORES,
    each an integer in its range."""
    if not isinstance(scores, dict) or set(scores) != set(judge.EMOLLM_SCORES):
        return None
    if not all(
        type(scores[k]) is int and low <= scores[k] <= high
        for k, (low, high) in judge.EMOLLM_SCORES.items()
    ):
        return None
    return dict(
        zip(
            EMOLLM_TERMS,
            (
                (scores["cognitive"] - 1) / 4,
                (scores["trace"] - 1) / 4,
                (scores["lookahead"] - 1) / 4,
                scores["overthinking"] / 2,
            ),
        )
    )


def emotional_gain(rollout: Rollout) -> float | None:
    """R_emo = (e_T - e_0) / 4: the user's final emotional state (the last turn's
    `judged["emotional_state"]`, the user's reply to it) minus the initial one (the episode's own
    `judged["emotional_state"]`, its opening message), on the judge's 1-5 scale mapped to [-1, 1].
    None when either is missing or out of range, or there are no turns."""
    initial = rollout.judged.get("emotional_state")
    final = rollout.turns[-1].judged.get("emotional_state") if rollout.turns else None
    if not (_number_in(initial, 1, 5) and _number_in(final, 1, 5)):
        return None
    return (final - initial) / 4


def _emollm_term(name: str) -> PartFn:
    """One of EmoLLM's turn terms (emollm_terms) of a reply, or its mean over an episode's turns."""

    def part(rollout, params):
        terms = [
            emollm_terms(turn.judged.get("turn_scores")) for turn in rollout.turns or [rollout]
        ]
        return None if None in terms else sum(t[name] for t in terms) / len(terms)

    return part


_TURN_PARTS = {name: _emollm_term(name) for name in EMOLLM_TERMS}
# The lambdas are "nonnegative weighting coefficients" in the paper, without values: all 1 here.
_TURN = dict(l_cog=1.0, l_arg=1.0, l_rp=1.0, l_over=1.0)


@reward(parts=_TURN_PARTS, judges=("prediction", "turn_scores"), **_TURN)
def emollm_turn(rollout, cfg):
    """r_t = l_cog R_cog + l_arg R_ARG + l_rp R_RP - l_over R_overthink (emollm_terms of
    `judged["turn_scores"]`); None when the judgement is missing or malformed."""
    terms = emollm_terms(rollout.judged.get("turn_scores"))
    if terms is None:
        return None
    return (
        cfg["l_cog"] * terms["R_cog"]
        + cfg["l_arg"] * terms["R_ARG"]
        + cfg["l_rp"] * terms["R_RP"]
        - cfg["l_over"] * terms["R_overthink"]
    )


@reward(
    parts=_TURN_PARTS | {"R_emo": lambda rollout, params: emotional_gain(rollout)},
    judges=("prediction", "turn_scores", "emotional_state"),
    l_emo=1.0,
    **_TURN,
)
def emollm(rollout, cfg):
    """R(tau) = sum_t r_t + l_emo R_emo over the episode's assistant turns (`rollout.turns`,
    emollm_turn each) and its emotional gain (emotional_gain). None when any of them is."""
    turn_cfg = {k: cfg[k] for k in _TURN}
    turn_rewards = [emollm_turn(turn, turn_cfg) for turn in rollout.turns]
    gain = emotional_gain(rollout)
    if not turn_rewards or None in turn_rewards or gain is None:
        return None
    return sum(turn_rewards) + cfg["l_emo"] * gain


# ----------------------------------------------------------------------------- CARE


def care_score(rubric: Any, scores: Any, uniform: bool = False) -> float | None:
    """sum_d w_d * mean(scores of d) / 5 over the three dimensions, w_d the rubric's or, `uniform`
    (Table 3's ablation), 1/3 each; None for a rubric that judge.care_rubric rejects or scores that
    are not one integer 0-5 per criterion."""
    rubric = judge.care_rubric(rubric)
    if rubric is None or not isinstance(scores, dict) or set(scores) != set(judge.CARE_DIMENSIONS):
        return None
    total = 0.0
    for name, dimension in rubric.items():
        given = scores[name]
        if not isinstance(given, list) or len(given) != len(dimension["criteria"]):
            return None
        if not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= 5 for s in given):
            return None
        weight = 1 / len(rubric) if uniform else dimension["weight"]
        total += weight * sum(given) / len(given) / 5
    return total


@reward(judges=("care_rubric", "care_scores"), uniform_weights=0.0)
def care(rollout, cfg):
    """The CARE rubric reward from `judged["care_rubric"]` (one rubric shared by the GRPO group) and
    `judged["care_scores"]`; `uniform_weights` 1 (a switch, Table 3) drops the rubric's weights."""
    return care_score(
        rollout.judged.get("care_rubric"),
        rollout.judged.get("care_scores"),
        bool(cfg["uniform_weights"]),
    )


# -------------------------------------------------------------------- CARE's rubric generator (3.3)

# Appendix A gives tau = 0.7, lambda = 0.1 and gamma = 0.3
# without the formulas; care_generator has our reading.
_GENERATOR = dict(tau=0.7, lambda_priority=0.1, gamma=0.3)


def _clip(x: float) -> float:
    return max(-1.0, min(1.0, x))


def comparison_term(score_chosen: float, score_rejected: float, tau: float) -> float:
    """R_cmp = (clip((S_c - S_r) / tau, -1, 1) + 1) / 2 in [0, 1], S the replies' aggregate scores
    on the 0-5 scale: 1 once the chosen reply leads by tau points, 0.5 for a tie, 0 once it trails
    by tau."""
    return (_clip((score_chosen - score_rejected) / tau) + 1) / 2


def priority_term(weights: dict[str, float], counts: dict[str, int], gamma: float) -> float:
    """R_pri in [0, 1], the ranking agreement of the rubric's weights with the chosen reply's
    strategy counts per dimension: the mean over the dimension pairs (i, j) that the counts order
    (n_i > n_j) of (clip((w_i - w_j) / gamma, -1, 1) + 1) / 2, so a weight gap of gamma in the
    counts' direction earns full credit and one against it none; 0.5 (no signal) when the counts
    order no pair."""
    ordered = [
        (i, j)
        for i in judge.CARE_DIMENSIONS
        for j in judge.CARE_DIMENSIONS
        if counts[i] > counts[j]
    ]
    if not ordered:
        return 0.5
    return sum((_clip((weights[i] - weights[j]) / gamma) + 1) / 2 for i, j in ordered) / len(
        ordered
    )


def _reply_scores(rollout: Rollout, rubric: dict) -> tuple[float, float] | None:
    """(S_chosen, S_rejected) on the 0-5 scale from the evaluator's scores, or None."""
    sides = [
        care_score(rubric, rollout.judged.get(key))
        for key in ("care_chosen_scores", "care_rejected_scores")
    ]
    return None if None in sides else (5 * sides[0], 5 * sides[1])


def _generator_part(term: str):
    """One term of care_generator (R_cmp, R_pri), None where it is undefined (no valid rubric, or no
    scores)."""

    def part(rollout: Rollout, params: dict) -> float | None:
        cfg = _GENERATOR | {k: v for k, v in params.items() if k in _GENERATOR}
        rubric = judge.generated_rubric(rollout.completion)
        if rubric is None:
            return None
        if term == "R_pri":
            return priority_term(
                {d: rubric[d]["weight"] for d in rubric},
                rollout.example.meta["dimension_counts"],
                cfg["gamma"],
            )
        scores = _reply_scores(rollout, rubric)
        return None if scores is None else comparison_term(*scores, cfg["tau"])

    return part


@reward(
    parts={
        "R_fmt": lambda rollout, params: float(
            judge.generated_rubric(rollout.completion) is not None
        ),
        "R_cmp": _generator_part("R_cmp"),
        "R_pri": _generator_part("R_pri"),
    },
    judges=("care_chosen_scores", "care_rejected_scores"),
    **_GENERATOR,
)
def care_generator(rollout, cfg):
    """CARE's preference-RL reward for the rubric generator (section 3.3; our reading of the
    formulas, whose values only survive): R = R_fmt (1 + R_cmp + lambda R_pri).
    - R_fmt in {0, 1}, the format term: the completion is a valid rubric (generated_rubric). Without
      one nothing else can be scored, so R = 0; with one, R >= 1 beats every invalid rubric.
    - R_cmp (comparison_term): the frozen evaluator scores the human-chosen and the rejected reply
      under the rubric (`judged["care_chosen_scores"]`, `["care_rejected_scores"]`); tau = 0.7
      points on the 0-5 scale is the margin at which the preference counts in full (a smaller lead
      earns a share, a tie half).
    - R_pri (priority_term): priority alignment, a ranking reward between the weights and the chosen
      reply's strategy counts per dimension (`meta["dimension_counts"]`), gamma = 0.3 the weight gap
      earning full credit; lambda = 0.1 keeps it a supplement to the comparison, as its ablation
      (59.4% -> 56.4%) suggests.
    None when the evaluator's scores are missing or do not fit the rubric."""
    if judge.generated_rubric(rollout.completion) is None:
        return 0.0
    cmp, pri = _generator_part("R_cmp")(rollout, cfg), _generator_part("R_pri")(rollout, cfg)
    return None if cmp is None else 1 + cmp + cfg["lambda_priority"] * pri


# ----------------------------------------------------------------------------- asking the judges


def judges_needed(spec: RewardSpec) -> tuple[str, ...]:
    """The judges a run of `spec` asks: those its registration declares, less those of the
    Social-R1 terms its switches turn off."""
    params = REWARDS[spec.name].defaults | spec.params if spec.name in REWARDS else {}
    off = set()
    if not params.get("use_struct", 1):
        off.add("sip_structure")
    if not params.get("use_content", 1):
        off |= {"sip_content", "sip_content_free"}
    declared = REWARDS[spec.name].judges if spec.name in REWARDS else ()
    return tuple(name for name in declared if name not in off)


def undeclared_judge(spec: RewardSpec) -> str | None:
    """One line naming the reward and the first judge it declares that judge.JUDGES does not hold,
    or None: checked at start-up, so that a misspelled judge never reaches the first update."""
    for name in REWARDS[spec.name].judges:
        if name not in judge.JUDGES:
            return (
                f"reward {spec.name} declares the judge {name!r}, which judge.JUDGES does not "
                f"hold (known: {', '.join(judge.JUDGES)})"
            )
    return None


# The example fields a reward needs beyond the conversation and its labels: meta keys that must hold
# a non-empty string, with what they are. A reward of your own that reads one adds its line here.
def check_spec(spec: RewardSpec, config_path) -> None:
    """A run's `reward` section, checked before any model loads: a registered reward whose judges
    are declared, given only its own settings, each switch 0 or 1. A ConfigError located at the
    key (config.config_error)."""
    if spec.name not in REWARDS:
        known = ", ".join(sorted(REWARDS))
        raise config_error(
            config_path, "reward.name", f"unknown reward {excerpt(spec.name)} (known: {known})"
        )
    if problem := undeclared_judge(spec):
        raise config_error(config_path, "reward.name", problem)
    defaults = REWARDS[spec.name].defaults
    if unknown := sorted(set(spec.params) - set(defaults)):
        raise config_error(
            config_path,
            f"reward.params.{unknown[0]}",
            f"not a setting of reward {excerpt(spec.name)} (known: "
            f"{', '.join(sorted(defaults)) or 'none'})",
        )
    for key in set(SWITCHES) & set(spec.params):
        if spec.params[key] not in (0, 1):
            raise config_error(
                config_path,
                f"reward.params.{key}",
                f"a switch: 0 (off) or 1 (on), got {spec.params[key]}",
            )


REWARD_DATA = {
    "social_r1": {
        "reference": "the reference SIP analysis R_content is scored against; "
        "reward social_r1_reference_free needs none"
    },
    "care_generator": {
        "chosen": "the human-preferred reply",
        "rejected": "the other reply",
        "dimension_counts": "the chosen reply's strategies per dimension "
        "(reward_models/rubric_generator.py writes them)",
    },
}


def _meta_ok(key: str, value: Any) -> bool:
    """A REWARD_DATA field as its reward reads it: dimension counts (one integer >= 0 per CARE
    dimension), or else a non-empty string."""
    if key == "dimension_counts":
        return (
            isinstance(value, dict)
            and set(value) == set(judge.CARE_DIMENSIONS)
            and all(type(n) is int and n >= 0 for n in value.values())
        )
    return isinstance(value, str) and bool(value.strip())


# social_r1's R_content judge: what a trained content RM (reward_models/social_r1.py) scores in its
# place, with no reference analysis
CONTENT_JUDGE = "sip_content"


# The rewards a dialogue run trains (dialogue/rl.py), and how each groups.
DIALOGUE_GROUPING = {"emollm": "trajectory", "emollm_turn": "turn", "care": "turn"}


def check_reward_data(
    spec: RewardSpec, examples: list[data.Example], content_model: bool = False
) -> None:
    """Stop a run whose data cannot feed its reward, before training: raises data.DataError, one
    line naming the field and the ids of the examples that lack it (the caller adds the file name).
    With a content RM (`content_model`), or R_content switched off, social_r1 needs no reference."""
    needed = REWARD_DATA.get(spec.name, {})
    if content_model or CONTENT_JUDGE not in judges_needed(spec):
        needed = {k: v for k, v in needed.items() if k != "reference"}
    for key, what in needed.items():
        missing = [e.id for e in examples if not _meta_ok(key, e.meta.get(key))]
        if missing:
            ids = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise data.DataError(
                f"field 'meta.{key}': reward {spec.name} needs it in every example ({what}); "
                f"{len(missing)} of {len(examples)} lack it: {ids}"
            )


# What the judges are asked about when each is probed once before a run (judge_probes): a stand-in
# for the run's own completions, one reasoning block and the example's labels, or for
# care_generator a valid rubric.
_STAND_IN_REASONING = "The last turn reads differently in the light of the turns before it."
_STAND_IN_RUBRIC = {
    name: {"weight": weight, "rationale": "a stand-in", "criteria": ["one point", "another point"]}
    for name, weight in zip(judge.CARE_DIMENSIONS, (0.4, 0.3, 0.3))
}


def judge_probes(
    spec: RewardSpec, example: data.Example, cfg: http_client.JudgeConfig, content: bool = False
) -> list[tuple[str, http_client.JudgeCall]]:
    """(judge name, call): one request of each kind the single-turn judges of a run of `spec` will
    get, about `example` and a stand-in completion, for http_client.probe before the run. `content`:
    R_content is scored in the prompted judge's place (judge_rollouts), asked without a
    reference."""
    completion = (
        json.dumps(_STAND_IN_RUBRIC)
        if spec.name == "care_generator"
        else f"{_STAND_IN_REASONING}\n{data.THINK_END}\nAnswer: {', '.join(example.labels)}"
    )
    rollout = Rollout.from_completion(
        example, completion, count_tokens=lambda text: len(text.split()), n_completion_tokens=16
    )
    return [
        (name, judge.JUDGES[_asked_as(name, content)].request(rollout, cfg))
        for name in judges_needed(spec)
    ]


def _asked_as(name: str, content: bool) -> str:
    """The judge whose request asks for `name`: R_content scored in the prompted judge's place is
    asked the reference-free judge's prompt."""
    return "sip_content_free" if content and name == CONTENT_JUDGE else name


def judge_rollouts(
    rollouts: list[Rollout],
    spec: RewardSpec,
    cfg: http_client.JudgeConfig,
    content: http_client.JudgeConfig | Callable[[list[Rollout]], list[float | None]] | None = None,
) -> dict[str, Any]:
    """Ask the judges that reward `spec` reads (judges_needed) about every rollout, all calls at
    once through `http_client.chat_many`, and store each parsed answer in `rollout.judged[name]`:
    None where the judge failed after its retries or answered out of format, so the reward reports
    missing feedback. Returns chat_many's stats (calls, retries, failures, latency, errors) plus
    `malformed`, the count of answers the strict parsers rejected. Data the reward cannot use raises
    (check_reward_data).

    `content` replaces the prompted R_content judge (CONTENT_JUDGE) with a trained RM
    (reward_models/social_r1.py): a function scoring the rollouts in-process, or the JudgeConfig of
    a served one, asked with the same prompt, without a reference, through the same client."""
    check_reward_data(
        spec, [rollout.example for rollout in rollouts], content_model=content is not None
    )
    pending, local = [], []
    for rollout in rollouts:
        for name in judges_needed(spec):
            rollout.judged.pop(name, None)
            if name == CONTENT_JUDGE and callable(content):
                local.append(rollout)
                continue
            served = name == CONTENT_JUDGE and content is not None
            asked = judge.JUDGES[_asked_as(name, served)]
            call = asked.request(rollout, cfg)
            if call is not None:
                parse = functools.partial(lambda text, j, r: j.parse(text, r), j=asked, r=rollout)
                pending.append((rollout, name, call, parse, content if served else cfg))
    for rollout, value in zip(local, content(local) if local else []):
        rollout.judged[CONTENT_JUDGE] = value
    stats = {"calls": 0, "retries": 0, "failures": 0, "malformed": 0}
    for endpoint in [cfg] + (
        [content] if isinstance(content, http_client.JudgeConfig) and content is not cfg else []
    ):
        mine = [p for p in pending if p[-1] is endpoint]
        if mine:
            values, asked = http_client.ask(
                [(call, parse) for _, _, call, parse, _ in mine], endpoint
            )
            for (rollout, name, *_), value in zip(mine, values):
                rollout.judged[name] = value
            stats = asked | {
                k: stats[k] + asked[k] for k in ("calls", "retries", "failures", "malformed")
            }
    return stats
