"""Dataset converters: the real public files under `shared_data` (counts checked against the numbers
the datasets publish) and small hand-made files in tests/fixtures/ for the formats we do not
have."""

import csv
import json
import re
import resource
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from data import (
    DataError,
    Example,
    Turn,
    build_prompt,
    parse_answer,
    render_conversation,
    visible_turns,
)
from dataset import load_jsonl
from dialogue import play as dialogue
from prepare import emollm_rows as emollm_data
from prepare.convert import (
    convert,
    convert_ccu,
    convert_dialogue_csv,
    convert_ecf,
    convert_emobench,
    convert_empathetic_dialogues,
    convert_hitom,
    convert_iclr,
    convert_meddialog,
    convert_mmlu,
    convert_motivebench,
    convert_msdialog,
    convert_simpletom,
    convert_socialiqa,
    convert_tactfultom,
    convert_tombench,
    convert_wiki_power,
    main,
    stratified_sample,
)

FIXTURES = Path(__file__).parents[1] / "fixtures"


def dialogues(examples):
    return {tuple((t.speaker, t.text) for t in e.turns) for e in examples}


# ----------------------------------------------------------------------------- MELD, CPED, ECF


def test_meld_dev_matches_published_counts(shared_data):
    examples = convert_dialogue_csv(shared_data / "meld" / "dev_sent_emo.csv", "meld")
    assert len(examples) == 1109 and len(dialogues(examples)) == 114
    # MELD paper, Table 3 (dev): the label distribution of the 1,109 utterances.
    assert Counter(e.labels[0] for e in examples) == {
        "neutral": 470,
        "joy": 163,
        "anger": 153,
        "surprise": 150,
        "sadness": 111,
        "fear": 40,
        "disgust": 22,
    }
    first = examples[0]
    assert first.turns[0] == Turn("Phoebe", "Oh my God, he’s lost it. He’s totally lost it.")
    assert (first.target, first.labels, first.task, first.language) == (
        0,
        ["sadness"],
        "meld_emotion",
        "en",
    )
    second = examples[1]  # the same dialogue, next target; CRLF never leaks into the text
    assert second.turns is first.turns and second.target == 1 and second.labels == ["surprise"]
    assert not any("\r" in t.text for e in examples for t in e.turns)


def test_meld_train_matches_published_counts(shared_data):
    examples = convert_dialogue_csv(shared_data / "meld" / "train_sent_emo.csv", "meld")
    assert len(examples) == 9989 and len(dialogues(examples)) == 1038
    assert Counter(e.labels[0] for e in examples) == {
        "neutral": 4710,
        "joy": 1743,
        "surprise": 1205,
        "anger": 1109,
        "sadness": 683,
        "disgust": 271,
        "fear": 268,
    }


def test_cped_valid_counts_and_catch_all(shared_data):
    examples = convert_dialogue_csv(shared_data / "cped" / "valid_split.csv", "cped")
    emotion = [e for e in examples if e.task == "cped_emotion"]
    acts = [e for e in examples if e.task == "cped_dialog_act"]
    # README: 11,137 utterances, 934 dialogues
    assert len(emotion) == 11137 and len(dialogues(emotion)) == 934
    # The 150 utterances whose act is the catch-all "other" are context only, never targets.
    assert len(acts) == 11137 - 150 and not any(e.labels == ["other"] for e in acts)
    assert {e.language for e in examples} == {"zh"}
    first = emotion[0]  # the BOM is not part of the first column name: the first row parsed
    assert (first.turns[0].speaker, first.turns[0].text, first.labels) == (
        "于春晓",
        "怎么了",
        ["astonished"],
    )
    # The first "other" utterance (read here with the csv module) is context for the next target.
    with open(shared_data / "cped" / "valid_split.csv", encoding="utf-8-sig", newline="") as f:
        rows = list(csv.DictReader(f))
    k = next(k for k, row in enumerate(rows) if row["DA"] == "other")
    position = sum(row["Dialogue_ID"] == rows[k]["Dialogue_ID"] for row in rows[:k])
    following = next(
        e
        for e in acts
        if e.id == f"valid_split-{rows[k]['Dialogue_ID']}-{position + 1}-cped_dialog_act"
    )
    assert visible_turns(following)[position].text == rows[k]["Utterance"]
    assert not any(
        e.id == f"valid_split-{rows[k]['Dialogue_ID']}-{position}-cped_dialog_act" for e in acts
    )


def test_cped_stratified_sample_is_fixed_per_seed(shared_data):
    examples = convert_dialogue_csv(shared_data / "cped" / "valid_split.csv", "cped")
    sample = stratified_sample(examples, 40, seed=3)
    counts = Counter((e.task, e.labels[0]) for e in sample)
    assert counts[("cped_emotion", "grateful")] == 13 and counts[("cped_emotion", "neutral")] == 40
    assert counts[("cped_dialog_act", "appreciation")] == 5 and max(counts.values()) == 40
    assert [e.id for e in stratified_sample(examples, 40, seed=3)] == [e.id for e in sample]
    assert [e.id for e in stratified_sample(examples, 40, seed=4)] != [e.id for e in sample]
    positions = {e.id: i for i, e in enumerate(examples)}
    assert [positions[e.id] for e in sample] == sorted(positions[e.id] for e in sample)


def test_ecf_counts_causes_and_detokenized_text(shared_data):
    examples = convert_ecf(shared_data / "ecf" / "Subtask_1_train.json")
    # README: 1,374 conversations
    assert len(examples) == 13619 and len(dialogues(examples)) == 1374
    first = examples[0]
    assert first.turns[0].text == (
        "Alright, so I am back in high school, I am standing in the middle of the "
        "cafeteria, and I realize I am totally naked."
    )
    # conversation 1: "3_surprise" is caused by utterances 1 and 3 (the target itself)
    third = examples[2]
    assert third.labels == ["surprise"]
    assert third.turns[2].text == "Then I look down, and I realize there is a phone... there."
    assert third.meta["causes"] == [
        {"turn": 0, "span": "I realize I am totally naked."},
        {"turn": 2, "span": "Then I look down, and I realize there is a phone... there."},
    ]
    n_causes = 0
    for e in examples:
        for cause in e.meta.get("causes", []):
            n_causes += 1
            assert cause["turn"] <= e.target and cause["span"] in e.turns[cause["turn"]].text
    # 9,292 distinct pairs in the file, minus those whose cause comes later
    assert 8000 < n_causes < 9292


# ----------------------------------------------------------------------------- ToMBench


