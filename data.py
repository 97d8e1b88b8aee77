"""The task contract: the example types, the task registry with its prompts, conversation rendering
and the completion format (its `<think>` tags, splitting, `well_formed`, answer parsing: nothing
else parses a completion). Reading, checking and writing data files, the curriculum and `stats` are
dataset.py's; converters are prepare/convert.py's.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import string

from config import excerpt
from verifier import EVIDENCE_CLOSE, EVIDENCE_OPEN

# ----------------------------------------------------------------------------- examples


class DataError(ValueError):
    """A bad example or data file: a one-line message naming the file and line (when read from a
    file) and the field."""


def reject_json_constant(name: str):  # json's parse_constant: NaN and Infinity are not JSON
    raise DataError(f"{name} is not valid JSON")


@dataclasses.dataclass
class Turn:
    """One segment of a conversation. `time` is ISO 8601 (instant messages; gaps become time
    markers); `reply_to` is the index of the earlier post this one answers (forums; shown
    quoted)."""

    speaker: str
    text: str
    time: str | None = None
    reply_to: int | None = None


@dataclasses.dataclass
class Example:
    """One item: a conversation, the index of the turn to analyze (`target`; None for tasks about
    the whole conversation, a story or a question) and the gold labels in the task's canonical
    spelling. `meta` holds task inputs (`question`, `options` for multiple choice) and extras such
    as ECF cause pairs (`causes`: [{"turn": index, "span": text}])."""

    id: str
    task: str
    turns: list[Turn]
    target: int | None
    labels: list[str]
    language: str = "en"
    culture: str | None = None
    dialog_act: str | None = None
    difficulty: float | None = None
    meta: dict = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------- tasks and prompts

_EMOTIONS = {
    "anger": (
        "irritation, stress, displeasure, hostility or antagonism aimed at someone or something."
    ),
    "anticipation": "looking forward to something, or expecting that something will happen.",
    "joy": "pleasure, happiness, gladness or delight, often from well-being, success or good luck.",
    "trust": "confidence that a person or thing can be counted on and is honest and well-meaning.",
    "fear": (
        "a sense that harm, pain or danger lies ahead, felt as being afraid, worried or anxious."
    ),
    "surprise": "being caught off guard by something unexpected, unusual or shocking.",
    "sadness": "unhappiness or grief after something unpleasant, a setback or a loss.",
    "disgust": "aversion, disapproval or dislike of something or someone.",
}
_CCU_ACTS = {
    "Doing apology": (
        "owning up to a wrong done to someone, expressing regret for it, or asking forgiveness "
        "for harm the speaker or someone close to them caused."
    ),
    "Doing criticism": (
        "expressing disapproval of someone or something because of perceived faults or mistakes."
    ),
    "Doing greeting": (
        "acknowledging someone when meeting them, or when seeing them again after time apart, to "
        "show recognition or welcome."
    ),
    "Doing request": "asking another party to do something.",
    "Doing persuasion": (
        "trying to win someone over to a view or a course of action with arguments, examples or "
        "backing."
    ),
    "Doing thanks": "expressing gratitude or appreciation for something someone said or did.",
    "Doing taking leave": (
        "signalling the intention to leave, or to end the conversation or interaction."
    ),
    "Doing admiration": (
        "expressing admiration, respect, approval or praise for someone or something."
    ),
    "Doing finalizing negotiation/deal": (
        "indicating that the outcome of a negotiation or deal is agreed or settled."
    ),
    "Doing refusing a request": (
        "indicating unwillingness to help or to do something that was asked for."
    ),
}
_CPED_EMOTIONS = {
    "happy": _EMOTIONS["joy"],
    "grateful": "thankfulness and appreciation toward someone for what they said or did.",
    "relaxed": "being at ease and calm, free of tension, worry or hurry.",
    "positive-other": "a clearly positive feeling that happy, grateful and relaxed do not cover.",
    "neutral": "no particular emotion, or the emotion is unclear.",
    "anger": _EMOTIONS["anger"],
    "sadness": _EMOTIONS["sadness"],
    "fear": (
        "an acute sense of being scared or frightened that something bad is happening or about to "
        "happen."
    ),
    "depress": (
        "low spirits: dejected, discouraged or drained, with a heavy, downcast state of mind."
    ),
    "disgust": _EMOTIONS["disgust"],
    "astonished": _EMOTIONS["surprise"],
    "worried": "nervous, uneasy concern about trouble or a mishap that might lie ahead.",
    "negative-other": (
        "a clearly negative feeling that anger, sadness, fear, depress, disgust, astonished and "
        "worried do not cover."
    ),
}
_CPED_ACTS = {
    "greeting": "a hello or a welcome, typically at the start of an exchange.",
    "question": "a request for facts, for confirmation, or for someone's view.",
    "answer": (
        "a reply that supplies what a preceding question sought: facts, a confirmation or a view."
    ),
    "statement-opinion": (
        "the speaker's own view, assessment, verdict or guess, put forward as such."
    ),
    "statement-non-opinion": (
        "facts, descriptions or an account of events, offered without the speaker's verdict."
    ),
    "apology": (
        "saying sorry: regret for a wrong or an inconvenience, or a plea to be forgiven for it."
    ),
    "command": "telling, directing or pressing the listener to carry out an action.",
    "agreement": (
        "going along with the other speaker: accepting, endorsing or consenting to their words or "
        "plan."
    ),
    "disagreement": (
        "pushing back against the other speaker: disputing, contradicting or objecting to their "
        "words."
    ),
    "acknowledge": (
        "a brief signal that what was said has been heard or taken in, with no new content."
    ),
    "appreciation": "praise, admiration or a favourable evaluation of a person or a thing.",
    "interjection": (
        "a burst of exclamation that mostly lets feeling out and carries little content."
    ),
    "conventional-closing": (
        "a set phrase used to say goodbye or to bring the conversation to an end."
    ),
    "thanking": "saying thanks to someone or showing gratitude.",
    "quotation": "repeating or relaying what someone else said, or what was said at another time.",
    "reject": "turning down a request, an offer, a suggestion or an invitation.",
    "irony": (
        "meaning the reverse of what is said, or something plainly unlike it; this includes "
        "sarcasm and mockery."
    ),
    "comfort": "offering the other speaker solace, encouragement or reassurance.",
    "other": "none of the acts above fits the utterance, or what it does cannot be told.",
}


@dataclasses.dataclass(frozen=True)
class Task:
    """A task: its labels (canonical spellings, in prompt order) with definitions, whether several
    labels may be given, the catch-all label ("none of these"), and the prompt pieces. `choices`
    tasks answer with option letters, the options coming from each example's meta. `dialog_acts`:
    the acts one of which every example must name in its `dialog_act` (a task judged given the act);
    empty: none."""

    name: str
    labels: tuple[str, ...]
    definitions: dict[str, str]
    multi_label: bool = False
    catch_all: str | None = None
    turn_level: bool = True
    choices: bool = False
    dialog_acts: tuple[str, ...] = ()
    noun: str = "label"
    setting: str = ""  # what the input is: the prompt's opening words
    question: str = ""  # what to decide (shown to judges as the task)
    grounded: str = ""  # the claims that must quote evidence; empty: no evidence instruction
    cues: str = ""  # task-specific guidance on what to weigh
    # the short prompt of `compact_prompt` (demo.py's toy task, for a model trained on a CPU)
    compact: bool = False
    # a generation task without labels: each example carries its chat prompt in meta.prompt
    own_prompt: bool = False

    def canonical(self, label: str) -> str | None:
        """The canonical spelling of `label` (matched case-insensitively, outer spaces ignored), or
        None."""
        wanted = label.strip().casefold()
        return next((known for known in self.labels if known.casefold() == wanted), None)

    def answer_labels(self, example: Example) -> tuple[str, ...]:
        """The labels an answer to `example` may give: the task's labels, or for a multiple-choice
        task the letters of the example's own options (C is no answer to a two-option item)."""
        return self.labels[: len(example.meta["options"])] if self.choices else self.labels

    def messages(self, example: Example) -> list[dict]:
        """The chat messages that ask the model to solve `example` (an example of this task)."""
        if example.task != self.name:
            raise DataError(
                f"example {excerpt(example.id)} is for task {example.task}, not {self.name}"
            )
        return (
            example.meta["prompt"]
            if self.own_prompt
            else [{"role": "user", "content": build_prompt(example)}]
        )


