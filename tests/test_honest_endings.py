"""A run ends with exit 0 only when it did what its command asked (DESIGN.md, honest endings): GRPO
with a judge nobody serves or one that refuses the request, a judge-backed reward that declares no
judge, a short run of a paper schedule that trains nothing, the end line and the model card, and an
RL adapter evaluated on the model it was trained on. The preparations' and the benchmark table's
cases are in test_sft.py, prepare/test_emollm_seeds.py and test_evaluate.py, by their helpers."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import read_jsonl, run_config, sft_adapter, write_examples
from instruments import free_port

import evaluate as ev
import grpo
import model as M
import rewards
from dialogue import rl as dialogue_rl
from judge_server import JudgeServer, UnsupportedRequest

REPO = Path(__file__).resolve().parents[1]


def test_a_judge_nobody_serves_stops_the_run_before_any_model_loads(
    tmp_path, assets, monkeypatch, capsys
):
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(grpo.Qwen, "from_pretrained", no_load)
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    config = run_config(tmp_path, assets, url, **{"judge.backoff": 0.01})
    with pytest.raises(SystemExit) as stop:
        grpo.main([str(config)])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        f"error: 'judge': asked once before the run: judge at {url}/chat/completions: "
        "ConnectionError (ConnectionRefusedError: [Errno 111] Connection refused), still failing "
        "after 3 attempts\n"
    )
    assert not (tmp_path / "run").exists()


def test_a_judge_that_refuses_the_runs_kind_of_request_stops_with_the_servers_reason(
    tmp_path, assets, capsys
):
    def refuses(messages, params):
        raise UnsupportedRequest("this server only grades essays")

    with JudgeServer(refuses).start() as server:
        with pytest.raises(SystemExit) as stop:
            grpo.main([str(run_config(tmp_path, assets, server.url))])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        f"error: 'judge': asked once before the run: judge at {server.url}/chat/completions "
        'refused the request: HTTP 400: {"error": {"message": "this server only grades essays", '
        '"type": "invalid_request_error", "code": 400}}\n'
    )
    assert server.requests_seen == 1 and not (tmp_path / "run").exists()


def test_a_judge_backed_reward_that_declares_no_judge_saves_and_stops(
    tmp_path, assets, judge, monkeypatch, capsys
):
    """docs/adding-a-reward.md's first draft: a reward reading a judge output that nothing asks for.
    Every reward is None, every group masked: after filtering.max_unscored_updates such updates the
    run saves and stops, naming the cause."""
    monkeypatch.setattr(rewards, "REWARDS", dict(rewards.REWARDS))

    @rewards.reward()
    def judged_politeness(rollout, cfg):
        value = rollout.judged.get("politeness")
        return None if value is None else float(value)

    overrides = {"reward.name": "judged_politeness", "filtering.max_unscored_updates": 2}
    config = run_config(tmp_path, assets, judge.url, updates=5, **overrides)
    with pytest.raises(SystemExit) as stop:
        grpo.main([str(config)])
    run = tmp_path / "run"
    assert stop.value.code == 1
    assert capsys.readouterr().err == (
        "error: 2 updates in a row trained nothing (filtering.max_unscored_updates), the last "
        "update 2: rewards were missing in 2 of 2 groups; no judge call failed: the reward reads a "
        "judge output that no judge was asked for (a judge-backed reward must declare its judges: "
        f"docs/adding-a-reward.md). Checkpoint saved: the same command resumes from {run}\n"
    )
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-000001", "ckpt-000002"]
    assert not (run / "adapter").exists()


def test_a_short_run_of_a_paper_schedule_says_so_and_ends_non_zero_having_trained_nothing(
    tmp_path, assets, judge, capsys
):
    """updates=2 on the paper's schedule (19 warm-up updates, the hold to 506): the line before the
    first update; every group of both updates has equal rewards, so nothing is trained, and the run
    says so instead of `done`."""
    schedule = {"lr": 1e-2, "lr_floor": 5e-7, "warmup_updates": 19, "hold_until": 506}
    config = run_config(tmp_path, assets, judge.url, updates=2, optim=schedule)
    with pytest.raises(SystemExit) as stop:
        grpo.main([str(config)])
    run = tmp_path / "run"
    captured = capsys.readouterr()
    last_lr = 5e-7 + (1e-2 - 5e-7) * 1 / 19  # update 2, one nineteenth of the way up
    note = (
        "schedule: updates=2 ends inside the warm-up (optim.warmup_updates=19): the LR rises from "
        f"5e-07 to {last_lr:.3g}, never to optim.lr=0.01"
    )
    assert captured.out.splitlines()[0] == note and "step 1/2" in captured.out.splitlines()[1]
    metrics = read_jsonl(run / "metrics.jsonl")
    calls = sum(m["judge/calls"] for m in metrics)
    summary = (
        f"trained 0 completion tokens in 0 of 2 updates; 4 of 4 groups masked (0 for missing "
        f"rewards); judge: 0 of {calls} calls failed"
    )
    assert stop.value.code == 1 and captured.err == (
        f"error: the run trained nothing: {summary}; {run / 'adapter'} holds the starting model\n"
    )
    card = (run / "adapter" / "README.md").read_text()
    assert f"## What was trained\n\n- {summary}\n- {note}\n" in card


def test_rollouts_that_fail_at_a_saved_update_keep_its_checkpoint(
    tmp_path, assets, judge, monkeypatch, capsys
):
    """The rollouts of update 2 fail (a dead rollout server) after ckpt-1 was saved: the run stops
    with exit 1 and keeps ckpt-1 as it was, not saved again (was: re-saved, the old folder deleted
    first, so a kill mid-save left no run to resume); the same command resumes from it."""
    from rollout import RolloutError

    collect, saved = grpo.collect_groups, []

    def dies_at_update_1(sampler, source, slots, cfg, update, ranks, play):
        if update == 1:
            raise RolloutError("the server at X failed")
        return collect(sampler, source, slots, cfg, update, ranks, play)

    def save_checkpoint(output_dir, step, *args, **kwargs):
        saved.append(step)
        return real_save(output_dir, step, *args, **kwargs)

    real_save = grpo.save_checkpoint
    monkeypatch.setattr(grpo, "collect_groups", dies_at_update_1)
    monkeypatch.setattr(grpo, "save_checkpoint", save_checkpoint)
    config = run_config(tmp_path, assets, judge.url, filtering={"resamples": 3, "replacements": 2})
    with pytest.raises(SystemExit) as stop:
        grpo.main([str(config)])
    assert stop.value.code == 1 and saved == [1], saved
    assert "stopped after update 1: the rollouts failed" in capsys.readouterr().err
    monkeypatch.setattr(grpo, "collect_groups", collect)
    grpo.main([str(config)])
    assert "resuming from" in capsys.readouterr().out and saved == [1, 2, 3]


def test_the_end_line_and_the_model_card_say_what_was_trained(tmp_path, assets, judge, capsys):
    config = run_config(tmp_path, assets, judge.url, filtering={"resamples": 3, "replacements": 2})
    grpo.main([str(config)])
    run = tmp_path / "run"
    metrics = read_jsonl(run / "metrics.jsonl")
    tokens = sum(m["tokens/trained"] for m in metrics)
    masked, groups = sum(m["groups/masked"] for m in metrics), 3 * 2  # 2 prompts per update
    assert 0 < tokens and 0 < masked < groups
    trained = sum(m["tokens/trained"] > 0 for m in metrics)
    summary = (
        f"trained {tokens:,} completion tokens in {trained} of 3 updates; {masked} of {groups} "
        f"groups masked (0 for missing rewards); judge: 0 of "
        f"{sum(m['judge/calls'] for m in metrics)} calls failed"
    )
    assert capsys.readouterr().out.splitlines()[-1] == f"done: {run / 'adapter'}: {summary}"
    assert f"## What was trained\n\n- {summary}\n" in (run / "adapter" / "README.md").read_text()


def test_an_rl_adapter_is_evaluated_on_the_model_it_was_trained_on(tmp_path, assets, judge):
    """GRPO from an SFT adapter trains a LoRA on the SFT-merged base: the adapter's lineage names
    both, `evaluate.py checkpoint=BASE adapter=RUN/adapter` merges the chain (the logits of the
    run's merged/), and another checkpoint stops with one line naming both and the command."""
    base, _ = assets
    sft = sft_adapter(base, tmp_path / "sft")
    config = run_config(
        tmp_path,
        assets,
        judge.url,
        save_merged=True,
        filtering={"resamples": 3, "replacements": 2},
        **{"model.sft_adapter": str(sft)},
    )
    grpo.main([str(config)])
    run = tmp_path / "run"
    lineage = json.loads((run / "adapter" / "lineage.json").read_text())
    assert lineage == {"base": str(base.resolve()), "sft_adapter": str(sft.resolve())}
    card = (run / "adapter" / "README.md").read_text()
    assert f"- base model: `{base}`\n- stands on: the SFT adapter `{sft}`, merged into" in card

    examples = write_examples(tmp_path / "eval.jsonl")
    cfg = ev.EvalConfig(
        output_dir=str(tmp_path / "eval"),
        sets=[ev.EvalSet(name="toy", path=str(examples))],
        checkpoint=str(base),
        adapter=str(run / "adapter"),
        device="cpu",
        dtype="float32",
    )
    chain, _ = ev.load_model(cfg)
    merged = M.Qwen.from_pretrained(run / "merged", dtype="float32")
    ids = torch.tensor([[1, 5, 7, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(chain(ids), merged(ids), rtol=1e-5, atol=1e-5)
    assert ev.model_identity(cfg)["sft_adapter"] == str(sft.resolve())

    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(
        yaml.safe_dump(
            {
                "output_dir": str(tmp_path / "eval-wrong"),
                "sets": [{"name": "toy", "path": str(examples)}],
                "checkpoint": str(run / "merged"),
                "adapter": str(run / "adapter"),
            }
        )
    )
    with pytest.raises(SystemExit) as stop:
        ev.main([str(wrong)])
    assert stop.value.code == 2 and not (tmp_path / "eval-wrong").exists()


def test_an_adapter_on_another_base_is_one_line_naming_both_and_the_command(tmp_path, capsys):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "lineage.json").write_text(
        json.dumps({"base": "/models/base", "sft_adapter": "/runs/sft/best"})
    )
    examples = write_examples(tmp_path / "eval.jsonl")
    config = tmp_path / "eval.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "output_dir": str(tmp_path / "eval"),
                "sets": [{"name": "toy", "path": str(examples)}],
                "checkpoint": "/models/other",
                "adapter": str(adapter),
            }
        )
    )
    with pytest.raises(SystemExit) as stop:
        ev.main([str(config)])
    assert stop.value.code == 2 and capsys.readouterr().err == (
        f"error: adapter {adapter} was trained on /models/base with the SFT adapter "
        "/runs/sft/best merged in, not on checkpoint /models/other: evaluate it with "
        f"checkpoint=/models/base adapter={adapter} (the SFT adapter is merged first), or "
        f"checkpoint={tmp_path / 'merged'} adapter=null where the run saved one\n"
    )
    assert not (tmp_path / "eval").exists()


def test_a_dialogue_runs_simulator_nobody_serves_stops_the_run_before_any_model_loads(
    tmp_path, assets, judge, monkeypatch, capsys
):
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(grpo.Qwen, "from_pretrained", no_load)
    base, _ = assets
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    argv = [
        str(REPO / "configs" / "dialogue_demo.yaml"),
        f"output_dir={tmp_path / 'run'}",
        f"train_data=[{REPO / 'configs' / 'dialogue_demo_scenarios.jsonl'}]",
        f"model.path={base}",
        f"judge.base_url={judge.url}",
        f"dialogue.simulator={{base_url: {url}, retries: 0, backoff: 0.01}}",
    ]
    with pytest.raises(SystemExit) as stop:
        dialogue_rl.main(argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        f"error: 'dialogue.simulator': asked once before the run: judge at {url}/chat/"
        "completions: ConnectionError (ConnectionRefusedError: [Errno 111] Connection refused), "
        "still failing after 3 attempts\n"
    )
    assert not (tmp_path / "run").exists()
