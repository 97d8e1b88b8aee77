"""Hostile inputs and bounded resources at the HTTP edges and in the verifier: the judge client's
key handling, deadlines and size cap, the local judge server's answers to malformed requests and
its command line, and the verifier's work per quotation (time and memory)."""

import base64
import gzip
import http.client
import json
import logging
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
from instruments import free_port

import http_client
import verifier
from http_client import JudgeCall, JudgeConfig, JudgeError
from judge_server import Faults, JudgeServer, ModelBackend, UnsupportedRequest, sampling_settings
from tokenizer import CheckpointError

REPO = Path(__file__).resolve().parents[1]
SECRET = "sk-test-Zq8LmR2vXc7Tn4Wp"
MESSAGES = [{"role": "user", "content": "x"}]


def echo_backend(messages, params):
    return "echo: " + messages[-1]["content"]


@contextmanager
def serving(backend=echo_backend, **kwargs):
    with JudgeServer(backend, host="127.0.0.1", port=0, **kwargs).start() as server:
        yield server


def config(url, **overrides) -> JudgeConfig:
    return JudgeConfig(
        **{**dict(base_url=url, model="m", timeout=2.0, retries=1, backoff=0.01), **overrides}
    )


def shows_secret(text: str, secret: str = SECRET) -> bool:
    return any(secret[i : i + 6] in text for i in range(len(secret) - 5))


