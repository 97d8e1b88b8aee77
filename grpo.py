"""Stage 2: GRPO with grounded rewards. Run: `torchrun --nproc_per_node=N grpo.py config.yaml [key=value ...]`
(or `python grpo.py config.yaml` for one process); `python grpo.py prepare config.yaml` first writes the data's
reference analyses through a teacher (the config's `prepare:` section, rewards.prepare_references: Social-R1).

One update (`train`, in this order):
  1. sample   P prompts from the current curriculum segment, K completions each (`model.generate`,
              identical prompts prefilled once), parsed into `rewards.Rollout`s; with a `dialogue:` section,
              P scenario seeds role-played against a simulated user (dialogue.py): K whole episodes from
              each seed (a trajectory reward, emollm), or one episode per seed with K candidate replies
              drawn at each of its states (a turn reward, emollm_turn or care), each state a group;
  2. score    the judges the reward needs (`rewards.judge_rollouts`, all calls concurrent), then the
              configured reward R_i (`rewards.score`) and, for a composite reward, each component;
  3. filter   (CLUE) a group whose K rewards are all equal or that has a None (missing judge
              feedback) is resampled up to 3 times, then replaced by up to 2 other prompts of the same
              segment; a group still unusable is masked out of the loss and counted (with filtering off,
              an unusable group is masked at once: both arms of the Accuracy-Only ablation scale alike);
  4. advantages  A_i = (R_i - mean(R)) / (std(R) + eps) within each group of K (`group_advantages`);
              an episode's advantage goes to every assistant turn it sampled;
  5. loss     per completion token, rho = exp(logp - logp_old),
              l = -(min(rho A, clip(rho, 1 - eps_lo, 1 + eps_hi) A) - beta KL_k3),
              KL_k3 = exp(ref - logp) - (ref - logp) - 1 against the reference policy (the same network
              with the RL LoRA disabled); averaged over each completion's tokens (an episode's: all its
              assistant turns' tokens) then over completions (`seq-mean-token-mean`) or over all tokens
              (`token-mean`), the counts taken over the whole
              update on every rank, so gradients do not depend on the rank count or micro-batch split;
  6. step     gradients summed over ranks, clipped, AdamW; `loss.passes` steps reuse one rollout batch
              (log-probs of the sampling policy cached from the first pass).

Ranks own whole groups; only LoRA gradients and metrics cross ranks; rank 0 writes. Outputs in
`output_dir`: config.yaml, metrics.jsonl (one line per update, keys in `update_metrics`),
completions.jsonl, `ckpt-<update>` checkpoints (exact resume with `resume: auto`), `adapter/` (the RL
LoRA in PEFT format, on top of the SFT-merged base) and, with `save_merged: true`, `merged/`.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

import data
import dialogue
import rewards
from config import ConfigError, MetricsWriter, parse_cli, print0, save_resolved_config
from judge import JudgeConfig, JudgeError
from model import (LORA_TARGETS, Qwen, add_lora, add_special_tokens, generate, load_adapter, load_tokenizer,
                   lora_disabled, merge_lora, save_adapter, save_merged, token_logprobs)
from train import (Dist, Progress, StopRequest, all_reduce_sum, broadcast_parameters, build_optimizer,
                   latest_checkpoint, load_checkpoint, optimizer_parameters, restore_optimizer, save_checkpoint,
                   set_lr, setup_distributed, sync_gradients, trim_log, warmup_hold_cosine)

# ----------------------------------------------------------------------------- config
# CLUE's Table 5 (LoRA, LR peak, rollout length, beta) was lost in extraction: those defaults are ours.


@dataclass
class ModelSettings:
    path: str  # the base checkpoint (Hugging Face folder), or an SFT-merged one
    sft_adapter: str | None = None  # the SFT adapter (with its <evidence> rows), merged into the base first
    dtype: str = "bfloat16"
    device: str | None = None  # default: cuda:LOCAL_RANK when available, else the CPU
    gradient_checkpointing: bool = False


@dataclass
class LoraSettings:  # not in the paper: the common r 16 / alpha 32 on every projection
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS


@dataclass
class RolloutSettings:  # paper A.2: temperature 1, top-p 1, no top-k, repetition penalty 1
    prompts_per_update: int = 8
    group_size: int = 8  # K
    max_new_tokens: int = 4096  # the paper's per-task limits were lost; long enough for its traces
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    enable_thinking: bool | None = None  # None: the chat template's default (Qwen3 / 3.5 think)


@dataclass
class FilterSettings:  # paper A.2: up to three resampling attempts, then up to two replacement prompts
    enabled: bool = True
    resamples: int = 3
    replacements: int = 2  # each replacement prompt is sampled once


@dataclass
class LossSettings:
    beta: float = 0.04  # KL weight (the GRPO paper's value); 0 skips the reference pass
    clip_low: float = 0.2
    clip_high: float = 0.2
    agg: Literal["seq-mean-token-mean", "token-mean"] = "seq-mean-token-mean"
    passes: int = 1  # optimizer steps per rollout batch
    micro_batch_size: int = 8  # sequences per forward/backward (memory only: the gradient is the same)
    adv_eps: float = 1e-6
    # the std A_i divides by: unbiased (1 / (G - 1), TRL's and verl's) or population (1 / G, EmoLLM B.2)
    adv_std: Literal["unbiased", "population"] = "unbiased"


@dataclass
class OptimSettings:  # paper A.2: AdamW (0.9, 0.99), wd 0.01; warm-up from 5e-7 over 19 updates, hold to 506, cosine
    lr: float = 1e-5  # the peak was lost; a LoRA rate (full fine-tuning rates such as 5e-7 barely move LoRA)
    lr_floor: float = 5e-7
    warmup_updates: int = 19
    hold_until: int = 506
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = 1.0  # not in the paper: the usual GRPO value


@dataclass
class GRPOConfig:
    output_dir: str
    train_data: list[str]  # JSONL files of examples (data.py's schema)
    model: ModelSettings
    updates: int = 723
    reward: rewards.RewardSpec = field(default_factory=rewards.RewardSpec)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    curriculum: data.CurriculumConfig = field(default_factory=data.CurriculumConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    filtering: FilterSettings = field(default_factory=FilterSettings)
    loss: LossSettings = field(default_factory=LossSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    dialogue: dialogue.DialogueSettings | None = None  # set: dialogue RL, train_data holds scenario seeds
    prepare: rewards.ReferenceSettings | None = None  # `grpo.py prepare`: writes train_data[0] with references
    save_every: int = 50  # updates between checkpoints (one is always written at the end)
    keep_checkpoints: int = 2
    resume: Literal["auto", "none"] = "auto"  # auto: continue from the newest checkpoint in output_dir
    save_merged: bool = False  # also write the merged full checkpoint to output_dir/merged
    log_completions: bool = True
    seed: int = 42


# ----------------------------------------------------------------------------- the math


def group_advantages(rewards, group_size: int, eps: float = 1e-6, std: str = "unbiased") -> torch.Tensor:
    """A_i = (R_i - mean(R)) / (std(R) + eps) over consecutive groups of `group_size` rewards, std
    unbiased (Bessel, 1 / (G - 1)) or `population` (1 / G). A group of equal rewards gets zero advantages."""
    if std not in ("unbiased", "population"):
        raise ValueError(f"group_advantages: unknown std {std!r} (unbiased, population)")
    r = torch.as_tensor(rewards, dtype=torch.float32).view(-1, group_size)
    spread = r.std(1, keepdim=True, correction=0 if std == "population" else 1)
    return ((r - r.mean(1, keepdim=True)) / (spread + eps)).view(-1)


def grpo_loss(logp, logp_old, logp_ref, advantages, mask, clip_low=0.2, clip_high=0.2, beta=0.04,
              agg="seq-mean-token-mean", *, normalizer=None, member_tokens=None):
    """The clipped GRPO objective with a k3 KL penalty, as a loss to minimize.

    logp, logp_old, logp_ref: [B, T] log-probabilities of the sampled tokens under the policy being
    trained, the policy that sampled (no gradient) and the reference (None when beta = 0);
    advantages [B]; mask [B, T], True on the tokens the loss covers. Per token:
        rho = exp(logp - logp_old),  l = -(min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A) - beta KL),
        KL = exp(d) - d - 1 with d = logp_ref - logp (k3, >= 0; d clamped to +-20 against overflow).
    agg "seq-mean-token-mean": sum over completions of (mean of l over its tokens) / normalizer;
    agg "token-mean": sum of l over all tokens / normalizer. The normalizer defaults to this batch's
    completion (resp. token) count; a trainer that splits one update into micro-batches or ranks passes
    the count of the whole update, so the pieces' gradients add up to the gradient of the whole. A
    completion over several rows (an episode: a row per assistant turn, each under its own prompt) gives
    `member_tokens` [B], its whole token count on each of its rows, which then count as mask.sum(1) /
    member_tokens of a completion each.

    stats (detached sums over the masked tokens, to be added over pieces): tokens, kl,
    clip_low (tokens with rho < 1 - clip_low and A < 0), clip_high (rho > 1 + clip_high and A > 0)."""
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - logp_old)
    adv = advantages.to(logp.dtype)[:, None]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    kl = torch.zeros_like(logp)
    if beta != 0:
        d = (logp_ref - logp).clamp(-20, 20)
        kl = torch.exp(d) - d - 1
        per_token = per_token + beta * kl
    if agg == "seq-mean-token-mean":
        tokens = (mask.sum(1) if member_tokens is None else member_tokens.to(logp.dtype)).clamp(min=1)
        total = ((per_token * mask).sum(1) / tokens).sum()
        count = mask.shape[0] if member_tokens is None else (mask.sum(1) / tokens).sum()
    elif agg == "token-mean":
        total, count = (per_token * mask).sum(), mask.sum()
    else:
        raise ValueError(f"grpo_loss: unknown agg {agg!r} (seq-mean-token-mean, token-mean)")
    loss = total / (count if normalizer is None else normalizer)
    with torch.no_grad():
        stats = {"tokens": mask.sum(), "kl": (kl * mask).sum(),
                 "clip_low": (((ratio < 1 - clip_low) & (adv < 0)) * mask).sum(),
                 "clip_high": (((ratio > 1 + clip_high) & (adv > 0)) * mask).sum()}
    return loss, stats


def lr_at(update: int, optim: OptimSettings, updates: int) -> float:
    """The learning rate of update `update`, counted from 1 (1..updates): paper A.2's warm-up, hold and cosine."""
    return warmup_hold_cosine(update, optim.lr, optim.lr_floor, optim.warmup_updates, optim.hold_until, updates)