def test_tombench_both_languages_and_quirks(shared_data):
    examples = convert_tombench(shared_data / "tombench")
    assert len(examples) == 2 * 2860
    english = [e for e in examples if e.language == "en"]
    chinese = [e for e in examples if e.language == "zh"]
    assert len(english) == len(chinese) == 2860
    # README: 483 items have only options A and B (C and
    # D are NaN); one item lacks C/D in Chinese only.
    assert sum(len(e.meta["options"]) == 2 for e in english) == 483
    assert sum(len(e.meta["options"]) == 2 for e in chinese) == 484
    assert all(e.labels[0] in "ABCD"[: len(e.meta["options"])] for e in examples)
    by_id = {e.id: e for e in examples}
    desires = by_id["tombench-en-Multiple Desires-1"]  # the file with a bare NaN parsed
    assert desires.task == "tom_mc" and desires.turns[0].speaker == ""
    odd_answer = by_id["tombench-en-Knowledge-Attention Links-11"]  # its answer field is "A. "
    assert odd_answer.labels == ["A"]
    prefixed = by_id["tombench-zh-Faux-pas Recognition Test-80"]  # options "A. 记得", "B. 不记得"
    assert prefixed.meta["options"] == ["记得", "不记得"]
    belief = by_id["tombench-en-False Belief Task-1"]
    assert belief.meta["question"] == "Where is the cabbage now?" and belief.labels == ["A"]
    assert belief.meta["options"] == ["Backpack", "Handbag", "Tote bag", "Briefcase"]
    assert belief.meta["ability"] == "Belief"
    assert belief.meta["sub_ability"] == "Belief: Location false beliefs"
    assert "\nA. Backpack\nB. Handbag\nC. Tote bag\nD. Briefcase" in build_prompt(belief)


def test_tombench_abilities_are_the_six_of_social_r1s_tables(shared_data):
    # Tables 8 and 11 break ToMBench down by six abilities; the release's ABILITY strings name
    # 33 sub-abilities ("Belief: Location false beliefs"), the ability before the colon,
    # spelled "Non-Literal Communication" in some files and "Non-literal communication" in others.
    # Counted by hand from the files' ABILITY fields: 2,860 items per language.
    english = convert_tombench(shared_data / "tombench", ("en",))
    counts = {}
    for e in english:
        counts[e.meta["ability"]] = counts.get(e.meta["ability"], 0) + 1
    assert counts == {
        "Belief": 882,
        "Desire": 180,
        "Emotion": 420,
        "Intention": 340,
        "Knowledge": 290,
        "Non-literal communication": 748,
    }
    assert len({e.meta["sub_ability"] for e in english}) == 33  # one spelled with a trailing space
    # DeepSeek-R1's Table 8 row is a whole number of items right in each of these: 692/882 = 0.7846
    assert f"{692 / counts['Belief']:.4f}" == "0.7846"


def test_tombench_english_only_items_convert_with_the_language_setting(tmp_path):
    # ToMBench-Hard is unreleased: its files may hold English only. The default (both languages)
    # names the missing field and the setting; --language en converts them, one example an item.
    line = {"STORY": "Mia hides the cake.", "QUESTION": "Where will Leo look?"}
    line |= {"OPTION-A": "box", "OPTION-B": "bag", "ANSWER": "B", "ABILITY": "Belief: x"}
    path = tmp_path / "hard.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps(line | {"ANSWER": "A"}) + "\n")
    with pytest.raises(DataError, match=rf"{path}:1: field '故事' is missing.*--language en"):
        convert_tombench(path)
    out = tmp_path / "out.jsonl"
    main(["tombench", str(path), str(out), "--language", "en"])
    examples = load_jsonl(out)
    assert [(e.language, e.labels) for e in examples] == [("en", ["B"]), ("en", ["A"])]
    with pytest.raises(SystemExit) as stop:
        main(["tombench", str(path), str(out), "--language", "fr"])
    assert stop.value.code == 2


def test_tombench_hard_folder_of_splits_converts_whole(tmp_path):
    # the full set of Tables 1 and 4 (all 800 items): train/ and test/ files of the same names
    # convert together, each item once, named by its path below the folder
    line = {"STORY": "s", "QUESTION": "q", "OPTION-A": "x", "OPTION-B": "y", "ANSWER": "A"}
    for split, n in (("train", 3), ("test", 1)):
        (tmp_path / "hard" / split).mkdir(parents=True)
        (tmp_path / "hard" / split / "Belief.jsonl").write_text((json.dumps(line) + "\n") * n)
    examples = convert_tombench(tmp_path / "hard", ("en",))
    assert [e.id for e in examples] == [
        "tombench-en-test/Belief-1",
        *(f"tombench-en-train/Belief-{n}" for n in (1, 2, 3)),
    ]
    # one split converted alone keeps its file's name
    assert convert_tombench(tmp_path / "hard" / "test", ("en",))[0].id == "tombench-en-Belief-1"


def test_tombench_bad_answer_is_located(tmp_path):
    line = {
        "STORY": "s",
        "QUESTION": "q",
        "OPTION-A": "x",
        "OPTION-B": "y",
        "OPTION-C": float("nan"),
        "故事": "s",
        "问题": "q",
        "选项A": "x",
        "选项B": "y",
        "答案\nANSWER": "C",
    }
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(
        DataError, match=rf"{path}:1: field 'ANSWER': 'C' is not one of the 2 options"
    ):
        convert_tombench(path)


def test_tombench_layout_with_six_options(tmp_path):
    # ToMBench-Hard items have up to six options (A-F); the same layout with OPTION-E / OPTION-F
    # converts with all of them, and the prompt and the answer parser follow the item's six letters
    line = {
        "STORY": "Mia hides the cake.",
        "QUESTION": "Where will Leo look?",
        "故事": "米娅藏起了蛋糕。",
        "问题": "里奥会去哪里找？",
        "答案\nANSWER": "F",
    }
    for i, letter in enumerate("ABCDEF"):
        line[f"OPTION-{letter}"], line[f"选项{letter}"] = f"{letter}. place {i}", f"地方{i}"
    path = tmp_path / "hard.jsonl"
    path.write_text(json.dumps(line, ensure_ascii=False) + "\n")
    english, chinese = convert_tombench(path)
    assert english.meta["options"] == [f"place {i}" for i in range(6)] and english.labels == ["F"]
    assert chinese.meta["options"] == [f"地方{i}" for i in range(6)] and chinese.labels == ["F"]
    prompt = build_prompt(english)
    assert "\nE. place 4\nF. place 5" in prompt and "exactly one of: A, B, C, D, E, F." in prompt
    assert parse_answer("x</think>\nAnswer: F", english) == ["F"]
    assert parse_answer("x</think>\nAnswer: G", english) is None
    del line["OPTION-C"]  # D-F after a gap: an error naming the field, not three options dropped
    path.write_text(json.dumps(line, ensure_ascii=False) + "\n")
    with pytest.raises(
        DataError, match=rf"{path}:1: field 'OPTION-D': an option after the missing 'OPTION-C'"
    ):
        convert_tombench(path)


# ----------------------------------------------------------------------------- CCU


SIM_NORMS = {
    "001": "Doing apology",
    "002": "Doing request",
    "003": "Doing greeting",
    "004": "Doing thanks",
    "005": "Doing taking leave",
}


