"""The YAML config loader, key=value overrides, and the run-output helpers of data.py."""

import json
import math
import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest
import yaml
from helpers import REPO

from config import (
    ConfigError,
    MetricsWriter,
    excerpt,
    load_config,
    parse_cli,
    redact_secrets,
    save_resolved_config,
)


@dataclass
class Optim:
    lr: float = 1e-4
    betas: tuple[float, ...] = (0.9, 0.99)
    warmup_steps: int = 0


@dataclass
class Judge:
    base_url: str = "http://127.0.0.1:8000/v1"
    api_key_env: Optional[str] = None
    api_key: Optional[str] = None


@dataclass
class Reward:
    name: str
    weight: float = 1.0


@dataclass
class Cfg:
    model_path: str
    output_dir: str = "runs/x"
    seed: int = 42
    bf16: bool = True
    agg: Literal["seq-mean-token-mean", "token-mean"] = "seq-mean-token-mean"
    optim: Optim = field(default_factory=Optim)
    judge: Judge = field(default_factory=Judge)
    rewards: list[Reward] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)


def write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_loads_nested_values_and_defaults(tmp_path):
    path = write(
        tmp_path,
        "model_path: /m\noptim:\n  lr: 3e-5\n  betas: [0.9, 0.95]\n"
        "rewards:\n  - {name: correctness}\n  - {name: iu_g, weight: 2}\n",
    )
    cfg = load_config(path, [], Cfg)
    assert cfg.model_path == "/m"
    # PyYAML alone reads '3e-5' as str
    assert cfg.optim.lr == pytest.approx(3e-5) and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.9, 0.95)
    assert cfg.optim.warmup_steps == 0 and cfg.seed == 42 and cfg.judge.api_key is None
    assert cfg.rewards == [Reward("correctness", 1.0), Reward("iu_g", 2.0)]
    assert isinstance(cfg.rewards[1].weight, float)


def test_overrides_are_typed_by_yaml_rules(tmp_path):
    path = write(tmp_path, "model_path: /m\nseed: 1\n")
    cfg = load_config(
        path,
        [
            "seed=7",
            "bf16=false",
            "optim.lr=2e-6",
            "tasks=[a, b]",
            "judge.api_key_env=JUDGE_KEY",
            "model_path=/other=path",
        ],
        Cfg,
    )
    assert cfg.seed == 7 and cfg.bf16 is False and cfg.optim.lr == pytest.approx(2e-6)
    assert cfg.tasks == ["a", "b"] and cfg.judge.api_key_env == "JUDGE_KEY"
    assert cfg.model_path == "/other=path"  # only the first '=' splits


