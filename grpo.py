"""Stage 2: GRPO with grounded rewards. Run: `torchrun --nproc_per_node=N grpo.py config.yaml
[key=value ...]` (or `python grpo.py config.yaml` for one process). Social-R1's reference analyses
are written first, through a teacher, by `python -m prepare.references config.yaml`.

One update (`train`, in this order):
  1. sample   P prompts from the current curriculum segment, K completions each, parsed into
              `rewards.Rollout`s by the run's sampler (rollout.py: `model.generate`; a vLLM server
              with `rollout.engine: vllm`);
  2. score    the judges the reward needs (`rewards.judge_rollouts`, all calls concurrent), then the
              configured reward R_i (`rewards.score`) and the parts its registration declares
              (`score_groups`);
  3. filter   (CLUE) a group whose K rewards are all equal or that has a None (missing judge
              feedback) is resampled up to 3 times, then replaced by up to 2 other prompts of the
              same segment; a group still unusable is masked out of the loss and counted
              (`filter_decision`; with filtering off it is masked at once, so both arms of the
              Accuracy-Only ablation scale alike);
  4. advantages  A_i = (R_i - mean(R)) / (std(R) + eps) within each group of K (`group_advantages`);
  5. loss     per completion token, rho = exp(logp - logp_old), l = -(min(rho A, clip(rho, 1 -
              eps_lo, 1 + eps_hi) A) - beta KL_k3), KL_k3 = exp(ref - logp) - (ref - logp) - 1
              against the reference policy (the same network with the RL LoRA disabled); averaged
              over each completion's tokens then over completions (`seq-mean-token-mean`) or over
              all tokens (`token-mean`), the counts taken over the whole update on every rank, so
              gradients do not depend on the rank count or micro-batch split;
  6. step     gradients summed over ranks, clipped, AdamW; `loss.passes` steps reuse one rollout
              batch (log-probs of the sampling policy cached from the first pass).

The prompts come in curriculum order (paper A.2: `curriculum`, walked by `PromptSource`). `train`
picks the sampler once (`rollout_sampler`: rollout.PromptSampler); an extension hands in its own
sampler, data order and slot hook (dialogue/rl.py: role-played episodes or per-state candidate
replies); nothing else changes.

Ranks own whole groups; the groups filtering sends back are dealt across the ranks each round
(`deal_slots`); only LoRA gradients, metrics and those slots cross ranks; rank 0 writes. Outputs in
`output_dir`: config.yaml, metrics.jsonl (one line per update, keys in `rollout.update_metrics`),
completions.jsonl, `ckpt-<update>` checkpoints (exact resume with `resume: auto`), `adapter/` (the
RL LoRA in PEFT format, on top of the SFT-merged base) and, with `save_merged: true`, `merged/`.
With `finetune: full` every weight but embedding and lm_head trains, sharded (fsdp.py), against a
frozen sharded reference; out: `model/`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

import data
import dataset
import rewards
from checkpoint import (
    ModelCard,
    checkpoint_path,
    checkpoint_problem,
    resume,
    save_checkpoint,
    save_final,
    trim_log,
)
from config import (
    ConfigError,
    ConfigSource,
    MetricsWriter,
    ReportTo,
    bounded,
    check_report_to,
    config_error,
    excerpt,
    parse_cli,
    print0,
    read_metrics,
    save_resolved_config,
)
from distributed import DistributedSettings, Ranks, all_reduce_sum, gather_json, setup_distributed
from fsdp import GatheredSampler, pad_batches, sharded_model
from http_client import JudgeAuthError, JudgeConfig, JudgeError
from http_client import probe as judge_probe
from model import (
    Packing,
    Qwen,
    add_lora,
    add_special_tokens,
    compile_problem,
    load_adapter,
    lora_disabled,
    merge_lora,
    token_logprobs,
)
from rollout import (
    Group,
    PromptSampler,
    RolloutError,
    end_line,
    log_update,
    rollout_stop,
    run_summary,
    unscored_cause,
    unscored_stop,
)
from tokenizer import CheckpointError, load_tokenizer
from train import (
    LoraSettings,
    Progress,
    StopRequest,
    build_optimizer,
    check_compile,
    clip_gradients,
    finetune_settings,
    optimizer_parameters,
    set_lr,
    sync_gradients,
    token_budget_parts,
)
from vllm_engine import VLLMSampler, VLLMSettings

# ----------------------------------------------------------------------------- config
# CLUE's Table 5 (LoRA, LR peak, rollout length, beta)
# was lost in extraction: those defaults are ours.


@dataclass
class ModelSettings:
    path: str  # the base checkpoint (Hugging Face folder), or an SFT-merged one
    # the SFT adapter (with its <evidence> rows), merged into the base first
    sft_adapter: str | None = None
    dtype: str = "bfloat16"
    device: str | None = None  # default: cuda:LOCAL_RANK when available, else the CPU
    gradient_checkpointing: bool = False
    # torch.compile each layer for training's forwards and backwards (Qwen.compile_layers)
    compile: bool = False

    def check(self, config_path) -> None:
        """The checkpoint folders are there (a ConfigError at the key, config.config_error)."""
        for key, folder, needed in (
            ("model.path", self.path, "config.json"),
            ("model.sft_adapter", self.sft_adapter, "adapter_config.json"),
        ):
            if folder is not None and not (Path(folder) / needed).is_file():
                raise config_error(config_path, key, f"{folder} has no {needed}")


@dataclass
class RolloutSettings:  # paper A.2: temperature 1, top-p 1, no top-k, repetition penalty 1
    prompts_per_update: int = bounded(8, ge=1)
    group_size: int = bounded(8, ge=2)  # K
    # the paper's per-task limits were lost; long enough for its traces
    max_new_tokens: int = bounded(4096, ge=1)
    temperature: float = bounded(1.0, gt=0)
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    enable_thinking: bool | None = None  # None: the chat template's default (Qwen3 / 3.5 think)
    # engine local, single-turn prompts: model.generate's decode step; static: one CUDA graph per
    # step (captured once per batch), compiled: also through torch.compile; auto: static on CUDA,
    # eager on a CPU (model.resolve_decode)
    decode: Literal["auto", "eager", "static", "compiled"] = "auto"
    # vllm: sampled by the server in `vllm` (vllm_engine.py), the LoRA or whole weights synced
    engine: Literal["local", "vllm"] = "local"
    vllm: VLLMSettings = field(default_factory=VLLMSettings)

    def check(self, config_path, device: str | None) -> None:
        """The engine can run on `device` (model.device): the vLLM server's key is set, a compiled
        decode step can be built (a ConfigError at the key, config.config_error)."""
        if self.engine == "vllm":
            self.vllm.check_key(config_path)
        if self.engine == "local" and self.decode == "compiled" and (p := compile_problem(device)):
            raise config_error(
                config_path, "rollout.decode", f"{p}; install one, or use decode: eager"
            )


# paper A.2: up to three resampling attempts, then up to two replacement prompts
@dataclass
class FilterSettings:
    enabled: bool = True
    resamples: int = 3
    replacements: int = 2  # each replacement prompt is sampled once
    # filtering off: mask a group of all-equal rewards (out of the loss and its normalizer), or keep
    # it, its advantages 0, its tokens in the normalizer and their KL term in the loss (verl's GRPO)
    mask_equal: bool = True
    # updates in a row that train no group because rewards are missing (a judge down, a judge the
    # reward never asked): at this many the run saves and stops, exit 1 (`unscored_stop`)
    max_unscored_updates: int = bounded(3, ge=1)


@dataclass
class LossSettings:
    beta: float = 0.04  # KL weight (the GRPO paper's value); 0 skips the reference pass
    clip_low: float = 0.2
    clip_high: float = 0.2
    agg: Literal["seq-mean-token-mean", "token-mean"] = "seq-mean-token-mean"
    passes: int = bounded(1, ge=1)  # optimizer steps per rollout batch
    # sequences per forward/backward (memory only: the gradient is the same)
    micro_batch_size: int = bounded(8, ge=1)
    # set: micro-batches of at most this many tokens, the sequences packed without padding
    # (`packed_micro_batches`), instead of micro_batch_size right-padded rows
    micro_batch_tokens: int | None = bounded(None, ge=2)
    adv_eps: float = 1e-6
    # the std A_i divides by: unbiased (1 / (G - 1),
    # TRL's and verl's) or population (1 / G, EmoLLM B.2)
    adv_std: Literal["unbiased", "population"] = "unbiased"


# paper A.2: AdamW (0.9, 0.99), wd 0.01; warm-up from 5e-7 over 19 updates, hold to 506, cosine
@dataclass
class OptimSettings:
    # the peak was lost; a LoRA rate (full fine-tuning rates such as 5e-7 barely move LoRA)
    lr: float = bounded(1e-5, ge=0)
    lr_floor: float = 5e-7
    warmup_updates: int = bounded(19, ge=0)
    hold_until: int = 506
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = 1.0  # not in the paper: the usual GRPO value


# paper A.2: full conversations by increasing difficulty, then contexts cut to 5, 10 or 20 turns
@dataclass
class CurriculumConfig:
    context_turns: tuple[int, ...] = (5, 10, 20)  # preceding turns kept in the shortened contexts
    seed: int = 0


@dataclass
class GRPOConfig:
    output_dir: str
    train_data: list[str]  # JSONL files of examples (data.py's schema)
    model: ModelSettings
    updates: int = bounded(723, ge=1)
    reward: rewards.RewardSpec = field(default_factory=rewards.RewardSpec)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    # full: every weight but embedding and lm_head, sharded (fsdp.py)
    finetune: Literal["lora", "full"] = "lora"
    lora: LoraSettings | None = None  # LoRA runs only; left out: LoraSettings()
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    filtering: FilterSettings = field(default_factory=FilterSettings)
    loss: LossSettings = field(default_factory=LossSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    distributed: DistributedSettings = field(default_factory=DistributedSettings)
    # updates between checkpoints (one is always written at the end)
    save_every: int = bounded(50, ge=1)
    keep_checkpoints: int = bounded(2, ge=1)
    # auto: continue from the newest checkpoint in output_dir
    resume: Literal["auto", "none"] = "auto"
    save_merged: bool = False  # also write the merged full checkpoint to output_dir/merged
    log_completions: bool = True
    # live views beside metrics.jsonl: tensorboard, wandb (sinks.py; optional packages)
    report_to: ReportTo = field(default_factory=list)
    seed: int = 42

    def __post_init__(self):
        check_report_to(self.report_to, self.output_dir)
        self.lora = finetune_settings(self.finetune, self.lora, self.save_merged, LoraSettings())
        if self.model.compile:
            check_compile("model.compile", self.finetune, self.loss.micro_batch_tokens)


# ----------------------------------------------------------------------------- the math


def group_advantages(
    rewards, group_size: int, eps: float = 1e-6, std: str = "unbiased"
) -> torch.Tensor:
    """A_i = (R_i - mean(R)) / (std(R) + eps) over consecutive groups of `group_size` rewards, std
    unbiased (Bessel, 1 / (G - 1)) or `population` (1 / G). A group of equal rewards gets zero
    advantages."""
    r = torch.as_tensor(rewards, dtype=torch.float32).view(-1, group_size)
    spread = r.std(1, keepdim=True, correction=0 if std == "population" else 1)
    return ((r - r.mean(1, keepdim=True)) / (spread + eps)).view(-1)


def grpo_loss(
    logp,
    logp_old,
    logp_ref,
    advantages,
    mask,
    clip_low=0.2,
    clip_high=0.2,
    beta=0.04,
    agg="seq-mean-token-mean",
    *,
    normalizer=None,
    row_weight=None,
    token_weight=None,
):
    """The clipped GRPO objective with a k3 KL penalty, as a loss to minimize.

    logp, logp_old, logp_ref: [B, T] log-probabilities of the sampled tokens under the policy being
    trained, the policy that sampled (no gradient) and the reference (None when beta = 0);
    advantages [B]; mask [B, T], True on the tokens the loss covers. Per token:
        rho = exp(logp - logp_old),  l = -(min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A) -
                                     beta KL),
        KL = exp(d) - d - 1 with d = logp_ref - logp (k3, >= 0; d clamped to +-20 against overflow).
    agg "seq-mean-token-mean": sum over completions of (mean of l over its tokens) / normalizer; agg
    "token-mean": sum of l over all tokens / normalizer. The normalizer defaults to this batch's
    completion (resp. token) count; a trainer that splits one update into micro-batches or ranks
    passes the count of the whole update, so the pieces' gradients add up to the gradient of the
    whole. With `row_weight` [B] (seq-mean-token-mean only), row b counts as row_weight[b] of a
    completion: its token mean is scaled by it and the count is their sum. A completion split over
    several rows gives each row its share of the completion's tokens, so the completion counts once,
    as the mean over all its tokens. `token_weight` [B, T] multiplies each token's clipped surrogate
    (not its KL): the sampler's weight of its tokens (what rollout.Sampler.rollouts hands the
    loss; a served engine's truncated importance weights).

    stats (detached sums over the masked tokens, to be added over pieces): tokens, kl, clip_low
    (tokens with rho < 1 - clip_low and A < 0), clip_high (rho > 1 + clip_high and A > 0)."""
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - logp_old)
    adv = advantages.to(logp.dtype)[:, None]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    per_token = per_token * (1 if token_weight is None else token_weight)
    kl = torch.zeros_like(logp)
    if beta != 0:
        d = (logp_ref - logp).clamp(-20, 20)
        kl = torch.exp(d) - d - 1
        per_token = per_token + beta * kl
    if agg == "seq-mean-token-mean":
        means = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
        if row_weight is None:
            total = means.sum()
            count = mask.shape[0]
        else:
            total = (means * row_weight.to(logp.dtype)).sum()
            count = row_weight.to(logp.dtype).sum()
    elif agg == "token-mean":
        total = (per_token * mask).sum()
        count = mask.sum()
    else:
        raise ValueError(f"grpo_loss: unknown agg {excerpt(agg)} (seq-mean-token-mean, token-mean)")
    loss = total / (count if normalizer is None else normalizer)
    with torch.no_grad():
        stats = {
            "tokens": mask.sum(),
            "kl": (kl * mask).sum(),
            "clip_low": (((ratio < 1 - clip_low) & (adv < 0)) * mask).sum(),
            "clip_high": (((ratio > 1 + clip_high) & (adv > 0)) * mask).sum(),
        }
    return loss, stats


def lr_at(update: int, optim: OptimSettings, updates: int) -> float:
    """The RL schedule (CLUE A.2) at `update`, counted from 1 as the paper counts (1..updates):
    update 1 runs at `optim.lr_floor`, and the rate rises linearly over `optim.warmup_updates` to
    the peak `optim.lr` at update warmup + 1 (no warm-up: update 1 runs at the peak); it holds
    through update `optim.hold_until`, then a cosine takes it back to the floor at update
    `updates`, the last one that runs (507 is the first below the peak)."""
    peak, floor, warmup, hold = optim.lr, optim.lr_floor, optim.warmup_updates, optim.hold_until
    if update <= warmup:
        return floor + (peak - floor) * (update - 1) / warmup
    if update <= hold:
        return peak
    progress = min(1.0, (update - hold) / max(1, updates - hold))
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- the data order


@dataclass
class Segment:
    """One stage of the curriculum; replacement prompts are drawn from the same segment."""

    name: str
    examples: list[data.Example]


def truncate_context(example: data.Example, n: int) -> data.Example:
    """The example with only the target and its preceding `n` turns (unchanged when it has no target
    or no more turns than that). Reply links and cause indices are shifted; links to dropped turns
    go."""
    if example.target is None or example.target <= n:
        return example
    start = example.target - n

    def shift(index):
        return index - start if index is not None and index >= start else None

    turns = [
        dataclasses.replace(t, reply_to=shift(t.reply_to))
        for t in example.turns[start : example.target + 1]
    ]
    meta = dict(example.meta)
    if "causes" in meta:
        meta["causes"] = [
            c | {"turn": shift(c["turn"])} for c in meta["causes"] if shift(c["turn"]) is not None
        ]
    return dataclasses.replace(example, id=f"{example.id}/ctx{n}", turns=turns, target=n, meta=meta)


def curriculum(examples: list[data.Example], cfg: CurriculumConfig) -> list[Segment]:
    """Two segments (paper A.2). "full": full conversations, each task ordered by increasing
    difficulty (unrated examples last, file order within ties) and the tasks interleaved in
    proportion to their size. "mixed": every example once more, its context drawn uniformly from the
    full conversation and the `context_turns` truncations, shuffled. Deterministic for
    `cfg.seed`."""
    by_task: dict[str, list[data.Example]] = {}
    for example in examples:
        by_task.setdefault(example.task, []).append(example)
    ranked = []
    for group in by_task.values():
        ordered = sorted(group, key=lambda e: (e.difficulty is None, e.difficulty or 0.0))
        ranked += [((rank + 0.5) / len(ordered), e) for rank, e in enumerate(ordered)]
    full = [e for _, e in sorted(ranked, key=lambda pair: pair[0])]
    rng = random.Random(cfg.seed)
    choices = (None, *cfg.context_turns)
    mixed = [e if (n := rng.choice(choices)) is None else truncate_context(e, n) for e in examples]
    rng.shuffle(mixed)
    return [Segment("full", full), Segment("mixed", mixed)]


def curriculum_segments(cfg: GRPOConfig, examples: list[data.Example]) -> list[Segment]:
    """A single-turn run's data order: `curriculum` (an extension hands grpo.train its own)."""
    return curriculum(examples, cfg.curriculum)


