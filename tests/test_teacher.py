"""teacher.py, the journaled, resumable teacher call of every data preparation, against the local
judge server (judge_server.JudgeServer, its requests counted there): a run where some calls fail
journals the answered ones, a rerun asks only the rest, a changed request is asked again, a torn
last journal line is ignored with the file left byte for byte as it was (until the next append cuts
it off); and the old `prepare` commands point to the scripts that replaced them."""

import json
from pathlib import Path

import pytest

import teacher
from http_client import JudgeCall, JudgeConfig, JudgeError
from judge_server import Faults, JudgeServer


class Echo:
    """Answers "answer to <the user message>"; records each message it was sent."""

    def __init__(self):
        self.seen = []

    def __call__(self, messages, params):
        self.seen.append(messages[-1]["content"])
        return "answer to " + messages[-1]["content"]


def requests(*texts: str) -> list[tuple[str, JudgeCall, callable]]:
    calls = [JudgeCall([{"role": "user", "content": t}], 8) for t in texts]
    return [(teacher.journal_key("echo", t), c, teacher.raw_text) for t, c in zip(texts, calls)]


def test_failed_calls_are_not_journaled_and_a_rerun_asks_only_them(tmp_path):
    backend, journal = Echo(), tmp_path / "journal.jsonl"
    faults = Faults(script=("ok", "503", "ok", "503"))  # the 2nd and 4th requests to arrive fail
    with JudgeServer(backend, faults=faults).start() as server:
        cfg = JudgeConfig(base_url=server.url, retries=0, concurrency=1)
        asks = requests("a", "b", "c", "d", "e")
        done = teacher.load_journal(journal)
        assert done == {} and not journal.exists()
        counts = teacher.ask_journaled(asks, cfg, journal, done)
        errors = counts.pop("errors")
        assert counts == {"asked": 5, "failures": 2, "malformed": 0} and server.requests_seen == 5
        assert len(errors) == 2 and all(
            f"{server.url}/chat/completions: HTTP 503" in e for e in errors
        )
        assert backend.seen == ["a", "c", "e"]  # a failed request never reaches the backend
        answered = {k: "answer to " + t for (k, _, _), t in zip(asks, "abcde") if t in "ace"}
        assert teacher.load_journal(journal) == answered == done
        assert len(journal.read_text().splitlines()) == 3

        rerun = teacher.load_journal(journal)
        counts = teacher.ask_journaled(asks, cfg, journal, rerun)
        assert counts == {"asked": 2, "failures": 0, "malformed": 0, "errors": []}
        assert server.requests_seen == 7
        assert backend.seen[3:] == ["b", "d"]
        assert rerun == teacher.load_journal(journal) and len(rerun) == 5

        before = journal.read_bytes()
        assert (
            teacher.ask_journaled(asks, cfg, journal, teacher.load_journal(journal))["asked"] == 0
        )
        # nothing asked, nothing written
        assert server.requests_seen == 7 and journal.read_bytes() == before


def test_a_parser_rejection_is_journaled_as_none_and_not_asked_again(tmp_path):
    journal = tmp_path / "journal.jsonl"
    with JudgeServer(Echo()).start() as server:
        cfg = JudgeConfig(base_url=server.url, retries=0)
        asks = [
            (k, c, lambda text: None if text.endswith("b") else text)
            for k, c, _ in requests("a", "b")
        ]
        assert teacher.ask_journaled(asks, cfg, journal, {})["malformed"] == 1
        done = teacher.load_journal(journal)
        assert list(done.values()) == ["answer to a", None]
        assert (
            teacher.ask_journaled(asks, cfg, journal, done)["asked"] == 0
            and server.requests_seen == 2
        )


def test_a_torn_last_line_is_ignored_and_the_file_left_as_it_is(tmp_path, capsys):
    backend, journal = Echo(), tmp_path / "journal.jsonl"
    with JudgeServer(backend).start() as server:
        cfg = JudgeConfig(base_url=server.url, retries=0, concurrency=1)
        asks = requests("a", "b", "c")
        teacher.ask_journaled(asks, cfg, journal, {})
        whole = journal.read_bytes()
        journal.write_bytes(whole[:-10])  # killed while writing the third record
        torn = journal.read_bytes()
        done = teacher.load_journal(journal)
        assert list(done.values()) == ["answer to a", "answer to b"]
        assert journal.read_bytes() == torn  # reading rewrote nothing

        changed = requests("a", "B", "c")  # a changed request is a new key: asked again
        counts = teacher.ask_journaled(changed, cfg, journal, done)
        assert (
            counts["asked"] == 2
            and backend.seen == ["a", "b", "c", "B", "c"]
            and server.requests_seen == 5
        )
        # the append said where it moved the torn line, kept whole there
        cut = torn[torn.rfind(b"\n") + 1 :]
        assert (
            f"moved a torn last line ({len(cut)} bytes) to {journal}.torn"
            in capsys.readouterr().err
        )
        assert Path(f"{journal}.torn").read_bytes() == cut + b"\n"
        assert journal.read_bytes().startswith(torn[: torn.rfind(b"\n") + 1])
        records = [json.loads(line) for line in journal.read_text().splitlines()]
        assert len(records) == 4 and teacher.load_journal(journal) == done


def test_a_file_that_is_not_a_journal_stops_with_its_line(tmp_path):
    journal = tmp_path / "journal.jsonl"
    journal.write_text('{"key": "k", "value": "v"}\n{"key": "1", "request": "ab", "answer": "x"}\n')
    with pytest.raises(JudgeError, match=r"journal.jsonl:2: not a journal record"):
        teacher.load_journal(journal)
    journal.write_text('{"key": "k", "value": "v"}\nnot json\n{"key": "k2", "value": "v"}\n')
    with pytest.raises(JudgeError, match=r"journal.jsonl:2: not valid JSON"):
        teacher.load_journal(journal)


def test_a_missing_teacher_key_names_the_teachers_setting(tmp_path, monkeypatch):
    """A preparation whose teacher key variable is unset: one line naming `teacher.api_key_env`
    (was: `judge.api_key_env`, another setting), before any request."""
    monkeypatch.delenv("TEACHER_TEST_KEY", raising=False)
    cfg = JudgeConfig(base_url="http://127.0.0.1:9/v1", api_key_env="TEACHER_TEST_KEY")
    with pytest.raises(teacher.JudgeError) as error:
        teacher.ask_journaled(requests("a"), cfg, tmp_path / "journal.jsonl", {}, "teacher")
    assert str(error.value) == (
        "'teacher.api_key_env': the environment variable TEACHER_TEST_KEY is not set"
    )
    assert not (tmp_path / "journal.jsonl").exists()
