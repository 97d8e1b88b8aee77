"""Several rollout servers (`rollout.vllm.base_url` as a list), without vLLM: two recording HTTP
servers that answer /v1/completions as vLLM does (token ids as `token_id:N` strings), so the test
sees which server got which group and which adapter requests. A real two-server run is in
tests/test_vllm.py (slow)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import JSONHandler, random_model, serve

import model as M
from config import ConfigError, load_config
from distributed import Ranks
from vllm_engine import EngineError, VLLMEngine, VLLMSettings


class Recorder:
    """A fake vLLM server: every POST's path and body are recorded; a completion's tokens are
    [server number, the prompt's first token], its log-probs -1.0; `refuse` answers HTTP 400."""

    def __init__(self, number: int, refuse: tuple[str, ...] = ()):
        self.number, self.refuse, self.posts = number, refuse, []
        recorder = self

        class Handler(JSONHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                recorder.posts.append((self.path, body))
                if self.path in recorder.refuse:
                    return self.answer(400, b'{"error": "refused"}')
                if self.path == "/v1/completions":
                    tokens = [f"token_id:{recorder.number}", f"token_id:{body['prompt'][0]}"]
                    choice = {"logprobs": {"tokens": tokens, "token_logprobs": [-1.0, -1.0]}}
                    choices = [choice | {"index": i} for i in range(body["n"])]
                    return self.answer(200, json.dumps({"choices": choices}).encode())
                self.answer(200, b'{"success": true}')

        self.server, self.url = serve(Handler)

    def paths(self, path: str) -> list[dict]:
        return [body for p, body in self.posts if p == path]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def two_servers():
    servers = [Recorder(0), Recorder(1)]
    yield servers
    for server in servers:
        server.close()


SAMPLING = SimpleNamespace(
    max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0
)


def engine(servers, tmp_path, rank=0, **kw) -> VLLMEngine:
    settings = VLLMSettings(base_url=[s.url for s in servers], retries=0, backoff=0.01, **kw)
    return VLLMEngine(settings, "t", tmp_path, rank)


@pytest.mark.parametrize("rank", [0, 1])
def test_groups_are_dealt_across_the_servers_in_turn_from_the_rank_s_own(
    two_servers, tmp_path, rank
):
    prompts = [[10], [11], [12], [13], [14]]
    tokens, logps = engine(two_servers, tmp_path, rank).generate(prompts, 2, SAMPLING, 100, [0])
    # group g went to server (rank + g) mod 2, in order, K = 2 rows per group
    expected = [[(rank + g) % 2, 10 + g] for g in range(5) for _ in range(2)]
    assert tokens == expected and logps == [[-1.0, -1.0]] * 10
    for number, server in enumerate(two_servers):
        sent = sorted(body["prompt"][0] for body in server.paths("/v1/completions"))
        assert sent == [10 + g for g in range(5) if (rank + g) % 2 == number]
        assert all(body["n"] == 2 for body in server.paths("/v1/completions"))
    seeds = sorted(b["seed"] for s in two_servers for b in s.paths("/v1/completions"))
    assert seeds == [100, 101, 102, 103, 104]  # a group's seed does not depend on its server


def test_every_server_loads_each_adapter_and_unloads_the_last(two_servers, tmp_path):
    policy = random_model("qwen3")
    M.add_lora(policy, rank=2, alpha=4)
    one = Ranks(0, 1, torch.device("cpu"))
    e = engine(two_servers, tmp_path)
    e.sync(policy, 1, one)
    e.sync(policy, 2, one)
    for server in two_servers:
        assert [b["lora_name"] for b in server.paths("/v1/load_lora_adapter")] == ["t-1", "t-2"]
        assert [b["lora_name"] for b in server.paths("/v1/unload_lora_adapter")] == ["t-1"]
    assert e.adapter == "t-2" and sorted(p.name for p in tmp_path.iterdir()) == ["t-2"]
    e.generate([[5]], 1, SAMPLING, 0, [0])
    assert two_servers[0].paths("/v1/completions")[0]["model"] == "t-2"


def test_a_server_that_refuses_stops_the_batch_naming_it(tmp_path):
    servers = [Recorder(0), Recorder(1, refuse=("/v1/completions", "/v1/load_lora_adapter"))]
    try:
        e = engine(servers, tmp_path)
        with pytest.raises(
            EngineError, match=f"vLLM at {servers[1].url}/completions refused the request: HTTP 400"
        ):
            e.generate([[1], [2]], 1, SAMPLING, 0, [0])
        policy = random_model("qwen3")
        M.add_lora(policy, rank=2, alpha=4)
        with pytest.raises(
            EngineError, match=f"{servers[1].url}/load_lora_adapter refused the request: HTTP 400"
        ):
            e.sync(policy, 1, Ranks(0, 1, torch.device("cpu")))
        assert e.adapter is None  # no update samples from an adapter one server lacks
    finally:
        for server in servers:
            server.close()


@pytest.mark.parametrize("urls", [[], ["http://a/v1", "http://a/v1"]])
def test_an_empty_or_repeated_list_is_a_config_error(tmp_path: Path, urls):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"base_url": urls}))
    with pytest.raises(ConfigError, match="'base_url': expects a URL or a list of distinct URLs"):
        load_config(path, [], VLLMSettings)