class PromptSource:
    """The curriculum walked in order: segment after segment (`curriculum`), the last one
    repeated. `cursor` (segment, position) is the data position saved in checkpoints."""

    def __init__(self, segments: list[Segment], cursor=(0, 0)):
        self.segments = segments
        self.cursor = tuple(cursor)
        # each example's position in its segment: how a slot names its prompt to another rank
        self.positions = [{id(e): i for i, e in enumerate(s.examples)} for s in segments]

    def take(self, n: int) -> list[tuple[data.Example, int]]:
        out = []
        for _ in range(n):
            segment, position = self.cursor
            if position == len(self.segments[segment].examples):
                segment = min(segment + 1, len(self.segments) - 1)
                position = 0
            out.append((self.segments[segment].examples[position], segment))
            self.cursor = (segment, position + 1)
        return out

    def replacement(self, slot: Slot, seed: int) -> data.Example:
        """Another prompt of the slot's segment, drawn at random (seeded, the same on every
        rank)."""
        pool = self.segments[slot.segment].examples
        choice = random.Random(seed).randrange(len(pool))
        if pool[choice].id == slot.example.id and len(pool) > 1:
            choice = (choice + 1) % len(pool)
        return pool[choice]


# ----------------------------------------------------------------- steps 1-3: sample, score, filter