def _emotion_task(name: str, definitions: dict[str, str], **kw) -> Task:
    return Task(
        name,
        tuple(definitions),
        definitions,
        noun="emotion",
        **kw,
        question=(
            "Identify the emotion that the speaker expresses or implies in the turn to analyze, "
            "and in that turn only; use the other turns as context for reading it."
        ),
        grounded=(
            "the conversation, the relationships, the setting, emotional states and their causes, "
            "tensions between the speakers or their attitudes"
        ),
    )


_CCU_EMOTIONS = {k.capitalize(): v for k, v in _EMOTIONS.items()} | {
    "None": (
        "the turn conveys no emotion, the emotion is unclear, or none of the listed emotions fits."
    )
}
_MELD_EMOTIONS = (
    {k: _EMOTIONS[k] for k in ("anger", "disgust", "fear", "joy")}
    | {"neutral": "no particular emotion is expressed."}
    | {k: _EMOTIONS[k] for k in ("sadness", "surprise")}
)
_TOY_EMOTIONS = {
    "joy": "glad about something good that happened.",
    "sadness": "unhappy about a loss or a setback.",
    "anger": "upset at a wrong someone did.",
    "fear": "afraid that something bad will happen.",
}
_CCU_SOURCES = "a conversation from an instant-messaging platform, a discussion forum or a script"
_WEIGH = (
    "Where the text supports it, weigh the relationship and social distance between the speakers, "
    "differences in power or status, the setting, earlier conflict, cooperation, support or "
    "repair, how the emotional tone has developed, and the obligations, requests, refusals, "
    "commitments and expectations in play"
)
_SCRIPT_CUES = (
    "Where the text supports it, take into account the line the speaker is answering, any "
    "exclamations, insults or terms of endearment, a question the turn responds to, and the other "
    "characters' reactions."
)

