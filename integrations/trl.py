"""This project's rewards and data inside TRL's GRPOTrainer, for runs that outgrow one node (TRL
trains on accelerate or DeepSpeed across nodes, with vLLM rollouts): docs/scale.md.

    accelerate launch -m integrations.trl configs/clue_qwen3_5_9b.yaml model.path=MERGED_SFT \
        model.sft_adapter=null          # grpo.py's config, its settings mapped (trl_arguments)

or, in your own script:

    from integrations.trl import examples_dataset, reward_function
    tok = load_tokenizer("checkpoints/Qwen3.5-9B")        # this project's tokenizer.py
    dataset = examples_dataset(load_jsonl("data/clue_rl.jsonl"), tok)
    clue = reward_function(RewardSpec("clue", {"lambda_iu": 0.5}), JudgeConfig(base_url=...), tok)
    trl.GRPOTrainer(model=..., reward_funcs=[clue], train_dataset=dataset, args=...).train()

`python -m integrations.trl` runs grpo.py's update through TRL: one generation of
prompts_per_update x group_size completions per update, `loss.passes` optimizer steps over it, the
LR of `grpo.lr_at` at every step (`lr_factor`, TRL's scheduler), and grpo.py's
outputs: metrics.jsonl (one line per update, grpo.py's keys), completions.jsonl (the text the
reward scored), `adapter/` (or `model/`), `merged/` with `save_merged`, and its end line and exit
status. It starts as grpo.py does (grpo.start_up: the inputs checked before any model loads, every
judge the reward needs asked once) and refuses what TRL cannot do as the config says
(check_inputs); what still differs is docs/scale.md's table.

A reward reads what grpo.py's does: the completion decoded from its token ids with special tokens
kept (TRL's own completion text drops them, and with them the <evidence> tags the verifier
reads), T counted by the tokenizer, the update t and the run's length T_total from TRL's state
(Social-R1's w(t)), and the judges it needs asked all at once (rewards.judge_rollouts). A reward
that cannot be scored (a judge failed) is None: TRL leaves that completion out of its group's
baseline, its advantage 0.
One difference in what the policy reads: TRL tokenizes the prompt text itself, so a tag that the
task's instructions spell (`<evidence>`) becomes that special token, where our trainers encode
message text as plain text. TRL, transformers, peft and datasets are the user's: imported lazily
(integrations.require)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

import grpo
import rewards
from checkpoint import LINEAGE, publish_folder, staging_folder, trim_log
from config import (
    ConfigError,
    ConfigSource,
    MetricsWriter,
    config_error,
    parse_cli,
    print0,
    read_metrics,
    save_resolved_config,
)
from data import Example, count_tokens, get_task, split_completion
from dataset import example_from_json, example_to_json
from distributed import Ranks
from http_client import JudgeAuthError, JudgeConfig
from integrations import exits_if_missing, require
from rollout import end_line, run_summary, unscored_cause, unscored_stop, update_metrics
from tokenizer import CheckpointError, QwenTokenizer, load_tokenizer
from verifier import extract_quotes


def examples_dataset(
    examples: list[Example], tok: QwenTokenizer, enable_thinking: bool | None = None
):
    """A `datasets.Dataset` of `examples` (data.py's), one row each: `prompt`, the chat text our
    trainers sample under (the task's messages in `tok`'s chat format, the generation prompt
    appended), and `example`, the example as JSON for the reward."""
    datasets = require("datasets")  # TRL's own dependency, not this project's
    rows = [
        {
            "prompt": tok.chat(get_task(e.task).messages(e), enable_thinking=enable_thinking),
            "example": json.dumps(example_to_json(e), ensure_ascii=False),
        }
        for e in examples
    ]
    return datasets.Dataset.from_list(rows)


def reward_function(
    spec: rewards.RewardSpec,
    judge_cfg: JudgeConfig,
    tok: QwenTokenizer,
    passes: int = 1,
    record: Callable[[list[dict], dict, float], None] | None = None,
) -> Callable[..., list[float | None]]:
    """`spec`'s reward in TRL's reward-function contract: called with the batch's `prompts`,
    `completions`, `completion_ids`, the dataset's `example` column and `trainer_state`, it returns
    one reward (or None) per completion, the value rewards.score gives the same completion. The
    update t counts TRL's optimizer steps in `passes` (num_iterations) per update. `record`, when
    given, gets each call's completions as completions.jsonl lines (with the reward's parts, the
    token count and whether it ran out of tokens), the judges' call statistics and their
    seconds."""
    eos = set(tok.eos_token_ids)
    parts = rewards.REWARDS[spec.name].parts

    def reward(
        prompts, completions, completion_ids, example, trainer_state=None, **_: Any
    ) -> list[float | None]:
        step, total = (
            (trainer_state.global_step // passes + 1, max(1, trainer_state.max_steps // passes))
            if trainer_state is not None
            else (0, 1)
        )
        rollouts = []
        for raw, ids in zip(example, completion_ids, strict=True):
            ids = list(ids)
            rollouts.append(
                rewards.Rollout.from_completion(
                    example_from_json(json.loads(raw)),
                    tok.decode(ids[:-1] if ids and ids[-1] in eos else ids),
                    count_tokens=lambda text: count_tokens(text, tok),
                    n_completion_tokens=len(ids),
                    step=step,
                    total_steps=total,
                )
            )
        start = time.perf_counter()
        stats = rewards.judge_rollouts(rollouts, spec, judge_cfg)
        scores = [rewards.score(r, spec) for r in rollouts]
        if record is not None:
            lines = [
                {
                    "id": r.example.id,
                    "prompt": prompt,
                    "completion": r.completion,
                    "reward": score,
                    **{name: part(r, spec.params) for name, part in parts.items()},
                    "tokens": len(ids),
                    "truncated": not ids or ids[-1] not in eos,
                }
                for prompt, r, score, ids in zip(prompts, rollouts, scores, completion_ids)
            ]
            record(lines, stats, time.perf_counter() - start)
        return scores

    reward.__name__ = spec.name  # the name TRL logs the reward under
    return reward


# grpo.py's loss aggregation in TRL's names
LOSS_TYPES = {"seq-mean-token-mean": "grpo", "token-mean": "dapo"}


def processes() -> int:
    """The number of training processes, as accelerate's launcher sets it."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def trl_arguments(cfg: grpo.GRPOConfig, n_processes: int = 1) -> dict[str, Any]:
    """trl.GRPOConfig's keyword arguments for grpo.py's update on `n_processes` processes. One
    update is one optimizer step over one generation of prompts_per_update x group_size
    completions, `loss.passes` times (TRL's num_iterations): each process's share is split into
    micro-batches of at most loss.micro_batch_size (memory only: the largest size that divides the
    share, so every micro-batch weighs the same) accumulated into one step, and TRL generates once
    per step's worth of micro-batches (steps_per_generation = gradient_accumulation_steps). Then the
    sampling, the KL weight, the clip range, the aggregation, AdamW and the peak LR, which the
    scheduler scales (`lr_factor`); TRL logs once per update. What TRL has no setting for is not
    carried (docs/scale.md): group filtering, the curriculum; the LoRA goes to trl.GRPOTrainer as a
    peft config (`peft_lora`). A setting TRL cannot follow raises ConfigError naming it."""
    r, loss, optim = cfg.rollout, cfg.loss, cfg.optim
    cpu = cfg.model.device == "cpu" or not torch.cuda.is_available()
    if loss.adv_std != "unbiased":
        raise ConfigError("'loss.adv_std': TRL divides by the unbiased std only")
    if optim.lr == 0:
        raise ConfigError("'optim.lr': 0; TRL's scheduler scales the peak LR, which must be > 0")
    if cfg.lora is not None and cfg.lora.compute != "float32":
        raise ConfigError("'lora.compute': peft computes the LoRA in its own dtype; leave float32")
    if cfg.model.compile:
        raise ConfigError("'model.compile': TRL's model is transformers', not model.py's layers")
    completions = r.prompts_per_update * r.group_size
    if completions % n_processes:
        raise ConfigError(
            f"'rollout.prompts_per_update': an update's {r.prompts_per_update} x {r.group_size} "
            f"completions do not split evenly over {n_processes} processes"
        )
    share = completions // n_processes
    micro = max(n for n in range(1, loss.micro_batch_size + 1) if share % n == 0)
    return dict(
        output_dir=cfg.output_dir,
        max_steps=cfg.updates * loss.passes,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=share // micro,
        steps_per_generation=share // micro,
        num_generations=r.group_size,
        num_iterations=loss.passes,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        repetition_penalty=r.repetition_penalty,
        beta=loss.beta,
        epsilon=loss.clip_low,
        epsilon_high=loss.clip_high,
        loss_type=LOSS_TYPES[loss.agg],
        scale_rewards="group",
        learning_rate=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        max_grad_norm=optim.grad_clip,
        activation_checkpointing=cfg.model.gradient_checkpointing,
        save_steps=cfg.save_every * loss.passes,
        save_total_limit=cfg.keep_checkpoints,
        logging_steps=loss.passes,
        seed=cfg.seed,
        report_to=[],  # metrics.jsonl and report_to's sinks are written by UpdateLog
        bf16=cfg.model.dtype == "bfloat16" and not cpu,  # accelerate's bf16 is for GPUs
        use_cpu=cpu,
    )