def rollout_sampler(cfg: GRPOConfig, policy: Qwen, tok, ranks: Ranks, out_dir: Path, content=None):
    """The run's sampler (rollout.py's interface): a vLLM server with `rollout.engine: vllm`, else
    rollout.PromptSampler; a sharded policy sampled here is gathered whole. `content`: a scorer of
    R_content in the prompted judge's place (reward_models/social_r1.py's trained RM)."""
    settings = (cfg.rollout, cfg.reward, cfg.judge, cfg.updates)
    if cfg.rollout.engine == "vllm":
        return VLLMSampler(policy, tok, *settings, ranks, out_dir, content)
    sampler = PromptSampler(policy, tok, *settings, content)
    return GatheredSampler(sampler, policy) if cfg.finetune == "full" else sampler


def derived_seed(*parts) -> int:
    """A reproducible 63-bit seed from the run's seed and counters."""
    return random.Random("/".join(map(str, parts))).getrandbits(63)


@dataclass
class Slot:
    """One group position of an update: the prompt it holds now and what filtering has spent on
    it."""

    index: int  # position among the update's prompts
    example: object  # a data.Example, or an extension's (dialogue/play.py: a Scenario, a State)
    segment: int
    resamples: int = 0
    replacements: int = 0
    group: Group | None = None


