"""The journaled, resumable teacher call every data preparation makes (CLUE's trace refinement
aside, which asks once): Social-R1's references (prepare/references.py), EmoLLM's ARG rows
(prepare/emollm_rows.py), the content RM's pairs (reward_models/content_rm.py pairs) and CARE's
rubric targets and win rate (reward_models/rubric_generator.py).

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

from config import atomic_write_text, open_log, print0, read_log
from http_client import JudgeCall, JudgeConfig, JudgeError, ask, probe


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
    endpoint: str = "teacher",
) -> dict[str, Any]:
    """Ask each (key, call, parser) not yet in `done`, appending every answer (parsed; None when
    malformed) to `journal` as it arrives. The first call goes alone (http_client.probe): a server
    that never answers or refuses this kind of request stops the preparation there (JudgeError
    naming the config key `endpoint` and the server's reason) before the rest is sent; the others go
    in concurrent chunks. Failed calls are not journaled: a rerun asks them again. Returns the
    counts (asked, failures, malformed) and `errors`, the failed calls' reasons; the first is
    printed in full as it happens."""
    journal = Path(journal)
    todo = [r for r in requests if r[0] not in done]
    counts = {"asked": len(todo), "failures": 0, "malformed": 0, "errors": []}
    if not todo:
        return counts
    (key, call, parse), rest = todo[0], todo[1:]
    first = parse(probe(call, cfg, endpoint))
    counts["malformed"] += first is None
    done[key] = first
    chunk = max(1, cfg.concurrency) * 4
    with open_log(journal) as f:
        f.write(json.dumps({"key": key, "value": first}, ensure_ascii=False) + "\n")
        for start in range(0, len(rest), chunk):
            part = rest[start : start + chunk]
            values, stats = ask([(call, parse) for _, call, parse in part], cfg)
            counts["failures"] += stats["failures"]
            counts["malformed"] += stats["malformed"]
            reasons = [stats["errors"][i] for i in sorted(stats["errors"])]
            if reasons and not counts["errors"]:
                print0(f"{journal.name}: a call to '{endpoint}' failed: {reasons[0]}")
            counts["errors"] += reasons
            lines = []
            for i, ((key, _, _), value) in enumerate(zip(part, values)):
                if i not in stats["errors"]:
                    done[key] = value
                    lines.append(
                        json.dumps({"key": key, "value": value}, ensure_ascii=False) + "\n"
                    )
            f.write("".join(lines))
            f.flush()
            print0(
                f"{journal.name}: {1 + min(start + chunk, len(rest))}/{len(todo)} calls answered "
                f"or failed"
            )
    return counts


def failed_calls(errors: list[str], journal, who: str = "teacher") -> str:
    """The end of the line that stops a preparation whose teacher (`who`) calls failed: how many,
    the first reason (cut: ask_journaled printed it whole), where the answers so far are."""
    first = errors[0] if len(errors[0]) <= 120 else errors[0][:117] + "..."
    return (
        f"{len(errors)} {who} calls failed, the first: {first}; rerun the same command to ask "
        f"the rest (the answers so far: {Path(journal).name}, kept)"
    )


def write_rows(path, lines: list[str], errors: list[str], journal) -> None:
    """The one ending of a preparation that writes rows (JSON lines): nothing is written when no
    row was kept (JudgeError: a preparation that kept nothing is no success); a file holding more
    rows is not replaced while teacher calls failed (refuse_shrinking); else the rows are written,
    and failed calls then raise JudgeError (exit non-zero), the kept rows on disk, the rerun asking
    only what failed."""
    if not lines:
        raise JudgeError(
            f"{path}: not written: no row was kept"
            + (f"; {failed_calls(errors, journal)}" if errors else " (the counts above say why)")
        )
    refuse_shrinking(path, len(lines), errors, journal)
    atomic_write_text(path, "".join(lines))
    if errors:
        raise JudgeError(f"{path}: {len(lines)} rows written, but {failed_calls(errors, journal)}")


def refuse_shrinking(path, rows: int, errors: list[str], journal) -> None:
    """Stop (JudgeError) before a preparation whose teacher calls failed replaces `path` with fewer
    than the rows it holds: the file is kept and a rerun, once the teacher answers, asks only for
    what failed."""
    path = Path(path)
    if not errors or not path.is_file():
        return
    with path.open("rb") as f:
        held = sum(1 for line in f if line.strip())
    if rows < held:
        raise JudgeError(
            f"{path}: kept as it was ({held} rows): this run has only {rows}; "
            f"{failed_calls(errors, journal)}"
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
