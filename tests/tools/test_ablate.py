"""tools/ablate.py (the papers' ablations in miniature) and its toy ToM task: the arm syntax, the
paired statistics and the table against hand computations, the toy stories against their own
logic, the rules SIP judges over real HTTP, and (slow) a two-arm, two-seed ablation end to end with
its resume and its refusal of a changed setting. (tests/test_ablations.py is another thing: the
paper configs' ablation rows.)"""

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

import data
import judge
import rewards
from http_client import JudgeConfig
from tools import ablate, toy_tom
from verifier import extract_quotes, verify_quote

REPO = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------- arms


def test_an_arm_is_a_reward_with_its_settings_and_grpo_settings():
    arm = ablate.parse_arm("clue:lambda_iu=0.25,filtering.enabled=false", rewards.REWARDS)
    assert (arm.reward, arm.params, arm.overrides) == (
        "clue",
        {"lambda_iu": 0.25},
        ("filtering.enabled=false",),
    )
    assert ablate.parse_arm("accuracy_only", rewards.REWARDS).params == {}
    # the config's own reward keeps the config's settings of it; another starts from its defaults
    assert ablate.reward_overrides(arm, "clue") == [
        "reward.name=clue",
        "reward.params.lambda_iu=0.25",
        "filtering.enabled=false",
    ]
    other = ablate.parse_arm("social_r1:use_struct=0", rewards.REWARDS)
    assert ablate.reward_overrides(other, "clue") == [
        "reward.name=social_r1",
        "reward.params={}",
        "reward.params.use_struct=0.0",
    ]
    assert arm.folder == "clue_lambda_iu=0.25_filtering.enabled=false"
    assert other.folder == "social_r1_use_struct=0"


@pytest.mark.parametrize(
    "text, message",
    [
        ("clu", "unknown reward 'clu'"),
        ("clue:", "nothing after ':'"),
        ("clue:lambda_iu", "'lambda_iu' is not KEY=VALUE"),
        ("clue:lambda_iu=", "'lambda_iu=' is not KEY=VALUE"),
        ("clue:lambda=0.5", "reward clue has no setting lambda (its: lambda_iu, budget)"),
        ("clue:lambda_iu=high", "lambda_iu=high is not a number"),
        ("clue:lambda_iu=1,lambda_iu=2", "lambda_iu is set twice"),
        ("clue:reward.name=correctness", "the reward is the arm's name"),
        ("clue:filtering..enabled=false", "is not KEY=VALUE"),
    ],
)
def test_a_malformed_arm_is_one_line_naming_it(text, message):
    with pytest.raises(ablate.ArmError, match="arm '" + text.replace(".", r"\.")) as caught:
        ablate.parse_arm(text, rewards.REWARDS)
    assert message in str(caught.value)


def test_an_arm_given_twice_is_refused():
    with pytest.raises(ablate.ArmError, match="an arm is given twice"):
        ablate.parse_arms(["clue", "accuracy_only", "clue"], rewards.REWARDS)


def test_command_line_errors_exit_2_before_anything_runs(tmp_path, capsys):
    for argv, message in [
        (["clue", "clue:lambda=1"], "reward clue has no setting lambda"),
        (["clue", "clue:optim.lrr=1"], "optim.lrr"),
    ]:
        with pytest.raises(SystemExit) as code:
            ablate.main([*argv, "--out", str(tmp_path / "out")])
        assert code.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit) as code:
        ablate.main(["--preset", "clue", "--task", "toy_tom", "--out", str(tmp_path / "out")])
    assert code.value.code == 2 and "runs on toy_emotion" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- statistics


def test_paired_statistics_against_a_hand_computation():
    arm, first = [0.90, 0.80, 0.70, 0.95], [0.80, 0.85, 0.60, 0.90]
    stats = ablate.paired(arm, first)
    assert stats["differences"] == pytest.approx([0.10, -0.05, 0.10, 0.05])
    assert stats["mean"] == pytest.approx(0.05)
    # sample SD: sqrt(((0.05)^2 + (0.1)^2 + (0.05)^2 + 0^2) / 3)
    assert stats["sd"] == pytest.approx(math.sqrt(0.015 / 3))
    # |d| ranks: the two 0.05s share (1 + 2) / 2, the two 0.10s (3 + 4) / 2; T+ = 3.5 + 3.5 + 1.5 =
    # 8.5, T- = 1.5. Of the 16 sign patterns, T+ >= 8.5 in 3 (all positive, or one 1.5 negative):
    # two-sided p = 2 * 3 / 16
    assert stats["wilcoxon"]["statistic"] == 1.5 and stats["wilcoxon"]["n"] == 4
    assert stats["wilcoxon"]["p"] == pytest.approx(0.375)
    assert ablate.paired([0.9, 0.8], [0.8, 0.7])["wilcoxon"] is None  # below MIN_TEST_SEEDS
    assert ablate.paired([0.9, None, 0.7], [0.8, 0.7, 0.6])["differences"] is None