@contextmanager
def raw_server(respond):
    """A TCP server on loopback whose `respond(connection)` writes any bytes it likes, once the
    request has arrived; yields the base URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            with connection:
                try:
                    connection.recv(1 << 16)
                    respond(connection, stop)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def completion_body(text: str) -> bytes:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()


# ----------------------------------------------------------------------------- the judge client


def test_key_whitespace_is_stripped_and_control_characters_are_refused_unshown(monkeypatch):
    with serving(api_key=SECRET) as server:
        monkeypatch.setenv("JUDGE_KEY", SECRET + "\r\n")  # as read from a file written on Windows
        texts, stats = http_client.chat_many(
            [JudgeCall(MESSAGES, 8)], config(server.url, api_key_env="JUDGE_KEY")
        )
        assert texts == ["echo: x"] and stats["failures"] == 0
        assert (
            http_client.chat(MESSAGES, base_url=server.url, model="m", api_key=f" {SECRET}\n")
            == "echo: x"
        )
    for bad in (
        SECRET[:9] + "\n" + SECRET[9:],
        SECRET + "\x1b",
        SECRET[:9] + "\u00e9" + SECRET[9:],
    ):
        monkeypatch.setenv("JUDGE_KEY", bad)
        with pytest.raises(
            JudgeError,
            match=r"^judge: the API key in the environment variable JUDGE_KEY has control "
            r"or non-ASCII characters \(not shown\)$",
        ):
            config("http://127.0.0.1:9/v1", api_key_env="JUDGE_KEY").read_api_key()
        with pytest.raises(JudgeError) as e:
            http_client.chat(MESSAGES, base_url="http://127.0.0.1:9/v1", model="m", api_key=bad)
        assert not shows_secret(str(e.value)) and "api_key" in str(e.value)


def test_chat_many_turns_any_exception_into_a_failed_call_with_a_scrubbed_reason(monkeypatch):
    def broken_post(*args, **kwargs):
        # what requests says of a bad key
        raise ValueError(f"Invalid header value b'Bearer {SECRET}\\n'")

    monkeypatch.setattr(http_client._SESSION, "post", broken_post)
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    cfg = config("http://127.0.0.1:9/v1", api_key_env="JUDGE_KEY")
    texts, stats = http_client.chat_many([JudgeCall(MESSAGES, 8)] * 3, cfg)
    assert texts == [None] * 3 and stats["failures"] == 3
    assert stats["errors"][0].startswith("ValueError: Invalid header value") and not shows_secret(
        json.dumps(stats)
    )


def test_retry_after_of_zero_or_a_past_date_waits_the_backoff():
    with serving(faults=Faults(script=("429", "503", "ok"), retry_after=0)) as server:
        start = time.perf_counter()
        texts, _ = http_client.chat_many(
            [JudgeCall(MESSAGES, 8)], config(server.url, retries=2, backoff=0.2)
        )
        elapsed = time.perf_counter() - start
    # Backoff waits are uniform in [d/2, d] for d = 0.2 and
    # 0.4: at least 0.3 s, where Retry-After 0 asked none.
    assert texts == ["echo: x"] and elapsed >= 0.3
    response = requests.Response()
    response.headers["Retry-After"] = "Wed, 21 Oct 2015 07:28:00 GMT"
    assert http_client._retry_after(response) == 0.0  # a past date: then the backoff decides


def test_a_server_trickling_bytes_cannot_hold_a_call():
    def trickle(connection, stop):
        connection.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
        )
        # one byte every 50 ms: the 0.5 s timeout between bytes never fires
        while not stop.wait(0.05):
            connection.sendall(b" ")

    with raw_server(trickle) as url:
        start = time.perf_counter()
        with pytest.raises(JudgeError, match="Timeout.*still failing after 2 attempts"):
            http_client.chat(
                MESSAGES, base_url=url, model="m", timeout=0.5, retries=1, backoff=0.01
            )
        elapsed = time.perf_counter() - start
    # two attempts of about 0.5 s each; without a deadline, 100,000 bytes take 5,000 s
    assert elapsed < 4.0


def test_answers_are_size_capped_and_gzip_is_decoded(monkeypatch):
    monkeypatch.setattr(http_client, "MAX_ANSWER_BYTES", 4096)
    with serving() as server:
        assert http_client.chat(MESSAGES, base_url=server.url, model="m") == "echo: x"
        with pytest.raises(JudgeError, match="an answer over 4096 bytes") as e:
            http_client.chat(
                [{"role": "user", "content": "y" * 10_000}], base_url=server.url, model="m"
            )
        assert e.value.retries == 0

    def gzipped(connection, stop):
        body = gzip.compress(completion_body("unzipped"))
        connection.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )

    with raw_server(gzipped) as url:
        assert http_client.chat(MESSAGES, base_url=url, model="m") == "unzipped"


def test_a_key_inside_the_url_is_never_shown(caplog):
    caplog.set_level(logging.DEBUG)
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now: connection refused
    outputs = []
    with pytest.raises(JudgeError) as e:
        http_client.chat(
            MESSAGES,
            base_url=f"http://alice:{SECRET}@127.0.0.1:{port}/v1",
            model="m",
            retries=1,
            backoff=0.01,
        )
    outputs.append(str(e.value))
    # echoes the Basic credentials it got
    with serving(api_key="the-server-expects-another-key") as server:
        url = server.url.replace("http://", f"http://alice:{SECRET}@")
        with pytest.raises(JudgeError, match="HTTP 401") as e:
            http_client.chat(MESSAGES, base_url=url, model="m")
        outputs.append(str(e.value))
        with pytest.raises(http_client.JudgeAuthError) as e:  # a refused key stops a batch
            http_client.chat_many([JudgeCall(MESSAGES, 8)], config(url))
        outputs.append(str(e.value))
    assert f"127.0.0.1:{port}" in outputs[0] and "Connection" in outputs[0]
    basic = base64.b64encode(f"alice:{SECRET}".encode()).decode()
    for output in outputs + [caplog.text]:
        assert (
            not shows_secret(output) and "alice" not in output and not shows_secret(output, basic)
        ), output


# ----------------------------------------------------------------------------- the judge server


def post_raw(url: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, str]:
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    connection.putrequest("POST", "/v1/chat/completions", skip_accept_encoding=True)
    for name, value in headers.items():
        connection.putheader(name, value)
    connection.endheaders(body)
    response = connection.getresponse()
    status, text = response.status, response.read().decode()
    connection.close()
    return status, text


def test_server_answers_malformed_requests_with_400_and_keeps_serving():
    with serving() as server:
        for length in ("-1", "abc", "1e3", "99999999999999999999"):
            status, text = post_raw(server.url, {"Content-Length": length})
            assert status == 400 and "Content-Length" in text
        assert (
            post_raw(server.url, {"Transfer-Encoding": "chunked"}, b"2\r\n{}\r\n0\r\n\r\n")[0]
            == 400
        )
        deep = b"[" * 100_000 + b"]" * 100_000
        assert (
            requests.post(server.url + "/chat/completions", data=deep, timeout=5).status_code == 400
        )
        assert http_client.chat(MESSAGES, base_url=server.url, model="m") == "echo: x"


BAD_SAMPLING = [
    ({"max_tokens": -1}, "field 'max_tokens' must be an integer in 1..32768, got -1"),
    ({"max_tokens": 10**9}, "field 'max_tokens' must be an integer in 1..32768, got 1000000000"),
    ({"temperature": -0.5}, "field 'temperature' must be a number >= 0, got -0.5"),
    ({"top_p": 0}, "field 'top_p' must be a number in (0, 1], got 0"),
    ({"seed": 1.5}, "field 'seed' must be an integer, got 1.5"),
    ({"seed": "7"}, "field 'seed' must be an integer, got '7'"),
]


def test_model_backend_answers_client_errors_with_400_and_the_reason():
    assert sampling_settings({"temperature": 0, "top_k": -1, "seed": None}) == {
        "max_tokens": 1024,
        "temperature": 0,
        "top_p": 1.0,
        "top_k": -1,
        "seed": None,
    }
    backend = ModelBackend.__new__(ModelBackend)  # requests are checked before the model is touched
    with serving(backend) as server:
        for fields, reason in BAD_SAMPLING + [
            (
                {"messages": [{"role": "tool", "content": "x"}]},
                "unknown role 'tool' (known: system, user, assistant)",
            )
        ]:
            body = {"model": "m", "messages": MESSAGES, **fields}
            response = requests.post(server.url + "/chat/completions", json=body, timeout=5)
            assert response.status_code == 400 and response.json()["error"]["message"] == reason
        assert server.requests_seen == len(BAD_SAMPLING) + 1
    with pytest.raises(UnsupportedRequest):
        backend([{"role": "user", "content": "x"}], {"top_p": 1.5})


def test_half_sent_requests_are_dropped_after_the_idle_timeout(capfd):
    with serving(idle_timeout=0.3) as server:
        host, port = server.server_address[:2]
        for partial in (
            b'POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"mo',
            b"POST /v1/chat/comp",
        ):
            with socket.create_connection((host, port), timeout=5) as connection:
                connection.sendall(partial)
                start = time.perf_counter()
                # the server closes the connection, with or without an answer
                while connection.recv(1024):
                    pass
                assert time.perf_counter() - start < 3
        assert http_client.chat(MESSAGES, base_url=server.url, model="m") == "echo: x"
    assert "Traceback" not in capfd.readouterr().err


def test_server_command_errors_are_one_line(tmp_path):
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    cases = [
        (["--port", str(port)], f"cannot listen on 127.0.0.1:{port}: Address already in use"),
        (["--host", "no-such-host.invalid"], "cannot listen on no-such-host.invalid:8000: "),
        (
            ["--backend", "model", "--model", str(tmp_path / "absent")],
            f"--model {tmp_path / 'absent'}: {tmp_path / 'absent' / 'config.json'}: file not found",
        ),
    ]
    with taken:
        for args, message in cases:
            argv = [sys.executable, str(REPO / "judge_server.py"), "--backend", "rules", *args]
            result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1
            assert result.stderr.startswith(f"judge_server.py: error: {message}"), result.stderr


# ----------------------------------------------------------------------------- the verifier


def test_over_long_quotes_and_too_many_fragments_do_not_verify():
    words = [f"{a}{b}ro" for a in "bcdfghjklm" for b in "aeiou"]  # 50 distinct plain words
    conversation = [" ".join(words[:25]), " ".join(words[25:]), " ".join(words * 3)]
    longest = " ".join((words * 2)[: verifier.MAX_QUOTE_TOKENS])
    assert verifier.verify_quote(longest, conversation)
    # 101 tokens, copied exactly
    assert not verifier.verify_quote(longest + " " + words[0], conversation)
    assert not verifier.verify_quote("x" * (16 * verifier.MAX_QUOTE_TOKENS + 1), ["x" * 2000])
    pieces = [" ".join(words[i : i + 2]) for i in range(0, 40, 4)]
    assert verifier.verify_quote(" ... ".join(pieces[: verifier.MAX_FRAGMENTS]), conversation)
    assert not verifier.verify_quote(
        " ... ".join(pieces[: verifier.MAX_FRAGMENTS + 1]), conversation
    )


def test_verifier_worst_cases_are_bounded_in_time_and_memory():
    # bench/bench_verifier_bounds.py: hostile quotations against
    # 10,000-turn conversations, here under an address-space limit of 512
    # MiB (before the bounds, the worst ran out of memory or for minutes).
    limit = 512 * 2**20
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_verifier_bounds.py"), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report.pop("exact fragments in repetitive") is True and report.pop("peak_rss_mb") < 512
    for kind in ("natural", "repetitive"):
        index = report.pop(kind + " index")
        cases = {case: seconds for case, seconds in report.items() if case.startswith(kind)}
        assert len(cases) >= 3
        for case, seconds in cases.items():
            # Each costs less than indexing the conversation
            # once: a ratio, so a loaded machine does not matter.
            assert seconds < max(index, 0.05), (case, seconds, index)


def test_the_servers_log_never_carries_a_query_string_and_routes_ignore_it(caplog):
    caplog.set_level(logging.INFO, logger="judge_server")
    with serving(verbose=True) as server:
        host, port = server.server_address[:2]
        with socket.create_connection((host, port), timeout=5) as s:  # a malformed request line
            s.sendall(f"GET /v1/models?api_key={SECRET} HTTP/1.1 junk\r\n\r\n".encode())
            reply = b"".join(iter(lambda: s.recv(4096), b""))
            assert b"Error code: 400" in reply
        answer = requests.post(
            server.url + "/chat/completions?x=1&api_key=" + SECRET,
            json={"model": "m", "messages": MESSAGES},
            timeout=5,
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "echo: x"
    assert "status 400" in caplog.text and "POST /v1/chat/completions 200" in caplog.text
    assert not shows_secret(caplog.text) and "?" not in caplog.text


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_port_out_of_range_is_a_usage_error(port, capsys):
    import judge_server

    with pytest.raises(SystemExit) as stop:
        judge_server.main(["--backend", "rules", "--port", port])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and error.endswith(f"--port: a port from 0 to 65535, not {port}")


def test_a_broken_reward_model_folder_is_one_line(tmp_path, capsys):
    from reward_models import content_rm as reward_model

    (tmp_path / "reward_model.json").write_text('{"max_length": 64}')
    with pytest.raises(SystemExit) as stop:
        reward_model.main(["serve", "--model", str(tmp_path)])
    error = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "\n" not in error
    assert error.endswith("reward_model.json: field 'base_model': missing or not a str")
    head = tmp_path / "value_head.safetensors"
    head.write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{")  # a header cut short
    with pytest.raises(CheckpointError, match="unreadable safetensors file"):
        reward_model.RewardModel.load_head(None, head)  # fails at the file, before the model


EXAMPLE = {
    "id": "a",
    "task": "tom_mc",
    "turns": [{"speaker": "", "text": "s"}],
    "target": None,
    "labels": ["B"],
    "meta": {"question": "q", "options": ["x", "y"]},
}
ESCONV = REPO / "tests" / "fixtures" / "emollm" / "esconv.json"
DEAD = "http://127.0.0.1:9/v1"  # nothing listens there


@pytest.mark.parametrize(
    "script, config, argv, expected",
    [
        (
            "reward_models.rubric_generator targets",
            "targets: {{turns: {tmp}/ex.jsonl, out: {tmp}}}\n",
            [],
            "'targets.out': {tmp} is a folder; name the file to write",
        ),
        (
            "reward_models.rubric_generator targets",
            "targets: {{turns: {tmp}/ex.jsonl, out: {tmp}/t.jsonl, journal: {tmp}}}\n",
            [],
            "'targets.journal': {tmp} is a folder; name the file to write",
        ),
        (
            "reward_models.rubric_generator examples",
            "rl: {{pairs: {tmp}/ex.jsonl, out: {tmp}}}\n",
            [],
            "'rl.out': {tmp} is a folder; name the file to write",
        ),
        (
            "reward_models.rubric_generator care_winrate",
            "winrate: {{pairs: {tmp}/ex.jsonl, output_dir: {tmp}/ex.jsonl}}\n",
            [],
            "'winrate.output_dir': {tmp}/ex.jsonl/winrate.json cannot be written",
        ),
        (
            "reward_models.content_rm pairs",
            "model: m\npairs: p\nbuild:\n  examples: {tmp}/ex.jsonl\n  out: {tmp}/pairs.jsonl\n"
            "  rollouts: [{{step: 1, path: {tmp}/ids.jsonl}}]\n",
            [],
            "ids.jsonl:1: field 'id': ['a'] is not an example of",
        ),
        (
            "reward_models.content_rm pairs",
            "model: m\npairs: p\nbuild:\n  examples: {tmp}/ex.jsonl\n  out: {tmp}\n",
            [],
            "'build.out': {tmp} is a folder; name the file to write",
        ),
        (  # an evaluation stopped before it sampled: no rollouts, not a checkpoint without any
            "reward_models.content_rm pairs",
            "model: m\npairs: p\nbuild:\n  examples: {tmp}/ex.jsonl\n  out: {tmp}/pairs.jsonl\n"
            "  rollouts: [{{step: 10, path: {tmp}/good.jsonl}},\n"
            "             {{step: 30, path: {tmp}/empty.jsonl}}]\n",
            [],
            "empty.jsonl: no completion (step 30's evaluation not run, or stopped before it",
        ),
        (
            "prepare.references",
            "out: {tmp}/train.jsonl\n",
            [],
            "c.yaml: missing required key 'examples'",
        ),
        (
            "prepare.references",
            "examples: {tmp}/absent.jsonl\nout: {tmp}/train.jsonl\n",
            [],
            "absent.jsonl: no such data file",
        ),
        (
            "prepare.emollm_rows",
            f"out: {{tmp}}/arg.jsonl\nobjective: target\nmodel: m\n"
            f"dialogues: [{ESCONV}, {ESCONV}]\nteacher: {{{{base_url: '{DEAD}'}}}}\n",
            [],
            "esconv.json:2: field 'id': 'esconv-0' appears twice",
        ),
        (
            "prepare.emollm_rows",
            f"out: {{tmp}}/arg.jsonl\nobjective: target\nmodel: m\ndialogues: [{ESCONV}]\n",
            ["share=0"],
            "override 'share=0': 'share' must be > 0 and <= 1, got 0",
        ),
    ],
)
def test_entry_points_stop_on_bad_input_in_one_line(
    tmp_path, capsys, script, config, argv, expected
):
    import importlib

    (tmp_path / "ex.jsonl").write_text(json.dumps(EXAMPLE) + "\n")
    (tmp_path / "ids.jsonl").write_text(json.dumps({"id": ["a"], "completion": "x"}) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    good = {"id": "a", "completion": "Bo wants the car.\n</think>\nAnswer: B"}
    (tmp_path / "good.jsonl").write_text(json.dumps(good) + "\n")
    path = tmp_path / "c.yaml"
    path.write_text(config.format(tmp=tmp_path))
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SystemExit) as stop:
        module, *command = script.split()
        importlib.import_module(module).main([*command, str(path), *argv])
    error = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "\n" not in error and len(error) <= 400, error
    assert expected.format(tmp=tmp_path) in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


# ------------------------------------------------ issue 48: the last wave's surfaces, under faults


def test_a_torn_last_record_cut_inside_a_character_is_ignored_like_any_torn_line(tmp_path):
    """A run killed while writing `é` leaves a last line that is not whole UTF-8: read_log ignores
    it (the file kept), as it ignores an unparsable one; open_log moves it aside."""
    from config import open_log, read_log

    journal = tmp_path / "roleplay.jsonl"
    whole = '{"key": "a", "value": "caf\\u00e9"}\n'.encode()
    journal.write_bytes(whole + '{"key": "b", "value": "caf'.encode() + "é".encode()[:1])
    assert read_log(journal) == [{"key": "a", "value": "café"}]
    with open_log(journal) as f:
        f.write('{"key": "c", "value": 1}\n')
    assert [r["key"] for r in read_log(journal)] == ["a", "c"]
    # an earlier line that is not UTF-8 is no torn line: one located error
    journal.write_bytes(b'{"key": "\xff"}\n' + whole)
    with pytest.raises(ValueError, match=rf"^{journal}:1: not UTF-8 text$"):
        read_log(journal)


def test_an_output_that_is_one_of_the_inputs_is_refused_before_any_work(tmp_path, capsys):
    """emollm_seeds with `out` naming its own dialogues file, prepare.traces with `out` its
    examples: one line naming both keys, the input unchanged, no teacher asked (none is there)."""
    from prepare import emollm_seeds, traces

    dialogues = tmp_path / "dialogues.jsonl"
    dialogues.write_text(ESCONV.read_text())
    before = dialogues.read_bytes()
    seeds = tmp_path / "seeds.yaml"
    seeds.write_text(
        f"dialogues: [{dialogues}]\nout: {dialogues}\nteacher: {{base_url: '{DEAD}'}}\n"
    )
    examples = tmp_path / "ex.jsonl"
    examples.write_text(json.dumps(EXAMPLE) + "\n")
    prep = tmp_path / "prep.yaml"
    prep.write_text(f"examples: {examples}\nout: {examples}\nmodel: m\n")
    for main, argv, path, key in (
        (emollm_seeds.main, [str(seeds)], dialogues, "dialogues"),
        (traces.main, [str(prep)], examples, "examples"),
    ):
        kept = path.read_bytes()
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and err == (
            f"error: 'out': {path} is also '{key}': name another file to write"
        ), err
        assert path.read_bytes() == kept
    assert dialogues.read_bytes() == before


def test_a_sinks_path_taken_by_a_file_stops_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """A `tensorboard` file of the user's in the output folder: one line when the config is read,
    before any model loads, the file kept (was a FileExistsError traceback after loading)."""
    pytest.importorskip("tensorboard")
    from helpers import grpo_checkpoint, run_config, write_examples

    import grpo

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(grpo.Qwen, "from_pretrained", no_load)
    assets = (grpo_checkpoint(tmp_path / "base"), write_examples(tmp_path / "train.jsonl"))
    config = run_config(tmp_path, assets, DEAD, report_to=["tensorboard"])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tensorboard").write_text("my notes")
    with pytest.raises(SystemExit) as stop:
        grpo.main([str(config)])
    err = capsys.readouterr().err.strip()
    assert (
        stop.value.code == 2
        and "\n" not in err
        and err.endswith(
            f"'report_to': tensorboard writes into {tmp_path / 'run' / 'tensorboard'}, a file "
            "there: move it or choose another output_dir"
        )
    ), err
    assert (tmp_path / "run" / "tensorboard").read_text() == "my notes"


def test_converter_lines_name_what_is_wrong(tmp_path):
    """A re-downloaded `order_0 (1).txt` beside Hi-ToM's files is named as a file whose name is not
    order_K.txt (was: the folder malformed); an EmoBench line in a language its questions are not
    written in names the field and the languages (was: "field 'fr': missing")."""
    from data import DataError
    from prepare.convert import convert_emobench, convert_hitom

    hitom = tmp_path / "hitom"
    shutil.copytree(REPO / "tests" / "fixtures" / "benchmarks" / "hitom", hitom)
    sample = hitom / "Hi-ToM_data" / "Tell" / "MC" / "length_1" / "sample_1"
    shutil.copy(sample / "order_0.txt", sample / "order_0 (1).txt")
    with pytest.raises(DataError) as error:
        convert_hitom(hitom)
    assert str(error.value) == (
        f"{sample / 'order_0 (1).txt'}: not a Hi-ToM story file name (order_K.txt, K the ToM "
        "order): a copy? rename or remove it"
    )
    emobench = tmp_path / "EA.jsonl"
    line = json.loads(
        (REPO / "tests/fixtures/benchmarks/emobench/data/EA.jsonl").read_text().splitlines()[0]
    )
    emobench.write_text(json.dumps(line | {"language": "fr"}) + "\n")
    with pytest.raises(DataError) as error:
        convert_emobench(emobench)
    assert str(error.value) == (
        f"{emobench}:1: field 'language': 'fr' is not a language EmoBench's questions are written "
        "in (en, zh)"
    )


FULL_DISK_APPEND = """
import resource, sys
sys.path.insert(0, sys.argv[2])
from config import open_log
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    with open_log(sys.argv[1]) as f:
        for _ in range(100):
            f.write('{"turn": "' + 'x' * 100 + '"}\\n')
            f.flush()
