"""Data: the example schema, tasks and prompts, conversation rendering, dataset converters and
curriculum contexts, plus the plumbing every script shares: YAML configs with `key=value`
overrides checked against a dataclass schema, and run outputs (rank-0 printing, metrics.jsonl,
the resolved config)."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import functools
import itertools
import json
import math
import os
import random
import re
import sys
import types
import typing
from pathlib import Path

import yaml

# ----------------------------------------------------------------------------- configs


class ConfigError(ValueError):
    """A bad config: the message is one line naming the file (and line) or override, and the key."""


class _YamlLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that also reads `1e-5` as a float (YAML 1.2); PyYAML alone reads a string."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _yaml_value(text: str):
    return yaml.load(text, Loader=_YamlLoader)


def _key_lines(node, prefix: str = "", lines: dict | None = None) -> dict[str, int]:
    """Map each dotted key of a composed YAML mapping to its 1-based line in the file."""
    lines = {} if lines is None else lines
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            lines[key] = key_node.start_mark.line + 1
            _key_lines(value_node, key + ".", lines)
    return lines


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value, tp, key: str, where):
    """Check `value` against the annotation `tp`; return it (ints widen to float, lists to tuples)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options:
            try:
                return _coerce(value, option, key, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where(key)}: '{key}' expects {_type_name(tp)}, got {value!r}")
    if origin is typing.Literal:
        if value in args:
            return value
        raise ConfigError(f"{where(key)}: '{key}' must be one of {list(args)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where(key)}: '{key}' expects a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, key + ".", where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where(key)}: '{key}' expects a list, got {value!r}")
        item_tp = args[0] if args else typing.Any
        items = [_coerce(v, item_tp, f"{key}[{i}]", where) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where(key)}: '{key}' expects a mapping, got {value!r}")
        value_tp = args[1] if args else typing.Any
        return {k: _coerce(v, value_tp, f"{key}.{k}", where) for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (bool, int, float, str):
        if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
            return value
        raise ConfigError(f"{where(key)}: '{key}' expects {tp.__name__}, got {type(value).__name__} {value!r}")
    raise TypeError(f"config schema: unsupported annotation {tp!r} for '{key}'")


def _build(schema, raw: dict, prefix: str, where):
    hints = typing.get_type_hints(schema)
    fields = {f.name: f for f in dataclasses.fields(schema) if f.init}
    for name in raw:
        if name not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{where(prefix + str(name))}: unknown key '{prefix}{name}' (known keys: {known})")
    kwargs = {}
    for name, field in fields.items():
        if name in raw:
            kwargs[name] = _coerce(raw[name], hints[name], prefix + name, where)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where(prefix + name)}: missing required key '{prefix}{name}'")
    return schema(**kwargs)


def _apply_override(raw: dict, override: str) -> None:
    key, sep, text = override.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{override}': expected key=value, e.g. optim.lr=1e-5")
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{override}': '{part}' is not a section")
        node = child
    node[leaf] = _yaml_value(text)


def load_config(path, overrides, schema):
    """Read the YAML file at `path`, apply `a.b.c=value` overrides (values typed by YAML rules),
    and build the dataclass `schema` from it. Unknown, missing or mistyped keys raise a
    `ConfigError` whose one-line message names the file and line, or the override."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        raw = _yaml_value(text)
        lines = _key_lines(yaml.compose(text, Loader=_YamlLoader))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{at}: not valid YAML: {getattr(e, 'problem', e)}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(raw).__name__}")
    from_override = {}
    for override in overrides:
        _apply_override(raw, override)
        from_override[override.partition("=")[0]] = override

    def where(key: str) -> str:
        for prefix, override in from_override.items():
            if key == prefix or key.startswith(prefix + ".") or key.startswith(prefix + "["):
                return f"override '{override}'"
        line = lines.get(key.split("[")[0])
        return f"{path}:{line}" if line else str(path)

    return _build(schema, raw, "", where)


def parse_cli(schema, argv=None):
    """`script.py config.yaml [key=value ...]` -> the config; a bad config exits with one error line."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {Path(sys.argv[0]).name} config.yaml [key=value ...]", file=sys.stderr)
        raise SystemExit(2)
    try:
        return load_config(argv[0], argv[1:], schema)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


# ----------------------------------------------------------------------------- run outputs


def is_main_process() -> bool:
    """Rank 0 under torchrun, or a plain single-process run."""
    return int(os.environ.get("RANK", "0")) == 0


def print0(*args, **kwargs) -> None:
    if is_main_process():
        print(*args, **kwargs, flush=True)


def _jsonable(value):
    """Plain JSON values: tensors and numpy scalars become numbers; NaN and infinities become the
    strings "nan", "inf", "-inf" so a diverging run stays visible and the file stays strict JSON."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    return value


class MetricsWriter:
    """Appends one JSON object per line to a `.jsonl` file (rank 0 only) and flushes after every
    record, so a crash never loses a step already logged; appending continues a resumed run."""

    def __init__(self, path):
        self.path = Path(path)
        self._file = None
        if is_main_process():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(_jsonable(record), ensure_ascii=False, allow_nan=False) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_SECRET_KEY = re.compile(r"api[_-]?key|secret|password|auth[_-]?token", re.IGNORECASE)


def redact_secrets(value):
    """Drop every mapping key that names a secret (api_key, secret, password, auth_token); keys
    ending in `_env` only name an environment variable and are kept."""
    if isinstance(value, dict):
        return {
            k: redact_secrets(v)
            for k, v in value.items()
            if not (_SECRET_KEY.search(str(k)) and not str(k).endswith("_env"))
        }
    if isinstance(value, (list, tuple)):
        return [redact_secrets(v) for v in value]
    return value


def atomic_write_text(path, text: str) -> None:
    """Write to a temporary name beside `path`, then rename: readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def save_resolved_config(cfg, output_dir) -> Path:
    """Write the config a run actually used to `output_dir/config.yaml`, secrets removed (rank 0)."""
    path = Path(output_dir) / "config.yaml"
    if is_main_process():
        resolved = redact_secrets(_jsonable(cfg))
        atomic_write_text(path, yaml.safe_dump(resolved, sort_keys=False, allow_unicode=True))
    return path


# ----------------------------------------------------------------------------- examples


class DataError(ValueError):
    """A bad example or data file: a one-line message naming the file and line (when read from a
    file) and the field."""


@dataclasses.dataclass
class Turn:
    """One segment of a conversation. `time` is ISO 8601 (instant messages; gaps become time
    markers); `reply_to` is the index of the earlier post this one answers (forums; shown quoted)."""

    speaker: str
    text: str
    time: str | None = None
    reply_to: int | None = None


