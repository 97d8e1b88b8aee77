"""reward_models/content_rm.py, Social-R1's content RM, on a tiny random-weight checkpoint (no
downloads): the Bradley-Terry loss and its gradient against hand values, a tiny RM learning to rank
a synthetic preference set it could not rank before, the value-head file, tiers and the priority
scheme on hand-made segments, the pair builder against a real local teacher server (resumed after
failed calls), and one-line errors for bad pair files."""

import hashlib
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import REPO, assert_sinks_hold_metrics, metrics, tensors
from helpers import sft_checkpoint as write_checkpoint
from safetensors import safe_open

import http_client
import judge
from data import Example, Turn
from dataset import example_to_json
from http_client import JudgeConfig
from judge import SIP_REFERENCE_SYSTEM
from judge_server import JudgeServer
from reward_models import content_rm as RM


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"))


# ----------------------------------------------------------------------------- the loss


def test_bt_loss_and_its_gradient_match_a_hand_computation():
    chosen = torch.tensor([1.0, -0.5, 2.0], requires_grad=True)
    rejected = torch.tensor([0.2, 0.5, 2.0], requires_grad=True)
    loss = RM.bt_loss(chosen, rejected)
    diffs = [0.8, -1.0, 0.0]
    # -log sigmoid(d) = log(1 + e^-d); d/dr_chosen =
    # -sigmoid(-d) / N, d/dr_rejected = +sigmoid(-d) / N
    assert loss.item() == pytest.approx(
        sum(math.log(1 + math.exp(-d)) for d in diffs) / 3, rel=1e-6
    )
    loss.backward()
    expected = [-1 / (1 + math.exp(d)) / 3 for d in diffs]
    assert chosen.grad.tolist() == pytest.approx(expected, rel=1e-6)
    assert rejected.grad.tolist() == pytest.approx([-g for g in expected], rel=1e-6)
    # a micro-batch's part of a larger update divides by the update's pair count
    assert RM.bt_loss(chosen[:1], rejected[:1], 4).item() == pytest.approx(
        math.log(1 + math.exp(-0.8)) / 4, rel=1e-6
    )


# ----------------------------------------------------------------------------- training


