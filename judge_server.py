"""A small OpenAI-compatible judge server (`/v1/models`, `/v1/chat/completions`) on the standard
library's HTTP server, loopback by default, for offline runs, tests and benchmarks:

    python judge_server.py --backend rules --port 8000
    python judge_server.py --backend model --model PATH --port 8000

Backend `rules` is a CRUDE LEXICAL STAND-IN, not a judge: it answers the IU_G and cause prompts of
judge.py deterministically from word overlap and quotation matching, and refuses anything else.
Backend `model` answers every prompt with model.py's `generate` from a checkpoint (a self-hosted
judge without vLLM). Latency, HTTP errors, hangs, dropped connections and malformed answers can be
injected to exercise the client's retries.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import verifier
from data import split_blocks
from judge import CAUSE_SYSTEM, IU_SYSTEM, SECTION_TAGS

log = logging.getLogger("judge_server")
# ----------------------------------------------------------------------------- the local server: backends

class UnsupportedRequest(ValueError):
    """A request this backend cannot answer; the server replies HTTP 400 with this message."""


_SECTION_RE = re.compile(r"<(" + "|".join(SECTION_TAGS) + r")((?: \w+=\"[^\"]*\")*)>\n(.*?)\n</\1>", re.DOTALL)
_STOPWORDS = frozenset("""about also because been being both could does doing done each from have having here into
just more most much only other over same should some such than that their them then there these they this those
very what when where which while will with would your""".split())
RULES_MIN_NEW_WORDS = 3


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _content_words(text: str) -> set[str]:
    """Lower-cased words of four or more letters (minus common function words), and single CJK characters."""
    words = re.findall(r"[^\W\d_]{4,}|[\u3040-\u30ff\u3400-\u9fff]", text.lower())
    return {w for w in words if w not in _STOPWORDS}


def _utterances(conversation: str) -> list[str]:
    """The lines of a rendered conversation, each without its `Speaker: ` prefix (crudely: the text
    after the first ': ', if any)."""
    texts = []
    for line in conversation.splitlines():
        speaker, colon, text = line.strip().partition(": ")
        texts.append(text if colon else speaker)
    return texts


def _rules_iu(sections: list[tuple[str, str]]) -> str:
    utterances = _utterances(next(text for tag, text in sections if tag == "conversation"))
    seen: set[str] = set()
    lines = []
    for j, block in enumerate((text for tag, text in sections if tag == "block"), 1):
        quotes = verifier.extract_quotes(block)
        words = _content_words(verifier.without_quotes(block))
        new_words = words - seen
        seen |= words
        if not quotes:
            reason, gain = "no quotation", False
        elif not all(verifier.verify_quote(q, utterances) for q in quotes):
            reason, gain = "a quotation does not verify against the conversation", False
        elif len(new_words) < RULES_MIN_NEW_WORDS:
            reason, gain = f"verified quotation but only {len(new_words)} new content words", False
        else:
            reason, gain = f"verified quotation and {len(new_words)} new content words", True
        lines.append(f"{j}: {reason} | {'GAIN' if gain else 'NO_GAIN'}")
    return "\n".join(lines)


def _rules_cause(sections: list[tuple[str, str]]) -> str:
    parts = dict(sections)
    k = int(parts["turn_to_assess"].strip("[] \n"))
    numbered = re.split(r"^\[(\d+)\] (?:\(TARGET\) )?", parts["conversation"], flags=re.MULTILINE)
    turns = {int(n): text.partition(": ")[2] for n, text in zip(numbered[1::2], numbered[2::2])}
    order, answers = sorted(turns), [_norm(a) for a in parts["answer"].split(",") if a.strip()]
    texts = [turns[n] for n in order]
    for block in split_blocks(parts["reasoning"]):
        quotes_turn = k in turns and any(order.index(k) in verifier.locate_quote(q, texts)
                                         for q in verifier.extract_quotes(block))
        if quotes_turn and any(a in _norm(block) for a in answers):
            return f"Quotes turn [{k}] in a passage naming the concluded emotion | YES"
    return f"No passage both quotes turn [{k}] and names the concluded emotion | NO"


def rules_backend(messages: list[dict[str, str]], params: dict[str, Any]) -> str:
    """A crude lexical stand-in for a judge model, for offline runs, tests and benchmarks; it reads
    our own IU_G and cause prompts and answers them deterministically in the judges' formats:
    - IU_G: a block is GAIN when it has a quotation, every quotation verifies (verifier.py) against
      the conversation's lines, and its prose outside quotations brings at least RULES_MIN_NEW_WORDS
      content words not seen in earlier blocks;
    - cause: YES when one reasoning paragraph both quotes the assessed turn (a quotation the verifier
      locates there) and names the concluded emotion.
    It understands nothing: it is not a judge, only a deterministic answer in the right format."""
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
    sections = [(m.group(1), m.group(3)) for m in _SECTION_RE.finditer(messages[-1]["content"])] if messages else []
    answer = {IU_SYSTEM: _rules_iu, CAUSE_SYSTEM: _rules_cause}.get(system)
    if answer is None:
        raise UnsupportedRequest("the rules backend answers only the IU_G and cause judges of judge.py")
    try:
        return answer(sections)
    except (StopIteration, KeyError, ValueError):
        raise UnsupportedRequest("a judge.py IU_G or cause prompt with a section missing or malformed") from None


MAX_NEW_TOKENS = 32768  # the most new tokens the model backend generates for one request
_ROLES = ("system", "user", "assistant")
# Request fields the model backend reads: (default, test, what the field must be).
_SAMPLING_FIELDS = {
    "max_tokens": (1024, lambda v: type(v) is int and 1 <= v <= MAX_NEW_TOKENS, f"an integer in 1..{MAX_NEW_TOKENS}"),
    "temperature": (1.0, lambda v: type(v) in (int, float) and 0 <= v < math.inf, "a number >= 0"),
    "top_p": (1.0, lambda v: type(v) in (int, float) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (0, lambda v: type(v) is int, "an integer (0 or less: no top-k)"),
    "seed": (None, lambda v: v is None or type(v) is int, "an integer"),
}


def sampling_settings(request: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields of a chat request, defaults filled in (null means the default); a bad one
    raises UnsupportedRequest naming it, so the client gets HTTP 400 and does not retry."""
    settings = {}
    for key, (default, valid, expected) in _SAMPLING_FIELDS.items():
        value = default if request.get(key) is None else request[key]
        if not valid(value):
            raise UnsupportedRequest(f"field '{key}' must be {expected}, got {value!r}")
        settings[key] = value
    return settings


