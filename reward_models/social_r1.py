"""Social-R1's GRPO the paper's way (section 4.1): the social_r1 reward with R_content scored by the
trained content RM (content_rm.py) instead of a prompted judge, so no example needs a reference
analysis. grpo.py's trainer with a `content_model:` section; run from the repository root:

    torchrun --nproc_per_node=N -m reward_models.social_r1 configs/social_r1_qwen3_8b.yaml

The RM is scored in-process on each rank's device (`content_model.path`) or served
(`content_model.endpoint`: `python -m reward_models.content_rm serve`), asked R_content's prompt
without a reference through the judge client."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import dataset
import grpo
import rewards
from config import ConfigSource, config_error
from reward_models.content_rm import RM_INFO, ContentModelSettings, content_scorer


@dataclass
class SocialR1Config(grpo.GRPOConfig):
    content_model: ContentModelSettings = field(default_factory=ContentModelSettings)


def check_inputs(cfg: SocialR1Config, config_path: str | ConfigSource) -> list:
    """The content RM (reward social_r1 with R_content on, either a path holding a trained RM or an
    endpoint, with its key), then grpo.check_settings; the examples need no reference."""
    rm = cfg.content_model
    if cfg.reward.name != "social_r1" or (rm.path is None) == (rm.endpoint is None):
        raise config_error(
            config_path,
            "content_model",
            "reward social_r1 only, with either a path (in-process) or an endpoint (served)",
        )
    if rm.path is not None and not (Path(rm.path) / RM_INFO).is_file():
        raise config_error(
            config_path,
            "content_model.path",
            f"{rm.path} has no {RM_INFO} (train one: python -m reward_models.content_rm)",
        )
    if rewards.CONTENT_JUDGE not in rewards.judges_needed(cfg.reward):
        raise config_error(
            config_path, "content_model", "R_content is switched off (reward.params.use_content: 0)"
        )
    if rm.endpoint is not None:
        rm.endpoint.check_key("content_model.endpoint", config_path)
    grpo.check_settings(cfg, config_path)
    return dataset.load_files(
        cfg.train_data,
        config_path,
        lambda loaded: rewards.check_reward_data(cfg.reward, loaded, content_model=True),
    )


def probes(cfg: SocialR1Config, examples: list) -> list:
    """The judge's kinds at `judge`, R_content's at the served RM (none for an in-process one)."""
    endpoint = cfg.content_model.endpoint
    return [
        ("content_model.endpoint", endpoint, call)
        if name == rewards.CONTENT_JUDGE
        else ("judge", cfg.judge, call)
        for name, call in rewards.judge_probes(cfg.reward, examples[0], cfg.judge, content=True)
        if name != rewards.CONTENT_JUDGE or endpoint is not None
    ]


def sampler_for(cfg: SocialR1Config, policy, tok, ranks, out_dir):
    scorer = content_scorer(cfg.content_model, policy.device, cfg.model.dtype)
    return grpo.rollout_sampler(cfg, policy, tok, ranks, out_dir, scorer)


def main(argv=None) -> None:
    grpo.main(argv, SocialR1Config, check_inputs, probes, sampler_for)


if __name__ == "__main__":
    main()