def synthetic_pairs(n: int, seed: int = 0) -> list[dict]:
    """The context says how a person feels; the chosen segment says the same, the rejected one the
    opposite. Which word is right flips with the context, so a random model ranks about half the
    pairs right."""
    rng, fill = random.Random(seed), "the exam I failed again We won bid knew you would".split()
    pairs = []
    for i in range(n):
        name, good = ("Ann", "Bo", "Cy", "Di")[i % 4], rng.choice(["glad", "sad"])
        bad = "sad" if good == "glad" else "glad"
        words = " ".join(rng.sample(fill, 2))
        pairs.append(
            {
                "context": f"{name} says {' '.join(rng.sample(fill, 3))} . {name} is {good} .",
                "chosen": f"{name} is {good} so {words}",
                "rejected": f"{name} is {bad} so {words}",
                "tiers": "A>B",
            }
        )
    return pairs


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_tiny_rm_learns_to_rank_a_synthetic_preference_set(checkpoint, tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", synthetic_pairs(160))
    cfg = RM.RMConfig(
        model=str(checkpoint),
        pairs=str(pairs),
        output_dir=str(tmp_path / "rm"),
        heldout_fraction=0.25,
        epochs=3,
        lr=3e-3,
        batch_size=8,
        grad_accum=1,
        warmup_fraction=0.0,
    )
    cfg.lora.dropout = 0.0
    state = RM.train(cfg)
    print(
        f"held-out pairwise accuracy: {state['heldout_accuracy_before']:.3f} before, "
        f"{state['heldout_accuracy']:.3f} after ({state['heldout_pairs']} pairs)"
    )
    assert state["heldout_pairs"] == 40 and 0.3 <= state["heldout_accuracy_before"] <= 0.7
    assert state["heldout_accuracy"] >= 0.95
    out = tmp_path / "rm"
    info = json.loads((out / RM.RM_INFO).read_text())
    assert info["heldout_accuracy"] == state["heldout_accuracy"] and info["base_model"] == str(
        checkpoint
    )
    with safe_open(str(out / RM.HEAD_FILE), framework="pt") as f:  # the documented head format
        assert sorted(f.keys()) == ["bias", "weight"] and f.metadata()["format"] == RM.HEAD_FORMAT
        assert (
            list(f.get_tensor("weight").shape) == [1, 32]
            and f.get_tensor("weight").dtype == torch.float32
        )
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    card = (out / "README.md").read_text()  # the model card: base, method, data, metrics, config
    assert f"- base model: `{checkpoint}`" in card and "RM_content" in card
    assert f"- `{pairs}`: sha256 `{hashlib.sha256(Path(pairs).read_bytes()).hexdigest()}`" in card
    last = metrics(out)[-1]
    assert f"| eval/heldout_accuracy | {last['eval/heldout_accuracy']:.6g} |" in card
    assert yaml.safe_load(card.split("```yaml\n")[1].split("```")[0])["pairs"] == str(pairs)
    # read back, the RM ranks the held-out contexts as
    # the trainer reported, and R_content = sigmoid(r)
    content = RM.load_reward_model(out)
    _, held = RM.split_heldout(RM.load_pairs(pairs), 0.25, cfg.seed)
    rewards = content.rewards([(p.context, s) for p in held for s in (p.chosen, p.rejected)])
    wins = sum(c > r for c, r in zip(rewards[0::2], rewards[1::2])) / len(held)
    assert wins == pytest.approx(state["heldout_accuracy"])
    scores = content.scores([(held[0].context, held[0].chosen)])
    assert (
        scores[0] == pytest.approx(1 / (1 + math.exp(-rewards[0])), rel=1e-5) and 0 < scores[0] < 1
    )


def test_report_to_tensorboard_holds_every_metric_of_an_rm_run(checkpoint, tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", synthetic_pairs(16))
    settings = dict(heldout_fraction=0.25, epochs=1, eval_every=1, report_to=["tensorboard"])
    RM.train(RM.RMConfig(str(checkpoint), str(pairs), output_dir=str(tmp_path / "rm"), **settings))
    assert_sinks_hold_metrics(tmp_path / "rm")


@pytest.mark.slow
def test_a_killed_rm_run_resumes_to_the_same_model_as_a_run_never_stopped(checkpoint, tmp_path):
    """SIGKILL (no chance to save) once ckpt-000003 exists, run again (resume: auto): the LoRA, the
    value head, AdamW and the held-out accuracies equal an uninterrupted run's bitwise, with dropout
    on, and no step is logged twice."""
    pairs = write_jsonl(tmp_path / "pairs.jsonl", synthetic_pairs(48))

    def run(name, kill_after=None):
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        raw = {
            "model": str(checkpoint),
            "pairs": str(pairs),
            "output_dir": str(folder / "rm"),
            "epochs": 2,
            "lr": 3e-3,
            "batch_size": 4,
            "grad_accum": 1,
            "warmup_fraction": 0.0,
            "heldout_fraction": 0.25,
            "save_every": 1,
            "lora": {"rank": 4, "alpha": 8, "dropout": 0.1},
        }
        (folder / "rm.yaml").write_text(json.dumps(raw))  # JSON is YAML
        process = subprocess.Popen(
            [sys.executable, "-m", "reward_models.content_rm", str(folder / "rm.yaml")],
            cwd=tmp_path,
            env=os.environ | {"PYTHONPATH": str(REPO)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        while kill_after and not (folder / "rm" / f"ckpt-{kill_after:06d}").is_dir():
            assert process.poll() is None, process.stderr.read()
            time.sleep(0.005)
        if kill_after:
            process.send_signal(signal.SIGKILL)
        process.wait(timeout=300)
        return process.returncode, folder / "rm"

    assert run("whole")[0] == 0
    code, killed = run("killed", kill_after=3)
    steps = 2 * 9  # 36 training pairs (12 held out) in updates of 4, two epochs
    assert code == -signal.SIGKILL and not (killed / RM.RM_INFO).exists()
    assert run("killed")[0] == 0
    whole = tmp_path / "whole" / "rm"
    for folder in (f"ckpt-{steps:06d}", "."):
        for file in ("adapter_model.safetensors", RM.HEAD_FILE) + (
            ("optimizer.safetensors",) if folder != "." else ()
        ):
            a, b = tensors(whole / folder / file), tensors(killed / folder / file)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (folder, file)
    info = [json.loads((run_dir / RM.RM_INFO).read_text()) for run_dir in (whole, killed)]
    assert info[0] == info[1] and info[0]["training_pairs"] == 36 and info[0]["heldout_pairs"] == 12
    drop = ("tokens_per_s", "elapsed_s")
    logged = [
        [{k: v for k, v in m.items() if k not in drop} for m in metrics(r)] for r in (whole, killed)
    ]
    assert logged[0] == logged[1] and [m["step"] for m in logged[0] if "loss" in m] == list(
        range(1, steps + 1)
    )


def test_held_out_pairs_never_share_a_context_with_training_pairs():
    pairs = [RM.pair_from_json(p) for p in synthetic_pairs(40)] * 2  # every context twice
    train, held = RM.split_heldout(pairs, 0.2, 0)
    assert held and not {p.context for p in train} & {p.context for p in held}
    assert len(train) + len(held) == 80


# -------------------------------------------------------------------- tiers and the priority scheme


def seg(text, step, correct, score):
    return RM.RatedSegment("x", step, text, correct, score)


def test_tiers_follow_the_papers_boundaries():
    rule = RM.TierRule()
    tiers = [
        RM.tier_of(seg("s", 1, c, s), rule)
        for c, s in [
            (True, 0.8),
            (True, 0.95),
            (True, 0.79),
            (True, 0.6),
            (True, 0.59),
            (True, 0.0),
            (False, 0.2),
            (False, 0.0),
            (False, 0.21),
            (False, 0.9),
            (True, None),
        ]
    ]
    assert tiers == ["A", "A", "B", "B", "C", "C", "D", "D", None, None, None]


def test_the_priority_scheme_pairs_hand_made_tiers():
    segments = [
        seg("a1 good reading", 600, True, 0.9),
        seg("a2 fine reading", 90, True, 0.85),
        seg("b1 partly right", 300, True, 0.7),
        seg("c1 right answer wrong reading", 30, True, 0.4),
        seg("d1 wrong", 30, False, 0.1),
        seg("w1 wrong but plausible", 90, False, 0.5),
        seg("early long rambling reading that circles back over and over again", 30, True, 0.7),
    ]
    pairs = RM.instance_pairs(
        "the reference", segments, RM.TierRule(), RM.SchemeSettings(per_instance=100)
    )
    got = {(p["tiers"], p["chosen"].split()[0], p["rejected"].split()[0]) for p in pairs}
    assert got == {
        ("S>C", "the", "c1"),  # P0
        ("A>C", "a1", "c1"),
        ("A>C", "a2", "c1"),  # P1
        ("A>B", "a1", "b1"),
        ("A>B", "a2", "b1"),
        ("A>B", "a1", "early"),
        ("A>B", "a2", "early"),  # P2
        ("B>D", "b1", "d1"),
        ("B>D", "early", "d1"),  # P3; the wrong answer scored 0.5 is no D
        # P4: late (step >= median 90, above the first) A/B
        # segments over early, >= 1.5x longer, no better scored
        ("late>early", "a1", "early"),
        ("late>early", "a2", "early"),
        ("late>early", "b1", "early"),
        ("late>early", "a1", "c1"),
        ("late>early", "a2", "c1"),
        ("late>early", "b1", "c1"),  # c1: 5 words >= 1.5 x 3
    }
    order = [p["tiers"] for p in pairs]
    assert order == sorted(order, key=list(RM.SCHEME.values()).index)  # priority order
    capped = RM.instance_pairs(
        "the reference", segments, RM.TierRule(), RM.SchemeSettings(per_instance=3)
    )
    # the cap keeps the highest priorities
    assert [p["tiers"] for p in capped] == ["S>C", "A>C", "A>B"]


STEPS = (30, 90, 120, 180, 270, 360, 420, 510, 570, 600)  # Appendix C.2's checkpoints


def paper_instance() -> list:
    """60 segments, the paper's 10 checkpoints x K = 6: per checkpoint an A (0.9, 4 words), two B
    (0.7; 12 words before step 360, the median, else 4), a C (0.4) at the first four checkpoints
    and an A elsewhere, a D (wrong, 0.1) and a wrong answer scored 0.5 (no tier)."""
    segments = []
    for step in STEPS:
        b_words = 12 if step < 360 else 4
        rows = [
            ("a", True, 0.9, 4),
            ("b", True, 0.7, b_words),
            ("bb", True, 0.7, b_words),
            ("c" if step <= 180 else "aa", True, 0.4 if step <= 180 else 0.85, 4),
            ("d", False, 0.1, 4),
            ("w", False, 0.5, 4),
        ]
        for name, correct, score, words in rows:
            text = " ".join([f"{name}{step}"] + ["word"] * (words - 1))
            segments.append(seg(text, step, correct, score))
    return segments


def test_sixty_segments_give_every_pair_type_its_share():
    segments = paper_instance()
    tiers = [RM.tier_of(x, RM.TierRule()) for x in segments]
    # by hand: A 10 + 6, B 20, C 4, D 10, and 10 untiered
    assert [tiers.count(t) for t in ("A", "B", "C", "D", None)] == [16, 20, 4, 10, 10]
    pairs = RM.instance_pairs("the reference", segments, RM.TierRule(), RM.SchemeSettings())
    counts = {t: [p["tiers"] for p in pairs].count(t) for t in RM.SCHEME.values()}
    # 29 round-robin: S>C has only 4 (one reference x 4 C); four full rounds (20), then the other
    # four rules twice more (28), then A>C, first in priority, the 29th
    assert counts == {"S>C": 4, "A>C": 7, "A>B": 6, "B>D": 6, "late>early": 6}
    # P4: a late (step >= 360) A or B of 4 words over an early B of 12 words, no better scored
    late_early = [p for p in pairs if p["tiers"] == "late>early"]
    assert all(int(p["chosen"].split()[0].lstrip("ab")) >= 360 for p in late_early)
    assert all(len(p["rejected"].split()) == 12 for p in late_early)
    assert len({(p["chosen"], p["rejected"]) for p in pairs}) == 29
    # the test instances' share (2K pairs from 100): 20, four rounds of five
    held = RM.instance_pairs(
        "the reference", segments, RM.TierRule(), RM.SchemeSettings(per_instance=20)
    )
    assert [p["tiers"] for p in held].count("late>early") == 4 and len(held) == 20
    # 700 such instances give the paper's 20K pairs, 100 test instances its 2K
    assert 700 * len(pairs) == 20_300 and 100 * len(held) == 2_000


# --------------------------------------------------------------------------- building the pair file


def tom_example(i: int) -> Example:
    return Example(
        id=f"tom-{i}",
        task="tom_mc",
        turns=[Turn("", f"Story {i}: Ann hides the key; Bo is away.")],
        target=None,
        labels=["A"],
        meta={
            "question": "Where will Bo look?",
            "options": ["Where he left it", "Where Ann hid it"],
        },
    )


class Teacher:
    """A scripted teacher: four stage lines and the gold answer for a reference request; a
    segment's score is the number after 'score=' in it. Requests for segments naming 'flaky' fail
    with HTTP 500 while `flaky` is set."""

    def __init__(self):
        self.calls, self.flaky, self.lock = [], True, threading.Lock()

    def __call__(self, messages, params):
        system, user = messages[0]["content"], messages[-1]["content"]
        with self.lock:
            self.calls.append(user)
        if system == SIP_REFERENCE_SYSTEM:
            return (
                "Encoding: Bo saw the key\nInterpretation: Bo believes it is there\nGoal: find "
                "it\nResponse: he looks where he left it\nAnswer: A"
            )
        reasoning = re.search(r"<reasoning>\n(.*?)\n</reasoning>", user, re.DOTALL).group(1)
        if "flaky" in reasoning and self.flaky:
            raise RuntimeError("injected")
        if "garbled" in reasoning:
            return "no score here"
        return f"scripted | {re.search(r'score=([0-9.]+)', reasoning).group(1)}"


def test_pairs_are_built_through_the_teacher_and_a_rerun_asks_only_what_failed(tmp_path):
    examples = [tom_example(0), tom_example(1)]
    examples[1].meta["reference"] = (
        "Encoding: given\nInterpretation: given\nGoal: given\nResponse: given"
    )
    (tmp_path / "ex.jsonl").write_text(
        "".join(json.dumps(example_to_json(e)) + "\n" for e in examples)
    )
    rows = [
        (0, "tom-0", "score=0.9 Bo left it there", "A"),
        (0, "tom-0", "score=0.4 lucky guess", "A"),
        (30, "tom-0", "score=0.1 Ann hid it", "B"),
        (30, "tom-0", "flaky score=0.7 close", "A"),
        (0, "tom-1", "score=0.3 shallow", "A"),
        (30, "tom-1", "garbled", "A"),
    ]
    for step in (0, 30):
        write_jsonl(
            tmp_path / f"c{step}.jsonl",
            [
                {"id": i, "completion": f"<think>\n{r}\n</think>\n\nAnswer: {a}"}
                for s, i, r, a in rows
                if s == step
            ],
        )
    teacher = Teacher()
    with JudgeServer(teacher).start() as server:
        build = RM.PairsConfig(
            examples=str(tmp_path / "ex.jsonl"),
            out=str(tmp_path / "pairs.jsonl"),
            rollouts=[
                RM.RolloutFile(0, str(tmp_path / "c0.jsonl")),
                RM.RolloutFile(30, str(tmp_path / "c30.jsonl")),
            ],
            teacher=JudgeConfig(base_url=server.url, retries=0, concurrency=4),
        )
        with pytest.raises(
            RM.JudgeError, match="1 teacher calls failed, the first: judge at .* HTTP 500.*; rerun"
        ):
            RM.build_pairs(build)
        assert len(teacher.calls) == 1 + 6  # one reference (tom-1 has its own), six segments
        teacher.flaky, teacher.calls = False, []
        counts = RM.build_pairs(build)
    assert len(teacher.calls) == 1 and "flaky" in teacher.calls[0]  # the journal kept the rest
    # the garbled answer was journaled as malformed by the
    # first run: this run counts it unrated, not malformed
    assert counts == {
        "segments": 6,
        "references_missing": 0,
        "unrated": 1,
        "pairs": 5,
        "tier_A": 1,
        "tier_B": 1,
        "tier_C": 2,
        "tier_D": 1,
        "P0": 2,
        "P1": 1,
        "P2": 1,
        "P3": 1,
        "P4": 0,
        "malformed": 0,
    }
    written = (tmp_path / "pairs.jsonl").read_bytes()
    (tmp_path / "c0.jsonl").write_text("")
    with pytest.raises(RM.DataError, match=r"c0.jsonl: no completion \(step 0's evaluation"):
        RM.build_pairs(build)  # a checkpoint's rollouts missing: the pair file is kept
    unreasoned = json.dumps({"id": "tom-0", "completion": ""}) + "\n"
    for name in ("c0.jsonl", "c30.jsonl"):
        (tmp_path / name).write_text(unreasoned)
    with pytest.raises(RM.DataError, match="^rollouts: no completion with a reasoning segment in"):
        RM.build_pairs(build)
    assert (tmp_path / "pairs.jsonl").read_bytes() == written
    pairs = RM.load_pairs(tmp_path / "pairs.jsonl")
    got = {(p.id, p.tiers, p.chosen.split()[0], p.rejected.split()[0]) for p in pairs}
    assert got == {
        ("tom-0", "S>C", "Encoding:", "score=0.4"),
        ("tom-0", "A>C", "score=0.9", "score=0.4"),
        ("tom-0", "A>B", "score=0.9", "flaky"),
        ("tom-0", "B>D", "flaky", "score=0.1"),
        ("tom-1", "S>C", "Encoding:", "score=0.3"),
    }
    by_id = {e.id: e for e in examples}
    assert all(p.context == RM.rm_context(by_id[p.id]) for p in pairs)


def test_pairs_builds_the_held_out_file_from_other_instances(tmp_path, capsys):
    files = {}
    for name, ids in (("train", (0, 1)), ("test", (2,)), ("leaky", (1, 2))):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text(
            "".join(json.dumps(example_to_json(tom_example(i))) + "\n" for i in ids)
        )
        write_jsonl(
            tmp_path / f"{name}_c.jsonl",
            [
                {"id": f"tom-{i}", "completion": f"<think>\nscore={s} {k}\n</think>\n\nAnswer: A"}
                for i in ids
                for k, s in enumerate((0.9, 0.7, 0.4))
            ],
        )
    with JudgeServer(Teacher()).start() as server:
        teacher = {"base_url": server.url, "retries": 0}

        def section(name, out, per_instance):
            return {
                "examples": str(files[name]),
                "rollouts": [{"step": 30, "path": str(tmp_path / f"{name}_c.jsonl")}],
                "out": str(out),
                "teacher": teacher,
                "scheme": {"per_instance": per_instance},
            }

        held = tmp_path / "held.jsonl"
        raw = {
            "model": "unused",
            "pairs": str(tmp_path / "pairs.jsonl"),
            "heldout": str(held),
            "build": section("train", tmp_path / "pairs.jsonl", 29),
            "build_heldout": section("test", held, 2),
        }
        config = tmp_path / "rm.yaml"
        config.write_text(json.dumps(raw))
        RM.main(["pairs", str(config)])
        # S>C, A>C, A>B per instance (one A, B, C each), the held-out instance capped at 2
        assert {p.id for p in RM.load_pairs(tmp_path / "pairs.jsonl")} == {"tom-0", "tom-1"}
        assert [(p.id, p.tiers) for p in RM.load_pairs(held)] == [
            ("tom-2", "S>C"),
            ("tom-2", "A>C"),
        ]
        raw["build_heldout"] = section("leaky", held, 2)
        config.write_text(json.dumps(raw))
        with pytest.raises(SystemExit) as stop:
            RM.main(["pairs", str(config)])
    assert stop.value.code == 2
    assert "1 held-out instances are also training instances" in capsys.readouterr().err


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "case, field",
    [
        ("missing", "rejected"),
        ("identical", "rejected"),
        ("tiers", "tiers"),
        ("unknown", "score"),
        ("empty", "context"),
    ],
)
def test_a_bad_pair_file_stops_with_one_line_naming_file_line_and_field(
    tmp_path, capsys, case, field
):
    pairs = synthetic_pairs(3)
    bad = pairs[1]
    if case == "missing":
        del bad["rejected"]
    elif case == "identical":
        bad["rejected"] = bad["chosen"] + "  "
    elif case == "tiers":
        bad["tiers"] = "C>A"
    elif case == "unknown":
        bad["score"] = 1
    else:
        bad["context"] = " "
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    config = tmp_path / "rm.yaml"
    config.write_text(
        f"model: {tmp_path / 'no-model'}\npairs: {path}\noutput_dir: {tmp_path / 'out'}\n"
    )
    with pytest.raises(SystemExit) as stop:
        RM.main([str(config)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: {path}:2: field '{field}'"), err
    assert not (tmp_path / "out").exists()  # stopped before any model loads


# ----------------------------------------------------------------------------- serving it


def test_a_served_rm_answers_the_r_content_prompt_as_the_in_process_rm_scores_it(
    checkpoint, tmp_path
):
    qwen = RM.Qwen.from_pretrained(checkpoint)
    RM.add_lora(qwen)
    rm = RM.RewardModel(qwen, seed=3)
    rm.head.bias.data.fill_(0.3)
    RM.save_reward_model(rm, tmp_path / "rm", str(checkpoint), 256)
    local = RM.load_reward_model(tmp_path / "rm")
    example = tom_example(0)
    segments = ["Ann hides the key so Bo is sad", "Bo knew you would", "the exam"]
    expected = local.scores([(RM.rm_context(example), s) for s in segments])
    assert len(set(expected)) == 3
    with JudgeServer(RM.RewardModelBackend(str(tmp_path / "rm"))).start() as server:
        cfg = JudgeConfig(base_url=server.url, retries=0)
        calls = [
            (judge.sip_content_request(example, s, ref), judge.parse_sip_content)
            for s in segments
            for ref in (None, "Encoding: a reference the RM does not read")
        ]
        values, _ = http_client.ask(calls, cfg)
        with pytest.raises(http_client.JudgeError, match="HTTP 400.*only the SIP content"):
            http_client.chat(
                judge.sip_structure_request(example, "r").messages,
                base_url=server.url,
                model="rm",
                retries=0,
            )
    # the judge format has two decimals: a served score is the in-process one rounded
    assert values == [round(e, 2) for e in expected for _ in range(2)]


def test_the_paper_config_parses_with_the_papers_values():
    cfg = RM.parse_cli(
        RM.RMConfig,
        [str(Path(__file__).resolve().parents[2] / "configs/social_r1_rm_qwen3_4b.yaml")],
    )
    assert cfg.epochs == 2 and cfg.model.endswith("Qwen3-4B-Instruct-2507")
    assert [r.step for r in cfg.build.rollouts] == [30, 90, 120, 180, 270, 360, 420, 510, 570, 600]
    assert (cfg.build.tiers.a_min, cfg.build.tiers.b_min) == (
        0.8,
        0.6,
    ) and cfg.build.teacher.api_key_env


# ----------------------------------------------------------------------------- social_r1 in GRPO


def structure_judge(messages, params):
    """A scripted SIP-structure judge (the rules backend has none): every stage done."""
    return "\n".join(f"{stage}: scripted | YES" for stage in judge.SIP_STAGES)


@pytest.mark.parametrize("mode", ["in-process", "served"])
def test_social_r1_takes_r_content_from_the_trained_rm_in_a_grpo_run(tmp_path, mode):
    from helpers import grpo_checkpoint, read_jsonl, run_config, write_examples

    from reward_models import social_r1

    # no references
    base, examples = grpo_checkpoint(tmp_path / "base"), write_examples(tmp_path / "train.jsonl")
    qwen = RM.Qwen.from_pretrained(base)
    RM.add_lora(qwen)
    RM.save_reward_model(RM.RewardModel(qwen, seed=5), tmp_path / "rm", str(base), 512)
    content = RM.load_reward_model(tmp_path / "rm")
    with (
        JudgeServer(structure_judge).start() as structure,
        JudgeServer(RM.RewardModelBackend(str(tmp_path / "rm"))).start() as served,
    ):
        rm = (
            {"path": str(tmp_path / "rm")}
            if mode == "in-process"
            else {"endpoint": {"base_url": served.url}}
        )
        config = run_config(
            tmp_path,
            (base, examples),
            structure.url,
            updates=2,
            reward={"name": "social_r1"},
            content_model=rm,
            filtering={"enabled": False},
        )
        social_r1.main([str(config)])
    by_id = {e.id: e for e in RM.load_jsonl(examples)}
    records = read_jsonl(tmp_path / "run" / "completions.jsonl")
    assert len(records) == 2 * 2 * 4 and all(r["R_struct"] == 1.0 for r in records)
    expected = content.scores(
        [(RM.rm_context(by_id[r["id"]]), RM.rm_segment(r["completion"])) for r in records]
    )
    got = [r["R_content"] for r in records]
    assert got == (
        pytest.approx(expected, abs=1e-6)
        if mode == "in-process"
        else [round(e, 2) for e in expected]
    )
    assert all(r["reward"] is not None for r in records)


def test_a_content_model_is_for_social_r1_only_and_must_exist(tmp_path, capsys):
    from helpers import run_config, write_examples

    from reward_models import social_r1

    examples = write_examples(tmp_path / "train.jsonl")
    for overrides, message in [
        (
            {"reward": {"name": "clue"}, "content_model": {"path": str(tmp_path)}},
            "'content_model': reward social_r1 only",
        ),
        (
            {"reward": {"name": "social_r1"}, "content_model": {"path": str(tmp_path)}},
            f"'content_model.path': {tmp_path} has no reward_model.json",
        ),
    ]:
        config = run_config(tmp_path, (tmp_path, examples), "http://127.0.0.1:9/v1", **overrides)
        with pytest.raises(SystemExit) as stop:
            social_r1.main([str(config)])
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


# ----------------------------------------------------------------------------- the whole chain


def chain_judge(messages, params):
    """The teacher, the judges and the pair scorer of the content-RM chain: a reference ending in
    the gold A; every SIP stage done; a content score set by the reasoning's length (0 to 1 in
    quarters), so that segments fall into every tier."""
    system, user = messages[0]["content"], messages[-1]["content"]
    if system == SIP_REFERENCE_SYSTEM:
        stages = "\n".join(f"{stage}: Ann hid the key" for stage in judge.SIP_STAGES)
        return stages + "\nAnswer: A"
    if system == judge._SIP_STRUCTURE_SYSTEM:
        return structure_judge(messages, params)
    reasoning = re.search(r"<reasoning>\n(.*?)\n</reasoning>", user, re.DOTALL).group(1)
    return f"scripted | {len(reasoning.split()) % 5 / 4:.2f}"


@pytest.mark.slow
def test_the_content_rm_chain_runs_in_the_documented_order(tmp_path, monkeypatch, capsys):
    """docs/paper-configs.md's chain with the shipped configs, shrunk to the tiny model by
    overrides only, in the folders the configs name (relative to the working directory): the
    references, the pair-source run (no RM yet), each checkpoint exported and sampled on both
    splits, the pairs, the RM, then the main run scoring R_content with that RM."""
    from helpers import grpo_checkpoint

    import evaluate
    import grpo
    from prepare import references
    from reward_models import social_r1
    from tools.export_checkpoint import export_checkpoint

    words = ["Ann", "hid", "key", "so", "</think>\nAnswer: A", "</think>\nAnswer: B"]
    base = grpo_checkpoint(tmp_path / "base", words=words)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name, ids in (("gold", range(4)), ("test", range(4, 6))):
        Path(f"data/tombench_hard_{name}.jsonl").write_text(
            "".join(json.dumps(example_to_json(tom_example(i))) + "\n" for i in ids)
        )
    config = lambda name: str(REPO / "configs" / name)  # noqa: E731
    tiny = [f"model.path={base}", "model.dtype=float32", "model.gradient_checkpointing=false"]
    tiny += ["updates=2", "rollout.prompts_per_update=2", "rollout.max_new_tokens=8"]
    tiny += ["loss.micro_batch_size=5", "judge.retries=0"]
    steps = (1, 2)
    with JudgeServer(chain_judge).start() as server:
        url = [f"judge.base_url={server.url}"]
        references.main(
            [config("social_r1_qwen3_8b_prepare.yaml"), f"teacher.base_url={server.url}"]
        )
        try:  # 1. the pair source: R_content from the prompted judge, a checkpoint an update
            grpo.main([config("social_r1_rm_source.yaml"), *tiny, *url, "save_every=1"])
        finally:
            torch.distributed.destroy_process_group()
        for step in steps:  # 2. each checkpoint exported, then K samples on each split
            export = f"runs/social_r1_rm_source/export-{step}"
            export_checkpoint(f"runs/social_r1_rm_source/ckpt-{step:06d}", export)
            for name, split in (
                ("social_r1_rm_rollouts", ""),
                ("social_r1_rm_rollouts_heldout", "test_"),
            ):
                evaluate.main(
                    [
                        config(f"{name}.yaml"),
                        f"checkpoint={export}",
                        f"output_dir=runs/eval_social_r1_rm_source_{split}step{step}",
                        "n_samples=6",
                        "sampling.max_new_tokens=8",
                        "device=cpu",
                    ]
                )
        path = "runs/eval_social_r1_rm_source_{}step{}/completions.jsonl"
        rollouts = {
            split: "["
            + ", ".join(f"{{step: {s}, path: {path.format(split, s)}}}" for s in steps)
            + "]"
            for split in ("", "test_")
        }
        endpoints = [
            f"{section}.{role}.{key}={value}"
            for section in ("build", "build_heldout")
            for role in ("teacher", "scorer")
            for key, value in (("base_url", server.url), ("api_key_env", "null"))
        ]
        rm_tiny = [f"model={base}", "dtype=float32", "gradient_checkpointing=false", "device=cpu"]
        rm_tiny += ["epochs=1", "batch_size=2", "grad_accum=1", "max_length=512"]
        rm_tiny += ["lora.rank=4", "lora.alpha=8"]
        RM.main(  # 3. the pairs, both splits
            [
                "pairs",
                config("social_r1_rm_qwen3_4b.yaml"),
                *rm_tiny,
                *endpoints,
                f"build.rollouts={rollouts['']}",
                f"build_heldout.rollouts={rollouts['test_']}",
            ]
        )
        RM.main([config("social_r1_rm_qwen3_4b.yaml"), *rm_tiny])  # 4. the RM
        try:  # 5. the main run, R_content from that RM
            social_r1.main([config("social_r1_qwen3_8b.yaml"), *tiny, *url])
        finally:
            torch.distributed.destroy_process_group()
    pairs = RM.load_pairs("data/social_pairs.jsonl")
    assert pairs and RM.load_pairs("data/social_pairs_heldout.jsonl")
    info = json.loads(Path("runs/social_r1_rm_qwen3_4b/reward_model.json").read_text())
    assert info["base_model"] == str(base)
    records = [json.loads(line) for line in open("runs/social_r1_qwen3_8b/completions.jsonl")]
    rm = RM.load_reward_model("runs/social_r1_rm_qwen3_4b")
    examples = {e.id: e for e in RM.load_jsonl("data/tombench_hard_train.jsonl")}
    expected = rm.scores(
        [(RM.rm_context(examples[r["id"]]), RM.rm_segment(r["completion"])) for r in records]
    )
    assert [r["R_content"] for r in records] == pytest.approx(expected, abs=1e-6)
    assert Path("runs/social_r1_qwen3_8b/model/config.json").is_file()
