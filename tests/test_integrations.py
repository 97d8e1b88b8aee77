"""integrations/: this project's rewards inside TRL's GRPOTrainer, run on a tiny random checkpoint
against the local judge server (TRL is a test-only dependency here; a user brings their own)."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    ANSWERS,
    GRPO_WORDS,
    REPO,
    TINY,
    grpo_checkpoint,
    write_examples,
    write_tiny_checkpoint,
)

import rewards
from dataset import example_from_json, load_jsonl
from integrations.trl import examples_dataset, reward_function
from judge import JudgeConfig
from judge_server import JudgeServer, rules_backend
from tokenizer import load_tokenizer


def test_the_dataset_holds_each_examples_prompt_as_our_trainers_render_it(tmp_path):
    pytest.importorskip("datasets")
    from data import get_task

    base, examples = grpo_checkpoint(tmp_path / "base"), write_examples(tmp_path / "ex.jsonl")
    tok = load_tokenizer(base)
    rows = examples_dataset([str(examples)], tok)
    found = load_jsonl(examples)
    assert len(rows) == len(found) == 4
    for row, e in zip(rows, found):
        assert example_from_json(json.loads(row["example"])) == e
        # the task's messages in ChatML, the assistant's turn opened, as grpo.py prompts (TRL
        # tokenizes the text again: a tag the instructions spell becomes its token there)
        messages = get_task(e.task).messages(e)
        assert row["prompt"] == "".join(
            f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages
        ) + ("<|im_start|>assistant\n")


def test_trls_grpo_trainer_logs_the_clue_reward_that_rewards_score_gives(tmp_path):
    """Two GRPOTrainer steps with the CLUE reward (IU_G asks the rules judge): the rewards TRL logs
    for the last generation batch equal, as float32, rewards.score of the same completions (their
    ids decoded with special tokens kept, the judge asked again), and every call returned one
    reward per completion."""
    trl = pytest.importorskip("trl")
    transformers = pytest.importorskip("transformers")
    base, examples = grpo_checkpoint(tmp_path / "base"), write_examples(tmp_path / "ex.jsonl")
    tok = load_tokenizer(base)
    specs = [rewards.RewardSpec("clue", {"lambda_iu": 0.5}), rewards.RewardSpec("r_len")]
    calls = {spec.name: [] for spec in specs}

    def recorded(spec):
        function = reward_function(spec, judge_cfg, tok)

        @functools.wraps(function)
        def call(*args, **kwargs):
            found = function(*args, **kwargs)
            calls[spec.name].append((kwargs["completion_ids"], kwargs["example"], found))
            return found

        return call

    with JudgeServer(rules_backend).start() as server:
        judge_cfg = JudgeConfig(base_url=server.url, retries=0, concurrency=8)

        args = trl.GRPOConfig(
            output_dir=str(tmp_path / "trl"),
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=6,
            max_steps=2,
            learning_rate=1e-2,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            bf16=False,
            seed=0,
        )
        trainer = trl.GRPOTrainer(
            model=transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
            processing_class=transformers.AutoTokenizer.from_pretrained(base),
            reward_funcs=[recorded(spec) for spec in specs],
            train_dataset=examples_dataset([str(examples)], tok),
            args=args,
        )
        trainer.train()
        eos = set(tok.eos_token_ids)
        for spec in specs:
            assert len(calls[spec.name]) == 2
            assert all(len(c[2]) == len(c[0]) == 4 for c in calls[spec.name])
            ids, raw, returned = calls[spec.name][-1]
            again = [
                rewards.Rollout.from_completion(
                    example_from_json(json.loads(r)),
                    tok.decode([i for i in c if i not in eos]),
                    count_tokens=lambda text: len(tok.encode(text)),
                    n_completion_tokens=len(c),
                    step=2,
                    total_steps=2,
                )
                for c, r in zip(ids, raw)
            ]
            rewards.judge_rollouts(again, spec, judge_cfg)
            expected = [rewards.score(r, spec) for r in again]
            assert returned == expected, spec.name
            logged = list(trainer._logs["rewards"][spec.name])
            assert logged == [torch.tensor(v, dtype=torch.float32).item() for v in expected]
    # r_len's values differ from one completion to the next: the float32 match is not of zeros
    assert len({v for _, _, found in calls["r_len"] for v in found}) > 1


def test_grpo_py_configs_map_to_trls_settings():
    """configs/clue_qwen3_5_9b.yaml through trl_arguments: an update is 8 prompts x 8 completions
    (TRL's generation batch), with the paper's sampling, KL and clip, AdamW and the peak LR."""
    pytest.importorskip("trl")
    from helpers import REPO

    import grpo
    from config import load_config
    from integrations.trl import trl_arguments

    cfg = load_config(REPO / "configs" / "clue_qwen3_5_9b.yaml", [], grpo.GRPOConfig)
    found = trl_arguments(cfg)
    assert (found["num_generations"], found["generation_batch_size"]) == (8, 64)
    assert (found["max_steps"], found["learning_rate"], found["beta"]) == (723, 1e-5, 0.04)
    assert (found["temperature"], found["top_p"], found["top_k"]) == (1.0, 1.0, 0)
    assert (found["epsilon"], found["epsilon_high"], found["loss_type"]) == (0.2, 0.2, "grpo")
    import trl

    trl.GRPOConfig(**found | {"use_cpu": True, "bf16": False})  # TRL accepts every key


def test_a_grpo_py_config_trains_through_trl(tmp_path):
    """`python -m integrations.trl CONFIG`: two updates of grpo.py's tiny config, the LoRA saved."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    from helpers import run_config

    from integrations import trl as plug

    base, examples = grpo_checkpoint(tmp_path / "base"), write_examples(tmp_path / "ex.jsonl")
    with JudgeServer(rules_backend).start() as server:
        config = run_config(tmp_path, (base, examples), server.url, updates=2)
        plug.main([str(config), "rollout.max_new_tokens=4"])
    assert (tmp_path / "run" / "adapter_config.json").is_file()


VERL_VENV = Path(os.environ.get("VERL_VENV", REPO / ".venv-verl"))
# run in the verl venv: verl's own Hydra config with our overrides, its loader for our function,
# its BatchRewardManager on a hand-built batch; writes what it scored
VERL_SCRIPT = """
import json, sys
import numpy as np, torch
from hydra import compose, initialize_config_dir
from transformers import AutoTokenizer
import verl
from verl import DataProto
from verl.trainer.ppo.reward import get_custom_reward_fn
from verl.workers.reward_manager.batch import BatchRewardManager

spec = json.load(open(sys.argv[1]))
configs = str(__import__("pathlib").Path(verl.__file__).parent / "trainer" / "config")
with initialize_config_dir(config_dir=configs, version_base=None):
    config = compose(config_name="ppo_trainer", overrides=spec["overrides"])
tok = AutoTokenizer.from_pretrained(spec["base"])
responses = [tok(r["completion"], add_special_tokens=False)["input_ids"] for r in spec["rows"]]
n, width, pad = len(responses), max(map(len, responses)), tok.pad_token_id
prompts = torch.full((n, 2), pad)
padded = torch.full((n, width), pad)
mask = torch.zeros(n, 2 + width, dtype=torch.long)
mask[:, :2] = 1
for i, ids in enumerate(responses):
    padded[i, : len(ids)] = torch.tensor(ids)
    mask[i, 2 : 2 + len(ids)] = 1
column = lambda key: np.array([r[key] for r in spec["rows"]], dtype=object)
data = DataProto.from_dict(
    tensors={"prompts": prompts, "responses": padded, "attention_mask": mask},
    non_tensors={k: column(k) for k in ("data_source", "reward_model", "extra_info")},
)
assert config.reward.reward_manager.name == "batch"
manager = BatchRewardManager(tok, num_examine=0, compute_score=get_custom_reward_fn(config))
out = manager(data, return_dict=True)
json.dump(
    {
        "rewards": out["reward_tensor"].sum(-1).tolist(),
        "scored": list(out["reward_extra_info"]["scored"]),
        "texts": [tok.decode(ids, skip_special_tokens=True) for ids in responses],
    },
    open(sys.argv[2], "w"),
)
"""


def test_verls_batch_reward_manager_scores_with_our_function_as_rewards_score_does(tmp_path):
    """A grpo.py config's verl overrides compose against verl's own ppo_trainer config; verl's
    loader finds integrations/verl.py's compute_score through them, and its BatchRewardManager
    scores a hand-built batch (right, wrong and unparsable answers, a quotation) with the judge
    asked: each reward equals rewards.score of the text verl decoded, as float32."""
    if not (VERL_VENV / "bin" / "python").is_file():
        pytest.skip(f"no verl venv at {VERL_VENV} (build it with `bash .ci/verl_venv.sh`)")
    import grpo
    from config import load_config
    from integrations.verl import verl_overrides, verl_rows

    # the think tags and answer lines ordinary added tokens, as Qwen3's think tags are: verl
    # decodes with skip_special_tokens=True
    config = dict(TINY, vocab_size=None)
    base = write_tiny_checkpoint(
        tmp_path / "base",
        ["[UNK]", *GRPO_WORDS],
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        config,
        added=("<think>", "</think>", *ANSWERS),
    )
    examples = write_examples(tmp_path / "ex.jsonl")
    rows = verl_rows([str(examples)])
    completions = [
        "so happy that I won</think>\nAnswer: joy",
        "so happy</think>\nAnswer: sadness",
        "I lost my keys",
        "<think>she said that I won the prize</think>\nAnswer: joy",
    ]
    with JudgeServer(rules_backend).start() as server:
        cfg = load_config(
            REPO / "configs" / "clue_qwen3_5_9b.yaml",
            [f"model.path={base}", f"judge.base_url={server.url}", "judge.model=rules"],
            grpo.GRPOConfig,
        )
        spec = {
            "base": str(base),
            "overrides": verl_overrides(cfg, str(tmp_path / "train.parquet")),
            "rows": [r | {"completion": c} for r, c in zip(rows, completions)],
        }
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        run = subprocess.run(
            [str(VERL_VENV / "bin" / "python"), "-c", VERL_SCRIPT, "spec.json", "out.json"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        found = json.loads((tmp_path / "out.json").read_text())
        tok = load_tokenizer(base)
        again = [
            rewards.Rollout.from_completion(
                example_from_json(json.loads(r["extra_info"]["example"])),
                text,
                count_tokens=lambda t: len(tok.encode(t)),
                n_completion_tokens=len(tok.encode(text)),
            )
            for r, text in zip(rows, found["texts"])
        ]
        rewards.judge_rollouts(again, cfg.reward, cfg.judge)
    expected = [rewards.score(r, cfg.reward) for r in again]
    assert None not in expected and len(set(expected)) > 1, (expected, found["texts"])
    assert found["rewards"] == [torch.tensor(v, dtype=torch.float32).item() for v in expected]
    assert found["scored"] == [1, 1, 1, 1]


# runs an entry point as `python -m` would, with one package made unimportable
BLOCKED_RUN = """import runpy, sys
sys.modules[sys.argv[1]] = None
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)"""


@pytest.mark.parametrize(
    ("package", "command"),
    [
        ("trl", ["integrations.trl", "config.yaml"]),
        ("transformers", ["integrations.trl", "config.yaml"]),
        ("datasets", ["integrations.verl", "parquet", "ex.jsonl", "out.parquet"]),
    ],
)
def test_an_entry_point_without_its_package_says_so_in_one_line(tmp_path, package, command):
    """TRL, verl and their packages are the user's: a missing one ends the command with exit 2 and
    one line naming the package and its install, not a traceback."""
    write_examples(tmp_path / "ex.jsonl")
    run = subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN, package, *command],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2, run.stderr[-2000:]
    assert len(lines) == 1 and f"pip install {package}" in lines[0], run.stderr[-2000:]
    assert not (tmp_path / "out.parquet").exists()
