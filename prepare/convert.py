"""Dataset converters: public dataset files (MELD, CPED, ECF 2.0, ToMBench, CCU annotation packages,
ConvoKit Wikipedia talk pages, MMLU, and the social-reasoning benchmarks SocialIQA, SimpleToM,
Hi-ToM, EmoBench, MotiveBench and TactfulToM as tom_mc multiple choice) to our example JSONL, each
checked by dataset.py's schema.

    python -m prepare.convert FORMAT IN OUT [--text FILE] [--task NAME]... [--language L]...
        [--per-label N] [--seed S]

EmpatheticDialogues, MSDialog, MedDialog-EN and ICLR's OpenReview review threads become dialogues
in ESConv's layout for EmoLLM's Stage I (prepare/emollm_rows.py), or with --seeds the scenario
seeds of dialogue/rl.py's runs.

A local Hugging Face dataset (`hf`: a save_to_disk folder, parquet or JSON lines) converts with a
column mapping, `--column FIELD=COLUMN` and `--value FIELD=VALUE` (the optional `datasets` package).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import functools
import io
import itertools
import json
import math
import random
import re
import sys
from pathlib import Path

from config import ConfigError, atomic_write_text, check_output_file, excerpt
from data import OPTION_LETTERS, TASKS, DataError, Example, Turn
from dataset import (
    example_from_json,
    load_jsonl,
    parse_json,
    read_data_text,
    read_jsonl,
    save_jsonl,
    turn_from_json,
    typed_field,
)

# ----------------------------------------------------------------------------- converters


@contextlib.contextmanager
def _record(where: str):
    """Report a record of the wrong shape (a missing key, a list where an object belongs, text where
    a number belongs) as a DataError naming `where`; a DataError passes as it is."""
    try:
        yield
    except DataError:
        raise
    except KeyError as e:
        raise DataError(f"{where}: field {e}: missing") from None
    except (TypeError, AttributeError, IndexError, ValueError) as e:
        raise DataError(f"{where}: not in the expected format ({type(e).__name__}: {e})") from None


def _object(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _csv_lines(
    path, header: bool = False, width: int | None = None, **fmt
) -> list[tuple[int, dict | list]]:
    """(line number, row) pairs of a CSV/TSV, rows as dicts when it has a header; a BOM, CRLF (also
    inside quoted cells, made LF) and quoted newlines are handled; empty rows are skipped. Every row
    must have as many cells as the header (or `width`)."""
    reader = csv.reader(io.StringIO(read_data_text(path), newline=""), **fmt)
    names, rows = None, []
    try:
        for cells in reader:
            if not cells:
                continue
            if header and names is None:
                names, width = cells, len(cells)
                continue
            if width is not None and len(cells) != width:
                raise DataError(
                    f"{path}:{reader.line_num}: expected {width} fields, got {len(cells)}"
                )
            cells = [_lf(cell) for cell in cells]
            rows.append((reader.line_num, dict(zip(names, cells)) if header else cells))
    except csv.Error as e:
        raise DataError(f"{path}:{reader.line_num}: not valid CSV: {e}") from None
    return rows


def _lf(cell: str) -> str:
    return cell.replace("\r\n", "\n")


def _label(task: str, raw: str, where: str) -> str:
    label = TASKS[task].canonical(raw)
    if label is None:
        raise DataError(f"{where}: {excerpt(raw)} is not a label of {task}")
    return label


def _files(path, pattern: str, keep=lambda file: True) -> list[Path]:
    """`path` itself, or the files in the folder `path` that match `pattern` (`**/` reaches into
    subfolders) and `keep`, sorted by name."""
    path = Path(path)
    return sorted(f for f in path.glob(pattern) if keep(f)) if path.is_dir() else [path]


# MELD and CPED: one CSV row per utterance, in dialogue
# order; the columns holding each task's label.
_DIALOGUE_CSV = {
    "meld": dict(language="en", tasks={"meld_emotion": "Emotion"}),
    "cped": dict(language="zh", tasks={"cped_emotion": "Emotion", "cped_dialog_act": "DA"}),
}


def convert_dialogue_csv(path, name: str) -> list[Example]:
    """MELD (`name="meld"`) or CPED (`"cped"`) CSV: one example per utterance and task, the dialogue
    up to it as context; utterances whose gold label is the task's catch-all stay as context
    only."""
    spec, path = _DIALOGUE_CSV[name], Path(path)
    dialogues: dict[str, list[tuple[int, dict]]] = {}
    for line, row in _csv_lines(path, header=True):
        with _record(f"{path}:{line}"):
            dialogues.setdefault(row["Dialogue_ID"], []).append(
                (line, Turn(row["Speaker"], row["Utterance"]), row)
            )
    examples = []
    for dialogue, rows in dialogues.items():
        turns = [turn for _, turn, _ in rows]
        for i, (line, _, row) in enumerate(rows):
            for task, column in spec["tasks"].items():
                with _record(f"{path}:{line}"):
                    raw = row[column]
                label = _label(task, raw, f"{path}:{line}: field '{column}'")
                if label != TASKS[task].catch_all:
                    examples.append(
                        Example(
                            f"{path.stem}-{dialogue}-{i}-{task}",
                            task,
                            turns,
                            i,
                            [label],
                            language=spec["language"],
                        )
                    )
    return examples


def _detokenize(text: str) -> str:
    """Undo ECF's space before punctuation ("Oh , yeah ." -> "Oh, yeah.")."""
    return re.sub(r" +([,.!?;:])", r"\1", text)


def convert_ecf(path) -> list[Example]:
    """ECF 2.0 (SemEval-2024 Task 3) JSON: one meld_emotion example per utterance, text detokenized;
    the annotated causes at or before the target are kept as meta["causes"] ([{"turn", "span"}])."""
    path = Path(path)
    conversations = parse_json(read_data_text(path), path)
    if not isinstance(conversations, list):
        raise DataError(
            f"{path}: expected a JSON list of conversations, got {type(conversations).__name__}"
        )
    examples = []
    for k, conversation in enumerate(conversations):
        where = f"{path}: conversation {k}"
        with _record(where):
            utterances = _object(conversation, where)["conversation"]
            if [u["utterance_ID"] for u in utterances] != list(range(1, len(utterances) + 1)):
                raise DataError(
                    f"{where}: field 'utterance_ID': expected 1..{len(utterances)} in order"
                )
            turns = [Turn(u["speaker"], _detokenize(u["text"])) for u in utterances]
            causes: dict[int, list[dict]] = {}
            for emotion, cause in conversation["emotion-cause_pairs"]:
                target, cause_turn = int(emotion.split("_")[0]) - 1, int(cause.split("_")[0]) - 1
                record = {"turn": cause_turn, "span": _detokenize(cause.split("_", 1)[1])}
                if cause_turn <= target and record not in causes.setdefault(target, []):
                    causes[target].append(record)
            for i, u in enumerate(utterances):
                label = _label(
                    "meld_emotion", u["emotion"], f"{where}, utterance {i + 1}: field 'emotion'"
                )
                meta = {"causes": causes[i]} if causes.get(i) else {}
                examples.append(
                    Example(
                        f"ecf-{conversation['conversation_ID']}-{i + 1}",
                        "meld_emotion",
                        turns,
                        i,
                        [label],
                        meta=meta,
                    )
                )
    return examples