# The letters a multiple-choice item's options take, in order: an item
# has 2 to 26 (ToMBench has 2-4, ToMBench-Hard up to six, A-F) and its
# own options decide which letters are answers (Task.answer_labels).
OPTION_LETTERS = tuple(string.ascii_uppercase)

TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        _emotion_task(
            "ccu_emotion",
            _CCU_EMOTIONS,
            multi_label=True,
            catch_all="None",
            setting="a conversation from an instant-messaging platform or a discussion forum",
            cues=_WEIGH
            + (
                ", and what the turn responds to (praise, blame, pressure, rejection, an apology, "
                "help, criticism or reassurance). Read the emotion from the turn in its context "
                "rather than from its literal words alone; a dialog act or a norm violation is "
                "not by itself an emotion."
            ),
        ),
        Task(
            "ccu_dialog_act",
            (*_CCU_ACTS, "None"),
            _CCU_ACTS
            | {"None": "no dialog act is clear, or none of the listed dialog acts fits the turn."},
            multi_label=True,
            catch_all="None",
            noun="dialog act",
            setting=_CCU_SOURCES,
            question=(
                "Identify the dialog act (the pragmatic intention) of the turn to analyze, and of "
                "that turn only; use the other turns as context for reading it."
            ),
            grounded=(
                "the conversation, the relationships, the setting, emotional states, social "
                "pressure, what a speaker intends or what a turn does"
            ),
            cues=_WEIGH
            + (
                ", as well as cultural or interactional cues. Judge what the turn does in "
                "context, not only what it literally says, and do not mistake emotion, "
                "politeness, disagreement or a norm violation for a dialog act."
            ),
        ),
        Task(
            "ccu_norm",
            ("Adhere", "Violate"),
            {
                "Adhere": (
                    "the turn appropriately follows the social expectations tied to its dialog "
                    "act in this context."
                ),
                "Violate": (
                    "the turn breaks, or fails to meet, the social expectations tied to its "
                    "dialog act in this context."
                ),
            },
            dialog_acts=tuple(_CCU_ACTS),
            noun="verdict",
            setting=_CCU_SOURCES,
            question=(
                "Decide whether the turn to analyze adheres to or violates the social "
                "expectations that come with its given dialog act. Only that turn is judged; the "
                "other turns are context."
            ),
            grounded=(
                "the conversation, the relationships, the setting, the norm in force, role "
                "obligations, boundaries, expectations, politeness pressure, a violation, "
                "adherence, repair or escalation, emotional states or what a turn does"
            ),
            cues=_WEIGH
            + (
                ", including promises, boundaries, role-based expectations and cultural or "
                "interactional cues. Tie the judgment to the given dialog act rather than to "
                "norms in general, and do not mistake negative emotion, disagreement, the dialog "
                "act itself or politeness markers for a violation or for adherence. Do not invent "
                "social rules, harms or obligations."
            ),
        ),
        _emotion_task(
            "meld_emotion",
            _MELD_EMOTIONS,
            setting="a conversation between characters of a TV series",
            cues=_SCRIPT_CUES
            + " If the turn expresses no particular emotion, the answer is neutral.",
        ),
        _emotion_task(
            "cped_emotion",
            _CPED_EMOTIONS,
            setting="a conversation between characters of a Chinese TV series",
            cues=_SCRIPT_CUES,
        ),
        Task(
            "cped_dialog_act",
            tuple(_CPED_ACTS),
            _CPED_ACTS,
            catch_all="other",
            noun="dialogue act",
            setting="a conversation between characters of a Chinese TV series",
            question=(
                "Identify the dialogue act of the turn to analyze: the communicative function it "
                "performs in the conversation."
            ),
            grounded=(
                "the conversation, what a speaker intends, what the turn does, or its link to the "
                "turns before or after it"
            ),
            cues=(
                "Where the text supports it, consider what the turn is responding to (a question, "
                "a request, an offer, a statement), whether it starts or ends the exchange, and "
                "how the other characters take it. Judge what the turn does in context rather "
                "than its words alone, and keep dialogue act apart from emotion."
            ),
        ),
        Task(
            "wiki_power",
            ("A", "B"),
            {"A": "speaker A has the higher standing.", "B": "speaker B has the higher standing."},
            turn_level=False,
            noun="speaker",
            setting="a conversation between two speakers, A and B, from a Wikipedia talk page",
            question=(
                "Decide which speaker has more power in the conversation. Here power is a "
                "speaker's standing on the site: being the one who can make decisions, take "
                "actions, give permission, protect or close pages, enforce rules or evaluate "
                "others' work (as administrators, moderators, maintainers and senior members "
                "can), rather than the one who asks, proposes, requests, complies or appeals. The "
                "text seldom says who holds it: work it out from the speakers' actions and the "
                "way each treats the other, relying only on cues found in the text."
            ),
            grounded=(
                "the conversation, the relationship, the setting, a gap in power or status, who "
                "steers the exchange, instructions given, deference or concessions, or a "
                "speaker's attitude"
            ),
            cues=(
                "Signs that a speaker stands higher: the other turns to them for help, "
                "permission, a review or a ruling; they issue instructions or set conditions that "
                "the other accepts; they carry out or announce steps that need authority "
                "(protecting, deleting, closing, restoring, granting); they cite or explain "
                "policy routinely; the other thanks them, apologizes, gives way or justifies "
                "themselves to them. Talking more, bringing up the issue, arguing harder or "
                "putting forward the plan does not settle it: raising a problem, asking for an "
                "action and suggesting a fix usually come from the lower-standing speaker."
            ),
        ),
        Task(
            "tom_mc",
            OPTION_LETTERS,
            {},
            turn_level=False,
            choices=True,
            noun="option",
            setting="a short story",
            question=(
                "Answer the multiple-choice question about the story. It tests theory of mind: "
                "what the characters believe, know, want, feel or intend, or what they mean "
                "beyond their literal words."
            ),
            grounded=(
                "the story, the characters, what they perceive, know, believe, want, feel or intend"
            ),
            cues=(
                "Track who saw or was told what, and when; a character's beliefs follow what they "
                "could perceive, not what the reader knows."
            ),
        ),
        Task(
            "mmlu",
            ("A", "B", "C", "D"),
            {},
            turn_level=False,
            choices=True,
            noun="option",
            question="Answer the multiple-choice question.",
        ),
        Task(
            "care_rubric",
            (),
            {},
            turn_level=False,
            own_prompt=True,
            noun="rubric",  # reward_models/rubric_generator.py writes them
            question=(
                "Write the rubric that scores the supporter's next reply in this "
                "emotional-support conversation (CARE's rubric generator; the prompt is "
                "judge.care_rubric_request's)."
            ),
        ),
        Task(
            "toy_emotion",
            tuple(_TOY_EMOTIONS),
            _TOY_EMOTIONS,
            noun="emotion",
            compact=True,
            question=(
                "Which emotion does the speaker of the turn to analyze feel? Read it in the light "
                "of the earlier turns."
            ),
            grounded="the emotion and its cause",
        ),
        Task(
            "toy_tom",
            OPTION_LETTERS,
            {},
            turn_level=False,
            choices=True,
            noun="option",
            compact=True,
            question=(
                "Answer the question about the story. Reason in four blocks: Encoding, "
                "Interpretation, Goal, Response."
            ),
            grounded="what each person did and saw",
        ),
    ]
}


