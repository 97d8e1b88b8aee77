"""integrations/: this project's rewards inside TRL's GRPOTrainer, run on a tiny random checkpoint
against the local judge server (TRL is a test-only dependency here; a user brings their own)."""

import functools
import json
import os
import re
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
    read_jsonl,
    run_config,
    tensors,
    write_examples,
    write_tiny_checkpoint,
)

import rewards
from dataset import example_from_json, load_jsonl
from http_client import JudgeConfig
from integrations.trl import examples_dataset, reward_function
from judge_server import JudgeServer, rules_backend
from tokenizer import load_tokenizer


def test_the_dataset_holds_each_examples_prompt_as_our_trainers_render_it(tmp_path):
    pytest.importorskip("datasets")
    from data import get_task

    base, examples = grpo_checkpoint(tmp_path / "base"), write_examples(tmp_path / "ex.jsonl")
    tok = load_tokenizer(base)
    found = load_jsonl(examples)
    rows = examples_dataset(found, tok)
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
            train_dataset=examples_dataset(load_jsonl(examples), tok),
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
    import grpo
    from config import load_config
    from integrations.trl import trl_arguments

    cfg = load_config(REPO / "configs" / "clue_qwen3_5_9b.yaml", [], grpo.GRPOConfig)
    found = trl_arguments(cfg)
    assert (found["max_steps"], found["learning_rate"], found["beta"]) == (723, 1e-5, 0.04)
    assert (found["temperature"], found["top_p"], found["top_k"]) == (1.0, 1.0, 0)
    assert (found["epsilon"], found["epsilon_high"], found["loss_type"]) == (0.2, 0.2, "grpo")
    import trl

    # TRL's own arithmetic (one process): one generation of 8 x 8 completions, every micro-batch
    # of it accumulated into one optimizer step
    args = trl.GRPOConfig(**found | {"use_cpu": True, "bf16": False})
    assert (args.num_generations, args.generation_batch_size) == (8, 64)
    assert args.per_device_train_batch_size == cfg.loss.micro_batch_size == 4
    assert args.steps_per_generation == args.gradient_accumulation_steps == 64 // 4
    assert (args.num_iterations, args.logging_steps) == (1, 1)
    # on 8 processes (TRL's rule: generation batch = micro-batch x processes x steps_per_generation)
    eight = trl_arguments(cfg, 8)
    assert eight["per_device_train_batch_size"] * 8 * eight["steps_per_generation"] == 64
    assert eight["steps_per_generation"] == eight["gradient_accumulation_steps"]