# ----------------------------------------------------------------------------- rewards and their parts


def _registered(name: str):
    """A component computed by the registered reward `name`, with the run's settings it accepts."""
    fn = rewards.REWARDS[name]
    return lambda rollout, params: fn(rollout, {k: v for k, v in params.items() if k in fn.defaults})


def _judged(key: str):
    return lambda rollout, params: rollout.judged.get(key)


def _emollm_term(name: str):
    """One of EmoLLM's turn terms (rewards.emollm_terms) of a reply, or its mean over an episode's turns."""
    def part(rollout, params):
        terms = [rewards.emollm_terms(turn.judged.get("turn_scores")) for turn in rollout.turns or [rollout]]
        return None if None in terms else sum(t[name] for t in terms) / len(terms)
    return part


# The parts of a composite reward logged beside it (metrics rewards/<part>/mean, completions.jsonl).
REWARD_PARTS = {
    "clue": {"c": _registered("correctness"), "f": _registered("evidence_format"), "IU_G": _registered("iu_g")},
    "social_r1": {"R_fmt": _registered("r_fmt"), "R_out": _registered("correctness"),
                  "R_struct": _judged("sip_structure"), "R_content": _judged("sip_content"),
                  "R_len": _registered("r_len")},
    "emollm_turn": {name: _emollm_term(name) for name in rewards.EMOLLM_TERMS},
    "emollm": {**{name: _emollm_term(name) for name in rewards.EMOLLM_TERMS},
               "R_emo": lambda rollout, params: rewards.emotional_gain(rollout)},
}


