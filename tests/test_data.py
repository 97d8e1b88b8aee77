"""data.py: the example schema and its errors, the task registry and prompts, conversation
rendering, answer parsing, the curriculum and the stats command."""

import dataclasses
import json

import pytest

from data import (
    TASKS,
    DataError,
    Example,
    Turn,
    build_prompt,
    count_tokens,
    parse_answer,
    render_conversation,
    render_target,
    split_blocks,
    split_completion,
    task_brief,
    time_marker,
    visible_turns,
    well_formed,
)
from dataset import (
    check_example,
    load_jsonl,
    main,
    save_jsonl,
    stats,
)


def chat_example(**kw):
    turns = [
        Turn("A", "Did you get the tickets?", "2021-03-02T10:00:00"),
        Turn("B", "Not yet", "2021-03-02T10:09:59"),
        Turn("B", "the site is down", "2021-03-02T10:19:59"),
        Turn("A", "Seriously?!", "2021-03-02T12:30:00"),
        Turn("B", "never shown", "2021-03-05T12:30:00"),
    ]
    fields = dict(
        id="c1", task="ccu_emotion", turns=turns, target=3, labels=["Surprise"], culture="American"
    )
    return Example(**(fields | kw))


def write_lines(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def good_line(**kw):
    raw = {
        "id": "x1",
        "task": "meld_emotion",
        "turns": [{"speaker": "Ross", "text": "Hi."}, {"speaker": "Rachel", "text": "Oh no."}],
        "target": 1,
        "labels": ["sadness"],
    }
    return json.dumps(raw | kw)


# ----------------------------------------------------------------------------- schema


def test_jsonl_round_trip_keeps_every_field(tmp_path):
    example = chat_example(language="zh", dialog_act=None, difficulty=0.25, meta={"file_id": "M1"})
    norm = Example(
        "n1",
        "ccu_norm",
        [Turn("A", "Sorry, my fault.", reply_to=None)],
        0,
        ["Violate"],
        dialog_act="Doing apology",
    )
    path = tmp_path / "out.jsonl"
    save_jsonl([example, norm], path)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    assert json.loads(lines[0])["turns"][0] == {
        "speaker": "A",
        "text": "Did you get the tickets?",
        # null turn fields left out
        "time": "2021-03-02T10:00:00",
    }
    assert load_jsonl(path) == [example, norm]


def test_labels_are_canonicalized_on_load(tmp_path):
    path = write_lines(tmp_path, ["\ufeff" + good_line(labels=["SADNESS"]), "", good_line(id="x2")])
    examples = load_jsonl(path)  # a BOM and a blank line are tolerated
    assert [e.labels for e in examples] == [["sadness"], ["sadness"]]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"id": "x1", "task": ', r"not valid JSON"),
        (good_line(task="meld_emotions"), r"field 'task': unknown task 'meld_emotions'"),
        (good_line(labels=["happy"]), r"field 'labels': 'happy' is not a label of meld_emotion"),
        (
            good_line(labels=["joy", "sadness"]),
            r"field 'labels': task meld_emotion needs exactly one label",
        ),
        (good_line(labels=[]), r"field 'labels': task meld_emotion needs exactly one label"),
        (
            good_line(target=2),
            r"field 'target': task meld_emotion needs a turn index in 0\.\.1, got 2",
        ),
        (good_line(target=None), r"field 'target': task meld_emotion needs a turn index"),
        (good_line(target="1"), r"field 'target': expected an integer, got '1'"),
        (good_line(task="wiki_power", labels=["A"]), r"field 'target': .* target must be null"),
        (good_line(turns=[{"speaker": "A"}]), r"field 'turns\[0\]\.text': missing"),
        (
            good_line(turns=[{"speaker": "A", "text": "x", "mood": 1}]),
            r"field 'turns\[0\]\.mood': unknown field",
        ),
        (
            good_line(
                turns=[{"speaker": "A", "text": "x"}, {"speaker": "B", "text": "y", "reply_to": 1}]
            ),
            r"field 'turns\[1\]\.reply_to': 1 is not an earlier turn",
        ),
        (
            good_line(
                turns=[
                    {"speaker": "A", "text": "x", "time": "yesterday"},
                    {"speaker": "B", "text": "y"},
                ]
            ),
            r"field 'turns\[0\]\.time': not an ISO 8601 time",
        ),
        (good_line(speaker="A"), r"field 'speaker': unknown field"),
        (good_line(difficulty=True), r"field 'difficulty': expected a number"),
        (good_line().replace('"target": 1', '"target": NaN'), r"NaN is not valid JSON"),
        (json.dumps(["not", "an", "object"]), r"expected a JSON object"),
        (good_line(id="ok"), r"field 'id': 'ok' appears twice"),
    ],
)
def test_bad_lines_name_file_line_and_field(tmp_path, line, message):
    path = write_lines(tmp_path, [good_line(id="ok"), line])
    with pytest.raises(DataError, match=rf"^{path}:2: {message}"):
        load_jsonl(path)


