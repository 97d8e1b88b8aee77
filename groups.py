"""What one GRPO update samples and learns from, shared by the single-turn trainer (grpo.py) and the dialogue mode
(dialogue.py): a `Sample` (the token ids of one sampled completion and the prompt it answered), a `Group` (K
samplings from one starting point with their rewards) and a `Slot` (a group position of the update, with what
filtering has spent on it); and how an update's groups are reported: every rank's `rank_report`, merged into one
metrics.jsonl line by `update_metrics`, and the completions.jsonl lines (`completion_records`). Imports nothing from
the project."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Sample:
    """One sampled completion and the prompt it answered, as token ids."""
    prompt: list[int]
    completion: list[int]  # new tokens, ending with EOS unless truncated
    logp: list[float]  # the sampler's log-probability of each new token
    truncated: bool


@dataclass
class Group:
    """K samplings from one starting point with their rewards: K completions of a prompt, K candidate replies at a
    dialogue state, or K episodes from a scenario seed. Member k sampled `samples[k]`: one completion, or one per
    assistant turn of its episode. The training side reads only `samples`, `rewards` and `masked`."""
    example: object  # the data.Example, or the dialogue.State the members started from
    samples: list[list[Sample]]
    rollouts: list  # rewards.Rollout, one per member
    rewards: list[float | None] = field(default_factory=list)
    parts: dict[str, list[float | None]] = field(default_factory=dict)
    masked: bool = False


@dataclass
class Slot:
    """One group position of an update: the prompt it holds now and what filtering has spent on it."""
    index: int  # position among the update's prompts
    example: object  # a data.Example, a dialogue.Scenario or a dialogue.State
    segment: int
    resamples: int = 0
    replacements: int = 0
    group: Group | None = None


# ----------------------------------------------------------------------------- what an update reports


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
    return {"rewards": [g.rewards for g in groups], "parts": [g.parts for g in groups],
            "lengths": [len(s.completion) for s in samples], "truncated": sum(s.truncated for s in samples),
            "prompt_tokens": sum(len(s.prompt) for s in samples), **counts, **train}


def update_metrics(reports: list[dict], step: int, lr: float, beta: float) -> dict:
    """One metrics.jsonl line from every rank's report of update `step` (1-based count of updates)."""
    def total(key):
        return sum(r[key] for r in reports)

    group_rewards = [g for r in reports for g in r["rewards"]]
    mean, _ = _mean_std([v for g in group_rewards for v in g])
    group_stds = [_mean_std(g)[1] for g in group_rewards if sum(v is not None for v in g) > 1]
    zero_std = sum(s == 0 for s in group_stds) + len(group_rewards) - len(group_stds)
    lengths = [n for r in reports for n in r["lengths"]]
    tokens = total("tokens")  # completion tokens trained on; 0 when every group was masked

    def per_token(key):
        return total(key) / tokens if tokens else None

    metrics = {"step": step, "loss": reports[0]["loss"], "lr": lr, "grad_norm": reports[0]["grad_norm"],
               "reward": mean, "reward_std": sum(group_stds) / len(group_stds) if group_stds else None}
    for name in dict.fromkeys(name for r in reports for g in r["parts"] for name in g):
        part_mean, part_std = _mean_std([v for r in reports for g in r["parts"] for v in g[name]])
        metrics[f"rewards/{name}/mean"] = part_mean
        metrics[f"rewards/{name}/std"] = part_std
    metrics |= {
        "frac_reward_zero_std": zero_std / max(1, len(group_rewards)),
        "groups/masked": total("masked"), "groups/resampled": total("resampled"), "groups/replaced": total("replaced"),
        "completions/mean_length": sum(lengths) / max(1, len(lengths)),
        "completions/max_length": max(lengths, default=0),
        "completions/clipped_ratio": total("truncated") / max(1, len(lengths)),
        "kl": per_token("kl") if beta != 0 else None, "entropy": per_token("entropy"),
        "clip_ratio/low_mean": per_token("clip_low"), "clip_ratio/high_mean": per_token("clip_high"),
        "logp_mismatch/mean": per_token("mismatch_sum"),
        "logp_mismatch/max": max(r["mismatch_max"] for r in reports) if tokens else None,
        "time/generate_s": max(r["generate_s"] for r in reports), "time/judge_s": max(r["judge_s"] for r in reports),
        "time/train_s": max(r["train_s"] for r in reports),
        "judge/calls": total("calls"), "judge/retries": total("retries"), "judge/failures": total("failures"),
        "skipped_nonfinite": reports[0]["skipped_nonfinite"],
    }
    return metrics


def completion_records(groups: list[Group], advantages: list, tok, step: int) -> list[dict]:
    """completions.jsonl lines: id, prompt, completion, reward and its parts, advantage (None: masked)."""
    records = []
    for g, adv in zip(groups, advantages):
        for k, (member, rollout) in enumerate(zip(g.samples, g.rollouts)):
            prompt = tok.decode(member[0].prompt)  # an episode's: its first turn's (its transcript is the completion)
            records.append({"step": step, "id": g.example.id, "prompt": prompt, "completion": rollout.completion,
                            "reward": g.rewards[k], **{name: v[k] for name, v in g.parts.items()},
                            "advantage": None if adv is None else adv[k]})
    return records