def test_unknown_key_names_file_line_and_key(tmp_path):
    path = write(tmp_path, "model_path: /m\noptim:\n  lr: 1e-5\n  lrr: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, [], Cfg)
    msg = str(e.value)
    assert f"{path}:4" in msg and "'optim.lrr'" in msg and "lr" in msg and "\n" not in msg


def test_mistyped_key_names_file_line_and_type(tmp_path):
    path = write(tmp_path, "model_path: /m\n\nseed: forty-two\n")
    with pytest.raises(ConfigError, match=rf"{path}:3: 'seed' expects int, got str 'forty-two'"):
        load_config(path, [], Cfg)
    path = write(tmp_path, "model_path: /m\nseed: 1.5\n")
    with pytest.raises(ConfigError, match="'seed' expects int"):
        load_config(path, [], Cfg)
    path = write(tmp_path, "model_path: /m\nbf16: 1\n")
    with pytest.raises(ConfigError, match="'bf16' expects bool"):
        load_config(path, [], Cfg)


def test_bad_override_is_named(tmp_path):
    path = write(tmp_path, "model_path: /m\n")
    with pytest.raises(ConfigError, match=r"override 'optim\.lr=fast': 'optim\.lr' expects float"):
        load_config(path, ["optim.lr=fast"], Cfg)
    with pytest.raises(
        ConfigError, match=r"override 'optim\.momentum=1'.*unknown key 'optim\.momentum'"
    ):
        load_config(path, ["optim.momentum=1"], Cfg)
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(path, ["seed"], Cfg)
    with pytest.raises(ConfigError, match="must be one of"):
        load_config(path, ["agg=sum"], Cfg)


def test_a_list_item_is_overridden_by_its_index(tmp_path):
    """`rewards.1.weight=3` sets the second item's key (an evaluation's `sets.0.path=...`); an
    index past the list, or a key the item lacks, is refused naming the override."""
    path = write(tmp_path, "model_path: /m\nrewards:\n  - {name: a}\n  - {name: b, weight: 2}\n")
    cfg = load_config(path, ["rewards.1.weight=3", "rewards.0.name=c"], Cfg)
    assert [(r.name, r.weight) for r in cfg.rewards] == [("c", 1.0), ("b", 3.0)]
    with pytest.raises(
        ConfigError, match=r"override 'rewards\.2\.name=x': 'rewards' is a list of 2 item\(s\)"
    ):
        load_config(path, ["rewards.2.name=x"], Cfg)
    with pytest.raises(
        ConfigError, match=r"override 'rewards\.0\.colour=1': unknown key 'rewards\[0\]\.colour'"
    ):
        load_config(path, ["rewards.0.colour=1"], Cfg)
    with pytest.raises(ConfigError, match=r"override 'rewards\.0\.weight=heavy'.*expects float"):
        load_config(path, ["rewards.0.weight=heavy"], Cfg)


def test_a_reward_setting_given_as_an_override_is_named_by_its_override(capsys):
    """A check after loading (grpo.check_settings: the reward's own settings) names the override
    that set the key, not the YAML file; a key set in the file keeps its file and line."""
    import grpo

    with pytest.raises(SystemExit) as stop:
        grpo.main([str(REPO / "configs" / "demo_grpo.yaml"), "reward.params.lambda_i=1"])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: override 'reward.params.lambda_i=1': 'reward.params.lambda_i'")
    with pytest.raises(SystemExit):
        grpo.main([str(REPO / "configs" / "demo_grpo.yaml"), "reward.name=social_r1"])
    err = capsys.readouterr().err
    line = next(
        n
        for n, text in enumerate((REPO / "configs" / "demo_grpo.yaml").read_text().splitlines(), 1)
        if "params: {lambda_iu" in text
    )
    assert f"demo_grpo.yaml:{line}: 'reward.params.lambda_iu': not a setting" in err, err


def test_missing_required_key_and_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="missing required key 'model_path'"):
        load_config(write(tmp_path, "seed: 1\n"), [], Cfg)
    with pytest.raises(ConfigError, match="missing required key 'rewards\\[0\\]\\.name'"):
        load_config(write(tmp_path, "model_path: /m\nrewards:\n  - {weight: 1}\n"), [], Cfg)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.yaml", [], Cfg)
    with pytest.raises(ConfigError, match=r"cfg\.yaml:2: not valid YAML"):
        load_config(write(tmp_path, "model_path: /m\n  bad: [\n"), [], Cfg)
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"), [], Cfg)