def test_ccu_simulated_package_with_hand_made_text(shared_data):
    examples = convert_ccu(
        shared_data / "ccu-sim", FIXTURES / "ccu_text.jsonl", norm_acts=SIM_NORMS
    )
    emotion = {e.meta["segment_id"]: e.labels for e in examples if e.task == "ccu_emotion"}
    # Hand-collapsed from data/emotions.tab: an emotion counts when two
    # annotators chose it; a segment with a single annotator is
    # unscored; none reaching two votes is the catch-all (context only).
    assert emotion == {
        "M010005NJ_0001": ["Joy", "Surprise"],
        "M010005NJ_0002": ["Joy"],
        "M010005NJ_0006": ["Surprise"],
        "M010005NJ_0007": ["Joy"],
        "M01000H0B_0001": ["Joy", "Surprise"],
        "M01000H0B_0002": ["Joy"],
        "M01000H0B_0004": ["Joy", "Surprise"],
        "M01000H0B_0006": ["Joy"],
    }
    acts = {e.meta["segment_id"]: e.labels for e in examples if e.task == "ccu_dialog_act"}
    assert sorted(acts) == [
        "M010005NJ_0001",
        "M010005NJ_0002",
        "M010005NJ_0004",
        "M010005NJ_0006",
        "M010005NJ_0007",
    ] + [f"M01000H0B_000{i}" for i in (1, 2, 4, 5, 6, 7, 8)]
    assert acts["M010005NJ_0001"] == [
        "Doing apology",
        "Doing greeting",
        "Doing thanks",
        "Doing taking leave",
    ]
    assert acts["M01000H0B_0005"] == ["Doing request"]
    norms = [e for e in examples if e.task == "ccu_norm"]
    assert len(norms) == 27 and Counter(e.labels[0] for e in norms) == {"Adhere": 21, "Violate": 6}
    violated = sorted(
        (e.meta["segment_id"], e.dialog_act) for e in norms if e.labels == ["Violate"]
    )
    # norms 001, 003, 005, 004
    nj_acts = ["Doing apology", "Doing greeting", "Doing taking leave", "Doing thanks"]
    assert violated == [("M010005NJ_0002", act) for act in nj_acts] + [
        ("M01000H0B_0002", "Doing request"),
        ("M01000H0B_0006", "Doing request"),
    ]
    # Files without text (the video M01000G2T) and text without annotations produce nothing.
    assert {e.meta["file_id"] for e in examples} == {"M010005NJ", "M01000H0B"}
    chat = next(e for e in examples if e.id == "ccu-M010005NJ_0006-emotion")
    assert (chat.language, chat.culture, chat.target) == ("zh", "Chinese", 6)
    # The catch-all segment 0004 and the unsegmented picture stay as context, with the time marker.
    assert render_conversation(chat).splitlines()[2:6] == [
        "A: [图片]",
        "A: 新开了一家火锅店，一起去吧",
        "[28 minutes later]",
        "B: 好呀！几点？",
    ]
    forum = next(e for e in examples if e.id == "ccu-M01000H0B_0007-norm-002")
    assert forum.dialog_act == "Doing request" and forum.meta["norm"] == "002"
    assert render_conversation(forum).endswith("用户3:\n  | 用户2: 周末人少一点\n  好的，下次试试")


def test_ccu_default_map_knows_only_ldc_norm_ids(shared_data):
    examples = convert_ccu(shared_data / "ccu-sim", FIXTURES / "ccu_text.jsonl")
    # ids 001-005 are not LDC's 101-110
    assert Counter(e.task for e in examples) == {"ccu_emotion": 8}


def test_ccu_errors_are_located(tmp_path, shared_data):
    text = tmp_path / "text.jsonl"
    text.write_text(
        json.dumps(
            {
                "file_id": "M01000H0B",
                "turns": [{"speaker": "A", "text": "hi", "segment_id": "M01000H0B_0001"}],
            }
        )
        + "\n"
    )
    tab = shared_data / "ccu-sim" / "data" / "emotions.tab"
    with pytest.raises(
        DataError, match=rf"{tab}:\d+: field 'segment_id': M01000H0B_0002 has no turn in"
    ):
        convert_ccu(shared_data / "ccu-sim", text)
    text.write_text('{"file_id": "F", "turns": [{"speaker": "A"}]}\n')
    with pytest.raises(DataError, match=rf"{text}:1: field 'turns\[0\]\.text': missing"):
        convert_ccu(shared_data / "ccu-sim", text)
    text.write_text('\n{"file_id": "F", "turns": [], "cultur": "Chinese"}\n')
    with pytest.raises(DataError, match=rf"{text}:2: field 'cultur': unknown field"):
        convert_ccu(shared_data / "ccu-sim", text)


# ---------------------------------------------------------------------------- Wikipedia power, MMLU


def test_wiki_power_selection_and_labels():
    examples = convert_wiki_power(FIXTURES / "wiki_utterances.jsonl")
    # Selected: two speakers and at least one admin utterance (500: both admins, selected but
    # unlabelled). Root 100 comes back after root 200: a new conversation.
    assert [(e.id, e.labels) for e in examples] == [
        ("wiki-100", ["B"]),
        ("wiki-200", ["A"]),
        ("wiki-103", ["B"]),
        ("wiki-700", ["A"]),
    ]
    first = examples[0]
    assert [t.speaker for t in first.turns] == ["A", "B", "A"] and first.target is None
    assert render_conversation(examples[1]) == (
        "A:\n  I have reverted your edit.\n  See the policy page.\nB: Sorry, I did not know."
    )
    assert [e.id for e in convert_wiki_power(FIXTURES / "wiki_utterances.jsonl", limit=2)] == [
        "wiki-100",
        "wiki-200",
    ]
    # the paper's first N selected conversations: 500 takes the fourth place and is left out
    assert [e.id for e in convert_wiki_power(FIXTURES / "wiki_utterances.jsonl", limit=4)] == [
        "wiki-100",
        "wiki-200",
        "wiki-103",
    ]
    assert "indented under it" in build_prompt(examples[1]) and "indented" not in build_prompt(
        first
    )
    assert build_prompt(first).endswith(
        "Conversation:\nA: Could you unprotect the page?\n"
        "B: Done. Please discuss first next time.\nA: Thanks, will do."
    )


def test_wiki_folder_and_missing_root(tmp_path):
    (tmp_path / "utterances.jsonl").write_text(
        '{"id": "1", "speaker": "A", "text": "x", "meta": {}}\n'
    )
    with pytest.raises(
        DataError, match=r"utterances\.jsonl:1: field 'conversation_id' or 'speaker': missing"
    ):
        convert_wiki_power(tmp_path)


def test_mmlu_csv_folder_and_json():
    examples = convert_mmlu(FIXTURES / "mmlu")
    assert [(e.meta["subject"], e.labels[0]) for e in examples] == [
        ("abstract_algebra", "C"),
        ("abstract_algebra", "A"),
        ("anatomy", "A"),
        ("anatomy", "A"),
        ("anatomy", "C"),
    ]
    assert examples[1].meta["options"] == ["Yes, always", "No", "Only for 2", "Only for odd primes"]
    # CRLF inside quotes
    assert examples[3].meta["question"] == "Which bone contains the sella turcica?\nChoose one."
    hf = convert_mmlu(FIXTURES / "mmlu_hf.jsonl")
    assert [
        (e.meta["subject"], e.labels, e.meta["options"][int("ABCD".index(e.labels[0]))]) for e in hf
    ] == [("geography", ["C"], "Paris"), ("elementary_mathematics", ["B"], "4")]


