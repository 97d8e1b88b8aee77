"""How GRPO's rollouts are made: what one update samples and learns from, and the one small
interface every way of sampling implements (`Sampler`). grpo.py picks the run's sampler once
(`grpo.rollout_sampler`, or an extension's own) and calls it in each update:

    with sampler.rollouts(update) as token_weights:     the span of one update's rollouts
        sampler.sample(examples, update, seed, counts)    K samplings of each example: a `Group`
                                                          each
        sampler.judge(groups)            the judge calls the reward needs; returns their statistics
    token_weights(logp_old, logp_sampler)    the loss's weight of each sampled token (None: 1)

`PromptSampler` is the single-turn implementation: K completions of each prompt in one batched
`model.generate` call (`complete`), parsed into `rewards.Rollout`s. Beside it:
vllm_engine.VLLMSampler (the completions from a vLLM server) and dialogue/play.py's DialogueSampler
(role-played dialogues), each loaded only by a run that asks for it; fsdp.GatheredSampler wraps any
of them for a sharded (full-parameter) policy.

A `Sample` is the token ids of one sampled completion and the prompt it answered, a `Group` K
samplings from one starting point with their rewards; an update's groups are reported by every
rank's `rank_report`, merged into one metrics.jsonl line by `update_metrics`, and written to
completions.jsonl by `completion_records` (`log_update` does the three); `run_summary` reads a
run's lines back for its last line (`end_line`), and `rollout_stop` and `unscored_stop` are the
lines of a run that stops early."""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, field
from typing import NoReturn

import data
import rewards
from config import print0
from distributed import gather_json
from model import generate, lora_merged
from verifier import extract_quotes


@dataclass
class Sample:
    """One sampled completion and the prompt it answered, as token ids."""

    prompt: list[int]
    completion: list[int]  # new tokens, ending with EOS unless truncated
    logp: list[float]  # the sampler's log-probability of each new token
    truncated: bool


@dataclass
class Group:
    """K samplings from one starting point with their rewards: K completions of a prompt, K
    candidate replies at a dialogue state, or K episodes from a scenario seed. Member k sampled
    `samples[k]`: one completion, or one per assistant turn of its episode. The training side reads
    only `samples`, `rewards` and `masked`."""

    example: object  # the data.Example, or the dialogue.State the members started from
    samples: list[list[Sample]]
    rollouts: list  # rewards.Rollout, one per member
    rewards: list[float | None] = field(default_factory=list)
    parts: dict[str, list[float | None]] = field(default_factory=dict)
    masked: bool = False


class RolloutError(RuntimeError):
    """An update's rollouts could not be completed (a served engine failed for good): nothing of the
    update is trained; the trainer saves the state before it and stops."""


# -------------------------------------------------------------------------- the samplers


class Sampler:
    """The interface grpo.train calls (module docstring); a sampler implements `sample` and
    `judge`. What only one engine needs it does in `rollouts`, which here does nothing: a sharded
    policy is gathered whole in it, a served engine syncs the new weights at its start and agrees
    on errors across ranks at its end (a RolloutError on one rank is one on all), and it hands the
    loss the weight of the update's sampled tokens: None here (every token weight 1), a served
    engine's truncated importance weights, `token_weights(logp_old, logp_sampler)` -> a [B, T]
    tensor that multiplies each token's clipped surrogate in grpo_loss (vllm_engine.tis_weights)."""

    def rollouts(self, update: int):
        return contextlib.nullcontext(None)