def get_task(name: str, field: str | None = None) -> Task:
    """TASKS[name], or a DataError listing the known tasks."""
    if name not in TASKS:
        at = f"field '{field}': " if field else ""
        raise DataError(f"{at}unknown task {excerpt(name)} (known: {', '.join(TASKS)})")
    return TASKS[name]


# ----------------------------------------------------------------------------- rendering

TIME_GAP_MINUTES = 10  # instant-messaging gaps at least this long become a time-marker line


def visible_turns(example: Example) -> list[Turn]:
    """The turns the model is shown: up to and including the target (all turns when there is
    none)."""
    return example.turns if example.target is None else example.turns[: example.target + 1]


def _speaker_line(turn: Turn) -> str:
    return f"{turn.speaker}: {turn.text}" if turn.speaker else turn.text


def _post_lines(turns: list[Turn], i: int) -> list[str]:
    """A post as lines: `Speaker: text` when it is one line and answers nothing; otherwise
    `Speaker:` followed by the answered post's own lines behind `| ` (recursively: its chain) and
    then the text."""
    turn = turns[i]
    text = turn.text.splitlines() or [""]
    if turn.reply_to is None and len(text) == 1:
        return [_speaker_line(turn)]
    quoted = (
        [f"| {line}".rstrip() for line in _post_lines(turns, turn.reply_to)]
        if turn.reply_to is not None
        else []
    )
    return ([f"{turn.speaker}:"] if turn.speaker else []) + quoted + text