# ----------------------------------------------------------------------------- rollouts


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
    example: data.Example  # or the dialogue.State the members started from
    samples: list[list[Sample]]
    rollouts: list[rewards.Rollout]
    rewards: list[float | None] = field(default_factory=list)
    parts: dict[str, list[float | None]] = field(default_factory=dict)
    masked: bool = False

    def usable(self) -> bool:
        """Rewards all present and not all equal: the group carries a learning signal."""
        return None not in self.rewards and len(set(self.rewards)) > 1


@dataclass
class Slot:
    """One group position of an update: the prompt it holds now and what filtering has spent on it."""
    index: int  # position among the update's prompts
    example: data.Example
    segment: int
    resamples: int = 0
    replacements: int = 0
    group: Group | None = None


def derived_seed(*parts) -> int:
    """A reproducible 63-bit seed from the run's seed and counters."""
    return random.Random("/".join(map(str, parts))).getrandbits(63)


class PromptSource:
    """The curriculum walked in order: segment after segment (data.curriculum), the last one repeated.
    `cursor` (segment, position) is the data position saved in checkpoints."""

    def __init__(self, segments: list[data.Segment], cursor=(0, 0)):
        self.segments, self.cursor = segments, tuple(cursor)

    def take(self, n: int) -> list[tuple[data.Example, int]]:
        out = []
        for _ in range(n):
            segment, position = self.cursor
            if position == len(self.segments[segment].examples):
                segment, position = min(segment + 1, len(self.segments) - 1), 0
            out.append((self.segments[segment].examples[position], segment))
            self.cursor = (segment, position + 1)
        return out

    def replacement(self, slot: Slot, seed: int) -> data.Example:
        """Another prompt of the slot's segment, drawn at random (seeded, the same on every rank)."""
        pool = self.segments[slot.segment].examples
        choice = random.Random(seed).randrange(len(pool))
        if pool[choice].id == slot.example.id and len(pool) > 1:
            choice = (choice + 1) % len(pool)
        return pool[choice]


