"""The HTTP client of every OpenAI-compatible endpoint the project asks (the judges, a teacher, a
served policy, the vLLM rollout server): where an endpoint is and how it is sampled (`JudgeConfig`,
`request_fields` for what an endpoint of each `kind` takes), the one POST with retries and one-line
errors (`post_json`), the single `chat()` call, concurrent batches (`chat_many`, and `ask`, which
parses each answer), and the start-up `probe`. The judges themselves, their prompts and parsers,
are judge.py's.

Retries with backoff on connection errors, timeouts, 429 and 5xx (waiting at least as long as a
Retry-After asks; one longer than `max_wait` is an error at once), a one-line error otherwise; an
answer larger than MAX_ANSWER_BYTES is refused. API keys come from environment variables only and
never appear in an error or a log line: what is shown is scrubbed of the key and of a URL's user
info.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any, Callable, Literal

import requests
import urllib3
from requests.adapters import HTTPAdapter

from config import bounded, config_error, http_url, print0

log = logging.getLogger("http_client")

# ----------------------------------------------------------------------------- config


# The request fields OpenAI's Chat Completions API takes: it answers any other (top_k,
# repetition_penalty, chat_template_kwargs, ...) with a 400 invalid_request_error. Its reasoning
# models (the o-series, gpt-5) also refuse the sampling fields below and take max_completion_tokens
# (hidden reasoning included) where other models take max_tokens.
OPENAI_FIELDS = frozenset(
    """audio frequency_penalty logit_bias logprobs max_completion_tokens max_tokens metadata
    modalities n parallel_tool_calls prediction presence_penalty reasoning_effort response_format
    seed service_tier stop store stream stream_options temperature tool_choice tools top_logprobs
    top_p user verbosity web_search_options""".split()
)
OPENAI_REASONING_REFUSED = frozenset(
    "temperature top_p presence_penalty frequency_penalty logprobs top_logprobs logit_bias".split()
)
EndpointKind = Literal["vllm", "openai", "openai_reasoning"]
STAND_IN = "rules"  # the model name judge_server.py's rules backend serves


def request_fields(kind: EndpointKind, params: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the fields of `params` a request to an endpoint of `kind` carries, the names left out):
    vllm (vLLM, SGLang: every field), openai (OPENAI_FIELDS only), openai_reasoning (those, less
    OPENAI_REASONING_REFUSED, max_tokens sent as max_completion_tokens unless that is given)."""
    if kind == "vllm":
        return dict(params), []
    sent = {k: v for k, v in params.items() if k in OPENAI_FIELDS}
    if kind == "openai_reasoning":
        budget = sent.pop("max_tokens", None)
        if budget is not None:
            sent.setdefault("max_completion_tokens", budget)
        sent = {k: v for k, v in sent.items() if k not in OPENAI_REASONING_REFUSED}
    renamed = {"max_tokens"} if "max_completion_tokens" in sent else set()
    return sent, sorted(set(params) - set(sent) - renamed)


