"""The papers' ablation and baseline rows as configs: each differs from its paper config only in the
keys the row changes, its reward is the row's formula (hand-computed), and it runs on the tiny
model."""

import math
import re
from pathlib import Path

import pytest
import yaml
from helpers import conversation, read_jsonl, sft_checkpoint

import data
import dataset
import grpo
import sft
from config import load_config
from dialogue import rl as dialogue_rl
from dialogue.rl import DialogueConfig
from judge import CARE_RUBRIC_SYSTEM, CARE_SCORES_SYSTEM, SIP_STAGES
from judge_server import JudgeServer, rules_backend
from reward_models import social_r1 as social_r1_rl
from rewards import Rollout, care, social_r1
from train import linear_warmup_decay

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"

# Social-R1 Table 2: the row's config and what it changes in configs/social_r1_qwen3_8b.yaml
SOCIAL_R1_ROWS = {
    "social_r1_qwen3_8b_no_struct.yaml": {"reward.params.use_struct": 0},
    # the RM pairs' source: the same row before any RM exists (R_content from the prompted judge,
    # grpo.py runs it), every checkpoint the pairs read kept
    "social_r1_rm_source.yaml": {
        "reward.params.use_struct": 0,
        "content_model": None,
        "save_every": 30,
        "keep_checkpoints": 20,
    },
    # the rows without R_content have no content RM either: grpo.py runs them
    "social_r1_qwen3_8b_no_content.yaml": {"reward.params.use_content": 0},
    "social_r1_qwen3_8b_only_out.yaml": {
        "reward.params.use_struct": 0,
        "reward.params.use_content": 0,
    },
    "social_r1_qwen3_8b_no_len.yaml": {"reward.params.use_len": 0},
}
# CARE Table 3: the row's config and the keys it changes in configs/care_qwen2_5_7b.yaml
CARE_ROWS = {
    "care_qwen2_5_7b_uniform_weights.yaml": {"reward.params.uniform_weights"},
    "care_qwen2_5_7b_fixed_criteria.yaml": {
        f"dialogue.fixed_criteria.{d}" for d in ("cognitive", "affective", "proactive")
    },
    "care_qwen2_5_7b_sft_generator.yaml": {
        "dialogue.rubric_judge.model",
    },
}


def flat(node, prefix=""):
    """A YAML mapping as {dotted key: leaf value}."""
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    return {k: v for key, value in node.items() for k, v in flat(value, f"{prefix}{key}.").items()}


def read(name):
    return flat(yaml.safe_load((CONFIGS / name).read_text(encoding="utf-8")))


@pytest.mark.parametrize(
    "base_name, name, changes",
    [("social_r1_qwen3_8b.yaml", n, c) for n, c in SOCIAL_R1_ROWS.items()]
    + [("care_qwen2_5_7b.yaml", n, dict.fromkeys(c)) for n, c in CARE_ROWS.items()],
)
def test_an_ablation_config_changes_only_its_keys(base_name, name, changes):
    base, row = read(base_name), read(name)
    differ = {
        k
        for k in base.keys() | row.keys()
        if k != "output_dir" and base.get(k, KeyError) != row.get(k, KeyError)
    }
    # a row without R_content, or without the RM, drops the base's content_model section, every leaf
    dropped = {k for k in base if k.startswith("content_model.") and k not in row}
    assert dropped == (
        {k for k in base if k.startswith("content_model.")}
        if changes.get("reward.params.use_content") == 0 or "content_model" in changes
        else set()
    )
    assert differ == set(changes) - {"content_model"} | dropped
    assert all(v is None or row[k] == v for k, v in changes.items())
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
        count_tokens=lambda _: 1450,
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
    """Each row through its entry point: with R_content, reward_models/social_r1.py, its content
    RM served (here the scripted backend answers its prompt), so the examples need no reference;
    without, grpo.py."""
    base, _ = assets
    train = tmp_path / "tom.jsonl"
    dataset.save_jsonl([tom_example(reference=False)], train)
    seen = []
    with JudgeServer(sip_backend(seen)).start() as server:
        served = f"content_model={{path: null, endpoint: {{base_url: {server.url}, retries: 0}}}}"
        run, rm = (social_r1_rl.main, [served]) if "content" in asked else (grpo.main, [])
        run(
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
                f"judge.base_url={server.url}",
                "judge.retries=0",
                *rm,
            ]
        )
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    # each judge once before the run (http_client.probe), then 2 updates x 2 rollouts
    assert set(seen) == asked and len(seen) == (1 + 2 * 2) * len(asked)