def test_task_specific_checks(monkeypatch):
    norm = Example("n", "ccu_norm", [Turn("A", "Bye")], 0, ["Adhere"])
    with pytest.raises(
        DataError, match="field 'dialog_act': task ccu_norm needs one of: Doing apology, "
    ):
        check_example(norm)
    # The requirement is the task's property, not its name: a task of your own can have it too.
    mine = dataclasses.replace(TASKS["ccu_norm"], name="my_norm", dialog_acts=("asking", "telling"))
    monkeypatch.setitem(TASKS, "my_norm", mine)
    with pytest.raises(
        DataError, match=r"task my_norm needs one of: asking, telling; got 'Doing request'"
    ):
        check_example(dataclasses.replace(norm, task="my_norm", dialog_act="Doing request"))
    assert check_example(dataclasses.replace(norm, task="my_norm", dialog_act="asking")).labels == [
        "Adhere"
    ]
    with pytest.raises(DataError, match="catch-all label 'None' cannot be combined"):
        check_example(chat_example(labels=["Joy", "none"]))
    with pytest.raises(DataError, match="needs one or more distinct labels"):
        check_example(chat_example(labels=["Joy", "joy"]))
    tom = Example(
        "t",
        "tom_mc",
        [Turn("", "A story.")],
        None,
        ["C"],
        meta={"question": "Q?", "options": ["x", "y"]},
    )
    with pytest.raises(DataError, match=r"'C' is not a label of tom_mc \(labels: A, B\)"):
        check_example(tom)  # two-option items allow only A and B
    with pytest.raises(DataError, match="field .meta.options.: expected 2 to 4 strings"):
        check_example(
            Example("m", "mmlu", [], None, ["A"], meta={"question": "Q?", "options": ["only one"]})
        )


def test_save_rejects_a_bad_example_by_id(tmp_path):
    with pytest.raises(DataError, match=r"example 'c1': field 'target'"):
        save_jsonl([chat_example(target=9)], tmp_path / "x.jsonl")
    with pytest.raises(DataError, match=r"example 'c1': field 'id': 'c1' appears twice"):
        save_jsonl([chat_example(), chat_example()], tmp_path / "x.jsonl")
    assert not (tmp_path / "x.jsonl").exists()


# ----------------------------------------------------------------------------- rendering


def test_time_markers():
    assert time_marker("2021-03-02T10:00:00", "2021-03-02T10:09:59") is None
    assert time_marker("2021-03-02T10:00:00", "2021-03-02T10:10:00") == "[10 minutes later]"
    assert time_marker("2021-03-02T10:00:00", "2021-03-02T11:59:00") == "[119 minutes later]"
    assert time_marker("2021-03-02T10:00:00", "2021-03-02T12:30:00") == "[2 hours later]"
    assert time_marker("2021-03-02T10:00:00", "2021-03-05T09:00:00") == "[2 days later]"
    assert (
        time_marker("2021-03-02T10:00:00+08:00", "2021-03-02T02:30:00+00:00")
        == "[30 minutes later]"
    )
    assert time_marker("2021-03-02T10:00:00", "2021-03-02T09:00:00") is None


