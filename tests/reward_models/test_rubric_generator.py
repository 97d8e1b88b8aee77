"""CARE's rubric generator (reward_models/rubric_generator.py, rewards.care_generator) against real
local servers (a scripted teacher and screeners; the rules backend as generator and evaluator):
targets checked by judge.care_rubric and screened, the rows sft.py's target objective reads, the
chosen-response win rate, the strategy mapping, one-line errors, the generator reward's parts
against hand values, and a short generator GRPO run over HTTP."""

import json
import re
import threading
from pathlib import Path

import pytest

import judge
import rewards
import sft
from data import Example, Turn
from http_client import JudgeConfig
from judge_server import JudgeServer, rules_backend
from reward_models import rubric_generator as G


def rubric(weights=(0.5, 0.3, 0.2), why=True):
    out = {}
    for dim, w in zip(judge.CARE_DIMENSIONS, weights):
        out[dim] = {
            "weight": w,
            **({"rationale": f"{dim} now"} if why else {}),
            "criteria": [f"{dim} criterion one", f"{dim} criterion two"],
        }
    return out


def turn(i: int, word: str) -> dict:
    return {
        "id": f"t{i}",
        "dialogue": [
            {"role": "user", "content": f"I feel {word} about work"},
            {"role": "assistant", "content": "Tell me more."},
            {"role": "user", "content": f"It is {word} every day"},
        ],
        "reference": f"That sounds {word}; I understand. Could you try one small step?",
        "strategies": ["Reflection of feelings", "Providing Suggestions", "Others"],
    }


class Scripted:
    """Teacher and screeners by word: 'plain' gets a rubric without rationales; 'picky' fails
    screener 1's check; 'split' gets scores 5 from screener 0 and 3 from screener 1; everything else
    passes with scores 4."""

    def __init__(self, index):
        self.index, self.seen, self.lock = index, [], threading.Lock()

    def __call__(self, messages, params):
        system, user = messages[0]["content"], messages[-1]["content"]
        with self.lock:
            self.seen.append(user)
        if system == G._TARGET_SYSTEM:
            return json.dumps(rubric(why="plain" not in user))
        if system == G._SCREEN_SYSTEM:
            verdict = "FAIL" if "picky" in user and self.index == 1 else "PASS"
            return "\n".join(f"{d}: scripted | {verdict}" for d in judge.CARE_DIMENSIONS)
        score = (5 if self.index == 0 else 3) if "split" in user else 4
        items = re.findall(r"^(cognitive|affective|proactive) (\d+):", user, re.MULTILINE)
        return "\n".join(f"{d} {i}: scripted | {score}" for d, i in items)


def test_targets_keep_checked_and_screened_rubrics_as_rows_for_sfts_target_objective(tmp_path):
    turns = [
        turn(0, "tired"),
        turn(1, "plain"),
        turn(2, "picky"),
        turn(3, "split"),
        turn(4, "stuck"),
    ]
    (tmp_path / "turns.jsonl").write_text("".join(json.dumps(t) + "\n" for t in turns))
    teacher, screeners = Scripted(None), [Scripted(0), Scripted(1)]
    with (
        JudgeServer(teacher).start() as a,
        JudgeServer(screeners[0]).start() as b,
        JudgeServer(screeners[1]).start() as c,
    ):
        cfg = G.GeneratorDataConfig(
            targets=G.TargetsConfig(
                turns=str(tmp_path / "turns.jsonl"),
                out=str(tmp_path / "sft.jsonl"),
                teacher=JudgeConfig(base_url=a.url),
                screeners=[
                    JudgeConfig(base_url=b.url, model="s0"),
                    JudgeConfig(base_url=c.url, model="s1"),
                ],
            )
        )
        counts = G.build_targets(cfg)
        assert counts == {"turns": 5, "rubric_check_rejected": 1, "screened_out": 2, "kept": 2}
        calls = len(teacher.seen) + len(screeners[0].seen)
        assert (
            G.build_targets(cfg) == counts and len(teacher.seen) + len(screeners[0].seen) == calls
        )  # journaled
    assert (
        "<strategies>\ncognitive: 0\naffective: 1\nproactive: 1\n</strategies>" in teacher.seen[0]
    )
    # a check and a score of the reference for each valid rubric
    assert len(screeners[0].seen) == 2 * 4
    rows = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["t0", "t4"]
    dialogue = [(m["role"], m["content"]) for m in turns[0]["dialogue"]]
    assert rows[0]["prompt"] == judge.care_rubric_request(dialogue).messages
    assert judge.care_rubric(json.loads(rows[0]["target"]), rationale=True) == judge.care_rubric(
        rubric()
    )
    # stage1's objective reads them as they are
    loaded = sft.load_rows(tmp_path / "sft.jsonl", "target")
    assert [r.target for r in loaded] == [r["target"] for r in rows]