class ModelBackend:
    """Answers with model.py's `generate` from a Hugging Face checkpoint folder: a self-hosted judge
    without vLLM. Requests are generated one at a time (a lock), with the request's sampling."""

    def __init__(self, path: str, device: str | None = None):
        import model as qwen  # lazy: only this backend needs torch

        self._generate = qwen.generate
        self.model = qwen.Qwen.from_pretrained(path, device=device)
        self.tok = qwen.load_tokenizer(path)
        self.lock = threading.Lock()

    def __call__(self, messages: list[dict[str, str]], params: dict[str, Any]) -> str:
        settings = sampling_settings(params)
        if roles := [m["role"] for m in messages if m["role"] not in _ROLES]:
            raise UnsupportedRequest(f"unknown role {roles[0]!r} (known: {', '.join(_ROLES)})")
        thinking = (params.get("chat_template_kwargs") or {}).get("enable_thinking")
        if self.tok.family == "qwen2":  # no thinking switch in its template, as vLLM ignores it there
            thinking = None
        eos = tuple(self.tok.eos_token_ids)
        with self.lock:
            new_tokens = self._generate(
                self.model, [self.tok.chat_ids(messages, enable_thinking=thinking)],
                max_new_tokens=settings["max_tokens"], temperature=float(settings["temperature"]),
                top_p=float(settings["top_p"]), top_k=max(0, settings["top_k"]), eos_token_ids=eos,
                seed=settings["seed"])[0]
        return self.tok.decode([t for t in new_tokens if t not in eos])


# ----------------------------------------------------------------------------- the local server: HTTP