def test_chat_rendering_golden():
    example = chat_example()
    # The 9:59 gap gets no marker, 10:00 does; the turn after the target is never shown.
    assert render_conversation(example) == (
        "A: Did you get the tickets?\n"
        "B: Not yet\n"
        "[10 minutes later]\n"
        "B: the site is down\n"
        "[2 hours later]\n"
        "A: Seriously?!"
    )
    assert render_target(example) == "A: Seriously?!"
    assert [t.text for t in visible_turns(example)] == [
        "Did you get the tickets?",
        "Not yet",
        "the site is down",
        "Seriously?!",
    ]
    prompt = build_prompt(example)
    assert "never shown" not in prompt
    assert prompt.endswith(
        "Conversation:\n" + render_conversation(example) + "\n\nTurn to analyze:\nA: Seriously?!"
    )
    assert "[22 minutes later]" in prompt  # the time markers are explained when they occur
    assert "[22 minutes later]" not in build_prompt(
        chat_example(turns=[Turn("A", "hi"), Turn("B", "yo")], target=1)
    )


def test_forum_reply_chains_golden():
    turns = [
        Turn("User 1", "Has anyone tried the new bus route?"),
        Turn("User 2", "Yes, it saves me ten minutes.", reply_to=0),
        Turn("User 3", "Not me.\nIt skips my stop.", reply_to=1),
        Turn("User 1", "Thanks both"),
        Turn("User 4", "Mine too", reply_to=2),
    ]
    example = Example("f", "ccu_emotion", turns, 4, ["Sadness"])
    assert render_conversation(example) == (
        "User 1: Has anyone tried the new bus route?\n"
        "User 2:\n"
        "  | User 1: Has anyone tried the new bus route?\n"
        "  Yes, it saves me ten minutes.\n"
        "User 3:\n"
        "  | User 2:\n"
        "  | | User 1: Has anyone tried the new bus route?\n"
        "  | Yes, it saves me ten minutes.\n"
        "  Not me.\n"
        "  It skips my stop.\n"
        "User 1: Thanks both\n"
        "User 4:\n"
        "  | User 3:\n"
        "  | | User 2:\n"
        "  | | | User 1: Has anyone tried the new bus route?\n"
        "  | | Yes, it saves me ten minutes.\n"
        "  | Not me.\n"
        "  | It skips my stop.\n"
        "  Mine too"
    )
    assert render_target(example) == "User 4: Mine too"
    assert "behind `|`" in build_prompt(example) and "indented under it" in build_prompt(example)
    assert "behind `|`" not in build_prompt(chat_example()) and "indented" not in build_prompt(
        chat_example()
    )
    # a reply spans lines: both notes
    one_reply = Example("g", "ccu_emotion", turns[:2], 1, ["Joy"])
    assert "behind `|`" in build_prompt(one_reply) and "indented under it" in build_prompt(
        one_reply
    )
    multi_line = Example("h", "ccu_emotion", [Turn("A", "one\ntwo")], 0, ["Joy"])
    assert "indented under it" in build_prompt(multi_line) and "behind `|`" not in build_prompt(
        multi_line
    )


def test_story_without_speaker_renders_bare():
    tom = Example(
        "t",
        "tom_mc",
        [Turn("", "Line one.\nLine two.")],
        None,
        ["B"],
        meta={"question": "Where is the ball?", "options": ["Box", "Basket"]},
    )
    assert render_conversation(tom) == "Line one.\nLine two."
    assert render_target(tom) == ""


# ----------------------------------------------------------------------------- prompts