except OSError as e:
    print(e, file=sys.stderr)
"""


def test_a_disk_that_fills_while_a_journal_is_appended_to_names_the_journal(tmp_path):
    """What the EQBench3 play, the teacher journal and completions.jsonl append through (open_log):
    a write that fails for want of space names the file being written (the file-size limit stands
    in for a full disk: Python ignores SIGXFSZ, so the write fails with EFBIG)."""
    journal = tmp_path / "roleplay.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK_APPEND, str(journal), str(REPO)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stderr == f"[Errno 27] File too large: '{journal}'\n", done.stderr


def test_a_weight_reload_that_fails_names_the_setting_only_when_the_route_is_missing(tmp_path):
    """A full-parameter run's weight reload: a server without the route (404: started without
    VLLM_SERVER_DEV_MODE=1) gets the setting's hint; a server that is down gets its own reason,
    not that hint (was: the hint both times)."""
    from judge_server import JudgeServer, rules_backend
    from vllm_engine import EngineError, VLLMEngine, VLLMSettings, reload_failure

    def reload_error(url):
        engine = VLLMEngine(VLLMSettings(base_url=url, retries=0, backoff=0.01), "t", tmp_path)
        try:
            engine._post("/collective_rpc", {"method": "reload_weights"}, dict, at_root=True)
        except EngineError as e:
            return reload_failure(e, tmp_path / "weights")
        raise AssertionError("the reload was answered")

    with JudgeServer(rules_backend).start() as server:  # no /collective_rpc route: HTTP 404
        missing_route = reload_error(server.url)
    assert "HTTP 404" in missing_route and missing_route.endswith(
        "(a full-parameter run needs the server started with VLLM_SERVER_DEV_MODE=1)"
    )
    down = reload_error(f"http://127.0.0.1:{free_port()}/v1")
    assert "Connection refused" in down and "VLLM_SERVER_DEV_MODE" not in down, down
