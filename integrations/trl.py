"""This project's rewards and data inside TRL's GRPOTrainer, for runs that outgrow one node (TRL
trains on accelerate or DeepSpeed across nodes, with vLLM rollouts): docs/scale.md.

    accelerate launch -m integrations.trl configs/clue_qwen3_5_9b.yaml model.path=MERGED_SFT \
        model.sft_adapter=null          # grpo.py's config, its settings mapped (trl_arguments)

or, in your own script:

    from integrations.trl import examples_dataset, reward_function
    tok = load_tokenizer("checkpoints/Qwen3.5-9B")        # this project's tokenizer.py
    dataset = examples_dataset(["data/clue_rl.jsonl"], tok)
    clue = reward_function(RewardSpec("clue", {"lambda_iu": 0.5}), JudgeConfig(base_url=...), tok)
    trl.GRPOTrainer(model=..., reward_funcs=[clue], train_dataset=dataset, args=...).train()

A reward reads what grpo.py's does: the completion decoded from its token ids with special tokens
kept (TRL's own completion text drops them, and with them the <evidence> tags the verifier
reads), T counted by the tokenizer, the update t and the run's length T_total from TRL's state
(Social-R1's w(t)), and the judges it needs asked all at once (rewards.judge_rollouts). A reward
that cannot be scored (a judge failed) is None: TRL leaves that completion out of its group's
baseline.
One difference in what the policy reads: TRL tokenizes the prompt text itself, so a tag that the
task's instructions spell (`<evidence>`) becomes that special token, where our trainers encode
message text as plain text. TRL, transformers, peft and datasets are the user's: imported lazily
(integrations.require)."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import torch

import grpo
import rewards
from config import ConfigError, parse_cli
from data import count_tokens, get_task
from dataset import example_from_json, example_to_json, load_jsonl
from integrations import exits_if_missing, require
from judge import JudgeConfig
from tokenizer import QwenTokenizer, load_tokenizer


def examples_dataset(paths: list[str], tok: QwenTokenizer, enable_thinking: bool | None = None):
    """A `datasets.Dataset` of the examples in `paths` (data.py's JSONL schema), one row each:
    `prompt`, the chat text our trainers sample under (the task's messages in `tok`'s chat format,
    the generation prompt appended), and `example`, the example as JSON for the reward."""
    datasets = require("datasets")  # TRL's own dependency, not this project's
    rows = [
        {
            "prompt": tok.chat(get_task(e.task).messages(e), enable_thinking=enable_thinking),
            "example": json.dumps(example_to_json(e), ensure_ascii=False),
        }
        for path in paths
        for e in load_jsonl(path)
    ]
    return datasets.Dataset.from_list(rows)


def reward_function(
    spec: rewards.RewardSpec, judge_cfg: JudgeConfig, tok: QwenTokenizer
) -> Callable[..., list[float | None]]:
    """`spec`'s reward in TRL's reward-function contract: called with the batch's `prompts`,
    `completions`, `completion_ids`, the dataset's `example` column and `trainer_state`, it returns
    one reward (or None) per completion, the value rewards.score gives the same completion."""
    eos = set(tok.eos_token_ids)

    def reward(
        prompts, completions, completion_ids, example, trainer_state=None, **_: Any
    ) -> list[float | None]:
        step, total = (
            (trainer_state.global_step + 1, max(1, trainer_state.max_steps))
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
        rewards.judge_rollouts(rollouts, spec, judge_cfg)
        return [rewards.score(r, spec) for r in rollouts]

    reward.__name__ = spec.name  # the name TRL logs the reward under
    return reward


# grpo.py's loss aggregation and advantage std in TRL's names
LOSS_TYPES = {"seq-mean-token-mean": "grpo", "token-mean": "dapo"}


def trl_arguments(cfg: grpo.GRPOConfig) -> dict[str, Any]:
    """trl.GRPOConfig's keyword arguments for what `cfg` sets that TRL has: one update takes
    rollout.prompts_per_update groups of rollout.group_size completions (one optimizer step,
    loss.passes passes over them); the sampling, the KL weight, the clip range, the aggregation,
    AdamW and the peak LR. The LR schedule becomes a linear warm-up then cosine decay (TRL has no
    hold), and what TRL has no setting for is not carried: group filtering, the curriculum, the
    LoRA (trl.GRPOTrainer takes it as a peft config: `peft_config`)."""
    r, loss, optim = cfg.rollout, cfg.loss, cfg.optim
    cpu = cfg.model.device == "cpu" or not torch.cuda.is_available()
    if loss.adv_std != "unbiased":
        raise ConfigError("loss.adv_std: TRL divides by the unbiased std only")
    return dict(
        output_dir=cfg.output_dir,
        max_steps=cfg.updates,
        per_device_train_batch_size=r.group_size,
        generation_batch_size=r.prompts_per_update * r.group_size,
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
        warmup_steps=optim.warmup_updates,
        lr_scheduler_type="cosine",
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        max_grad_norm=optim.grad_clip,
        save_steps=cfg.save_every,
        logging_steps=1,
        seed=cfg.seed,
        report_to=list(cfg.report_to),
        bf16=cfg.model.dtype == "bfloat16" and not cpu,  # accelerate's bf16 is for GPUs
        use_cpu=cpu,
    )


def peft_lora(lora):
    """Our LoraSettings as peft's LoraConfig (peft: TRL's LoRA route, the user's install)."""
    return require("peft").LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.targets),
    )


@exits_if_missing
def main(argv=None) -> None:
    """`accelerate launch -m integrations.trl CONFIG [key=value ...]`: grpo.py's config trained by
    trl.GRPOTrainer (our data, reward and judge; the model a Hugging Face folder, an SFT model
    merged already; LoRA as the config asks)."""
    transformers, trl = require("transformers"), require("trl")
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_cli(grpo.GRPOConfig, argv)
    if cfg.model.sft_adapter:
        raise SystemExit(
            f"error: {argv[0]}: model.sft_adapter: TRL loads one model folder; give the SFT run's "
            "merged/ as model.path and model.sft_adapter=null"
        )
    tok = load_tokenizer(cfg.model.path)
    peft_config = None if cfg.lora is None else peft_lora(cfg.lora)  # peft asked before the model
    trainer = trl.GRPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(
            cfg.model.path, dtype=cfg.model.dtype or "auto"
        ),
        processing_class=transformers.AutoTokenizer.from_pretrained(cfg.model.path),
        reward_funcs=[reward_function(cfg.reward, cfg.judge, tok)],
        train_dataset=examples_dataset(cfg.train_data, tok, cfg.rollout.enable_thinking),
        args=trl.GRPOConfig(**trl_arguments(cfg)),
        peft_config=peft_config,
    )
    trainer.train()
    trainer.save_model(cfg.output_dir)


if __name__ == "__main__":
    main()