def all_task_examples():
    turns = [Turn("A", "Could you look at my edit?"), Turn("B", "Done, and I protected the page.")]
    return {
        "ccu_emotion": chat_example(),
        "ccu_dialog_act": chat_example(task="ccu_dialog_act", labels=["Doing request"]),
        "ccu_norm": chat_example(task="ccu_norm", labels=["Violate"], dialog_act="Doing request"),
        "meld_emotion": Example("m", "meld_emotion", turns, 1, ["joy"]),
        "cped_emotion": Example("ce", "cped_emotion", turns, 1, ["relaxed"], language="zh"),
        "cped_dialog_act": Example("cd", "cped_dialog_act", turns, 1, ["answer"], language="zh"),
        "wiki_power": Example("w", "wiki_power", turns, None, ["B"]),
        "tom_mc": Example(
            "t",
            "tom_mc",
            [Turn("", "Sam hides the key.")],
            None,
            ["A"],
            meta={"question": "Where does Ann look?", "options": ["Drawer", "Box", "Bag"]},
        ),
        "mmlu": Example(
            "q",
            "mmlu",
            [],
            None,
            ["D"],
            meta={"question": "2 + 2 = ?", "options": ["1", "2", "3", "4"]},
        ),
        "toy_emotion": Example("toy", "toy_emotion", turns, 1, ["fear"]),
        "toy_tom": Example(
            "tt",
            "toy_tom",
            [Turn("", "Anna puts the ball in the basket."), Turn("", "Anna goes out.")],
            None,
            ["A"],
            meta={"question": "Where will Anna look first?", "options": ["basket", "box"]},
        ),
        "care_rubric": Example(
            "r",
            "care_rubric",
            [Turn("user", "I feel stuck.")],
            None,
            [],
            meta={
                "prompt": [
                    {"role": "system", "content": "Write a rubric."},
                    {"role": "user", "content": "User: I feel stuck."},
                ]
            },
        ),
    }


def test_every_task_has_an_example_here():
    assert set(all_task_examples()) == set(TASKS)


def test_a_generation_task_takes_its_prompt_from_the_example_and_has_no_labels():
    example = check_example(all_task_examples()["care_rubric"])
    assert TASKS["care_rubric"].messages(example) == example.meta["prompt"]
    # nothing to parse: the completion is the output
    assert parse_answer("Answer: cognitive", example) is None
    for change, field in [
        ({"labels": ["cognitive"]}, "labels"),
        ({"meta": {}}, "meta.prompt"),
        ({"meta": {"prompt": [{"role": "user"}]}}, "meta.prompt"),
    ]:
        with pytest.raises(DataError, match=f"field '{field}'"):
            check_example(dataclasses.replace(example, **change))


@pytest.mark.parametrize("name", [name for name, task in TASKS.items() if not task.own_prompt])
def test_prompt_carries_every_required_element(name):
    example = check_example(all_task_examples()[name])
    task = TASKS[name]
    messages = task.messages(example)
    assert [m["role"] for m in messages] == ["user"]
    other = TASKS["mmlu" if name != "mmlu" else "tom_mc"]
    with pytest.raises(DataError, match=f"is for task {name}, not {other.name}"):
        other.messages(example)
    prompt = messages[0]["content"]
    brief = task_brief(example)
    assert brief in prompt or all(part in prompt for part in brief.split("\n\n"))
    assert "last line" in prompt and "last line" not in brief  # answer format: prompt only
    if task.choices:
        letters = task.labels[: len(example.meta["options"])]
        assert f"exactly one of: {', '.join(letters)}." in prompt
        for letter, option in zip(letters, example.meta["options"]):
            assert f"\n{letter}. {option}" in prompt and f"\n{letter}. {option}" in brief
    else:
        for label in task.labels:  # every label with its definition
            assert f"\n- {label}: {task.definitions[label]}" in prompt
            assert f"\n- {label}: {task.definitions[label]}" in brief
    if name != "mmlu":
        assert "<evidence> and </evidence>" in prompt and "copied exactly" in prompt
    if task.multi_label:
        assert (
            f'"Answer: {task.labels[0]}, {task.labels[1]}"' in prompt
            and f'"Answer: {task.catch_all}"' in prompt
        )
    elif not task.choices:
        assert f"exactly one of: {', '.join(task.labels)}." in prompt
    if example.culture:
        assert (
            f"The applicable culture is: {example.culture}." in prompt and example.culture in brief
        )
    if task.turn_level:
        assert prompt.endswith(
            render_target(example)
            + (f"\nDialog act of the turn: {example.dialog_act}" if name == "ccu_norm" else "")
        )
    if name == "ccu_norm":
        assert "Dialog act of the turn: Doing request" in brief
    if name == "tom_mc":
        assert "Story:\nSam hides the key." in prompt and "Sam hides" not in brief