@dataclasses.dataclass
class Example:
    """One item: a conversation, the index of the turn to analyze (`target`; None for tasks about the
    whole conversation, a story or a question) and the gold labels in the task's canonical spelling.
    `meta` holds task inputs (`question`, `options` for multiple choice) and extras such as ECF cause
    pairs (`causes`: [{"turn": index, "span": text}])."""

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


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", list: "a list", dict: "an object"}


def _typed(raw: dict, key: str, kind, default=..., where: str = ""):
    """raw[key] checked against `kind` (a type; a missing key or null gives `default`, or an error
    when the key is required). Integers count as numbers; booleans count as neither."""
    value = raw.get(key)
    if value is None:
        if default is ...:
            raise DataError(f"field '{where}{key}': missing")
        return default
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise DataError(f"field '{where}{key}': expected {_TYPE_NAMES[kind]}, got {value!r}")
    return value


def _parse_time(text: str, where: str) -> datetime.datetime:
    try:
        return datetime.datetime.fromisoformat(text)
    except ValueError:
        raise DataError(f"field '{where}': not an ISO 8601 time: {text!r}") from None


def _turn_from_json(raw, i: int, extra: tuple[str, ...] = ()) -> Turn:
    where = f"turns[{i}]."
    if not isinstance(raw, dict):
        raise DataError(f"field 'turns[{i}]': expected an object, got {raw!r}")
    unknown = set(raw) - {"speaker", "text", "time", "reply_to", *extra}
    if unknown:
        raise DataError(f"field '{where}{sorted(unknown)[0]}': unknown field")
    return Turn(_typed(raw, "speaker", str, where=where), _typed(raw, "text", str, where=where),
                _typed(raw, "time", str, None, where), _typed(raw, "reply_to", int, None, where))


_EXAMPLE_FIELDS = {f.name for f in dataclasses.fields(Example)}


def example_from_json(raw) -> Example:
    """Build and check an Example from a parsed JSON object; errors name the field."""
    if not isinstance(raw, dict):
        raise DataError(f"expected a JSON object, got {type(raw).__name__}")
    unknown = set(raw) - _EXAMPLE_FIELDS
    if unknown:
        raise DataError(f"field '{sorted(unknown)[0]}': unknown field (known: {', '.join(sorted(_EXAMPLE_FIELDS))})")
    turns = _typed(raw, "turns", list)
    labels = _typed(raw, "labels", list)
    example = Example(
        id=_typed(raw, "id", str), task=_typed(raw, "task", str),
        turns=[_turn_from_json(t, i) for i, t in enumerate(turns)],
        target=_typed(raw, "target", int, None), labels=labels,
        language=_typed(raw, "language", str, "en"), culture=_typed(raw, "culture", str, None),
        dialog_act=_typed(raw, "dialog_act", str, None), difficulty=_typed(raw, "difficulty", float, None),
        meta=_typed(raw, "meta", dict, {}),
    )
    return check_example(example)


def check_example(example: Example) -> Example:
    """Check an example against its task; return it with labels in canonical spelling. Raises
    DataError naming the field: unknown task, target out of range, label outside the set, ..."""
    task = get_task(example.task, field="task")
    n = len(example.turns)
    aware = set()
    for i, turn in enumerate(example.turns):
        if turn.time is not None:
            aware.add(_parse_time(turn.time, f"turns[{i}].time").tzinfo is not None)
        if turn.reply_to is not None and not 0 <= turn.reply_to < i:
            raise DataError(f"field 'turns[{i}].reply_to': {turn.reply_to} is not an earlier turn (0..{i - 1})")
    if len(aware) > 1:
        raise DataError("field 'turns': times mix zoned and unzoned values")
    if task.turn_level and (example.target is None or not 0 <= example.target < n):
        raise DataError(f"field 'target': task {task.name} needs a turn index in 0..{n - 1}, got {example.target!r}")
    if not task.turn_level and example.target is not None:
        raise DataError(f"field 'target': task {task.name} analyzes the whole input; target must be null")
    allowed = task.labels
    if task.choices:
        options = example.meta.get("options")
        if not (isinstance(options, list) and 2 <= len(options) <= len(task.labels)
                and all(isinstance(o, str) for o in options)):
            raise DataError(f"field 'meta.options': expected 2 to {len(task.labels)} strings, got {options!r}")
        if not isinstance(example.meta.get("question"), str):
            raise DataError(f"field 'meta.question': expected a string, got {example.meta.get('question')!r}")
        allowed = task.labels[: len(options)]
    labels = [task.canonical(label) if isinstance(label, str) else None for label in example.labels]
    for raw, label in zip(example.labels, labels):
        if label not in allowed:
            raise DataError(f"field 'labels': {raw!r} is not a label of {task.name} (labels: {', '.join(allowed)})")
    if not labels or len(set(labels)) != len(labels) or (not task.multi_label and len(labels) != 1):
        need = "one or more distinct labels" if task.multi_label else "exactly one label"
        raise DataError(f"field 'labels': task {task.name} needs {need}, got {example.labels!r}")
    if task.catch_all in labels and len(labels) > 1:
        raise DataError(f"field 'labels': the catch-all label {task.catch_all!r} cannot be combined with others")
    if task.name == "ccu_norm" and example.dialog_act not in TASKS["ccu_dialog_act"].definitions:
        acts = ", ".join(TASKS["ccu_dialog_act"].labels[:-1])
        raise DataError(f"field 'dialog_act': task ccu_norm needs one of: {acts}; got {example.dialog_act!r}")
    return dataclasses.replace(example, labels=labels)


def example_to_json(example: Example) -> dict:
    """The JSONL object of an example; turn fields that are null are left out."""
    raw = dataclasses.asdict(example)
    raw["turns"] = [{k: v for k, v in t.items() if v is not None} for t in raw["turns"]]
    return raw