def update_slots(source: PromptSource, n: int, ranks: Ranks) -> list[Slot]:
    """The update's next `n` prompts of the curriculum as slots, this rank's share of them."""
    drawn = source.take(n)
    return [
        Slot(i, example, segment)
        for i, (example, segment) in enumerate(drawn)
        if i % ranks.world_size == ranks.rank
    ]


def collect_groups(
    sampler,
    source: PromptSource,
    slots: list[Slot],
    cfg: GRPOConfig,
    update: int,
    ranks: Ranks,
    play=None,
) -> tuple[list[Group], dict]:
    """Steps 1-3 for this rank's slots: sample, score, filter, again for the slots filtering sends
    back, until every slot holds a usable group or is out of attempts. Each round's waiting slots
    are dealt across the ranks (`dealt_rounds`), unless an extension's `play(sampler, slots, seed,
    counts)` first turns them into slots of its own, which stay on this rank (dialogue/play.py's
    `play_slots`: a turn reward's states played). Returns the groups and the update's counters."""
    counts = {
        "resampled": 0,
        "replaced": 0,
        "masked": 0,
        "generate_s": 0.0,
        "judge_s": 0.0,
        "train_s": 0.0,
        "calls": 0,
        "retries": 0,
        "failures": 0,
        "malformed": 0,
        "judge_error": None,  # the first failed call's reason, for unscored_stop's line
    }

    def attempt(pending: list[Slot], round_: int) -> tuple[list[Slot], list[Slot]]:
        seed = derived_seed(cfg.seed, "sample", update, ranks.rank, round_)
        return sample_score_filter(sampler, source, pending, cfg, update, seed, counts)

    if play is None:
        done = dealt_rounds(slots, attempt, source, ranks)
    else:
        with timer(counts, "generate_s"):
            slots = play(sampler, slots, derived_seed(cfg.seed, "play", update, ranks.rank), counts)
        done = local_rounds(slots, attempt)
    groups = [s.group for s in sorted(done, key=lambda s: s.index)]
    counts["unscored"] = sum(g.masked and None in g.rewards for g in groups)
    return groups, counts


def sample_score_filter(
    sampler,
    source: PromptSource,
    slots: list[Slot],
    cfg: GRPOConfig,
    update: int,
    seed: int,
    counts: dict,
) -> tuple[list[Slot], list[Slot]]:
    """Steps 1-3 once for these slots: sample the ones without a group, score, filter. Returns the
    slots done with (kept or masked) and the ones filtering sends back."""
    if not slots:
        return [], []
    fresh = [s for s in slots if s.group is None]  # a played state's first group is there
    if fresh:  # 1. sample
        with timer(counts, "generate_s"):
            sampled = sampler.sample([s.example for s in fresh], update, seed, counts)
        for slot, group in zip(fresh, sampled):
            slot.group = group
            slot.example = group.example  # a seed's state: its resamples share its rubric
    with timer(counts, "judge_s"):  # 2. score
        judge_stats = score_groups([s.group for s in slots], cfg.reward, sampler.judge)
    count_calls(counts, judge_stats)
    decisions = filter_slots(slots, source, cfg, update)  # 3. filter
    count_decisions(counts, decisions)
    again = [d in ("resample", "replace") for d in decisions]
    return [s for s, a in zip(slots, again) if not a], [s for s, a in zip(slots, again) if a]


def score_groups(groups: list[Group], reward: rewards.RewardSpec, judge) -> dict:
    """Step 2: ask the judges about every rollout at once (`judge`, the sampler's), then compute
    each reward and the parts its registration declares. Returns the judges' call statistics."""
    judge_stats = judge(groups)
    parts = rewards.REWARDS[reward.name].parts
    for g in groups:
        g.rewards = [rewards.score(r, reward) for r in g.rollouts]
        g.parts = {
            name: [part(r, reward.params) for r in g.rollouts] for name, part in parts.items()
        }
    return judge_stats


def filter_decision(
    group_rewards: list[float | None], resamples: int, replacements: int, filtering: FilterSettings
) -> str:
    """Step 3's rule for one scored group: "keep", "resample", "replace" (its prompt) or "mask" (out
    of the loss). With filtering on (CLUE), a group whose rewards hold a None or are all equal is
    resampled while resampling attempts remain, then replaced while replacements remain, then
    masked. With filtering off such a group is masked at once (a None always; all-equal rewards with
    `mask_equal`, as both arms of CLUE's Accuracy-Only ablation do, so the same informative groups
    get the same gradient in both) or, all-equal without `mask_equal`, kept as verl keeps it."""
    if None not in group_rewards and (
        len(set(group_rewards)) > 1 or not (filtering.enabled or filtering.mask_equal)
    ):
        return "keep"
    if not filtering.enabled:
        return "mask"
    if resamples < filtering.resamples:
        return "resample"
    if replacements < filtering.replacements:
        return "replace"
    return "mask"


def filter_slots(
    slots: list[Slot], source: PromptSource, cfg: GRPOConfig, update: int
) -> list[str]:
    """Step 3: each slot's `filter_decision`, applied: a resampled slot is emptied, a replaced one
    gets another prompt of its segment, a masked group is marked. Returns the decisions, in slot
    order."""
    decisions = []
    for slot in slots:
        decision = filter_decision(
            slot.group.rewards, slot.resamples, slot.replacements, cfg.filtering
        )
        slot.group.masked = decision == "mask"
        if decision == "resample":
            slot.resamples += 1
        if decision == "replace":
            slot.replacements += 1
            seed = derived_seed(cfg.seed, "replace", update, slot.index, slot.replacements)
            slot.example = source.replacement(slot, seed)
        if decision in ("resample", "replace"):
            slot.group = None
        decisions.append(decision)
    return decisions