def test_parse_cli_prints_one_line_and_exits(tmp_path, capsys):
    path = write(tmp_path, "model_path: /m\nsedd: 1\n")
    with pytest.raises(SystemExit) as e:
        parse_cli(Cfg, [str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown key 'sedd'" in err and f"{path}:2" in err
    good = write(tmp_path, "model_path: /m\n")
    assert parse_cli(Cfg, [str(good), "seed=3"]) == Cfg(model_path="/m", seed=3)


def test_metrics_writer_appends_and_flushes(tmp_path):
    import torch

    path = tmp_path / "out" / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write({"step": 1, "loss": torch.tensor(0.5), "bad": float("nan"), "up": float("inf")})
    # Flushed already: a second reader sees the line before close (what survives a crash).
    lines = path.read_text().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0]) == {"step": 1, "loss": 0.5, "bad": "nan", "up": "inf"}
    writer.write({"step": 2, "loss": 0.25})
    writer.close()
    with MetricsWriter(path) as again:  # a resumed run appends
        again.write({"step": 3})
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_metrics_writer_is_silent_off_rank0(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    path = tmp_path / "metrics.jsonl"
    MetricsWriter(path).write({"step": 1})
    assert not path.exists()


def test_resolved_config_drops_secrets(tmp_path):
    cfg = Cfg(model_path="/m", judge=Judge(api_key="sk-live-123", api_key_env="JUDGE_KEY"))
    path = save_resolved_config(cfg, tmp_path)
    text = path.read_text()
    assert "sk-live-123" not in text and "api_key:" not in text
    saved = yaml.safe_load(text)
    assert saved["judge"] == {"base_url": "http://127.0.0.1:8000/v1", "api_key_env": "JUDGE_KEY"}
    assert saved["optim"]["lr"] == pytest.approx(1e-4)
    # The resolved file loads back into the same config.
    assert load_config(path, [], Cfg) == Cfg(model_path="/m", judge=Judge(api_key_env="JUDGE_KEY"))
    assert redact_secrets({"OpenAI-Api-Key": "x", "a": [{"password": "p", "b": 1}]}) == {
        "a": [{"b": 1}]
    }
    assert math.isfinite(saved["optim"]["lr"])


def test_unreadable_files_and_bad_override_values_are_one_line_errors(tmp_path):
    bad_bytes = tmp_path / "latin1.yaml"
    bad_bytes.write_bytes("model_path: /m\nname: caf\xe9\n".encode("latin-1"))
    cases = [
        (bad_bytes, [], rf"^{bad_bytes}:2: not UTF-8 text \(byte 24\)$"),
        (tmp_path, [], rf"^{tmp_path}: cannot read the config: Is a directory$"),
        (
            write(tmp_path, "model_path: /m\n"),
            ["seed=[1"],
            r"^override 'seed=\[1': not valid YAML: expected",
        ),
        (
            write(tmp_path, "model_path: /m\n"),
            ["tasks=" + "[" * 5000],
            r"not valid YAML: nested too deeply$",
        ),
    ]
    for path, overrides, message in cases:
        with pytest.raises(ConfigError, match=message) as e:
            load_config(path, overrides, Cfg)
        assert "\n" not in str(e.value)


def test_duplicate_keys_name_both_lines(tmp_path):
    path = write(
        tmp_path, "model_path: /m\noptim:\n  lr: 1e-5\nseed: 3\noptim:\n  warmup_steps: 9\n"
    )
    with pytest.raises(
        ConfigError, match=rf"^{path}:5: not valid YAML: duplicate key 'optim' \(first on line 2\)$"
    ):
        load_config(path, [], Cfg)
    with pytest.raises(
        ConfigError, match=r"^override 'optim=\{lr: 1, lr: 2\}': .*duplicate key 'lr'"
    ):
        load_config(write(tmp_path, "model_path: /m\n"), ["optim={lr: 1, lr: 2}"], Cfg)
    # A key that a merge (<<) brings in and the mapping then sets is an override, not a duplicate.
    path = write(
        tmp_path, "model_path: /m\noptim:\n  <<: &base {lr: 1e-5, warmup_steps: 4}\n  lr: 2e-5\n"
    )
    assert load_config(path, [], Cfg).optim == Optim(lr=2e-5, warmup_steps=4)


def test_non_finite_numbers_are_refused_for_floats(tmp_path):
    for text, line in [
        ("optim:\n  lr: .nan\n", 2),
        ("optim:\n  lr: -.inf\n", 2),
        ("optim:\n  lr: 1e400\n", 2),
        ("rewards:\n  - {name: a, weight: " + "9" * 400 + "}\n", 1),
    ]:
        path = write(tmp_path, "model_path: /m\n" + text)
        with pytest.raises(
            ConfigError, match=rf"^{path}:{line + 1}: '[\w.\[\]]+' expects a finite number, got "
        ):
            load_config(path, [], Cfg)
    with pytest.raises(
        ConfigError, match=r"^override 'optim\.lr=\.inf': 'optim\.lr' expects a finite number"
    ):
        load_config(write(tmp_path, "model_path: /m\n"), ["optim.lr=.inf"], Cfg)


def test_alias_expansion_is_bounded(tmp_path):
    # Nine levels of nine aliases: 9**9 (387 million) strings once expanded, from 550 bytes of YAML.
    levels = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    levels += [f"{b}: &{b} [{','.join(['*' + a] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi")]
    path = write(tmp_path, "\n".join(levels) + "\nmodel_path: /m\n")
    with pytest.raises(
        ConfigError,
        match=rf"^{path}: not valid YAML: aliases expand the document past 10000 values$",
    ):
        load_config(path, [], Cfg)
    with pytest.raises(ConfigError, match="aliases expand the document past"):
        # a list inside itself
        load_config(write(tmp_path, "model_path: /m\nx: &x [*x]\n"), [], Cfg)
    # Aliases within the bound still work.
    assert (
        load_config(write(tmp_path, "model_path: &p /m\noutput_dir: *p\n"), [], Cfg).output_dir
        == "/m"
    )


