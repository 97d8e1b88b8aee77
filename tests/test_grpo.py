"""grpo.py: the loss and advantages against hand computations, group filtering on scripted rewards,
gradients that do not depend on the micro-batch split or the rank count (two gloo processes), the
paper's LR landmarks, and whole runs on a tiny random model against the local rules judge over real
HTTP: every output written, exact resume after SIGKILL, SIGTERM, judge failures, bad inputs, and a
reward that a tiny model learns to raise."""

import collections
import contextlib
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import yaml
from helpers import (
    assert_same_run,
    assert_sinks_hold_metrics,
    fixed_groups,
    gloo_rank,
    kill_after_checkpoint,
    random_model,
    read_jsonl,
    run_config,
    wandb_offline_run,
    write_examples,
)
from helpers import (
    grpo_checkpoint as write_checkpoint,
)
from instruments import end_rank, free_port
from safetensors.torch import load_file

import checkpoint as CK
import data
import dataset
import distributed as D
import grpo
import model as M
import rewards
import rollout
import train as T
from config import MetricsWriter, load_config
from dialogue.rl import DialogueConfig
from judge import SIP_REFERENCE_SYSTEM, SIP_STAGES, parse_sip_reference
from judge_server import Faults, JudgeServer, rules_backend
from prepare import references
from reward_models import social_r1 as social_r1_rl
from vllm_engine import tis_weights

REPO = Path(__file__).resolve().parents[1]
METRIC_KEYS = [
    "step",
    "loss",
    "lr",
    "grad_norm",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "groups/masked",
    "groups/resampled",
    "groups/replaced",
    "completions/mean_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "logp_mismatch/mean",
    "logp_mismatch/max",
    "time/generate_s",
    "time/judge_s",
    "time/train_s",
    "tokens_per_s",
    "judge/calls",
    "judge/retries",
    "judge/failures",
    "skipped_nonfinite",
]


# ----------------------------------------------------------------------------- the math by hand


def test_group_advantages_by_hand():
    adv = grpo.group_advantages(
        [1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0], group_size=4, eps=0.0 + 1e-6
    )
    std = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)  # unbiased std of (1, 0, 0, 0)
    expected = [0.75 / (std + 1e-6)] + [-0.25 / (std + 1e-6)] * 3 + [0.0] * 4
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_group_advantages_population_std_for_emollm():
    # EmoLLM (B.2) divides by sigma_R = sqrt(1/G sum (R - mu)^2): for [0, 0, 0,
    # 1], mu = 0.25 and sigma = sqrt(3) / 4, so A = [-1/sqrt(3)] * 3 + [sqrt(3)]
    # = [-0.577, -0.577, -0.577, 1.732]; the unbiased std gives [-0.5 x3, 1.5]
    population = grpo.group_advantages([0.0, 0.0, 0.0, 1.0], 4, eps=0.0, std="population")
    torch.testing.assert_close(
        population, torch.tensor([-0.57735, -0.57735, -0.57735, 1.73205]), atol=1e-5, rtol=0
    )
    unbiased = grpo.group_advantages([0.0, 0.0, 0.0, 1.0], 4, eps=0.0)
    torch.testing.assert_close(unbiased, torch.tensor([-0.5, -0.5, -0.5, 1.5]))
    emollm = load_config(REPO / "configs" / "emollm_qwen3_8b.yaml", [], DialogueConfig)
    clue = load_config(REPO / "configs" / "clue_qwen3_5_9b.yaml", [], grpo.GRPOConfig)
    assert (emollm.loss.adv_std, clue.loss.adv_std) == ("population", "unbiased")
    example = data.Example("e", "meld_emotion", [data.Turn("A", "hi")], 0, ["joy"])
    group = rollout.Group(
        example,
        [[rollout.Sample([1, 2], [3], [-0.1], False)] for _ in range(4)],
        [],
        [0.0, 0.0, 0.0, 1.0],
    )
    emollm.loss.adv_eps = 0.0
    (adv,) = grpo.advantages_by_group([group], emollm.loss)
    assert adv == pytest.approx([-0.57735, -0.57735, -0.57735, 1.73205], abs=1e-5)


def hand_loss(logp, old, ref, adv, mask, lo, hi, beta, agg):
    """The per-token formula of DESIGN.md, one token at a time in plain Python."""
    rows, tokens, n_tok = [], 0.0, 0
    for b in range(len(logp)):
        s, n = 0.0, 0
        for t in range(len(logp[b])):
            if not mask[b][t]:
                continue
            rho = math.exp(logp[b][t] - old[b][t])
            clipped = min(max(rho, 1 - lo), 1 + hi)
            d = ref[b][t] - logp[b][t]
            kl = math.exp(d) - d - 1
            term = -(min(rho * adv[b], clipped * adv[b]) - beta * kl)
            s, n = s + term, n + 1
        rows.append(s / n)
        tokens, n_tok = tokens + s, n_tok + n
    return sum(rows) / len(rows) if agg == "seq-mean-token-mean" else tokens / n_tok


def test_grpo_loss_by_hand():
    logp = [[-1.0, -2.0, -0.5, -3.0], [-0.2, -1.5, -1.0, -0.7]]
    old = [[-1.5, -1.9, -0.5, -3.0], [-0.9, -1.5, -0.3, -0.7]]
    ref = [[-1.2, -2.5, -0.4, -1.0], [-0.3, -1.0, -1.1, -0.2]]
    mask = [[True, True, True, False], [True, True, True, True]]
    adv = [1.5, -0.5]
    for agg in ("seq-mean-token-mean", "token-mean"):
        loss, stats = grpo.grpo_loss(
            torch.tensor(logp),
            torch.tensor(old),
            torch.tensor(ref),
            torch.tensor(adv),
            torch.tensor(mask),
            clip_low=0.2,
            clip_high=0.28,
            beta=0.1,
            agg=agg,
        )
        assert loss.item() == pytest.approx(
            hand_loss(logp, old, ref, adv, mask, 0.2, 0.28, 0.1, agg), rel=1e-6
        )
    # rho: row 0 = e^0.5 (> 1.28, A > 0: high-clipped), e^-0.1, 1; row 1 =
    # e^0.7 (A < 0: not counted), 1, e^-0.7 (< 0.8, A < 0: low-clipped), 1
    assert stats["tokens"] == 7 and stats["clip_high"] == 1 and stats["clip_low"] == 1
    kl = sum(
        math.exp(r - p) - (r - p) - 1
        for rr, pp, mm in zip(ref, logp, mask)
        for r, p, m in zip(rr, pp, mm)
        if m
    )
    assert stats["kl"].item() == pytest.approx(kl, rel=1e-6)
    # a normalizer replaces the batch's own count: 2 completions here, 10 in the whole update
    loss10, _ = grpo.grpo_loss(
        torch.tensor(logp),
        torch.tensor(old),
        torch.tensor(ref),
        torch.tensor(adv),
        torch.tensor(mask),
        0.2,
        0.28,
        0.1,
        "seq-mean-token-mean",
        normalizer=10,
    )
    assert loss10.item() == pytest.approx(
        hand_loss(logp, old, ref, adv, mask, 0.2, 0.28, 0.1, "seq-mean-token-mean") * 2 / 10,
        rel=1e-6,
    )


# ----------------------------------------------------------------------------- the data order


def long_example(n_turns=25, target=22, **kw):
    turns = [
        data.Turn(
            "A" if i % 2 else "B", f"turn {i}", reply_to=(i - 3 if i % 5 == 0 and i >= 3 else None)
        )
        for i in range(n_turns)
    ]
    fields = dict(
        id="long",
        task="meld_emotion",
        turns=turns,
        target=target,
        labels=["joy"],
        meta={"causes": [{"turn": 5, "span": "turn 5"}, {"turn": 20, "span": "turn 20"}]},
    )
    return data.Example(**(fields | kw))


