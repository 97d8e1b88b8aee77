"""How GRPO's rollouts are made: what one update samples and learns from, and the one small
interface every way of sampling implements. grpo.py picks the run's sampler once
(`grpo.rollout_sampler`) and calls it:

    sampler.segments(items)              the curriculum segments the run walks (examples, or
                                         scenario seeds)
    with sampler.rollouts(update):       the span of one update's rollouts (a sharded policy is
                                         gathered whole in it, a served engine syncs the new weights
                                         at its start and agrees on errors across ranks at its end:
                                         a RolloutError on one rank is one on all)
        sampler.open(slots, seed, counts)    the update's slots (a dialogue run may play them into
                                             others)
        sampler.sample(examples, update, seed, counts)    K samplings of each example: a `Group`
                                                          each
        sampler.judge(groups)            the judge calls the reward needs; returns their statistics
    sampler.deals_slots                  True: a slot is only its prompt, so grpo.collect_groups
                                         deals each round's waiting slots across the ranks

`PromptSampler` is the single-turn implementation: K completions of each prompt in one batched
`model.generate` call (`complete`), parsed into `rewards.Rollout`s. Beside it:
vllm_engine.VLLMSampler (the completions from a vLLM server) and dialogue.DialogueSampler
(role-played dialogues), each loaded only by a run that asks for it; fsdp.GatheredSampler wraps any
of them for a sharded (full-parameter) policy.

A `Sample` is the token ids of one sampled completion and the prompt it answered, a `Group` K
samplings from one starting point with their rewards, a `Slot` a group position of the update with
what filtering has spent on it; an update's groups are reported by every rank's `rank_report`,
merged into one metrics.jsonl line by `update_metrics`, and written to completions.jsonl by
`completion_records`."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import data
import dataset
import rewards
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


@dataclass
class Slot:
    """One group position of an update: the prompt it holds now and what filtering has spent on
    it."""

    index: int  # position among the update's prompts
    example: object  # a data.Example, a dialogue.Scenario or a dialogue.State
    segment: int
    resamples: int = 0
    replacements: int = 0
    group: Group | None = None


class RolloutError(RuntimeError):
    """An update's rollouts could not be completed (a served engine failed for good): nothing of the
    update is trained; the trainer saves the state before it and stops."""


# -------------------------------------------------------------------------- the single-turn sampler


class PromptSampler:
    """Single-turn rollouts (`cfg`: grpo.GRPOConfig): the curriculum's segments, K completions per
    prompt, and the judges the reward needs (`rewards.judge_rollouts`, with `content`, when given,
    scoring R_content in the prompted judge's place: reward_models/social_r1.py's trained RM)."""

    deals_slots = True  # any rank can sample any slot's prompt: resamples are shared

    def __init__(self, policy, tok, cfg, content=None):
        self.policy = policy
        self.tok = tok
        self.cfg = cfg
        self.content = content

    def segments(self, examples: list[data.Example]) -> list[dataset.Segment]:
        return dataset.curriculum(examples, self.cfg.curriculum)

    def rollouts(self, update: int):
        return contextlib.nullcontext()

    def open(self, slots: list[Slot], seed: int, counts: dict) -> list[Slot]:
        return slots  # every slot is a prompt to sample

    def complete(
        self, prompts: list[list[int]], seed: int
    ) -> tuple[list[list[int]], list[list[float]]]:
        """K completions of each prompt, group after group: (token ids, the sampler's log-probs of
        them), decoded with the LoRA merged into the weights (`lora_merged`)."""
        r = self.cfg.rollout
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
        k, tok, eos = self.cfg.rollout.group_size, self.tok, set(self.tok.eos_token_ids)
        prompts = [
            tok.chat_ids(
                data.get_task(e.task).messages(e), enable_thinking=self.cfg.rollout.enable_thinking
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
                        step=update + 1,
                        # t counts from 1: w(t) reaches 1 + gamma at the last
                        total_steps=self.cfg.updates,
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
            [r for g in groups for r in g.rollouts], self.cfg.reward, self.cfg.judge, self.content
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
