"""Writes docs/config-reference.md, every config key of every script, from the dataclass schemas the
scripts check their configs against: `python -m tools.config_reference` (tests/test_config.py fails
when the committed page differs from what this writes). Each key's note is the comment beside or
above its field in the source; a range is the one `config.bounded` gives it."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import io
import json
import re
import tokenize
import types
import typing
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config-reference.md"
# script -> the schema its parse_cli reads (a script in a folder runs as `python -m folder.script`)
SCRIPTS = {
    "sft.py": "SFTConfig",
    "grpo.py": "GRPOConfig",
    "dialogue/rl.py": "DialogueConfig",
    "reward_models/social_r1.py": "SocialR1Config",
    "reward_models/content_rm.py": "RMConfig",
    "prepare/traces.py": "PrepareConfig",
    "prepare/references.py": "ReferenceSettings",
    "prepare/emollm_rows.py": "EmoLLMData",
    "prepare/emollm_seeds.py": "SeedSettings",
    "reward_models/rubric_generator.py": "GeneratorDataConfig",
    "evaluate.py": "EvalConfig",
    "dialogue/evaluation.py": "DialogueEvalConfig",
}


def type_text(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is tuple and args[-1:] == (Ellipsis,):
        return f"tuple[{type_text(args[0])}, ...]"
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(type_text(a) for a in args)}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def field_comments(schema) -> dict[str, str]:
    """field name -> the comment lines directly above its line and the comment ending it."""
    lines, _ = inspect.getsourcelines(schema)
    comments = {
        token.start[0]: token.string.lstrip("# ").rstrip()
        for token in tokenize.generate_tokens(io.StringIO("".join(lines)).readline)
        if token.type == tokenize.COMMENT
    }
    notes = {}
    for number, line in enumerate(lines, 1):
        match = re.match(r"    (\w+)\s*:", line)
        if not match:
            continue
        above, previous = [], number - 1
        while previous in comments and lines[previous - 1].lstrip().startswith("#"):
            above.insert(0, comments[previous])
            previous -= 1
        notes[match.group(1)] = " ".join(above + ([comments[number]] if number in comments else []))
    return notes


def class_comment(schema) -> str:
    """The comment lines above a class and the comment ending its `class` line."""
    above = [line.lstrip("# ") for line in (inspect.getcomments(schema) or "").splitlines()]
    lines, _ = inspect.getsourcelines(schema)
    line = next(text for text in lines if text.startswith("class "))
    tokens = tokenize.generate_tokens(io.StringIO(line).readline)
    end = [t.string.lstrip("# ") for t in tokens if t.type == tokenize.COMMENT]
    return " ".join(above + end)


def nested_schema(tp):
    """The dataclass a field's annotation holds (`X` or `X | None`), else None."""
    options = (
        typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ()
    )
    found = [a for a in (tp, *options) if dataclasses.is_dataclass(a)]
    return found[0] if found else None


def default_text(field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(section)"
    value = list(value) if isinstance(value, tuple) else value
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def rows(schema, prefix: str = "", skip=()) -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, range, note) of every key of `schema` but the fields `skip` names,
    sections followed by their keys."""
    hints, notes = typing.get_type_hints(schema), field_comments(schema)
    out = []
    for field in (f for f in dataclasses.fields(schema) if f.init and f.name not in skip):
        key, tp = prefix + field.name, hints[field.name]
        bounds, inner = field.metadata.get("bounds"), nested_schema(tp)
        note = notes.get(field.name) or (class_comment(inner) if inner else "")
        out.append((key, type_text(tp), default_text(field), str(bounds or ""), note))
        if inner is not None:
            out += rows(inner, key + ".")
    return out


def anchor(script: str) -> str:
    """The page's link target of a script's section (GitHub's: punctuation dropped)."""
    return script.replace(".", "").replace("/", "")


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def page() -> str:
    parts = [
        "# Config reference\n\n"
        "Every key each script's config takes (`python X.py config.yaml [key=value ...]`, a\n"
        "script in a folder as `python -m folder.X`),\n"
        "with its type, default, range and the note its dataclass gives: the paper section a\n"
        "value comes from, or why it was chosen. Generated from the schemas by\n"
        "`python -m tools.config_reference`; do not edit by hand. How configs are read and\n"
        "checked: [configs.md](configs.md).\n"
    ]
    schemas = {
        script: getattr(importlib.import_module(script.removesuffix(".py").replace("/", ".")), name)
        for script, name in SCRIPTS.items()
    }
    for script, schema in schemas.items():
        name = schema.__name__
        doc = schema.__doc__ or ""
        doc = "" if doc.startswith(f"{name}(") else " ".join(doc.split())  # dataclass's own
        # an extension's config: its parent script's keys, and its own
        parent = next((s for s, base in schemas.items() if base in schema.__mro__[1:]), None)
        inherited = [f.name for f in dataclasses.fields(schemas[parent])] if parent else []
        also = f" Every key of [{parent}](#{anchor(parent)}), and:" if parent else ""
        parts.append(
            f"\n## {script}\n\n`{name}`. {doc}{also}".rstrip()
            + "\n\n| key | type | default | range | note |\n|---|---|---|---|---|\n"
        )
        parts += [
            f"| `{key}` | {cell(tp)} | {cell(default)} | {cell(bounds)} | {cell(note)} |\n"
            for key, tp, default, bounds, note in rows(schema, skip=inherited)
        ]
    return "".join(parts)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.config_reference",
        description=f"Write {PAGE.relative_to(PAGE.parents[1])}: every config key of every script, "
        "from the schemas (run it after changing a config dataclass).",
    )
    parser.parse_args(argv)
    PAGE.write_text(page(), encoding="utf-8")
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