def time_marker(earlier: str, later: str) -> str | None:
    """`[N minutes later]` (hours past 2 hours, days past 2 days) for a gap of at least
    TIME_GAP_MINUTES between two message times; None for shorter or negative gaps."""
    minutes = (
        datetime.datetime.fromisoformat(later) - datetime.datetime.fromisoformat(earlier)
    ).total_seconds() // 60
    if minutes < TIME_GAP_MINUTES:
        return None
    if minutes < 120:
        return f"[{int(minutes)} minutes later]"
    if minutes < 48 * 60:
        return f"[{int(minutes // 60)} hours later]"
    return f"[{int(minutes // (24 * 60))} days later]"


def _marker_before(turns: list[Turn], i: int) -> str | None:
    earlier, later = turns[i - 1].time if i else None, turns[i].time
    return time_marker(earlier, later) if earlier and later else None


def render_conversation(example: Example) -> str:
    """The visible conversation exactly as the prompt shows it: one segment per line (`Speaker:
    text`; a multi-line or replying post opens with `Speaker:` and indents its lines under it),
    forum reply chains quoted with `|`, and a time-marker line between messages at least 10 minutes
    apart."""
    turns = visible_turns(example)
    lines = []
    for i, turn in enumerate(turns):
        marker = _marker_before(turns, i)
        if marker:
            lines.append(marker)
        post = _post_lines(turns, i)
        indent = "  " if turn.speaker else ""
        lines += post[:1] + [indent + line for line in post[1:]]
    return "\n".join(lines)


def render_target(example: Example) -> str:
    """The turn to analyze as shown again after the conversation (`Speaker: text`); "" without a
    target."""
    return "" if example.target is None else _speaker_line(example.turns[example.target])