class PromptSampler(Sampler):
    """Single-turn rollouts: K completions per prompt sampled as `rollout` (grpo.RolloutSettings)
    says, and the judges the reward `reward` needs at the endpoint `judge`
    (`rewards.judge_rollouts`, with `content`, when given, scoring R_content in the prompted judge's
    place: reward_models/social_r1.py's trained RM); `updates`, the run's length, is the T_total
    of a reward that weighs by training progress."""

    def __init__(self, policy, tok, rollout, reward, judge, updates: int, content=None):
        self.policy, self.tok = policy, tok
        self.rollout, self.reward, self.endpoint = rollout, reward, judge
        self.updates, self.content = updates, content

    def complete(
        self, prompts: list[list[int]], seed: int
    ) -> tuple[list[list[int]], list[list[float]]]:
        """K completions of each prompt, group after group: (token ids, the sampler's log-probs of
        them), decoded with the LoRA merged into the weights (`lora_merged`)."""
        r = self.rollout
        self.policy.eval()
        with lora_merged(self.policy):
            return generate(
                self.policy,
                [p for p in prompts for _ in range(r.group_size)],
                r.max_new_tokens,
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
                repetition_penalty=r.repetition_penalty,
                eos_token_ids=self.tok.eos_token_ids,
                seed=seed,
                return_logprobs=True,
                decode=r.decode,
            )

    def sample(
        self, examples: list[data.Example], update: int, seed: int, counts: dict
    ) -> list[Group]:
        """Step 1: K completions of each example (`complete`), parsed into Rollouts; `update` counts
        from 0."""
        k, tok, eos = self.rollout.group_size, self.tok, set(self.tok.eos_token_ids)
        prompts = [
            tok.chat_ids(
                data.get_task(e.task).messages(e), enable_thinking=self.rollout.enable_thinking
            )
            for e in examples
        ]
        new, logp = self.complete(prompts, seed)
        groups = []
        for g, (example, prompt) in enumerate(zip(examples, prompts)):
            rows = range(g * k, (g + 1) * k)
            rollouts = []
            for i in rows:
                text = tok.decode(new[i][:-1] if new[i] and new[i][-1] in eos else new[i])
                rollouts.append(
                    rewards.Rollout.from_completion(
                        example,
                        text,
                        count_tokens=lambda reasoning: data.count_tokens(reasoning, tok),
                        n_completion_tokens=len(new[i]),
                        # t counts from 1: w(t) reaches 1 + gamma at the last
                        step=update + 1,
                        total_steps=self.updates,
                    )
                )
            groups.append(
                Group(
                    example,
                    [
                        [Sample(prompt, new[i], logp[i], not new[i] or new[i][-1] not in eos)]
                        for i in rows
                    ],
                    rollouts,
                )
            )
        return groups

    def judge(self, groups: list[Group]) -> dict:
        return rewards.judge_rollouts(
            [r for g in groups for r in g.rollouts], self.reward, self.endpoint, self.content
        )


# --------------------------------------------------------------------------- what an update reports