def test_excerpt_of_an_input_value_is_bounded_and_names_its_length():
    assert excerpt("joy") == "'joy'" and excerpt(12) == "12" and excerpt(["a", 1]) == "['a', 1]"
    assert excerpt("a" * 52_428_800) == "'" + "a" * 120 + "...' (52,428,800 characters)"
    # the quotes repr chose
    assert excerpt("it's " * 30) == '"' + "it's " * 24 + '..." (150 characters)'
    big = excerpt(["x" * 1000] * 100_000)
    assert len(big) < 400 and big.endswith(", ...] (100,000 items)")
    assert len(excerpt({"k": "v" * 10**6})) < 100 and len(excerpt([[[[["deep"]]]]])) < 20
    assert len(excerpt(10**4000)) < 150


def test_a_huge_config_value_is_cut_in_its_error(tmp_path):
    path = write(tmp_path, "model_path: /m\nseed: " + "9" * 100 + "x" * 3_000_000 + "\n")
    with pytest.raises(ConfigError) as error:
        load_config(path, [], Cfg)
    message = str(error.value)
    assert (
        len(message) < 350
        and "(3,000,100 characters)" in message
        and message.startswith(f"{path}:2: 'seed'")
    )


@pytest.mark.parametrize(
    "script, schema, key, value, expected",
    [
        ("sft", "SFTConfig", "batch_size", 0, "'batch_size' must be >= 1, got 0"),
        ("sft", "SFTConfig", "lora.rank", 0, "'lora.rank' must be >= 1, got 0"),
        ("sft", "SFTConfig", "lr", -1, "'lr' must be >= 0, got -1.0"),
        ("sft", "SFTConfig", "epochs", -1, "'epochs' must be >= 1, got -1"),
        (
            "reward_models.content_rm",
            "RMConfig",
            "heldout_fraction",
            2,
            "must be > 0 and <= 0.5, got 2.0",
        ),
        ("reward_models.content_rm", "RMConfig", "save_every", 0, "must be >= 1, got 0"),
        ("reward_models.content_rm", "RMConfig", "keep_checkpoints", 0, "must be >= 1, got 0"),
        ("grpo", "GRPOConfig", "rollout.vllm.timeout", -1, "'rollout.vllm.timeout' must be > 0"),
        ("grpo", "GRPOConfig", "judge.concurrency", 0, "'judge.concurrency' must be >= 1, got 0"),
    ],
)
def test_numeric_settings_out_of_range_name_the_file_line_and_key(
    tmp_path, script, schema, key, value, expected
):
    import importlib

    config_class = getattr(importlib.import_module(script), schema)
    required = {
        "sft": "model: m\ndata: d\n",
        "reward_models.content_rm": "model: m\npairs: p\n",
        "grpo": "output_dir: o\ntrain_data: [t]\nmodel:\n  path: m\n",
    }
    path = tmp_path / "c.yaml"
    *parents, leaf = key.split(".")
    nested = "".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(parents))
    path.write_text(required.get(script, "") + nested + f"{'  ' * len(parents)}{leaf}: {value}\n")
    line = required.get(script, "").count("\n") + len(parents) + 1
    with pytest.raises(ConfigError) as error:
        load_config(path, [], config_class)
    assert str(error.value).startswith(f"{path}:{line}: ") and expected in str(error.value)