def test_truncate_context_keeps_target_and_preceding_turns():
    example = long_example()
    short = grpo.truncate_context(example, 10)
    assert [t.text for t in short.turns] == [f"turn {i}" for i in range(12, 23)]
    assert short.target == 10 and short.id == "long/ctx10" and short.labels == ["joy"]
    # turn 15 answered turn 12 (now 0); turn 20 answered
    # 17 (now 5); turn 12's own parent (9) was dropped
    assert [t.reply_to for t in short.turns] == [
        None,
        None,
        None,
        0,
        None,
        None,
        None,
        None,
        5,
        None,
        None,
    ]
    assert short.meta["causes"] == [{"turn": 8, "span": "turn 20"}]
    # the input is untouched
    assert example.turns[12].reply_to is None and example.meta["causes"][0]["turn"] == 5
    dataset.check_example(short)
    assert (
        grpo.truncate_context(example, 22) is example
        and grpo.truncate_context(example, 30) is example
    )
    power = data.Example("w", "wiki_power", example.turns, None, ["A"])
    assert grpo.truncate_context(power, 5) is power
    assert data.render_target(grpo.truncate_context(example, 5)) == data.render_target(example)


def test_curriculum_orders_full_segment_by_difficulty_within_task():
    xs = [
        data.Example(f"x{d}", "wiki_power", [data.Turn("A", "hi")], None, ["A"], difficulty=d)
        for d in (0.9, 0.1)
    ]
    ys = [long_example(id=f"y{i}", difficulty=d) for i, d in enumerate((0.5, None, 0.2, 0.7))]
    full, mixed = grpo.curriculum(xs + ys, grpo.CurriculumConfig(seed=1))
    assert (full.name, mixed.name) == ("full", "mixed")
    # Within a task: increasing difficulty, unrated last. Across tasks, by relative position:
    # x: 1/4, 3/4; y: 1/8, 3/8, 5/8, 7/8 (hand-computed).
    assert [e.id for e in full.examples] == ["y2", "x0.1", "y0", "y3", "x0.9", "y1"]
    # full contexts
    assert all(e.turns is o.turns for e in full.examples for o in xs + ys if o.id == e.id)


def test_curriculum_mixed_segment_is_deterministic_and_covers_every_example():
    examples = [long_example(id=f"e{i}") for i in range(60)]
    examples.append(data.Example("w", "wiki_power", [data.Turn("A", "x")], None, ["A"]))
    cfg = grpo.CurriculumConfig(context_turns=(5, 10, 20), seed=7)
    mixed = grpo.curriculum(examples, cfg)[1].examples
    assert sorted(e.id.split("/")[0] for e in mixed) == sorted(e.id for e in examples)
    lengths = collections.Counter(e.id.partition("/ctx")[2] or "full" for e in mixed)
    # the power example is never cut
    assert set(lengths) == {"full", "5", "10", "20"} and lengths["full"] >= 2
    for e in mixed:
        n = e.id.partition("/ctx")[2]
        if n:
            assert (
                len(e.turns) == int(n) + 1 and e.target == int(n) and e.turns[-1].text == "turn 22"
            )
    assert [e.id for e in grpo.curriculum(examples, cfg)[1].examples] == [e.id for e in mixed]
    assert [e.id for e in grpo.curriculum(examples, grpo.CurriculumConfig(seed=8))[1].examples] != [
        e.id for e in mixed
    ]


def test_rl_schedule_at_the_papers_landmarks():
    paper = grpo.OptimSettings(lr=2e-6, lr_floor=5e-7, warmup_updates=19, hold_until=506)

    def lr(update):  # updates counted from 1, as in the paper
        return grpo.lr_at(update, paper, 723)

    assert lr(1) == pytest.approx(5e-7)
    assert lr(10) == pytest.approx(5e-7 + 1.5e-6 * 9 / 19)
    assert lr(19) == pytest.approx(5e-7 + 1.5e-6 * 18 / 19)
    assert lr(20) == lr(300) == lr(506) == 2e-6
    assert (
        lr(507) == pytest.approx(2e-6 - 1.5e-6 * (1 - math.cos(math.pi / 217)) / 2)
        and lr(507) < 2e-6
    )
    mid = 506 + (723 - 506) / 2
    assert lr(mid) == pytest.approx(5e-7 + 1.5e-6 / 2)
    assert lr(600) == pytest.approx(5e-7 + 1.5e-6 * 0.5 * (1 + math.cos(math.pi * 94 / 217)))
    assert lr(723) == pytest.approx(5e-7, rel=1e-12)
    # no warm-up: the first update at the peak
    no_warmup = grpo.OptimSettings(lr=2e-6, lr_floor=5e-7, warmup_updates=0, hold_until=50)
    assert grpo.lr_at(1, no_warmup, 50) == 2e-6


def test_the_token_weights_a_samplers_rollouts_span_hands_over_weigh_the_loss(
    tmp_path, assets, judge
):
    """The weight the sampler's `rollouts` span yields (a served engine's truncated importance
    weights) multiplies each token's surrogate in the run's loss: with no KL term, a span that
    weighs every token 2 doubles the gradient norm of the first update that trains (the same
    rollouts from the same policy: nothing stepped before it), its trained tokens unchanged. (Its
    loss is 0 either way: on the sampling policy the surrogate is the mean advantage, 0.)"""

    class Weighed(rollout.PromptSampler):
        @contextlib.contextmanager
        def rollouts(self, update):
            yield lambda logp_old, logp_sampler: torch.full_like(logp_old, 2.0)

    def weighed(cfg, policy, tok, ranks, out_dir):
        return Weighed(policy, tok, cfg.rollout, cfg.reward, cfg.judge, cfg.updates)

    first = {}
    for name, sampler_for in (("plain", grpo.rollout_sampler), ("weighed", weighed)):
        config = run_config(
            tmp_path / name,
            assets,
            judge.url,
            filtering={"resamples": 3, "replacements": 2},
            **{"loss.beta": 0},
        )
        grpo.main([str(config)], sampler_for=sampler_for)
        lines = read_jsonl(tmp_path / name / "run" / "metrics.jsonl")
        first[name] = next(m for m in lines if m["tokens/trained"] > 0)
    plain, twice = first["plain"], first["weighed"]
    assert plain["grad_norm"] > 0
    assert (twice["step"], twice["tokens/trained"]) == (plain["step"], plain["tokens/trained"])
    assert twice["grad_norm"] == pytest.approx(2 * plain["grad_norm"], rel=1e-5)