def load_jsonl(path) -> list[Example]:
    """Read examples, one JSON object per line (UTF-8, an optional BOM, blank lines skipped). Any
    bad line raises DataError naming the file, the line number and the field."""
    path = Path(path)
    examples = []
    with open(path, encoding="utf-8-sig") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                examples.append(example_from_json(json.loads(line, parse_constant=_reject_constant)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{number}: not valid JSON: {e.msg} (column {e.colno})") from None
            except DataError as e:
                raise DataError(f"{path}:{number}: {e}") from None
    return examples


def _reject_constant(name: str):
    raise DataError(f"{name} is not valid JSON")


def save_jsonl(examples, path) -> None:
    """Check every example, then write them atomically, one JSON object per line."""
    lines = []
    for example in examples:
        try:
            lines.append(json.dumps(example_to_json(check_example(example)), ensure_ascii=False, allow_nan=False))
        except DataError as e:
            raise DataError(f"example {example.id!r}: {e}") from None
    atomic_write_text(path, "".join(line + "\n" for line in lines))


# ----------------------------------------------------------------------------- tasks and prompts

_EMOTIONS = {
    "anger": "irritation, stress, displeasure, hostility or antagonism aimed at someone or something.",
    "anticipation": "looking forward to something, or expecting that something will happen.",
    "joy": "pleasure, happiness, gladness or delight, often from well-being, success or good luck.",
    "trust": "belief or hope that someone or something is reliable, dependable, honest and good.",
    "fear": "being afraid, worried or anxious that something bad or painful will happen.",
    "surprise": "a reaction to something unexpected, unusual or shocking.",
    "sadness": "unhappiness or grief after something unpleasant, a setback or a loss.",
    "disgust": "aversion, disapproval or dislike of something or someone.",
}
_CCU_ACTS = {
    "Doing apology": "owning up to a wrong done to someone, expressing regret for it, or asking forgiveness "
                     "for harm the speaker or someone close to them caused.",
    "Doing criticism": "expressing disapproval of someone or something because of perceived faults or mistakes.",
    "Doing greeting": "acknowledging someone when meeting them, or when seeing them again after time apart, "
                      "to show recognition or welcome.",
    "Doing request": "asking another party to do something.",
    "Doing persuasion": "giving reasons, examples or support to get someone to accept an idea or do something.",
    "Doing thanks": "expressing gratitude or appreciation for something someone said or did.",
    "Doing taking leave": "signalling the intention to leave, or to end the conversation or interaction.",
    "Doing admiration": "expressing admiration, respect, approval or praise for someone or something.",
    "Doing finalizing negotiation/deal": "indicating that the outcome of a negotiation or deal is agreed or settled.",
    "Doing refusing a request": "indicating unwillingness to help or to do something that was asked for.",
}
_CPED_EMOTIONS = {
    "happy": _EMOTIONS["joy"],
    "grateful": "thankfulness and appreciation toward someone for what they said or did.",
    "relaxed": "being at ease and calm, free of tension, worry or hurry.",
    "positive-other": "a clearly positive feeling that happy, grateful and relaxed do not cover.",
    "neutral": "no particular emotion, or the emotion is unclear.",
    "anger": _EMOTIONS["anger"],
    "sadness": _EMOTIONS["sadness"],
    "fear": "an acute sense of being scared or frightened that something bad is happening or about to happen.",
    "depress": "low spirits: dejected, discouraged or drained, with a heavy, downcast state of mind.",
    "disgust": _EMOTIONS["disgust"],
    "astonished": _EMOTIONS["surprise"],
    "worried": "anxious concern or unease that something bad may happen or go wrong.",
    "negative-other": "a clearly negative feeling that anger, sadness, fear, depress, disgust, astonished and "
                      "worried do not cover.",
}
_CPED_ACTS = {
    "greeting": "greeting or welcoming someone, usually as an interaction starts.",
    "question": "asking for information, confirmation or an opinion.",
    "answer": "directly giving the information, confirmation or opinion a question asked for.",
    "statement-opinion": "stating a personal opinion, judgment, evaluation or guess.",
    "statement-non-opinion": "stating facts, a description or a story without a personal judgment.",
    "apology": "expressing regret or asking forgiveness for a wrong or an inconvenience.",
    "command": "ordering, instructing or urging the listener to do something.",
    "agreement": "agreeing with, accepting or consenting to what the other speaker said or proposed.",
    "disagreement": "disagreeing with, contradicting or objecting to what the other speaker said.",
    "acknowledge": "briefly showing that what was said was heard or registered, adding nothing new.",
    "appreciation": "expressing admiration, praise or a positive assessment of someone or something.",
    "interjection": "an exclamation or outburst that mainly vents feeling rather than conveying content.",
    "conventional-closing": "a conventional formula that ends the conversation or takes leave.",
    "thanking": "thanking someone or expressing gratitude.",
    "quotation": "quoting or reporting words said by someone else or on another occasion.",
    "reject": "refusing a request, offer, suggestion or invitation.",
    "irony": "saying the opposite of, or something clearly different from, what is meant; sarcasm or mockery.",
    "comfort": "comforting, consoling, encouraging or reassuring the other speaker.",
    "other": "the utterance fits none of the listed dialogue acts, or its function is unclear.",
}

_TURN_CONTEXT = ("the relationship and social distance between the speakers, differences in power or status, "
                 "the setting, earlier conflict, cooperation, support or repair, how the emotional tone has "
                 "developed, and the obligations, requests, refusals, commitments and expectations in play")


@dataclasses.dataclass(frozen=True)
class Task:
    """A task: its labels (canonical spellings, in prompt order) with definitions, whether several labels
    may be given, the catch-all label ("none of these"), and the prompt pieces. `choices` tasks answer
    with option letters, the options coming from each example's meta."""

    name: str
    labels: tuple[str, ...]
    definitions: dict[str, str]
    multi_label: bool = False
    catch_all: str | None = None
    turn_level: bool = True
    choices: bool = False
    noun: str = "label"
    setting: str = ""    # what the input is: the prompt's opening words
    question: str = ""   # what to decide (shown to judges as the task)
    grounded: str = ""   # the claims that must quote evidence; empty: no evidence instruction
    cues: str = ""       # task-specific guidance on what to weigh

    def canonical(self, label: str) -> str | None:
        """The canonical spelling of `label` (matched case-insensitively, outer spaces ignored), or None."""
        wanted = label.strip().casefold()
        return next((known for known in self.labels if known.casefold() == wanted), None)

    def messages(self, example: Example) -> list[dict]:
        """The chat messages that ask the model to solve `example`."""
        return [{"role": "user", "content": build_prompt(example)}]


def _emotion_task(name, labels, **kw) -> Task:
    return Task(name, tuple(labels), labels, noun="emotion", question=(
        "Identify the emotion that the speaker expresses or implies in the turn to analyze, and in that turn "
        "only; use the other turns as context for reading it."), grounded=(
        "the conversation, the relationships, the setting, emotional states and their causes, tensions "
        "between the speakers or their attitudes"), **kw)


_WEIGH = "Where the text supports it, weigh " + _TURN_CONTEXT
_SCRIPT = "a conversation between characters of a TV series"
_CHINESE_SCRIPT = "a conversation between characters of a Chinese TV series"
TASKS: dict[str, Task] = {t.name: t for t in [
    _emotion_task("ccu_emotion", {k.capitalize(): v for k, v in _EMOTIONS.items()} | {
        "None": "the turn conveys no emotion, the emotion is unclear, or none of the listed emotions fits."},
        multi_label=True, catch_all="None", setting="a conversation from an instant-messaging platform or a "
        "discussion forum", cues=_WEIGH + ", and what the turn responds to (praise, blame, pressure, rejection, "
        "an apology, help, criticism or reassurance). Judge the emotion conveyed in context, not only the literal "
        "words, and do not mistake a dialog act or a norm violation for an emotion."),
    Task("ccu_dialog_act", tuple(_CCU_ACTS) + ("None",), _CCU_ACTS | {
        "None": "no dialog act is clear, or none of the listed dialog acts fits the turn."},
        multi_label=True, catch_all="None", noun="dialog act",
        setting="a conversation from an instant-messaging platform, a discussion forum or a script",
        question="Identify the dialog act (the pragmatic intention) of the turn to analyze, and of that turn "
        "only; use the other turns as context for reading it.",
        grounded="the conversation, the relationships, the setting, emotional states, social pressure, "
        "what a speaker intends or what a turn does",
        cues=_WEIGH + ", as well as cultural or interactional cues. Judge what the turn does in context, not "
        "only what it literally says, and do not mistake emotion, politeness, disagreement or a norm "
        "violation for a dialog act."),
    Task("ccu_norm", ("Adhere", "Violate"), {
        "Adhere": "the turn appropriately follows the social expectations tied to its dialog act in this context.",
        "Violate": "the turn breaks, or fails to meet, the social expectations tied to its dialog act in "
                   "this context."}, noun="verdict",
        setting="a conversation from an instant-messaging platform, a discussion forum or a script",
        question="Decide whether the turn to analyze adheres to or violates the social expectations that come "
        "with its given dialog act. Only that turn is judged; the other turns are context.",
        grounded="the conversation, the relationships, the setting, the norm in force, role obligations, "
        "boundaries, expectations, politeness pressure, a violation, adherence, repair or escalation, "
        "emotional states or what a turn does",
        cues=_WEIGH + ", including promises, boundaries, "
        "role-based expectations and cultural or interactional cues. Tie the judgment to the given dialog act "
        "rather than to norms in general, and do not mistake negative emotion, disagreement, the dialog act "
        "itself or politeness markers for a violation or for adherence. Do not invent social rules, harms or "
        "obligations."),
    _emotion_task("meld_emotion", {k: _EMOTIONS[k] for k in ("anger", "disgust", "fear", "joy")} | {
        "neutral": "no particular emotion is expressed."} | {k: _EMOTIONS[k] for k in ("sadness", "surprise")},
        setting=_SCRIPT, cues="Where the text supports it, weigh what was said to the speaker just before the "
        "turn, exclamations, insults, endearments, questions the speaker reacts to, and how the other "
        "characters respond. If the turn expresses no particular emotion, the answer is neutral."),
    _emotion_task("cped_emotion", _CPED_EMOTIONS, setting=_CHINESE_SCRIPT,
                  cues="Where the text supports it, weigh what was said to the speaker just before the turn, "
                  "exclamations, insults, endearments, questions the speaker reacts to, and how the other "
                  "characters respond."),
    Task("cped_dialog_act", tuple(_CPED_ACTS), _CPED_ACTS, catch_all="other", noun="dialogue act",
         setting=_CHINESE_SCRIPT, question="Identify the dialogue act of the turn to "
         "analyze: the communicative function it performs in the conversation.",
         grounded="the conversation, what a speaker intends, what the turn does, or how it relates to earlier "
         "or later turns", cues="Where the text supports it, weigh whether the turn reacts to a question, "
         "request, offer or statement, whether it opens or closes the interaction, and how the other "
         "characters respond. Judge what the turn does in context rather than its words alone, and keep "
         "dialogue act apart from emotion."),
    Task("wiki_power", ("A", "B"), {"A": "speaker A has the higher standing.", "B": "speaker B has the higher "
         "standing."}, turn_level=False, noun="speaker", setting="a conversation between two speakers, A and "
         "B, from a Wikipedia talk page", question="Decide which speaker has more power in the conversation. "
         "Power means standing in the setting: the authority to decide, act, permit, protect, close, enforce "
         "or evaluate, as an administrator, moderator, maintainer or senior member has, as opposed to the one "
         "who asks, proposes, requests, complies or appeals. That standing is rarely stated: infer it from "
         "what the speakers do and how they treat each other, using only cues present in the text.",
         grounded="the conversation, the relationship, the setting, power or status differences, control of "
         "the interaction, directives, deference, concessions or a speaker's attitude",
         cues="Signs of the higher standing: the other speaker asks them for help, permission, a review or a "
         "decision; they give directives or set conditions the other follows; they take or announce actions "
         "only someone with authority can take (protecting, deleting, closing, restoring, granting); they "
         "explain or invoke policy as a matter of course; the other thanks them, apologizes, defers or "
         "justifies themselves to them. Do not decide by who speaks more, raises the issue, argues more or "
         "proposes the plan: raising an issue, requesting an action and proposing a solution usually mark the "
         "lower standing."),
    Task("tom_mc", ("A", "B", "C", "D"), {}, turn_level=False, choices=True, noun="option",
         setting="a short story", question="Answer the multiple-choice question about the story. It tests "
         "theory of mind: what the characters believe, know, want, feel or intend, or what they mean beyond "
         "their literal words.", grounded="the story, the characters, what they perceive, know, believe, "
         "want, feel or intend", cues="Track who saw or was told what, and when; a character's beliefs "
         "follow what they could perceive, not what the reader knows."),
    Task("mmlu", ("A", "B", "C", "D"), {}, turn_level=False, choices=True, noun="option",
         question="Answer the multiple-choice question."),
]}


def get_task(name: str, field: str | None = None) -> Task:
    """TASKS[name], or a DataError listing the known tasks."""
    if name not in TASKS:
        at = f"field '{field}': " if field else ""
        raise DataError(f"{at}unknown task {name!r} (known: {', '.join(TASKS)})")
    return TASKS[name]


# ----------------------------------------------------------------------------- rendering

TIME_GAP_MINUTES = 10  # instant-messaging gaps at least this long become a time-marker line


def visible_turns(example: Example) -> list[Turn]:
    """The turns the model is shown: up to and including the target (all turns when there is none)."""
    return example.turns if example.target is None else example.turns[: example.target + 1]


def _speaker_line(turn: Turn) -> str:
    return f"{turn.speaker}: {turn.text}" if turn.speaker else turn.text


def _post_lines(turns: list[Turn], i: int) -> list[str]:
    """A post as lines: `Speaker: text` when it is one line and answers nothing; otherwise `Speaker:`
    followed by the answered post's own lines behind `| ` (recursively: its chain) and then the text."""
    turn = turns[i]
    text = turn.text.splitlines() or [""]
    if turn.reply_to is None and len(text) == 1:
        return [_speaker_line(turn)]
    quoted = [f"| {line}".rstrip() for line in _post_lines(turns, turn.reply_to)] if turn.reply_to is not None else []
    return ([f"{turn.speaker}:"] if turn.speaker else []) + quoted + text


def time_marker(earlier: str, later: str) -> str | None:
    """`[N minutes later]` (hours past 2 hours, days past 2 days) for a gap of at least
    TIME_GAP_MINUTES between two message times; None for shorter or negative gaps."""
    minutes = (datetime.datetime.fromisoformat(later) - datetime.datetime.fromisoformat(earlier)).total_seconds() // 60
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
    """The visible conversation exactly as the prompt shows it: one segment per line (`Speaker: text`;
    a multi-line or replying post opens with `Speaker:` and indents its lines under it), forum reply
    chains quoted with `|`, and a time-marker line between messages at least 10 minutes apart."""
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
    """The turn to analyze as shown again after the conversation (`Speaker: text`); "" without a target."""
    return "" if example.target is None else _speaker_line(example.turns[example.target])


def _options(example: Example) -> str:
    letters = get_task(example.task).labels
    return "\n".join(f"{letter}. {option}" for letter, option in zip(letters, example.meta["options"]))


def _label_list(task: Task, example: Example) -> str:
    if task.choices:
        return f"Question: {example.meta['question']}\nOptions:\n{_options(example)}"
    items = "\n".join(f"- {label}: {task.definitions[label]}" for label in task.labels)
    return f"Choose only from the following {task.noun}s, each with its definition:\n{items}"


def _culture(example: Example) -> list[str]:
    return [f"The applicable culture is: {example.culture}."] if example.culture else []


def task_brief(example: Example) -> str:
    """The task as a judge is shown it: what to decide, the culture, the labels with their definitions
    (or the question and options), and the dialog act for the norm task; no answer-format rules."""
    task = get_task(example.task)
    parts = [task.question, *_culture(example), _label_list(task, example)]
    if example.dialog_act:
        parts.append(f"Dialog act of the turn: {example.dialog_act}")
    return "\n\n".join(parts)


def _layout_note(example: Example) -> str:
    notes = ["The conversation is written one segment per line as `Speaker: text`."]
    if get_task(example.task).turn_level:
        notes.append("A speaker often sends several messages in a row that continue one another: where the "
                     "lines just before the turn to analyze run on into it, read them together with it; where "
                     "the turn stands alone, read it alone. Let the text decide which.")
    turns = visible_turns(example)
    if any(t.reply_to is not None for t in turns):
        notes.append("A post that spans several lines opens with `Speaker:` and its lines are indented under "
                     "it. A reply shows the post it answers behind `|`: `| Speaker:` opens that post, lines "
                     "with the same number of `|` are its words, one more `|` marks the post it answered in "
                     "turn, and lines without `|` are the replier's own words.")
    if any(_marker_before(turns, i) for i in range(len(turns))):
        notes.append("A line such as [22 minutes later] stands between two messages and tells how much time "
                     "passed; it is not a turn and nobody said it.")
    return " ".join(notes)


def _answer_format(task: Task, example: Example) -> str:
    labels = task.labels[: len(example.meta["options"])] if task.choices else task.labels
    first = labels[0]
    if task.multi_label:
        rule = (f'"Answer: {first}", or "Answer: {first}, {labels[1]}" when several {task.noun}s clearly '
                f"apply to the turn (separate them with a comma and a space).")
        if task.catch_all:
            rule += f' If none of the listed {task.noun}s clearly applies, write "Answer: {task.catch_all}".'
    else:
        rule = f'"Answer: <{task.noun}>", where <{task.noun}> is exactly one of: {", ".join(labels)}.'
    return (f"After your reasoning, give the final answer alone on the last line, in exactly this form: {rule} "
            "Write it in English, spelled exactly as listed, with nothing else on the line. That line must be "
            "the very last thing you write.")


def build_prompt(example: Example) -> str:
    """The user message for `example`: the setting and task, how the conversation is laid out, the
    evidence rule, task-specific cues, the culture, the labels with definitions, the answer format,
    then the conversation, the turn to analyze again and (norm task) its dialog act."""
    task = get_task(example.task)
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
            f"Before answering, reason from the {source}. Ground every concrete claim about {task.grounded} "
            f"in exact text from the {source}, and put every quoted span between the special tokens "
            f"<evidence> and </evidence>. The text inside the tags must be copied exactly, character for "
            f"character and in its original language and script; never put a paraphrase or a translation "
            f"inside them. Do not invent facts, relationships, motives, cultural background or events.")
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


# ----------------------------------------------------------------------------- completions

THINK_END = "</think>"
_ANSWER_LINE = re.compile(r"^\s*answer\s*:(.*)$", re.IGNORECASE)


def split_completion(completion: str) -> tuple[str, str]:
    """(reasoning, answer text): the text before the final `</think>` (a leading `<think>` and outer
    whitespace removed) and the text after it. Without a `</think>` the reasoning never closed: all of
    it is reasoning and the answer text is empty."""
    reasoning, closed, answer = completion.rpartition(THINK_END)
    if not closed:
        reasoning, answer = completion, ""
    return reasoning.strip().removeprefix("<think>").strip(), answer


def split_blocks(reasoning: str) -> list[str]:
    """The reasoning's blocks r_1..r_N: separated by blank lines, stripped, empty ones dropped."""
    return [block.strip() for block in re.split(r"\n\s*\n", reasoning) if block.strip()]


def parse_answer(completion: str, task: str) -> list[str] | None:
    """The predicted labels, in canonical spelling, from the last `Answer: <label>[, <label>...]` line
    after the final `</think>`; labels match case-insensitively. None (an invalid answer, scored wrong)
    when there is no such line, it is empty, a label is outside the task's set, a single-label task
    gets several, or the catch-all comes with other labels."""
    spec = get_task(task)
    _, answer_text = split_completion(completion)
    found = [m.group(1) for line in answer_text.splitlines() if (m := _ANSWER_LINE.match(line))]
    if not found:
        return None
    labels = [spec.canonical(name) for name in found[-1].split(",")]
    if None in labels:
        return None
    labels = list(dict.fromkeys(labels))
    if (not spec.multi_label and len(labels) > 1) or (spec.catch_all in labels and len(labels) > 1):
        return None
    return labels


def count_tokens(text: str, tokenizer) -> int:
    """Tokens in `text` for a tokenizer whose `encode` returns ids or a `tokenizers.Encoding` (whose
    post-processor must not add special tokens, as Qwen's does not): e.g. T, the reasoning tokens."""
    encoded = tokenizer.encode(text)
    return len(getattr(encoded, "ids", encoded))


# ----------------------------------------------------------------------------- curriculum


@dataclasses.dataclass
class CurriculumConfig:
    context_turns: tuple[int, ...] = (5, 10, 20)  # preceding turns kept in the shortened contexts
    seed: int = 0


@dataclasses.dataclass
class Segment:
    """One stage of the curriculum; replacement prompts are drawn from the same segment."""

    name: str
    examples: list[Example]


def truncate_context(example: Example, n: int) -> Example:
    """The example with only the target and its preceding `n` turns (unchanged when it has no target
    or no more turns than that). Reply links and cause indices are shifted; links to dropped turns go."""
    if example.target is None or example.target <= n:
        return example
    start = example.target - n

    def shift(index):
        return index - start if index is not None and index >= start else None

    turns = [dataclasses.replace(t, reply_to=shift(t.reply_to)) for t in example.turns[start: example.target + 1]]
    meta = dict(example.meta)
    if "causes" in meta:
        meta["causes"] = [c | {"turn": shift(c["turn"])} for c in meta["causes"] if shift(c["turn"]) is not None]
    return dataclasses.replace(example, id=f"{example.id}/ctx{n}", turns=turns, target=n, meta=meta)


def curriculum(examples: list[Example], cfg: CurriculumConfig) -> list[Segment]:
    """Two segments (paper A.2). "full": full conversations, each task ordered by increasing difficulty
    (unrated examples last, file order within ties) and the tasks interleaved in proportion to their
    size. "mixed": every example once more, its context drawn uniformly from the full conversation and
    the `context_turns` truncations, shuffled. Deterministic for `cfg.seed`."""
    by_task: dict[str, list[Example]] = {}
    for example in examples:
        by_task.setdefault(example.task, []).append(example)
    ranked = []
    for group in by_task.values():
        ordered = sorted(group, key=lambda e: (e.difficulty is None, e.difficulty or 0.0))
        ranked += [((rank + 0.5) / len(ordered), e) for rank, e in enumerate(ordered)]
    full = [e for _, e in sorted(ranked, key=lambda pair: pair[0])]
    rng = random.Random(cfg.seed)
    choices = (None, *cfg.context_turns)
    mixed = [e if (n := rng.choice(choices)) is None else truncate_context(e, n) for e in examples]
    rng.shuffle(mixed)
    return [Segment("full", full), Segment("mixed", mixed)]


# ----------------------------------------------------------------------------- converters


def _csv_lines(path, header: bool = False, **fmt) -> list[tuple[int, dict | list]]:
    """(line number, row) pairs of a CSV/TSV, rows as dicts when it has a header; a BOM, CRLF (also
    inside quoted cells, made LF) and quoted newlines are handled; empty rows are skipped."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f, **fmt) if header else csv.reader(f, **fmt)
        rows = [(reader.line_num, row) for row in reader if row]
    return [(line, {k: _lf(v) for k, v in row.items()} if header else list(map(_lf, row))) for line, row in rows]


def _lf(cell):
    return cell.replace("\r\n", "\n") if isinstance(cell, str) else cell


def _label(task: str, raw: str, where: str) -> str:
    label = TASKS[task].canonical(raw)
    if label is None:
        raise DataError(f"{where}: {raw!r} is not a label of {task}")
    return label


def _files(path, pattern: str) -> list[Path]:
    """`path` itself, or the files in the folder `path` that match `pattern`, sorted by name."""
    path = Path(path)
    return sorted(path.glob(pattern)) if path.is_dir() else [path]


# MELD and CPED: one CSV row per utterance, rows of a dialogue consecutive; every utterance is a target.
_DIALOGUE_CSV = {
    "meld": dict(language="en", tasks={"meld_emotion": "Emotion"}),
    "cped": dict(language="zh", tasks={"cped_emotion": "Emotion", "cped_dialog_act": "DA"}),
}


def convert_dialogue_csv(path, name: str) -> list[Example]:
    """MELD (`name="meld"`) or CPED (`"cped"`) CSV: one example per utterance and task, the dialogue up to
    it as context; utterances whose gold label is the task's catch-all stay as context only."""
    spec, path = _DIALOGUE_CSV[name], Path(path)
    dialogues: dict[str, list[tuple[int, dict]]] = {}
    for line, row in _csv_lines(path, header=True):
        dialogues.setdefault(row["Dialogue_ID"], []).append((line, row))
    examples = []
    for dialogue, rows in dialogues.items():
        turns = [Turn(row["Speaker"], row["Utterance"]) for _, row in rows]
        for i, (line, row) in enumerate(rows):
            for task, column in spec["tasks"].items():
                label = _label(task, row[column], f"{path}:{line}: field '{column}'")
                if label != TASKS[task].catch_all:
                    examples.append(Example(f"{path.stem}-{dialogue}-{i}-{task}", task, turns, i, [label],
                                            language=spec["language"]))
    return examples


def _detokenize(text: str) -> str:
    """Undo ECF's space before punctuation ("Oh , yeah ." -> "Oh, yeah.")."""
    return re.sub(r" +([,.!?;:])", r"\1", text)


def convert_ecf(path) -> list[Example]:
    """ECF 2.0 (SemEval-2024 Task 3) JSON: one meld_emotion example per utterance, text detokenized;
    the annotated causes at or before the target are kept as meta["causes"] ([{"turn", "span"}])."""
    path = Path(path)
    examples = []
    for k, conversation in enumerate(json.loads(path.read_text(encoding="utf-8-sig"))):
        where = f"{path}: conversation {k}"
        utterances = conversation["conversation"]
        if [u["utterance_ID"] for u in utterances] != list(range(1, len(utterances) + 1)):
            raise DataError(f"{where}: field 'utterance_ID': expected 1..{len(utterances)} in order")
        turns = [Turn(u["speaker"], _detokenize(u["text"])) for u in utterances]
        causes: dict[int, list[dict]] = {}
        for emotion, cause in conversation["emotion-cause_pairs"]:
            target, cause_turn = int(emotion.split("_")[0]) - 1, int(cause.split("_")[0]) - 1
            record = {"turn": cause_turn, "span": _detokenize(cause.split("_", 1)[1])}
            if cause_turn <= target and record not in causes.setdefault(target, []):
                causes[target].append(record)
        for i, u in enumerate(utterances):
            label = _label("meld_emotion", u["emotion"], f"{where}, utterance {i + 1}: field 'emotion'")
            meta = {"causes": causes[i]} if causes.get(i) else {}
            examples.append(Example(f"ecf-{conversation['conversation_ID']}-{i + 1}", "meld_emotion", turns, i,
                                    [label], meta=meta))
    return examples


def _present(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


_TOMBENCH_KEYS = {"en": ("STORY", "QUESTION", "OPTION-{}"), "zh": ("故事", "问题", "选项{}")}


def convert_tombench(path) -> list[Example]:
    """ToMBench JSONL (a file or a folder of them): two tom_mc examples per item, English and Chinese.
    Handles the release's quirks: keys with a literal newline ("答案\\nANSWER"), the bare NaN (and NaN
    for absent options: two-option items), options that repeat their letter ("A. ...") and answers
    with trailing text ("A. ")."""
    examples = []
    for file in _files(path, "*.jsonl"):
        for number, line in enumerate(file.read_text(encoding="utf-8-sig").splitlines(), 1):
            if not line.strip():
                continue
            where = f"{file}:{number}"
            item = {key.split("\n")[-1]: value for key, value in json.loads(line).items()}  # Python reads NaN
            answer = str(item.get("ANSWER", "")).strip()[:1].upper()
            for language, (story, question, option) in _TOMBENCH_KEYS.items():
                options = []
                for letter in "ABCD":
                    if not _present(item.get(option.format(letter))):
                        break
                    text = str(item[option.format(letter)]).strip()
                    options.append(re.sub(rf"^{letter}\s*[.:：．、)]\s*", "", text))
                if answer not in "ABCD"[: len(options)] or not answer:
                    raise DataError(f"{where}: field 'ANSWER': {item.get('ANSWER')!r} is not one of the "
                                    f"{len(options)} options ({language})")
                examples.append(Example(
                    f"tombench-{language}-{file.stem}-{number}", "tom_mc", [Turn("", item[story])], None, [answer],
                    language=language, meta={"question": item[question], "options": options,
                                             "ability": item.get("ABILITY")}))
    return examples


def _root(utterance: dict):
    return utterance.get("conversation_id", utterance.get("root"))  # ConvoKit 2 / ConvoKit 1 spelling


def _speaker(utterance: dict):
    return utterance.get("speaker", utterance.get("user"))


def convert_wiki_power(path, limit: int = 1000) -> list[Example]:
    """ConvoKit Wikipedia talk pages (`utterances.jsonl`, or the corpus folder): scan utterances in file
    order, group consecutive ones sharing a root, keep conversations with exactly two speakers of whom
    exactly one made an `is-admin` utterance (both admins: no power difference to predict), name the
    speakers A and B by first appearance, and stop after `limit` conversations."""
    path = Path(path)
    path = path / "utterances.jsonl" if path.is_dir() else path
    utterances = []
    with open(path, encoding="utf-8-sig") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                utterances.append(json.loads(line))
                if _root(utterances[-1]) is None or _speaker(utterances[-1]) is None:
                    raise DataError(f"{path}:{number}: field 'conversation_id' or 'speaker': missing")
    examples = []
    for _, group in itertools.groupby(utterances, key=_root):
        group = list(group)
        speakers = list(dict.fromkeys(map(_speaker, group)))
        admins = {_speaker(u) for u in group if (u.get("meta") or {}).get("is-admin")}
        if len(speakers) != 2 or len(admins) != 1:
            continue
        letters = dict(zip(speakers, "AB"))
        turns = [Turn(letters[_speaker(u)], u["text"]) for u in group]
        examples.append(Example(f"wiki-{group[0]['id']}", "wiki_power", turns, None, [letters[admins.pop()]]))
        if len(examples) == limit:
            break
    return examples


# LDC's CCU norm ids for the ten social acts of the dialog-act and norm tasks; other ids are left out.
CCU_NORM_ACTS = dict(zip(map(str, range(101, 111)), _CCU_ACTS))


def _ccu_conversations(text_path) -> dict[str, tuple[dict, list[Turn], dict[str, int]]]:
    """file_id -> (the line's fields, turns, segment_id -> turn index) from the CCU text JSONL: one
    conversation per line, {"file_id", "language", "culture", "turns": [{..turn.., "segment_id"}]}."""
    conversations = {}
    with open(text_path, encoding="utf-8-sig") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line, parse_constant=_reject_constant)
                turns = [_turn_from_json(t, i, extra=("segment_id",)) for i, t in enumerate(_typed(raw, "turns", list))]
                segments = {t["segment_id"]: i for i, t in enumerate(raw["turns"]) if t.get("segment_id")}
                conversations[_typed(raw, "file_id", str)] = (raw, turns, segments)
            except (json.JSONDecodeError, DataError) as e:
                raise DataError(f"{text_path}:{number}: {e}") from None
    return conversations


def convert_ccu(annotation_dir, text_path, norm_acts: dict[str, str] = CCU_NORM_ACTS) -> list[Example]:
    """A CCU annotation package (`data/emotions.tab`, `data/norms.tab`) paired with the conversation text
    (see `_ccu_conversations`; files without text are skipped). Per annotated segment: ccu_emotion keeps
    the emotions that at least two annotators chose (a segment with one annotator is unscored, none
    reaching two is the catch-all None); ccu_dialog_act lists the acts of its norms (`norm_acts` maps
    norm ids to acts; "none" is the catch-all); ccu_norm asks adhere/violate once per act."""
    conversations = _ccu_conversations(text_path)
    annotation_dir = Path(annotation_dir)
    segments: dict[tuple[str, str], dict] = {}

    def segment(tab: Path, line: int, row: dict) -> dict | None:
        if row["file_id"] not in conversations:
            return None
        if row["segment_id"] not in conversations[row["file_id"]][2]:
            raise DataError(f"{tab}:{line}: field 'segment_id': {row['segment_id']} has no turn in {text_path}")
        return segments.setdefault((row["file_id"], row["segment_id"]), {"voters": set(), "votes": {}, "norms": {}})

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
        if row["norm"] != "noann" and (seg := segment(tab, line, row)) is not None and row["norm"] in norm_acts:
            seg["norms"][row["norm"]] = (norm_acts[row["norm"]], _label("ccu_norm", row["status"],
                                                                         f"{tab}:{line}: field 'status'"))
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
                examples.append(Example(f"ccu-{segment_id}-emotion", "ccu_emotion", turns, i, emotions, **fields,
                                        meta=meta))
            acts = [a for a in TASKS["ccu_dialog_act"].labels if a in {act for act, _ in seg["norms"].values()}]
            if acts:
                examples.append(Example(f"ccu-{segment_id}-dialog_act", "ccu_dialog_act", turns, i, acts, **fields,
                                        meta=meta))
            for norm, (act, status) in seg["norms"].items():
                examples.append(Example(f"ccu-{segment_id}-norm-{norm}", "ccu_norm", turns, i, [status],
                                        dialog_act=act, **fields, meta=meta | {"norm": norm}))
    return examples


def convert_mmlu(path) -> list[Example]:
    """MMLU: the original header-less CSVs (question, A, B, C, D, answer letter; subject from the file
    name, e.g. `anatomy_test.csv`), a file or a folder of them, or JSON/JSONL records {question,
    choices, answer (index or letter), subject}."""
    examples = []
    for file in _files(path, "*.csv"):
        if file.suffix == ".csv":
            subject = re.sub(r"_(test|dev|val)$", "", file.stem)
            records = [(f"{file}:{line}", {"question": r[0], "choices": r[1:5], "answer": r[5], "subject": subject})
                       for line, r in _csv_lines(file)]
        else:
            text = file.read_text(encoding="utf-8-sig")
            rows = json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines()]
            records = [(f"{file}: record {n}", r) for n, r in enumerate(rows)]
        for n, (where, record) in enumerate(records):
            answer, choices = record["answer"], list(record["choices"])
            letter = "ABCD"[answer] if isinstance(answer, int) and 0 <= answer < 4 else str(answer).strip().upper()
            if letter not in "ABCD"[: len(choices)] or not letter:
                raise DataError(f"{where}: field 'answer': {answer!r} is not one of {len(choices)} choices")
            subject = record.get("subject") or file.stem
            examples.append(Example(f"mmlu-{subject}-{n}", "mmlu", [], None, [letter],
                                    meta={"question": record["question"], "options": choices, "subject": subject}))
    return examples