def sample_groups(policy: Qwen, tok, examples: list[data.Example], cfg: GRPOConfig, update: int,
                  seed: int) -> list[Group]:
    """Step 1: K completions of each example in one batched `generate` call, parsed into Rollouts."""
    ro, eos = cfg.rollout, set(tok.eos_token_ids)
    prompts = [tok.chat_ids(data.get_task(e.task).messages(e), enable_thinking=ro.enable_thinking) for e in examples]
    policy.eval()
    new, logp = generate(policy, [p for p in prompts for _ in range(ro.group_size)], ro.max_new_tokens,
                         temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                         repetition_penalty=ro.repetition_penalty, eos_token_ids=tok.eos_token_ids, seed=seed,
                         return_logprobs=True)
    groups = []
    for g, (example, prompt) in enumerate(zip(examples, prompts)):
        rows = range(g * ro.group_size, (g + 1) * ro.group_size)
        rollouts = []
        for i in rows:
            text = tok.decode(new[i][:-1] if new[i] and new[i][-1] in eos else new[i])
            reasoning, _ = data.split_completion(text)
            rollouts.append(rewards.Rollout.from_completion(
                example, text, n_reasoning_tokens=data.count_tokens(reasoning, tok), n_completion_tokens=len(new[i]),
                step=update + 1, total_steps=cfg.updates))  # t counts from 1: w(t) reaches 1 + gamma at the last
        groups.append(Group(example, [[Sample(prompt, new[i], logp[i], not new[i] or new[i][-1] not in eos)]
                                      for i in rows], rollouts))
    return groups


def _sample(turn: dialogue.PolicyTurn) -> Sample:
    return Sample(turn.prompt, turn.completion, turn.logp, turn.truncated)


def _turn_group(state: dialogue.State, replies: list[dialogue.PolicyTurn]) -> Group:  # K replies at one state
    return Group(state, [[_sample(r)] for r in replies], [dialogue.turn_rollout(state, r) for r in replies])


def sample_dialogue_groups(policy: Qwen, tok, items: list, cfg: GRPOConfig, seed: int, counts: dict) -> list[Group]:
    """Step 1 of a dialogue run (dialogue.py): K candidate replies at each state (a turn reward), or K episodes
    played from each seed (a trajectory reward; an episode's samples are its assistant turns). The simulator's
    calls are added to `counts`."""
    states, k = [dialogue.as_state(item) for item in items], cfg.rollout.group_size
    respond = dialogue.local_policy(policy, tok, cfg.rollout)
    if dialogue.GROUPING[cfg.reward.name] == "turn":
        replies = respond([dialogue.policy_messages(s, cfg.dialogue) for s in states], k, seed)
        return [_turn_group(s, r) for s, r in zip(states, replies)]
    episodes, simulated = dialogue.play(respond, [s for s in states for _ in range(k)], cfg.dialogue,
                                        cfg.dialogue.simulator or cfg.judge, 1, seed)
    dialogue.add_stats(counts, simulated)
    members = [episodes[g * k:(g + 1) * k] for g in range(len(states))]
    return [Group(s, [[_sample(t.candidates[0]) for t in e.turns] for e in m], [dialogue.episode_rollout(e) for e in m])
            for s, m in zip(states, members)]


def played_slots(policy: Qwen, tok, slots: list[Slot], cfg: GRPOConfig, seed: int, counts: dict) -> list[Slot]:
    """Step 1 of a dialogue run with a turn reward: one episode from each slot's seed, K candidate replies drawn at
    each state (the episode goes on with the first). Each state becomes a slot whose first group is those K."""
    respond = dialogue.local_policy(policy, tok, cfg.rollout)
    episodes, simulated = dialogue.play(respond, [dialogue.as_state(s.example) for s in slots], cfg.dialogue,
                                        cfg.dialogue.simulator or cfg.judge, cfg.rollout.group_size, seed)
    dialogue.add_stats(counts, simulated)
    return [Slot(slot.index * cfg.dialogue.max_turns + k, turn.state, slot.segment,
                 group=_turn_group(turn.state, turn.candidates))
            for slot, episode in zip(slots, episodes) for k, turn in enumerate(episode.turns)]


