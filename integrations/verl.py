"""This project's rewards and data inside verl, for runs across many nodes (docs/scale.md).

    python -m integrations.verl parquet data/tombench_hard_train.jsonl data/verl/train.parquet
    python -m integrations.verl overrides data/verl/train.parquet \
        configs/social_r1_qwen3_8b_no_content.yaml [key=value ...]   # verl's command

`parquet` writes our examples in verl's dataset layout: `data_source` (clue-mini/<task>), `prompt`
(the task's chat messages), `ability` (the task), `reward_model` ({"style": "rule",
"ground_truth": the gold labels as JSON}) and `extra_info` ({"index", "example": the example as
JSON}). `overrides` prints the Hydra overrides that carry a grpo.py config's settings into
`python -m verl.trainer.main_ppo` (group size, batch, lengths, LR, KL, clip range, aggregation, the
reward and its parameters, the judge), with `compute_score` below as the custom reward function of
verl's batch reward manager.

`compute_score` is verl's batched reward function: it receives the decoded responses and our
`extra_info`, scores them with rewards.score (the judges the reward reads asked at once) and
returns {"score", "scored"} per response. verl has no missing reward: a response a judge could not
score gets 0.0 and scored 0 (verl logs `scored` beside the score). verl decodes responses with
skip_special_tokens=True, so tags that are special tokens of the policy's tokenizer (the
<evidence> tags an SFT run adds) never reach the reward: use verl for rewards that read no such
tag (Social-R1's, or CLUE's correctness alone), or keep CLUE's IU_G on grpo.py or TRL."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import rewards
from config import parse_cli
from data import count_tokens, get_task
from dataset import example_from_json, example_to_json, load_jsonl
from integrations import exits_if_missing, require
from judge import JudgeConfig
from tokenizer import load_tokenizer

_tokenizer = functools.cache(load_tokenizer)  # once per reward worker


def verl_rows(paths: list[str]) -> list[dict]:
    """Our examples as rows of verl's dataset layout (module docstring)."""
    rows = []
    for path in paths:
        for e in load_jsonl(path):
            rows.append(
                {
                    "data_source": f"clue-mini/{e.task}",
                    "prompt": get_task(e.task).messages(e),
                    "ability": e.task,
                    "reward_model": {"style": "rule", "ground_truth": json.dumps(e.labels)},
                    "extra_info": {
                        "index": len(rows),
                        "example": json.dumps(example_to_json(e), ensure_ascii=False),
                    },
                }
            )
    return rows


def compute_score(
    data_sources,
    solution_strs,
    ground_truths,
    extra_infos,
    *,
    reward: str,
    params: dict,
    judge: dict,
    tokenizer_path: str,
    **_: Any,
) -> list[dict]:
    """verl's batched reward function (BatchRewardManager's `compute_score`; `reward`, `params`,
    `judge` (JudgeConfig's fields) and `tokenizer_path` come from its reward_kwargs): one
    {"score", "scored"} per response, score = rewards.score of the response as our trainer builds it
    (T counted by the policy's tokenizer at `tokenizer_path`)."""
    spec = rewards.RewardSpec(reward, dict(params))
    tok = _tokenizer(tokenizer_path)
    rollouts = [
        rewards.Rollout.from_completion(
            example_from_json(json.loads(info["example"])),
            text,
            count_tokens=lambda t: count_tokens(t, tok),
            n_completion_tokens=count_tokens(text, tok),
        )
        for text, info in zip(solution_strs, extra_infos, strict=True)
    ]
    rewards.judge_rollouts(rollouts, spec, JudgeConfig(**judge))
    scores = [rewards.score(r, spec) for r in rollouts]
    return [{"score": 0.0 if s is None else s, "scored": int(s is not None)} for s in scores]


def hydra_value(value) -> str:
    """A reward_kwargs value in Hydra's override grammar: a dict as {key:value,...}, strings
    double-quoted, without spaces (the override is one shell word)."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def verl_overrides(cfg, train_parquet: str) -> list[str]:
    """Hydra overrides for `python -m verl.trainer.main_ppo` (verl 0.9's config layout) that carry
    `cfg` (a grpo.py config): verl's own names for the same settings, our reward as its custom
    reward function. verl loads that function from this file's path: run verl with the repository
    on PYTHONPATH."""
    r, loss, optim = cfg.rollout, cfg.loss, cfg.optim
    judge = {
        k: v
        for k, v in (("base_url", cfg.judge.base_url), ("model", cfg.judge.model))
        if v is not None
    }
    kwargs = {
        "reward": cfg.reward.name,
        "params": cfg.reward.params,
        "judge": judge,
        "tokenizer_path": cfg.model.path,
    }
    return [
        "algorithm.adv_estimator=grpo",
        f"algorithm.norm_adv_by_std_in_grpo={loss.adv_std == 'unbiased'}",
        f"data.train_files={train_parquet}",
        f"data.train_batch_size={r.prompts_per_update}",
        f"data.max_response_length={r.max_new_tokens}",
        f"actor_rollout_ref.model.path={cfg.model.path}",
        f"actor_rollout_ref.rollout.n={r.group_size}",
        f"actor_rollout_ref.rollout.temperature={r.temperature}",
        f"actor_rollout_ref.rollout.top_p={r.top_p}",
        f"actor_rollout_ref.rollout.top_k={r.top_k if r.top_k else -1}",
        f"actor_rollout_ref.actor.optim.lr={optim.lr}",
        f"actor_rollout_ref.actor.optim.weight_decay={optim.weight_decay}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={r.prompts_per_update}",
        f"actor_rollout_ref.actor.ppo_epochs={loss.passes}",
        f"actor_rollout_ref.actor.use_kl_loss={loss.beta > 0}",
        f"actor_rollout_ref.actor.kl_loss_coef={loss.beta}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        f"actor_rollout_ref.actor.clip_ratio_low={loss.clip_low}",
        f"actor_rollout_ref.actor.clip_ratio_high={loss.clip_high}",
        f"actor_rollout_ref.actor.loss_agg_mode={loss.agg}",
        f"actor_rollout_ref.actor.grad_clip={optim.grad_clip}",
        f"trainer.total_training_steps={cfg.updates}",
        f"trainer.save_freq={cfg.save_every}",
        "reward.reward_manager.name=batch",
        f"reward.custom_reward_function.path={Path(__file__).resolve()}",
        "reward.custom_reward_function.name=compute_score",
        *(
            f"+reward.custom_reward_function.reward_kwargs.{k}={hydra_value(v)}"
            for k, v in kwargs.items()
        ),
    ]


@exits_if_missing
def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["parquet"] and len(argv) >= 3:
        datasets = require("datasets")  # verl's own dependency
        *paths, out = argv[1:]
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(verl_rows(paths)).to_parquet(out)
        print(f"parquet: {len(paths)} file(s) -> {out}")
    elif argv[:1] == ["overrides"] and len(argv) >= 3:
        import grpo

        cfg = parse_cli(grpo.GRPOConfig, argv[2:])
        words = [f"'{w}'" for w in verl_overrides(cfg, argv[1])]
        print(" \\\n    ".join(["python -m verl.trainer.main_ppo", *words]))
    else:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
