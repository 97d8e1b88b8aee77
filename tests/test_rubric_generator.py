"""rubric_generator.py, CARE's rubric generator data and evaluation, against real local servers (a scripted teacher
and screeners; the rules backend as generator and evaluator): targets checked by judge.care_rubric and screened, the
rows sft.py's target objective reads, the chosen-response win rate, the strategy mapping, one-line errors."""

import json
import re
import threading
from pathlib import Path

import pytest

import judge
import rubric_generator as G
import sft
from judge import JudgeConfig
from judge_server import JudgeServer, rules_backend


def rubric(weights=(0.5, 0.3, 0.2), why=True):
    out = {}
    for dim, w in zip(judge.CARE_DIMENSIONS, weights):
        out[dim] = {"weight": w, **({"rationale": f"{dim} now"} if why else {}),
                    "criteria": [f"{dim} criterion one", f"{dim} criterion two"]}
    return out


def turn(i: int, word: str) -> dict:
    return {"id": f"t{i}", "dialogue": [{"role": "user", "content": f"I feel {word} about work"},
                                        {"role": "assistant", "content": "Tell me more."},
                                        {"role": "user", "content": f"It is {word} every day"}],
            "reference": f"That sounds {word}; I understand. Could you try one small step?",
            "strategies": ["Reflection of feelings", "Providing Suggestions", "Others"]}


class Scripted:
    """Teacher and screeners by word: 'plain' gets a rubric without rationales; 'picky' fails screener 1's check;
    'split' gets scores 5 from screener 0 and 3 from screener 1; everything else passes with scores 4."""

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
    turns = [turn(0, "tired"), turn(1, "plain"), turn(2, "picky"), turn(3, "split"), turn(4, "stuck")]
    (tmp_path / "turns.jsonl").write_text("".join(json.dumps(t) + "\n" for t in turns))
    teacher, screeners = Scripted(None), [Scripted(0), Scripted(1)]
    with JudgeServer(teacher).start() as a, JudgeServer(screeners[0]).start() as b, \
            JudgeServer(screeners[1]).start() as c:
        cfg = G.GeneratorDataConfig(targets=G.TargetsConfig(
            turns=str(tmp_path / "turns.jsonl"), out=str(tmp_path / "sft.jsonl"), teacher=JudgeConfig(base_url=a.url),
            screeners=[JudgeConfig(base_url=b.url, model="s0"), JudgeConfig(base_url=c.url, model="s1")]))
        counts = G.build_targets(cfg)
        assert counts == {"turns": 5, "rubric_check_rejected": 1, "screened_out": 2, "kept": 2}
        calls = len(teacher.seen) + len(screeners[0].seen)
        assert G.build_targets(cfg) == counts and len(teacher.seen) + len(screeners[0].seen) == calls  # journaled
    assert "<strategies>\ncognitive: 0\naffective: 1\nproactive: 1\n</strategies>" in teacher.seen[0]
    assert len(screeners[0].seen) == 2 * 4  # a check and a score of the reference for each valid rubric
    rows = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["t0", "t4"]
    dialogue = [(m["role"], m["content"]) for m in turns[0]["dialogue"]]
    assert rows[0]["prompt"] == judge.care_rubric_request(dialogue).messages
    assert judge.care_rubric(json.loads(rows[0]["target"]), rationale=True) == judge.care_rubric(rubric())
    loaded = sft.load_rows(tmp_path / "sft.jsonl", "target")  # stage1's objective reads them as they are
    assert [r.target for r in loaded] == [r["target"] for r in rows]


def test_the_win_rate_counts_pairs_whose_chosen_reply_scores_higher_under_the_generated_rubric(tmp_path):
    def pair(i, chosen, rejected):
        return {"id": f"p{i}", "dialogue": [{"role": "user", "content": "I am so anxious and overwhelmed"}],
                "chosen": chosen, "rejected": rejected, "strategies": ["Question"]}

    warm = "I understand, that sounds hard. Maybe try one small step: write a list."
    pairs = [pair(0, warm, "Okay."), pair(1, warm, "Fine then."), pair(2, "Okay.", warm), pair(3, "Hmm.", "Okay.")]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    with JudgeServer(rules_backend).start() as server:
        cfg = G.GeneratorDataConfig(winrate=G.WinRateConfig(
            pairs=str(tmp_path / "pairs.jsonl"), generator=JudgeConfig(base_url=server.url, model="gen"),
            evaluator=JudgeConfig(base_url=server.url, model="eval"), output_dir=str(tmp_path / "out")))
        result = G.win_rate(cfg)
    assert (result["pairs"], result["win_rate"], result["ties"], result["unscored"]) == (4, 0.5, 1, 0)
    assert json.loads((tmp_path / "out" / "winrate.json").read_text()) == result


def test_strategies_map_to_the_three_dimensions_and_an_unknown_one_is_an_error():
    assert G.dimension_counts(["Question", "question", "Information", "Self-disclosure", "Others"]) == \
        {"cognitive": 2, "affective": 1, "proactive": 1}
    assert G.dimension_counts(["Empowerment"], {"Empowerment": "proactive"})["proactive"] == 1
    with pytest.raises(G.DataError, match="field 'strategies': unknown strategy 'Hugging'"):
        G.dimension_counts(["Hugging"])


@pytest.mark.parametrize("case, field", [("identical", "rejected"), ("strategy", "strategies"),
                                         ("ends with assistant", "dialogue"), ("missing", "chosen")])
def test_a_bad_pair_file_stops_with_one_line(tmp_path, capsys, case, field):
    good = {"id": "p", "dialogue": [{"role": "user", "content": "hi"}], "chosen": "a", "rejected": "b",
            "strategies": []}
    bad = dict(good)
    if case == "identical":
        bad["rejected"] = "a"
    elif case == "strategy":
        bad["strategies"] = ["Telepathy"]
    elif case == "ends with assistant":
        bad["dialogue"] = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
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
    root = Path(__file__).resolve().parents[1] / "configs"
    data = G.parse_cli(G.GeneratorDataConfig, [str(root / "care_generator_data.yaml")])
    assert data.targets.agreement == 0.2 and len(data.targets.screeners) == 2
    assert data.winrate.evaluator.model == "deepseek-v4-flash"
    stage1 = sft.parse_cli(sft.SFTConfig, [str(root / "care_generator_sft_qwen3_8b.yaml")])
    assert (stage1.objective, stage1.data) == ("target", data.targets.out)