@dataclass
class JudgeConfig:
    """Where the judge is served and how it is sampled. The defaults are the CLUE paper's IU_G judge
    settings (thinking disabled, temperature 0.3, top-p 0.95, top-k 20, 128 + 120 N new tokens);
    every judge call uses the same sampling, with its own token budget."""

    base_url: str = "http://127.0.0.1:8000/v1"
    model: str = "judge"
    # what the server accepts (request_fields): vllm (vLLM, SGLang: top_k, chat_template_kwargs and
    # the rest), openai (OpenAI's API and others that refuse fields it lacks: those are not sent,
    # and said once at start-up), openai_reasoning (OpenAI's o-series and gpt-5: no temperature or
    # top_p, max_completion_tokens)
    kind: EndpointKind = "vllm"
    # name of the environment variable holding the key; never the key
    api_key_env: str | None = None
    # seconds to connect, to wait for bytes, and to receive the whole answer
    timeout: float = bounded(120.0, gt=0)
    retries: int = bounded(4, ge=0)  # retries after the first attempt
    # the first retry waits about this long, then the wait doubles (with jitter)
    backoff: float = bounded(1.0, ge=0)
    # longest single wait; a Retry-After asking for more fails the request
    max_wait: float = bounded(60.0, ge=0)
    concurrency: int = bounded(32, ge=1)  # requests in flight at once in `chat_many`
    temperature: float = bounded(0.3, ge=0)
    top_p: float = bounded(0.95, gt=0, le=1)
    top_k: int = bounded(20, ge=0)
    enable_thinking: bool = False  # sent as chat_template_kwargs (vLLM, SGLang)
    iu_max_tokens_base: int = 128
    iu_max_tokens_per_block: int = 120
    # Extra or overriding request fields; a value of None drops a field, e.g. {top_k: null,
    # chat_template_kwargs: null} for a hosted API that rejects the fields vLLM accepts.
    sampling: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.base_url = http_url(self.base_url)

    def read_api_key(self) -> str | None:
        if self.api_key_env is None:
            return None
        key = _checked_key(
            os.environ.get(self.api_key_env), f"the environment variable {self.api_key_env}"
        )
        if not key:  # the caller names its setting (judge.api_key_env, teacher.api_key_env, ...)
            raise JudgeError(f"the environment variable {self.api_key_env} is not set")
        return key

    def check_key(self, key: str, config_path) -> None:
        """The endpoint of config key `key` has its API key, if it names one: a ConfigError at
        `key`.api_key_env (config.config_error) when the variable is unset or unusable."""
        try:
            self.read_api_key()
        except JudgeError as e:
            raise config_error(config_path, f"{key}.api_key_env", str(e)) from None

    def requested(self, max_tokens: int) -> dict[str, Any]:
        """The sampling this config asks for, before `kind` leaves out what the server refuses."""
        params = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": max_tokens,
            "chat_template_kwargs": {"enable_thinking": self.enable_thinking},
        }
        params.update(self.sampling)
        return {k: v for k, v in params.items() if v is not None}

    def sampling_params(self, max_tokens: int) -> dict[str, Any]:
        """The sampling fields a request carries (request_fields)."""
        return request_fields(self.kind, self.requested(max_tokens))[0]

    def not_sent(self) -> str | None:
        """One line naming the settings this endpoint's kind does not send, None when all are."""
        requested = self.requested(1)
        left = request_fields(self.kind, requested)[1]
        if not left:
            return None
        shown = ", ".join(f"{k}={json.dumps(requested[k])}" for k in left)
        return (
            f"{self.base_url} ({self.model}, kind {self.kind}) is not sent {shown}: its API "
            "refuses these fields"
        )


@dataclass
class JudgeCall:
    """One judge request: the chat messages and the judge's own budget of new tokens."""

    messages: list[dict[str, str]]
    max_tokens: int


# ----------------------------------------------------------------------------- the HTTP call


class JudgeError(RuntimeError):
    """A judge request that failed for good; `retries` counts the retries spent on it. The message
    never contains the API key."""

    def __init__(self, message: str, retries: int = 0):
        super().__init__(message)
        self.retries = retries


class JudgeAuthError(JudgeError):
    """The judge refused the key (HTTP 401 or 403): not incomplete feedback but a run that cannot
    work, so chat_many raises it instead of yielding None; the message names the endpoint and the
    key's variable."""


# pooled connections per host: above any sensible concurrency, so none is discarded
_POOL_SIZE = 256
MAX_ANSWER_BYTES = 8 * 2**20  # a larger answer is refused (judges answer in kilobytes)
_SESSION = requests.Session()
for _scheme in ("http://", "https://"):
    _SESSION.mount(_scheme, HTTPAdapter(pool_connections=8, pool_maxsize=_POOL_SIZE, max_retries=0))
_RETRIED_ERRORS = (
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.HTTPError,
)
_USERINFO = re.compile(r"(?<=://)[^/?#@\s]*@")