def eval_record(accuracy, verified, reward, parts, seed):
    return {
        "n": 10,
        "seed": seed,
        "accuracy": accuracy,
        "invalid": 0.0,
        "verified": verified,
        "reasoning_tokens": 30.0 + seed,
        "reward": reward,
        "parts": parts,
        "yardstick": {"name": "clue", "params": {"lambda_iu": 0.5}},
    }


def test_the_table_against_hand_computed_means_sds_and_differences():
    evals = {
        ablate.SFT_ROW: {s: eval_record(0.5, 0.3, 1.0, {"c": 0.5}, s) for s in (0, 1, 2)},
        "clue": {
            0: eval_record(0.90, 0.80, 1.3, {"c": 0.9}, 0),
            1: eval_record(0.80, 0.60, 1.2, {"c": 0.8}, 1),
            2: eval_record(0.70, 0.70, 1.1, {"c": 0.7}, 2),
        },
        "accuracy_only": {
            0: eval_record(0.91, 0.20, 1.0, {"c": 0.91}, 0),
            1: eval_record(0.83, 0.10, 0.9, {"c": 0.83}, 1),
            2: eval_record(0.69, 0.30, 0.8, {"c": 0.69}, 2),
        },
    }
    results = {"task": "toy_emotion"} | ablate.summarize(
        evals, ["clue", "accuracy_only"], [0, 1, 2]
    )
    clue = results["means"]["clue"]
    assert clue["accuracy"]["mean"] == pytest.approx(0.8)
    assert clue["accuracy"]["sd"] == pytest.approx(0.1)  # sqrt((0.01 + 0 + 0.01) / 2)
    assert clue["verified"]["sd"] == pytest.approx(0.1)
    assert results["means"]["accuracy_only"]["c"]["mean"] == pytest.approx(0.81)
    assert results["means"][ablate.SFT_ROW]["reward"] == {
        "mean": 1.0,
        "sd": 0.0,
        "runs": [1.0] * 3,
    }
    verified = results["differences"]["accuracy_only"]["verified"]
    assert verified["differences"] == pytest.approx([-0.6, -0.5, -0.4])
    # three negative differences: T+ = 0, p = 2 / 2^3
    assert verified["wilcoxon"]["p"] == pytest.approx(0.25)
    assert "clue" not in results["differences"] and ablate.SFT_ROW not in results["differences"]
    table = ablate.results_markdown(results)
    row = "| clue | 80.0 ± 10.0% | 0.0 ± 0.0% | 70.0 ± 10.0% | 31.0 ± 1.0 | 1.200 ± 0.100 | 0.800"
    assert row in table
    assert f"| {ablate.SFT_ROW} | 50.0 ± 0.0% |" in table
    # accuracy: +1, +3, -1 points, mean +1.0; |d| ranks 1.5, 3, 1.5: T+ = 4.5, reached or passed
    # by 3 of the 8 sign patterns (4.5, 4.5, 6): p = 2 * 3 / 8
    assert "| accuracy_only | +1.0 (+1.0, +3.0, -1.0), p 0.75 | " in table
    assert "-50.0 (-60.0, -50.0, -40.0), p 0.25" in table
    assert "with 3 seeds no p falls below 0.25" in table


def test_changes_name_every_differing_setting():
    old = {"updates": 30, "optim": {"lr": 3e-4, "betas": [0.9, 0.99]}, "gone": 1}
    new = {"updates": 20, "optim": {"lr": 3e-4, "betas": [0.9, 0.999]}}
    assert ablate.changes(old, new) == [
        "updates: 30 -> 20",
        "optim.betas: [0.9, 0.99] -> [0.9, 0.999]",
        "gone: 1 -> None",
    ]
    assert ablate.changes(old, old) == []


# ----------------------------------------------------------------------------- the toy ToM task


def option_of(example, letter):
    return example.meta["options"][toy_tom.LETTERS.index(letter)]


def test_tom_stories_answer_by_who_saw_the_move():
    stories = toy_tom.tom_stories(300, 0, "train")
    assert stories == toy_tom.tom_stories(300, 0, "train") != toy_tom.tom_stories(300, 1, "train")
    heldout = toy_tom.tom_stories(100, 0, "heldout", frozenset(map(toy_tom.story_key, stories)))
    assert not {toy_tom.story_key(e) for e in heldout} & {toy_tom.story_key(e) for e in stories}
    kinds = set()
    for e in stories:
        words, texts, m = toy_tom.WORDS[e.language], [t.text for t in e.turns], e.meta
        left = any(line.format(who=m["who"]) in texts for line in words.leaves)
        assert left != (words.stays.format(who=m["who"]) in texts)  # one or the other
        belief = m["question"] == words.look.format(who=m["who"], thing=m["thing"])
        # the place put first is in the first line; the place moved to, in the mover's line
        wanted = m["first"] if belief and left else m["moved"]
        assert option_of(e, e.labels[0]) == words.option.format(place=wanted)
        assert m["first"] in texts[0] and len(set(m["options"])) == 4
        kinds.add((e.language, belief, left))
    assert len(kinds) == 8  # both languages, both questions, both beliefs


