"""A small OpenAI-compatible judge server (`/v1/models`, `/v1/chat/completions`) on the standard
library's HTTP server, loopback by default, for offline runs, tests and benchmarks:

    python judge_server.py --backend rules --port 8000
    python judge_server.py --backend model --model PATH --port 8000

Backend `rules` is a CRUDE LEXICAL STAND-IN, not a judge: it answers from judge.JUDGES, by each
judge's system prompt, the IU_G and cause prompts deterministically from word overlap and quotation
matching, Social-R1's SIP structure and content judges from stage headers and word overlap with the
reference, plays a SCRIPTED user and gives SCRIPTED scores for the dialogue judges and CARE's rubric
and scores from word lists, and refuses the judges it has no rule for, and anything else. Backend
`model` answers every prompt with model.py's `generate` from a checkpoint (a self-hosted judge
without vLLM); an extension adds its own (`python -m reward_models.content_rm serve`: a trained
content RM). Latency, HTTP errors, hangs, dropped connections and malformed answers can be
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
from config import excerpt, port_number
from data import split_blocks
from judge import (
    ARG_SECTIONS,
    CARE_DIMENSIONS,
    JUDGES,
    SECTION_TAGS,
    SIP_STAGES,
    user_ends_dialogue,
)
from tokenizer import load_tokenizer

log = logging.getLogger("judge_server")
# ----------------------------------------------------------------------- the local server: backends


class UnsupportedRequest(ValueError):
    """A request this backend cannot answer; the server replies HTTP 400 with this message."""


SECTION_RE = re.compile(
    r"<(" + "|".join(SECTION_TAGS) + r")((?: \w+=\"[^\"]*\")*)>\n(.*?)\n</\1>", re.DOTALL
)
_STOPWORDS = frozenset(
    """about also because been being both could does doing done each from have having here into