FAULT_ACTIONS = ("ok", "500", "503", "429", "hang", "drop", "malformed")


@dataclass
class Faults:
    """What the server does to requests, for tests and benchmarks. The first len(script) chat
    requests, in arrival order, get the scripted actions; later ones fail with HTTP 503 at
    `fail_rate` (seeded). Actions: ok; 500 / 503 / 429 (an error answer, with Retry-After when
    `retry_after` is set); hang (answer only after `hang` seconds); drop (close the connection
    without answering); malformed (a well-formed completion whose text is not in any judge format)."""

    latency: float = 0.0  # seconds before every chat answer
    fail_rate: float = 0.0
    script: tuple[str, ...] = ()
    retry_after: float | None = None
    hang: float = 30.0
    seed: int = 0


class JudgeServer(ThreadingHTTPServer):
    """A small OpenAI-compatible server: GET /v1/models, POST /v1/chat/completions, one thread per
    connection, keep-alive; a connection that sends nothing for `idle_timeout` seconds is closed,
    so half-sent requests cannot hold threads. Loopback by default. `with JudgeServer(...).start()
    as server:` serves from a background thread until the block ends."""

    daemon_threads = True

    def __init__(self, backend: Callable[[list[dict[str, str]], dict[str, Any]], str], *, host: str = "127.0.0.1",
                 port: int = 0, faults: Faults | None = None, model_name: str = "rules",
                 api_key: str | None = None, verbose: bool = False, idle_timeout: float = 60.0):
        self.backend, self.faults, self.model_name = backend, faults or Faults(), model_name
        self.api_key, self.verbose, self.idle_timeout = api_key, verbose, idle_timeout
        self.requests_seen = 0
        self.stopping = threading.Event()
        self._lock, self._rng = threading.Lock(), random.Random(self.faults.seed)
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"

    def next_action(self) -> str:
        with self._lock:
            index, self.requests_seen = self.requests_seen, self.requests_seen + 1
            if index < len(self.faults.script):
                return self.faults.script[index]
            return "503" if self._rng.random() < self.faults.fail_rate else "ok"

    def start(self) -> JudgeServer:
        self._thread = threading.Thread(target=self.serve_forever, args=(0.05,), name="judge-server", daemon=True)
        self._thread.start()
        return self

    def process_request(self, request, client_address) -> None:
        with self._lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        with self._lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def stop(self) -> None:
        """Stop serving and end every open connection, so no handler thread outlives the server."""
        self.stopping.set()
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
        self.server_close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> JudgeServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):  # a client gone quiet or away
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms delayed-ACK stall
    server: JudgeServer

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout
        super().setup()

    def log_message(self, format, *args) -> None:
        if self.server.verbose:
            log.info("%s %s", self.address_string(), format % args)

    def _send_json(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._send_json(status, {"error": {"message": message, "type": kind, "code": status}}, headers)

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/models":
            self._send_json(200, {"object": "list", "data": [
                {"id": self.server.model_name, "object": "model", "owned_by": "clue-mini"}]})
        else:
            self._error(404, f"no route for GET {self.path}")

    def do_POST(self) -> None:
        length = self.headers.get("Content-Length", "0")
        if "Transfer-Encoding" in self.headers or not re.fullmatch(r"[0-9]{1,18}", length):
            self.close_connection = True
            return self._error(400, f"expected a body with a Content-Length of 0 or more bytes, got {length[:40]!r}")
        if int(length) > 64 * 2 ** 20:
            self.close_connection = True
            return self._error(413, "request body over 64 MiB")
        body = self.rfile.read(int(length))
        if self.path.rstrip("/") != "/v1/chat/completions":
            return self._error(404, f"no route for POST {self.path}")
        server = self.server
        if server.api_key is not None and self.headers.get("Authorization") != f"Bearer {server.api_key}":
            # Like hosted APIs that echo the key they rejected: clients must keep it out of their errors.
            presented = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
            return self._error(401, f"Incorrect API key provided: {presented}")
        action = server.next_action()
        server.stopping.wait(server.faults.latency)
        if action == "drop":
            self.close_connection = True
            return
        if action in ("500", "503", "429"):
            retry = {} if server.faults.retry_after is None else {"Retry-After": f"{server.faults.retry_after:g}"}
            return self._error(int(action), f"injected HTTP {action}", retry if action != "500" else None)
        if action == "hang":
            server.stopping.wait(server.faults.hang)
        try:
            request = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, or nested too deeply to parse
            request = None
        messages = request.get("messages") if isinstance(request, dict) else None
        if not isinstance(messages, list) or request.get("stream") or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            return self._error(400, "expected a JSON chat request {model, messages: [{role, content}], ...}, "
                                    "without streaming")
        try:
            text = "I am not sure; both readings seem possible." if action == "malformed" else \
                server.backend(messages, request)
        except UnsupportedRequest as e:
            return self._error(400, str(e))
        except Exception as e:  # the backend failed on this request: answer 500 (clients retry), keep serving
            log.exception("judge server: backend error")
            return self._error(500, f"backend error: {type(e).__name__}")
        self._send_json(200, {
            "id": f"chatcmpl-{time.time_ns()}", "object": "chat.completion", "created": int(time.time()),
            "model": server.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]})


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="judge_server.py",
        description="A small OpenAI-compatible judge server (/v1/models, /v1/chat/completions; loopback by default). "
                    "Backend 'rules' is a CRUDE LEXICAL STAND-IN, not a judge: it answers the IU_G and cause prompts "
                    "deterministically from word overlap and quotation matching, for offline runs, tests and "
                    "benchmarks. Backend 'model' answers with model.py's generate from a checkpoint.")
    parser.add_argument("--backend", choices=("rules", "model"), required=True,
                       help="rules: crude lexical stand-in (IU_G and cause only); model: generate with --model")
    parser.add_argument("--model", metavar="PATH", help="Hugging Face checkpoint folder (backend 'model')")
    parser.add_argument("--device", help="torch device for backend 'model' (default: cpu)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    parser.add_argument("--api-key-env", metavar="NAME", help="require the key held in this environment variable")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added before every chat answer")
    parser.add_argument("--fail-rate", type=float, default=0.0, help="fraction of chat requests answered HTTP 503")
    parser.add_argument("--script", default="",
                       help=f"actions for the first requests, comma-separated: {', '.join(FAULT_ACTIONS)}")
    parser.add_argument("--retry-after", type=float, help="Retry-After seconds sent with injected 429 and 503")
    parser.add_argument("--hang", type=float, default=30.0, help="seconds a 'hang' action waits before answering")
    parser.add_argument("--seed", type=int, default=0, help="seed of the injected failures")
    parser.add_argument("--verbose", action="store_true", help="log every request (never its headers)")
    args = parser.parse_args(argv)
    script = tuple(a for a in args.script.split(",") if a)
    if unknown := [a for a in script if a not in FAULT_ACTIONS]:
        parser.error(f"--script: unknown action(s) {unknown}; known: {', '.join(FAULT_ACTIONS)}")
    if args.backend == "model" and not args.model:
        parser.error("--backend model needs --model PATH")
    api_key = os.environ.get(args.api_key_env, "").strip() if args.api_key_env else None
    if args.api_key_env and not api_key:
        parser.error(f"--api-key-env: {args.api_key_env} is not set")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        backend = rules_backend if args.backend == "rules" else ModelBackend(args.model, args.device)
    except (OSError, ValueError, RuntimeError) as e:  # no such folder, not a checkpoint, no such device
        parser.exit(1, f"judge_server.py: error: --model {args.model}: {' '.join(str(e).split())}\n")
    faults = Faults(args.latency, args.fail_rate, script, args.retry_after, args.hang, args.seed)
    name = "rules" if args.backend == "rules" else os.path.basename(os.path.normpath(args.model))
    try:
        server = JudgeServer(backend, host=args.host, port=args.port, faults=faults, model_name=name, api_key=api_key)
    except OSError as e:  # the port is taken, the host unknown or not ours
        parser.exit(1, f"judge_server.py: error: cannot listen on {args.host}:{args.port}: {e.strerror or e}\n")
    print(f"judge_server.py: backend {args.backend} at {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