def _mean_std(values: list) -> tuple[float | None, float | None]:
    """Mean and unbiased std of the values that are not None (None when there are none)."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None
    mean = sum(present) / len(present)
    var = sum((v - mean) ** 2 for v in present) / max(1, len(present) - 1)
    return mean, math.sqrt(var)


def rank_report(groups: list[Group], counts: dict, train: dict) -> dict:
    """What this rank saw in one update, as plain JSON for `gather_json`."""
    samples = [s for g in groups for member in g.samples for s in member]
    rollouts = [r for g in groups for r in g.rollouts]
    return {
        "rewards": [g.rewards for g in groups],
        "rollouts": len(rollouts),
        # whether grounding happens at all: the format term is 1 without tags too
        "quoting": sum(bool(extract_quotes(r.reasoning)) for r in rollouts),
        "parts": [g.parts for g in groups],
        "lengths": [len(s.completion) for s in samples],
        "truncated": sum(s.truncated for s in samples),
        "prompt_tokens": sum(len(s.prompt) for s in samples),
        **counts,
        **train,
    }


def update_metrics(reports: list[dict], update: int, lr: float, beta: float) -> dict:
    """One metrics.jsonl line from every rank's report of update `update` (counted from 1; the
    line's "step")."""

    def total(key):
        return sum(r[key] for r in reports)

    group_rewards = [g for r in reports for g in r["rewards"]]
    scored = [v for g in group_rewards for v in g if v is not None]
    mean, _ = _mean_std(scored)
    group_stds = [_mean_std(g)[1] for g in group_rewards if sum(v is not None for v in g) > 1]
    zero_std = sum(s == 0 for s in group_stds) + len(group_rewards) - len(group_stds)
    lengths = [n for r in reports for n in r["lengths"]]
    tokens = total("tokens")  # completion tokens trained on; 0 when every group was masked

    def per_token(key):
        return total(key) / tokens if tokens else None

    metrics = {
        "step": update,
        "loss": reports[0]["loss"],
        "lr": lr,
        "grad_norm": reports[0]["grad_norm"],
        "reward": mean,
        "reward_std": sum(group_stds) / len(group_stds) if group_stds else None,
        "reward_min": min(scored, default=None),
        "reward_max": max(scored, default=None),
    }
    for name in dict.fromkeys(name for r in reports for g in r["parts"] for name in g):
        part_mean, part_std = _mean_std([v for r in reports for g in r["parts"] for v in g[name]])
        metrics[f"rewards/{name}/mean"] = part_mean
        metrics[f"rewards/{name}/std"] = part_std
    metrics |= {
        "frac_reward_zero_std": zero_std / max(1, len(group_rewards)),
        "groups/total": len(group_rewards),
        "groups/masked": total("masked"),
        # masked because a reward was missing (judge failures or malformed answers)
        "groups/unscored": total("unscored"),
        "groups/resampled": total("resampled"),
        "groups/replaced": total("replaced"),
        "completions/mean_length": sum(lengths) / max(1, len(lengths)),
        "completions/max_length": max(lengths, default=0),
        "completions/clipped_ratio": total("truncated") / max(1, len(lengths)),
        "completions/quoting": total("quoting") / max(1, total("rollouts")),
        "kl": per_token("kl") if beta != 0 else None,
        "entropy": per_token("entropy"),
        "clip_ratio/low_mean": per_token("clip_low"),
        "clip_ratio/high_mean": per_token("clip_high"),
        "logp_mismatch/mean": per_token("mismatch_sum"),
        "logp_mismatch/max": max(r["mismatch_max"] for r in reports) if tokens else None,
        "time/generate_s": max(r["generate_s"] for r in reports),
        "time/judge_s": max(r["judge_s"] for r in reports),
        "time/train_s": max(r["train_s"] for r in reports),
        "judge/calls": total("calls"),
        "judge/retries": total("retries"),
        "judge/failures": total("failures"),
        "judge/malformed": total("malformed"),
        "tokens/trained": int(tokens),
        "skipped_nonfinite": reports[0]["skipped_nonfinite"],
    }
    return metrics


def unscored_cause(reports: list[dict]) -> str:
    """Why an update's rewards were missing, from every rank's report: the judge's failed calls
    (with the first reason), its malformed answers, or, with neither, a reward that reads a judge
    output nobody asked for."""
    calls, failures, malformed = (
        sum(r[k] for r in reports) for k in ("calls", "failures", "malformed")
    )
    if failures:
        first = next(r["judge_error"] for r in reports if r["judge_error"])
        return f"{failures} of {calls} judge calls failed, the first: {first}"
    if malformed:
        return f"{malformed} of {calls} judge answers were out of format"
    return (
        "no judge call failed: the reward reads a judge output that no judge was asked for "
        "(a judge-backed reward must declare its judges: docs/adding-a-reward.md)"
    )