@contextlib.contextmanager
def timer(counts: dict, key: str):
    """The block's seconds added to counts[key]: the steps' timing, kept out of the steps."""
    start = time.perf_counter()
    yield
    counts[key] += time.perf_counter() - start


def count_calls(counts: dict, judge_stats: dict) -> None:
    for key in ("calls", "retries", "failures", "malformed"):
        counts[key] += judge_stats.get(key, 0)
    errors = list(judge_stats.get("errors", {}).values())
    counts["judge_error"] = counts["judge_error"] or (errors[0] if errors else None)


def count_decisions(counts: dict, decisions: list[str]) -> None:
    for decision, key in (("resample", "resampled"), ("replace", "replaced"), ("mask", "masked")):
        counts[key] += decisions.count(decision)


def dealt_rounds(slots: list[Slot], attempt, source: PromptSource, ranks: Ranks) -> list[Slot]:
    """`attempt(pending, round)` (steps 1-3 once) in rounds, each round's waiting slots of every
    rank dealt across the ranks first (`deal_slots`), until none waits anywhere. A RolloutError here
    ends this rank's work and is raised on every rank at the next deal. Returns the slots this rank
    is done with."""
    pending, done, error, round_ = list(slots), [], None, 0
    while True:
        pending, waiting = deal_slots(pending, source, ranks, error)
        if not waiting:
            return done
        try:
            finished, pending = attempt(pending, round_)
        except RolloutError as e:
            finished, pending, error = [], [], str(e)  # the next deal raises it on every rank
        done += finished
        round_ += 1


def deal_slots(
    pending: list[Slot], source: PromptSource, ranks: Ranks, error: str | None
) -> tuple[list[Slot], int]:
    """Every rank's slots waiting for a group, gathered and dealt in turn by slot index, so that no
    rank idles through a round while another resamples (a collective: every rank calls it once per
    round). A slot travels as its index, its prompt's place in the curriculum and what filtering
    has spent on it. `error`: this rank's RolloutError of the last round, raised on every rank.
    Returns this rank's share and the number waiting on all ranks."""
    mine = [
        [
            s.index,
            s.segment,
            source.positions[s.segment][id(s.example)],
            s.resamples,
            s.replacements,
        ]
        for s in pending
    ]
    everyone = gather_json({"slots": mine, "error": error}, ranks)
    errors = [r["error"] for r in everyone if r["error"] is not None]
    if errors:
        raise RolloutError(error or f"another rank's rollouts failed: {errors[0]}")
    waiting = sorted(row for r in everyone for row in r["slots"])
    share = [
        Slot(index, source.segments[segment].examples[position], segment, resamples, replaced)
        for index, segment, position, resamples, replaced in waiting[ranks.rank :: ranks.world_size]
    ]
    return share, len(waiting)


def local_rounds(slots: list[Slot], attempt) -> list[Slot]:
    """`attempt(pending, round)` in rounds over this rank's own slots until none waits."""
    pending, done, round_ = list(slots), [], 0
    while pending:
        finished, pending = attempt(pending, round_)
        done += finished
        round_ += 1
    return done


# ---------------------------------------------------------------- steps 4-6: advantages, loss, step


def advantages_by_group(groups: list[Group], loss: LossSettings) -> list[list[float] | None]:
    """Step 4: each unmasked group's advantages (`group_advantages` over its K rewards, with
    `loss.adv_eps` and `loss.adv_std`); None for a masked group."""
    return [
        None
        if g.masked
        else group_advantages(g.rewards, len(g.rewards), loss.adv_eps, loss.adv_std).tolist()
        for g in groups
    ]


@dataclass
class Sequence:
    """One trained sequence: token ids, the positions whose next token the loss covers (`mask[t]`
    True: ids[t + 1] is a policy token), its advantage, the sampler's log-probs on those tokens, and
    the share of its group member's completion tokens it holds (1 unless the member sampled several
    rows)."""

    ids: list[int]
    mask: list[bool]
    advantage: float
    sampler_logp: list[float]
    row_weight: float


def training_sequences(groups: list[Group], advantages: list[list[float] | None]) -> list[Sequence]:
    """The sequences the loss is computed on: every sample of every unmasked group's members, with
    the member's advantage. A member sampled in several rows (dialogue/play.py's episodes: a row per
    assistant turn, each under its own prompt) gives each row its share of the member's tokens, so
    the member counts once in the loss."""
    sequences = []
    for g, adv in zip(groups, advantages):
        if adv is None:
            continue
        for member, a in zip(g.samples, adv):
            tokens = sum(len(s.completion) for s in member)
            # the prompt's tokens (the user's turns among them) are never trained on
            for s in member:
                mask = [False] * (len(s.prompt) - 1) + [True] * len(s.completion)
                weight = len(s.completion) / max(1, tokens)
                sequences.append(Sequence(s.prompt + s.completion, mask, a, s.logp, weight))
    return sequences


@dataclass
class MicroBatch:
    """b sequences for one forward and backward. The loss's tensors (mask, sampler_logp) are [b,
    T-1], right-padded, either way; `ids` is [b, T] right-padded, or with `packing` [1, N], the b
    sequences packed one after another, `packed_mask` [1, N-1] then selecting the same positions
    in that row."""

    ids: torch.Tensor
    mask: torch.Tensor  # [b, T-1] bool
    advantages: torch.Tensor  # [b]
    sampler_logp: torch.Tensor  # [b, T-1], 0 outside the mask
    row_weight: torch.Tensor  # [b]
    packing: Packing | None = None
    packed_mask: torch.Tensor | None = None


def micro_batch(part: list[Sequence], pad_id: int, device, packed: bool) -> MicroBatch:
    """`part` as one micro-batch, right-padded with `pad_id` or packed."""
    width = max(len(s.ids) for s in part)
    mask = torch.zeros(len(part), width - 1, dtype=torch.bool)
    sampler = torch.zeros(len(part), width - 1)
    for row, s in enumerate(part):
        mask[row, : len(s.mask)] = torch.tensor(s.mask)
        sampler[row, mask[row]] = torch.tensor(s.sampler_logp)
    packing = packed_mask = None
    if packed:
        ids = torch.tensor([[t for s in part for t in s.ids]])
        # a sequence's last token predicts nothing: its next token opens the next sequence
        packed_mask = torch.tensor([[m for s in part for m in [*s.mask, False]][:-1]]).to(device)
        packing = Packing.of([len(s.ids) for s in part], device)
    else:
        ids = torch.full((len(part), width), pad_id, dtype=torch.long)
        for row, s in enumerate(part):
            ids[row, : len(s.ids)] = torch.tensor(s.ids)
    return MicroBatch(
        ids.to(device),
        mask.to(device),
        torch.tensor([s.advantage for s in part], device=device),
        sampler.to(device),
        torch.tensor([s.row_weight for s in part], device=device),
        packing,
        packed_mask,
    )