def stratified_sample(examples: list[Example], per_label: int, seed: int = 0) -> list[Example]:
    """At most `per_label` examples for each (task, gold label set), drawn with `seed`, in input order."""
    groups: dict[tuple, list[int]] = {}
    for i, example in enumerate(examples):
        groups.setdefault((example.task, tuple(example.labels)), []).append(i)
    rng = random.Random(seed)
    keep = {i for group in groups.values() for i in (group if len(group) <= per_label else rng.sample(group, per_label))}
    return [e for i, e in enumerate(examples) if i in keep]


def convert(fmt: str, source, text: str | None = None) -> list[Example]:
    """Convert `source` from one of CONVERTERS' formats (`ccu` also needs the conversation `text`)."""
    if fmt not in CONVERTERS:
        raise DataError(f"unknown format {fmt!r} (known: {', '.join(CONVERTERS)})")
    if (fmt == "ccu") != (text is not None):
        raise DataError("--text (the conversation JSONL) is needed for, and only for, the ccu format")
    try:
        return convert_ccu(source, text) if fmt == "ccu" else CONVERTERS[fmt](source)
    except KeyError as e:
        raise DataError(f"{source}: field {e}: missing") from None


CONVERTERS = {
    "meld": functools.partial(convert_dialogue_csv, name="meld"),
    "cped": functools.partial(convert_dialogue_csv, name="cped"),
    "ecf": convert_ecf,
    "tombench": convert_tombench,
    "wiki": convert_wiki_power,
    "ccu": convert_ccu,
    "mmlu": convert_mmlu,
    "jsonl": load_jsonl,
}