def run_summary(records: list[dict]) -> tuple[int, str]:
    """(trained completion tokens, one line) of what a run's metrics.jsonl says it trained: the
    updates that trained, the tokens, the masked groups and why, the judge's failed calls."""
    total = {
        key: sum(r.get(key) or 0 for r in records)
        for key in (
            "tokens/trained",
            "groups/total",
            "groups/masked",
            "groups/unscored",
            "judge/calls",
            "judge/failures",
        )
    }
    total = {key: int(value) for key, value in total.items()}
    trained_updates = sum(bool(r.get("tokens/trained")) for r in records)
    return total["tokens/trained"], (
        f"trained {total['tokens/trained']:,} completion tokens in {trained_updates} of "
        f"{len(records)} updates; {total['groups/masked']} of {total['groups/total']} groups "
        f"masked ({total['groups/unscored']} for missing rewards); judge: "
        f"{total['judge/failures']} of {total['judge/calls']} calls failed"
    )


def log_update(
    groups, counts, trained, advantages, tok, update, lr, cfg, ranks, progress, logs
) -> tuple[dict, list[dict]]:
    """Update `update`'s line in metrics.jsonl (rollout.update_metrics over every rank's report,
    with the progress line's figures) and its completions in completions.jsonl (`logs`: the two
    writers); returns the line and the reports."""
    metrics_log, completions_log = logs
    reports = gather_json(rank_report(groups, counts, trained), ranks)
    metrics = update_metrics(reports, update + 1, lr, cfg.loss.beta)
    records = gather_json(
        completion_records(groups, advantages, tok, update + 1) if cfg.log_completions else [],
        ranks,
    )
    n_tokens = sum(r["prompt_tokens"] + sum(r["lengths"]) for r in reports)
    metrics |= progress.log(
        update,
        n_tokens,
        reward=metrics["reward"] or 0.0,
        loss=metrics["loss"],
        masked=metrics["groups/masked"],
    )
    metrics.pop("elapsed_s", None)
    metrics_log.write(metrics)
    for record in (r for rank_records in records for r in rank_records):
        completions_log.write(record)
    return metrics, reports


def rollout_stop(error: RolloutError, update: int, out_dir) -> NoReturn:
    """The stop when update `update`'s rollouts failed for good: one line, exit 1."""
    print0(
        f"error: {error}\nstopped after update {update}: the rollouts failed; checkpoint saved, "
        f"the same command resumes from {out_dir}",
        file=sys.stderr,
    )
    raise SystemExit(1) from None


def unscored_stop(streak: int, metrics: dict, cause: str, out_dir) -> NoReturn:
    """The stop after `streak` updates in a row that trained nothing for want of rewards (the last
    one's metrics line `metrics`, `cause` from unscored_cause), its checkpoint saved: one line, exit
    1."""
    print0(
        f"error: {streak} updates in a row trained nothing (filtering.max_unscored_updates), the "
        f"last update {metrics['step']}: rewards were missing in {metrics['groups/unscored']} of "
        f"{metrics['groups/total']} groups; {cause}. Checkpoint saved: the same command resumes "
        f"from {out_dir}",
        file=sys.stderr,
    )
    raise SystemExit(1)


def end_line(final, trained_tokens: int, summary: str) -> None:
    """A run's last line (`summary` from run_summary; `final` the saved model): done, or, when the
    run trained no token at all, an error and exit 1."""
    if not trained_tokens:
        print0(
            f"error: the run trained nothing: {summary}; {final} holds the starting model",
            file=sys.stderr,
        )
        raise SystemExit(1)
    print0(f"done: {final}: {summary}")


def completion_records(groups: list[Group], advantages: list, tok, update: int) -> list[dict]:
    """completions.jsonl lines: id, prompt, completion, reward and its parts, advantage (None:
    masked)."""
    records = []
    for g, adv in zip(groups, advantages):
        for k, (member, rollout) in enumerate(zip(g.samples, g.rollouts)):
            # an episode's: its first turn's (its transcript is the completion)
            prompt = tok.decode(member[0].prompt)
            records.append(
                {
                    "step": update,
                    "id": g.example.id,
                    "prompt": prompt,
                    "completion": rollout.completion,
                    "reward": g.rewards[k],
                    **{name: v[k] for name, v in g.parts.items()},
                    "advantage": None if adv is None else adv[k],
                }
            )
    return records