def score_groups(groups: list[Group], cfg: GRPOConfig) -> dict:
    """Step 2: ask the judges about every rollout at once, then compute each reward and its parts.
    Returns the judges' call statistics."""
    if cfg.dialogue is None:
        judge_stats = rewards.judge_rollouts([r for g in groups for r in g.rollouts], cfg.reward, cfg.judge)
    else:
        judge_stats = dialogue.judge_groups([(g.example, g.rollouts) for g in groups], cfg.reward, cfg.dialogue,
                                            cfg.judge)
    parts = REWARD_PARTS.get(cfg.reward.name, {})
    for g in groups:
        g.rewards = [rewards.score(r, cfg.reward) for r in g.rollouts]
        g.parts = {name: [part(r, cfg.reward.params) for r in g.rollouts] for name, part in parts.items()}
    return judge_stats


def collect_groups(policy: Qwen, tok, source: PromptSource, slots: list[Slot], cfg: GRPOConfig, update: int,
                   where: Dist) -> tuple[list[Group], dict]:
    """Steps 1-3 for this rank's slots: sample, score, and (when filtering is on) resample or replace unusable groups
    until every slot is usable or out of attempts. Unusable groups (a missing reward, or all rewards equal) end masked
    with filtering on or off, out of the loss and of its normalizer: filtering decides only whether they are drawn
    again, so CLUE and its Accuracy-Only ablation scale the same informative groups' gradient alike. A dialogue run
    with a turn reward first plays its seeds: a slot per state (`played_slots`). Judge statistics count the
    simulator's calls too."""
    counts = {"resampled": 0, "replaced": 0, "masked": 0, "generate_s": 0.0, "judge_s": 0.0,
              "calls": 0, "retries": 0, "failures": 0}
    if cfg.dialogue is not None and dialogue.GROUPING[cfg.reward.name] == "turn":
        start = time.perf_counter()
        slots = played_slots(policy, tok, slots, cfg, derived_seed(cfg.seed, "play", update, where.rank), counts)
        counts["generate_s"] += time.perf_counter() - start
    pending, rounds = list(slots), 0
    while pending:
        start = time.perf_counter()
        fresh = [s for s in pending if s.group is None]  # (a played state's first group is already sampled)
        if fresh:
            seed, items = derived_seed(cfg.seed, "sample", update, where.rank, rounds), [s.example for s in fresh]
            sampled = (sample_groups(policy, tok, items, cfg, update, seed) if cfg.dialogue is None
                       else sample_dialogue_groups(policy, tok, items, cfg, seed, counts))
            for slot, group in zip(fresh, sampled):
                slot.group, slot.example = group, group.example  # a seed's state: its resamples share its rubric
        counts["generate_s"] += time.perf_counter() - start
        start = time.perf_counter()
        judged = score_groups([s.group for s in pending], cfg)
        counts["judge_s"] += time.perf_counter() - start
        for key in ("calls", "retries", "failures"):
            counts[key] += judged.get(key, 0)
        retry = []
        for slot in pending:
            if slot.group.usable() or not cfg.filtering.enabled:
                continue
            if slot.resamples < cfg.filtering.resamples:
                slot.resamples += 1
                counts["resampled"] += 1
            elif slot.replacements < cfg.filtering.replacements:
                slot.replacements += 1
                slot.example = source.replacement(slot, derived_seed(cfg.seed, "replace", update, slot.index,
                                                                     slot.replacements))
                counts["replaced"] += 1
            else:
                continue
            slot.group = None
            retry.append(slot)
        pending, rounds = retry, rounds + 1
    groups = [s.group for s in slots]
    for g in groups:
        g.masked = not g.usable()
        counts["masked"] += g.masked
    return groups, counts


# ----------------------------------------------------------------------------- training


@dataclass
class Sequence:
    """One trained sequence: token ids, the positions whose next token the loss covers (`mask[t]`
    True: ids[t + 1] is a policy token), its advantage, the sampler's log-probs on those tokens, and
    the token count of the group member it belongs to (an episode's: all its assistant turns')."""
    ids: list[int]
    mask: list[bool]
    advantage: float
    sampler_logp: list[float]
    member_tokens: int


def training_sequences(groups: list[Group], cfg: GRPOConfig) -> tuple[list[Sequence], list[list[float] | None]]:
    """Step 4: advantages within each unmasked group, and the sequences the loss is computed on.
    Also returns each group's advantages (None for a masked group) for completions.jsonl."""
    sequences, advantages = [], []
    for g in groups:
        if g.masked:
            advantages.append(None)
            continue
        adv = group_advantages(g.rewards, len(g.rewards), cfg.loss.adv_eps, cfg.loss.adv_std).tolist()
        advantages.append(adv)
        for member, a in zip(g.samples, adv):
            tokens = sum(len(s.completion) for s in member)
            for s in member:  # the prompt's tokens (the user's turns among them) are never trained on
                mask = [False] * (len(s.prompt) - 1) + [True] * len(s.completion)
                sequences.append(Sequence(s.prompt + s.completion, mask, a, s.logp, tokens))
    return sequences, advantages