def _present(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


_TOMBENCH_KEYS = {"en": ("STORY", "QUESTION", "OPTION-{}"), "zh": ("故事", "问题", "选项{}")}
# ToMBench's six abilities, the columns of Social-R1's Tables 4, 8 and 11 (the release spells the
# last one two ways).
TOMBENCH_ABILITIES = (
    "Belief",
    "Desire",
    "Emotion",
    "Intention",
    "Knowledge",
    "Non-literal communication",
)


def tombench_ability(raw: str) -> str:
    """The ability an ABILITY string ("Belief: Location false beliefs") names: one of
    TOMBENCH_ABILITIES, matched case-insensitively on the text before its first colon; a string
    naming none is kept as written."""
    head = raw.split(":", 1)[0].strip()
    return next((a for a in TOMBENCH_ABILITIES if a.lower() == head.lower()), raw.strip())


def convert_tombench(path, languages: tuple[str, ...] = ("en", "zh")) -> list[Example]:
    """ToMBench JSONL (a file, or a folder of them and of subfolders holding them: ToMBench-Hard's
    train/ and test/ give its 800 items): a tom_mc example per item and language of
    `languages` (English and Chinese by default; ToMBench-Hard's files may hold English only).
    Handles the release's quirks: keys with a literal newline ("答案\\nANSWER"), the bare NaN (and
    NaN for absent options: two-option items), options that repeat their letter ("A. ...") and
    answers with trailing text ("A. "). Options run from A up to the first absent letter, as many as
    the item has (ToMBench-Hard's go up to F); one after a gap is an error. meta["ability"] is the
    ability of TOMBENCH_ABILITIES the item tests, meta["sub_ability"] its ABILITY string as
    written."""
    examples = []
    for file in _files(path, "**/*.jsonl"):
        # a file in a subfolder (ToMBench-Hard's train/ and test/) is named by its path below `path`
        name = (
            file.relative_to(path).with_suffix("").as_posix() if Path(path).is_dir() else file.stem
        )
        for number, record in read_jsonl(file, allow_nan=True):
            where = f"{file}:{number}"
            with _record(where):
                item = {key.split("\n")[-1]: value for key, value in _object(record, where).items()}
                answer = str(item.get("ANSWER", "")).strip()[:1].upper()
                raw = str(item["ABILITY"]) if _present(item.get("ABILITY")) else None
                for language in languages:
                    story, question, option = _TOMBENCH_KEYS[language]
                    if not _present(item.get(story)):
                        raise DataError(
                            f"{where}: field {story!r} is missing: the item has no {language} text "
                            f"(an English-only file converts with --language en)"
                        )
                    present = [
                        _present(item.get(option.format(letter))) for letter in OPTION_LETTERS
                    ]
                    n = present.index(False) if False in present else len(present)
                    if any(present[n:]):
                        late = OPTION_LETTERS[n + present[n:].index(True)]
                        raise DataError(
                            f"{where}: field {option.format(late)!r}: an option after the missing "
                            f"{option.format(OPTION_LETTERS[n])!r} ({language})"
                        )
                    options = [
                        re.sub(
                            rf"^{letter}\s*[.:：．、)]\s*",
                            "",
                            str(item[option.format(letter)]).strip(),
                        )
                        for letter in OPTION_LETTERS[:n]
                    ]
                    if answer not in OPTION_LETTERS[: len(options)]:
                        raise DataError(
                            f"{where}: field 'ANSWER': {excerpt(item.get('ANSWER'))} is not one "
                            f"of the {len(options)} options ({language})"
                        )
                    examples.append(
                        Example(
                            f"tombench-{language}-{name}-{number}",
                            "tom_mc",
                            [Turn("", item[story])],
                            None,
                            [answer],
                            language=language,
                            meta={
                                "question": item[question],
                                "options": options,
                                "ability": None if raw is None else tombench_ability(raw),
                                "sub_ability": None if raw is None else raw.strip(),
                            },
                        )
                    )
    return examples


def _choice(
    example_id: str,
    story: list[Turn],
    question: str,
    options: list[str],
    gold: int,
    where: str,
    language: str = "en",
    **meta,
) -> Example:
    """A tom_mc example: the story's turns (none when the question holds the scenario), the
    question, the options in order and the gold option's index; `meta` adds the source's own
    fields."""
    if not 2 <= len(options) <= len(OPTION_LETTERS) or not all(
        isinstance(o, str) and o.strip() for o in options
    ):
        raise DataError(f"{where}: expected 2 to 26 non-empty options, got {excerpt(options)}")
    if not 0 <= gold < len(options):
        raise DataError(f"{where}: the answer is not one of the {len(options)} options")
    return Example(
        example_id,
        "tom_mc",
        story,
        None,
        [OPTION_LETTERS[gold]],
        language=language,
        meta={"question": question, "options": options, **meta},
    )


def _gold(options: list, answer, where: str) -> int:
    """The index of the gold `answer` among `options` (a DataError located at `where`
    otherwise)."""
    if answer not in options:
        raise DataError(f"{where}: {excerpt(answer)} is not one of the {len(options)} choices")
    return options.index(answer)


def _json_records(file: Path) -> list[tuple[str, dict]]:
    """(where, record) for each object of a JSON list file, or of a JSON lines file."""
    text = read_data_text(file)
    if text.lstrip().startswith("["):
        records = [(f"{file}: record {n}", r) for n, r in enumerate(parse_json(text, file))]
    else:
        records = [(f"{file}:{line}", r) for line, r in read_jsonl(file)]
    return [(where, _object(r, where)) for where, r in records]


def convert_socialiqa(path) -> list[Example]:
    """SocialIQA (socialiqa-train-dev.zip): `dev.jsonl` with {context, question, answerA, answerB,
    answerC} per line and, beside it, `dev-labels.lst` holding the 1-based gold (1-3) of each line
    in the same order. `path` is the JSONL file; the labels file is found by its name."""
    path = Path(path)
    labels_path = path.with_name(f"{path.stem}-labels.lst")
    records = list(read_jsonl(path))
    labels = [line.strip() for line in read_data_text(labels_path).splitlines() if line.strip()]
    if len(labels) != len(records):
        raise DataError(
            f"{labels_path}: {len(labels)} labels for the {len(records)} questions of {path}"
        )
    examples = []
    for (number, record), label in zip(records, labels):
        where = f"{path}:{number}"
        with _record(where):
            item = _object(record, where)
            if label not in ("1", "2", "3"):
                raise DataError(f"{labels_path}: label {excerpt(label)} for line {number}: not 1-3")
            examples.append(
                _choice(
                    f"socialiqa-{path.stem}-{number}",
                    [Turn("", item["context"])],
                    item["question"],
                    [item["answerA"], item["answerB"], item["answerC"]],
                    int(label) - 1,
                    where,
                )
            )
    return examples


def convert_simpletom(path) -> list[Example]:
    """SimpleToM (allenai/SimpleToM): `mental-state-qa/test.jsonl`, `behavior-qa/test.jsonl` and
    `judgment-qa/test.jsonl`, one question per line {id, story, question, choices: {text, label},
    answerKey}; `path` is one file or the dataset folder (story-data, which has no questions, is
    skipped). The subset (the file's folder) is kept as meta["subset"]."""
    files = _files(path, "**/*.jsonl", lambda f: "story-data" not in f.parts)
    examples = []
    for file in files:
        for where, item in _json_records(file):
            with _record(where):
                choices = _object(item["choices"], f"{where}: field 'choices'")
                examples.append(
                    _choice(
                        f"simpletom-{item['id']}",
                        [Turn("", item["story"])],
                        item["question"],
                        list(choices["text"]),
                        _gold(
                            list(choices["label"]), item["answerKey"], f"{where}: field 'answerKey'"
                        ),
                        where,
                        subset=file.parent.name,
                    )
                )
    return examples


_HITOM = re.compile(
    r"Story:\n(?P<story>.*?)\nQuestion: (?P<question>[^\n]*)\nAnswer: (?P<answer>[^\n]*)\n"
    r"Choices: (?P<choices>[^\n]*)\n(?:\s*\n(?P<note>Note:.*))?",
    re.DOTALL,
)


def convert_hitom(path) -> list[Example]:
    """Hi-ToM (Hi-ToM_data/{Tell,No_Tell}/MC/length_L/sample_S/order_K.txt): each file holds a story
    of numbered lines, a question of ToM order K, the answer (a choice's text), the choices ("A.
    green_envelope, B. red_basket, ...") and a note of the story world's rules, which is kept after
    the story. `path` is one file or a folder; the CoT copies (the same stories) are skipped."""
    files = _files(path, "**/order_*.txt", lambda f: "CoT" not in f.parts)
    examples = []
    for file in files:
        if not re.fullmatch(r"order_\d+", file.stem):
            raise DataError(
                f"{file}: not a Hi-ToM story file name (order_K.txt, K the ToM order): a copy? "
                "rename or remove it"
            )
        match = _HITOM.search(read_data_text(file))
        if match is None:
            raise DataError(f"{file}: not a Hi-ToM story (Story:, Question:, Answer:, Choices:)")
        pairs = re.findall(r"(?:^|, )([A-Z])\. ((?:(?!, [A-Z]\. ).)+)", match["choices"])
        options = [text.strip() for _, text in pairs]
        if [letter for letter, _ in pairs] != list(OPTION_LETTERS[: len(pairs)]):
            raise DataError(
                f"{file}: choices {excerpt(match['choices'])} are not lettered A, B, ..."
            )
        if match["answer"].strip() not in options:
            raise DataError(f"{file}: answer {excerpt(match['answer'])} is not one of the choices")
        story = match["story"].strip()
        if match["note"]:
            story += "\n\n" + match["note"].strip()
        tell, _, length, sample = file.resolve().parts[-5:-1]
        examples.append(
            _choice(
                f"hitom-{tell}-{length}-{sample}-{file.stem}",
                [Turn("", story)],
                match["question"].strip(),
                options,
                options.index(match["answer"].strip()),
                str(file),
                order=int(file.stem.removeprefix("order_")),
                tell=tell,
            )
        )
    return examples


# EmoBench's questions (its src/configs/prompts.yaml), per language.
_EMOBENCH_QUESTIONS = {
    "en": {
        "emotion": "What emotion(s) would {subject} ultimately feel in this situation?",
        "cause": "Why would {subject} feel these emotions in this situation?",
        "EA": "In this scenario, what is the most effective {kind} for {subject}?",
    },
    "zh": {
        "emotion": "在这种情况下，{subject}最终会感受到什么情绪？",
        "cause": "{subject}为什么会在这种情况下感受到这些情绪？",
        "EA": "在这个场景中，{subject}最有效的{kind}是什么？",
    },
}


# EmoBench's categories as Social-R1's Table 10 names its columns: Emotional Understanding's four
# coarse categories, and Emotional Application's problems split by whose they are (its column
# sizes, 100 and 100 of 200 English questions, match -Self and -Others, not Personal and Social).
_EMOBENCH_CATEGORIES = {
    "complex_emotions": "Complex Emotions",
    "emotional_cues": "Emotional Cues",
    "personal_beliefs_and_experiences": "Personal Beliefs & Experiences",
    "perspective_taking": "Perspective Taking",
}


def emobench_category(raw: str) -> str:
    """The Table 10 column of an EmoBench category ("complex_emotions", "Personal-Others"); one
    it does not name is kept as written."""
    if raw.endswith(("-Self", "-Others")):
        return "Self" if raw.endswith("-Self") else "Interpersonal"
    return _EMOBENCH_CATEGORIES.get(raw, raw)


def convert_emobench(path) -> list[Example]:
    """EmoBench (data/EU.jsonl, data/EA.jsonl; English and Chinese lines): an Emotional Application
    item is one question (the most effective action or response), its label the gold choice's text;
    an Emotional Understanding item is two, the emotion and its cause, which share meta["group"]:
    EmoBench counts the item right only when both are (evaluate.py's group accuracy).
    meta["category"] is the item's column in Social-R1's Table 10 (emobench_category),
    meta["source_category"] the file's own. `path` is a file or the data folder."""
    examples = []
    for file in _files(path, "E[AU].jsonl"):
        for where, item in _json_records(file):
            with _record(where):
                language = item["language"]
                if language not in _EMOBENCH_QUESTIONS:
                    raise DataError(
                        f"{where}: field 'language': {excerpt(language)} is not a language "
                        f"EmoBench's questions are written in ({', '.join(_EMOBENCH_QUESTIONS)})"
                    )
                questions = _EMOBENCH_QUESTIONS[language]
                subject, scenario = item["subject"], [Turn("", item["scenario"])]
                if "emotion_choices" in item:
                    group = f"emobench-eu-{language}-{item['qid']}"
                    for part in ("emotion", "cause"):
                        options = list(item[f"{part}_choices"])
                        examples.append(
                            _choice(
                                f"{group}-{part}",
                                scenario,
                                questions[part].format(subject=subject),
                                options,
                                _gold(
                                    options, item[f"{part}_label"], f"{where}: field '{part}_label'"
                                ),
                                where,
                                language,
                                group=group,
                                category=emobench_category(item["coarse_category"]),
                                source_category=item["coarse_category"],
                            )
                        )
                else:
                    options = list(item["choices"])
                    kind = item["question type"].lower()
                    examples.append(
                        _choice(
                            f"emobench-ea-{language}-{item['qid']}",
                            scenario,
                            questions["EA"].format(subject=subject, kind=kind),
                            options,
                            _gold(options, item["label"], f"{where}: field 'label'"),
                            where,
                            language,
                            category=emobench_category(item["category"]),
                            source_category=item["category"],
                        )
                    )
    return examples


_MOTIVEBENCH_KEYS = (
    ("motivation", "Motivation Reasoning Question", "1"),
    ("behavior", "Behavior Reasoning Question", "2"),
    ("motivation_behavior", "Motivation and Behavior Reasoning Question", "3"),
)


def convert_motivebench(path) -> list[Example]:
    """MotiveBench (Persona/Persona_questions.json, Amazon/..., Blog/...): a JSON list of items,
    each with three questions (motivation, behavior, both) that hold their scenario, "Options N"
    lettered "A. ..." to "F. ..." and "Correct Answer N" a letter. Three examples per item, the
    options in the file's order (MotiveBench also averages over five reorderings); the file's
    source (Persona, Amazon, Blog) is kept as meta["source"]. `path` is a file or a folder."""
    files = _files(path, "**/*_questions.json")
    examples = []
    for file in files:
        source = file.stem.removesuffix("_questions")
        for where, item in _json_records(file):
            with _record(where):
                for kind, key, n in _MOTIVEBENCH_KEYS:
                    options = [
                        re.sub(rf"^{letter}\.\s*", "", option.strip())
                        for letter, option in zip(OPTION_LETTERS, item[f"Options {n}"])
                    ]
                    answer = str(item[f"Correct Answer {n}"]).strip().upper()
                    examples.append(
                        _choice(
                            f"motivebench-{source}-{item['idx']}-{kind}",
                            [],
                            item[key],
                            options,
                            OPTION_LETTERS.index(answer) if answer in OPTION_LETTERS else -1,
                            f"{where}: field 'Correct Answer {n}'",
                            kind=kind,
                            source=source,
                        )
                    )
    return examples


# TactfulToM's question lists with a correct and wrong answers (multiple choice) and with a yes/no
# answer (binary); the list questions (name every character who knows) have no single answer.
_TACTFUL_CHOICE = (
    "comprehensionQA",
    "justificationQA",
    "fact_reasonQA",
    "fact_truthQA",
    "beliefQAs",
    "lieabilityQAs",
)
_TACTFUL_BINARY = (
    "infoAccessibilityQAs_binary",
    "answerabilityQAs_binary",
    "liedetectabilityQAs_binary",
)
_SPEAKER_LINE = re.compile(r"\*\*(?P<speaker>[^*\n]+)\*\*:\s*(?P<text>.*)", re.DOTALL)


def _tactful_turns(context: str, where: str) -> list[Turn]:
    """The conversation `**Name**: text` paragraphs as turns; a paragraph without a speaker
    continues the turn before it."""
    turns = []
    for paragraph in (p.strip() for p in context.split("\n\n")):
        match = _SPEAKER_LINE.fullmatch(paragraph)
        if match:
            turns.append(Turn(match["speaker"].strip(), match["text"].strip()))
        elif turns and paragraph:
            turns[-1].text += "\n\n" + paragraph
        elif paragraph:
            raise DataError(f"{where}: field 'full_context': {excerpt(paragraph)} has no speaker")
    return turns


def _tactful_referent(qa: dict) -> str:
    """The information or question a binary question refers to ("Does X know this information?")."""
    if qa.get("information"):
        return f"Information: {qa['information']}\n"
    asked = [v for k, v in qa.items() if k.startswith(("fact_question", "comprehension_q")) and v]
    return f"Question: {asked[0]}\n" if asked else ""


def convert_tactfultom(path) -> list[Example]:
    """TactfulToM (dataset/final_set/Tactful_conv_set_N.json): a JSON list of conversation sets,
    each with its full conversation (`**Name**: text` paragraphs) and lists of questions. The
    multiple-choice ones (_TACTFUL_CHOICE) give the correct answer and the wrong ones; TactfulToM
    shuffles them at random for each run, here they are shuffled once with the question's id as the
    seed. The yes/no ones (_TACTFUL_BINARY) become two options, Yes and No, with the information or
    question they refer to before them; the list questions are left out. `path` is a file or a
    folder (only Tactful_conv_set_<N>.json files, not the release's stray copies)."""
    files = _files(path, "*.json", lambda f: re.fullmatch(r"Tactful_conv_set_\d+\.json", f.name))
    examples = []
    for file in files:
        for where, conversation in _json_records(file):
            with _record(where):
                turns = _tactful_turns(conversation["full_context"], where)
                for category in (*_TACTFUL_CHOICE, *_TACTFUL_BINARY):
                    for qa in conversation.get(category) or []:
                        at = f"{where}: {category} {excerpt(qa.get('q_id'))}"
                        if category in _TACTFUL_BINARY:
                            options = ["Yes", "No"]
                            answer = qa["correct_answer"].strip().lower()
                            gold = _gold(["yes", "no"], answer, f"{at}: field 'correct_answer'")
                            question = _tactful_referent(qa) + qa["question"]
                        else:
                            wrong = qa["wrong_answer"]
                            options = [
                                qa["correct_answer"],
                                *([wrong] if isinstance(wrong, str) else wrong),
                            ]
                            random.Random(qa["q_id"]).shuffle(options)
                            gold = _gold(
                                options, qa["correct_answer"], f"{at}: field 'correct_answer'"
                            )
                            question = qa["question"]
                        examples.append(
                            _choice(
                                f"tactfultom-{qa['q_id']}",
                                turns,
                                question,
                                options,
                                gold,
                                at,
                                category=category,
                                question_type=qa.get("question_type"),
                            )
                        )
    return examples


def _root(utterance: dict):
    # ConvoKit 2 / ConvoKit 1 spelling
    return utterance.get("conversation_id", utterance.get("root"))


def _speaker(utterance: dict):
    return utterance.get("speaker", utterance.get("user"))


def convert_wiki_power(path, limit: int = 1000) -> list[Example]:
    """ConvoKit Wikipedia talk pages (`utterances.jsonl`, or the corpus folder): scan utterances in
    file order, group consecutive ones sharing a root, and take the first `limit` conversations with
    exactly two speakers and at least one `is-admin` utterance (the paper's selection); name the
    speakers A and B by first appearance, the gold being the admin. A selected conversation in which
    both speakers made admin utterances has no power difference to predict: it counts toward
    `limit` and is left out."""
    path = Path(path)
    path = path / "utterances.jsonl" if path.is_dir() else path
    utterances = []
    for number, record in read_jsonl(path):
        where = f"{path}:{number}"
        with _record(where):
            utterance = _object(record, where)
            if _root(utterance) is None or _speaker(utterance) is None:
                raise DataError(f"{where}: field 'conversation_id' or 'speaker': missing")
            meta = utterance.get("meta") or {}
            utterances.append(
                (
                    _root(utterance),
                    _speaker(utterance),
                    str(utterance["id"]),
                    utterance["text"],
                    bool(_object(meta, f"{where}: field 'meta'").get("is-admin")),
                )
            )
    examples, selected = [], 0
    for _, group in itertools.groupby(utterances, key=lambda u: u[0]):
        group = list(group)
        speakers = list(dict.fromkeys(speaker for _, speaker, *_ in group))
        admins = {speaker for _, speaker, _, _, admin in group if admin}
        if len(speakers) != 2 or not admins:
            continue
        selected += 1
        if len(admins) == 1:
            letters = dict(zip(speakers, "AB"))
            turns = [Turn(letters[speaker], text) for _, speaker, _, text, _ in group]
            examples.append(
                Example(f"wiki-{group[0][2]}", "wiki_power", turns, None, [letters[admins.pop()]])
            )
        if selected == limit:
            break
    return examples


# LDC's CCU norm ids for the ten social acts of the dialog-act
# and norm tasks; other ids are left out. the last label is None
CCU_NORM_ACTS = dict(zip(map(str, range(101, 111)), TASKS["ccu_dialog_act"].labels[:-1]))


def _ccu_conversations(text_path) -> dict[str, tuple[dict, list[Turn], dict[str, int]]]:
    """file_id -> (the line's fields, turns, segment_id -> turn index) from the CCU text JSONL: one
    conversation per line, {"file_id", "language", "culture", "turns": [{..turn..,
    "segment_id"}]}."""
    conversations = {}
    for number, raw in read_jsonl(text_path):
        try:
            unknown = set(_object(raw, "line")) - {"file_id", "language", "culture", "turns"}
            if unknown:
                raise DataError(f"field '{sorted(unknown)[0]}': unknown field")
            turns = [
                turn_from_json(t, i, extra=("segment_id",))
                for i, t in enumerate(typed_field(raw, "turns", list))
            ]
            segments = {
                t["segment_id"]: i for i, t in enumerate(raw["turns"]) if t.get("segment_id")
            }
            conversations[typed_field(raw, "file_id", str)] = (raw, turns, segments)
        except DataError as e:
            raise DataError(f"{text_path}:{number}: {e}") from None
    return conversations


def convert_ccu(
    annotation_dir, text_path, norm_acts: dict[str, str] = CCU_NORM_ACTS
) -> list[Example]:
    """A CCU annotation package (`data/emotions.tab`, `data/norms.tab`) paired with the conversation
    text (see `_ccu_conversations`; files without text are skipped). Per annotated segment:
    ccu_emotion keeps the emotions that at least two annotators chose (a segment with one annotator
    is unscored, none reaching two is the catch-all None); ccu_dialog_act lists the acts of its
    norms (`norm_acts` maps norm ids to acts; "none" is the catch-all); ccu_norm asks adhere/violate
    once per act."""
    conversations = _ccu_conversations(text_path)
    annotation_dir = Path(annotation_dir)
    segments: dict[tuple[str, str], dict] = {}

    def segment(tab: Path, line: int, row: dict) -> dict | None:
        if row["file_id"] not in conversations:
            return None
        if row["segment_id"] not in conversations[row["file_id"]][2]:
            raise DataError(
                f"{tab}:{line}: field 'segment_id': {row['segment_id']} has no turn in {text_path}"
            )
        return segments.setdefault(
            (row["file_id"], row["segment_id"]), {"voters": set(), "votes": {}, "norms": {}}
        )

    tab = annotation_dir / "data" / "emotions.tab"
    for line, row in _csv_lines(tab, header=True, delimiter="\t", quoting=csv.QUOTE_NONE):
        if row["emotion"] != "noann" and (seg := segment(tab, line, row)) is not None:
            seg["voters"].add(row["user_id"])
            for name in row["emotion"].split(","):
                if name.strip() != "none":
                    label = _label("ccu_emotion", name, f"{tab}:{line}: field 'emotion'")
                    seg["votes"][label] = seg["votes"].get(label, 0) + 1
    tab = annotation_dir / "data" / "norms.tab"
    for line, row in _csv_lines(tab, header=True, delimiter="\t", quoting=csv.QUOTE_NONE):
        if (
            row["norm"] != "noann"
            and (seg := segment(tab, line, row)) is not None
            and row["norm"] in norm_acts
        ):
            seg["norms"][row["norm"]] = (
                norm_acts[row["norm"]],
                _label("ccu_norm", row["status"], f"{tab}:{line}: field 'status'"),
            )
    examples = []
    for file_id, (raw, turns, segment_turns) in conversations.items():
        fields = dict(language=raw.get("language", "en"), culture=raw.get("culture"))
        for segment_id, i in segment_turns.items():
            seg = segments.get((file_id, segment_id))
            if seg is None:
                continue
            meta = {"file_id": file_id, "segment_id": segment_id}
            emotions = [e for e in TASKS["ccu_emotion"].labels if seg["votes"].get(e, 0) >= 2]
            if len(seg["voters"]) >= 2 and emotions:
                examples.append(
                    Example(
                        f"ccu-{segment_id}-emotion",
                        "ccu_emotion",
                        turns,
                        i,
                        emotions,
                        **fields,
                        meta=meta,
                    )
                )
            acts = [
                a
                for a in TASKS["ccu_dialog_act"].labels
                if a in {act for act, _ in seg["norms"].values()}
            ]
            if acts:
                examples.append(
                    Example(
                        f"ccu-{segment_id}-dialog_act",
                        "ccu_dialog_act",
                        turns,
                        i,
                        acts,
                        **fields,
                        meta=meta,
                    )
                )
            for norm, (act, status) in seg["norms"].items():
                examples.append(
                    Example(
                        f"ccu-{segment_id}-norm-{norm}",
                        "ccu_norm",
                        turns,
                        i,
                        [status],
                        dialog_act=act,
                        **fields,
                        meta=meta | {"norm": norm},
                    )
                )
    return examples


def convert_mmlu(path) -> list[Example]:
    """MMLU: the original header-less CSVs (question, A, B, C, D, answer letter; subject from the
    file name, e.g. `anatomy_test.csv`), a file or a folder of them, or JSON/JSONL records
    {question, choices, answer (index or letter), subject}."""
    examples = []
    for file in _files(path, "*.csv"):
        if file.suffix == ".csv":
            subject = re.sub(r"_(test|dev|val)$", "", file.stem)
            records = [
                (
                    f"{file}:{line}",
                    {"question": r[0], "choices": r[1:5], "answer": r[5], "subject": subject},
                )
                for line, r in _csv_lines(file, width=6)
            ]
        else:
            text = read_data_text(file)
            if text.lstrip().startswith("["):
                rows = parse_json(text, file)
                records = [(f"{file}: record {n}", r) for n, r in enumerate(rows)]
            else:
                records = [(f"{file}:{line}", r) for line, r in read_jsonl(file)]
        for n, (where, record) in enumerate(records):
            with _record(where):
                answer, choices = _object(record, where)["answer"], list(record["choices"])
                letter = (
                    "ABCD"[answer]
                    if isinstance(answer, int) and 0 <= answer < 4
                    else str(answer).strip().upper()
                )
                if letter not in "ABCD"[: len(choices)] or not letter:
                    raise DataError(
                        f"{where}: field 'answer': {excerpt(answer)} is not one of {len(choices)} "
                        f"choices"
                    )
                subject = record.get("subject") or file.stem
                examples.append(
                    Example(
                        f"mmlu-{file.stem}-{n}",
                        "mmlu",
                        [],
                        None,
                        [letter],
                        meta={
                            "question": record["question"],
                            "options": choices,
                            "subject": subject,
                        },
                    )
                )
    return examples


# EmpatheticDialogues, MSDialog, MedDialog and ICLR reviews (EmoLLM's SFT/RL sources): dialogues in
# ESConv's layout, which prepare/emollm_rows.py reads, or scenario seeds for grpo.py's
# dialogue runs (`--seeds`). Each dialogue: {"id", "situation"?, "problem_type"?,
# "emotion_type"?, "dialog": [{"speaker": "seeker" | "supporter", "content"}]}.
_ED_COLUMNS = ["conv_id", "utterance_idx", "context", "prompt", "speaker_idx", "utterance"]


def convert_empathetic_dialogues(path) -> list[dict]:
    """EmpatheticDialogues CSV (train.csv, valid.csv, test.csv as the release ships them), the
    layout assumed: a header starting conv_id,utterance_idx,context,prompt,speaker_idx,utterance
    (selfeval, tags and any further cells are ignored), one row per utterance, commas inside a cell
    written as `_comma_`, no quoting. A conversation is the rows of one conv_id ordered by
    utterance_idx; its first speaker told the situation (`prompt`, the situation) and felt the
    emotion (`context`, the emotion type): the seeker; the other speaker is the supporter."""
    path, dialogues = Path(path), {}
    rows = _csv_lines(path, quoting=csv.QUOTE_NONE)
    if not rows or rows[0][1][: len(_ED_COLUMNS)] != _ED_COLUMNS:
        raise DataError(f"{path}:1: expected the header {','.join(_ED_COLUMNS)},...")
    for line, cells in rows[1:]:
        if len(cells) < len(_ED_COLUMNS):
            raise DataError(
                f"{path}:{line}: expected at least {len(_ED_COLUMNS)} fields, got {len(cells)}"
            )
        row = {k: v.replace("_comma_", ",").strip() for k, v in zip(_ED_COLUMNS, cells)}
        if not row["utterance"]:
            raise DataError(f"{path}:{line}: field 'utterance': empty")
        if not (row["utterance_idx"].isascii() and row["utterance_idx"].isdigit()):
            raise DataError(
                f"{path}:{line}: field 'utterance_idx': expected a number, "
                f"got {excerpt(row['utterance_idx'])}"
            )
        dialogues.setdefault(row["conv_id"], []).append((int(row["utterance_idx"]), row))
    out = []
    for conv_id, turns in dialogues.items():
        turns.sort(key=lambda x: x[0])
        first = turns[0][1]
        dialog = [
            {
                "speaker": "seeker" if r["speaker_idx"] == first["speaker_idx"] else "supporter",
                "content": r["utterance"],
            }
            for _, r in turns
        ]
        out.append(
            {
                "id": conv_id,
                "situation": first["prompt"],
                "emotion_type": first["context"],
                "dialog": dialog,
            }
        )
    return out


def convert_msdialog(path) -> list[dict]:
    """MSDialog JSON (MSDialog-Complete / -Intent), the layout assumed: one object mapping each
    dialogue id to {"title", "category", "utterances": [{"actor_type": "User" | "Agent",
    "utterance", ...}]}, utterances in dialogue order. The user asking for help is the seeker, every
    agent answering the supporter; the title is the situation, the category the problem type."""
    path, out = Path(path), []
    for dialog_id, record in _object(parse_json(read_data_text(path), path), str(path)).items():
        where = f"{path}: dialogue {dialog_id}"
        with _record(where):
            utterances = _object(record, where)["utterances"]
            dialog = []
            for i, u in enumerate(utterances):
                actor, text = u["actor_type"], u["utterance"]
                if actor not in ("User", "Agent") or not isinstance(text, str) or not text.strip():
                    bad = "actor_type" if actor not in ("User", "Agent") else "utterance"
                    raise DataError(
                        f"{where}: field 'utterances[{i}].{bad}': {excerpt(u[bad])} (expected "
                        f"{'User or Agent' if bad == 'actor_type' else 'non-empty text'})"
                    )
                dialog.append(
                    {
                        "speaker": "seeker" if actor == "User" else "supporter",
                        "content": text.strip(),
                    }
                )
            if not dialog:
                raise DataError(f"{where}: field 'utterances': empty")
            for key in ("title", "category"):
                if not isinstance(record[key], str) or not record[key].strip():
                    raise DataError(
                        f"{where}: field '{key}': {excerpt(record[key])} (expected non-empty text)"
                    )
            out.append(
                {
                    "id": f"msdialog-{dialog_id}",
                    "situation": record["title"].strip(),
                    "problem_type": record["category"].strip(),
                    "dialog": dialog,
                }
            )
    return out


_MEDDIALOG_SPEAKER = re.compile(r"^\s*(patient|doctor)\s*:\s*", re.IGNORECASE)


def convert_meddialog(path) -> list[dict]:
    """MedDialog-EN, the processed JSON (english-train.json, -dev, -test), the layout assumed: an
    array of consultations, each {"description": text, "utterances": ["patient: ...", "doctor:
    ..."]}, the speaker named (in any case) before a colon at the start of each utterance. The
    patient is the seeker, the doctor the supporter; the description is the situation. Ids are
    meddialog-<index in the array>."""
    path, out = Path(path), []
    records = parse_json(read_data_text(path), path)
    if not isinstance(records, list):
        raise DataError(f"{path}: expected a JSON array of consultations")
    for index, record in enumerate(records):
        where = f"{path}: consultation {index}"
        with _record(where):
            record = _object(record, where)
            dialog = []
            for i, u in enumerate(record["utterances"]):
                said = _MEDDIALOG_SPEAKER.match(u) if isinstance(u, str) else None
                if said is None or not u[said.end() :].strip():
                    raise DataError(
                        f"{where}: field 'utterances[{i}]': {excerpt(u)} (expected 'patient: ...' "
                        f"or 'doctor: ...')"
                    )
                speaker = "seeker" if said.group(1).lower() == "patient" else "supporter"
                dialog.append({"speaker": speaker, "content": u[said.end() :].strip()})
            if not dialog:
                raise DataError(f"{where}: field 'utterances': empty")
            description = record["description"]
            if not isinstance(description, str) or not description.strip():
                raise DataError(
                    f"{where}: field 'description': {excerpt(description)} (expected non-empty "
                    f"text)"
                )
            out.append(
                {"id": f"meddialog-{index}", "situation": description.strip(), "dialog": dialog}
            )
    return out


# The text of an OpenReview note: its free-text field, or a structured review's parts in order.
_NOTE_TEXT = ("review", "comment")
_REVIEW_PARTS = ("summary", "strengths", "weaknesses", "questions")


def _note_value(content: dict, key: str):
    """A content field of an OpenReview note: plain in API 1, {"value": ...} in API 2."""
    value = content.get(key)
    return value.get("value") if isinstance(value, dict) else value


def _note_text(content: dict, where: str) -> str:
    for key in _NOTE_TEXT:
        text = _note_value(content, key)
        if isinstance(text, str) and text.strip():
            return text.strip()
    parts = [
        f"{key.capitalize()}: {text.strip()}"
        for key in _REVIEW_PARTS
        if isinstance(text := _note_value(content, key), str) and text.strip()
    ]
    if not parts:
        raise DataError(
            f"{where}: no text (expected content 'review', 'comment' or any of "
            f"{', '.join(_REVIEW_PARTS)})"
        )
    return "\n".join(parts)


def convert_iclr(path) -> list[dict]:
    """ICLR peer-review threads from OpenReview, the layout assumed: the notes of the venue's forums
    as the API returns them (a JSON object {"notes": [...]}) or as openreview-py's Note.to_json
    writes them (a JSON array), each {"id", "forum", "replyto" (null for the submission),
    "signatures": [...], "content": {field: text | {"value": text}}, "cdate"?}. Every official
    review (a reply to the submission signed by a reviewer, e.g. .../Paper12/Reviewer_ab3x or
    .../AnonReviewer2) starts a thread: the review and every note below it, in order of creation
    (cdate; file order without it). The paper's authors (a signature ending in /Authors) are the
    seeker, reviewers and chairs the supporter; a note's text is its review or comment, else a
    structured review's summary, strengths, weaknesses and questions. The submission's title is the
    situation. A thread without an author reply has no user turn and is left out; ids are
    iclr-<review id>."""
    path = Path(path)
    raw = parse_json(read_data_text(path), path)
    notes = raw.get("notes") if isinstance(raw, dict) else raw
    if not isinstance(notes, list):
        raise DataError(f"{path}: expected a JSON array of notes or an object with 'notes'")
    by_id, children = {}, {}
    for index, note in enumerate(notes):
        where = f"{path}: note {index}"
        with _record(where):
            note = _object(note, where)
            for key in ("id", "forum"):
                if not isinstance(note[key], str) or not note[key]:
                    raise DataError(
                        f"{where}: field '{key}': {excerpt(note[key])} (expected an id)"
                    )
            if not isinstance(note["signatures"], list) or not all(
                isinstance(s, str) for s in note["signatures"]
            ):
                raise DataError(f"{where}: field 'signatures': expected a list of names")
            _object(note["content"], f"{where}: field 'content'")
            if note["id"] in by_id:
                raise DataError(f"{where}: field 'id': {excerpt(note['id'])} appears twice")
            by_id[note["id"]] = (index, note)
            if note.get("replyto"):
                children.setdefault(note["replyto"], []).append(note["id"])

    def order(note_id: str):
        index, note = by_id[note_id]
        return (note.get("cdate", 0), index)

    def below(note_id: str) -> list[str]:
        found = []
        for child in children.get(note_id, []):
            found += [child, *below(child)]
        return found

    def authored(note: dict) -> bool:
        return any(s.endswith("/Authors") for s in note["signatures"])

    out = []
    for index, note in sorted(by_id.values(), key=lambda x: x[0]):
        reviewer = any(re.search(r"/(Anon)?Reviewer", s) for s in note["signatures"])
        if note.get("replyto") != note["forum"] or not reviewer:
            continue
        if note["forum"] not in by_id:
            raise DataError(
                f"{path}: note {index}: its submission {note['forum']} is not in the file"
            )
        thread = [note["id"], *sorted(below(note["id"]), key=order)]
        dialog = [
            {
                "speaker": "seeker" if authored(by_id[i][1]) else "supporter",
                "content": _note_text(by_id[i][1]["content"], f"{path}: note {by_id[i][0]}"),
            }
            for i in thread
        ]
        if not any(t["speaker"] == "seeker" for t in dialog):
            continue
        title = _note_value(by_id[note["forum"]][1]["content"], "title")
        if not isinstance(title, str) or not title.strip():
            raise DataError(
                f"{path}: note {by_id[note['forum']][0]}: field 'content.title': {excerpt(title)} "
                f"(expected the submission's title)"
            )
        out.append({"id": f"iclr-{note['id']}", "situation": title.strip(), "dialog": dialog})
    return out


def scenario_seeds(dialogues: list[dict]) -> list[dict]:
    """grpo.py's scenario seeds (dialogue.load_scenarios): the situation (with the emotion, when
    given) as the scenario the simulated user plays, the seeker's first turn as the opening
    message."""
    seeds = []
    for d in dialogues:
        opening = next((t["content"] for t in d["dialog"] if t["speaker"] == "seeker"), None)
        if opening and d.get("situation"):
            feeling = f" You feel {d['emotion_type']}." if d.get("emotion_type") else ""
            seeds.append(
                {"id": d["id"], "scenario": d["situation"] + feeling, "initial_prompt": opening}
            )
    return seeds


DIALOGUE_CONVERTERS = {
    "empathetic_dialogues": convert_empathetic_dialogues,
    "msdialog": convert_msdialog,
    "meddialog": convert_meddialog,
    "iclr": convert_iclr,
}


def _hf_rows(path: Path) -> list[dict]:
    """The rows of a local Hugging Face dataset: a `save_to_disk` folder (of one split), a parquet
    file, or a JSON lines file. Needs the optional `datasets` package."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            "reading a Hugging Face dataset needs the datasets package (pip install datasets)"
        ) from None
    if not path.exists():
        raise DataError(f"{path}: not found")
    if path.suffix == ".jsonl" and not path.is_dir():  # our reader names a broken line
        rows = [_object(raw, f"{path}:{number}") for number, raw in read_jsonl(path)]
        if not rows:
            raise DataError(f"{path}: no rows (the file is empty)")
        return rows
    if not path.is_dir() and path.suffix not in (".parquet", ".json"):
        raise DataError(f"{path}: expected a save_to_disk folder, a .parquet or a .jsonl file")
    datasets.disable_progress_bars()  # errors stay one line on stderr: no bars, no logged traces
    datasets.logging.set_verbosity(datasets.logging.CRITICAL + 1)
    kind = "save_to_disk folder" if path.is_dir() else f"{path.suffix[1:]} file"
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
        elif path.suffix == ".parquet":
            loaded = datasets.Dataset.from_parquet(str(path))
        else:
            loaded = datasets.Dataset.from_json(str(path))
    except Exception as e:  # pyarrow's and datasets' many errors of a file cut short or not theirs
        reason = " ".join(str(e).split())[:200]
        raise DataError(f"{path}: not a readable {kind} ({type(e).__name__}: {reason})") from None
    if isinstance(loaded, datasets.DatasetDict):
        raise DataError(
            f"{path}: a dataset of several splits ({', '.join(loaded)}); give one split's "
            f"folder, e.g. {path / next(iter(loaded))}"
        )
    if not len(loaded):
        raise DataError(f"{path}: no rows (the file is empty)")
    return loaded.to_list()


def convert_hf(path, columns: dict[str, str], values: dict) -> list[Example]:
    """Examples from a local Hugging Face dataset: each example field is read from the column
    `columns` maps it to (default: the column of its own name) or set to `values`' constant; a
    label given as one string becomes a one-label list, a missing id the row's index."""
    path = Path(path)
    known = sorted(f.name for f in dataclasses.fields(Example))
    for field in [*columns, *values]:
        if field not in known:
            raise DataError(
                f"--column/--value: unknown field {excerpt(field)} (known: {', '.join(known)})"
            )
    rows = _hf_rows(path)
    names = list(rows[0]) if rows else []
    missing = [c for c in columns.values() if c not in names]
    if missing:
        raise DataError(f"{path}: no column {excerpt(missing[0])} (columns: {', '.join(names)})")
    examples = []
    for i, row in enumerate(rows):
        raw = {"id": f"row{i}"} | {
            field: row[columns.get(field, field)]
            for field in known
            if columns.get(field, field) in row and row[columns.get(field, field)] is not None
        }
        raw |= values
        if isinstance(raw.get("labels"), str):
            raw["labels"] = [raw["labels"]]
        try:
            examples.append(example_from_json(raw))
        except DataError as e:
            raise DataError(f"{path} row {i}: {e}") from None
    return examples


def _field_pairs(pairs: list[str] | None, option: str, as_json: bool) -> dict:
    """FIELD=VALUE arguments of `option` as a mapping (values read as JSON when `as_json` and they
    parse, else kept as text)."""
    mapping = {}
    for pair in pairs or []:
        field, sep, value = pair.partition("=")
        if not sep or not field:
            raise DataError(f"{option} {excerpt(pair)}: expected FIELD=VALUE")
        if as_json:
            with contextlib.suppress(json.JSONDecodeError):
                value = json.loads(value)
        mapping[field] = value
    return mapping


def stratified_sample(examples: list[Example], per_label: int, seed: int = 0) -> list[Example]:
    """At most `per_label` examples for each (task, gold label set), drawn with `seed`, in input
    order."""
    groups: dict[tuple, list[int]] = {}
    for i, example in enumerate(examples):
        groups.setdefault((example.task, tuple(example.labels)), []).append(i)
    rng = random.Random(seed)
    keep = {i for group in groups.values() for i in rng.sample(group, min(per_label, len(group)))}
    return [e for i, e in enumerate(examples) if i in keep]


def convert(
    fmt: str, source, text: str | None = None, languages: list[str] | None = None
) -> list[Example]:
    """Convert `source` from one of CONVERTERS' formats (`ccu` also needs the conversation
    `text`); ToMBench reads the fields of `languages` only, when given."""
    if fmt not in CONVERTERS:
        raise DataError(f"unknown format {excerpt(fmt)} (known: {', '.join(CONVERTERS)})")
    if (fmt == "ccu") != (text is not None):
        raise DataError(
            "--text (the conversation JSONL) is needed for, and only for, the ccu format"
        )
    if fmt == "tombench" and languages and set(languages) - set(_TOMBENCH_KEYS):
        raise DataError(
            f"--language: ToMBench is written in {' and '.join(_TOMBENCH_KEYS)}, not "
            f"{excerpt(sorted(set(languages) - set(_TOMBENCH_KEYS))[0])}"
        )
    with _record(str(source)):
        if fmt == "ccu":
            return convert_ccu(source, text)
        if fmt == "tombench" and languages:
            return convert_tombench(source, tuple(dict.fromkeys(languages)))
        return CONVERTERS[fmt](source)


CONVERTERS = {
    "meld": functools.partial(convert_dialogue_csv, name="meld"),
    "cped": functools.partial(convert_dialogue_csv, name="cped"),
    "ecf": convert_ecf,
    "tombench": convert_tombench,
    "socialiqa": convert_socialiqa,
    "simpletom": convert_simpletom,
    "hitom": convert_hitom,
    "emobench": convert_emobench,
    "motivebench": convert_motivebench,
    "tactfultom": convert_tactfultom,
    "wiki": convert_wiki_power,
    "ccu": convert_ccu,
    "mmlu": convert_mmlu,
    "jsonl": load_jsonl,
}


# ----------------------------------------------------------------------------- command line


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {excerpt(text)}")
    return value


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m prepare.convert", description="Convert a public dataset to our JSONL."
    )
    parser.add_argument("format", choices=[*CONVERTERS, *DIALOGUE_CONVERTERS, "hf"])
    parser.add_argument(
        "input", help="the dataset file or folder (ccu: the annotation package folder)"
    )
    parser.add_argument("output", help="the JSONL file to write")
    parser.add_argument(
        "--text", help="ccu: the conversation text JSONL paired with the annotations"
    )
    parser.add_argument("--task", action="append", help="keep only this task (repeatable)")
    parser.add_argument(
        "--language",
        action="append",
        help="keep only this language's examples, e.g. en (repeatable); tombench then reads only "
        "its fields, so an English-only file converts",
    )
    parser.add_argument(
        "--per-label", type=_positive_int, help="keep at most N examples per task and gold label"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for --per-label sampling")
    parser.add_argument(
        "--seeds",
        action="store_true",
        help="empathetic_dialogues, msdialog, meddialog, iclr: write grpo.py's "
        "scenario seeds instead of ESConv-layout dialogues",
    )
    parser.add_argument(
        "--column",
        action="append",
        metavar="FIELD=COLUMN",
        help="hf: read this example field from this column (repeatable)",
    )
    parser.add_argument(
        "--value",
        action="append",
        metavar="FIELD=VALUE",
        help="hf: set this example field to this value in every row, e.g. task=meld_emotion",
    )
    args = parser.parse_args(argv)
    try:
        # the dataset is never written over: not the input, --text, or a file in the input folder
        check_output_file(args.output, "output", {"input": args.input, "--text": args.text})
        source = Path(args.input).resolve()
        if source.is_dir() and Path(args.output).resolve().is_relative_to(source):
            raise ConfigError(f"'output': {args.output} is inside the input folder {args.input}")
        if args.format in DIALOGUE_CONVERTERS:
            records = DIALOGUE_CONVERTERS[args.format](args.input)
            records = scenario_seeds(records) if args.seeds else records
            if not records:
                raise DataError(
                    f"{args.input}: no {'scenario seeds' if args.seeds else 'dialogues'} in the "
                    f"input"
                )
            atomic_write_text(
                args.output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
            )
            print(
                f"wrote {len(records)} {'scenario seeds' if args.seeds else 'dialogues'} to "
                f"{args.output}"
            )
            return
        examples = (
            convert_hf(
                args.input,
                _field_pairs(args.column, "--column", as_json=False),
                _field_pairs(args.value, "--value", as_json=True),
            )
            if args.format == "hf"
            else convert(args.format, args.input, args.text, args.language)
        )
        if not examples:
            raise DataError(f"{args.input}: no examples in the input")
        if args.task:
            unknown = set(args.task) - set(TASKS)
            if unknown:
                raise DataError(
                    f"--task: unknown task {excerpt(sorted(unknown)[0])} (known: "
                    f"{', '.join(TASKS)})"
                )
            examples = [e for e in examples if e.task in args.task]
            if not examples:
                raise DataError(f"{args.input}: no examples of task {', '.join(args.task)}")
        if args.language:
            examples = [e for e in examples if e.language in args.language]
            if not examples:
                raise DataError(f"{args.input}: no examples in {', '.join(args.language)}")
        if args.per_label:
            examples = stratified_sample(examples, args.per_label, args.seed)
        save_jsonl(examples, args.output)
        print(f"wrote {len(examples)} examples to {args.output}")
    except (ConfigError, DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