def lr_factor(cfg: grpo.GRPOConfig) -> Callable[[int], float]:
    """TRL's LR schedule (a LambdaLR factor of optim.lr) at optimizer step s, counted from 0: the
    LR grpo.py's update s // loss.passes + 1 runs at (grpo.lr_at)."""
    optim, passes = cfg.optim, cfg.loss.passes
    return lambda step: grpo.lr_at(step // passes + 1, optim, cfg.updates) / optim.lr


def peft_lora(lora):
    """Our LoraSettings as peft's LoraConfig (peft: TRL's LoRA route, the user's install)."""
    return require("peft").LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.targets),
    )


def check_inputs(cfg: grpo.GRPOConfig, config_path: str | ConfigSource) -> list[Example]:
    """What this route adds to grpo.py's checks, then grpo.check_inputs (the reward, its judges,
    the model folder, the data), before any model loads; returns the examples. Refused: an SFT
    adapter (TRL loads one folder), an output_dir that is, holds or sits inside model.path (TRL
    writes its tokenizer and checkpoints there), and what trl_arguments cannot map."""
    if cfg.model.sft_adapter:
        raise config_error(
            config_path,
            "model.sft_adapter",
            "TRL loads one model folder; give the SFT run's merged/ as model.path and "
            "model.sft_adapter=null",
        )
    out, model = Path(cfg.output_dir).resolve(), Path(cfg.model.path).resolve()
    if out.is_relative_to(model) or model.is_relative_to(out):
        raise config_error(
            config_path,
            "output_dir",
            f"{cfg.output_dir} is, holds or sits inside model.path {cfg.model.path}, where TRL "
            "would write its tokenizer and checkpoints; choose another output_dir",
        )
    try:
        trl_arguments(cfg, processes())
    except ConfigError as e:
        raise ConfigError(f"{config_path}: {e}") from None
    return grpo.check_inputs(cfg, config_path)