# ----------------------------------------------------------------------------- answers


def think(answer_text, reasoning="Step one.\n\nStep two."):
    return f"<think>\n{reasoning}\n</think>\n\n{answer_text}"


@pytest.mark.parametrize(
    "task, text, expected",
    [
        ("ccu_emotion", "Answer: Joy", ["Joy"]),
        ("ccu_emotion", "Answer: joy, TRUST", ["Joy", "Trust"]),
        ("ccu_emotion", "Answer: none", ["None"]),
        ("ccu_emotion", "Answer: None, Joy", None),  # the catch-all stands alone
        ("ccu_emotion", "Answer: Joy, Joy", ["Joy"]),
        ("ccu_emotion", "Answer: Happiness", None),
        ("ccu_emotion", "Answer:", None),
        ("ccu_emotion", "The answer is Joy.", None),
        (
            "ccu_dialog_act",
            "Answer: doing request, Doing Persuasion",
            ["Doing request", "Doing persuasion"],
        ),
        (
            "ccu_dialog_act",
            "Answer: Doing finalizing negotiation/deal",
            ["Doing finalizing negotiation/deal"],
        ),
        ("ccu_dialog_act", "Answer: request", None),
        ("ccu_norm", "Answer: violate", ["Violate"]),
        ("ccu_norm", "Answer: Adhere, Violate", None),  # single-label
        ("meld_emotion", "Answer: Neutral", ["neutral"]),
        ("meld_emotion", "Answer: anticipation", None),  # a CCU label, not MELD's
        ("cped_emotion", "Answer: Negative-Other", ["negative-other"]),
        ("cped_dialog_act", "Answer: statement-non-opinion", ["statement-non-opinion"]),
        ("cped_dialog_act", "Answer: statement", None),
        ("wiki_power", "Answer: b", ["B"]),
        ("wiki_power", "Answer: C", None),
        ("tom_mc", "Answer: C", ["C"]),  # the example here has three options
        ("tom_mc", "Answer: D", None),  # a letter of the task, but past this item's options
        ("tom_mc", "Answer: A. Drawer", None),
        ("mmlu", "Answer: d", ["D"]),
        ("mmlu", "Answer: E", None),
    ],
)
def test_parse_answer_per_task(task, text, expected):
    example = all_task_examples()[task]
    assert parse_answer(think(text), example) == expected
    if not TASKS[task].choices:
        # the name is enough when no item has options
        assert parse_answer(think(text), task) == expected


def test_a_letter_outside_the_items_own_options_is_invalid():
    two = Example(
        "t2",
        "tom_mc",
        [Turn("", "A story.")],
        None,
        ["B"],
        meta={"question": "Q?", "options": ["x", "y"]},
    )
    assert parse_answer(think("Answer: B"), two) == ["B"]
    assert parse_answer(think("Answer: C"), two) is None  # C is no answer to a two-option item
    assert TASKS["tom_mc"].answer_labels(two) == ("A", "B")
    with pytest.raises(ValueError, match="tom_mc is multiple-choice: pass the example"):
        parse_answer(think("Answer: A"), "tom_mc")


@pytest.mark.parametrize("n", [2, 5, 6, 26])
def test_tom_mc_takes_two_to_26_options(n):
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:n]
    item = Example(
        "t",
        "tom_mc",
        [Turn("", "A story.")],
        None,
        [letters[-1]],
        meta={"question": "Q?", "options": [f"option {i}" for i in range(n)]},
    )
    check_example(item)
    assert TASKS["tom_mc"].answer_labels(item) == tuple(letters)
    prompt = build_prompt(item)
    assert (
        f"\n{letters[-1]}. option {n - 1}" in prompt
        and f"exactly one of: {', '.join(letters)}." in prompt
    )
    assert parse_answer(think(f"Answer: {letters[-1].lower()}"), item) == [letters[-1]]
    assert (
        n == 26 or parse_answer(think(f"Answer: {'ABCDEFGHIJKLMNOPQRSTUVWXYZ'[n]}"), item) is None
    )
    too_many = dataclasses.replace(item, meta={"question": "Q?", "options": ["x"] * 27})
    with pytest.raises(DataError, match="field 'meta.options': expected 2 to 26 strings"):
        check_example(too_many)