just more most much only other over same should some such than that their them then there these \
they this those
very what when where which while will with would your""".split()
)
RULES_MIN_NEW_WORDS = 3


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _content_words(text: str) -> set[str]:
    """Lower-cased words of four or more letters (minus common function words), and single CJK
    characters."""
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


def _rules_iu(sections: list[tuple[str, str]], _: str) -> str:
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


def _rules_cause(sections: list[tuple[str, str]], _: str) -> str:
    parts = dict(sections)
    k = int(parts["turn_to_assess"].strip("[] \n"))
    numbered = re.split(r"^\[(\d+)\] (?:\(TARGET\) )?", parts["conversation"], flags=re.MULTILINE)
    turns = {int(n): text.partition(": ")[2] for n, text in zip(numbered[1::2], numbered[2::2])}
    order, answers = sorted(turns), [_norm(a) for a in parts["answer"].split(",") if a.strip()]
    texts = [turns[n] for n in order]
    for block in split_blocks(parts["reasoning"]):
        quotes_turn = k in turns and any(
            order.index(k) in verifier.locate_quote(q, texts)
            for q in verifier.extract_quotes(block)
        )
        if quotes_turn and any(a in _norm(block) for a in answers):
            return f"Quotes turn [{k}] in a passage naming the concluded emotion | YES"
    return f"No passage both quotes turn [{k}] and names the concluded emotion | NO"


# ---------------------------------------------------- the rules backend: Social-R1's SIP judges

# the share of a reference stage's content words that the candidate's block of that stage must
# hold for the stage to pass the content rule, and the score a failure at each stage caps the
# answer at (the prompt's tiers: Encoding 0.2, Interpretation 0.5, Goal and Response 0.7)
RULES_CONTENT_SHARE = 0.5
_CONTENT_CAPS = dict(zip(SIP_STAGES, (0.2, 0.5, 0.7, 0.7)))


def _stage_blocks(reasoning: str) -> list[tuple[str, str]]:
    """(stage, text) for each reasoning block that opens with a SIP stage's name and a colon
    (`Interpretation: ...`, any case), in order; the text without the evidence tags."""
    found = []
    for block in split_blocks(reasoning):
        head, colon, text = block.partition(":")
        stage = next((s for s in SIP_STAGES if head.strip().lower() == s.lower()), None)
        if colon and stage:
            text = text.replace(verifier.EVIDENCE_OPEN, " ").replace(verifier.EVIDENCE_CLOSE, " ")
            found.append((stage, text))
    return found


def _in_order(reasoning: str) -> dict[str, str | None]:
    """Each SIP stage's text as the structure rule reads it: the first block of that stage, with
    content words, after the block credited to the stage before it (None: no such block)."""
    blocks, credited, after = _stage_blocks(reasoning), {}, -1
    for stage in SIP_STAGES:
        at = next(
            (
                i
                for i, (s, text) in enumerate(blocks)
                if i > after and s == stage and _content_words(text)
            ),
            None,
        )
        credited[stage] = None if at is None else blocks[at][1]
        after = after if at is None else at
    return credited


def _rules_sip_structure(sections: list[tuple[str, str]], _: str) -> str:
    stages = _in_order(dict(sections)["reasoning"])
    return "\n".join(
        f"{stage}: "
        + ("a block opens with it, in order" if text else "no block opens with it in order")
        + f" | {'YES' if text else 'NO'}"
        for stage, text in stages.items()
    )


def _rules_sip_content(sections: list[tuple[str, str]], _: str) -> str:
    parts = dict(sections)
    stages = _in_order(parts["reasoning"])
    reference = {}
    for line in parts["reference"].splitlines():
        head, _, text = line.partition(":")
        reference[head.strip()] = text
    shares = []
    for stage in SIP_STAGES:
        wanted = _content_words(reference.get(stage, ""))
        share = len(wanted & _content_words(stages[stage] or "")) / len(wanted) if wanted else 1.0
        if share < RULES_CONTENT_SHARE:
            return f"{stage} holds {share:.0%} of the reference's words | {_CONTENT_CAPS[stage]}"
        shares.append(share)
    mean = sum(shares) / len(shares)
    return f"every stage holds most of the reference's words ({mean:.0%}) | {0.8 + 0.2 * mean:.2f}"


# --------------------------------------------------------------------- the rules backend: dialogues

# Word lists of the scripted dialogue stand-in. A reply "comforts" with COMFORT words and "acts"
# with ACTION words; a user message reads as distressed or relieved by DISTRESS and RELIEF words.
COMFORT = frozenset(
    "understand sorry hear together support breathe valid natural gently listening".split()
)
ACTION = frozenset("try step plan start next list call write walk rest".split())
DISTRESS = frozenset(
    (
        "overwhelmed worried anxious scared hopeless alone stuck drained exhausted afraid panic "
        "hurt"
    ).split()
)
RELIEF = frozenset("thank thanks better calmer relieved helps helped hopeful lighter".split())
# comfort words over the assistant's replies after which the scripted user says thanks
RULES_COMFORT_TO_END = 3
SCRIPTED_USER = {
    "ends": "Thank you, that helps. I feel calmer now.",  # state 5 (and user_ends_dialogue)
    "eased": "That helps a little, but I am still worried.",  # state 3
    "not eased": "I still feel overwhelmed and stuck.",
}  # state 1


def _count(text: str, words: frozenset) -> int:
    return sum(w in words for w in re.findall(r"[a-z]+", text.lower()))


def _dialogue(text: str) -> list[tuple[str, str]]:
    """(role, text) pairs of a dialogue rendered `Role: text`, paragraphs apart (crudely: a
    paragraph that starts with a role label opens a message)."""
    pieces = re.split(r"(?:^|\n\n)(User|Assistant): ", text)
    return [(role.lower(), message) for role, message in zip(pieces[1::2], pieces[2::2])]


def _last_user(dialogue: str) -> str:
    return next((m for role, m in reversed(_dialogue(dialogue)) if role == "user"), "")


def _rules_user_turn(sections: list[tuple[str, str]], _: str) -> str:
    parts = dict(sections)
    replies = [m for role, m in _dialogue(parts["dialogue"]) if role == "assistant"]
    if sum(_count(r, COMFORT) for r in replies) >= RULES_COMFORT_TO_END:
        return SCRIPTED_USER["ends"]
    return SCRIPTED_USER["eased" if replies and _count(replies[-1], COMFORT) else "not eased"]


def _rules_emotional_state(sections: list[tuple[str, str]], _: str) -> str:
    parts = dict(sections)
    text = parts["user_text"]
    relief, distress = _count(text, RELIEF), _count(text, DISTRESS)
    return (
        f"{relief} relief and {distress} distress words | {min(5, max(1, 3 + relief - distress))}"
    )


def _rules_turn_scores(sections: list[tuple[str, str]], message: str) -> str:
    parts = dict(sections)
    reasoning, reply = (
        ("" if parts["reasoning"] == "(none)" else parts["reasoning"]),
        parts["reply"],
    )
    allowed = int(re.search(r"at most (\d+) lookahead steps", message).group(1))
    asked = _last_user(parts["dialogue"])
    lines = re.MULTILINE | re.IGNORECASE
    present = [name for name in ARG_SECTIONS if re.search(rf"^\s*{name}\s*:", reasoning, lines)]
    steps = [
        m.group(1).strip() for m in re.finditer(r"^\s*Lookahead \d+\s*:(.*)$", reasoning, lines)
    ]
    cognitive = 1 if not reply.strip() else 4 + bool(_content_words(reply) & _content_words(asked))
    forecast, follow_up = (
        _count(parts["prediction"], RELIEF) > 0,
        _count(parts["follow_up"], RELIEF) > 0,
    )
    # the forecast came true
    lookahead = 3 if parts["follow_up"] == "(none)" else 5 if forecast == follow_up else 2
    overthinking = min(
        2,
        (bool(reasoning) and len(asked.split()) < 6)
        + (len(steps) > allowed or len(set(steps)) < len(steps)),
    )
    return "\n".join(
        [
            f"cognitive: reply {'empty' if not reply.strip() else 'given'} | {cognitive}",
            f"trace: {len(present)} of {len(ARG_SECTIONS)} sections | "
            f"{1 + round(4 * len(present) / 5)}",
            f"lookahead: forecast {'eased' if forecast else 'strained'} | {lookahead}",
            f"overthinking: a {len(asked.split())}-word message, {len(steps)} steps | "
            f"{overthinking}",
        ]
    )


def _rules_prediction(sections: list[tuple[str, str]], _: str) -> str:
    parts = dict(sections)  # eased by a comforting reply, and once eased, eased further on
    eased = _count(parts["reply"], COMFORT) > 0 or _count(parts.get("previous", ""), RELIEF) > 0
    return "\n".join(
        [
            f"Needs: {'a next step' if eased else 'to be heard'}",
            f"Appraisal: {'manageable' if eased else 'too much to handle'}",
            f"Emotion: {'calmer' if eased else 'worried'}",
        ]
    )


def _rules_turn_quality(sections: list[tuple[str, str]], _: str) -> str:
    parts = dict(sections)
    reply, comfort = parts["reply"], _count(parts["reply"], COMFORT)
    action = _count(reply, ACTION)
    return "\n".join(
        [
            f"sr_proxy: follow-up "
            f"{'closes' if user_ends_dialogue(parts['follow_up']) else 'goes on'} | "
            f"{int(user_ends_dialogue(parts['follow_up']))}",
            f"ea: {comfort} comfort words | {1 + min(4, comfort)}",
            f"fact_sensitive: {action} action words | {int(action > 0)}",
            f"fa: reply {'given' if reply.strip() else 'empty'} | {int(bool(reply.strip()))}",
        ]
    )


_RULES_CRITERIA = {
    "cognitive": [
        "Restates the core of what the person described",
        "Connects the feeling to its cause in the person's situation",
    ],
    "affective": ["Names the person's feeling", "Validates the feeling without judging it"],
    "proactive": [
        "Suggests one small, concrete next step",
        "Leaves the choice of what to do with the person",
    ],
}


def _rules_care_rubric(sections: list[tuple[str, str]], _: str) -> str:
    parts = dict(sections)
    weights = (
        (0.3, 0.5, 0.2) if _count(_last_user(parts["dialogue"]), DISTRESS) else (0.4, 0.2, 0.4)
    )
    return json.dumps(
        {
            dim: {"weight": weight, "criteria": _RULES_CRITERIA[dim]}
            for dim, weight in zip(CARE_DIMENSIONS, weights)
        }
    )


def _rules_care_scores(sections: list[tuple[str, str]], _: str) -> str:
    parts = dict(sections)
    reply = parts["reply"]
    scores = {
        "cognitive": len(_content_words(reply) & _content_words(_last_user(parts["dialogue"]))),
        "affective": _count(reply, COMFORT),
        "proactive": _count(reply, ACTION),
    }
    items = re.findall(r"^(cognitive|affective|proactive) (\d+):", parts["rubric"], re.MULTILINE)
    return "\n".join(
        f"{dim} {i}: {scores[dim]} cue words | {min(5, scores[dim])}" for dim, i in items
    )


# A rule per judge of judge.JUDGES that the stand-in answers, by the judge's name; each answers from
# the request's (tag, text) sections and its whole user message.
_RULES = {
    "iu": _rules_iu,
    "care_chosen_scores": _rules_care_scores,
    "care_rejected_scores": _rules_care_scores,
    "user_turn": _rules_user_turn,
    "emotional_state": _rules_emotional_state,
    "prediction": _rules_prediction,
    "turn_scores": _rules_turn_scores,
    "care_rubric": _rules_care_rubric,
    "care_scores": _rules_care_scores,
    "turn_quality": _rules_turn_quality,
    "cause": _rules_cause,
    "sip_structure": _rules_sip_structure,
    "sip_content": _rules_sip_content,
}


def rules_backend(messages: list[dict[str, str]], params: dict[str, Any]) -> str:
    """A crude lexical stand-in for a judge model, for offline runs, tests and benchmarks; it reads
    our own prompts and answers them deterministically in the judges' formats:
    - IU_G: a block is GAIN when it has a quotation, every quotation verifies (verifier.py) against
      the conversation's lines, and its prose outside quotations brings at least RULES_MIN_NEW_WORDS
      content words not seen in earlier blocks;
    - cause: YES when one reasoning paragraph both quotes the assessed turn (a quotation the
      verifier locates there) and names the concluded emotion;
    - the user simulator: a SCRIPTED user (SCRIPTED_USER) who thanks the assistant, which ends the
      dialogue, once its replies hold RULES_COMFORT_TO_END COMFORT words in all, says it is eased a
      little after a reply with one, and not eased otherwise;
    - emotional state: 3 + RELIEF words - DISTRESS words, within 1-5;
    - EmoLLM's turn scores: cognitive 1 for an empty reply, else 4, or 5 when it shares a content
      word with the user's message; trace 1 + 4 x the share of the ARG sections present; lookahead 5
      when the forecast and the follow-up agree on easing (a RELIEF word in both or neither), 2 when
      not, 3 without a follow-up; overthinking 1 for reasoning about a message under 6 words, 1 more
      for repeated or too many steps;
    - the reverse-perspective predictor: an eased forecast (Emotion: calmer) after a reply with a
      COMFORT word or from an eased previous step, a strained one (Emotion: worried) otherwise;
    - turn quality: sr_proxy 1 when the follow-up ends the dialogue, ea 1 + COMFORT words (at most
      5), fact_sensitive 1 when the reply has an ACTION word (advice that can be right or wrong),
      fa 1 for a non-empty reply;
    - CARE: a fixed rubric (affective first after a DISTRESS word, else cognitive and proactive),
      and each criterion scored by the reply's cue words for its dimension (content words shared
      with the user's message, COMFORT, ACTION; at most 5);
    - Social-R1's SIP structure (R_struct): a stage is YES when a reasoning block opens with its
      name and a colon (`Encoding:`, English in any language, as tools/toy_tom.py's traces write
      them) and has content words, after the block credited to the stage before it;
    - Social-R1's SIP content against the reference (R_content): each stage's block (as the
      structure rule credits it) must hold RULES_CONTENT_SHARE of the content words of the
      reference's line for that stage; the first stage that does not caps the score as the prompt's
      tiers do (Encoding 0.2, Interpretation 0.5, Goal and Response 0.7), and one that passes them
      all scores 0.8 + 0.2 x the mean share. Word overlap, not understanding: a wrong belief in the
      right words passes. (sip_content_free, without a reference, has no rule.)
    It understands nothing: it is not a judge, only a deterministic answer in the right format."""
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
    message = messages[-1]["content"] if messages else ""
    name = next((name for name, j in JUDGES.items() if j.system == system), None)
    if name is None:
        raise UnsupportedRequest("the rules backend answers only the prompts of judge.JUDGES")
    if name not in _RULES:
        raise UnsupportedRequest(
            f"the rules backend has no rule for the judge {name!r} (it answers: "
            f"{', '.join(_RULES)})"
        )
    answer = _RULES[name]
    try:
        return answer([(m.group(1), m.group(3)) for m in SECTION_RE.finditer(message)], message)
    except (StopIteration, KeyError, ValueError, AttributeError):
        raise UnsupportedRequest(
            "a prompt the rules backend answers, with a section missing or malformed"
        ) from None


MAX_NEW_TOKENS = 32768  # the most new tokens the model backend generates for one request
_ROLES = ("system", "user", "assistant")
# Request fields the model backend reads: (default, test, what the field must be).
_SAMPLING_FIELDS = {
    "max_tokens": (
        1024,
        lambda v: type(v) is int and 1 <= v <= MAX_NEW_TOKENS,
        f"an integer in 1..{MAX_NEW_TOKENS}",
    ),
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
            raise UnsupportedRequest(f"field '{key}' must be {expected}, got {excerpt(value)}")
        settings[key] = value
    return settings


class ModelBackend:
    """Answers with model.py's `generate` from a Hugging Face checkpoint folder: a self-hosted judge
    without vLLM. Requests are generated one at a time (a lock), with the request's sampling."""

    def __init__(self, path: str, device: str | None = None):
        import model as qwen  # lazy: only this backend needs torch

        self._generate = qwen.generate
        self.model = qwen.Qwen.from_pretrained(path, device=device)
        self.tok = load_tokenizer(path)
        self.lock = threading.Lock()

    def __call__(self, messages: list[dict[str, str]], params: dict[str, Any]) -> str:
        settings = sampling_settings(params)
        if roles := [m["role"] for m in messages if m["role"] not in _ROLES]:
            raise UnsupportedRequest(
                f"unknown role {excerpt(roles[0])} (known: {', '.join(_ROLES)})"
            )
        thinking = (params.get("chat_template_kwargs") or {}).get("enable_thinking")
        # no thinking switch in its template, as vLLM ignores it there
        if not self.tok.thinking_switch:
            thinking = None
        eos = tuple(self.tok.eos_token_ids)
        with self.lock:
            new_tokens = self._generate(
                self.model,
                [self.tok.chat_ids(messages, enable_thinking=thinking)],
                max_new_tokens=settings["max_tokens"],
                temperature=float(settings["temperature"]),
                top_p=float(settings["top_p"]),
                top_k=max(0, settings["top_k"]),
                eos_token_ids=eos,
                seed=settings["seed"],
            )[0]
        return self.tok.decode([t for t in new_tokens if t not in eos])