def _options(example: Example) -> str:
    letters = get_task(example.task).labels
    return "\n".join(
        f"{letter}. {option}" for letter, option in zip(letters, example.meta["options"])
    )


def _label_list(task: Task, example: Example) -> str:
    if task.choices:
        return f"Question: {example.meta['question']}\nOptions:\n{_options(example)}"
    items = "\n".join(f"- {label}: {task.definitions[label]}" for label in task.labels)
    return f"Choose only from the following {task.noun}s, each with its definition:\n{items}"


def _culture(example: Example) -> list[str]:
    return [f"The applicable culture is: {example.culture}."] if example.culture else []


def task_brief(example: Example) -> str:
    """The task as a judge is shown it: what to decide, the culture, the labels with their
    definitions (or the question and options), and the dialog act for the norm task; no
    answer-format rules."""
    task = get_task(example.task)
    parts = [task.question, *_culture(example), _label_list(task, example)]
    if example.dialog_act:
        parts.append(f"Dialog act of the turn: {example.dialog_act}")
    return "\n\n".join(parts)


def _layout_note(example: Example) -> str:
    notes = ["The conversation is written one segment per line as `Speaker: text`."]
    if get_task(example.task).turn_level:
        notes.append(
            "One speaker may post several consecutive lines that form a single thought. If the "
            "lines right before the turn to analyze carry on into it, read them as one with the "
            "turn; if the turn is self-contained, read it by itself. The text shows which case "
            "applies."
        )
    turns = visible_turns(example)
    if any(len(_post_lines(turns, i)) > 1 for i in range(len(turns))):
        notes.append(
            "A post that spans several lines opens with `Speaker:` and its lines are indented "
            "under it."
        )
    if any(t.reply_to is not None for t in turns):
        notes.append(
            "A reply shows the post it answers behind `|`: `| Speaker:` opens that post, lines "
            "with the same number of `|` are its words, one more `|` marks the post it answered "
            "in turn, and lines without `|` are the replier's own words."
        )
    if any(_marker_before(turns, i) for i in range(len(turns))):
        notes.append(
            "Bracketed lines like [22 minutes later] give the time that elapsed between the "
            "messages around them; no one said them and they are not turns."
        )
    return " ".join(notes)


def _answer_format(task: Task, example: Example) -> str:
    labels = task.answer_labels(example)
    first = labels[0]
    if task.multi_label:
        rule = (
            f'"Answer: {first}", or "Answer: {first}, {labels[1]}" when several {task.noun}s '
            f"clearly "
            f"apply to the turn (separate them with a comma and a space)."
        )
        if task.catch_all:
            rule += (
                f' If none of the listed {task.noun}s clearly applies, write "Answer: '
                f'{task.catch_all}".'
            )
    else:
        rule = (
            f'"Answer: <{task.noun}>", where <{task.noun}> is exactly one of: {", ".join(labels)}.'
        )
    return (
        f"After your reasoning, give the final answer alone on the last line, in exactly this "
        f"form: {rule} "
        "Write it in English, spelled exactly as listed, with nothing else on the line, and write "
        "nothing "
        "after it."
    )


def build_prompt(example: Example) -> str:
    """The user message for `example`: the setting and task, how the conversation is laid out, the
    evidence rule, task-specific cues, the culture, the labels with definitions, the answer format,
    then the conversation, the turn to analyze again and (norm task) its dialog act."""
    task = get_task(example.task)
    if task.compact:
        return compact_prompt(task, example)
    conversation = render_conversation(example)
    opening = f"Below is {task.setting}. " if task.setting else ""
    if task.turn_level:
        opening += "It ends with the turn to analyze, which is shown again after it. "
    parts = [opening + task.question]
    if example.turns and not task.choices:
        parts.append(_layout_note(example))
    if task.grounded:
        source = "story" if task.choices else "conversation"
        parts.append(
            f"Before answering, reason from the {source}. Ground every concrete claim about "
            f"{task.grounded} in exact text from the {source}, and put every quoted span between "
            f"the special tokens {EVIDENCE_OPEN} and {EVIDENCE_CLOSE}. The text inside the tags "
            f"must be copied exactly, character for character and in its original language and "
            f"script; never put a paraphrase or a translation inside them. Do not invent facts, "
            f"relationships, motives, cultural background or events."
        )
    parts += [task.cues] if task.cues else []
    parts += _culture(example)
    if not task.choices:
        parts.append(_label_list(task, example))
    parts.append(_answer_format(task, example))
    if task.choices:
        parts += [f"Story:\n{conversation}"] if example.turns else []
        parts.append(_label_list(task, example))
    elif task.turn_level:
        parts.append(f"Conversation:\n{conversation}\n\nTurn to analyze:\n{render_target(example)}")
        parts[-1] += f"\nDialog act of the turn: {example.dialog_act}" if example.dialog_act else ""
    else:
        parts.append(f"Conversation:\n{conversation}")
    return "\n\n".join(parts)