def test_parse_answer_reads_only_after_the_final_think_end():
    reasoning = "Maybe Joy.\nAnswer: Joy\n\nNo, it is fear."
    assert parse_answer(think("Answer: Fear", reasoning), "ccu_emotion") == ["Fear"]
    assert parse_answer(think("Answer: Anger", "a </think> b"), "ccu_emotion") == ["Anger"]
    assert parse_answer(think("", reasoning), "ccu_emotion") is None  # only the reasoning has one
    # no </think>: the reasoning never closed
    assert parse_answer("Answer: Joy", "ccu_emotion") is None
    assert parse_answer("Hmm.</think>\nAnswer: Joy\nAnswer: Sadness\n", "ccu_emotion") == [
        "Sadness"
    ]
    assert parse_answer("</think>  answer :  Joy ,Trust  ", "ccu_emotion") == ["Joy", "Trust"]
    with pytest.raises(DataError, match="unknown task 'emotion'"):
        parse_answer("</think>Answer: Joy", "emotion")


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("reasoning</think>\nAnswer: sadness", True),
        ("<think>\nreasoning\n</think>\n\nAnswer: sadness\n", True),
        (
            "  <think>reasoning</think>\n  answer : not a label",
            True,
        ),  # labels are parse_answer's question
        ("reasoning</think>\nsadness", False),
        ("reasoning</think>\nAnswer: sadness\nbecause she lost her job", False),
        ("a</think>b</think>\nAnswer: sadness", False),
        ("<think>\n</think>\nAnswer: sadness", False),  # no reasoning
        ("reasoning\nAnswer: sadness", False),  # never closed
        ("<think>a <think>b</think>\nAnswer: sadness", False),  # a second opener
        ("So <think>reasoning</think>\nAnswer: sadness", False),  # an opener that does not open
    ],
)
def test_well_formed(completion, expected):
    assert well_formed(completion) is expected


def test_split_completion_and_blocks():
    completion = "<think>\nFirst <evidence>hi</evidence>.\n\n  \nSecond.\n</think>\n\nAnswer: Joy"
    reasoning, answer = split_completion(completion)
    assert reasoning == "First <evidence>hi</evidence>.\n\n  \nSecond."
    assert answer == "\n\nAnswer: Joy"
    assert split_blocks(reasoning) == ["First <evidence>hi</evidence>.", "Second."]
    assert split_completion("no closing tag, Answer: Joy") == ("no closing tag, Answer: Joy", "")
    assert split_completion("reasoning without opener</think>Answer: A") == (
        "reasoning without opener",
        "Answer: A",
    )
    assert split_blocks("one\nline\n\n\n\ntwo\r\n\r\nthree") == ["one\nline", "two", "three"]
    assert split_blocks("  \n\n") == []


# ----------------------------------------------------------------------------- stats