def test_a_switch_is_0_or_1(tmp_path, assets, capsys):
    with pytest.raises(SystemExit) as stop:
        grpo.main(
            [str(CONFIGS / "social_r1_qwen3_8b_no_content.yaml"), "reward.params.use_len=0.5"]
        )
    assert stop.value.code == 2
    assert (
        "'reward.params.use_len': a switch: 0 (off) or 1 (on), got 0.5" in capsys.readouterr().err
    )


def test_uniform_weights_drop_the_rubric_weights():
    rubric = {
        "cognitive": {"weight": 0.5, "criteria": ["c1", "c2"]},
        "affective": {"weight": 0.3, "criteria": ["a1", "a2"]},
        "proactive": {"weight": 0.2, "criteria": ["p1", "p2"]},
    }
    scores = {"cognitive": [5, 3], "affective": [4, 4], "proactive": [2, 2]}
    r = Rollout(tom_example(), "", "", [], None, 0, 0)
    r.judged = {"care_rubric": rubric, "care_scores": scores}
    params = yaml.safe_load((CONFIGS / "care_qwen2_5_7b_uniform_weights.yaml").read_text())
    # 0.5 x 4/5 + 0.3 x 4/5 + 0.2 x 2/5, then each dimension at 1/3
    assert care(r) == pytest.approx(0.72, rel=1e-12)
    assert care(r, params["reward"]["params"]) == pytest.approx((0.8 + 0.8 + 0.4) / 3, rel=1e-12)


class CareRecorder:
    """The rules backend, each request's (system prompt, user message, model) kept; every other
    scoring answer gives every criterion 5, so that a group's two replies score apart."""

    def __init__(self):
        self.requests = []

    def __call__(self, messages, params):
        self.requests.append((messages[0]["content"], messages[-1]["content"], params["model"]))
        answer = rules_backend(messages, params)
        scored = sum(system == CARE_SCORES_SYSTEM for system, _, _ in self.requests)
        if messages[0]["content"] == CARE_SCORES_SYSTEM and scored % 2:
            return re.sub(r"\| \d$", "| 5", answer, flags=re.MULTILINE)
        return answer