def _checked_key(key: str | None, source: str) -> str | None:
    """The key stripped (of a trailing CR LF, say); one an HTTP header cannot carry is refused,
    unshown."""
    key = None if key is None else key.strip()
    if key and not (key.isascii() and key.isprintable()):
        raise JudgeError(
            f"judge: the API key in {source} has control or non-ASCII characters (not shown)"
        )
    return key


def _scrub(text: str, url: str, api_key: str | None) -> str:
    """`text` without any URL's user:password@, and with every word that holds the key or the user
    or password of `url`, or a 6-character piece of one, replaced: servers may echo a key, even
    masked."""
    userinfo = _USERINFO.search(url).group()[:-1] if _USERINFO.search(url) else ""
    # and as Basic auth
    secrets = [api_key, *userinfo.split(":"), base64.b64encode(userinfo.encode()).decode()]
    pieces = {s[i : i + 6] for s in secrets if s for i in range(max(1, len(s) - 5))}
    words = re.split(r"(\s+)", _USERINFO.sub("", text))
    return "".join("[redacted]" if any(p in w for p in pieces) else w for w in words)


def _root_cause(error: BaseException) -> str:
    """The innermost error under what requests raises (its message repeats the host, port and path
    at each level): e.g. "ConnectionRefusedError: [Errno 111] Connection refused"."""
    seen = {id(error)}
    while True:
        inner = next(
            (
                e
                for e in (getattr(error, "reason", None), *error.args[:1], error.__cause__)
                if isinstance(e, BaseException) and id(e) not in seen
            ),
            None,
        )
        if inner is None:
            return f"{type(error).__name__}: {error}"
        seen.add(id(inner))
        error = inner