def update_lines(packs: list[dict], logs: dict, update: int, cfg: grpo.GRPOConfig):
    """(metrics.jsonl line, completions.jsonl lines) of update `update` from every process's pack
    of its generation (`reward_function`'s record lines, each with TRL's advantage, and the judges'
    statistics) and TRL's log of the update's steps (`logs`). The line has grpo.py's keys
    (rollout.update_metrics) where TRL's update has them: a group trains when its advantages are
    not all 0, and `groups/masked` counts those that do not (all-equal rewards, or rewards missing:
    `groups/unscored`); `tokens/trained` the completion tokens with an advantage; loss, grad_norm,
    lr (the LR the steps ran at), kl, entropy and the clip ratios are TRL's."""
    lines = [line for pack in packs for line in pack["lines"]]
    parts, k = rewards.REWARDS[cfg.reward.name].parts, cfg.rollout.group_size
    groups = [lines[i : i + k] for i in range(0, len(lines), k)]
    idle = [g for g in groups if all(line["advantage"] == 0 for line in g)]
    counts = {"calls": 0, "retries": 0, "failures": 0, "malformed": 0, "judge_error": None}
    for pack in packs:
        grpo.count_calls(counts, pack["stats"])
    report = {
        "rewards": [[line["reward"] for line in g] for g in groups],
        "parts": [{name: [line[name] for line in g] for name in parts} for g in groups],
        "lengths": [line["tokens"] for line in lines],
        "rollouts": len(lines),
        "quoting": sum(bool(extract_quotes(split_completion(ln["completion"])[0])) for ln in lines),
        "truncated": sum(line["truncated"] for line in lines),
        "tokens": sum(line["tokens"] for line in lines if line["advantage"] != 0),
        "masked": len(idle),
        "unscored": sum(any(line["reward"] is None for line in g) for g in idle),
        "resampled": 0,
        "replaced": 0,
        "loss": logs["loss"],
        "grad_norm": logs.get("grad_norm"),
        "skipped_nonfinite": 0,
        "judge_s": max(pack["judge_s"] for pack in packs),
        **dict.fromkeys(("generate_s", "train_s", "mismatch_max"), 0.0),
        **dict.fromkeys(("kl", "entropy", "clip_low", "clip_high", "mismatch_sum"), 0.0),
        **counts,
    }
    metrics = update_metrics([report], update, logs["learning_rate"], cfg.loss.beta)
    for key in ("logp_mismatch/mean", "logp_mismatch/max", "time/generate_s", "time/train_s"):
        del metrics[key]  # not measured on this route
    metrics |= {
        "kl": logs.get("kl") if cfg.loss.beta != 0 else None,
        "entropy": logs.get("entropy"),
        "clip_ratio/low_mean": logs.get("clip_ratio/low_mean"),
        "clip_ratio/high_mean": logs.get("clip_ratio/high_mean"),
    }
    completions = [
        {key: value for key, value in line.items() if key not in ("tokens", "truncated")}
        | {"step": update}
        for line in lines
    ]
    return metrics, completions, report