def test_mmlu_bad_answer_is_located(tmp_path):
    path = tmp_path / "x_test.csv"
    path.write_text("q1,a,b,c,d,B\nq2,a,b,c,d,E\n")
    with pytest.raises(DataError, match=rf"{path}:2: field 'answer': 'E' is not one of 4 choices"):
        convert_mmlu(path)


# ----------------------------------------------------------------------------- the command line


def test_cli_convert_filters_and_samples(tmp_path, capsys, shared_data):
    out = tmp_path / "cped.jsonl"
    main(
        [
            "cped",
            str(shared_data / "cped" / "valid_split.csv"),
            str(out),
            "--task",
            "cped_emotion",
            "--per-label",
            "5",
            "--seed",
            "1",
        ]
    )
    assert capsys.readouterr().out.strip() == f"wrote 65 examples to {out}"  # 13 emotions x 5
    written = load_jsonl(out)
    assert {e.task for e in written} == {"cped_emotion"} and set(
        Counter(e.labels[0] for e in written).values()
    ) == {5}


def test_cli_convert_ccu_and_jsonl(tmp_path, shared_data):
    out = tmp_path / "ccu.jsonl"
    main(
        ["ccu", str(shared_data / "ccu-sim"), str(out), "--text", str(FIXTURES / "ccu_text.jsonl")]
    )
    assert len(load_jsonl(out)) == 8
    again = tmp_path / "again.jsonl"
    main(["jsonl", str(out), str(again)])
    assert again.read_text(encoding="utf-8") == out.read_text(encoding="utf-8")


def test_cli_errors_exit_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["ccu", str(FIXTURES), str(tmp_path / "o.jsonl")])
    assert e.value.code == 2 and "--text" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["mmlu", str(FIXTURES / "mmlu"), str(tmp_path / "o.jsonl"), "--task", "mmlu_x"])
    assert "unknown task 'mmlu_x'" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text("Dialogue_ID,Speaker\n1,A\n")
    with pytest.raises(SystemExit):
        main(["meld", str(bad), str(tmp_path / "o.jsonl")])
    assert capsys.readouterr().err.strip() == f"error: {bad}:2: field 'Utterance': missing"
    with pytest.raises(DataError, match="unknown format 'csv'"):
        convert("csv", bad)


# ------------------------------------------------------------------- hostile inputs through the CLI

REPO = Path(__file__).resolve().parents[2]
MELD_HEADER = "Sr No.,Utterance,Speaker,Emotion,Sentiment,Dialogue_ID,Utterance_ID\n"
GOOD_LINE = (
    '{"id": "x", "task": "wiki_power", "turns": [{"speaker": "A", "text": "hi"}], "target": null, '
    '"labels": ["A"]}'
)


def run_cli(module, *args, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        **kwargs,
    )


HOSTILE_INPUTS = [
    # (format, file name, content, the one error line after "error: {path}")
    (
        "meld",
        "short.csv",
        MELD_HEADER + "1,Hi,A,joy,positive,0,0\n2,Hello\n",
        ":3: expected 7 fields, got 2",
    ),
    (
        "meld",
        "huge_cell.csv",
        MELD_HEADER + '1,"' + "x" * 200_000 + '",A,joy,positive,0,0\n',
        ":2: not valid CSV: field larger than field limit (131072)",
    ),
    (
        "meld",
        "latin1.csv",
        (MELD_HEADER + "1,caf\xe9,A,joy,positive,0,0\n").encode("latin-1"),
        f":2: not UTF-8 text (byte {len(MELD_HEADER) + 5})",
    ),
    ("mmlu", "short_test.csv", "q,a,b,c,d,A\nq,a,b\n", ":2: expected 6 fields, got 3"),
    (
        "ecf",
        "object.json",
        '{"conversation": []}',
        ": expected a JSON list of conversations, got dict",
    ),
    (
        "ecf",
        "shape.json",
        '[{"conversation_ID": 1, "conversation": "text", "emotion-cause_pairs": []}]',
        ": conversation 0: not in the expected format (TypeError: string indices must be "
        "integers, not 'str')",
    ),
    (
        "ecf",
        "syntax.json",
        '[\n{"conversation_ID": 1,\n "conversation": [}\n]',
        ":3: not valid JSON: Expecting value (column 19)",
    ),
    ("ecf", "deep.json", "[" * 100_000 + "]" * 100_000, ": not valid JSON: nested too deeply"),
    ("tombench", "list.jsonl", '\n["a"]\n', ":2: expected a JSON object, got list"),
    (
        "tombench",
        "story.jsonl",
        '{"STORY": "s", "QUESTION": "q", "OPTION-A": "x", "OPTION-B": "y"}\n',
        ":1: field 'ANSWER': None is not one of the 2 options (en)",
    ),
    (
        "wiki",
        "meta.jsonl",
        '{"id": "1", "conversation_id": "c", "speaker": "a", "text": "x", "meta": ["admin"]}\n',
        ":1: field 'meta': expected a JSON object, got list",
    ),
    (
        "jsonl",
        "infinite.jsonl",
        GOOD_LINE.replace('"labels"', '"difficulty": 1e400, "labels"'),
        ":1: the number 1e400 is out of range",
    ),
    ("jsonl", "nan.jsonl", "\n" + GOOD_LINE.replace("null", "NaN"), ":2: NaN is not valid JSON"),
    ("jsonl", "empty.jsonl", "\n", ": no examples in the input"),
    (
        "hitom",
        "order_0.txt",
        "Story:\n1 Ann left.\n",
        ": not a Hi-ToM story (Story:, Question:, Answer:, Choices:)",
    ),
    (
        "emobench",
        "EA.jsonl",
        '{"qid": "1", "language": "en", "category": "c", "question type": "Action", '
        '"scenario": "s", "subject": "Ann", "choices": ["a", "b"], "label": "z"}\n',
        ":1: field 'label': 'z' is not one of the 2 choices",
    ),
    (
        "motivebench",
        "X_questions.json",
        '[{"idx": 0, "Motivation Reasoning Question": "q", "Options 1": ["A. a", "B. b"], '
        '"Correct Answer 1": "C"}]',
        ": record 0: field 'Correct Answer 1': the answer is not one of the 2 options",
    ),
    (
        "tactfultom",
        "Tactful_conv_set_0.json",
        '[{"full_context": "hello there"}]',
        ": record 0: field 'full_context': 'hello there' has no speaker",
    ),
]