# ----------------------------------------------------------------------------- stats


def _spread(values: list[int]) -> str:
    ordered = sorted(values)
    return (f"min {ordered[0]}, median {ordered[len(ordered) // 2]}, mean {sum(ordered) / len(ordered):.1f}, "
            f"max {ordered[-1]}")


def stats(examples: list[Example], tokenizer=None) -> str:
    """A report of what a file holds: examples per task and gold label, visible turns per example, and
    (given a tokenizer) prompt lengths in tokens (the user message; the chat template adds a few)."""
    lines = [f"{len(examples)} examples"]
    for name in dict.fromkeys(e.task for e in examples):
        group = [e for e in examples if e.task == name]
        counts: dict[str, int] = {}
        for example in group:
            for label in example.labels:
                counts[label] = counts.get(label, 0) + 1
        lines.append(f"\n{name}: {len(group)} examples")
        lines.append("  labels: " + ", ".join(f"{label} {n}" for label, n in sorted(counts.items(), key=lambda x: -x[1])))
        lines.append("  visible turns: " + _spread([len(visible_turns(e)) for e in group]))
        if tokenizer is not None:
            lengths = [count_tokens(build_prompt(e), tokenizer) for e in group]
            lines.append("  prompt tokens: " + _spread(lengths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="data.py", description="Convert datasets to our JSONL; inspect a file.")
    commands = parser.add_subparsers(dest="command", required=True)
    conv = commands.add_parser("convert", help="convert a dataset to our JSONL")
    conv.add_argument("format", choices=list(CONVERTERS))
    conv.add_argument("input", help="the dataset file or folder (ccu: the annotation package folder)")
    conv.add_argument("output", help="the JSONL file to write")
    conv.add_argument("--text", help="ccu: the conversation text JSONL paired with the annotations")
    conv.add_argument("--task", action="append", help="keep only this task (repeatable)")
    conv.add_argument("--per-label", type=int, help="keep at most N examples per task and gold label")
    conv.add_argument("--seed", type=int, default=0, help="seed for --per-label sampling")
    show = commands.add_parser("stats", help="counts per task and label, turns, prompt lengths")
    show.add_argument("file")
    show.add_argument("--tokenizer", help="tokenizer.json, or the model folder holding it")
    args = parser.parse_args(argv)
    try:
        if args.command == "convert":
            examples = convert(args.format, args.input, args.text)
            if args.task:
                unknown = set(args.task) - set(TASKS)
                if unknown:
                    raise DataError(f"--task: unknown task {sorted(unknown)[0]!r} (known: {', '.join(TASKS)})")
                examples = [e for e in examples if e.task in args.task]
            if args.per_label:
                examples = stratified_sample(examples, args.per_label, args.seed)
            save_jsonl(examples, args.output)
            print(f"wrote {len(examples)} examples to {args.output}")
        else:
            tokenizer = None
            if args.tokenizer:
                from tokenizers import Tokenizer

                path = Path(args.tokenizer)
                tokenizer = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
            print(stats(load_jsonl(args.file), tokenizer))
    except (DataError, OSError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