class UpdateLog:
    """grpo.py's logs of a TRL run: the reward function's `record` keeps this process's scored
    completions; once TRL has their advantages, `generated` keeps every process's; TRL's log of the
    update's last step writes the update's metrics.jsonl line and completions (rank 0) and counts
    the updates in a row that trained nothing for want of rewards (`stop`, as grpo.py's
    filtering.max_unscored_updates)."""

    def __init__(self, cfg: grpo.GRPOConfig, metrics_log, completions_log):
        self.cfg, self.metrics_log, self.completions_log = cfg, metrics_log, completions_log
        self.local: dict | None = None
        self.packs: list[dict] = []
        self.streak = 0
        self.stop: tuple[int, dict, str] | None = None  # rollout.unscored_stop's arguments

    def record(self, lines: list[dict], stats: dict, seconds: float) -> None:
        self.local = {"lines": lines, "stats": stats, "judge_s": seconds}

    def with_advantages(self, advantages: list[float]) -> dict:
        pack, self.local = self.local, None
        for line, advantage in zip(pack["lines"], advantages, strict=True):
            line["advantage"] = advantage
        return pack

    def generated(self, packs: list[dict]) -> None:
        self.packs = packs

    def logged(self, logs: dict, update: int) -> bool:
        """Write update `update`'s lines; True when the run is to stop (`stop` says why)."""
        metrics, completions, report = update_lines(self.packs, logs, update, self.cfg)
        self.metrics_log.write(metrics)
        if self.cfg.log_completions:
            for line in completions:
                self.completions_log.write(line)
        unscored = metrics["tokens/trained"] == 0 and metrics["groups/unscored"] > 0
        self.streak = self.streak + 1 if unscored else 0
        if self.streak >= self.cfg.filtering.max_unscored_updates:
            self.stop = (self.streak, metrics, unscored_cause([report]))
        return self.stop is not None


def grpo_trainer(trl):
    """trl.GRPOTrainer with grpo.py's schedule (`lr_factor` as its LR scheduler) and logs
    (`UpdateLog`, given as `update_log`)."""
    from accelerate.utils import gather_object  # TRL's own dependency

    class Trainer(trl.GRPOTrainer):
        def __init__(self, *args, update_log: UpdateLog, **kwargs):
            self.update_log = update_log
            super().__init__(*args, **kwargs)

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer, lr_factor(self.update_log.cfg)
                )
            return self.lr_scheduler

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            if self.model.training:  # this process's advantages, in its completions' order
                pack = self.update_log.with_advantages(output["advantages"].tolist())
                self.update_log.generated(gather_object([pack]))
            return output

        def log(self, logs, start_time=None):
            super().log(logs, start_time)
            if "loss" in logs and self.model.training and self.update_log.packs:
                update = self.state.global_step // self.args.num_iterations
                if self.update_log.logged(logs, update):
                    self.control.should_save = True  # a checkpoint to resume from
                    self.control.should_training_stop = True

    return Trainer