@pytest.mark.parametrize(
    "fmt, name, content, message", HOSTILE_INPUTS, ids=[case[1] for case in HOSTILE_INPUTS]
)
def test_hostile_inputs_are_one_located_line(tmp_path, fmt, name, content, message):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    result = run_cli("prepare.convert", fmt, path, tmp_path / "out.jsonl")
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"error: {path}{message}\n")
    # nothing written, no temporary file
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_per_label_and_task_filters_are_checked(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(GOOD_LINE + "\n")
    for value in ("-1", "0", "x"):
        result = run_cli(
            "prepare.convert", "jsonl", path, tmp_path / "out.jsonl", "--per-label", value
        )
        assert result.returncode == 2 and result.stderr.splitlines()[-1] == (
            "python -m prepare.convert: error: argument --per-label: expected a positive integer, "
            f"got '{value}'"
        )
    result = run_cli("prepare.convert", "jsonl", path, tmp_path / "out.jsonl", "--task", "mmlu")
    assert (result.returncode, result.stderr) == (2, f"error: {path}: no examples of task mmlu\n")
    assert (
        run_cli(
            "prepare.convert", "jsonl", path, tmp_path / "out.jsonl", "--per-label", "1"
        ).returncode
        == 0
    )


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(GOOD_LINE.replace('"x"', f'"x{i}"') + "\n" for i in range(200)))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "inside").touch()  # a non-empty folder where the output should go
    result = run_cli("prepare.convert", "jsonl", path, tmp_path / "taken")
    assert (result.returncode, result.stderr) == (
        2,
        f"error: 'output': {tmp_path / 'taken'} is a folder; name the file to write\n",
    )  # said before anything is read
    # A full disk, as the file-size limit: Python ignores SIGXFSZ, so the write fails with EFBIG.
    out = tmp_path / "out" / "big.jsonl"
    result = run_cli(
        "prepare.convert",
        "jsonl",
        path,
        out,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)),
    )
    assert (result.returncode, result.stderr) == (2, f"error: [Errno 27] File too large: '{out}'\n")
    assert list(out.parent.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == [
        "in.jsonl",
        "out",
        "taken",
    ]


def test_stats_names_a_bad_tokenizer_path(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(GOOD_LINE + "\n")
    result = run_cli("dataset", "stats", path, "--tokenizer", tmp_path / "absent")
    assert (result.returncode, result.stderr) == (
        2,
        f"error: {tmp_path / 'absent'}: not a readable tokenizer.json: No such file or directory "
        f"(os error 2)\n",
    )
    result = run_cli("dataset", "stats", path, "--tokenizer", path)
    assert result.returncode == 2 and result.stderr.startswith(
        f"error: {path}: not a readable tokenizer.json: "
    )


# ----------------------------------------------------------- EmpatheticDialogues, MSDialog (EmoLLM)


def test_empathetic_dialogues_and_msdialog_become_esconv_layout_dialogues_and_seeds(tmp_path):
    ed = convert_empathetic_dialogues(FIXTURES / "emollm" / "empathetic_dialogues.csv")
    assert ed == [
        {
            "id": "hit:0_conv:1",
            "emotion_type": "sentimental",
            "situation": (
                "I remember going to the fireworks with my best friend, it felt like only us."
            ),
            "dialog": [
                {
                    "speaker": "seeker",
                    "content": "I remember going to see the fireworks with my best friend.",
                },
                {
                    "speaker": "supporter",
                    "content": "Was this a friend you were in love with, or just a best friend?",
                },
                {"speaker": "seeker", "content": "This was a best friend. I miss her."},
            ],
        },
        {
            "id": "hit:1_conv:2",
            "situation": "I heard a noise downstairs at night.",
            "emotion_type": "afraid",
            "dialog": [
                {
                    "speaker": "seeker",
                    "content": "I heard something downstairs last night and I was terrified.",
                },
                # sorted by utterance_idx
                {"speaker": "supporter", "content": "Did you check what it was?"},
            ],
        },
    ]
    ms = convert_msdialog(FIXTURES / "emollm" / "msdialog.json")
    assert [d["id"] for d in ms] == ["msdialog-9", "msdialog-12"]
    assert (ms[0]["situation"], ms[0]["problem_type"]) == (
        "Outlook keeps asking for my password",
        "Outlook",
    )
    assert [t["speaker"] for t in ms[0]["dialog"]] == [
        "seeker",
        "supporter",
        "seeker",
        "seeker",
        "supporter",
    ]
    for fmt, source, n in (
        ("empathetic_dialogues", "empathetic_dialogues.csv", 2),
        ("msdialog", "msdialog.json", 2),
    ):
        out = tmp_path / f"{fmt}.jsonl"
        result = run_cli("prepare.convert", fmt, FIXTURES / "emollm" / source, out)
        assert (result.returncode, result.stdout) == (0, f"wrote {n} dialogues to {out}\n"), (
            result.stderr
        )
        assert len(emollm_data.load_dialogues([str(out)])) == n  # what EmoLLM's Stage I reads
        seeds = tmp_path / f"{fmt}.seeds.jsonl"
        assert (
            run_cli(
                "prepare.convert", fmt, FIXTURES / "emollm" / source, seeds, "--seeds"
            ).returncode
            == 0
        )
        assert len(dialogue.load_scenarios(seeds)) == n  # what dialogue/rl.py reads
    [first, _] = dialogue.load_scenarios(tmp_path / "empathetic_dialogues.seeds.jsonl")
    assert first.scenario.endswith(
        "only us. You feel sentimental."
    ) and first.initial_prompt.startswith("I remember")
    merged = emollm_data.load_dialogues([str(tmp_path / "msdialog.jsonl")])[0]
    assert merged.turns[2][1] == "Outlook 2016. On Windows 10."  # one user turn of two utterances


def test_meddialog_and_iclr_review_threads_become_esconv_layout_dialogues(tmp_path):
    assert convert_meddialog(FIXTURES / "emollm" / "meddialog.json") == [
        {
            "id": "meddialog-0",
            "situation": "Q. Is a cough that lasts three weeks after a cold a concern?",
            "dialog": [
                {
                    "speaker": "seeker",
                    "content": "Hi doctor, I had a cold three weeks ago and the cough has not gone "
                    "away. It is dry and worse at night. Should I be worried?",
                },
                {
                    "speaker": "supporter",
                    "content": "Hello. A cough can last up to eight weeks after a viral infection. "
                    "If you get fever, breathlessness or blood in the sputum, see a physician in "
                    "person.",
                },
            ],
        },
        {
            "id": "meddialog-1",
            "situation": "Q. What can I do about frequent headaches at work?",
            "dialog": [  # "Patient:" / "Doctor:" in capitals too
                {
                    "speaker": "seeker",
                    "content": "I get headaches almost every afternoon at the office.",
                },
                {
                    "speaker": "supporter",
                    "content": "Do you take enough water and breaks from the screen?",
                },
            ],
        },
    ]
    # rev2 has no author reply, meta1 is no review: one thread, its replies by cdate
    expected = [
        {
            "id": "iclr-rev1",
            "situation": "Sparse Adapters for Long Contexts",
            "dialog": [
                {
                    "speaker": "supporter",
                    "content": "Summary: The paper proposes sparse adapters.\n"
                    "Strengths: Clear writing.\nWeaknesses: No comparison with LoRA.\n"
                    "Questions: How does it scale past 32k tokens?",
                },
                {
                    "speaker": "seeker",
                    "content": "We added a LoRA comparison in Table 3 and results at 64k tokens.",
                },
                {
                    "speaker": "supporter",
                    "content": "Thanks, the LoRA comparison addresses my concern.",
                },
            ],
        }
    ]
    assert convert_iclr(FIXTURES / "emollm" / "iclr_openreview.json") == expected
    # API 1 notes (plain content values) dumped as a JSON array, without cdate: file order
    api1 = [
        {"id": "p", "forum": "p", "replyto": None, "signatures": ["~A"], "content": {"title": "T"}},
        {
            "id": "r",
            "forum": "p",
            "replyto": "p",
            "signatures": ["ICLR.cc/2019/Conference/Paper3/AnonReviewer2"],
            "content": {"title": "Review", "review": "Unclear motivation.", "rating": "4: reject"},
        },
        {
            "id": "a",
            "forum": "p",
            "replyto": "r",
            "signatures": ["ICLR.cc/2019/Conference/Paper3/Authors"],
            "content": {"comment": "We clarified it in section 1."},
        },
    ]
    (tmp_path / "notes.json").write_text(json.dumps(api1))
    assert convert_iclr(tmp_path / "notes.json") == [
        {
            "id": "iclr-r",
            "situation": "T",
            "dialog": [
                {"speaker": "supporter", "content": "Unclear motivation."},
                {"speaker": "seeker", "content": "We clarified it in section 1."},
            ],
        }
    ]
    for fmt, source, ids, roles in (
        ("meddialog", "meddialog.json", ["meddialog-0", "meddialog-1"], ["user", "assistant"]),
        ("iclr", "iclr_openreview.json", ["iclr-rev1"], ["assistant", "user", "assistant"]),
    ):
        out = tmp_path / f"{fmt}.jsonl"
        result = run_cli("prepare.convert", fmt, FIXTURES / "emollm" / source, out)
        assert (result.returncode, result.stdout) == (
            0,
            f"wrote {len(ids)} dialogues to {out}\n",
        ), result.stderr
        loaded = emollm_data.load_dialogues([str(out)])  # what EmoLLM's Stage I reads
        assert [d.id for d in loaded] == ids
        assert [role for role, _, _ in loaded[0].turns] == roles


@pytest.mark.parametrize(
    "fmt, text, error",
    [
        (
            "empathetic_dialogues",
            "conv_id,utterance_idx,context,prompt,speaker_idx\n",
            ":1: expected the header",
        ),
        (
            "empathetic_dialogues",
            "conv_id,utterance_idx,context,prompt,speaker_idx,utterance\nc,1,sad,p,1,\n",
            ":2: field 'utterance': empty",
        ),
        (
            "empathetic_dialogues",
            "conv_id,utterance_idx,context,prompt,speaker_idx,utterance\nc,one,sad,p,1,hi\n",
            ":2: field 'utterance_idx': expected a number",
        ),
        (
            "msdialog",
            '{"1": {"title": "t", "category": "c", "utterances": [{"actor_type": "Bot", '
            '"utterance": "x"}]}}',
            ": dialogue 1: field 'utterances[0].actor_type'",
        ),
        (
            "msdialog",
            '{"1": {"title": "t", "utterances": [{"actor_type": "User", "utterance": "x"}]}}',
            ": dialogue 1: field 'category': missing",
        ),
        (
            "meddialog",
            '[{"description": "d", "utterances": ["nurse: hello"]}]',
            ": consultation 0: field 'utterances[0]': 'nurse: hello'",
        ),
        (
            "iclr",
            '{"notes": [{"id": "r", "forum": "p", "replyto": "p", "signatures": '
            '["C/Paper1/Reviewer_x"], "content": {"review": "ok"}}]}',
            ": note 0: its submission p is not in the file",
        ),
        (
            "iclr",
            '[{"id": "p", "forum": "p", "signatures": [], "content": {"title": "T"}}, '
            '{"id": "p", "forum": "p", "signatures": [], "content": {"title": "U"}}]',
            ": note 1: field 'id': 'p' appears twice",
        ),
    ],
)
def test_bad_dialogue_sources_stop_with_one_line(tmp_path, fmt, text, error):
    source = tmp_path / "in.txt"
    source.write_text(text)
    result = run_cli("prepare.convert", fmt, source, tmp_path / "out.jsonl")
    assert result.returncode == 2 and result.stderr.startswith(f"error: {source}{error}"), (
        result.stderr
    )
    assert result.stderr.count("\n") == 1 and not (tmp_path / "out.jsonl").exists()


# ---------------------------------------------------------------------------- Hugging Face datasets


def _user_dataset():
    """A dataset as a user holds it: their own column names, the label as one string."""
    datasets = pytest.importorskip(
        "datasets", reason="datasets is not installed (requirements-dev)"
    )
    return datasets.Dataset.from_list(
        [
            {
                "uid": "d1",
                "dialogue": [
                    {"speaker": "Ann", "text": "My dog died on Sunday."},
                    {"speaker": "Bo", "text": "How are you holding up?"},
                    {"speaker": "Ann", "text": "Well, what can I say."},
                ],
                "emotion": "sadness",
                "turn": 2,
            },
            {
                "uid": "d2",
                "dialogue": [
                    {"speaker": "Cy", "text": "We won the cup!"},
                    {"speaker": "Di", "text": "No way."},
                ],
                "emotion": "joy",
                "turn": 0,
            },
        ]
    )


HF_FLAGS = ["--column", "id=uid", "--column", "turns=dialogue", "--column", "labels=emotion"]
HF_FLAGS += ["--column", "target=turn", "--value", "task=meld_emotion"]


@pytest.mark.parametrize("layout", ["save_to_disk", "parquet", "jsonl"])
def test_a_hugging_face_dataset_converts_with_a_column_mapping(tmp_path, capsys, layout):
    dataset = _user_dataset()
    source = {"save_to_disk": tmp_path / "saved", "parquet": tmp_path / "d.parquet"}.get(
        layout, tmp_path / "d.jsonl"
    )
    {"save_to_disk": dataset.save_to_disk, "parquet": dataset.to_parquet}.get(
        layout, dataset.to_json
    )(str(source))
    capsys.readouterr()
    out = tmp_path / "examples.jsonl"
    main(["hf", str(source), str(out), *HF_FLAGS])
    assert capsys.readouterr().out.strip() == f"wrote 2 examples to {out}"
    first, second = (json.loads(line) for line in out.read_text().splitlines())
    assert (first["id"], first["task"], first["target"], first["labels"]) == (
        "d1",
        "meld_emotion",
        2,
        ["sadness"],
    )
    assert [(t["speaker"], t["text"]) for t in first["turns"]] == [
        ("Ann", "My dog died on Sunday."),
        ("Bo", "How are you holding up?"),
        ("Ann", "Well, what can I say."),
    ]
    assert (second["id"], second["labels"], len(second["turns"])) == ("d2", ["joy"], 2)
    assert [e.id for e in load_jsonl(out)] == ["d1", "d2"]  # what grpo.py and sft.py read


def test_a_saved_dataset_trains_after_one_convert_command(tmp_path, assets, judge):
    """`datasets`' save_to_disk folder -> `prepare/convert.py hf` -> two GRPO updates on its
    examples."""
    from helpers import metrics, run_config

    import grpo

    source, examples = tmp_path / "saved", tmp_path / "examples.jsonl"
    _user_dataset().save_to_disk(str(source))
    main(["hf", str(source), str(examples), *HF_FLAGS])
    grpo.main([str(run_config(tmp_path, (assets[0], examples), judge.url, updates=2))])
    records = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").open()]
    assert {r["id"] for r in records} == {"d1", "d2"}
    assert [m["step"] for m in metrics(tmp_path / "run") if "loss" in m] == [1, 2]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--column", "labels=feeling"], "{src}: no column 'feeling' (columns: "),
        (["--column", "mood=emotion"], "--column/--value: unknown field 'mood' (known: "),
        (["--value", "task=no_such_task"], "{src} row 0: field 'task': unknown task"),
        (["--column", "target=uid"], "{src} row 0: field 'target': expected an integer"),
    ],
)
def test_a_bad_column_mapping_stops_with_one_line(tmp_path, capsys, flags, message):
    source = tmp_path / "saved"
    _user_dataset().save_to_disk(str(source))
    capsys.readouterr()  # the progress bar of saving
    with pytest.raises(SystemExit) as stop:
        main(["hf", str(source), str(tmp_path / "out.jsonl"), *HF_FLAGS, *flags])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: " + message.format(src=source)), err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(
    "record, expected",
    [
        ({"title": "t", "category": "c", "utterances": []}, "field 'utterances': empty"),
        (
            {
                "title": " ",
                "category": "c",
                "utterances": [{"actor_type": "User", "utterance": "u"}],
            },
            "field 'title': ' ' (expected non-empty text)",
        ),
        (
            {
                "title": "t",
                "category": None,
                "utterances": [{"actor_type": "User", "utterance": "u"}],
            },
            "field 'category': None (expected non-empty text)",
        ),
    ],
)
def test_msdialog_refuses_a_dialogue_emollm_data_could_not_use(tmp_path, record, expected):
    path = tmp_path / "ms.json"
    path.write_text(json.dumps({"7": record}))
    with pytest.raises(DataError, match="^" + re.escape(f"{path}: dialogue 7: {expected}")):
        convert_msdialog(path)


