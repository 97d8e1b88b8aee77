"""Datasets: the schema checks of an example, strict JSONL reading and writing (a bad line is one
error naming the file, the line and the field), the curriculum of the GRPO stage (paper A.2) and a
file report. The task contract (the registry, prompts, rendering, the completion format) is
data.py's.

    python dataset.py stats FILE [--tokenizer PATH] [--by FIELD ...]
    python dataset.py label-sft FILE OUT    # CLUE's Label SFT rows: each example, its answer alone
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
from pathlib import Path

from config import atomic_write_text, config_error, excerpt, read_text
from data import (
    DataError,
    Example,
    Turn,
    count_tokens,
    get_task,
    is_chat,
    label_completion,
    reject_json_constant,
    visible_turns,
)

# ----------------------------------------------------------------------------- examples

_TYPE_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    list: "a list",
    dict: "an object",
}


_REQUIRED = object()


def typed_field(raw: dict, key: str, kind, default=_REQUIRED, where: str = ""):
    """raw[key] checked against `kind` (a type; a missing key or null gives `default`, or an error
    when the key is required). Integers count as numbers; booleans count as neither."""
    value = raw.get(key)
    if value is None:
        if default is _REQUIRED:
            raise DataError(f"field '{where}{key}': missing")
        return default
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise DataError(f"field '{where}{key}': expected {_TYPE_NAMES[kind]}, got {excerpt(value)}")
    return value


def _parse_time(text: str, where: str) -> datetime.datetime:
    try:
        return datetime.datetime.fromisoformat(text)
    except ValueError:
        raise DataError(f"field '{where}': not an ISO 8601 time: {excerpt(text)}") from None


def turn_from_json(raw, i: int, extra: tuple[str, ...] = ()) -> Turn:
    where = f"turns[{i}]."
    if not isinstance(raw, dict):
        raise DataError(f"field 'turns[{i}]': expected an object, got {excerpt(raw)}")
    unknown = set(raw) - {"speaker", "text", "time", "reply_to", *extra}
    if unknown:
        raise DataError(f"field '{where}{sorted(unknown)[0]}': unknown field")
    return Turn(
        typed_field(raw, "speaker", str, where=where),
        typed_field(raw, "text", str, where=where),
        typed_field(raw, "time", str, None, where),
        typed_field(raw, "reply_to", int, None, where),
    )


_EXAMPLE_FIELDS = {f.name for f in dataclasses.fields(Example)}


def example_from_json(raw) -> Example:
    """Build and check an Example from a parsed JSON object; errors name the field."""
    if not isinstance(raw, dict):
        raise DataError(f"expected a JSON object, got {type(raw).__name__}")
    unknown = set(raw) - _EXAMPLE_FIELDS
    if unknown:
        raise DataError(
            f"field '{sorted(unknown)[0]}': unknown field (known: "
            f"{', '.join(sorted(_EXAMPLE_FIELDS))})"
        )
    turns = typed_field(raw, "turns", list)
    labels = typed_field(raw, "labels", list)
    example = Example(
        id=typed_field(raw, "id", str),
        task=typed_field(raw, "task", str),
        turns=[turn_from_json(t, i) for i, t in enumerate(turns)],
        target=typed_field(raw, "target", int, None),
        labels=labels,
        language=typed_field(raw, "language", str, "en"),
        culture=typed_field(raw, "culture", str, None),
        dialog_act=typed_field(raw, "dialog_act", str, None),
        difficulty=typed_field(raw, "difficulty", float, None),
        meta=typed_field(raw, "meta", dict, {}),
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
            raise DataError(
                f"field 'turns[{i}].reply_to': {turn.reply_to} is not an earlier turn (0..{i - 1})"
            )
    if len(aware) > 1:
        raise DataError("field 'turns': times mix zoned and unzoned values")
    if task.turn_level and (example.target is None or not 0 <= example.target < n):
        raise DataError(
            f"field 'target': task {task.name} needs a turn index in 0..{n - 1}, "
            f"got {excerpt(example.target)}"
        )
    if not task.turn_level and example.target is not None:
        raise DataError(
            f"field 'target': task {task.name} analyzes the whole input; target must be null"
        )
    if task.own_prompt:  # a generation task: its prompt in meta.prompt, no labels
        if not is_chat(example.meta.get("prompt")):
            raise DataError(
                f"field 'meta.prompt': task {task.name} needs its chat prompt, a list of {{role, "
                f"content}}"
            )
        if example.labels:
            raise DataError(
                f"field 'labels': task {task.name} has no labels, got {example.labels!r}"
            )
        return example
    allowed = task.labels
    if task.choices:
        options = example.meta.get("options")
        if not (
            isinstance(options, list)
            and 2 <= len(options) <= len(task.labels)
            and all(isinstance(o, str) for o in options)
        ):
            raise DataError(
                f"field 'meta.options': expected 2 to {len(task.labels)} strings, got "
                f"{excerpt(options)}"
            )
        if not isinstance(example.meta.get("question"), str):
            raise DataError(
                f"field 'meta.question': expected a string, got "
                f"{excerpt(example.meta.get('question'))}"
            )
    allowed = task.answer_labels(example)
    labels = [task.canonical(label) if isinstance(label, str) else None for label in example.labels]
    for raw, label in zip(example.labels, labels):
        if label not in allowed:
            raise DataError(
                f"field 'labels': {excerpt(raw)} is not a label of {task.name} "
                f"(labels: {', '.join(allowed)})"
            )
    if not labels or len(set(labels)) != len(labels) or (not task.multi_label and len(labels) != 1):
        need = "one or more distinct labels" if task.multi_label else "exactly one label"
        raise DataError(
            f"field 'labels': task {task.name} needs {need}, got {excerpt(example.labels)}"
        )
    if task.catch_all in labels and len(labels) > 1:
        raise DataError(
            f"field 'labels': the catch-all label {task.catch_all!r} cannot be combined with others"
        )
    if task.dialog_acts and example.dialog_act not in task.dialog_acts:
        acts = ", ".join(task.dialog_acts)
        raise DataError(
            f"field 'dialog_act': task {task.name} needs one of: {acts}; got "
            f"{excerpt(example.dialog_act)}"
        )
    return dataclasses.replace(example, labels=labels)


def example_to_json(example: Example) -> dict:
    """The JSONL object of an example; turn fields that are null are left out."""
    raw = dataclasses.asdict(example)
    raw["turns"] = [{k: v for k, v in t.items() if v is not None} for t in raw["turns"]]
    return raw


# what an SFT row adds to its example (sft.py's data, docs/sft.md)
SFT_ROW_FIELDS = ("completion", "prompt")


def load_jsonl(path, sft_rows: bool = False) -> list[Example]:
    """Read examples, one JSON object per line (UTF-8, an optional BOM, blank lines skipped); with
    `sft_rows`, the examples of SFT rows (their SFT_ROW_FIELDS set aside). Any bad line (or a
    repeated id) raises DataError naming the file, the line number and the field."""
    examples, ids = [], set()
    for number, raw in read_jsonl(path):
        try:
            if sft_rows and isinstance(raw, dict):
                raw = {k: v for k, v in raw.items() if k not in SFT_ROW_FIELDS}
            examples.append(example_from_json(raw))
            check_new_id(examples[-1].id, ids)
        except DataError as e:
            raise DataError(f"{path}:{number}: {e}") from None
    return examples


def load_files(paths: list[str], config_path, check=None) -> list[Example]:
    """The examples of the data files `paths` (the config key `train_data`), each file there and not
    empty, and each file's examples passed to `check` (a DataError then names the file). Raises
    ConfigError located at the key (config.config_error) or DataError, with one line."""
    if not paths:
        raise config_error(config_path, "train_data", "no data files given")
    examples = []
    for path in paths:
        if not Path(path).is_file():
            raise config_error(config_path, "train_data", f"{path}: file not found")
        loaded = load_jsonl(path)
        if not loaded:
            raise config_error(
                config_path, "train_data", f"{path}: no examples (the file is empty)"
            )
        try:
            if check is not None:
                check(loaded)
        except DataError as e:
            raise DataError(f"{path}: {e}") from None
        examples += loaded
    return examples


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise DataError(f"the number {text[:40]} is out of range")
    return value


def parse_json(text: str, path, line: int | None = None, allow_nan: bool = False):
    """`text` as strict JSON: NaN and Infinity (NaN is let through with `allow_nan`), numbers past
    the float range (1e400) and nesting too deep to parse are errors. `text` is the whole file
    `path`, or its line `line`; every error is a DataError naming the file and the line."""
    where = f"{path}:{line}" if line is not None else str(path)

    def constant(name: str):
        return math.nan if allow_nan and name == "NaN" else reject_json_constant(name)

    try:
        return json.loads(text, parse_constant=constant, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}:{(line or 1) + e.lineno - 1}: not valid JSON: {e.msg} (column {e.colno})"
        ) from None
    except RecursionError:
        raise DataError(f"{where}: not valid JSON: nested too deeply") from None
    except ValueError as e:  # DataError, or an integer with too many digits
        raise DataError(f"{where}: {e}") from None


def read_data_text(path) -> str:
    """The text of a UTF-8 data file (config.read_text); DataError naming the line of a non-UTF-8
    byte, or of a file that cannot be read."""
    try:
        return read_text(path, DataError)
    except FileNotFoundError:
        raise DataError(f"{path}: no such data file") from None
    except OSError as e:  # a folder, no permission
        raise DataError(f"{path}: cannot read the data file ({e.strerror or e})") from None


def read_jsonl(path, allow_nan: bool = False):
    """(line number, parsed value) for each non-blank line of a JSONL file, as `parse_json` reads
    it."""
    for number, line in enumerate(read_data_text(path).split("\n"), 1):
        if line.strip():
            yield number, parse_json(line, path, number, allow_nan)


def check_new_id(example_id: str, seen: set) -> None:
    """Add `example_id` to `seen`; DataError when it is there already."""
    if example_id in seen:
        raise DataError(f"field 'id': {excerpt(example_id)} appears twice")
    seen.add(example_id)


def save_jsonl(examples, path) -> None:
    """Check every example as `load_jsonl` will read it back (and that ids are unique), then write
    them atomically, one JSON per line."""
    lines, ids = [], set()
    for example in examples:
        try:
            check_new_id(example.id, ids)
            checked = example_from_json(example_to_json(example))
            lines.append(json.dumps(example_to_json(checked), ensure_ascii=False, allow_nan=False))
        except ValueError as e:  # a DataError, or a number JSON cannot hold (NaN in meta)
            raise DataError(f"example {excerpt(example.id)}: {e}") from None
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def write_label_rows(examples: list[Example], path) -> None:
    """sft.py rows for CLUE's Label SFT baseline: each example with the completion
    `label_completion(its labels)`, no reasoning, written atomically."""
    rows = [example_to_json(e) | {"completion": label_completion(e.labels)} for e in examples]
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


# ----------------------------------------------------------------------------- stats


def _spread(values: list[int]) -> str:
    ordered = sorted(values)
    return (
        f"min {ordered[0]}, median {ordered[len(ordered) // 2]}, mean "
        f"{sum(ordered) / len(ordered):.1f}, max {ordered[-1]}"
    )


def meta_counts(examples: list[Example], fields: list[str], indent: str = "  ") -> list[str]:
    """Lines counting `examples` by the value of meta[fields[0]], most frequent first, each value
    then counted by the next field, and so on (Social-R1's Table 3: ability, then sub-ability)."""
    if not fields:
        return []
    groups: dict[str, list[Example]] = {}
    for e in examples:
        groups.setdefault(str(e.meta.get(fields[0])), []).append(e)
    lines = []
    for value, group in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
        lines.append(f"{indent}{fields[0]} {value}: {len(group)}")
        lines += meta_counts(group, fields[1:], indent + "  ")
    return lines


def stats(examples: list[Example], tokenizer=None, by: list[str] | None = None) -> str:
    """A report of what a file holds: examples per task and gold label, visible turns per example,
    (given a tokenizer) prompt lengths in tokens (the messages' text; the chat template adds a
    few), and (given `by`) the examples counted by those meta fields, nested."""
    lines = [f"{len(examples)} examples"]
    for name in dict.fromkeys(e.task for e in examples):
        group = [e for e in examples if e.task == name]
        counts: dict[str, int] = {}
        for example in group:
            for label in example.labels:
                counts[label] = counts.get(label, 0) + 1
        lines.append(f"\n{name}: {len(group)} examples")
        by_count = sorted(counts.items(), key=lambda item: -item[1])
        if by_count:
            lines.append("  labels: " + ", ".join(f"{label} {n}" for label, n in by_count))
        lines.append("  visible turns: " + _spread([len(visible_turns(e)) for e in group]))
        if tokenizer is not None:
            task = get_task(name)
            lengths = [
                count_tokens("\n\n".join(m["content"] for m in task.messages(e)), tokenizer)
                for e in group
            ]
            lines.append("  prompt tokens: " + _spread(lengths))
        lines += meta_counts(group, by or [])
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="dataset.py", description="Inspect a JSONL file of examples."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser(
        "stats", help="counts per task and label, turns, prompt lengths (examples or SFT rows)"
    )
    show.add_argument("file")
    show.add_argument("--tokenizer", help="tokenizer.json, or the model folder holding it")
    show.add_argument(
        "--by",
        nargs="+",
        metavar="FIELD",
        help="count the examples by these meta fields, nested (e.g. ability sub_ability)",
    )
    labels = commands.add_parser("label-sft", help="CLUE's Label SFT rows (sft.py's data)")
    labels.add_argument("file")
    labels.add_argument("out")
    args = parser.parse_args(argv)
    try:
        if args.command == "label-sft":
            examples = load_jsonl(args.file)
            write_label_rows(examples, args.out)
            print(f"label-sft: {len(examples)} rows -> {args.out}")
            return
        tokenizer = None
        if args.tokenizer:
            from tokenizers import Tokenizer

            path = Path(args.tokenizer)
            path = path / "tokenizer.json" if path.is_dir() else path
            try:
                tokenizer = Tokenizer.from_file(str(path))
            except Exception as e:  # the tokenizers library raises a bare Exception
                raise DataError(
                    f"{path}: not a readable tokenizer.json: {' '.join(str(e).split())[:200]}"
                ) from None
        print(stats(load_jsonl(args.file, sft_rows=True), tokenizer, args.by))
    except (DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