@dataclass
class MicroBatch:
    ids: torch.Tensor  # [b, T], right-padded
    mask: torch.Tensor  # [b, T-1] bool
    advantages: torch.Tensor  # [b]
    sampler_logp: torch.Tensor  # [b, T-1], 0 outside the mask
    member_tokens: torch.Tensor  # [b]


def micro_batches(sequences: list[Sequence], size: int, pad_id: int, device) -> list[MicroBatch]:
    batches = []
    for i in range(0, len(sequences), size):
        part = sequences[i:i + size]
        width = max(len(s.ids) for s in part)
        ids = torch.full((len(part), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(part), width - 1, dtype=torch.bool)
        sampler = torch.zeros(len(part), width - 1)
        for row, s in enumerate(part):
            ids[row, :len(s.ids)] = torch.tensor(s.ids)
            mask[row, :len(s.mask)] = torch.tensor(s.mask)
            sampler[row, mask[row]] = torch.tensor(s.sampler_logp)
        adv, members = torch.tensor([s.advantage for s in part]), torch.tensor([s.member_tokens for s in part])
        batches.append(MicroBatch(ids.to(device), mask.to(device), adv.to(device), sampler.to(device),
                                  members.to(device)))
    return batches


def policy_update(policy: Qwen, optimizer, batches: list[MicroBatch], cfg: GRPOConfig, where: Dist) -> dict:
    """Steps 5-6: the reference pass (beta > 0), then `loss.passes` optimizer steps over the batch.
    The first pass's log-probs are the sampling policy's (logp_old, cached for later passes); the
    loss is normalized by the completion or token count of the whole update over all ranks."""
    ls, temperature = cfg.loss, cfg.rollout.temperature
    params = optimizer_parameters(optimizer)
    seq_mean = ls.agg == "seq-mean-token-mean"  # count completions (episodes, whose rows add up to 1 each) or tokens
    local = sum((b.mask.sum(1) / b.member_tokens.clamp(min=1)).sum() if seq_mean else b.mask.sum() for b in batches)
    normalizer = all_reduce_sum(torch.tensor(float(local), device=where.device))
    out = {"loss": 0.0, "grad_norm": 0.0, "skipped_nonfinite": 0, "entropy": 0.0, "mismatch_sum": 0.0,
           "mismatch_max": 0.0, "tokens": 0.0, "kl": 0.0, "clip_low": 0.0, "clip_high": 0.0}
    if normalizer == 0:  # every group of the update masked: nothing to learn from, no step
        return out
    refs = [None] * len(batches)
    if ls.beta != 0:
        policy.eval()
        with torch.no_grad(), lora_disabled(policy):
            refs = [token_logprobs(policy, b.ids, b.mask, temperature) for b in batches]
    old: list[torch.Tensor | None] = [None] * len(batches)
    policy.train()
    for _ in range(ls.passes):
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=where.device)
        for i, b in enumerate(batches):
            if old[i] is None:
                logp, entropy = token_logprobs(policy, b.ids, b.mask, temperature, entropy=True)
                old[i] = logp.detach()
                gap = (old[i] - b.sampler_logp).abs()[b.mask]
                out["entropy"] += entropy[b.mask].sum().item()
                out["mismatch_sum"] += gap.sum().item()
                out["mismatch_max"] = max(out["mismatch_max"], gap.max().item())
            else:
                logp = token_logprobs(policy, b.ids, b.mask, temperature)
            loss, stats = grpo_loss(logp, old[i], refs[i], b.advantages, b.mask, ls.clip_low, ls.clip_high,
                                    ls.beta, ls.agg, normalizer=normalizer, member_tokens=b.member_tokens)
            loss.backward()
            loss_sum += loss.detach()
            for key, value in stats.items():
                out[key] += value.item() / ls.passes
        sync_gradients(params)
        loss_total = all_reduce_sum(loss_sum)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        if torch.isfinite(loss_total) and torch.isfinite(grad_norm):
            optimizer.step()
        else:  # never apply a non-finite step: the weights stay as they were
            out["skipped_nonfinite"] += 1
        out["loss"] += loss_total.item() / ls.passes
        out["grad_norm"] += grad_norm.item() / ls.passes
    return out


# ----------------------------------------------------------------------------- metrics and logs