def micro_batches(sequences: list[Sequence], size: int, pad_id: int, device) -> list[MicroBatch]:
    """Right-padded micro-batches of `size` sequences, in order."""
    return [
        micro_batch(sequences[i : i + size], pad_id, device, packed=False)
        for i in range(0, len(sequences), size)
    ]


def packed_micro_batches(sequences: list[Sequence], max_tokens: int, device) -> list[MicroBatch]:
    """Packed micro-batches of at most `max_tokens` tokens (train.token_budget_parts). The loss does
    not depend on the split: it is normalized over the whole update."""
    return [
        micro_batch([sequences[i] for i in part], 0, device, packed=True)
        for part in token_budget_parts([len(s.ids) for s in sequences], max_tokens)
    ]


def loss_batches(sequences: list[Sequence], loss: LossSettings, pad_id: int, device):
    """The update's micro-batches: `loss.micro_batch_size` right-padded rows each, or packed into
    at most `loss.micro_batch_tokens` tokens when that is set."""
    if loss.micro_batch_tokens is None:
        return micro_batches(sequences, loss.micro_batch_size, pad_id, device)
    return packed_micro_batches(sequences, loss.micro_batch_tokens, device)


def batch_logprobs(model: Qwen, b: MicroBatch, temperature: float, entropy: bool = False):
    """token_logprobs of a micro-batch in the loss's layout [b, T-1] (a packed batch's computed on
    its row, then put in place); with entropy=True, (logp, entropy)."""
    if b.packing is None:
        return token_logprobs(model, b.ids, b.mask, temperature, entropy)
    out = token_logprobs(model, b.ids, b.packed_mask, temperature, entropy, packing=b.packing)
    placed = [
        torch.zeros(b.mask.shape, device=x.device).masked_scatter(b.mask, x[b.packed_mask])
        for x in (out if entropy else (out,))
    ]
    return tuple(placed) if entropy else placed[0]


def idle_batch(device) -> MicroBatch:
    """A micro-batch that weighs nothing in the loss: one all-masked row."""
    return MicroBatch(
        torch.zeros(1, 2, dtype=torch.long, device=device),
        torch.zeros(1, 1, dtype=torch.bool, device=device),
        *(torch.zeros(shape, device=device) for shape in (1, (1, 1), 1)),
    )


def accumulate_loss(
    policy: Qwen,
    batches: list[MicroBatch],
    old: list,
    refs: list,
    normalizer,
    cfg: GRPOConfig,
    ranks: Ranks,
    stats: dict,
    token_weights=None,
) -> torch.Tensor:
    """Step 5: the loss of every micro-batch, backward into the gradients; returns this rank's loss
    sum. The first pass's log-probs are the sampling policy's (logp_old, cached into `old`
    for later passes) and give the entropy and the sampler mismatch; `token_weights(logp_old,
    logp_sampler)` (the sampler's, from its rollouts span: rollout.Sampler) weighs each token's
    surrogate; the loss statistics are added into `stats`."""
    loss_cfg = cfg.loss
    temperature = cfg.rollout.temperature
    loss_sum = torch.zeros((), device=ranks.device)
    for i, b in enumerate(batches):
        # the sampler mismatch: |logp_old - the sampler's log-probs| (vLLM's with engine vllm)
        if old[i] is None:
            logp, entropy = batch_logprobs(policy, b, temperature, entropy=True)
            old[i] = logp.detach()
            gap = (old[i] - b.sampler_logp).abs()[b.mask]
            stats["entropy"] += entropy[b.mask].sum().item()
            stats["mismatch_sum"] += gap.sum().item()
            stats["mismatch_max"] = max(
                stats["mismatch_max"], gap.max().item() if gap.numel() else 0.0
            )
        else:
            logp = batch_logprobs(policy, b, temperature)
        loss, sums = grpo_loss(
            logp,
            old[i],
            refs[i],
            b.advantages,
            b.mask,
            loss_cfg.clip_low,
            loss_cfg.clip_high,
            loss_cfg.beta,
            loss_cfg.agg,
            normalizer=normalizer,
            row_weight=b.row_weight,
            token_weight=None if token_weights is None else token_weights(old[i], b.sampler_logp),
        )
        loss.backward()
        loss_sum += loss.detach()
        for key, value in sums.items():
            stats[key] += value.item() / loss_cfg.passes
    return loss_sum


def policy_update(
    policy: Qwen,
    optimizer,
    batches: list[MicroBatch],
    cfg: GRPOConfig,
    ranks: Ranks,
    reference: Qwen | None = None,
    token_weights=None,
) -> dict:
    """Steps 5-6, `loss.passes` times over one rollout batch, after the reference pass (beta > 0):
    the loss (`accumulate_loss`), then the step. The loss is normalized by the completion or token
    count of the whole update over all ranks. Returns the training stats."""
    # every rank of a sharded policy runs the same forwards and backwards: pad with batches that
    # weigh nothing
    if cfg.finetune == "full":
        batches = pad_batches(batches, idle_batch(ranks.device), ranks.device)
    seq_mean = cfg.loss.agg == "seq-mean-token-mean"  # count completions (weighted rows) or tokens
    local = sum(b.row_weight.sum() if seq_mean else b.mask.sum() for b in batches)
    normalizer = all_reduce_sum(torch.tensor(float(local), device=ranks.device))
    stats = {
        "loss": 0.0,
        "grad_norm": 0.0,
        "skipped_nonfinite": 0,
        "entropy": 0.0,
        "mismatch_sum": 0.0,
        "mismatch_max": 0.0,
        "tokens": 0.0,
        "kl": 0.0,
        "clip_low": 0.0,
        "clip_high": 0.0,
    }
    if normalizer == 0:  # every group of the update masked: nothing to learn from, no step
        return stats
    # the reference's log-probs: the policy without its RL LoRA (full mode: the frozen copy)
    refs = [None] * len(batches)
    if cfg.loss.beta != 0:
        policy.eval()
        with torch.no_grad(), lora_disabled(reference or policy):
            refs = [
                batch_logprobs(reference or policy, b, cfg.rollout.temperature) for b in batches
            ]
    old: list[torch.Tensor | None] = [None] * len(batches)
    params = optimizer_parameters(optimizer)
    policy.train()
    for _ in range(cfg.loss.passes):
        optimizer.zero_grad(set_to_none=True)
        # 5. loss (summed over ranks for the log and the finiteness check)
        loss = accumulate_loss(
            policy, batches, old, refs, normalizer, cfg, ranks, stats, token_weights
        )
        loss_total = all_reduce_sum(loss)
        # 6. step: gradients summed over ranks, clipped, one AdamW step
        sync_gradients(params)
        grad_norm = clip_gradients(params, cfg.optim.grad_clip)
        if torch.isfinite(loss_total) and math.isfinite(grad_norm):
            optimizer.step()
        else:  # never apply a non-finite step: the weights stay as they were (counted)
            stats["skipped_nonfinite"] += 1
        stats["loss"] += loss_total.item() / cfg.loss.passes
        stats["grad_norm"] += grad_norm / cfg.loss.passes
    return stats


