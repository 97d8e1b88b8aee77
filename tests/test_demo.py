"""demo.py: the toy data against the verifier and the rules judge over real HTTP, the tokenizer and
the random checkpoint against model.py and transformers, a shortened demo run end to end, twice, and
a less shortened one for two seeds that must show GRPO helping."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import data
import dataset
import demo
import rewards
from http_client import JudgeConfig
from model import Qwen
from tokenizer import load_tokenizer
from verifier import EVIDENCE_OPEN, extract_quotes, verify_quote

REPO = Path(__file__).resolve().parents[1]


def test_toy_examples_are_deterministic_and_held_out_conversations_never_train():
    train = demo.toy_examples(400, 3, "train")
    assert train == demo.toy_examples(400, 3, "train") and train != demo.toy_examples(
        400, 4, "train"
    )
    plain = demo.toy_examples(30, 3, "heldout")
    excluded = {demo.conversation_key(plain[0]), demo.conversation_key(plain[9])}
    heldout = demo.toy_examples(30, 3, "heldout", exclude=excluded)
    assert len(heldout) == 30 and not excluded & {demo.conversation_key(e) for e in heldout}
    assert heldout[0].turns != plain[0].turns  # the excluded conversation was drawn again
    assert {e.language for e in train} == {"en", "zh"} and {e.labels[0] for e in train} == set(
        demo._EN_CUES
    )


def test_only_the_cue_tells_the_label():
    """The target turn is a noncommittal line shared by every label; the target speaker's only other
    turn is the cue, which belongs to the gold label."""
    for example in demo.toy_examples(200, 0, "train"):
        lang, target = demo.LANGUAGES[example.language], example.turns[example.target]
        assert example.target == len(example.turns) - 1 and target.text in lang.targets
        own = [t.text for t in example.turns[:-1] if t.speaker == target.speaker]
        assert len(own) == 1 and own[0] in lang.cues[example.labels[0]]


def test_traces_answer_right_and_only_tagged_quotes_earn_iu_g(judge):
    examples = demo.toy_examples(8, 1, "train")
    rollouts = []
    for example in examples:
        for tagged in (True, False):
            trace = demo.toy_trace(example, tagged)
            assert data.well_formed(trace) and data.parse_answer(trace, example) == example.labels
            quotes = extract_quotes(trace)
            texts = rewards.conversation_texts(example)
            assert len(quotes) == (2 if tagged else 0) and all(
                verify_quote(q, texts) for q in quotes
            )
            rollouts.append(
                rewards.Rollout.from_completion(
                    example, trace, count_tokens=lambda _: 60, n_completion_tokens=70
                )
            )
    spec = rewards.RewardSpec("clue", {"lambda_iu": 0.5})
    # `judge` (conftest): the rules judge server
    judge = JudgeConfig(base_url=judge.url, model="rules", retries=0)
    assert rewards.judge_rollouts(rollouts, spec, judge)["failures"] == 0
    # every tagged block is a GAIN
    assert [r.judged["iu"] for r in rollouts] == [[1, 1], [0, 0]] * len(examples)
    assert [rewards.score(r, spec) for r in rollouts] == [1.5, 1.0] * len(examples)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    demo.prepare(out, demo.DemoData(train=40, heldout=10))
    return out


def test_tokenizer_is_read_as_qwen3_with_chatml(base):
    tok = load_tokenizer(base / "base")
    assert tok.family == "qwen3"
    assert tok.eos_token_ids == [tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")]
    assert tok.pad_token_id == tok.token_id("<|endoftext|>")
    example = dataset.load_jsonl(base / "data" / "heldout.jsonl")[0]
    messages = data.get_task(example.task).messages(example)
    ids = tok.chat_ids(messages)
    # byte-level: every prompt, Chinese included, round-trips
    assert tok.decode(ids) == tok.chat(messages)
    # the chat template vLLM's chat endpoint renders
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = json.loads((base / "base" / "tokenizer_config.json").read_text())["chat_template"]
    rendered = (
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        .from_string(template)
        .render(messages=messages, add_generation_prompt=True, enable_thinking=False)
    )
    assert rendered == tok.chat(messages, enable_thinking=False)
    assert (
        ids.count(tok.token_id("<|im_start|>")) == 2 and ids.count(tok.token_id("<|im_end|>")) == 1
    )
    trace = demo.toy_trace(example)
    assert (
        tok.token_id("</think>") in tok.encode(trace)
        and EVIDENCE_OPEN not in tok.tokenizer.get_vocab()
    )


def test_random_checkpoint_loads_here_and_in_transformers(base):
    transformers = pytest.importorskip("transformers")
    ours = Qwen.from_pretrained(base / "base")
    assert ours.config.family == "qwen3" and ours.config.vocab_size % 64 == 0
    # spare rows for the evidence tags
    assert ours.config.vocab_size > len(load_tokenizer(base / "base"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(base / "base").float().eval()
    ids = torch.randint(
        0, ours.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max() < 1e-4
    head = ours.lm_head.weight
    assert abs(head.std().item() - demo.ModelSize.head_std) < 0.01  # the scale init_model documents
    assert (
        abs(ours.model.layers[0].mlp.up_proj.weight.std().item() - demo.ModelSize.init_std) < 0.002
    )


def run_demo(out: Path) -> str:
    command = [
        sys.executable,
        "demo.py",
        "--out",
        str(out),
        "--train",
        "24",
        "--heldout",
        "6",
        "--grpo",
        "updates=2",
        "--grpo",
        "rollout.prompts_per_update=2",
        "--grpo",
        "rollout.group_size=2",
        "--grpo",
        "rollout.max_new_tokens=24",
        # three SFT steps answer nothing yet, so every group's rewards are equal: kept in the loss
        # (verl's way), not masked, they leave the run something to train on
        "--grpo",
        "filtering.enabled=false",
        "--grpo",
        "filtering.mask_equal=false",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_shortened_demo_runs_end_to_end_and_reruns_the_same(tmp_path):
    """A few steps of each stage: every output is written, the table has the three models, and a
    rerun reuses the built data and model and samples exactly the same completions."""
    out = tmp_path / "demo"
    first = run_demo(out)
    results = json.loads((out / "results.json").read_text())
    assert list(results) == ["random init", "after SFT", "after GRPO"]
    for means in results.values():
        assert set(means) == {"accuracy", "invalid", "verified", "reward"}
        assert (
            all(0 <= means[k] <= 1 for k in ("accuracy", "invalid", "verified"))
            and 0 <= means["reward"] <= 1.5
        )
    assert results["random init"]["invalid"] == 1.0  # no answer line from random weights
    assert "| after GRPO |" in first and (out / "results.md").read_text().strip() in first
    for path in (
        "sft/best/adapter_model.safetensors",
        "sft/merged/config.json",
        "grpo/adapter/adapter_config.json",
        "grpo/merged/config.json",
        "grpo/metrics.jsonl",
        "grpo/completions.jsonl",
        "sft/metrics.jsonl",
    ):
        assert (out / path).is_file(), path
    assert len((out / "grpo" / "metrics.jsonl").read_text().splitlines()) == 2
    records = {
        name: (out / "eval" / f"{name}.jsonl").read_text() for name in ("init", "sft", "grpo")
    }
    assert all(len(text.splitlines()) == 6 for text in records.values())

    second = run_demo(out)
    assert "built earlier" in second and "built earlier" not in first
    assert {name: (out / "eval" / f"{name}.jsonl").read_text() for name in records} == records
    assert json.loads((out / "results.json").read_text()) == results
    pytest.importorskip("matplotlib")
    assert (out / "training_curves.png").stat().st_size > 0


# The demo shortened only in its evaluation (200 held-out conversations instead of 1,000): shorter
# training did not show GRPO's direction (measured: SFT on 800 rows learned
# the format but not to copy the cue, 23.5% accuracy; after 10 of the 30 GRPO
# updates seed 0 stood 3.5 points below its SFT model, on the way to 0.5
# above it at update 30). It is the slowest test: two whole demo trainings.
SHORT = ["--heldout", "200"]


@pytest.mark.slow
def test_two_seeds_show_grpo_grounding_its_answers_without_losing_accuracy(tmp_path):
    """`--seeds 0 2` on the demo with a shorter evaluation (seed 2 had the weakest SFT model of
    issue 28's four): for each seed, GRPO raises the verified quotes by at least 20 points and the
    mean reward, and keeps the accuracy within 3 points (6 of the 200 conversations) of the SFT
    model's; the several-seed table has one mean ± SD row per stage and one row per seed."""
    out = tmp_path / "seeds"
    command = [sys.executable, "demo.py", "--out", str(out), "--seeds", "0", "2", *SHORT]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert list(results) == ["0", "2"]
    for seed, stages in results.items():
        sft, grpo = stages["after SFT"], stages["after GRPO"]
        assert grpo["verified"] >= sft["verified"] + 0.2, (seed, sft, grpo)
        assert grpo["reward"] > sft["reward"], (seed, sft, grpo)
        assert grpo["accuracy"] >= sft["accuracy"] - 0.03, (seed, sft, grpo)
    table = (out / "results.md").read_text()
    assert table.strip() in done.stdout and "ETA" in done.stdout
    # 2 seeds, 3 rates
    assert "| after GRPO | " in table and " ± " in table and table.count("% -> ") == 2 * 3
    for seed in (0, 2):
        assert json.loads((out / f"seed{seed}" / "results.json").read_text()) == results[str(seed)]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--heldout", "0"], "--heldout: at least 1 conversation, not 0"),
        (["--train", "-3"], "--train: at least 1 conversation, not -3"),
        (["--out", "{tmp}/mine"], "holds 'keep.txt', which the demo did not write; choose another"),
        (["--out", "{tmp}/mine/keep.txt"], "keep.txt: is a file, not a folder"),
    ],
)
def test_bad_options_stop_in_one_line_before_anything_is_written(tmp_path, capsys, args, expected):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("the user's own file")
    argv = [a.format(tmp=tmp_path) for a in args]
    with pytest.raises(SystemExit) as stop:
        demo.main(argv if "--out" in argv else [*argv, "--out", str(tmp_path / "new")])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and expected in error, error
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["keep.txt", "mine"]
    assert (tmp_path / "mine" / "keep.txt").read_text() == "the user's own file"