def _retry_after(response: requests.Response) -> float | None:
    """Seconds the server asks us to wait (Retry-After as seconds or an HTTP date), if it says."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _backoff_delay(attempt: int, backoff: float, max_wait: float) -> float:
    """Exponential backoff with jitter: uniform in [d/2, d] for d = min(max_wait, backoff *
    2^attempt)."""
    delay = min(max_wait, backoff * 2**attempt)
    return delay / 2 + random.uniform(0, delay / 2)


def _read_answer(response: requests.Response, deadline: float) -> bytes | None:
    """The body, or None past MAX_ANSWER_BYTES; one still arriving at `deadline` times out."""
    body = bytearray()
    while chunk := response.raw.read1(2**16, decode_content=True):
        body += chunk
        if len(body) > MAX_ANSWER_BYTES:
            return None
        if time.monotonic() > deadline:
            raise requests.Timeout("the answer was still arriving at the deadline")
    return bytes(body)


def _completion_text(body: bytes) -> str | None:
    try:
        text = json.loads(body)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError, RecursionError):
        return None
    return text if isinstance(text, str) else None


def post_json(
    url,
    body: dict,
    parse: Callable[[bytes], Any],
    *,
    api_key=None,
    timeout=120.0,
    retries=4,
    backoff=1.0,
    max_wait=60.0,
    server="judge",
    expected="the answer expected",
) -> tuple[Any, int]:
    """(parse(answer body), retries used) for a JSON POST to `url`, the one HTTP client of the
    project (judges here, vLLM's rollout endpoints in vllm_engine.py). Retries connection errors,
    timeouts, 429 and 5xx with backoff; any other answer, a 200 that `parse` turns into None, or
    running out of retries raises JudgeError, whose message begins `{server} at {url}` and never
    holds the key."""
    api_key = _checked_key(api_key, "api_key")
    shown = _USERINFO.sub("", url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    last = ""  # the last error answer's text, shown when the retries run out
    for attempt in range(retries + 1):
        wait = None
        try:
            deadline = time.monotonic() + timeout
            with _SESSION.post(
                url, json=body, headers=headers, timeout=timeout, stream=True
            ) as response:
                answer = _read_answer(response, deadline)
        except _RETRIED_ERRORS as e:
            reason = f"{type(e).__name__} ({_scrub(_root_cause(e), url, api_key)[:300]})"
        except requests.RequestException as e:  # a malformed URL or header: retrying cannot help
            raise JudgeError(
                f"{server} at {shown}: {type(e).__name__}: {_scrub(str(e), url, api_key)[:300]}",
                attempt,
            ) from None
        else:
            if answer is None:
                raise JudgeError(
                    f"{server} at {shown}: an answer over {MAX_ANSWER_BYTES} bytes", attempt
                )
            if response.status_code == 200:
                value = parse(answer)
                if value is None:
                    raise JudgeError(f"{server} at {shown}: HTTP 200 but not {expected}", attempt)
                return value, attempt
            reason = f"HTTP {response.status_code}"
            if response.status_code in (401, 403):  # the body may echo the key: never shown
                raise JudgeAuthError(f"{server} at {shown} refused the API key: {reason}", attempt)
            # one line
            last = " ".join(_scrub(answer[:500].decode("utf-8", "replace"), url, api_key).split())
            if response.status_code != 429 and response.status_code < 500:
                raise JudgeError(
                    f"{server} at {shown} refused the request: {reason}: {last}", attempt
                )
            wait = _retry_after(response)
        if attempt == retries:
            break
        if wait is not None and wait > max_wait:
            raise JudgeError(
                f"{server} at {shown}: {reason} with Retry-After {wait:.0f}s, "
                f"more than max_wait={max_wait:g}s",
                attempt,
            )
        # a Retry-After of 0 is no hurry
        delay = max(wait or 0.0, _backoff_delay(attempt, backoff, max_wait))
        log.warning(
            "%s at %s: %s; retry %d/%d in %.2fs", server, shown, reason, attempt + 1, retries, delay
        )
        time.sleep(delay)
    raise JudgeError(
        f"{server} at {shown}: {reason}, still failing after {retries + 1} attempts"
        + (f" (last answer: {last})" if last else ""),
        retries,
    )


def _chat_with_retries(
    messages, *, base_url, model, api_key, timeout, retries, backoff, max_wait, sampling
) -> tuple[str, int]:
    """(answer text, retries used) of one chat completion; raises JudgeError."""
    return post_json(
        base_url.rstrip("/") + "/chat/completions",
        {"model": model, "messages": messages, **sampling},
        _completion_text,
        api_key=api_key,
        timeout=timeout,
        retries=retries,
        backoff=backoff,
        max_wait=max_wait,
        expected="a chat completion with text content",
    )


def chat(
    messages,
    *,
    base_url,
    model,
    api_key=None,
    timeout=120.0,
    retries=4,
    backoff=1.0,
    max_wait=60.0,
    **sampling,
) -> str:
    """POST one chat completion to `{base_url}/chat/completions` and return the answer text.

    `sampling` fields go into the request body as given (temperature, top_p, max_tokens, and the
    fields vLLM accepts beyond OpenAI's: top_k, chat_template_kwargs). Connection errors, timeouts,
    HTTP 429 and 5xx are retried with exponential backoff and jitter, waiting at least as long as a
    Retry-After asks; any other answer, or running out of retries, raises JudgeError."""
    return _chat_with_retries(
        messages,
        base_url=base_url,
        model=model,
        api_key=api_key,
        timeout=timeout,
        retries=retries,
        backoff=backoff,
        max_wait=max_wait,
        sampling=sampling,
    )[0]


def chat_many(calls: list[JudgeCall], cfg: JudgeConfig) -> tuple[list[str | None], dict[str, Any]]:
    """Send `calls` concurrently (`cfg.concurrency` at once) and return their answers in order.

    A call that still fails after its retries yields None, and its reason is kept in
    `stats["errors"]` (index -> reason, secrets scrubbed): no failed call raises here, except a
    refused key (JudgeAuthError, naming the key's variable) and a key variable not set or not usable
    (before any request). `stats` also holds the counts for the caller's metrics: calls, retries,
    failures, latency_mean_s, latency_max_s, wall_s."""
    api_key = cfg.read_api_key()
    start = time.perf_counter()

    def one(call: JudgeCall):
        begin = time.perf_counter()
        try:
            text, retries = _chat_with_retries(
                call.messages,
                base_url=cfg.base_url,
                model=cfg.model,
                api_key=api_key,
                timeout=cfg.timeout,
                retries=cfg.retries,
                backoff=cfg.backoff,
                max_wait=cfg.max_wait,
                sampling=cfg.sampling_params(call.max_tokens),
            )
            return text, retries, None, time.perf_counter() - begin
        except JudgeAuthError as e:
            source = (
                f"key from the environment variable {cfg.api_key_env}"
                if cfg.api_key_env
                else "no api_key_env set"
            )
            raise JudgeAuthError(f"{e} ({source})") from None
        # a JudgeError, or anything else: a failed call, never a crashed batch
        except Exception as e:
            reason = (
                str(e)
                if isinstance(e, JudgeError)
                else _scrub(f"{type(e).__name__}: {e}", cfg.base_url, api_key)
            )
            return None, getattr(e, "retries", 0), reason, time.perf_counter() - begin

    with ThreadPoolExecutor(max_workers=max(1, min(cfg.concurrency, len(calls)))) as pool:
        outcomes = list(pool.map(one, calls))
    latencies = [o[3] for o in outcomes]
    stats = {
        "calls": len(calls),
        "retries": sum(o[1] for o in outcomes),
        "failures": sum(o[0] is None for o in outcomes),
        "latency_mean_s": sum(latencies) / len(latencies) if latencies else 0.0,
        "latency_max_s": max(latencies, default=0.0),
        "wall_s": time.perf_counter() - start,
        "errors": {i: o[2] for i, o in enumerate(outcomes) if o[2] is not None},
    }
    return [o[0] for o in outcomes], stats


PROBE_RETRIES = 2


def probe(call: JudgeCall, cfg: JudgeConfig, key: str) -> str:
    """Ask `call`, a request of a kind the run will send, once before the run's first expensive
    step, and return the answer: an endpoint that never answers (nothing listening, a wrong port)
    or refuses that kind of request stops the run there, not after an update of failed calls.
    Raises JudgeError (JudgeAuthError for a refused key) whose one line names the config `key`, the
    endpoint and the server's own reason. Whether the answer parses is left to the run: a malformed
    answer is incomplete feedback, counted as any later one is. Connection errors, timeouts, 429 and
    5xx are retried at least PROBE_RETRIES times, whatever `cfg.retries` says: a server still
    starting, or one fault, should not stop a run that the same server can serve."""
    source = f"the key from {cfg.api_key_env}" if cfg.api_key_env else "no api_key_env set"
    if line := cfg.not_sent():
        print0(f"'{key}': {line}")
    try:
        api_key = cfg.read_api_key()
    except JudgeError as e:
        raise JudgeError(f"'{key}.api_key_env': {e}") from None
    try:
        return _chat_with_retries(
            call.messages,
            base_url=cfg.base_url,
            model=cfg.model,
            api_key=api_key,
            timeout=cfg.timeout,
            retries=max(cfg.retries, PROBE_RETRIES),
            backoff=cfg.backoff,
            max_wait=cfg.max_wait,
            sampling=cfg.sampling_params(call.max_tokens),
        )[0]
    except JudgeAuthError as e:
        raise JudgeAuthError(f"'{key}': {e} ({source})") from None
    except JudgeError as e:
        raise JudgeError(f"'{key}': asked once before the run: {e}") from None


def ask(
    requests: list[tuple[JudgeCall, Callable[[str], Any]]], cfg: JudgeConfig
) -> tuple[list[Any], dict[str, Any]]:
    """Send every call of `requests` (call, parser) at once (`chat_many`) and parse each answer: the
    parsed values in order, None where the call failed or its parser rejected the answer;
    chat_many's stats plus `malformed`, the count of answers the parsers rejected."""
    texts, stats = chat_many([call for call, _ in requests], cfg)
    values = [None if text is None else parse(text) for (_, parse), text in zip(requests, texts)]
    return values, stats | {
        "malformed": sum(t is not None and v is None for t, v in zip(texts, values))
    }
