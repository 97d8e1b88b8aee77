"""GRPO on role-played dialogues (EmoLLM 3.2.2, CARE 3.4): grpo.py's trainer, with the scenario
seeds as its data and the dialogue sampler (play.py) as its sampler. Run from the repository root:

    torchrun --nproc_per_node=N -m dialogue.rl configs/emollm_qwen3_8b.yaml [key=value ...]
    python -m dialogue.rl configs/dialogue_demo.yaml model.path=PATH      # one process

The config is grpo.py's plus a `dialogue:` section (play.DialogueSettings); `train_data` holds
scenario seeds (prepare/emollm_seeds.py), walked as one segment (play.scenario_segments); the slots
are played first (play.play_slots); the reward is one of rewards.DIALOGUE_GROUPING."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpo
import rewards
from config import ConfigSource, config_error
from dialogue.play import (
    DialogueSettings,
    dialogue_sampler,
    judge_probes,
    load_scenarios,
    play_slots,
    scenario_segments,
)
from judge import CARE_DIMENSIONS, care_rubric


@dataclass
class DialogueConfig(grpo.GRPOConfig):
    dialogue: DialogueSettings = field(default_factory=DialogueSettings)


def check_inputs(cfg: DialogueConfig, config_path: str | ConfigSource) -> list:
    """grpo.check_settings, then what a dialogue run adds: a dialogue reward, CARE's fixed criteria,
    the keys of the dialogue's endpoints, the scenario seeds (returned). One line each."""
    grpo.check_settings(cfg, config_path)
    spec, settings = cfg.reward, cfg.dialogue
    if spec.name not in rewards.DIALOGUE_GROUPING:
        raise config_error(
            config_path,
            "reward.name",
            f"a dialogue run trains {', '.join(rewards.DIALOGUE_GROUPING)}, not {spec.name} "
            "(single-turn rewards run with grpo.py)",
        )
    fixed = settings.fixed_criteria
    if fixed is not None and (
        spec.name != "care"
        or care_rubric({d: {"weight": 1 / 3, "criteria": fixed.get(d)} for d in fixed}) is None
    ):
        raise config_error(
            config_path,
            "dialogue.fixed_criteria",
            f"reward care only, with 2-4 distinct criteria for each of "
            f"{', '.join(CARE_DIMENSIONS)}",
        )
    if cfg.rollout.engine == "vllm":
        raise config_error(
            config_path,
            "rollout.engine",
            "vllm samples single-turn prompts; dialogue runs sample with 'local'",
        )
    endpoints = {"judge": cfg.judge} | {
        f"dialogue.{key}": getattr(settings, key)
        for key in ("simulator", "rubric_judge", "predictor")
        if getattr(settings, key) is not None
    }
    for key, endpoint in endpoints.items():
        endpoint.check_key(key, config_path)
    if not cfg.train_data:
        raise config_error(config_path, "train_data", "no scenario files given")
    scenarios = []
    for path in cfg.train_data:
        if not Path(path).is_file():
            raise config_error(config_path, "train_data", f"{path}: file not found")
        scenarios += load_scenarios(path)
    return scenarios


def probes(cfg: DialogueConfig, scenarios: list) -> list:
    return judge_probes(cfg.reward, cfg.dialogue, cfg.judge, scenarios[0])


def main(argv=None) -> None:
    grpo.main(
        argv, DialogueConfig, check_inputs, probes, dialogue_sampler, scenario_segments, play_slots
    )


if __name__ == "__main__":
    main()