def test_the_win_rate_counts_pairs_whose_chosen_reply_scores_higher_under_the_generated_rubric(
    tmp_path,
):
    def pair(i, chosen, rejected):
        return {
            "id": f"p{i}",
            "dialogue": [{"role": "user", "content": "I am so anxious and overwhelmed"}],
            "chosen": chosen,
            "rejected": rejected,
            "strategies": ["Question"],
        }

    warm = "I understand, that sounds hard. Maybe try one small step: write a list."
    pairs = [
        pair(0, warm, "Okay."),
        pair(1, warm, "Fine then."),
        pair(2, "Okay.", warm),
        pair(3, "Hmm.", "Okay."),
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    with JudgeServer(rules_backend).start() as server:
        cfg = G.GeneratorDataConfig(
            winrate=G.WinRateConfig(
                pairs=str(tmp_path / "pairs.jsonl"),
                generator=JudgeConfig(base_url=server.url, model="gen"),
                evaluator=JudgeConfig(base_url=server.url, model="eval"),
                output_dir=str(tmp_path / "out"),
            )
        )
        result = G.win_rate(cfg)
    assert (result["pairs"], result["win_rate"], result["ties"], result["unscored"]) == (
        4,
        0.5,
        1,
        0,
    )
    assert json.loads((tmp_path / "out" / "winrate.json").read_text()) == result


def test_care_priorities_weigh_the_dimensions_by_turn_and_emotion_as_a_hand_count(tmp_path, capsys):
    """CARE's Figures 3, 4 and 9 from the rubrics a win-rate run's generator wrote: a scripted
    generator weighs (cognitive, affective, proactive) by the seeker's words; per turn and per
    emotion, the mean weights and the share of rubrics each dimension strictly leads, by hand."""
    weights = {"worried": (0.5, 0.3, 0.2), "down": (0.2, 0.5, 0.3), "again": (0.4, 0.4, 0.2)}

    def generator(messages, params):
        if messages[0]["content"] == judge.CARE_RUBRIC_SYSTEM:
            word = next(w for w in weights if w in messages[-1]["content"])
            return json.dumps(rubric(weights[word], why=False))
        return rules_backend(messages, params)

    def pair(i, messages, emotion):
        dialogue = [{"role": r, "content": c} for r, c in messages]
        return {"id": f"p{i}", "dialogue": dialogue, "chosen": "I hear you.", "rejected": "Ok."} | {
            "strategies": [],
            "emotion": emotion,
        }

    pairs = [
        pair(0, [("user", "I am worried")], "anxiety"),
        pair(1, [("user", "I feel down")], "sadness"),
        pair(2, [("user", "hi"), ("assistant", "hello"), ("user", "it happened again")], "anxiety"),
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    with JudgeServer(generator).start() as server:
        cfg = G.GeneratorDataConfig(
            winrate=G.WinRateConfig(
                pairs=str(tmp_path / "pairs.jsonl"),
                generator=JudgeConfig(base_url=server.url, model="gen"),
                evaluator=JudgeConfig(base_url=server.url, model="eval"),
                output_dir=str(tmp_path / "out"),
            )
        )
        G.win_rate(cfg)
    found = G.care_priorities(cfg)  # reads the journal: no server
    approx = pytest.approx
    assert found["turn"]["1"]["n"] == 2 and found["turn"]["2"]["n"] == 1
    assert found["turn"]["1"]["weights"] == approx(
        {"cognitive": 0.35, "affective": 0.4, "proactive": 0.25}
    )
    assert found["turn"]["1"]["dominant"] == approx(
        {"cognitive": 0.5, "affective": 0.5, "proactive": 0.0, "tie": 0.0}
    )
    assert found["turn"]["2"]["dominant"]["tie"] == 1.0  # 0.4 and 0.4: no strict leader
    assert found["emotion"]["anxiety"]["weights"] == approx(
        {"cognitive": 0.45, "affective": 0.35, "proactive": 0.2}
    )
    assert found["emotion"]["anxiety"]["dominant"] == approx(
        {"cognitive": 0.5, "affective": 0.0, "proactive": 0.0, "tie": 0.5}
    )
    assert found["emotion"]["sadness"]["dominant"]["affective"] == 1.0
    saved = json.loads((tmp_path / "out" / "priorities.json").read_text())
    assert saved["rubrics"] == 3 and saved["turn"] == json.loads(json.dumps(found["turn"]))
    assert (
        "| 1 | 2 | 0.350 | 0.400 | 0.250 | 50.0% | 50.0% | 0.0% | 0.0% |" in capsys.readouterr().out
    )


def test_strategies_map_to_the_three_dimensions_and_an_unknown_one_is_an_error():
    assert G.dimension_counts(
        ["Question", "question", "Information", "Self-disclosure", "Others"]
    ) == {"cognitive": 2, "affective": 1, "proactive": 1}
    assert G.dimension_counts(["Empowerment"], {"Empowerment": "proactive"})["proactive"] == 1
    with pytest.raises(G.DataError, match="field 'strategies': unknown strategy 'Hugging'"):
        G.dimension_counts(["Hugging"])


@pytest.mark.parametrize(
    "case, field",
    [
        ("identical", "rejected"),
        ("strategy", "strategies"),
        ("ends with assistant", "dialogue"),
        ("missing", "chosen"),
    ],
)
def test_a_bad_pair_file_stops_with_one_line(tmp_path, capsys, case, field):
    good = {
        "id": "p",
        "dialogue": [{"role": "user", "content": "hi"}],
        "chosen": "a",
        "rejected": "b",
        "strategies": [],
    }
    bad = dict(good)
    if case == "identical":
        bad["rejected"] = "a"
    elif case == "strategy":
        bad["strategies"] = ["Telepathy"]
    elif case == "ends with assistant":
        bad["dialogue"] = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
        ]
    else:
        del bad["chosen"]
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    config = tmp_path / "w.yaml"
    config.write_text(f"winrate: {{pairs: {path}, output_dir: {tmp_path / 'out'}}}\n")
    with pytest.raises(SystemExit) as stop:
        G.main(["care_winrate", str(config)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: {path}:2: field '{field}'"), err


def test_the_generator_configs_parse_with_the_papers_values():
    root = Path(__file__).resolve().parents[2] / "configs"
    data = G.parse_cli(G.GeneratorDataConfig, [str(root / "care_generator_data.yaml")])
    assert data.targets.agreement == 0.2 and len(data.targets.screeners) == 2
    assert data.winrate.evaluator.model == "deepseek-v4-flash"
    stage1 = sft.parse_cli(sft.SFTConfig, [str(root / "care_generator_sft_qwen3_8b.yaml")])
    assert (stage1.objective, stage1.data) == ("target", data.targets.out)


# ------------------------------------------------------------- the generator's reward (Section 3.3)


def generator_rollout(completion, counts=None, chosen=None, rejected=None):
    example = Example(
        "p",
        "care_rubric",
        [Turn("user", "I am overwhelmed")],
        None,
        [],
        meta={
            "prompt": [{"role": "user", "content": "x"}],
            "chosen": "a",
            "rejected": "b",
            "dimension_counts": counts or {"cognitive": 2, "affective": 1, "proactive": 0},
        },
    )
    judged = {"care_chosen_scores": chosen, "care_rejected_scores": rejected}
    return rewards.Rollout.from_completion(
        example, completion, count_tokens=lambda _: 0, n_completion_tokens=9, judged=judged
    )


def test_the_generator_reward_parts_match_hand_values():
    weights = {"cognitive": 0.5, "affective": 0.3, "proactive": 0.2}
    # R_pri: pairs the counts order, (clip(dw / 0.3) + 1)
    # / 2 each: (0.2 -> 5/6, 0.3 -> 1, 0.1 -> 2/3) / 3
    assert rewards.priority_term(
        weights, {"cognitive": 2, "affective": 1, "proactive": 0}, 0.3
    ) == pytest.approx((5 / 6 + 1 + 2 / 3) / 3)
    assert rewards.priority_term(
        weights, {"cognitive": 0, "affective": 3, "proactive": 0}, 0.3
    ) == pytest.approx(
        (1 / 6 + 2 / 3) / 2
    )  # affective over cognitive (-0.2) and over proactive (+0.1)
    # no order: no signal
    assert rewards.priority_term(weights, dict.fromkeys(weights, 1), 0.3) == 0.5
    # R_cmp = (clip((S_c - S_r) / 0.7) + 1) / 2 on the 0-5 scale
    assert [
        rewards.comparison_term(c, r, 0.7) for c, r in [(4, 3.65), (4, 3), (3, 3.7), (3, 3)]
    ] == pytest.approx([0.75, 1.0, 0.0, 0.5])
    text = json.dumps(rubric())  # weights 0.5 / 0.3 / 0.2 with rationales
    # 0.5 .8 + 0.3 .8 + 0.2 .4 = .72 -> 3.6
    chosen = {"cognitive": [4, 4], "affective": [5, 3], "proactive": [2, 2]}
    rejected = {"cognitive": [3, 3], "affective": [3, 3], "proactive": [3, 3]}  # 0.6 -> 3.0
    r = generator_rollout(text, chosen=chosen, rejected=rejected)
    parts = {name: part(r, {}) for name, part in rewards.REWARDS["care_generator"].parts.items()}
    r_cmp, r_pri = (0.6 / 0.7 + 1) / 2, (5 / 6 + 1 + 2 / 3) / 3
    assert parts == pytest.approx({"R_fmt": 1.0, "R_cmp": r_cmp, "R_pri": r_pri})
    assert rewards.score(r, rewards.RewardSpec("care_generator")) == pytest.approx(
        1 + r_cmp + 0.1 * r_pri
    )
    assert rewards.score(
        r, rewards.RewardSpec("care_generator", {"lambda_priority": 0.5, "tau": 1.2})
    ) == pytest.approx(1 + (0.6 / 1.2 + 1) / 2 + 0.5 * r_pri)
    # the format term: no rationale, not JSON, or text around it -> 0 (and nothing to score)
    for bad in (json.dumps(rubric(why=False)), "not a rubric", text + " Hope this helps."):
        r = generator_rollout(bad, chosen=chosen, rejected=rejected)
        assert rewards.score(r, rewards.RewardSpec("care_generator")) == 0.0
        assert rewards.REWARDS["care_generator"].parts["R_fmt"](r, {}) == 0.0
    assert (
        rewards.score(
            generator_rollout(
                "<think>\nweighing it\n</think>\n" + text, chosen=chosen, rejected=rejected
            ),
            rewards.RewardSpec("care_generator"),
        )
        > 1
    )
    # missing evaluator scores: feedback incomplete, None
    assert (
        rewards.score(generator_rollout(text, chosen=chosen), rewards.RewardSpec("care_generator"))
        is None
    )


def test_a_short_generator_grpo_run_end_to_end_over_http(tmp_path):
    """The policy is the generator: its one-token completions are whole rubrics (six valid, two
    without rationales), the rules backend scores both replies of each pair under them, and every
    logged part follows the formulas."""
    from helpers import grpo_checkpoint as write_checkpoint
    from helpers import read_jsonl, run_config

    import grpo

    weights = [
        (0.5, 0.3, 0.2),
        (0.2, 0.3, 0.5),
        (0.34, 0.33, 0.33),
        (0.1, 0.8, 0.1),
        (0.6, 0.2, 0.2),
        (0.25, 0.25, 0.5),
    ]
    rubrics = [json.dumps(rubric(w)) for w in weights] + [
        json.dumps(rubric(w, why=False)) for w in weights[:2]
    ]
    base = write_checkpoint(tmp_path / "base", words=rubrics)
    warm = "I understand, that sounds hard. Try one small step: write a list."
    pairs = [
        {
            "id": f"p{i}",
            "dialogue": [{"role": "user", "content": f"I am so anxious about {topic}"}],
            "chosen": warm,
            "rejected": "Okay.",
            "strategies": strategies,
        }
        for i, (topic, strategies) in enumerate(
            [
                ("work", ["Question", "Question", "Reflection of feelings"]),
                ("exams", ["Providing Suggestions"]),
            ]
        )
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    G.preference_examples(
        G.GeneratorDataConfig(
            rl=G.RLDataConfig(str(tmp_path / "pairs.jsonl"), str(tmp_path / "rl.jsonl"))
        )
    )
    with JudgeServer(rules_backend).start() as evaluator:
        config = run_config(
            tmp_path,
            (base, tmp_path / "rl.jsonl"),
            evaluator.url,
            updates=2,
            reward={"name": "care_generator"},
            filtering={"enabled": False},
            rollout={"prompts_per_update": 2, "group_size": 6, "max_new_tokens": 1},
        )
        grpo.main([str(config)])
    records = read_jsonl(tmp_path / "run" / "completions.jsonl")
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    counts = {
        "p0": {"cognitive": 2, "affective": 1, "proactive": 0},
        "p1": {"cognitive": 0, "affective": 0, "proactive": 1},
    }
    valid = [r for r in records if r["R_fmt"] == 1.0]
    assert len(records) == 24 and valid and len(valid) < 24
    # both replies, valid rubrics only
    assert sum(m["judge/calls"] for m in metrics) == 2 * len(valid)
    for r in records:
        if r["R_fmt"] == 0.0:
            assert r["completion"] in rubrics[6:] or r["completion"] not in rubrics
            assert r["reward"] == 0.0 and r["R_cmp"] is None and r["R_pri"] is None
            continue
        w = dict(zip(judge.CARE_DIMENSIONS, weights[rubrics.index(r["completion"])]))
        assert r["R_pri"] == pytest.approx(rewards.priority_term(w, counts[r["id"]], 0.3))
        assert r["R_cmp"] > 0.5  # the warm reply wins under every rubric of the rules backend
        assert r["reward"] == pytest.approx(1 + r["R_cmp"] + 0.1 * r["R_pri"])
    assert (
        "rewards/R_cmp/mean" in metrics[0]
        and (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
    )


def test_the_generator_rl_config_and_the_care_run_point_at_each_other():
    import grpo
    from config import load_config

    root = Path(__file__).resolve().parents[2] / "configs"
    rl = load_config(root / "care_generator_qwen3_8b.yaml", [], grpo.GRPOConfig)
    assert (rl.reward.name, rl.reward.params) == (
        "care_generator",
        {"tau": 0.7, "lambda_priority": 0.1, "gamma": 0.3},
    )
    assert rl.rollout.enable_thinking is False and rl.model.path.startswith(
        "runs/care_generator_sft_qwen3_8b"
    )
    data = G.parse_cli(G.GeneratorDataConfig, [str(root / "care_generator_data.yaml")])
    assert rl.train_data == [data.rl.out]
    from dialogue.rl import DialogueConfig

    care = load_config(root / "care_qwen2_5_7b.yaml", [], DialogueConfig)
    # the same served generator
    assert care.dialogue.rubric_judge.model == data.winrate.generator.model


def test_generator_examples_without_usable_counts_or_replies_stop_the_run_before_training():
    good = generator_rollout("x").example
    rewards.check_reward_data(rewards.RewardSpec("care_generator"), [good])
    for meta, field in [
        (
            {"dimension_counts": {"cognitive": -1, "affective": 0, "proactive": 0}},
            "dimension_counts",
        ),
        ({"dimension_counts": {"cognitive": 1, "affective": 0}}, "dimension_counts"),
        ({"chosen": " "}, "chosen"),
    ]:
        bad = Example("q", "care_rubric", good.turns, None, [], meta=good.meta | meta)
        with pytest.raises(
            rewards.data.DataError,
            match=f"field 'meta.{field}': reward care_generator needs it.*: q",
        ):
            rewards.check_reward_data(rewards.RewardSpec("care_generator"), [good, bad])