@pytest.mark.parametrize("name", ["care_qwen2_5_7b.yaml", *CARE_ROWS])
def test_a_table_3_row_runs(tmp_path, assets, name):
    base, _ = assets
    recorder = CareRecorder()
    with JudgeServer(recorder).start() as server:
        urls = [
            f"{k}.base_url={server.url}"
            for k in ("judge", "dialogue.rubric_judge", "dialogue.simulator")
        ]
        dialogue_rl.main(
            [
                str(CONFIGS / name),
                f"output_dir={tmp_path / 'run'}",
                f"train_data=[{REPO / 'configs' / 'dialogue_demo_scenarios.jsonl'}]",
                f"model.path={base}",
                "model.dtype=float32",
                "model.device=cpu",
                "model.gradient_checkpointing=false",
                "updates=1",  # full-parameter, as the paper (one process: FSDP2 over one rank)
                "dialogue.max_turns=1",
                "rollout.prompts_per_update=1",
                "rollout.group_size=2",
                "rollout.max_new_tokens=4",
                "loss.micro_batch_size=4",
                *urls,
            ]
        )
    (record,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert record["step"] == 1
    cfg = yaml.safe_load((CONFIGS / name).read_text())["dialogue"]
    writers = {m for system, _, m in recorder.requests if system == CARE_RUBRIC_SYSTEM}
    assert writers == {cfg["rubric_judge"]["model"]}
    # the first: the judge asked once before the run (http_client.probe), about a stand-in rubric
    _, *scored = [user for system, user, _ in recorder.requests if system == CARE_SCORES_SYSTEM]
    assert len(scored) == 2  # both replies, under their state's rubric
    # the fixed row's criteria are in every scoring prompt of that row, and in no other row's
    fixed_row = yaml.safe_load((CONFIGS / "care_qwen2_5_7b_fixed_criteria.yaml").read_text())
    ours = [c for criteria in fixed_row["dialogue"]["fixed_criteria"].values() for c in criteria]
    assert all((c in user) == ("fixed_criteria" in cfg) for c in ours for user in scored)


def test_care_trains_every_weight_of_the_policy_and_the_generator():
    policy = load_config(CONFIGS / "care_qwen2_5_7b.yaml", [], DialogueConfig)
    assert (policy.finetune, policy.lora, policy.optim.lr, policy.optim.lr_floor) == (
        "full",
        None,
        2e-6,
        2e-6,
    )
    generator_rl = load_config(CONFIGS / "care_generator_qwen3_8b.yaml", [], grpo.GRPOConfig)
    generator_sft = load_config(CONFIGS / "care_generator_sft_qwen3_8b.yaml", [], sft.SFTConfig)
    assert generator_rl.finetune == generator_sft.finetune == "full"
    # the RL stage starts from the SFT stage's whole model
    assert generator_rl.model.path == f"{generator_sft.output_dir}/best"


def test_the_label_sft_config_changes_only_its_data():
    base, row = read("sft_example.yaml"), read("clue_label_sft.yaml")
    assert {
        k for k in base.keys() | row.keys() if base.get(k, KeyError) != row.get(k, KeyError)
    } == {
        "data",
        "output_dir",
    }


def test_label_sft_rows_are_the_answer_alone_and_train(tmp_path):
    base = sft_checkpoint(tmp_path / "base")
    gold, rows = tmp_path / "gold.jsonl", tmp_path / "label_sft.jsonl"
    labels = ["sadness", "joy", "sadness", "anger"]
    dataset.save_jsonl(
        [
            data.Example(f"ex-{i}", "meld_emotion", conversation(i), 3, [label])
            for i, label in enumerate(labels)
        ],
        gold,
    )
    dataset.main(["label-sft", str(gold), str(rows)])
    loaded = sft.load_rows(rows)
    assert [r.completion for r in loaded] == [f"</think>\nAnswer: {x}" for x in labels]
    cfg = sft.parse_cli(
        sft.SFTConfig,
        [
            str(CONFIGS / "clue_label_sft.yaml"),
            f"model={base}",
            f"data={rows}",
            f"output_dir={tmp_path / 'run'}",
            "dtype=float32",
            "device=cpu",
            "gradient_checkpointing=false",
            "lora.rank=4",
            "lora.alpha=8",
            "epochs=1",
            "rows_per_update=1",
            "selection.per_task=1",
            "selection.max_new_tokens=4",
        ],
    )
    ids, weights = sft.encode_row(sft.load_tokenizer(str(base)), loaded[0], cfg)
    # </think> Answer : sadness <|im_end|>: the label 0.15, the four others 0.85 / 4 each
    assert [w for w in weights if w] == pytest.approx([0.2125, 0.2125, 0.2125, 0.15, 0.2125])
    run = sft.train(cfg)
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl") if "loss" in m] == [1, 2, 3]
    assert (run / "best" / "adapter_model.safetensors").is_file()


def test_the_rm_pairs_read_checkpoints_the_pair_source_run_keeps():
    """The pair source (the run without R_struct, before any RM: grpo.py's config, no
    content_model) keeps every checkpoint the pairs read, each sampled on its own split."""
    from reward_models import content_rm as reward_model

    rm = load_config(CONFIGS / "social_r1_rm_qwen3_4b.yaml", [], reward_model.RMConfig)
    run = load_config(CONFIGS / "social_r1_rm_source.yaml", [], grpo.GRPOConfig)
    steps = [r.step for r in rm.build.rollouts]
    assert steps == [30, 90, 120, 180, 270, 360, 420, 510, 570, 600]  # Appendix C.2
    assert [r.step for r in rm.build_heldout.rollouts] == steps
    saved = range(run.save_every, run.updates + 1, run.save_every)
    assert set(steps) <= set(saved) and run.keep_checkpoints >= len(saved)
    for split, rollouts in (("", rm.build.rollouts), ("test_", rm.build_heldout.rollouts)):
        assert [r.path for r in rollouts] == [
            f"runs/eval_social_r1_rm_source_{split}step{s}/completions.jsonl" for s in steps
        ]


def test_the_documented_cpt_command_reaches_the_stated_peak_lr():
    commands = {
        line.lstrip("# ").split("#")[0].strip()
        for path in [CONFIGS / "emollm_stage1_cpt.yaml", *(REPO / "docs").glob("*.md")]
        for line in path.read_text(encoding="utf-8").splitlines()
        if "sft.py configs/emollm_stage1_cpt.yaml" in line
    }
    assert len(commands) == 1, commands  # every page gives the same command
    (command,) = commands
    world = re.search(r"--nproc_per_node[= ](\d+)", command)
    world = int(world.group(1)) if world else 1
    cfg = load_config(CONFIGS / "emollm_stage1_cpt.yaml", [], sft.SFTConfig)
    # D.1: per-device batch 16, accumulation 2; the update's 32 rows hold at the command's world
    assert (cfg.lr, cfg.warmup_steps, cfg.batch_size, cfg.rows_per_update) == (1e-4, 100, 16, 32)
    assert sum(len(sft.rank_rows(list(range(32)), r, world)) for r in range(world)) == 32
    rows = 13_000  # about one ESConv context per supporter turn
    total = cfg.epochs * math.ceil(rows / cfg.rows_per_update)
    lrs = [
        linear_warmup_decay(s, total, cfg.lr, cfg.warmup_fraction, cfg.warmup_steps)
        for s in range(total)
    ]
    assert max(lrs) == pytest.approx(1e-4, rel=1e-12) and lrs[99] == max(lrs)