@pytest.fixture
def word_tokenizer(tmp_path):
    """A whitespace word-level tokenizer: its token count is len(text.split()), an independent
    oracle."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"[UNK]": 0, "Answer:": 1}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return tok, path


def test_count_tokens_and_stats(word_tokenizer, tmp_path, capsys):
    tok, path = word_tokenizer
    assert count_tokens("Answer: Joy  and\nmore", tok) == 4
    assert count_tokens("a b", type("Ids", (), {"encode": lambda self, text: [1, 2, 3]})()) == 3
    examples = [
        chat_example(id="a"),
        chat_example(id="b", target=1, labels=["Joy", "Fear"]),
        Example("w", "wiki_power", [Turn("A", "x"), Turn("B", "y")], None, ["B"]),
    ]
    save_jsonl(examples, tmp_path / "s.jsonl")
    main(["stats", str(tmp_path / "s.jsonl"), "--tokenizer", str(tmp_path)])
    report = capsys.readouterr().out
    assert report.startswith("3 examples\n")
    assert (
        "ccu_emotion: 2 examples\n  labels: Surprise 1, Joy 1, Fear 1\n"
        "  visible turns: min 2, median 4, mean 3.0, max 4"
    ) in report
    lengths = sorted(len(build_prompt(e).split()) for e in examples[:2])
    mean = sum(lengths) / 2
    assert (
        f"prompt tokens: min {lengths[0]}, median {lengths[1]}, mean {mean:.1f}, max {lengths[1]}"
        in report
    )
    assert (
        "wiki_power: 1 examples\n  labels: B 1\n  visible turns: min 2, median 2, mean 2.0, max 2"
        in report
    )
    assert "prompt tokens" not in stats(examples)  # without a tokenizer
    assert stats(examples).splitlines() == [
        line for line in report.splitlines() if "prompt tokens" not in line
    ]


def test_stats_counts_an_own_prompt_tasks_messages(word_tokenizer, tmp_path, capsys):
    """reward_models/rubric_generator.py's examples (task care_rubric) carry their chat prompt and
    no labels."""
    prompt = [
        {"role": "system", "content": "You write rubrics."},
        {"role": "user", "content": "Score the next reply to: I am anxious"},
    ]
    example = Example("r", "care_rubric", [Turn("user", "I am anxious")], None, [])
    example.meta["prompt"] = prompt
    save_jsonl([example], tmp_path / "r.jsonl")
    main(["stats", str(tmp_path / "r.jsonl"), "--tokenizer", str(tmp_path)])
    assert capsys.readouterr().out == (
        "1 examples\n\ncare_rubric: 1 examples\n  visible turns: min 1, median 1, mean 1.0, max 1\n"
        "  prompt tokens: min 11, median 11, mean 11.0, max 11\n"
    )


def test_stats_reads_the_sft_rows_docs_sft_md_describes(tmp_path, capsys):
    """`python dataset.py stats` on SFT rows (an example with its `completion`, and a `prompt` of
    its own): the example's counts (was: "field 'completion': unknown field")."""
    import dataset

    example = {
        "id": "r1",
        "task": "meld_emotion",
        "turns": [{"speaker": "A", "text": "I failed again."}],
        "target": 0,
        "labels": ["sadness"],
    }
    rows = tmp_path / "sft.jsonl"
    rows.write_text(
        json.dumps(example | {"completion": "<think>\nx\n</think>\n\nAnswer: sadness"})
        + "\n"
        + json.dumps(
            example
            | {"id": "r2", "completion": "Answer: sadness"}
            | {"prompt": [{"role": "user", "content": "the emotion?"}]}
        )
        + "\n"
    )
    dataset.main(["stats", str(rows)])
    out = capsys.readouterr().out
    assert "meld_emotion" in out and "2" in out


def test_stats_counts_by_meta_fields_nested_as_social_r1s_table_3(tmp_path, capsys):
    """`stats --by ability sub_ability`: the examples per ability, then per sub-ability within it,
    most frequent first (Table 3's layout), counted by hand here: 3 Belief (2 + 1), 1 Desire."""
    import dataset

    def item(n, ability, sub):
        meta = {"question": "?", "options": ["x", "y"], "ability": ability, "sub_ability": sub}
        return Example(f"q{n}", "tom_mc", [Turn("", "s")], None, ["A"], meta=meta)

    path = tmp_path / "hard.jsonl"
    subs = [("Belief", "Second-order"), ("Desire", "Multiple"), ("Belief", "Location")]
    save_jsonl([item(n, a, s) for n, (a, s) in enumerate([*subs, subs[0]])], path)
    dataset.main(["stats", str(path), "--by", "ability", "sub_ability"])
    out = capsys.readouterr().out.splitlines()
    at = out.index("  ability Belief: 3")
    assert out[at : at + 5] == [
        "  ability Belief: 3",
        "    sub_ability Second-order: 2",
        "    sub_ability Location: 1",
        "  ability Desire: 1",
        "    sub_ability Multiple: 1",
    ]