# ----------------------------------------------------------------------------- set-up


def check_settings(cfg: GRPOConfig, config_path: str | ConfigSource) -> None:
    """The settings a user can get wrong, checked before any model loads, each by its owner: the
    reward (rewards.check_spec), the checkpoint folders, the engine, the judge's key when the
    reward asks one. Raises ConfigError with one line."""
    rewards.check_spec(cfg.reward, config_path)
    cfg.model.check(config_path)
    cfg.rollout.check(config_path, cfg.model.device)
    if rewards.judges_needed(cfg.reward):
        cfg.judge.check_key("judge", config_path)


def check_inputs(cfg: GRPOConfig, config_path: str | ConfigSource) -> list:
    """Everything a user can get wrong in a single-turn run, checked before any model loads
    (check_settings, then the examples of `train_data`, each file checked against what the reward
    reads: rewards.check_reward_data); returns the examples."""
    check_settings(cfg, config_path)
    if cfg.reward.name in rewards.DIALOGUE_GROUPING:
        raise config_error(
            config_path,
            "reward.name",
            f"{cfg.reward.name} trains on role-played dialogues: run `python -m dialogue.rl`",
        )
    return dataset.load_files(
        cfg.train_data, config_path, lambda loaded: rewards.check_reward_data(cfg.reward, loaded)
    )


def judge_probes(cfg: GRPOConfig, examples: list) -> list:
    """(config key, endpoint, call) for http_client.probe: one request of each kind the run's judges
    will get, about the first example (rewards.judge_probes)."""
    return [
        ("judge", cfg.judge, call)
        for _, call in rewards.judge_probes(cfg.reward, examples[0], cfg.judge)
    ]


def build_policy(cfg: GRPOConfig, ranks: Ranks, like: Qwen | None = None):
    """(policy, tokenizer): the base model with the SFT adapter (and its <evidence> rows) merged
    in, plus a fresh LoRA: the only trainable parameters (embedding and lm_head stay frozen);
    disabling it gives the reference. `finetune: full`: fsdp.sharded_model, every weight but
    embedding and lm_head trained (`like`: the frozen reference of such a policy)."""
    m = cfg.model
    tok = load_tokenizer(m.path)
    # the ids the SFT run gave them
    tags = [data.EVIDENCE_OPEN, data.EVIDENCE_CLOSE] if m.sft_adapter else []
    if cfg.finetune == "full":
        d = cfg.distributed
        policy = sharded_model(
            m.path,
            m.dtype,
            ranks.device,
            tok,
            tags,
            m.sft_adapter,
            like=like,
            seed=cfg.seed,
            replicas=d.replicas,
            timeout_s=d.timeout_s,
        )
        policy.gradient_checkpointing = m.gradient_checkpointing
        return policy, tok
    policy = Qwen.from_pretrained(m.path, dtype=m.dtype, device=ranks.device)
    if m.sft_adapter:
        add_special_tokens(policy, tok, tags)
        merge_lora(load_adapter(policy, m.sft_adapter))
    torch.manual_seed(cfg.seed)
    add_lora(
        policy, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.targets, cfg.lora.compute
    )
    policy.gradient_checkpointing = m.gradient_checkpointing
    if m.compile:
        policy.compile_layers()
    return policy, tok


def schedule_notes(cfg: GRPOConfig) -> list[str]:
    """The parts of the LR schedule a run of `cfg.updates` never reaches (a short trial run of a
    paper config): said before the first update and recorded in the model card."""
    o, n = cfg.optim, cfg.updates
    if n <= o.warmup_updates:
        return [
            f"schedule: updates={n} ends inside the warm-up (optim.warmup_updates="
            f"{o.warmup_updates}): the LR rises from {o.lr_floor:g} to {lr_at(n, o, n):.3g}, never "
            f"to optim.lr={o.lr:g}"
        ]
    if n < o.hold_until:
        return [
            f"schedule: updates={n} ends before optim.hold_until={o.hold_until}: the LR holds at "
            f"optim.lr={o.lr:g} to the end, with no cosine decay"
        ]
    return []