def test_a_grpo_py_config_trains_through_trl(tmp_path, capsys):
    """`python -m integrations.trl CONFIG save_merged=true log_completions=false`: two updates of
    grpo.py's tiny config; grpo.py's end line; adapter/ with its lineage; merged/ a checkpoint
    our model loads with the logits transformers + peft give the base with adapter/; no
    completions logged."""
    pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    import model as M
    from checkpoint import read_lineage
    from integrations import trl as plug

    base, examples = grpo_checkpoint(tmp_path / "base"), write_examples(tmp_path / "ex.jsonl")
    with JudgeServer(rules_backend).start() as server:
        config = run_config(tmp_path, (base, examples), server.url, updates=2)
        plug.main(
            [str(config), "rollout.max_new_tokens=4", "save_merged=true", "log_completions=false"]
        )
    run = tmp_path / "run"
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"done: {run / 'adapter'}: trained ")
    assert read_lineage(run / "adapter") == {"base": str(base.resolve()), "sft_adapter": None}
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    assert read_jsonl(run / "completions.jsonl") == []
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, run / "adapter").eval()
    merged = M.Qwen.from_pretrained(run / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(merged(ids), hf(ids).logits, atol=1e-5)
        with hf.disable_adapter():
            assert not torch.allclose(merged(ids), hf(ids).logits, atol=1e-5)  # it trained


@pytest.mark.slow
def test_a_trl_run_resumes_from_its_newest_checkpoint_with_its_logs_trimmed(tmp_path, capsys):
    """A TRL run of 2 updates loses its last checkpoint (as a kill before it was written would):
    the same command resumes from checkpoint-1 through TRL, metrics.jsonl and completions.jsonl
    trimmed to update 1, so each update is logged once, and ends as a run that did its work."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    import shutil

    from integrations import trl as plug

    base, examples = (
        grpo_checkpoint(tmp_path / "base", seed=2),
        write_examples(tmp_path / "ex.jsonl"),
    )
    run = tmp_path / "run"
    with JudgeServer(rules_backend).start() as server:
        config = run_config(tmp_path, (base, examples), server.url, updates=2)
        argv = [str(config), "rollout.max_new_tokens=8", "rollout.group_size=8"]
        plug.main(argv)
        first = read_jsonl(run / "completions.jsonl")
        shutil.rmtree(run / "checkpoint-2")
        capsys.readouterr()
        plug.main(argv)
    out = capsys.readouterr().out.splitlines()
    assert f"resuming from {run / 'checkpoint-1'} (update 1 of 2)" in out
    assert out[-1].startswith(f"done: {run / 'adapter'}: ")
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    again = read_jsonl(run / "completions.jsonl")
    assert [c["step"] for c in again] == [1] * 16 + [2] * 16
    assert again[:16] == first[:16]  # update 1 kept as it was


def test_trls_schedule_is_grpos_at_every_optimizer_step():
    """lr_factor, TRL's LambdaLR factor of optim.lr, on the paper config with loss.passes=2: both
    optimizer steps of update u run at grpo.lr_at(u) (the floor at update 1, never
    0), over all 723 updates."""
    import grpo
    from config import load_config
    from integrations.trl import lr_factor

    config = REPO / "configs" / "clue_qwen3_5_9b.yaml"
    cfg = load_config(config, ["loss.passes=2"], grpo.GRPOConfig)
    factor = lr_factor(cfg)
    found = [factor(step) * cfg.optim.lr for step in range(2 * 723)]
    paper = grpo.OptimSettings(lr=1e-5, lr_floor=5e-7, warmup_updates=19, hold_until=506)
    expected = [grpo.lr_at(u, paper, 723) for u in range(1, 724)]
    assert found == pytest.approx([lr for lr in expected for _ in (0, 1)], rel=1e-12)
    assert found[0] == pytest.approx(5e-7) and found[2 * 19] == pytest.approx(1e-5)


def test_help_points_to_the_section_of_the_config_it_reads():
    """`python -m integrations.trl --help` reads grpo.py's config: its pointer is grpo.py's section
    of the config reference, a heading that exists (was: #integrationstrlpy, none)."""
    done = subprocess.run(
        [sys.executable, "-m", "integrations.trl", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    pointer = done.stdout.splitlines()[-1]
    assert pointer.endswith("docs/config-reference.md#grpopy"), pointer
    page = (REPO / "docs" / "config-reference.md").read_text(encoding="utf-8")
    assert "\n## grpo.py\n" in page


def run_both(tmp_path, base, examples, judge_url, *overrides):
    """grpo.py and `python -m integrations.trl` on one config, each in its own output_dir; returns
    their exit statuses (0 when main returned)."""
    import grpo
    from integrations import trl as plug

    config = run_config(tmp_path, (base, examples), judge_url, updates=2)
    statuses = {}
    for name, main in (("grpo", grpo.main), ("trl", plug.main)):
        try:
            main([str(config), *overrides, f"output_dir={tmp_path / name}"])
            statuses[name] = 0
        except SystemExit as e:
            statuses[name] = e.code
    return statuses


@pytest.mark.slow
def test_an_update_through_trl_is_an_update_of_grpo_py(tmp_path):
    """grpo.py and the TRL route on the same tiny model, data, seed and config (2 updates of 2
    prompts x 8 completions, loss.passes 2), each checked from its own logs: 2 optimizer steps per
    update (grpo.py's AdamW step count in its checkpoint; TRL's trainer_state.json), a fresh
    generation per update (its completions not the last update's; TRL's own token count grows at
    each), the LR of every update grpo.lr_at's, the CLUE reward's parts in metrics.jsonl,
    and each logged completion's reward and parts what rewards.score gives its logged text, the
    judge asked again, with <evidence> tags in the text (TRL's own completion text drops them)."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    import grpo

    # a vocabulary this small makes answers and evidence tags frequent in random completions
    base = grpo_checkpoint(tmp_path / "base", words=GRPO_WORDS[:3], seed=2)
    examples = write_examples(tmp_path / "ex.jsonl")
    by_id = {e.id: e for e in load_jsonl(examples)}
    tok = load_tokenizer(base)
    spec = rewards.RewardSpec("clue")
    parts = list(rewards.REWARDS["clue"].parts)
    overrides = ["rollout.group_size=8", "rollout.max_new_tokens=8", "loss.passes=2"]
    with JudgeServer(rules_backend).start() as server:
        judge_cfg = JudgeConfig(base_url=server.url, retries=0, concurrency=8)
        assert run_both(tmp_path, base, examples, server.url, *overrides) == {"grpo": 0, "trl": 0}
        for name in ("grpo", "trl"):
            run = tmp_path / name
            metrics, completions = (
                read_jsonl(run / "metrics.jsonl"),
                read_jsonl(run / "completions.jsonl"),
            )
            assert [m["step"] for m in metrics] == [1, 2], name
            short = grpo.OptimSettings(lr=1e-2, lr_floor=5e-7, warmup_updates=1, hold_until=100)
            expected_lr = [grpo.lr_at(u, short, 2) for u in (1, 2)]
            assert [m["lr"] for m in metrics] == pytest.approx(expected_lr, rel=1e-12), name
            for m in metrics:
                assert all(isinstance(m[f"rewards/{p}/mean"], float) for p in parts), name
                assert m["groups/total"] == 2 and isinstance(m["frac_reward_zero_std"], float)
                assert m["tokens/trained"] > 0, name
            steps = [
                [(c["id"], c["completion"]) for c in completions if c["step"] == u] for u in (1, 2)
            ]
            assert [len(s) for s in steps] == [16, 16], name
            assert not set(steps[0]) & set(steps[1]), name  # update 2 trained fresh completions
            assert any("evidence>" in c["completion"] for c in completions), name
            again = [
                rewards.Rollout.from_completion(
                    by_id[c["id"]],
                    c["completion"],
                    count_tokens=lambda text: len(tok.encode(text)),
                    n_completion_tokens=len(tok.encode(c["completion"])),
                    step=c["step"],
                    total_steps=2,
                )
                for c in completions
            ]
            rewards.judge_rollouts(again, spec, judge_cfg)
            for c, r in zip(completions, again):
                assert c["reward"] == rewards.score(r, spec), (name, c)
                for p, part in rewards.REWARDS["clue"].parts.items():
                    assert c[p] == part(r, spec.params), (name, p, c)
    # optimizer steps: AdamW's own count in grpo.py's last checkpoint, TRL's trainer state
    assert tensors(tmp_path / "grpo" / "ckpt-000002" / "optimizer.safetensors")["0.step"] == 4
    state = json.loads((tmp_path / "trl" / "checkpoint-4" / "trainer_state.json").read_text())
    logged = [h for h in state["log_history"] if "loss" in h]
    assert state["global_step"] == 4 and [h["step"] for h in logged] == [2, 4]
    assert logged[0]["num_tokens"] < logged[1]["num_tokens"]  # TRL generated for update 2 too


# ---------------------------------------------------------------- the TRL route's start-up and end


def no_model(monkeypatch):
    """Make loading a model through transformers an assertion failure."""
    transformers = pytest.importorskip("transformers")

    def refused(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refused)


def folder_state(folder: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


def test_the_trl_route_stops_before_any_model_loads_on_a_judge_nobody_serves(
    tmp_path, assets, monkeypatch, capsys
):
    """grpo.py's start-up probe on the TRL route: the judge asked once, one line, exit 2, nothing
    written (was: two steps of loss 0, an adapter saved, exit 0)."""
    pytest.importorskip("trl")
    from instruments import free_port

    from integrations import trl as plug

    no_model(monkeypatch)
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    config = run_config(tmp_path, assets, url, **{"judge.backoff": 0.01})
    with pytest.raises(SystemExit) as stop:
        plug.main([str(config)])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        f"error: 'judge': asked once before the run: judge at {url}/chat/completions: "
        "ConnectionError (ConnectionRefusedError: [Errno 111] Connection refused), still failing "
        "after 3 attempts\n"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("train_data", ["{tmp}/missing.jsonl"], "{tmp}/missing.jsonl: file not found"),
        ("model.path", "{tmp}/no_model", "{tmp}/no_model has no config.json"),
        ("model.sft_adapter", "{adapter}", "TRL loads one model folder"),
        ("output_dir", "{base}", "is, holds or sits inside model.path"),
        ("output_dir", "{base}/run", "is, holds or sits inside model.path"),
        ("output_dir", "{base_parent}", "is, holds or sits inside model.path"),
        ("loss.adv_std", "population", "TRL divides by the unbiased std only"),
        ("lora.compute", "model", "peft computes the LoRA in its own dtype"),
    ],
)
def test_the_trl_route_checks_its_inputs_before_any_model_loads(
    tmp_path, monkeypatch, capsys, key, value, problem
):
    """A missing data file or model folder, an SFT adapter, an output_dir that is, holds or sits
    inside the model: one line naming the config and the key, exit 2, before a model loads, the
    model's folder untouched (was: tracebacks after the model loaded, exit 1, or TRL's tokenizer
    written over the checkpoint's)."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    from helpers import sft_adapter

    from integrations import trl as plug

    base = grpo_checkpoint(tmp_path / "models" / "base")
    adapter = sft_adapter(base, tmp_path / "sft")
    examples = write_examples(tmp_path / "ex.jsonl")
    names = {"tmp": tmp_path, "base": base, "adapter": adapter, "base_parent": base.parent}

    def fill(text):
        return text.format(**names)

    value = [fill(v) for v in value] if isinstance(value, list) else fill(value)
    config = run_config(tmp_path, (base, examples), "http://127.0.0.1:9/v1", **{key: value})
    before = folder_state(base)
    no_model(monkeypatch)
    with pytest.raises(SystemExit) as stop:
        plug.main([str(config)])
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    # the file, and the key's line where the key is in it
    assert err.count("\n") == 1 and re.match(
        rf"error: {re.escape(str(config))}(:\d+)?: '{key}': ", err
    ), err
    assert fill(problem) in err
    assert folder_state(base) == before
    assert not (tmp_path / "run").exists()


def test_the_trl_route_stops_when_every_reward_is_missing(tmp_path, assets, monkeypatch, capsys):
    """A reward that reads a judge output nobody asks for (every reward None, as in
    test_honest_endings.py for grpo.py): after filtering.max_unscored_updates updates that trained
    nothing, a checkpoint and grpo.py's line naming the cause, exit 1, no adapter (was: loss 0,
    grad_norm 0 throughout, an adapter, exit 0)."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    from integrations import trl as plug

    monkeypatch.setattr(rewards, "REWARDS", dict(rewards.REWARDS))

    @rewards.reward()
    def judged_politeness(rollout, cfg):
        value = rollout.judged.get("politeness")
        return None if value is None else float(value)

    overrides = {"reward.name": "judged_politeness", "filtering.max_unscored_updates": 2}
    config = run_config(tmp_path, assets, "http://127.0.0.1:9/v1", updates=5, **overrides)
    with pytest.raises(SystemExit) as stop:
        plug.main([str(config), "rollout.max_new_tokens=4"])
    run = tmp_path / "run"
    assert stop.value.code == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: 2 updates in a row trained nothing (filtering.max_unscored_updates), the last "
        "update 2: rewards were missing in 2 of 2 groups; no judge call failed: the reward reads a "
        "judge output that no judge was asked for (a judge-backed reward must declare its judges: "
        f"docs/adding-a-reward.md). Checkpoint saved: the same command resumes from {run}"
    )
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [(m["step"], m["tokens/trained"], m["groups/unscored"]) for m in metrics] == [
        (1, 0, 2),
        (2, 0, 2),
    ]
    assert (run / "checkpoint-2" / "trainer_state.json").is_file()
    assert not (run / "adapter").exists()


def test_a_trl_run_whose_rewards_never_differ_in_a_group_ends_non_zero(
    tmp_path, assets, judge, capsys
):
    """No group of either update has two different rewards, so no completion has an advantage and
    nothing is trained: grpo.py's `the run trained nothing` line, exit 1 (was: `done`-less exit
    0)."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    from integrations import trl as plug

    config = run_config(tmp_path, assets, judge.url, updates=2)
    with pytest.raises(SystemExit) as stop:
        plug.main([str(config), "rollout.max_new_tokens=6", "loss.micro_batch_size=4"])
    run = tmp_path / "run"
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["frac_reward_zero_std"] for m in metrics] == [1.0, 1.0]
    calls = sum(m["judge/calls"] for m in metrics)
    summary = (
        "trained 0 completion tokens in 0 of 2 updates; 4 of 4 groups masked (0 for missing "
        f"rewards); judge: 0 of {calls} calls failed"
    )
    assert stop.value.code == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: the run trained nothing: {summary}; {run / 'adapter'} holds the starting model"
    )


def test_verls_overrides_refuse_a_std_verl_cannot_divide_by(tmp_path, capsys):
    """loss.adv_std=population (EmoLLM's): verl's GRPO divides by the unbiased std or by nothing,
    so the command refuses in one line, exit 2 (was: norm_adv_by_std_in_grpo=False printed, exit
    0: no std at all)."""
    from integrations import verl as plug

    config = str(REPO / "configs" / "clue_qwen3_5_9b.yaml")
    with pytest.raises(SystemExit) as stop:
        plug.main(["overrides", "train.parquet", config, "loss.adv_std=population"])
    captured = capsys.readouterr()
    assert stop.value.code == 2 and captured.out == ""
    assert captured.err == (
        f"error: {config}: 'loss.adv_std': verl's GRPO divides by the unbiased std only\n"
    )


# ------------------------------------------------------------------------- verl's parquet command


def parquet_run(tmp_path, capsys, *args):
    from integrations import verl as plug

    try:
        plug.main(["parquet", *map(str, args)])
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def test_verls_parquet_writes_every_example_and_leaves_no_temporary(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    examples = write_examples(tmp_path / "ex.jsonl")
    out = tmp_path / "verl" / "train.parquet"
    assert parquet_run(tmp_path, capsys, examples, out)[0] == 0
    assert len(datasets.Dataset.from_parquet(str(out))) == 4
    capsys.readouterr()  # datasets' progress bars
    assert sorted(p.name for p in out.parent.iterdir()) == ["train.parquet"]
    # an existing output is refused, and replaced with --overwrite
    code, err = parquet_run(tmp_path, capsys, examples, out)
    assert (
        code == 2
        and err == f"error: 'output': {out} exists; name a new file, or pass --overwrite\n"
    )
    assert parquet_run(tmp_path, capsys, "--overwrite", examples, out)[0] == 0


@pytest.mark.parametrize(
    ("case", "line"),
    [
        (
            "forgotten output",
            "'output': {b} is not a .parquet name (the last argument is the output)",
        ),
        (
            "output is an input",
            "'output': {tmp}/a.parquet is also 'input': name another file to write",
        ),
        ("missing file", "{tmp}/missing.jsonl: no such data file"),
        ("bad line", "{tmp}/bad.jsonl:2: "),
        ("folder as output", "'output': {tmp}/verl is a folder; name the file to write"),
        ("empty input", "{tmp}/empty.jsonl: no examples (the file is empty)"),
    ],
)
def test_verls_parquet_refuses_bad_input_in_one_line_and_writes_nothing(
    tmp_path, capsys, case, line
):
    """`parquet a.jsonl b.jsonl` (the output forgotten) leaves the user's b.jsonl as it was; an
    output that is an input, a missing file, a bad line, a folder as output, an empty input: one
    line, exit 2, nothing written (was: b.jsonl turned into parquet, tracebacks, a 0-row
    parquet)."""
    pytest.importorskip("datasets")
    a, b = write_examples(tmp_path / "a.jsonl"), write_examples(tmp_path / "b.jsonl")
    (tmp_path / "bad.jsonl").write_text(a.read_text().splitlines()[0] + "\n{not json\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "verl").mkdir()
    out = tmp_path / "out.parquet"
    args = {
        "forgotten output": [a, b],
        "output is an input": [b, tmp_path / "a.parquet", tmp_path / "a.parquet"],
        "missing file": [a, tmp_path / "missing.jsonl", out],
        "bad line": [a, tmp_path / "bad.jsonl", out],
        "folder as output": [a, tmp_path / "verl"],
        "empty input": [tmp_path / "empty.jsonl", out],
    }[case]
    (tmp_path / "a.parquet").write_bytes(b"PAR1")  # a parquet file given as an input
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    code, err = parquet_run(tmp_path, capsys, *args)
    assert code == 2, err
    assert err.startswith("error: " + line.format(tmp=tmp_path, b=b)) and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    assert not any((tmp_path / "verl").iterdir())


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
        "extra": {k: [float(x) for x in v] for k, v in out["reward_extra_info"].items()},
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
    # the reward's parts beside each response (verl's rollout dumps keep them)
    for name, part in rewards.REWARDS["clue"].parts.items():
        assert found["extra"][name] == [float(part(r, cfg.reward.params)) for r in again], name


# run in the verl venv: verl's Hydra config composed with our overrides, the LR scheduler its FSDP
# engine builds from it (the run's length set as RayPPOTrainer sets it), stepped through the run
VERL_SCHEDULE = """
import json, sys, types
import torch
from hydra import compose, initialize_config_dir
import verl
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

configs = str(__import__("pathlib").Path(verl.__file__).parent / "trainer" / "config")
found = []
for overrides in json.load(open(sys.argv[1])):
    with initialize_config_dir(config_dir=configs, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    actor = config.actor_rollout_ref.actor
    actor.optim.total_training_steps = config.trainer.total_training_steps
    optim = omega_conf_to_dataclass(actor.optim)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    engine = types.SimpleNamespace(optimizer_config=optim, rank=1)
    scheduler = FSDPEngine._build_lr_scheduler(engine, optimizer)
    lrs = []
    for _ in range(config.trainer.total_training_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    found.append({
        "lrs": lrs,
        "prompts": config.data.train_batch_size,
        "n": config.actor_rollout_ref.rollout.n,
        "mini_batch": actor.ppo_mini_batch_size,
        "epochs": actor.ppo_epochs,
        "betas": list(optim.betas),
    })
json.dump(found, open(sys.argv[2], "w"))
"""


def test_verls_composed_config_takes_the_configs_steps_and_schedule(tmp_path):
    """configs/clue_qwen3_5_9b.yaml's verl overrides composed against verl's own config, as is
    (723 updates: verl's cosine), with updates=100 (inside the hold: verl's constant) and with
    loss.passes=2. Steps per generation by verl's rule (RayPPOTrainer._update_actor: mini-batches
    of ppo_mini_batch_size x n, ppo_epochs times): loss.passes, over one generation of P x K. The
    LR verl's FSDP engine schedules at every update against grpo.lr_at: within lr_floor
    in the warm-up (verl starts it from 0: update 1 at LR 0), equal from the peak through the hold
    in a run that ends inside it, and in the long run the docs' number at update 506, where verl's
    cosine has left the hold behind, and lr_floor at the end."""
    if not (VERL_VENV / "bin" / "python").is_file():
        pytest.skip(f"no verl venv at {VERL_VENV} (build it with `bash .ci/verl_venv.sh`)")
    import grpo
    from config import load_config
    from integrations.verl import verl_overrides

    runs = [[], ["updates=100"], ["loss.passes=2"]]
    cfgs = [
        load_config(REPO / "configs" / "clue_qwen3_5_9b.yaml", extra, grpo.GRPOConfig)
        for extra in runs
    ]
    spec = [verl_overrides(cfg, str(tmp_path / "train.parquet")) for cfg in cfgs]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run = subprocess.run(
        [str(VERL_VENV / "bin" / "python"), "-c", VERL_SCHEDULE, "spec.json", "out.json"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads((tmp_path / "out.json").read_text())
    for cfg, verl in zip(cfgs, found):
        r, o = cfg.rollout, cfg.optim
        assert verl["prompts"] * verl["n"] == r.prompts_per_update * r.group_size == 64
        steps = verl["epochs"] * (verl["prompts"] * verl["n"]) // (verl["mini_batch"] * verl["n"])
        assert steps == cfg.loss.passes
        assert verl["betas"] == list(o.betas) and len(verl["lrs"]) == cfg.updates
        ours = [grpo.lr_at(u, o, cfg.updates) for u in range(1, cfg.updates + 1)]
        w = o.warmup_updates
        assert verl["lrs"][0] == 0 and ours[0] == o.lr_floor
        assert all(abs(a - b) <= o.lr_floor for a, b in zip(verl["lrs"][:w], ours[:w]))
        assert verl["lrs"][w] == pytest.approx(o.lr) == ours[w]
    short = found[1]["lrs"]
    assert short[19:] == pytest.approx([1e-5] * 81)  # the hold to the end, as grpo.py's
    long = found[0]["lrs"]
    assert long[-1] == pytest.approx(5e-7, rel=1e-3)
    table = (REPO / "docs" / "scale.md").read_text(encoding="utf-8")
    assert f"update 506 at {long[505] / 1e-5:.2f} of the peak" in table


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


def test_trl_refuses_model_py_s_own_speed_settings():
    """lora.compute and model.compile act on model.py's layers, which TRL does not run."""

    import grpo
    from config import ConfigError
    from integrations import trl as plug

    cfg = grpo.GRPOConfig("run", ["x.jsonl"], grpo.ModelSettings(path="m", compile=True))
    with pytest.raises(ConfigError, match="'model.compile': TRL's model is transformers'"):
        plug.trl_arguments(cfg)
