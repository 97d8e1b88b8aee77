"""What one GRPO update samples and learns from, shared by the single-turn trainer (grpo.py) and the dialogue mode
(dialogue.py): a `Sample` (the token ids of one sampled completion and the prompt it answered), a `Group` (K
samplings from one starting point with their rewards) and a `Slot` (a group position of the update, with what
filtering has spent on it). Imports nothing from the project."""

from __future__ import annotations

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
