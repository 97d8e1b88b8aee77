"""The journaled, resumable teacher call every data preparation makes (CLUE's trace refinement
aside, which asks once): Social-R1's references (prepare_references.py), EmoLLM's ARG rows
(emollm_data.py), the content RM's pairs (reward_model.py pairs) and CARE's rubric targets and win
rate (rubric_generator.py).

A journal is a JSONL file of {"key", "value"} records, appended to as each chunk of calls finishes.
The key is a hash of everything the request depends on (`journal_key`), so a changed request is a
new key and is asked again; the value is the parsed answer (None when the parser rejected it: not
asked again). A failed call is not journaled, so a rerun of the same command asks only for what
failed or was never asked. A torn last line of a killed run is ignored when the journal is read
(config.read_log) and cut off before the next append (config.open_log).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from config import open_log, print0, read_log
from judge import JudgeCall, JudgeConfig, JudgeError, ask


def journal_key(*parts: str) -> str:
    """A journal entry's key: a hash of what the request depends on."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def load_journal(path) -> dict:
    """key -> parsed answer of a journal `ask_journaled` appends to (a torn last line is ignored,
    the file kept)."""
    done = {}
    for number, record in enumerate(read_log(path, JudgeError), 1):
        if not isinstance(record, dict) or set(record) != {"key", "value"}:
            raise JudgeError(f"{path}:{number}: not a journal record {{key, value}}")
        done[record["key"]] = record["value"]
    return done


def ask_journaled(
    requests: list[tuple[str, JudgeCall, Callable[[str], Any]]],
    cfg: JudgeConfig,
    journal,
    done: dict,
) -> dict[str, int]:
    """Ask each (key, call, parser) not yet in `done`, in chunks, appending every answer (parsed;
    None when malformed) to `journal` as its chunk finishes. Failed calls are not journaled: a rerun
    asks them again."""
    journal = Path(journal)
    todo = [r for r in requests if r[0] not in done]
    counts = {"asked": len(todo), "failures": 0, "malformed": 0}
    if not todo:
        return counts
    chunk = max(1, cfg.concurrency) * 4
    with open_log(journal) as f:
        for start in range(0, len(todo), chunk):
            part = todo[start : start + chunk]
            values, stats = ask([(call, parse) for _, call, parse in part], cfg)
            counts["failures"] += stats["failures"]
            counts["malformed"] += stats["malformed"]
            failed = {int(i) for i in stats["errors"]}
            lines = []
            for i, ((key, _, _), value) in enumerate(zip(part, values)):
                if i not in failed:
                    done[key] = value
                    lines.append(
                        json.dumps({"key": key, "value": value}, ensure_ascii=False) + "\n"
                    )
            f.write("".join(lines))
            f.flush()
            print0(
                f"{journal.name}: {min(start + chunk, len(todo))}/{len(todo)} calls answered or "
                f"failed"
            )
    return counts


def refuse_shrinking(path, rows: int, failures: int, journal) -> None:
    """Stop (JudgeError) before a preparation whose teacher calls failed replaces `path` with fewer
    than the rows it holds: the file is kept and a rerun, once the teacher answers, asks only for
    what failed."""
    path = Path(path)
    if not failures or not path.is_file():
        return
    with path.open("rb") as f:
        held = sum(1 for line in f if line.strip())
    if rows < held:
        raise JudgeError(
            f"{path}: kept as it was ({held} rows): {failures} teacher calls failed, so this run "
            f"has only {rows}; the answers so far are in {journal}: rerun to ask the rest"
        )


def request_key(kind: str, item: str, cfg: JudgeConfig, call: JudgeCall) -> str:
    """The key of a call whose answer depends on the teacher's model and the whole request (the
    messages and max_tokens), for the `kind` of call about `item` (an example's id)."""
    return journal_key(
        kind, item, cfg.model, json.dumps(call.messages, ensure_ascii=False), str(call.max_tokens)
    )


def raw_text(text: str) -> str:
    """The parser that journals the answer as it came, for a caller that parses (and counts
    rejections) itself."""
    return text