def compact_prompt(task: Task, example: Example) -> str:
    """The user message of a compact task (the toy tasks of demo.py and tools/toy_tom.py): the
    question, the labels with their definitions, the evidence rule and the answer format in a
    sentence each, then the conversation and the turn to analyze again; a multiple-choice task's
    story, then its question and options. A few dozen tokens of instructions instead of several
    hundred."""
    source = "story" if task.choices else "conversation"
    rule = (
        f"Quote the text that shows {task.grounded} between {EVIDENCE_OPEN} and {EVIDENCE_CLOSE}, "
        f"copied exactly from the {source}."
    )
    answer = (
        f'On the last line write "Answer: <{task.noun}>", where <{task.noun}> is exactly one of: '
        f"{', '.join(task.answer_labels(example))}."
    )
    if task.choices:
        return "\n\n".join(
            [
                task.question,
                f"{rule} {answer}",
                f"Story:\n{render_conversation(example)}",
                _label_list(task, example),
            ]
        )
    return "\n\n".join(
        [
            task.question,
            _label_list(task, example),
            f"{rule} {answer}",
            f"Conversation:\n{render_conversation(example)}\n\nTurn to "
            f"analyze:\n{render_target(example)}",
        ]
    )


# ----------------------------------------------------------------------------- completions


def is_chat(value) -> bool:
    """A chat as prompts carry it: a non-empty list of {"role": system / user / assistant,
    "content": text} messages, no other key."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict)
            and set(m) == {"role", "content"}
            and m["role"] in ("system", "user", "assistant")
            and isinstance(m["content"], str)
            for m in value
        )
    )


THINK_START, THINK_END = "<think>", "</think>"  # the reasoning's tags, defined here only
_ANSWER_LINE = re.compile(r"^\s*answer\s*:(.*)$", re.IGNORECASE)


def split_completion(completion: str) -> tuple[str, str]:
    """(reasoning, answer text): the text before the final `</think>` (a leading `<think>` and outer
    whitespace removed) and the text after it. Without a `</think>` the reasoning never closed: all
    of it is reasoning and the answer text is empty."""
    reasoning, closed, answer = completion.rpartition(THINK_END)
    if not closed:
        reasoning, answer = completion, ""
    return reasoning.strip().removeprefix(THINK_START).strip(), answer


def split_blocks(reasoning: str) -> list[str]:
    """The reasoning's blocks r_1..r_N: separated by blank lines, stripped, empty ones dropped."""
    return [block.strip() for block in re.split(r"\n\s*\n", reasoning) if block.strip()]


def well_formed(completion: str) -> bool:
    """The completion keeps our format exactly: one `</think>` with reasoning before it (opened by
    at most one `<think>`, at the very start), and after it a single non-blank line, the `Answer:`
    line. Whether its labels are valid is parse_answer's question."""
    reasoning, answer_text = split_completion(completion)
    lines = answer_text.strip().splitlines()
    opened = completion.count(THINK_START)
    return (
        completion.count(THINK_END) == 1
        and bool(reasoning)
        and len(lines) == 1
        and _ANSWER_LINE.match(lines[0]) is not None
        and (opened == 0 or (opened == 1 and completion.lstrip().startswith(THINK_START)))
    )


def label_completion(labels: list[str]) -> str:
    """A completion that is the answer alone, no reasoning: `</think>`, then the `Answer:` line
    (CLUE's Label SFT baseline trains on these)."""
    return f"{THINK_END}\nAnswer: {', '.join(labels)}"