# --------------------------------------------------------------------------- the local server: HTTP

FAULT_ACTIONS = ("ok", "500", "503", "429", "hang", "drop", "malformed")


@dataclass
class Faults:
    """What the server does to requests, for tests and benchmarks. The first len(script) chat
    requests, in arrival order, get the scripted actions; later ones fail with HTTP 503 at
    `fail_rate` (seeded). Actions: ok; 500 / 503 / 429 (an error answer, with Retry-After when
    `retry_after` is set); hang (answer only after `hang` seconds); drop (close the connection
    without answering); malformed (a well-formed completion whose text is not in any judge
    format)."""

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

    def __init__(
        self,
        backend: Callable[[list[dict[str, str]], dict[str, Any]], str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        faults: Faults | None = None,
        model_name: str = "rules",
        api_key: str | None = None,
        verbose: bool = False,
        idle_timeout: float = 60.0,
    ):
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
        self._thread = threading.Thread(
            target=self.serve_forever, args=(0.05,), name="judge-server", daemon=True
        )
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
        # a client gone quiet or away
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # headers and body go out as two writes: no 40 ms delayed-ACK stall
    disable_nagle_algorithm = True
    server: JudgeServer

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout
        super().setup()

    def handle_one_request(self) -> None:
        """One request, then with --verbose one log line: method, path (no query), status,
        milliseconds from the request line to the end of the answer; never a header or a body. A
        dropped request shows status -."""
        self._started, self._status = None, "-"
        super().handle_one_request()
        if self.server.verbose and self._started is not None and self.command:
            ms = (time.perf_counter() - self._started) * 1000
            log.info(
                "%s %s %s %.0f ms", self.command, self.path.split("?")[0][:200], self._status, ms
            )

    def parse_request(self) -> bool:
        self._started = time.perf_counter()
        return super().parse_request()

    def log_request(self, code="-", size="-") -> None:
        self._status = getattr(code, "value", code)

    # the base class's own errors (a bad request line, a timeout): the status only, since their
    # message quotes the request line, query string and all
    def log_message(self, format, *args) -> None:
        if self.server.verbose:
            status = args[0] if format.startswith("code") and args else "-"
            log.warning("refused a malformed or unfinished request (status %s)", status)

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
        self._send_json(
            status, {"error": {"message": message, "type": kind, "code": status}}, headers
        )

    def do_GET(self) -> None:
        if self.path.split("?")[0].rstrip("/") == "/v1/models":
            self._send_json(
                200,
                {
                    "object": "list",
                    "data": [
                        {"id": self.server.model_name, "object": "model", "owned_by": "clue-mini"}
                    ],
                },
            )
        else:
            self._error(404, f"no route for GET {self.path.split('?')[0][:200]}")

    def do_POST(self) -> None:
        length = self.headers.get("Content-Length", "0")
        if "Transfer-Encoding" in self.headers or not re.fullmatch(r"[0-9]{1,18}", length):
            self.close_connection = True
            return self._error(
                400,
                f"expected a body with a Content-Length of 0 or more bytes, got {excerpt(length)}",
            )
        if int(length) > 64 * 2**20:
            self.close_connection = True
            return self._error(413, "request body over 64 MiB")
        body = self.rfile.read(int(length))
        if self.path.split("?")[0].rstrip("/") != "/v1/chat/completions":
            return self._error(404, f"no route for POST {self.path.split('?')[0][:200]}")
        server = self.server
        if (
            server.api_key is not None
            and self.headers.get("Authorization") != f"Bearer {server.api_key}"
        ):
            # Like hosted APIs that echo the key they rejected:
            # clients must keep it out of their errors.
            presented = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
            return self._error(401, f"Incorrect API key provided: {presented}")
        action = server.next_action()
        server.stopping.wait(server.faults.latency)
        if action == "drop":
            self.close_connection = True
            return
        if action in ("500", "503", "429"):
            retry = (
                {}
                if server.faults.retry_after is None
                else {"Retry-After": f"{server.faults.retry_after:g}"}
            )
            return self._error(
                int(action), f"injected HTTP {action}", retry if action != "500" else None
            )
        if action == "hang":
            server.stopping.wait(server.faults.hang)
        try:
            request = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, or nested too deeply to parse
            request = None
        messages = request.get("messages") if isinstance(request, dict) else None
        if (
            not isinstance(messages, list)
            or request.get("stream")
            or not all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            return self._error(
                400,
                "expected a JSON chat request {model, messages: [{role, content}], ...}, "
                "without streaming",
            )
        try:
            text = (
                "I am not sure; both readings seem possible."
                if action == "malformed"
                else server.backend(messages, request)
            )
        except UnsupportedRequest as e:
            return self._error(400, str(e))
        # the backend failed on this request: answer 500 (clients retry), keep serving
        except Exception as e:
            log.exception("judge server: backend error")
            return self._error(500, f"backend error: {type(e).__name__}")
        self._send_json(
            200,
            {
                "id": f"chatcmpl-{time.time_ns()}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": server.model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
            },
        )


# ----------------------------------------------------------------------------- CLI


def main(
    argv: list[str] | None = None, backends: dict | None = None, without_model: tuple = ()
) -> None:
    """`python judge_server.py --backend rules|model ...`; `backends`: an extension's own backends,
    by name, each built from the parsed arguments (`python -m reward_models.content_rm serve`);
    `without_model`: those of them that need no --model."""
    backends = {
        "rules": lambda args: rules_backend,
        "model": lambda args: ModelBackend(args.model, args.device),
    } | (backends or {})
    parser = argparse.ArgumentParser(
        prog="judge_server.py",
        description=(
            "A small OpenAI-compatible judge server (/v1/models, /v1/chat/completions; loopback "
            "by default). Backend 'rules' is a CRUDE LEXICAL STAND-IN, not a judge: it answers "
            "the IU_G and cause prompts deterministically from word overlap and quotation "
            "matching, and plays a scripted user and gives scripted scores for the dialogue and "
            "CARE prompts, for offline runs, tests and benchmarks. Backend 'model' answers with "
            "model.py's generate from a checkpoint."
        ),
    )
    parser.add_argument(
        "--backend",
        choices=list(backends),
        required=True,
        help="rules: lexical stand-in (IU_G, cause, CARE, dialogue); model: the --model checkpoint",
    )
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="the folder a backend answers with (backend 'model': a Hugging Face checkpoint)",
    )
    parser.add_argument(
        "--base",
        metavar="PATH",
        help="the base checkpoint of a --model folder that names one (default: that one)",
    )
    parser.add_argument("--device", help="torch device for backend 'model' (default: cpu)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: loopback only)"
    )
    parser.add_argument("--port", type=port_number, default=8000, help="port (0 picks a free one)")
    parser.add_argument(
        "--api-key-env", metavar="NAME", help="require the key held in this environment variable"
    )
    parser.add_argument(
        "--latency", type=float, default=0.0, help="seconds added before every chat answer"
    )
    parser.add_argument(
        "--fail-rate", type=float, default=0.0, help="fraction of chat requests answered HTTP 503"
    )
    parser.add_argument(
        "--script",
        default="",
        help=f"actions for the first requests, comma-separated: {', '.join(FAULT_ACTIONS)}",
    )
    parser.add_argument(
        "--retry-after", type=float, help="Retry-After seconds sent with injected 429 and 503"
    )
    parser.add_argument(
        "--hang", type=float, default=30.0, help="seconds a 'hang' action waits before answering"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the injected failures")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help=(
            "one line per request to stderr: method, path, status, milliseconds (no headers, "
            "bodies)"
        ),
    )
    args = parser.parse_args(argv)
    script = tuple(a for a in args.script.split(",") if a)
    if unknown := [a for a in script if a not in FAULT_ACTIONS]:
        parser.error(f"--script: unknown action(s) {unknown}; known: {', '.join(FAULT_ACTIONS)}")
    if args.backend not in ("rules", *without_model) and not args.model:
        parser.error(f"--backend {args.backend} needs --model PATH")
    api_key = os.environ.get(args.api_key_env, "").strip() if args.api_key_env else None
    if args.api_key_env and not api_key:
        parser.error(f"--api-key-env: {args.api_key_env} is not set")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s"
    )
    try:
        backend = backends[args.backend](args)
    # no such folder, not a checkpoint, no such device
    except (OSError, ValueError, RuntimeError) as e:
        parser.exit(
            2, f"judge_server.py: error: --model {args.model}: {' '.join(str(e).split())}\n"
        )
    faults = Faults(args.latency, args.fail_rate, script, args.retry_after, args.hang, args.seed)
    name = os.path.basename(os.path.normpath(args.model)) if args.model else args.backend
    try:
        server = JudgeServer(
            backend,
            host=args.host,
            port=args.port,
            faults=faults,
            model_name=name,
            api_key=api_key,
            verbose=args.verbose,
        )
    except OSError as e:  # the port is taken, the host unknown or not ours
        parser.exit(
            2,
            f"judge_server.py: error: cannot listen on {args.host}:{args.port}: "
            f"{e.strerror or e}\n",
        )
    print(f"judge_server.py: backend {args.backend} at {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