def test_tom_traces_answer_right_quote_the_story_and_references_parse():
    for e in toy_tom.tom_stories(40, 2, "train"):
        for kind in ("full", "short", "padded"):
            trace = toy_tom.tom_trace(e, kind)
            assert data.well_formed(trace) and data.parse_answer(trace, e) == e.labels
            quotes = extract_quotes(trace)
            assert quotes and all(verify_quote(q, [t.text for t in e.turns]) for q in quotes)
        assert judge.parse_sip_reference(e.meta["reference"], e) == e.meta["reference"]
    prompt = data.build_prompt(e)
    assert prompt.index("Story:\n" + e.turns[0].text) < prompt.index("Question: ")
    assert "exactly one of: A, B, C, D." in prompt and "\nD. " in prompt


def scored(rollouts, server, spec):
    cfg = JudgeConfig(base_url=server.url, model="rules", retries=0)
    assert rewards.judge_rollouts(rollouts, spec, cfg)["failures"] == 0
    return [(r.judged["sip_structure"], r.judged["sip_content"]) for r in rollouts]


def test_rules_sip_judges_score_the_trace_kinds_as_documented(judge):
    """Over real HTTP: a full trace has every stage in order and the reference's words (1, 1); a
    short one Encoding and Response (0.5; content capped at Interpretation, 0.5); a padded one
    as a full one; stages out of order lose those after the break; an Interpretation without the
    reference's words fails the content rule there (0.5), a missing Goal caps it at 0.7."""
    spec = rewards.RewardSpec("social_r1")
    stories = toy_tom.tom_stories(4, 3, "train")  # English, Chinese, English, Chinese
    rollouts, expected = [], []

    def add(example, completion, verdicts):
        rollouts.append(
            rewards.Rollout.from_completion(
                example, completion, count_tokens=lambda _: 40, n_completion_tokens=50
            )
        )
        expected.append(verdicts)

    for e in stories:
        for kind, verdicts in (("full", (1.0, 1.0)), ("short", (0.5, 0.5)), ("padded", (1, 1))):
            add(e, toy_tom.tom_trace(e, kind), verdicts)
        encoding, interpretation, goal, response = toy_tom.stages(e)
        answer = f"\n{data.THINK_END}\n\nAnswer: {e.labels[0]}"
        shuffled = [f"Encoding: {encoding}", f"Response: {response}"]
        shuffled += [f"Interpretation: {interpretation}", f"Goal: {goal}"]
        add(e, "\n\n".join(shuffled) + answer, (0.75, 0.7))  # Response only before the others
        no_goal = [f"Encoding: {encoding}", f"Interpretation: {interpretation}"]
        add(e, "\n\n".join([*no_goal, f"Response: {response}"]) + answer, (0.75, 0.7))
    # an Interpretation about something else: none of the reference's words
    other = "Emma drinks some tea in the garden."
    encoding, _, goal, response = toy_tom.stages(stories[0])
    blocks = [f"Encoding: {encoding}", f"Interpretation: {other}", f"Goal: {goal}"]
    text = "\n\n".join([*blocks, f"Response: {response}"])
    add(stories[0], text + f"\n{data.THINK_END}\nAnswer: {stories[0].labels[0]}", (1.0, 0.5))
    assert scored(rollouts, judge, spec) == expected


def test_the_scaled_length_window_sits_between_the_short_and_the_full_traces():
    """configs/toy_tom_grpo.yaml's R_len window, by hand: R_win(L) = sigmoid((L - 28) / 3.5) *
    sigmoid((175 - L) / 3.5); a short trace's 18 reasoning tokens get 0.054, a full one's 38 get
    0.946, and a padded trace's repetition (rho 0.29: R_rep = exp(-8 * 0.19)) costs it 78%."""
    from config import load_config
    from grpo import GRPOConfig

    params = load_config(REPO / "configs" / "toy_tom_grpo.yaml", [], GRPOConfig).reward.params
    assert params == {"len_min": 28, "len_max": 175, "len_k": 3.5}

    def sigmoid(x):
        return 1 / (1 + math.exp(-x))

    for length, value in ((18, 0.054), (38, 0.946)):
        by_hand = sigmoid((length - 28) / 3.5) * sigmoid((175 - length) / 3.5)
        assert rewards.r_win(length, 28, 175, 3.5) == pytest.approx(by_hand)
        assert by_hand == pytest.approx(value, abs=5e-4)
    padded = [toy_tom.tom_trace(e, "padded") for e in toy_tom.tom_stories(50, 0, "train")]
    rho = statistics.mean(rewards.repetition_ratio(data.split_completion(t)[0]) for t in padded)
    assert 0.25 < rho < 0.35 and rewards.r_rep(rho) < 0.3