def test_empathetic_dialogues_refuses_a_non_ascii_digit_index(tmp_path):
    header = "conv_id,utterance_idx,context,prompt,speaker_idx,utterance,selfeval,tags\n"
    path = tmp_path / "ed.csv"
    path.write_text(header + "c1,\u00b2,sad,p,1,hello,,\n", encoding="utf-8")
    with pytest.raises(DataError, match=f"^{path}:2: field 'utterance_idx': expected a number"):
        convert_empathetic_dialogues(path)


# ----------------------------------------------------------------------------- social benchmarks

BENCH = FIXTURES / "benchmarks"


def mc(id, story, question, options, label, language="en", **meta) -> Example:
    turns = [Turn("", story)] if isinstance(story, str) else story
    return Example(
        id,
        "tom_mc",
        turns,
        None,
        [label],
        language=language,
        meta={"question": question, "options": options, **meta},
    )


def test_socialiqa_reads_the_one_based_labels_file():
    assert convert_socialiqa(BENCH / "socialiqa" / "dev.jsonl") == [
        mc(
            "socialiqa-dev-1",
            "Robin lent Kai her umbrella because the rain would not stop.",
            "How would Kai feel as a result?",
            ["annoyed at Robin", "grateful to Robin", "soaked through"],
            "B",
        ),
        mc(
            "socialiqa-dev-2",
            "Tracy forgot her friend's birthday and called the next morning.",
            "What will Tracy want to do next?",
            ["apologize to her friend", "throw a party for herself", "forget the call"],
            "A",
        ),
        mc(
            "socialiqa-dev-3",
            "Jordan practiced the speech every night for a week.",
            "Why did Jordan do this?",
            ["to sleep better", "to skip the speech", "to give the speech well"],
            "C",
        ),
    ]