def test_truncated_importance_weights_by_hand():
    """w = min(pi_old / pi_sampler, C) per token, and grpo_loss multiplying each token's clipped
    surrogate by it (the KL term unweighted), against the formula evaluated by hand."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, -1.0]])
    sampler = torch.tensor([[-1.5, -1.7, -3.0], [-0.2, -2.0, -1.1]])
    w = tis_weights(old, sampler, 2.0)
    # e^2.5 capped at 2
    expected = [[math.exp(0.5), math.exp(-0.3), 2.0], [1.0, math.exp(-1.0), math.exp(0.1)]]
    torch.testing.assert_close(w, torch.tensor(expected))
    assert tis_weights(old, sampler, None) is None
    logp = torch.tensor([[-0.8, -2.1, -0.4], [-0.3, -2.9, -1.2]])
    ref = torch.tensor([[-1.1, -2.0, -0.9], [-0.1, -3.2, -1.0]])
    adv, mask = [0.7, -1.2], [[True, True, True], [True, True, False]]
    loss, _ = grpo.grpo_loss(
        logp,
        old,
        ref,
        torch.tensor(adv),
        torch.tensor(mask),
        0.2,
        0.2,
        0.1,
        "token-mean",
        token_weight=w,
    )
    total, n = 0.0, 0
    for b in range(2):
        for t in range(3):
            if mask[b][t]:
                rho = math.exp(logp[b][t] - old[b][t])
                surrogate = min(rho * adv[b], min(max(rho, 0.8), 1.2) * adv[b])
                d = ref[b][t].item() - logp[b][t].item()
                total, n = total - expected[b][t] * surrogate + 0.1 * (math.exp(d) - d - 1), n + 1
    assert loss.item() == pytest.approx(total / n, rel=1e-6)


def test_clipped_tokens_pass_no_gradient():
    logp = torch.tensor([[0.5, -0.5, 0.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    loss, _ = grpo.grpo_loss(
        logp, old, None, torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.bool), beta=0.0
    )
    loss.backward()
    # rho = e^0.5 > 1.2 with A > 0: clipped, no gradient; the others: d(-rho A / 3)/dlogp = -rho / 3
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -math.exp(-0.5) / 3, -1 / 3]]))


def test_lr_at_the_papers_landmarks():
    # Updates count from 1 as in the paper (A.2): 5e-7 at update 1, rising over
    # 19 updates to the peak 1e-5 at update 20, constant through update 506, then
    # a cosine down to 5e-7 at update 723, the last that runs. The old schedule
    # counted from 0: update 507 ran at the peak and update 723 at 5.005e-7.
    cfg = load_config(REPO / "configs" / "clue_qwen3_5_9b.yaml", [], grpo.GRPOConfig)
    assert (cfg.updates, cfg.optim.lr, cfg.optim.lr_floor, cfg.optim.betas) == (
        723,
        1e-5,
        5e-7,
        (0.9, 0.99),
    )
    lr = {u: grpo.lr_at(u, cfg.optim, cfg.updates) for u in (1, 10, 19, 20, 506, 507, 614, 723)}
    assert lr[1] == pytest.approx(5e-7, rel=1e-12)
    assert lr[10] == pytest.approx(5e-7 + 9.5e-6 * 9 / 19, rel=1e-12)
    assert lr[19] == pytest.approx(9.5e-6, rel=1e-12)  # 5e-7 + 9.5e-6 * 18 / 19
    assert lr[20] == lr[506] == 1e-5
    assert lr[507] == pytest.approx(1e-5 - 9.5e-6 * (1 - math.cos(math.pi / 217)) / 2, rel=1e-12)
    assert lr[507] == pytest.approx(9.99950e-6, abs=1e-11) and lr[507] < 1e-5
    assert lr[614] == pytest.approx(
        5e-7 + 9.5e-6 * 0.5 * (1 + math.cos(math.pi * 108 / 217)), rel=1e-12
    )
    assert lr[723] == pytest.approx(5e-7, rel=1e-12)


def test_social_r1_weight_reaches_one_plus_gamma_at_the_last_update(assets):
    # w(t) = 1 + gamma t / T with t the update counted from 1: the rollouts
    # of the last update (the loop's update T - 1) carry t = T, so the
    # process weight is 1 + gamma there (the old code passed t = T - 1)
    base, _ = assets
    cfg = load_config(
        REPO / "configs" / "social_r1_qwen3_8b.yaml",
        [
            f"model.path={base}",
            "model.dtype=float32",
            "model.device=cpu",
            "lora.rank=4",
            "lora.alpha=8",
            "finetune=lora",
            "rollout.group_size=2",
            "rollout.max_new_tokens=2",
        ],
        social_r1_rl.SocialR1Config,
    )
    policy, tok = grpo.build_policy(cfg, D.Ranks(0, 1, torch.device("cpu")))
    story = data.Example(
        "s",
        "tom_mc",
        [data.Turn("", "Sam hides the key.")],
        None,
        ["A"],
        meta={"question": "Where?", "options": ["box", "bag"]},
    )
    gamma = cfg.reward.params.get("gamma", rewards.REWARDS[cfg.reward.name].defaults["gamma"])
    for update, weight in ((cfg.updates - 1, 1 + gamma), (0, 1 + gamma / cfg.updates)):
        (group,) = grpo.rollout_sampler(cfg, policy, tok, None, None).sample([story], update, 0, {})
        assert {(r.step, r.total_steps) for r in group.rollouts} == {(update + 1, cfg.updates)}
        assert rewards.process_weight(group.rollouts[0].step, cfg.updates, gamma) == pytest.approx(
            weight
        )


# ----------------------------------------------------------------------------- group filtering


def scripted_filtering(
    monkeypatch, script, enabled=True, config="clue_qwen3_5_9b.yaml", overrides=()
):
    """Run collect_groups on 3 slots whose rewards come from `script[example id]`, one list per
    sampling of that prompt (the last one repeats). Returns (groups, counts, samplings per id)."""
    cfg = load_config(
        REPO / "configs" / config, ["rollout.group_size=2", *overrides], grpo.GRPOConfig
    )
    cfg.filtering.enabled = enabled
    examples = [
        data.Example(f"p{i}", "meld_emotion", [data.Turn("A", "hi")], 0, ["joy"]) for i in range(6)
    ]
    source = grpo.PromptSource(
        [grpo.Segment("full", examples[:3]), grpo.Segment("mixed", examples[3:])]
    )
    seen: dict[str, int] = {}

    def fake_sample(sampler, batch, update, seed, counts):
        groups = []
        for example in batch:
            k = seen[example.id] = seen.get(example.id, 0) + 1
            rewards_ = script[example.id][min(k, len(script[example.id])) - 1]
            samples = [[rollout.Sample([1], [token], [0.0], False)] for token in (2, 3)]
            groups.append(rollout.Group(example, samples, [], list(rewards_)))
        return groups

    monkeypatch.setattr(grpo.PromptSampler, "sample", fake_sample)
    monkeypatch.setattr(
        grpo, "score_groups", lambda groups, cfg, judge: {"calls": 0, "retries": 0, "failures": 0}
    )
    slots = [grpo.Slot(i, ex, seg) for i, (ex, seg) in enumerate(source.take(3))]
    ranks = D.Ranks(0, 1, torch.device("cpu"))
    groups, counts = grpo.collect_groups(
        grpo.rollout_sampler(cfg, None, None, None, None), source, slots, cfg, 0, ranks
    )
    return groups, counts, seen


@pytest.mark.parametrize(
    "rewards_, resamples, replacements, enabled, expected",
    [
        ([1.0, 0.0], 0, 0, True, "keep"),  # rewards differ: a learning signal
        ([0.5, 0.5], 0, 0, True, "resample"),  # all equal: sample the prompt again
        (
            [1.0, None],
            2,
            0,
            True,
            "resample",
        ),  # a missing judge answer, a resample left (3 allowed)
        ([0.5, 0.5], 3, 0, True, "replace"),  # resamples spent: another prompt of the segment
        ([0.5, 0.5], 3, 1, True, "replace"),
        ([None, None], 3, 2, True, "mask"),  # replacements spent too
        ([0.0, 0.0], 3, 2, True, "mask"),
        (
            [0.5, 0.5],
            0,
            0,
            False,
            "mask",
        ),  # filtering off: equal rewards masked at once, out of the normalizer too
        ([1.0, 0.0], 0, 0, False, "keep"),
        ([1.0, None], 0, 0, False, "mask"),  # ... and a missing reward is never read as a number
    ],
)
def test_filter_decision_by_hand(rewards_, resamples, replacements, enabled, expected):
    settings = grpo.FilterSettings(enabled=enabled, resamples=3, replacements=2)
    assert grpo.filter_decision(rewards_, resamples, replacements, settings) == expected


def test_without_mask_equal_an_all_equal_group_stays_in_the_normalizer(assets):
    # verl's plain GRPO (Social-R1's configs): filtering off, mask_equal false
    keep = grpo.FilterSettings(enabled=False, mask_equal=False)
    assert grpo.filter_decision([0.5, 0.5], 0, 0, keep) == "keep"
    assert grpo.filter_decision([1.0, None], 0, 0, keep) == "mask"
    assert grpo.filter_decision([0.5, 0.5], 0, 0, grpo.FilterSettings(enabled=True)) == "resample"
    cfg, policy = tiny_policy(assets[0])
    cfg.loss.agg, cfg.loss.beta = "token-mean", 0.04
    ranks = D.Ranks(0, 1, torch.device("cpu"))
    groups = fixed_groups()
    groups[1].rewards = [1.0, 1.0, 1.0]
    equal_tokens = sum(len(s.completion) for member in groups[1].samples for s in member)
    all_tokens = sum(len(s.completion) for g in groups for member in g.samples for s in member)
    results = {}
    for mask_equal in (True, False):
        cfg.filtering = grpo.FilterSettings(enabled=False, mask_equal=mask_equal)
        for g in groups:
            g.masked = grpo.filter_decision(g.rewards, 0, 0, cfg.filtering) == "mask"
        results[mask_equal] = gradients(cfg, policy, groups, ranks, 4)
    for i, g in enumerate(groups):  # the equal group alone: its KL term (the adapter is not 0)
        g.masked = i != 1
    (masked, masked_grads), (kept, kept_grads) = results[True], results[False]
    alone, alone_grads = gradients(cfg, policy, groups, ranks, 4)
    n_equal, n_rest = equal_tokens, all_tokens - equal_tokens
    assert (masked["tokens"], kept["tokens"], alone["tokens"]) == (n_rest, all_tokens, n_equal)
    assert alone["kl"] > 0 and kept["kl"] == pytest.approx(masked["kl"] + alone["kl"], rel=1e-5)
    # the token mean over all tokens: (n_rest x the others' mean + n_equal x its KL mean) / n_all
    for a, b, c in zip(kept_grads, masked_grads, alone_grads):
        expected = (n_rest * b + n_equal * c) / all_tokens
        assert (a - expected).norm() <= 1e-5 * expected.norm() + 1e-9


def test_every_filter_off_config_says_whether_it_masks_equal_groups():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        filtering = raw.get("filtering") if isinstance(raw, dict) else None
        if filtering and filtering.get("enabled") is False:
            # Social-R1's configs and its toy (configs/toy_tom_grpo.yaml) keep verl's plain GRPO
            social_r1 = path.name.startswith(("social_r1", "toy_tom"))
            assert filtering["mask_equal"] is (not social_r1), path.name


def test_group_filtering_resamples_replaces_and_masks(monkeypatch):
    script = {
        "p0": [(1.0, 1.0), (0.0, 1.0), (1.0, 1.0)],  # identical, recovered by the first resample
        "p1": [
            (None, 1.0),
            (0.0, None),
            (1.0, 0.5),
            (1.0, 1.0),
        ],  # None twice, recovered by the second
        "p2": [(0.5, 0.5)],  # never usable
    }
    # p2: 3 resamples, then 2 replacements from its own segment ("full":
    # p0 or p1, whose later samplings give identical rewards), then masked
    groups, counts, seen = scripted_filtering(monkeypatch, script)
    assert [g.rewards for g in groups[:2]] == [[0.0, 1.0], [1.0, 0.5]]
    assert not groups[0].masked and not groups[1].masked
    assert seen["p2"] == 4 and seen["p0"] + seen["p1"] == 2 + 3 + 2
    assert counts["resampled"] == 1 + 2 + 3 and counts["replaced"] == 2 and counts["masked"] == 1
    assert (
        groups[2].masked
        and groups[2].example.id in ("p0", "p1")
        and groups[2].rewards == [1.0, 1.0]
    )


def test_group_filtering_replacement_can_rescue(monkeypatch):
    script = {"p0": [(0.0, 1.0)], "p1": [(0.0, 1.0)], "p2": [(0.0, 0.0)]}
    # p2's first replacement is p0 or p1 (same segment), whose rewards differ on its next sampling
    script["p0"] += [(1.0, 0.0)]
    script["p1"] += [(1.0, 0.0)]
    groups, counts, _ = scripted_filtering(monkeypatch, script)
    assert counts == counts | {"resampled": 3, "replaced": 1, "masked": 0}
    assert groups[2].example.id != "p2" and groups[2].rewards == [1.0, 0.0] and not groups[2].masked


def test_filtering_off_draws_nothing_again_and_masks_unusable_groups(monkeypatch):
    # all-equal rewards are masked too, as with filtering
    # on: out of the loss normalizer in both arms
    script = {"p0": [(1.0, 1.0)], "p1": [(None, 1.0)], "p2": [(0.0, 1.0)]}
    groups, counts, seen = scripted_filtering(monkeypatch, script, enabled=False)
    assert seen == {"p0": 1, "p1": 1, "p2": 1} and counts["resampled"] == counts["replaced"] == 0
    assert [g.masked for g in groups] == [True, True, False] and counts["masked"] == 2


def _dealing_worker(rank, port, out):
    """Rank `rank` of 2: collect_groups on 4 prompts whose rewards follow the script by how often
    each prompt was sampled on either rank (`out` counts across processes): p0 and p2, rank 0's
    own, are all-equal twice; p1 and p3 are usable at once. Then a round in which rank 0's sampler
    fails."""
    gloo_rank(rank, port)
    ranks = D.setup_distributed("cpu")
    cfg = load_config(
        REPO / "configs" / "clue_qwen3_5_9b.yaml", ["rollout.group_size=2"], grpo.GRPOConfig
    )
    examples = [
        data.Example(f"p{i}", "meld_emotion", [data.Turn("A", "hi")], 0, ["joy"]) for i in range(4)
    ]
    script = {"p0": [(0.5, 0.5)] * 2 + [(1.0, 0.0)], "p2": [(0.5, 0.5)] * 2 + [(0.0, 1.0)]}
    calls = []

    def scripted_sample(sampler, batch, update, seed, counts):
        calls.append([e.id for e in batch])
        groups = []
        for example in batch:
            k = out[example.id] = out.get(example.id, 0) + 1
            rewards_ = script.get(example.id, [(1.0, 0.0)])
            samples = [[rollout.Sample([1], [t], [0.0], False)] for t in (2, 3)]
            groups.append(
                rollout.Group(example, samples, [], list(rewards_[min(k, len(rewards_)) - 1]))
            )
        return groups

    grpo.PromptSampler.sample = scripted_sample
    grpo.score_groups = lambda groups, cfg, judge: {"calls": 0, "retries": 0, "failures": 0}
    source = grpo.PromptSource([grpo.Segment("full", examples)])
    drawn = source.take(4)
    slots = [grpo.Slot(i, e, seg) for i, (e, seg) in enumerate(drawn) if i % 2 == rank]
    sampler = grpo.rollout_sampler(cfg, None, None, None, None)
    groups, counts = grpo.collect_groups(sampler, source, slots, cfg, 0, ranks)
    out[f"calls{rank}"] = calls
    out[f"groups{rank}"] = [(g.example.id, g.rewards, g.masked) for g in groups]
    out[f"resampled{rank}"] = counts["resampled"]

    def failing_sample(sampler, batch, update, seed, counts):
        if rank == 0:
            raise rollout.RolloutError("the server at X failed")
        return scripted_sample(sampler, batch, update, seed, counts)

    grpo.PromptSampler.sample = failing_sample
    slots = [grpo.Slot(i, e, seg) for i, (e, seg) in enumerate(drawn) if i % 2 == rank]
    try:
        grpo.collect_groups(sampler, source, slots, cfg, 1, ranks)
    except rollout.RolloutError as e:
        out[f"error{rank}"] = str(e)
    end_rank()


@pytest.mark.slow
def test_two_ranks_share_the_resamples_and_an_error_on_one_is_raised_on_both():
    """Without sharing, rank 0 would sample three rounds (p0 and p2 each time) while rank 1 idles
    after its first; dealt, rank 1 samples p2 again while rank 0 samples p0."""
    out = mp.Manager().dict()
    mp.spawn(_dealing_worker, args=(free_port(), out), nprocs=2)
    assert out["calls0"] == [["p0", "p2"], ["p0"], ["p0"]]
    assert out["calls1"] == [["p1", "p3"], ["p2"], ["p2"]]
    assert out["groups0"] == [("p0", [1.0, 0.0], False)]
    assert out["groups1"] == [
        ("p1", [1.0, 0.0], False),
        ("p2", [0.0, 1.0], False),
        ("p3", [1.0, 0.0], False),
    ]
    assert out["resampled0"] + out["resampled1"] == 4
    assert out["error0"] == "the server at X failed"
    assert out["error1"] == "another rank's rollouts failed: the server at X failed"


# ----------------------------------------------------------------------------- gradients


def tiny_policy(tmp_path_or_base):
    cfg = load_config(
        REPO / "configs" / "clue_qwen3_5_9b.yaml",
        [
            f"model.path={tmp_path_or_base}",
            "model.sft_adapter=null",
            "model.dtype=float32",
            "lora.rank=4",
            "lora.alpha=8",
            "optim.lr=0.0",
            "optim.grad_clip=1e9",
            "seed=3",
        ],
        grpo.GRPOConfig,
    )
    policy, tok = grpo.build_policy(cfg, D.Ranks(0, 1, torch.device("cpu")))
    with torch.no_grad():  # B != 0, so the LoRA path carries gradient into A as well
        for m in M.lora_modules(policy).values():
            m.lora_B.normal_(0, 0.05, generator=torch.Generator().manual_seed(7))
    return cfg, policy


def test_accuracy_only_and_clue_scale_the_same_informative_groups_alike(monkeypatch, assets):
    # The paper's ablation: Accuracy-Only (filtering off) against CLUE (filtering on). Here
    # one group of three is informative and the others stay all-correct or all-wrong through
    # every resampling (no replacements). The old code kept the two all-equal groups in
    # Accuracy-Only's loss normalizer (3 completions' worth of groups instead of 1), so its
    # policy-gradient step was 3x smaller at the same LR; now both arms mask them.
    script = {"p0": [(1.0, 1.0)], "p1": [(1.0, 0.0)], "p2": [(0.0, 0.0)]}
    arms = {
        name: scripted_filtering(
            monkeypatch, script, enabled=on, config=config, overrides=["filtering.replacements=0"]
        )[0]
        for name, on, config in (
            ("clue", True, "clue_qwen3_5_9b.yaml"),
            ("accuracy_only", False, "clue_accuracy_only.yaml"),
        )
    }
    assert (
        [g.masked for g in arms["clue"]]
        == [g.masked for g in arms["accuracy_only"]]
        == [True, False, True]
    )
    assert arms["clue"][1].example.id == arms["accuracy_only"][1].example.id == "p1"
    cfg, policy = tiny_policy(assets[0])
    cfg.loss.beta = 0.0  # the policy-gradient term alone
    ranks = D.Ranks(0, 1, torch.device("cpu"))
    (_, clue), (_, accuracy_only) = (
        gradients(cfg, policy, arms[name], ranks, 4) for name in ("clue", "accuracy_only")
    )
    assert any(g.abs().sum() > 0 for g in clue)
    for a, b in zip(clue, accuracy_only):
        torch.testing.assert_close(a, b)


def gradients(cfg, policy, groups, ranks, micro_batch_size):
    cfg.loss.micro_batch_size = micro_batch_size
    sequences = grpo.training_sequences(groups, grpo.advantages_by_group(groups, cfg.loss))
    batches = grpo.micro_batches(sequences, micro_batch_size, 0, ranks.device)
    optimizer = T.build_optimizer(policy, 0.0, 0.0, (0.9, 0.99))
    out = grpo.policy_update(policy, optimizer, batches, cfg, ranks)
    return out, [p.grad.clone() for p in T.optimizer_parameters(optimizer)]


def _rank_worker(rank, port, base, agg, out):
    gloo_rank(rank, port)
    ranks = D.setup_distributed("cpu")
    cfg, policy = tiny_policy(base)
    cfg.loss.agg = agg
    mine = [g for i, g in enumerate(fixed_groups()) if i % 2 == rank]  # each rank owns whole groups
    result, grads = gradients(cfg, policy, mine, ranks, micro_batch_size=2)
    out[rank] = (result["loss"], grads)
    out[f"gathered{rank}"] = grpo.gather_json({"rank": rank, "text": "é" * (rank + 1)}, ranks)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_gradients_equal_for_micro_batch_splits_and_two_ranks(assets, agg):
    base, _ = assets
    ranks = D.Ranks(0, 1, torch.device("cpu"))
    cfg, policy = tiny_policy(base)
    cfg.loss.agg = agg
    cfg.loss.beta = 0.04
    reference, ref_grads = gradients(cfg, policy, fixed_groups(), ranks, micro_batch_size=100)
    assert reference["grad_norm"] > 0
    for size in (1, 5):
        result, grads = gradients(cfg, policy, fixed_groups(), ranks, micro_batch_size=size)
        assert result["loss"] == pytest.approx(reference["loss"], abs=1e-7)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    if agg != "token-mean":
        return
    out = mp.Manager().dict()
    mp.spawn(_rank_worker, args=(free_port(), str(base), agg, out), nprocs=2)
    for rank in (0, 1):
        loss, grads = out[rank]
        assert loss == pytest.approx(reference["loss"], abs=1e-7)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert out[f"gathered{rank}"] == [{"rank": 0, "text": "é"}, {"rank": 1, "text": "éé"}]


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_packed_micro_batches_give_the_padded_update(assets, agg):
    base, _ = assets
    ranks = D.Ranks(0, 1, torch.device("cpu"))
    cfg, policy = tiny_policy(base)
    cfg.loss.agg, cfg.loss.beta = agg, 0.04
    policy.gradient_checkpointing = True
    expected, expected_grads = gradients(cfg, policy, fixed_groups(), ranks, micro_batch_size=4)
    groups = fixed_groups()
    sequences = grpo.training_sequences(groups, grpo.advantages_by_group(groups, cfg.loss))
    batches = grpo.packed_micro_batches(sequences, 24, ranks.device)
    # several sequences share a row, in fewer micro-batches than padded rows of 4 would take
    assert all(b.ids.shape[0] == 1 for b in batches) and 1 < len(batches) < len(sequences) / 2
    assert sum(b.ids.shape[1] for b in batches) == sum(len(s.ids) for s in sequences)
    optimizer = T.build_optimizer(policy, 0.0, 0.0, (0.9, 0.99))
    found = grpo.policy_update(policy, optimizer, batches, cfg, ranks)
    assert expected["grad_norm"] > 0 and expected["kl"] > 0
    for key in ("loss", "grad_norm", "entropy", "mismatch_sum", "mismatch_max", "tokens", "kl"):
        assert found[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    for a, b in zip((p.grad for p in T.optimizer_parameters(optimizer)), expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_packed_run_trains_like_a_padded_one(tmp_path):
    # test_a_learnable_reward_rises's setting: the rewards vary within groups, so every update
    # trains; a budget of 1,000 tokens packs two of its 412-token sequences in each micro-batch
    base = write_checkpoint(tmp_path / "base", seed=12, hidden=16)
    examples = write_examples(tmp_path / "train.jsonl", n=8)
    runs = {}
    for name, loss in (("padded", {}), ("packed", {"micro_batch_tokens": 1000})):
        config = run_config(
            tmp_path / name,
            (base, examples),
            "http://127.0.0.1:9/v1",
            updates=2,
            reward={"name": "accuracy_only"},
            filtering={"enabled": False},
            rollout={"prompts_per_update": 4, "group_size": 8, "max_new_tokens": 1},
            optim={"lr": 3e-2, "warmup_updates": 0, "hold_until": 100},
            loss={"micro_batch_size": 3} | loss,
        )
        grpo.main([str(config)])
        runs[name] = tmp_path / name / "run"
    padded, packed = (read_jsonl(runs[n] / "metrics.jsonl") for n in ("padded", "packed"))
    assert [m["step"] for m in packed] == [1, 2] and all(m["grad_norm"] > 0 for m in padded)
    for a, b in zip(packed, padded):
        for key in ("loss", "kl", "grad_norm", "entropy", "reward"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
        # the sampler decodes with the LoRA merged, a float32 rounding (about 1e-6) away from the
        # trainer's side path: the largest gap moves by float32 rounding between the layouts
        assert a["logp_mismatch/max"] == pytest.approx(b["logp_mismatch/max"], abs=1e-6)
    found, expected = (
        load_file(runs[n] / "adapter" / "adapter_model.safetensors") for n in ("packed", "padded")
    )
    for key in expected:
        torch.testing.assert_close(found[key], expected[key], rtol=1e-4, atol=1e-6)


def test_the_default_decode_is_static_on_cuda_and_eager_on_a_cpu(monkeypatch):
    """rollout.decode's default, auto: the step generate runs on the run's device. On this CPU,
    eager; on the device setup_distributed picks when CUDA is available (mocked), static."""
    assert grpo.RolloutSettings().decode == "auto"
    ran, decode_step = [], M.decode_step
    monkeypatch.setattr(
        M,
        "decode_step",
        lambda model, cache, decode: ran.append(decode) or decode_step(model, cache, decode),
    )
    M.generate(random_model("qwen3"), [[1, 2, 3]], 3, decode="auto")
    assert ran == ["eager"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    device = D.setup_distributed().device
    assert device == torch.device("cuda", 0) and M.resolve_decode("auto", device) == "static"
    assert M.resolve_decode("compiled", device) == "compiled"


def test_a_static_decode_run_samples_what_an_eager_one_does(tmp_path, assets, judge, monkeypatch):
    completions, made_static, make_static = {}, [], M.Cache.make_static
    monkeypatch.setattr(
        M.Cache, "make_static", lambda c, slots: made_static.append(slots) or make_static(c, slots)
    )
    for decode in ("eager", "static"):
        config = run_config(
            tmp_path / decode,
            assets,
            judge.url,
            updates=1,
            # every group kept (verl's way): a run that trains nothing would end as a failure
            filtering={"enabled": False, "mask_equal": False},
            **{"rollout.decode": decode},
        )
        grpo.main([str(config)])
        completions[decode] = [
            r["completion"] for r in read_jsonl(tmp_path / decode / "run" / "completions.jsonl")
        ]
    assert len(completions["static"]) >= 8 and completions["static"] == completions["eager"]
    assert made_static and set(made_static) == {6}  # rollout.max_new_tokens slots per row


def test_on_policy_loss_is_zero_but_the_gradient_is_not(assets):
    base, _ = assets
    cfg, policy = tiny_policy(base)
    cfg.loss.beta = 0.0
    result, grads = gradients(cfg, policy, fixed_groups(), D.Ranks(0, 1, torch.device("cpu")), 4)
    assert abs(result["loss"]) < 1e-6  # ratio 1 and centered advantages: the loss value is ~0 ...
    # ... the gradient not
    assert result["grad_norm"] > 1e-3 and max(g.abs().max().item() for g in grads) > 0
    assert result["clip_low"] == result["clip_high"] == 0


def test_several_passes_reach_the_clipped_branch(assets):
    base, _ = assets
    cfg, policy = tiny_policy(base)
    cfg.loss.passes, cfg.optim.grad_clip = 4, 1.0
    groups = fixed_groups()
    sequences = grpo.training_sequences(groups, grpo.advantages_by_group(groups, cfg.loss))
    batches = grpo.micro_batches(sequences, 4, 0, "cpu")
    optimizer = T.build_optimizer(policy, 0.05, 0.0, (0.9, 0.99))
    result = grpo.policy_update(policy, optimizer, batches, cfg, D.Ranks(0, 1, torch.device("cpu")))
    assert result["clip_low"] + result["clip_high"] > 0  # later passes move the ratio past 1 +- 0.2


def test_nonfinite_loss_skips_the_step_and_keeps_the_weights(assets):
    base, _ = assets
    cfg, policy = tiny_policy(base)
    groups = fixed_groups()
    groups[1].rewards[0] = float("nan")
    sequences = grpo.training_sequences(groups, grpo.advantages_by_group(groups, cfg.loss))
    optimizer = T.build_optimizer(policy, 0.1, 0.0, (0.9, 0.99))
    before = [p.detach().clone() for p in T.optimizer_parameters(optimizer)]
    result = grpo.policy_update(
        policy,
        optimizer,
        grpo.micro_batches(sequences, 4, 0, "cpu"),
        cfg,
        D.Ranks(0, 1, torch.device("cpu")),
    )
    assert result["skipped_nonfinite"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, T.optimizer_parameters(optimizer)))


# ----------------------------------------------------------------------------- whole runs


def test_report_to_sends_every_metric_to_tensorboard_and_an_offline_wandb_run(
    tmp_path, assets, judge, monkeypatch
):
    secret = "sk-never-logged-7d1f"
    monkeypatch.setenv("CLUE_TEST_JUDGE_KEY", secret)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = run_config(
        tmp_path,
        assets,
        judge.url,
        filtering={"resamples": 3, "replacements": 2},
        report_to=["tensorboard", "wandb"],
        **{"judge.api_key_env": "CLUE_TEST_JUDGE_KEY"},
    )
    grpo.main([str(config)])
    out = tmp_path / "run"
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    assert_sinks_hold_metrics(out, wandb_run=True)
    wandb_config, _ = wandb_offline_run(out)
    # the resolved config, naming the key's variable, never its value
    assert wandb_config["judge"]["api_key_env"] == "CLUE_TEST_JUDGE_KEY"
    assert wandb_config["rollout"]["group_size"] == 4
    logged = [p for p in (out / "wandb").rglob("*") if p.is_file()]
    logged += [p for p in (out / "tensorboard").rglob("*") if p.is_file()]
    assert logged and not [p for p in logged if secret.encode() in p.read_bytes()]


def test_a_sink_whose_package_is_missing_stops_with_one_line_before_any_model_loads(
    tmp_path, assets, monkeypatch, capsys
):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else find_spec(name, *a),
    )
    config = run_config(tmp_path, assets, "http://127.0.0.1:9/v1", report_to=["wandb"])
    with pytest.raises(SystemExit) as stop:
        grpo.main([str(config)])
    err = capsys.readouterr().err
    line = next(
        n for n, text in enumerate(config.read_text().splitlines(), 1) if "report_to" in text
    )
    assert stop.value.code == 2 and err == (
        f"config error: {config}:{line}: 'report_to': wandb needs the wandb package "
        "(pip install wandb)\n"
    )
    assert not (tmp_path / "run").exists()


def test_three_updates_write_every_output(tmp_path, assets, judge, umask_022):
    config = run_config(
        tmp_path,
        assets,
        judge.url,
        save_merged=True,
        keep_checkpoints=2,
        filtering={"resamples": 3, "replacements": 2},
    )
    grpo.main([str(config)])
    out = tmp_path / "run"
    # adapter, merged shards, checkpoints: readable by others (a vLLM server's user) like the logs
    umask_022(out)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert set(METRIC_KEYS) <= set(m), set(METRIC_KEYS) - set(m)
        assert {"rewards/c/mean", "rewards/f/mean", "rewards/IU_G/mean", "rewards/IU_G/std"} <= set(
            m
        )
        assert m["judge/calls"] > 0 and m["completions/max_length"] <= 6
    completions = read_jsonl(out / "completions.jsonl")
    assert len(completions) >= 3 * 2 * 4
    assert {"step", "id", "prompt", "completion", "reward", "c", "f", "IU_G", "advantage"} <= set(
        completions[0]
    )
    for m in metrics:  # the share of the update's completions whose reasoning opens a quotation
        texts = [r["completion"] for r in completions if r["step"] == m["step"]]
        mine = [t.rpartition("</think>")[0] if "</think>" in t else t for t in texts]
        assert m["completions/quoting"] == pytest.approx(
            sum("<evidence>" in text for text in mine) / len(mine)
        )
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-000002", "ckpt-000003"]
    assert json.loads((out / "ckpt-000003" / "state.json").read_text())["trainer"]["update"] == 3
    assert yaml.safe_load((out / "config.yaml").read_text())["reward"]["name"] == "clue"
    # the adapter's model card: base, method, the data's sha256, the final metrics, the config
    base, examples = assets
    card = (out / "adapter" / "README.md").read_text()
    assert f"- base model: `{base}`" in card and "with the `clue` reward" in card
    assert f"- `{examples}`: sha256 `{hashlib.sha256(examples.read_bytes()).hexdigest()}`" in card
    assert f"| judge/calls | {metrics[-1]['judge/calls']} |" in card
    assert f"| completions/mean_length | {metrics[-1]['completions/mean_length']:.6g} |" in card
    config_block = card.split("```yaml\n")[1].split("```")[0]
    assert yaml.safe_load(config_block) == yaml.safe_load((out / "config.yaml").read_text())
    # the adapter on the base, and the merged checkpoint, give the same logits
    base, _ = assets
    with_adapter = M.load_adapter(M.Qwen.from_pretrained(base, dtype="float32"), out / "adapter")
    merged = M.Qwen.from_pretrained(out / "merged", dtype="float32")
    ids = torch.tensor([[1, 5, 7, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), with_adapter(ids), rtol=1e-5, atol=1e-5)
    assert any(
        t.abs().max() > 0
        for k, t in load_file(out / "adapter" / "adapter_model.safetensors").items()
        if "lora_B" in k
    )  # the LoRA moved


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_result(tmp_path, assets):
    trains = {"filtering": {"resamples": 3, "replacements": 2}}  # groups trained, not all masked
    with JudgeServer(rules_backend, faults=Faults(latency=0.05)).start() as server:
        straight = run_config(tmp_path / "a", assets, server.url, **trains)
        grpo.main([str(straight)])
        killed = run_config(tmp_path / "b", assets, server.url, **trains)
        run = tmp_path / "b" / "run"
        kill_after_checkpoint([str(killed)], run, "ckpt-000002")
        assert CK.latest_checkpoint(run).name in ("ckpt-000002", "ckpt-000003")
        grpo.main([str(killed)])  # resume: auto
    assert_same_run(tmp_path / "a" / "run", run)


KILL_IN_FINAL_SAVE = """
import os, runpy, signal, sys
rename = os.replace
def replace(src, dst, *args, **kwargs):  # SIGKILL at the first rename of the final save (not a \
checkpoint's)
    if "adapter" in str(dst) and "ckpt-" not in str(dst):
        os.kill(os.getpid(), signal.SIGKILL)
    return rename(src, dst, *args, **kwargs)