def start_up(cfg, config_path, check=check_inputs, probes=judge_probes) -> list:
    """The examples of a run, once `check` has passed its inputs (before any model loads) and each
    endpoint of `probes` has answered a real request (http_client.probe): every trainer entry point
    starts here (integrations/trl.py too). A failure ends the command with one line, exit 2."""
    try:
        examples = check(cfg, config_path)
        for key, endpoint, call in probes(cfg, examples):
            judge_probe(call, endpoint, key)
    except (ConfigError, data.DataError, JudgeError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return examples


# ----------------------------------------------------------------------------- the run's records


def resume_state(cfg: GRPOConfig, policy, source: PromptSource, ranks: Ranks):
    """(optimizer, first update, unscored streak) of the run, save_state's counterpart: a fresh
    AdamW (train.build_optimizer), or with `resume: auto` the newest checkpoint's state
    (checkpoint.resume: weights, optimizer, RNG; `source`'s cursor set to its data position). The
    schedule's notes are said, and the logs trimmed to the first update."""
    out_dir = Path(cfg.output_dir)
    optimizer, meta, path = resume(
        out_dir,
        policy,
        lambda: build_optimizer(policy, cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.betas),
        cfg.rollout.prompts_per_update,
        cfg.resume == "auto",
    )
    start, unscored_streak = 0, 0
    if meta is not None:
        start, source.cursor = meta["trainer"]["update"], tuple(meta["trainer"]["cursor"])
        unscored_streak = meta["trainer"].get("unscored_streak", 0)
        print0(f"resuming from {path} (update {start} of {cfg.updates})")
    for note in schedule_notes(cfg):
        print0(note)
    for name in ("metrics.jsonl", "completions.jsonl"):
        trim_log(out_dir / name, start, ranks)
    return optimizer, start, unscored_streak


def save_state(cfg: GRPOConfig, update: int, policy, optimizer, cursor, unscored_streak: int):
    """The checkpoint of the state after `update` updates, exact resume's trainer state."""
    trainer = {"update": update, "cursor": list(cursor), "unscored_streak": unscored_streak}
    save_checkpoint(
        Path(cfg.output_dir),
        update,
        policy,
        optimizer,
        trainer,
        cfg.rollout.prompts_per_update,
        keep=cfg.keep_checkpoints,
    )


def save_final_model(cfg: GRPOConfig, policy, tok, ranks: Ranks) -> None:
    """The run's model (checkpoint.save_final: `adapter/`, or a full run's `model/`, with its card
    and lineage; `merged/` with save_merged) and its last line (`end_line`)."""
    out_dir = Path(cfg.output_dir)
    final = out_dir / ("model" if cfg.finetune == "full" else "adapter")
    trained_tokens, summary = run_summary(read_metrics(out_dir / "metrics.jsonl"))
    card = ModelCard(
        cfg.model.path,
        f"GRPO (DeepSeekMath's group-relative policy optimization) with the `{cfg.reward.name}` "
        "reward; the reward's paper and section: docs/paper-configs.md",
        cfg.train_data,
        cfg,
        out_dir / "metrics.jsonl",
        sft_adapter=cfg.model.sft_adapter,
        trained=[summary, *schedule_notes(cfg)],
    )
    merged = out_dir / "merged" if cfg.save_merged else None
    save_final(policy, tok, final, ranks, card, merged, lineage=cfg.finetune == "lora")
    end_line(final, trained_tokens, summary)


# ----------------------------------------------------------------------------- the run


def train(
    cfg: GRPOConfig,
    examples: list,
    sampler_for=rollout_sampler,
    segments_for=curriculum_segments,
    play=None,
) -> None:
    """The run: `updates` updates of the six steps (module docstring), checkpoints, the final model.
    An extension hands in its own `sampler_for(cfg, policy, tok, ranks, out_dir)` (the run's
    sampler), `segments_for(cfg, examples)` (its data order) and `play` (collect_groups' slot hook):
    dialogue/rl.py."""
    ranks = setup_distributed(cfg.model.device, cfg.distributed, cfg.output_dir)
    out_dir = Path(cfg.output_dir)
    save_resolved_config(cfg, out_dir)
    policy, tok = build_policy(cfg, ranks)
    # a full-parameter run's KL needs a frozen, sharded reference
    full_kl = cfg.lora is None and cfg.loss.beta != 0
    reference = build_policy(cfg, ranks, like=policy)[0] if full_kl else None
    sampler = sampler_for(cfg, policy, tok, ranks, out_dir)
    source = PromptSource(segments_for(cfg, examples))
    optimizer, start, unscored_streak = resume_state(cfg, policy, source, ranks)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_ids[0]
    progress = Progress(cfg.updates, first_step=start)
    with (
        MetricsWriter(out_dir / "metrics.jsonl", cfg.report_to, cfg) as metrics_log,
        MetricsWriter(out_dir / "completions.jsonl") as completions_log,
        StopRequest() as stop,
    ):
        logs = (metrics_log, completions_log)
        for update in range(start, cfg.updates):
            lr = lr_at(update + 1, cfg.optim, cfg.updates)  # `update` counts from 0, A.2's from 1
            set_lr(optimizer, lr)
            cursor = source.cursor
            slots = update_slots(source, cfg.rollout.prompts_per_update, ranks)
            # 1-3. sample, score, filter (again for the slots filtering sends back)
            try:
                with sampler.rollouts(update) as token_weights:  # None: every token weight 1
                    groups, counts = collect_groups(
                        sampler, source, slots, cfg, update, ranks, play
                    )
            # nothing of this update is trained: the checkpoint holds the state before it (one
            # saved at this update already does, with the RNG as the update began: kept)
            except RolloutError as e:
                if checkpoint_problem(checkpoint_path(out_dir, update)):
                    save_state(cfg, update, policy, optimizer, cursor, unscored_streak)
                rollout_stop(e, update, out_dir)
            # 4. advantages
            advantages = advantages_by_group(groups, cfg.loss)
            sequences = training_sequences(groups, advantages)
            batches = loss_batches(sequences, cfg.loss, pad_id, ranks.device)
            # 5-6. loss and step, `loss.passes` times
            with timer(counts, "train_s"):
                trained = policy_update(
                    policy, optimizer, batches, cfg, ranks, reference, token_weights
                )
            metrics, reports = log_update(
                groups, counts, trained, advantages, tok, update, lr, cfg, ranks, progress, logs
            )
            done = update + 1
            unscored = metrics["tokens/trained"] == 0 and metrics["groups/unscored"] > 0
            unscored_streak = unscored_streak + 1 if unscored else 0
            give_up = unscored_streak >= cfg.filtering.max_unscored_updates
            stopping = stop.requested(ranks.device)
            if done % cfg.save_every == 0 or done == cfg.updates or stopping or give_up:
                save_state(cfg, done, policy, optimizer, source.cursor, unscored_streak)
            if give_up:
                unscored_stop(unscored_streak, metrics, unscored_cause(reports), out_dir)
            if stopping:
                print0(f"stopped after update {done}; `resume: auto` continues from {out_dir}")
                return
    save_final_model(cfg, policy, tok, ranks)


def main(
    argv=None,
    config_class=GRPOConfig,
    check=check_inputs,
    probes=judge_probes,
    sampler_for=rollout_sampler,
    segments_for=curriculum_segments,
    play=None,
) -> None:
    """`python grpo.py config.yaml [key=value ...]`: the config read and checked (`check`: the
    examples), each endpoint asked once (`probes`: http_client.probe), then `train`. An extension
    runs its kind of GRPO through here with its own config class, checks, probes and sampler
    (dialogue/rl.py, reward_models/social_r1.py), and its data order and slot hook (`train`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_cli(config_class, argv)
    examples = start_up(cfg, ConfigSource(argv[0], tuple(argv[1:])), check, probes)
    try:
        train(cfg, examples, sampler_for, segments_for, play)
    # a refused key; vLLM at start-up (down, other weights, no adapter); a checkpoint of
    # another mode or world size; an output_dir the ranks do not share
    except (JudgeAuthError, RolloutError, CheckpointError, ConfigError) as e:
        print0(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
