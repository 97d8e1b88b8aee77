"""The papers' ablation and baseline rows as configs: each differs from its paper config only in the
keys the row changes, its reward is the row's formula (hand-computed), and it runs on the tiny
model."""

import math
from pathlib import Path

import pytest
import yaml
from helpers import read_jsonl

import data
import dataset
import grpo
from judge import SIP_STAGES
from judge_server import JudgeServer
from rewards import Rollout, social_r1

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"

# Social-R1 Table 2: the row's config and what it changes in configs/social_r1_qwen3_8b.yaml
SOCIAL_R1_ROWS = {
    "social_r1_qwen3_8b_no_struct.yaml": {"reward.params.use_struct": 0},
    "social_r1_qwen3_8b_no_content.yaml": {
        "reward.params.use_content": 0,
        "content_model": None,
    },
    "social_r1_qwen3_8b_only_out.yaml": {
        "reward.params.use_struct": 0,
        "reward.params.use_content": 0,
        "content_model": None,
    },
    "social_r1_qwen3_8b_no_len.yaml": {"reward.params.use_len": 0},
}


def flat(node, prefix=""):
    """A YAML mapping as {dotted key: leaf value}."""
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    return {k: v for key, value in node.items() for k, v in flat(value, f"{prefix}{key}.").items()}


def read(name):
    return flat(yaml.safe_load((CONFIGS / name).read_text(encoding="utf-8")))


@pytest.mark.parametrize("name, changes", SOCIAL_R1_ROWS.items())
def test_an_ablation_config_changes_only_its_keys(name, changes):
    base, row = read("social_r1_qwen3_8b.yaml"), read(name)
    differ = {
        k
        for k in base.keys() | row.keys()
        if k != "output_dir" and base.get(k, KeyError) != row.get(k, KeyError)
    }
    # a null content_model replaces the base's content_model.* leaves
    nulled = {k for k in base if k.startswith("content_model.") and "content_model" in changes}
    assert differ == set(changes) | nulled
    assert all(row[k] == v for k, v in changes.items())
    assert row["output_dir"] == f"runs/{name.removesuffix('.yaml')}"


def tom_example(reference=True):
    meta = {"question": "Where will Sam look?", "options": ["box", "bag"]}
    if reference:
        meta["reference"] = "\n".join(f"{stage}: the {stage.lower()}" for stage in SIP_STAGES)
    return data.Example(
        "s1", "tom_mc", [data.Turn("", "Sam hides the key in the box.")], None, ["A"], meta=meta
    )


def test_each_row_computes_its_table_2_formula():
    # R_struct 0.8, R_content 0.6, update 300 of 600 (w = 1.5), a correct, well-formed answer and
    # T = 1450 reasoning tokens: R_len = sigmoid((1450 - 400) / 50) sigmoid((2500 - 1450) / 50)
    completion = "Sam put the key in the box himself so he knows where it is</think>\nAnswer: A"
    judged = {"sip_structure": 0.8, "sip_content": 0.6}
    r = Rollout.from_completion(
        tom_example(),
        completion,
        n_reasoning_tokens=1450,
        n_completion_tokens=1455,
        step=300,
        total_steps=600,
        judged=judged,
    )
    length = (1 / (1 + math.exp(-21))) ** 2
    expected = {
        "social_r1_qwen3_8b.yaml": (2 + 0.5 * (1.5 * 0.8 + 1.5 * 0.6)) * length,
        "social_r1_qwen3_8b_no_struct.yaml": (2 + 0.5 * 1.5 * 0.6) * length,
        "social_r1_qwen3_8b_no_content.yaml": (2 + 0.5 * 1.5 * 0.8) * length,
        "social_r1_qwen3_8b_only_out.yaml": 2 * length,
        "social_r1_qwen3_8b_no_len.yaml": 2 + 0.5 * (1.5 * 0.8 + 1.5 * 0.6),
    }
    for name, value in expected.items():
        params = yaml.safe_load((CONFIGS / name).read_text())["reward"]["params"]
        assert social_r1(r, params) == pytest.approx(value, rel=1e-12), name
    # a term switched off reads no judge output: its absence leaves the reward defined
    r.judged = {"sip_content": 0.6}
    assert social_r1(r, {"use_struct": 0}) == pytest.approx(
        expected["social_r1_qwen3_8b_no_struct.yaml"]
    )
    assert social_r1(r) is None
    r.judged = {}
    assert social_r1(r, {"use_struct": 0, "use_content": 0}) == pytest.approx(2 * length)


def sip_backend(seen):
    """The two SIP judges, each request's kind recorded in `seen`."""

    def backend(messages, params):
        system = messages[0]["content"]
        if "Encoding: <short assessment>" in system:
            seen.append("structure")
            return "\n".join(f"{stage}: done | YES" for stage in SIP_STAGES)
        seen.append("content")
        return "against the reference | 0.7"

    return backend


@pytest.mark.parametrize(
    "name, asked",
    [
        ("social_r1_qwen3_8b_no_struct.yaml", {"content"}),
        ("social_r1_qwen3_8b_no_content.yaml", {"structure"}),
        ("social_r1_qwen3_8b_only_out.yaml", set()),
        ("social_r1_qwen3_8b_no_len.yaml", {"structure", "content"}),
    ],
)
def test_a_table_2_row_runs_asking_only_its_judges(tmp_path, assets, name, asked):
    base, _ = assets
    train = tmp_path / "tom.jsonl"
    # only the rows with R_content read a reference
    dataset.save_jsonl([tom_example(reference="content" in asked)], train)
    seen = []
    with JudgeServer(sip_backend(seen)).start() as server:
        grpo.main(
            [
                str(CONFIGS / name),
                f"output_dir={tmp_path / 'run'}",
                f"train_data=[{train}]",
                f"model.path={base}",
                "model.dtype=float32",
                "model.device=cpu",
                "model.gradient_checkpointing=false",
                "finetune=lora",
                "lora.rank=4",
                "lora.alpha=8",
                "updates=2",
                "rollout.prompts_per_update=1",
                "rollout.group_size=2",
                "rollout.max_new_tokens=4",
                "loss.micro_batch_size=4",
                "content_model=null",  # the full rows' RM replaced by the prompted judge
                f"judge.base_url={server.url}",
                "judge.retries=0",
            ]
        )
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert set(seen) == asked and len(seen) == 2 * 2 * len(asked)  # 2 updates x 2 rollouts


def test_a_switch_is_0_or_1(tmp_path, assets, capsys):
    with pytest.raises(SystemExit) as stop:
        grpo.main([str(CONFIGS / "social_r1_qwen3_8b_no_len.yaml"), "reward.params.use_len=0.5"])
    assert stop.value.code == 2
    assert (
        "'reward.params.use_len': a switch: 0 (off) or 1 (on), got 0.5" in capsys.readouterr().err
    )