def parse_answer(completion: str, task: str | Example) -> list[str] | None:
    """The predicted labels, in canonical spelling, from the last `Answer: <label>[, <label>...]`
    line after the final `</think>`; labels match case-insensitively. `task` is the task's name, or
    the example: a multiple-choice task needs the example, whose own options decide the valid
    letters. None (an invalid answer, scored wrong) when there is no such line, it is empty, a label
    is outside the labels the item allows (Task.answer_labels), a single-label task gets several, or
    the catch-all comes with other labels."""
    example = task if isinstance(task, Example) else None
    spec = get_task(example.task if example else task)
    if spec.choices and example is None:
        raise ValueError(
            f"parse_answer: {spec.name} is multiple-choice: pass the example, whose options "
            "decide the valid letters"
        )
    allowed = spec.answer_labels(example) if example else spec.labels
    _, answer_text = split_completion(completion)
    found = [m.group(1) for line in answer_text.splitlines() if (m := _ANSWER_LINE.match(line))]
    if not found:
        return None
    labels = [spec.canonical(name) for name in found[-1].split(",")]
    if any(label not in allowed for label in labels):
        return None
    labels = list(dict.fromkeys(labels))
    if (not spec.multi_label and len(labels) > 1) or (spec.catch_all in labels and len(labels) > 1):
        return None
    return labels


def count_tokens(text: str, tokenizer) -> int:
    """Tokens in `text` for a tokenizer whose `encode` returns ids or a `tokenizers.Encoding` (whose
    post-processor must not add special tokens, as Qwen's does not): e.g. T, the reasoning
    tokens."""
    encoded = tokenizer.encode(text)
    return len(getattr(encoded, "ids", encoded))


# ----------------------------------------------------------------------------- label metrics


def f1_scores(
    gold: list[list[str]],
    pred: list[list[str] | None],
    labels: list[str],
    catch_all: str | None = None,
) -> dict:
    """Weighted and macro F1 of predicted label sets against gold ones, as scikit-learn computes
    them over `labels` (multi-label: per label over the indicator matrix; single-label: one-element
    sets).

    A None prediction is an invalid answer: it predicts nothing, so it is wrong. Targets whose gold
    is the catch-all are not scored (paper B: excluded as targets, kept as context) and the
    catch-all is no class: predicting it only misses the gold label. Per label, F1 = 2 TP / (2 TP +
    FP + FN); weighted F1 weights it by the label's gold support, macro F1 averages the labels that
    occur in the scored gold or predictions (an absent label has no defined F1). Returns
    {"weighted", "macro", "micro", "accuracy" (exact set match), "n" (scored targets), "per_label":
    {label: {"precision", "recall", "f1", "support"}}}; the averages are None when no target is
    scored."""
    rows = [
        (set(g), set(p or ()))
        for g, p in zip(gold, pred, strict=True)
        if catch_all is None or list(g) != [catch_all]
    ]
    per_label, totals = {}, [0, 0, 0]
    for label in (label for label in labels if label != catch_all):
        tp = sum(label in g and label in p for g, p in rows)
        fp = sum(label not in g and label in p for g, p in rows)
        fn = sum(label in g and label not in p for g, p in rows)
        totals = [totals[0] + tp, totals[1] + fp, totals[2] + fn]
        if tp + fp + fn:
            per_label[label] = {
                "precision": tp / (tp + fp) if tp + fp else 0.0,
                "recall": tp / (tp + fn) if tp + fn else 0.0,
                "f1": 2 * tp / (2 * tp + fp + fn),
                "support": tp + fn,
            }
    support = sum(s["support"] for s in per_label.values())
    if not rows or not support:
        return {
            "weighted": None,
            "macro": None,
            "micro": None,
            "accuracy": None,
            "n": len(rows),
            "per_label": {},
        }
    tp, fp, fn = totals
    return {
        "weighted": sum(s["f1"] * s["support"] for s in per_label.values()) / support,
        "macro": sum(s["f1"] for s in per_label.values()) / len(per_label),
        "micro": 2 * tp / (2 * tp + fp + fn),
        "accuracy": sum(g == p for g, p in rows) / len(rows),
        "n": len(rows),
        "per_label": per_label,
    }