# ----------------------------------------------------------------------------- end to end


def run_ablation(out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "tools.ablate",
        "clue:filtering.enabled=false",
        "accuracy_only:filtering.enabled=false",
        "--seeds",
        "0",
        "1",
        "--out",
        str(out),
        "--train",
        "24",
        "--heldout",
        "6",
        # a few steps; all-equal groups (three SFT steps answer little) kept in the loss, so that
        # the runs train something
        *("--grpo", "updates=2", "--grpo", "rollout.prompts_per_update=2"),
        *("--grpo", "rollout.group_size=2", "--grpo", "rollout.max_new_tokens=24"),
        *("--grpo", "filtering.mask_equal=false"),
        *extra,
    ]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_two_arms_two_seeds_end_to_end_resumed_and_a_changed_setting_refused(tmp_path):
    out = tmp_path / "ablation"
    done = run_ablation(out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    arms = ["clue:filtering.enabled=false", "accuracy_only:filtering.enabled=false"]
    folders = {a: ablate.parse_arm(a, rewards.REWARDS).folder for a in arms}
    paths = {(a, s): out / f"seed{s}" / folders[a] / "eval.json" for a in arms for s in (0, 1)} | {
        (ablate.SFT_ROW, s): out / f"seed{s}" / "sft_eval.json" for s in (0, 1)
    }
    evals = {key: json.loads(path.read_text()) for key, path in paths.items()}
    for (arm, seed), e in evals.items():
        # each eval.json against its own completions: accuracy and verified quotes recounted
        name = "sft_completions.jsonl" if arm == ablate.SFT_ROW else "completions.jsonl"
        records = [json.loads(line) for line in (paths[arm, seed].parent / name).open()]
        assert len(records) == e["n"] == 6 and e["arm"] == arm and e["seed"] == seed
        assert e["accuracy"] == sum(r["answer"] == r["labels"] for r in records) / 6
        assert e["verified"] == sum(r["verified"] for r in records) / 6
        assert e["yardstick"]["name"] == "clue" and set(e["parts"]) == {"c", "f", "IU_G"}
    results = json.loads((out / "results.json").read_text())
    assert list(results["means"]) == [ablate.SFT_ROW, *arms] and results["seeds"] == [0, 1]
    for row in results["means"]:
        for key in ("accuracy", "invalid", "verified", "reasoning_tokens", "reward", "IU_G"):
            values = [evals[row, s]["parts" if key == "IU_G" else key] for s in (0, 1)]
            values = [v["IU_G"] if key == "IU_G" else v for v in values]
            stat = results["means"][row][key]
            assert stat["mean"] == pytest.approx(sum(values) / 2), (row, key)
            assert stat["sd"] == pytest.approx(abs(values[0] - values[1]) / math.sqrt(2))
    difference = results["differences"][arms[1]]["reward"]
    assert difference["differences"] == pytest.approx(
        [evals[arms[1], s]["reward"] - evals[arms[0], s]["reward"] for s in (0, 1)]
    )
    assert difference["wilcoxon"] is None  # two seeds: no test
    table = (out / "results.md").read_text()
    assert table.strip() in done.stdout and "no paired test below 3 seeds" in table
    assert "[seed 1 | accuracy_only:filtering.enabled=false | run " in done.stdout
    assert "| ablation ETA " in done.stdout
    if (out / "ablation.png").exists():
        assert (out / "ablation.png").stat().st_size > 0

    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    again = run_ablation(out)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "6 runs done earlier are kept" in again.stdout and "step 1/" not in again.stdout
    unchanged = [p for p in stamps if p.name not in ("results.md", "results.json", "ablation.png")]
    assert all(p.stat().st_mtime_ns == stamps[p] for p in unchanged)
    assert json.loads((out / "results.json").read_text())["means"] == results["means"]

    for extra, named in (
        (("--grpo", "updates=3"), "config.updates: 2 -> 3"),
        (("--heldout", "7"), "demo.json: heldout: 6 -> 7"),
    ):
        refused = run_ablation(out, *extra)
        assert refused.returncode == 2 and named in refused.stderr, refused.stderr
        assert "not mixed in" in refused.stderr
    assert all(p.stat().st_mtime_ns == stamps[p] for p in unchanged)