def test_socialiqa_label_count_mismatch_is_an_error(tmp_path):
    (tmp_path / "dev.jsonl").write_text((BENCH / "socialiqa" / "dev.jsonl").read_text())
    (tmp_path / "dev-labels.lst").write_text("2\n1\n")
    with pytest.raises(DataError, match="2 labels for the 3 questions"):
        convert_socialiqa(tmp_path / "dev.jsonl")


def test_simpletom_subsets_and_story_data_skipped():
    story = (
        "The jar of jam on the shelf has mould under its lid. Mia takes the jar to the checkout."
    )
    assert convert_simpletom(BENCH / "simpletom") == [
        mc(
            "simpletom-fruit-1_action",
            story,
            "What will Mia likely do next?",
            ["Put the jar back and report the mould.", "Pay for the jar of jam."],
            "B",
            subset="behavior-qa",
        ),
        mc(
            "simpletom-fruit-1_aware",
            story,
            'Is Mia likely to be aware that "the jam has mould under its lid"?',
            ["No", "Yes"],
            "A",
            subset="mental-state-qa",
        ),
    ]


def test_hitom_stories_with_their_rules_and_cot_copies_skipped():
    story = (
        "1 Ella, Liam and Noah entered the kitchen.\n2 The pear is in the blue_box.\n"
        "3 Ella exited the kitchen.\n4 Liam moved the pear to the red_bag.\n"
        "5 Liam exited the kitchen.\n\nNote: You should assume the following. (1) An agent sees "
        "every move in a room before leaving it. (2) Agents may lie."
    )
    options = ["blue_box", "red_bag", "green_crate"]
    assert convert_hitom(BENCH / "hitom") == [
        mc(
            "hitom-Tell-length_1-sample_1-order_0",
            story,
            "Where is the pear really?",
            options,
            "B",
            order=0,
            tell="Tell",
        ),
        mc(
            "hitom-Tell-length_1-sample_1-order_1",
            story,
            "Where does Ella really think the pear is?",
            options,
            "A",
            order=1,
            tell="Tell",
        ),
    ]


def test_emobench_categories_are_table_10s_columns():
    # EmoBench's release (Sahandfer/EmoBench data/*.jsonl): EU's coarse categories hold 49, 28, 56
    # and 67 items per language, EA's four categories 50 questions each. Table 10's columns count
    # 98, 56, 112, 134 (EU questions, two per item) and 100, 100: EA by whose problem it is.
    from prepare.convert import emobench_category

    assert [emobench_category(c) for c in ("Personal-Self", "Social-Self")] == ["Self"] * 2
    assert [emobench_category(c) for c in ("Personal-Others", "Social-Others")] == [
        "Interpersonal"
    ] * 2
    assert [
        emobench_category(c)
        for c in (
            "complex_emotions",
            "emotional_cues",
            "personal_beliefs_and_experiences",
            "perspective_taking",
            "something_new",
        )
    ] == [
        "Complex Emotions",
        "Emotional Cues",
        "Personal Beliefs & Experiences",
        "Perspective Taking",
        "something_new",
    ]