def gather_json(value, where: Dist) -> list:
    """Every rank's JSON-able `value`, in rank order, on every rank (the bytes travel through sums,
    one rank's row each; nothing is unpickled)."""
    if where.world_size == 1:
        return [value]
    raw = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=where.device)
    sizes = torch.zeros(where.world_size, dtype=torch.long, device=where.device)
    sizes[where.rank] = raw.numel()
    all_reduce_sum(sizes)
    table = torch.zeros(where.world_size, int(sizes.max()), dtype=torch.uint8, device=where.device)
    table[where.rank, :raw.numel()] = raw
    all_reduce_sum(table)
    return [json.loads(bytes(row[:n].tolist())) for row, n in zip(table.cpu(), sizes.tolist())]


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
        metrics[f"rewards/{name}/mean"], metrics[f"rewards/{name}/std"] = part_mean, part_std
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


# ----------------------------------------------------------------------------- setup


def check_inputs(cfg: GRPOConfig, config_path: str) -> list[data.Example] | list[dialogue.Scenario]:
    """Everything a user can get wrong, checked before any model loads: settings, the reward and its
    judges, the checkpoint folders, the data files (examples, or a dialogue run's scenario seeds).
    Raises ConfigError / DataError with one line."""
    def bad(key, problem):
        return ConfigError(f"{config_path}: '{key}': {problem}")

    talk = cfg.dialogue
    if cfg.reward.name not in rewards.REWARDS:
        raise bad("reward.name", f"unknown reward {cfg.reward.name!r} (known: {', '.join(sorted(rewards.REWARDS))})")
    if (talk is not None) != (cfg.reward.name in dialogue.GROUPING):
        raise bad("dialogue", f"rewards {', '.join(dialogue.GROUPING)} train on role-played dialogues: they, and only "
                              f"they, need a 'dialogue' section (reward: {cfg.reward.name})")
    unknown = sorted(set(cfg.reward.params) - set(rewards.REWARDS[cfg.reward.name].defaults))
    if unknown:
        known = ", ".join(sorted(rewards.REWARDS[cfg.reward.name].defaults)) or "none"
        raise bad(f"reward.params.{unknown[0]}", f"not a setting of reward {cfg.reward.name!r} (known: {known})")
    ro, ls = cfg.rollout, cfg.loss
    for key, value, low in (("rollout.group_size", ro.group_size, 2), ("updates", cfg.updates, 1),
                            ("rollout.prompts_per_update", ro.prompts_per_update, 1),
                            ("rollout.max_new_tokens", ro.max_new_tokens, 1), ("loss.passes", ls.passes, 1),
                            ("loss.micro_batch_size", ls.micro_batch_size, 1), ("save_every", cfg.save_every, 1),
                            ("keep_checkpoints", cfg.keep_checkpoints, 1),
                            *((("dialogue.max_turns", talk.max_turns, 1), ("dialogue.lookahead", talk.lookahead, 1))
                              if talk else ())):
        if value < low:
            raise bad(key, f"must be at least {low}, got {value}")
    if not ro.temperature > 0:
        raise bad("rollout.temperature", f"must be > 0 (log-probabilities are taken at it), got {ro.temperature}")
    for key, folder, needed in (("model.path", cfg.model.path, "config.json"),
                                ("model.sft_adapter", cfg.model.sft_adapter, "adapter_config.json")):
        if folder is not None and not (Path(folder) / needed).is_file():
            raise bad(key, f"{folder} has no {needed}")
    judges = {"judge": cfg.judge} if rewards.REWARD_JUDGES.get(cfg.reward.name) or talk else {}
    judges |= {f"dialogue.{k}": getattr(talk, k) for k in ("simulator", "rubric_judge") if talk and getattr(talk, k)}
    for key, judge_cfg in judges.items():
        try:
            judge_cfg.read_api_key()
        except JudgeError as e:
            raise bad(f"{key}.api_key_env", str(e)) from None
    if not cfg.train_data:
        raise bad("train_data", "no data files given")
    examples = []
    for path in cfg.train_data:
        if not Path(path).is_file():
            raise bad("train_data", f"{path}: file not found")
        if talk:
            examples += dialogue.load_scenarios(path)
            continue
        loaded = data.load_jsonl(path)
        try:
            rewards.check_reward_data(cfg.reward, loaded)
        except data.DataError as e:
            raise data.DataError(f"{path}: {e}") from None
        examples += loaded
    if not examples:
        raise bad("train_data", "the data files hold no examples")
    return examples


def build_policy(cfg: GRPOConfig, where: Dist):
    """The base model with the SFT adapter (and its <evidence> rows) merged in, plus a fresh LoRA: the
    only trainable parameters (embedding and lm_head stay frozen). Disabling it gives the reference."""
    tok = load_tokenizer(cfg.model.path)
    policy = Qwen.from_pretrained(cfg.model.path, dtype=cfg.model.dtype, device=where.device)
    if cfg.model.sft_adapter:
        add_special_tokens(policy, tok, [data.EVIDENCE_OPEN, data.EVIDENCE_CLOSE])  # the ids the SFT run gave them
        merge_lora(load_adapter(policy, cfg.model.sft_adapter))
    torch.manual_seed(cfg.seed)
    add_lora(policy, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.targets)
    policy.gradient_checkpointing = cfg.model.gradient_checkpointing
    return policy, tok