os.replace = replace
sys.argv = ["grpo.py", sys.argv[1]]
runpy.run_path("grpo.py", run_name="__main__")
"""


@pytest.mark.slow
def test_a_kill_during_the_final_save_leaves_no_temporary_in_the_result(tmp_path, assets, judge):
    config = run_config(tmp_path, assets, judge.url, filtering={"resamples": 3, "replacements": 2})
    run = tmp_path / "run"
    killed = subprocess.run(
        [sys.executable, "-c", KILL_IN_FINAL_SAVE, str(config)],
        cwd=REPO,
        capture_output=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL and (run / "ckpt-000003").is_dir(), (
        killed.stderr.decode()[-2000:]
    )
    # with its card and lineage
    whole = ["README.md", "adapter_config.json", "adapter_model.safetensors", "lineage.json"]
    # absent or whole, never half-written
    assert not (run / "adapter").exists() or sorted(os.listdir(run / "adapter")) == whole
    grpo.main([str(config)])  # the rerun: resumes at its last update, then saves again
    assert sorted(os.listdir(run / "adapter")) == whole
    leftovers = [str(p.relative_to(run)) for p in run.rglob("*") if ".tmp" in p.name]
    assert not leftovers, leftovers


def test_trim_log_keeps_the_whole_lines_up_to_the_step(tmp_path):
    records = [
        {"step": 1, "completion": "a\u2028b\x85c"},
        {"step": 2, "completion": "d\u2029"},
        {"step": 3},
    ]
    path = tmp_path / "completions.jsonl"
    with MetricsWriter(path) as log:
        for record in records:
            log.write(record)
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"step": 4, "compl')  # a line torn by a kill mid-write
    grpo.trim_log(path, 2, D.Ranks(0, 1, torch.device("cpu")))
    assert path.read_text(encoding="utf-8") == "".join(
        json.dumps(r, ensure_ascii=False) + "\n" for r in records[:2]
    )


def test_trim_log_refuses_a_file_that_is_not_a_runs_log(tmp_path):
    path = tmp_path / "metrics.jsonl"
    mine = '{"step": 1}\nname,loss\n{"step": 2}\n'  # a user's own file in output_dir
    path.write_text(mine, encoding="utf-8")
    with pytest.raises(CK.CheckpointError, match=rf"^{path}:2: not a record of a run's log"):
        grpo.trim_log(path, 1, D.Ranks(0, 1, torch.device("cpu")))
    assert path.read_text(encoding="utf-8") == mine


def test_sigterm_saves_a_checkpoint_and_stops(tmp_path, assets, judge, monkeypatch):
    calls = []
    score = grpo.score_groups

    def score_then_signal(groups, cfg, judge):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return score(groups, cfg, judge)

    monkeypatch.setattr(grpo, "score_groups", score_then_signal)
    grpo.main([str(run_config(tmp_path, assets, judge.url, updates=4, save_every=10))])
    run = tmp_path / "run"
    assert [p.name for p in run.glob("ckpt-*")] == ["ckpt-000001"] and not (
        run / "adapter"
    ).exists()
    assert len(read_jsonl(run / "metrics.jsonl")) == 1


def test_judge_outage_never_crashes(tmp_path, assets, capsys):
    with JudgeServer(rules_backend, faults=Faults(fail_rate=0.3, seed=3)).start() as server:
        config = run_config(
            tmp_path, assets, server.url, filtering={"resamples": 3, "replacements": 2}
        )
        grpo.main([str(config)])
    run = tmp_path / "run"
    metrics = read_jsonl(run / "metrics.jsonl")
    completions = read_jsonl(run / "completions.jsonl")
    failures = sum(m["judge/failures"] for m in metrics)
    masked = sum(m["groups/masked"] for m in metrics)
    print(
        f"judge calls {sum(m['judge/calls'] for m in metrics)}, failures {failures}, "
        f"resampled {sum(m['groups/resampled'] for m in metrics)}, masked {masked}"
    )
    assert failures > 0 and (run / "adapter" / "adapter_model.safetensors").is_file()
    # K = 4 rows per masked group
    assert masked == sum(c["advantage"] is None for c in completions) // 4
    assert all(c["reward"] is not None for c in completions if c["advantage"] is not None)


def test_a_rejected_judge_key_stops_the_run_at_the_first_update(
    tmp_path, assets, capsys, monkeypatch
):
    """A judge answering 401 to every call is not incomplete feedback: one line naming the endpoint
    and the variable holding the key (never the key, which this server echoes back), exit status 2,
    no update made."""
    key = "sk-rejected-4b1c9e77a2"
    monkeypatch.setenv("GRPO_TEST_JUDGE_KEY", key)
    with JudgeServer(rules_backend, api_key="sk-the-right-one").start() as server:
        config = run_config(
            tmp_path, assets, server.url, **{"judge.api_key_env": "GRPO_TEST_JUDGE_KEY"}
        )
        with pytest.raises(SystemExit) as stop:
            grpo.main([str(config)])
    assert stop.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert (
        f"{server.url}/chat/completions" in err
        and "HTTP 401" in err
        and "GRPO_TEST_JUDGE_KEY" in err
    ), err
    assert key not in captured.err + captured.out and key[:8] not in err
    run = tmp_path / "run"
    # no update recorded
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text()
    assert not list(run.glob("ckpt-*")) and not (run / "adapter").exists()


def test_bad_inputs_stop_before_any_model_loads(tmp_path, assets, monkeypatch, capsys):
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(grpo.Qwen, "from_pretrained", no_load)
    bad_data = tmp_path / "bad.jsonl"
    bad_data.write_text(
        assets[1].read_text() + '{"id": "x", "task": "meld_emotion", "turns": [], "target": 0, '
        '"labels": ["happy"]}\n'
    )
    # one label of 50 MiB: the error quotes an excerpt, never the value
    huge = tmp_path / "huge.jsonl"
    huge.write_text(
        json.dumps(
            {
                "id": "x",
                "task": "meld_emotion",
                "turns": [{"speaker": "A", "text": "hi"}],
                "target": 0,
                "labels": ["a" * 52_428_800],
            }
        )
        + "\n"
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases = [
        ({"train_data": [str(bad_data)]}, f"{bad_data}:5: field 'target'"),
        (
            {"train_data": [str(huge)]},
            f"{huge}:1: field 'labels': '{'a' * 120}...' (52,428,800 characters) is",
        ),
        (
            {"train_data": [str(assets[1]), str(empty)]},
            f"'train_data': {empty}: no examples (the file is empty)",
        ),
        ({"train_data": []}, "'train_data': no data files given"),
        ({"reward.name": "clu"}, "'reward.name': unknown reward 'clu'"),
        (
            {"reward.params": {"lambda": 1.0}},
            "'reward.params.lambda': not a setting of reward 'clue'",
        ),
        ({"rollout.group_size": 1}, "'rollout.group_size' must be >= 2, got 1"),
        (
            {"rollout.engine": "vllm", "rollout.vllm": {"api_key_env": "CLUE_TEST_UNSET_KEY"}},
            "rollout.vllm.api_key_env: the environment variable CLUE_TEST_UNSET_KEY is not set",
        ),
        ({"loss.agg": "sum"}, "'loss.agg' must be one of"),
        (
            {"reward.name": "social_r1"},
            f"{assets[1]}: field 'meta.reference': reward social_r1 needs it",
        ),
    ]
    for overrides, message in cases:
        with pytest.raises(SystemExit) as stop:
            grpo.main([str(run_config(tmp_path, assets, "http://127.0.0.1:9/v1", **overrides))])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err and len(err) < 500, err[:1000]


@pytest.mark.slow
def test_a_learnable_reward_rises(tmp_path):
    """Accuracy-only on a one-token answer: the gold label is `joy` everywhere and the answer tokens
    are three of 27 and the random policy gives it about 7%; GRPO must find and reinforce it."""
    # the gold token starts at about 7%
    base = write_checkpoint(tmp_path / "base", seed=12, hidden=16)
    examples = write_examples(tmp_path / "train.jsonl", n=8)
    config = run_config(
        tmp_path,
        (base, examples),
        "http://127.0.0.1:9/v1",
        updates=10,
        save_every=100,
        reward={"name": "accuracy_only"},
        filtering={"enabled": False},
        log_completions=False,
        rollout={"prompts_per_update": 4, "group_size": 8, "max_new_tokens": 1},
        optim={"lr": 3e-2, "warmup_updates": 0, "hold_until": 100},
        loss={"beta": 0.0},
    )
    grpo.main([str(config)])
    rewards = [m["reward"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    print("mean reward per update:", " ".join(f"{r:.2f}" for r in rewards))
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"first 3 updates {first:.3f}, last 3 updates {last:.3f}")
    # seeds 1-6 measured: 0.08-0.26 -> 0.47-0.65
    assert first < 0.3 and last > max(0.4, first + 0.2)


# ---------------------------------------------------------------- Social-R1: references, then a run


def social_r1_backend(messages, params):
    """A teacher and the two SIP judges: a reference that reaches the <labels> option, four YES
    stages, and a content score that says whether a reference was shown."""
    system, user = messages[0]["content"], messages[-1]["content"]
    if system == SIP_REFERENCE_SYSTEM:
        gold = user.split("<labels>\n")[1].split("\n")[0]
        return "\n".join(
            [f"{stage}: the {stage.lower()} of the story" for stage in SIP_STAGES]
            + [f"Answer: {gold}"]
        )
    if "Encoding: <short assessment>" in system:
        return "\n".join(f"{stage}: done | YES" for stage in SIP_STAGES)
    return "against the reference | 0.7" if "<reference>" in user else "no reference | 0.1"


def test_convert_prepare_references_then_a_social_r1_run(tmp_path, assets):
    # prepare/convert.py tombench -> prepare/references.py (teacher over
    # HTTP, concurrent, resumable) -> grpo.py on the result
    items = []
    for i, n in enumerate((2, 4, 6)):
        item = {
            "STORY": f"Story {i}.",
            "QUESTION": "Where?",
            "故事": f"故事{i}。",
            "问题": "哪里？",
            "答案\nANSWER": "ABCDEF"[n - 1],
        }
        for letter in "ABCDEF"[:n]:
            item[f"OPTION-{letter}"], item[f"选项{letter}"] = f"place {letter}", f"地方{letter}"
        items.append(json.dumps(item, ensure_ascii=False))
    (tmp_path / "tom.jsonl").write_text("\n".join(items) + "\n", encoding="utf-8")
    gold, train_file = tmp_path / "gold.jsonl", tmp_path / "train.jsonl"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "prepare.convert",
            "tombench",
            str(tmp_path / "tom.jsonl"),
            str(gold),
        ],
        check=True,
        cwd=REPO,
        capture_output=True,
    )
    base, _ = assets
    # the second teacher call fails (the first goes alone: http_client.probe)
    server = JudgeServer(social_r1_backend, faults=Faults(script=("ok", "503")))
    with server.start():
        overrides = [
            f"output_dir={tmp_path / 'run'}",
            f"train_data=[{train_file}]",
            f"model.path={base}",
            "model.dtype=float32",
            "model.device=cpu",
            "model.gradient_checkpointing=false",
            "updates=1",
            "lora.rank=4",
            "lora.alpha=8",
            "rollout.prompts_per_update=2",
            "rollout.group_size=2",
            "finetune=lora",
            "rollout.max_new_tokens=4",
            "loss.micro_batch_size=4",
            f"judge.base_url={server.url}",
            "judge.retries=0",
        ]
        # the config without its content RM: R_content from the prompted judge and the references
        raw = yaml.safe_load((REPO / "configs" / "social_r1_qwen3_8b.yaml").read_text())
        del raw["content_model"]
        config = tmp_path / "prompted.yaml"
        config.write_text(yaml.safe_dump(raw))
        prep = [
            str(REPO / "configs" / "social_r1_qwen3_8b_prepare.yaml"),
            f"examples={gold}",
            f"out={train_file}",
            f"teacher.base_url={server.url}",
            "teacher.retries=0",
            "teacher.concurrency=4",
        ]
        with pytest.raises(SystemExit) as stop:
            references.main(prep)
        # 6 examples, one call failed: the 5 kept are written, the run is no success
        assert stop.value.code == 2
        assert len(dataset.load_jsonl(train_file)) == 5 and server.requests_seen == 6
        references.main(prep)  # the rerun asks only for the missing one
        assert server.requests_seen == 7
        written = dataset.load_jsonl(train_file)
        assert sorted(e.id for e in written) == sorted(e.id for e in dataset.load_jsonl(gold))
        six = next(e for e in written if e.id == "tombench-en-tom-3")
        assert len(six.meta["options"]) == 6 and six.meta["reference"].splitlines() == [
            "Encoding: the encoding of the story",
            "Interpretation: the interpretation of the story",
            "Goal: the goal of the story",
            "Response: the response of the story",
            "Answer: F",
        ]
        grpo.main([str(config), *overrides])
    (record,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    # every R_content was scored against the reference the prepare step wrote (0.1 without one)
    assert record["step"] == 1 and record["rewards/R_content/mean"] == pytest.approx(0.7)
    assert record["rewards/R_struct/mean"] == 1.0 and record["judge/failures"] == 0


def test_parse_sip_reference_is_strict():
    item = data.Example(
        "t",
        "tom_mc",
        [data.Turn("", "s")],
        None,
        ["B"],
        meta={"question": "q", "options": ["x", "y"]},
    )
    good = "Encoding: a\nInterpretation: b\nGoal: c\nResponse: d\nAnswer: B"
    assert parse_sip_reference(good, item) == good
    for bad in [
        good.replace("B", "A"),
        good.replace("Goal: c\n", ""),
        good.replace("Goal: c", "Goal:"),
        good + "\nextra",
        good.replace("Encoding", "Cues"),
    ]:
        assert parse_sip_reference(bad, item) is None, bad


def test_prepare_references_with_the_teacher_down_keeps_the_existing_file(tmp_path, capsys):
    gold, train_file = tmp_path / "gold.jsonl", tmp_path / "train.jsonl"
    dataset.save_jsonl(
        [
            data.Example(
                f"t{i}",
                "tom_mc",
                [data.Turn("", "s")],
                None,
                ["B"],
                meta={"question": "q", "options": ["x", "y"]},
            )
            for i in range(2)
        ],
        gold,
    )
    train_file.write_bytes(gold.read_bytes())  # what an earlier run wrote
    before = train_file.read_bytes()
    # another teacher (new requests): the first call answers, the second fails
    with JudgeServer(social_r1_backend, faults=Faults(script=("ok", "503"))).start() as server:
        argv = [
            str(REPO / "configs" / "social_r1_qwen3_8b_prepare.yaml"),
            f"examples={gold}",
            f"out={train_file}",
            f"teacher.base_url={server.url}",
            "teacher.retries=0",
        ]
        with pytest.raises(SystemExit) as stop:
            references.main(argv)
    assert stop.value.code == 2 and train_file.read_bytes() == before
    error = capsys.readouterr().err.strip()
    assert error.startswith(
        f"error: {train_file}: kept as it was (2 rows): this run has only 1; 1 teacher calls "
        f"failed, the first: judge at {server.url}/chat/completions: HTTP 503"
    )
    assert "\n" not in error and len(error) <= 400


def test_an_updates_metrics_hold_the_lowest_and_highest_reward_over_every_rank():
    from rollout import update_metrics

    def report(rewards):
        keys = ("tokens", "masked", "unscored", "resampled", "replaced", "truncated", "kl")
        keys += ("rollouts", "quoting")
        keys += ("entropy", "clip_low", "clip_high", "mismatch_sum", "mismatch_max")
        keys += ("generate_s", "judge_s", "train_s", "calls", "retries", "failures", "malformed")
        return {
            **dict.fromkeys(keys, 0),
            "loss": 0.0,
            "grad_norm": 0.0,
            "skipped_nonfinite": 0,
            "rewards": rewards,
            "parts": [],
            "lengths": [1],
        }

    # rank 0: a group with an unscored member; rank 1: the lowest and the highest
    metrics = update_metrics([report([[0.5, None]]), report([[0.0, 1.0]])], 1, 1e-6, 0.0)
    assert (metrics["reward_min"], metrics["reward_max"]) == (0.0, 1.0)
    assert metrics["reward"] == pytest.approx(0.5)
    nothing = update_metrics([report([[None, None]])], 1, 1e-6, 0.0)
    assert (nothing["reward_min"], nothing["reward_max"]) == (None, None)