def test_emobench_understanding_is_two_grouped_questions_application_one():
    en = (
        "Omar burnt the cake for his mother's party, but she laughed and said it was the best "
        "one yet."
    )
    zh = "奥马尔把妈妈生日会的蛋糕烤糊了，但妈妈笑着说这是最好吃的一个。"
    # category: Social-R1's Table 10 column; source_category: the file's own
    eu = dict(category="Complex Emotions", source_category="complex_emotions")
    assert convert_emobench(BENCH / "emobench" / "data") == [
        mc(
            "emobench-ea-en-1",
            "Nina's flatmate has been crying since she failed her driving test.",
            "In this scenario, what is the most effective action for Nina?",
            [
                "Ignore it",
                "Sit with her and listen",
                "Tell her the test is easy",
                "Book her another test right away",
            ],
            "B",
            category="Interpersonal",
            source_category="Personal-Others",
        ),
        mc(
            "emobench-eu-en-1-emotion",
            en,
            "What emotion(s) would Omar ultimately feel in this situation?",
            ["Relief", "Anger", "Shame", "Fear"],
            "A",
            group="emobench-eu-en-1",
            **eu,
        ),
        mc(
            "emobench-eu-en-1-cause",
            en,
            "Why would Omar feel these emotions in this situation?",
            [
                "The cake was not burnt",
                "His mother kindly accepted the burnt cake",
                "The party was cancelled",
                "He bought another cake",
            ],
            "B",
            group="emobench-eu-en-1",
            **eu,
        ),
        mc(
            "emobench-eu-zh-1-emotion",
            zh,
            "在这种情况下，奥马尔最终会感受到什么情绪？",
            ["宽慰", "愤怒", "羞愧", "恐惧"],
            "A",
            "zh",
            group="emobench-eu-zh-1",
            **eu,
        ),
        mc(
            "emobench-eu-zh-1-cause",
            zh,
            "奥马尔为什么会在这种情况下感受到这些情绪？",
            ["蛋糕没有烤糊", "妈妈温和地接受了烤糊的蛋糕", "生日会取消了", "他又买了一个蛋糕"],
            "B",
            "zh",
            group="emobench-eu-zh-1",
            **eu,
        ),
    ]


def test_motivebench_three_questions_per_item_letters_stripped():
    examples = convert_motivebench(BENCH / "motivebench")
    assert [(e.id, e.labels, e.turns, e.meta["kind"]) for e in examples] == [
        ("motivebench-Persona-0-motivation", ["B"], [], "motivation"),
        ("motivebench-Persona-0-behavior", ["C"], [], "behavior"),
        ("motivebench-Persona-0-motivation_behavior", ["C"], [], "motivation_behavior"),
    ]
    assert examples[0] == mc(
        "motivebench-Persona-0-motivation",
        [],
        "Lena, a nurse, stays an hour after her shift to talk with a scared patient. What most "
        "likely motivates her?",
        [
            "To earn overtime pay",
            "To comfort the patient",
            "To avoid going home",
            "To impress her manager",
            "To learn a new procedure",
            "To finish paperwork",
        ],
        "B",
        kind="motivation",
        source="Persona",  # the file's folder: the paper's Amazon / Blog / Persona columns
    )


def test_tactfultom_choice_and_yes_no_questions_lists_left_out():
    turns = [
        Turn("Ava", "Who wants to try the new sushi place on Friday?"),
        Turn("Cal", "I have to go, see you all later!"),
        Turn("Sam", "Between us, Ben, I would rather keep my money this month."),
        Turn("Ben", "Fair enough, it is pricey.\n\nAnd the prices keep going up."),
        Turn("Sam", "Ava, sorry, I have to work on Friday."),
    ]
    examples = convert_tactfultom(BENCH / "tactfultom" / "final_set")  # the stray copy is skipped
    assert examples == [
        # options shuffled once with the q_id as seed: the gold letter points at the correct answer
        mc(
            "tactfultom-0-1-0-0-comprehension-0",
            turns,
            "Was what Sam told Ava, 'I have to work on Friday', true?",
            ["Yes", "No"],
            "B",
            category="comprehensionQA",
            question_type="comprehension",
        ),
        mc(
            "tactfultom-0-1-0-0-justification-0",
            turns,
            "Why did Sam tell Ava 'I have to work on Friday'?",
            [
                "Because Sam has other plans with Cal.",
                "Because Sam really works on Friday.",
                "To decline without making Ava feel bad about the pricey place.",
                "Because Sam dislikes Ava.",
            ],
            "C",
            category="justificationQA",
            question_type="justification",
        ),
        mc(
            "tactfultom-0-1-0-0-info_access_binary-0",
            turns,
            "Information: Sam would rather keep his money\nDoes Ava know this information?",
            ["Yes", "No"],
            "B",
            category="infoAccessibilityQAs_binary",
            question_type="tom:info_accessibility:binary",
        ),
        mc(
            "tactfultom-0-1-0-0-answerability_binary-0",
            turns,
            "Question: Who discussed 'Sam would rather keep his money'?\nDoes Ben know the precise "
            "correct answer to this question?",
            ["Yes", "No"],
            "A",
            category="answerabilityQAs_binary",
            question_type="tom:answerability:binary",
        ),
    ]
    # the story is shown as the conversation, the options lettered, and the answer parses
    prompt = build_prompt(examples[1])
    assert "Sam: Between us, Ben, I would rather keep my money this month." in prompt
    assert "\nC. To decline without making Ava feel bad about the pricey place." in prompt
    assert parse_answer("x</think>\nAnswer: C", examples[1]) == ["C"]
    assert parse_answer("x</think>\nAnswer: C", examples[0]) is None  # two options: A, B


@pytest.mark.parametrize(
    "fmt, source",
    [
        ("socialiqa", "socialiqa/dev.jsonl"),
        ("simpletom", "simpletom"),
        ("hitom", "hitom"),
        ("emobench", "emobench/data"),
        ("motivebench", "motivebench"),
        ("tactfultom", "tactfultom/final_set"),
    ],
)
def test_benchmark_formats_convert_from_the_command_line(tmp_path, fmt, source, capsys):
    out = tmp_path / "out.jsonl"
    main([fmt, str(BENCH / source), str(out)])
    written = load_jsonl(out)
    assert written and all(e.task == "tom_mc" for e in written)
    assert f"wrote {len(written)} examples" in capsys.readouterr().out


def test_a_broken_hugging_face_file_is_one_line_naming_it(tmp_path):
    """`python -m prepare.convert hf` on a parquet file cut in half, a JSON lines file with a broken
    line, an empty file: exit 2 and one line naming the file (and the line where there is one),
    never the library's traceback."""
    parquet = tmp_path / "data.parquet"
    _user_dataset().to_parquet(str(parquet))
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(parquet.read_bytes()[: parquet.stat().st_size // 2])
    broken = tmp_path / "rows.jsonl"
    broken.write_text('{"id": "a", "emotion": "joy"}\n{"id": "b", "emotion": \n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for source, start in (
        (cut, f"error: {cut}: not a readable parquet file ("),
        (broken, f"error: {broken}:2: not valid JSON"),
        (empty, f"error: {empty}: no rows (the file is empty)"),
    ):
        result = run_cli("prepare.convert", "hf", source, tmp_path / "out.jsonl", *HF_FLAGS)
        assert result.returncode == 2 and result.stderr.startswith(start), result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "out.jsonl").exists()