# ----------------------------------------------------------------------------- the training loop


def train(cfg: GRPOConfig, examples: list[data.Example]) -> None:
    where = setup_distributed(cfg.model.device)
    out = Path(cfg.output_dir)
    save_resolved_config(cfg, out)
    policy, tok = build_policy(cfg, where)
    segments = [data.Segment("scenarios", examples)] if cfg.dialogue else data.curriculum(examples, cfg.curriculum)
    source = PromptSource(segments)
    checkpoint = latest_checkpoint(out) if cfg.resume == "auto" else None
    start = 0
    if checkpoint is not None:
        meta = load_checkpoint(checkpoint, policy)
        start, source.cursor = meta["trainer"]["update"], tuple(meta["trainer"]["cursor"])
        print0(f"resuming from {checkpoint} (update {start} of {cfg.updates})")
    optimizer = build_optimizer(policy, cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.betas)
    if checkpoint is not None:
        restore_optimizer(checkpoint, optimizer, meta)
    else:
        broadcast_parameters(optimizer_parameters(optimizer))
    for name in ("metrics.jsonl", "completions.jsonl"):
        trim_log(out / name, start, where)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_ids[0]
    progress = Progress(cfg.updates, first_step=start)
    with MetricsWriter(out / "metrics.jsonl") as metrics_log, \
            MetricsWriter(out / "completions.jsonl") as completions_log, StopRequest() as stop:
        for update in range(start, cfg.updates):
            lr = lr_at(update + 1, cfg.optim, cfg.updates)  # `update` counts from 0, the paper's updates from 1
            set_lr(optimizer, lr)
            # 1-3. sample, score, filter: this rank's share of the update's prompts
            drawn = source.take(cfg.rollout.prompts_per_update)
            slots = [Slot(i, example, segment) for i, (example, segment) in enumerate(drawn)
                     if i % where.world_size == where.rank]
            groups, counts = collect_groups(policy, tok, source, slots, cfg, update, where)
            # 4. advantages
            start_train = time.perf_counter()
            sequences, advantages = training_sequences(groups, cfg)
            batches = micro_batches(sequences, cfg.loss.micro_batch_size, pad_id, where.device)
            # 5-6. loss and optimizer step(s)
            trained = policy_update(policy, optimizer, batches, cfg, where)
            trained["train_s"] = time.perf_counter() - start_train
            reports = gather_json(rank_report(groups, counts, trained), where)
            metrics = update_metrics(reports, update + 1, lr, cfg.loss.beta)
            records = gather_json(completion_records(groups, advantages, tok, update + 1)
                                  if cfg.log_completions else [], where)
            n_tokens = sum(r["prompt_tokens"] + sum(r["lengths"]) for r in reports)
            metrics |= progress.log(update, n_tokens, reward=metrics["reward"] or 0.0, loss=metrics["loss"],
                                    masked=metrics["groups/masked"])
            metrics.pop("elapsed_s", None)
            metrics_log.write(metrics)
            for record in (r for rank_records in records for r in rank_records):
                completions_log.write(record)
            done = update + 1
            stopping = stop.requested(where.device)
            if done % cfg.save_every == 0 or done == cfg.updates or stopping:
                save_checkpoint(out, done, policy, optimizer, {"update": done, "cursor": list(source.cursor)},
                                keep=cfg.keep_checkpoints)
            if stopping:
                print0(f"stopped after update {done}; `resume: auto` continues from {out}")
                return
    if where.main:
        base = None if cfg.model.sft_adapter else cfg.model.path  # else: the SFT-merged base, not on disk
        save_adapter(policy, out / "adapter", base_model_name_or_path=base)
        if cfg.save_merged:
            save_merged(policy, tok, out / "merged")
    print0(f"done: {out / 'adapter'}")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv[:1] == ["prepare"] else "train"
    cfg = parse_cli(GRPOConfig, argv)
    try:
        if command == "prepare":
            if cfg.prepare is None:
                raise ConfigError(f"{argv[0]}: missing section 'prepare' (what `grpo.py prepare` builds data from)")
            rewards.prepare_references(cfg.prepare, cfg.train_data[0])
            return
        examples = check_inputs(cfg, argv[0])
    except (ConfigError, data.DataError, JudgeError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    train(cfg, examples)


if __name__ == "__main__":
    main()