def resumed_update(checkpoint: str | None, passes: int) -> int:
    """The updates a TRL checkpoint folder holds (its trainer_state.json's optimizer steps)."""
    if checkpoint is None:
        return 0
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text(encoding="utf-8"))
    return state["global_step"] // passes


def save_final(trainer, cfg: grpo.GRPOConfig, tok: QwenTokenizer, main: bool) -> Path:
    """The trained model as grpo.py leaves it: `adapter/` (PEFT's files and lineage.json) or, in a
    full-parameter run, `model/`, each built beside and swapped in whole; with `save_merged`, the
    LoRA merged into the base in `merged/` (tokenizer and chat template ours)."""
    out = Path(cfg.output_dir)
    final = out / ("adapter" if cfg.lora is not None else "model")
    staging = staging_folder(final, clear=main)
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(str(staging))
    if main:
        if cfg.lora is not None:
            lineage = {"base": str(Path(cfg.model.path).resolve()), "sft_adapter": None}
            (staging / LINEAGE).write_text(json.dumps(lineage, indent=2) + "\n", encoding="utf-8")
        publish_folder(staging, final)
        if cfg.save_merged:
            merged = staging_folder(out / "merged")
            trainer.model.merge_and_unload().save_pretrained(merged)
            tok.save(merged)
            publish_folder(merged, out / "merged")
    trainer.accelerator.wait_for_everyone()
    return final


@exits_if_missing
def main(argv=None) -> None:
    """`accelerate launch -m integrations.trl CONFIG [key=value ...]`: grpo.py's config trained by
    trl.GRPOTrainer (our data, reward and judge; the model a Hugging Face folder, an SFT model
    merged already; LoRA as the config asks), with grpo.py's start-up, logs and end."""
    transformers, trl = require("transformers"), require("trl")
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_cli(grpo.GRPOConfig, argv)
    examples = grpo.start_up(cfg, ConfigSource(argv[0], tuple(argv[1:])), check=check_inputs)
    peft_config = None if cfg.lora is None else peft_lora(cfg.lora)  # peft asked before the model
    out = Path(cfg.output_dir)
    ranks = Ranks(int(os.environ.get("RANK", "0")), processes(), None)
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(out)) if cfg.resume == "auto" and out.is_dir() else None
    start = resumed_update(last, cfg.loss.passes)
    if last is not None:
        print0(f"resuming from {last} (update {start} of {cfg.updates})")
    for note in grpo.schedule_notes(cfg):
        print0(note)
    try:
        for name in ("metrics.jsonl", "completions.jsonl"):
            trim_log(out / name, start, ranks)
        save_resolved_config(cfg, out)
        tok = load_tokenizer(cfg.model.path)
        with (
            MetricsWriter(out / "metrics.jsonl", cfg.report_to, cfg) as metrics_log,
            MetricsWriter(out / "completions.jsonl") as completions_log,
        ):
            update_log = UpdateLog(cfg, metrics_log, completions_log)
            trainer = grpo_trainer(trl)(
                model=transformers.AutoModelForCausalLM.from_pretrained(
                    cfg.model.path, dtype=cfg.model.dtype or "auto"
                ),
                processing_class=transformers.AutoTokenizer.from_pretrained(cfg.model.path),
                reward_funcs=[
                    reward_function(cfg.reward, cfg.judge, tok, cfg.loss.passes, update_log.record)
                ],
                train_dataset=examples_dataset(examples, tok, cfg.rollout.enable_thinking),
                args=trl.GRPOConfig(**trl_arguments(cfg, processes())),
                peft_config=peft_config,
                update_log=update_log,
            )
            trainer.train(resume_from_checkpoint=last)
    # a refused judge key; a log of ours that another tool wrote
    except (JudgeAuthError, CheckpointError) as e:
        print0(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if update_log.stop is not None:
        unscored_stop(*update_log.stop, out)
    final = save_final(trainer, cfg, tok, ranks.main)
    end_line(final, *run_summary(read_metrics(out / "metrics.jsonl")))


if __name__ == "__main__":
    main()
