"""This project's rewards and data inside verl, for runs across many nodes (docs/scale.md).

    python -m integrations.verl parquet [--overwrite] EXAMPLES.jsonl [...] OUT.parquet
    python -m integrations.verl overrides data/verl/train.parquet \
        configs/social_r1_qwen3_8b_no_content.yaml [key=value ...]   # verl's command

`parquet` writes our examples in verl's dataset layout: `data_source` (clue-mini/<task>), `prompt`
(the task's chat messages), `ability` (the task), `reward_model` ({"style": "rule",
"ground_truth": the gold labels as JSON}) and `extra_info` ({"index", "example": the example as
JSON}). Every input is read and checked first; the output is the last argument, a `.parquet` file
that is none of the inputs and does not exist yet (`--overwrite` replaces one), written under a
temporary name and moved into place. `overrides` prints the Hydra overrides that carry a grpo.py
config's settings into `python -m verl.trainer.main_ppo` (group size, batch, one optimizer step per
generation `loss.passes` times, lengths, AdamW, the LR schedule as near as verl's schedulers come,
KL, clip range, aggregation, the reward and its parameters, the judge, output_dir), with
`compute_score` below as the custom reward function of verl's batch reward manager.

`compute_score` is verl's batched reward function: it receives the decoded responses and our
`extra_info`, scores them with rewards.score (the judges the reward reads asked at once) and
returns {"score", "scored", and the reward's parts} per response (NaN for a part that could not be
computed): verl keeps them beside each response in its rollout dumps (trainer.rollout_data_dir,
output_dir/rollouts with log_completions), not in its metrics. verl has no missing reward: a
response a judge could not score gets 0.0 and scored 0. verl decodes responses with
skip_special_tokens=True, so tags that are special tokens of the policy's tokenizer (the
<evidence> tags an SFT run adds) never reach the reward: use verl for rewards that read no such
tag (Social-R1's, or CLUE's correctness alone), or keep CLUE's IU_G on grpo.py or TRL."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import rewards
from config import ConfigError, check_output_file, parse_cli
from data import DataError, count_tokens, get_task
from dataset import example_from_json, example_to_json, load_jsonl
from http_client import JudgeConfig
from integrations import exits_if_missing, require
from tokenizer import load_tokenizer

_tokenizer = functools.cache(load_tokenizer)  # once per reward worker


def verl_rows(paths: list[str]) -> list[dict]:
    """Our examples as rows of verl's dataset layout (module docstring). A missing or empty file, or
    a bad line, raises DataError naming it."""
    rows = []
    for path in paths:
        examples = load_jsonl(path)
        if not examples:
            raise DataError(f"{path}: no examples (the file is empty)")
        for e in examples:
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
    parts = rewards.REWARDS[reward].parts
    results = []
    for r in rollouts:
        score = rewards.score(r, spec)
        values = {name: part(r, spec.params) for name, part in parts.items()}
        results.append(
            {"score": 0.0 if score is None else score, "scored": int(score is not None)}
            | {name: math.nan if v is None else v for name, v in values.items()}
        )
    return results


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
    if loss.adv_std != "unbiased":
        raise ConfigError("'loss.adv_std': verl's GRPO divides by the unbiased std only")
    # verl's schedulers warm up from 0; they hold (constant) or decay (cosine), not both: the hold
    # when the run ends inside it, else the cosine from the warm-up's end to lr_floor
    schedule = "constant" if cfg.updates <= optim.hold_until else "cosine"
    floor = min(1.0, optim.lr_floor / optim.lr) if optim.lr else 0.0
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
        "algorithm.norm_adv_by_std_in_grpo=True",
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
        f"actor_rollout_ref.actor.optim.betas=[{optim.betas[0]},{optim.betas[1]}]",
        f"actor_rollout_ref.actor.optim.lr_warmup_steps={optim.warmup_updates}",
        f"actor_rollout_ref.actor.optim.lr_scheduler_type={schedule}",
        f"actor_rollout_ref.actor.optim.min_lr_ratio={floor}",
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
        f"trainer.default_local_dir={cfg.output_dir}",
        *(
            [f"trainer.rollout_data_dir={Path(cfg.output_dir) / 'rollouts'}"]
            if cfg.log_completions
            else []
        ),
        "reward.reward_manager.name=batch",
        f"reward.custom_reward_function.path={Path(__file__).resolve()}",
        "reward.custom_reward_function.name=compute_score",
        *(
            f"+reward.custom_reward_function.reward_kwargs.{k}={hydra_value(v)}"
            for k, v in kwargs.items()
        ),
    ]


def write_parquet(paths: list[str], out: str, overwrite: bool = False) -> int:
    """The examples of `paths` as verl's parquet `out`, every input read and checked before it is
    written under a temporary name and moved into place; returns the row count. Refused
    (ConfigError): an output that is not a .parquet name, is an input, a folder, or exists
    (unless `overwrite`)."""
    datasets = require("datasets")  # verl's own dependency
    check_output_file(out, "output", {"input": paths})
    if Path(out).suffix != ".parquet":
        raise ConfigError(
            f"'output': {out} is not a .parquet name (the last argument is the output)"
        )
    if Path(out).exists() and not overwrite:
        raise ConfigError(f"'output': {out} exists; name a new file, or pass --overwrite")
    rows = verl_rows(paths)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    staged = Path(out).with_name(f".{Path(out).name}.tmp{os.getpid()}")
    try:
        datasets.Dataset.from_list(rows).to_parquet(str(staged))
        os.replace(staged, out)
    finally:
        staged.unlink(missing_ok=True)
    return len(rows)


@exits_if_missing
def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    files = [a for a in argv[1:] if a != "--overwrite"]
    if argv[:1] == ["parquet"] and len(files) >= 2:
        *paths, out = files
        try:
            n = write_parquet(paths, out, overwrite="--overwrite" in argv[1:])
        except (ConfigError, DataError) as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        print(f"parquet: {n} examples of {len(paths)} file(s) -> {out}")
    elif argv[:1] == ["overrides"] and len(argv) >= 3:
        import grpo

        cfg = parse_cli(grpo.GRPOConfig, argv[2:])
        try:
            words = [f"'{w}'" for w in verl_overrides(cfg, argv[1])]
        except ConfigError as e:
            print(f"error: {argv[2]}: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        print(" \\\n    ".join(["python -m verl.trainer.main_ppo", *words]))
    else:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