def test_bounds_include_ge_and_le_and_exclude_gt():
    from config import Bounds

    assert [Bounds(ge=1).holds(v) for v in (0, 1, 2)] == [False, True, True]
    assert [Bounds(gt=0, le=0.5).holds(v) for v in (0, 1e-9, 0.5, 0.51)] == [
        False,
        True,
        True,
        False,
    ]


# ----------------------------------------------------------------------------- the reference page


def test_the_committed_config_reference_is_what_the_schemas_give():
    from tools import config_reference

    assert config_reference.PAGE.read_text(encoding="utf-8") == config_reference.page(), (
        "docs/config-reference.md is out of date: run `python -m tools.config_reference`"
    )


def _dotted_keys(mapping, prefix=""):
    for key, value in mapping.items():
        yield prefix + key
        if isinstance(value, dict) and not key.endswith(("params", "sampling")):
            yield from _dotted_keys(value, f"{prefix}{key}.")


@pytest.mark.parametrize(
    "scripts, config",
    [
        (["grpo.py"], "clue_qwen3_5_9b.yaml"),
        (["sft.py"], "sft_example.yaml"),
        (["grpo.py", "dialogue/rl.py"], "care_qwen2_5_7b.yaml"),  # an extension: its own and grpo's
        (["grpo.py", "reward_models/social_r1.py"], "social_r1_qwen3_8b.yaml"),
    ],
)
def test_the_reference_lists_every_key_a_shipped_config_sets_in_its_scripts_section(
    scripts, config
):
    from tools import config_reference

    sections = config_reference.PAGE.read_text(encoding="utf-8").split("\n## ")
    mine = [s for s in sections if s.split("\n")[0] in scripts]
    assert len(mine) == len(scripts)
    listed = {k for s in mine for k in re.findall(r"^\| `([^`]+)` \|", s, re.MULTILINE)}
    raw = yaml.safe_load((REPO / "configs" / config).read_text())
    assert set(_dotted_keys(raw)) <= listed, set(_dotted_keys(raw)) - listed


def test_help_lists_the_top_level_keys_and_points_to_the_scripts_section():
    page = (REPO / "docs" / "config-reference.md").read_text(encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(REPO / "grpo.py"), "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stderr == ""
    usage, keys, pointer = done.stdout.splitlines()
    assert usage == "usage: grpo.py config.yaml [key=value ...]"
    assert {"output_dir", "rollout", "loss", "filtering", "report_to"} <= set(
        keys.removeprefix("top-level keys: ").split(", ")
    )
    assert pointer.endswith("docs/config-reference.md#grpopy") and "\n## grpo.py\n" in page


def test_a_resumed_runs_tensorboard_holds_each_logged_step_once(tmp_path):
    """A run killed after logging update 3 but before its checkpoint resumes from 2: metrics.jsonl
    is trimmed to steps 1-2 and step 3 logged again; the TensorBoard events, read back by
    tensorboard's own reader, then hold steps 1, 2, 3 once each, step 3 with its new value (was:
    step 3 twice, a doubled point on the curve)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from checkpoint import trim_log
    from distributed import Ranks

    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path, ["tensorboard"], {}) as log:
        for step in (1, 2, 3):
            log.write({"step": step, "loss": float(step)})
    trim_log(path, 2, Ranks(0, 1, None))  # the resume: back to the checkpoint of update 2
    with MetricsWriter(path, ["tensorboard"], {}) as log:
        log.write({"step": 3, "loss": 30.0})
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_the_reference_writer_prints_help_and_writes_nothing_on_help(tmp_path):
    """`python -m tools.config_reference --help` prints its usage and leaves the page alone (it used
    to rewrite it)."""
    from tools import config_reference

    page = config_reference.PAGE
    before = page.stat().st_mtime_ns
    done = subprocess.run(
        [sys.executable, "-m", "tools.config_reference", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and done.stdout.startswith(
        "usage: python -m tools.config_reference"
    )
    assert page.stat().st_mtime_ns == before
