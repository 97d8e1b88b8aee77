"""The papers' ablations in miniature, on a CPU, in minutes: per seed one toy data set, one random
model and one SFT run, then one GRPO run per arm from that same SFT checkpoint (so the arms differ
only in what the arm names), every arm scored on the same held-out examples, and the table and the
figure a paper prints.

    python -m tools.ablate clue accuracy_only:filtering.enabled=false --seeds 0 1 2
    python -m tools.ablate --preset clue --seeds 0 1 2 --jobs 2        # the CLUE set (PRESETS)
    python -m tools.ablate --preset social_r1 --seeds 0 1 2 --jobs 2   # Social-R1's Table 2

An arm is `REWARD[:KEY=VALUE[,KEY=VALUE...]]`: a reward of rewards.REWARDS (one of your own too,
docs/adding-a-reward.md); a KEY without a dot is a setting of that reward (`clue:lambda_iu=0.25`),
a dotted KEY a setting of grpo.py's config (`clue:filtering.enabled=false`). An arm naming the
config's own reward starts from the config's settings of it, another reward from its defaults.

The toy tasks (TASKS): `toy_emotion`, the demo's (demo.py: the emotion shows only in an earlier
line), and `toy_tom`, a false-belief story with lettered options (tools/toy_tom.py). Judges are the
local rules server's (judge_server.py), a lexical stand-in: what it rewards is what the arms learn.

Every arm is scored on the seed's held-out examples with the FIRST arm's reward (the yardstick,
so that the rewards of arms that train on others are comparable) and its logged parts, beside
accuracy, invalid answers, verified quotes (completions that quote, every quotation found in the
input) and reasoning tokens T. The output folder (--out):

    seed<N>/data, base/         the seed's toy data and model (demo.prepare, demo.json)
    seed<N>/sft/, sft.log       its SFT run and output; sft.json, its config (written when done)
    seed<N>/sft_eval.json       the SFT model's held-out means (a row of the table), and
    seed<N>/sft_completions.jsonl   its completions
    seed<N>/<arm>/grpo/         the arm's GRPO run; log.txt, its output
    seed<N>/<arm>/eval.json     the arm's held-out means, with the config it ran (written last)
    seed<N>/<arm>/completions.jsonl
    results.md, results.json, ablation.png (needs matplotlib, requirements-plot.txt)

`--jobs N` runs N of the runs at a time, each a process with one thread: on two idle cores two
take about half the time.

A rerun continues: a seed's SFT and an arm whose eval.json is there are not run again, and more
arms or seeds may be added; a setting that differs from the one a finished run used (the data
sizes, --sft, --grpo, the configs, the yardstick) is refused, naming it, instead of being mixed in.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- arms


class ArmError(ValueError):
    """An arm that cannot be run: one line naming it."""


@dataclass(frozen=True)
class Arm:
    """One arm: its label as written, the reward it trains, that reward's settings and grpo.py
    settings (`key=value`)."""

    label: str
    reward: str
    params: dict[str, float] = field(default_factory=dict)
    overrides: tuple[str, ...] = ()

    @property
    def folder(self) -> str:
        return re.sub(r"[^\w.=-]", "_", self.label)


_NAME = re.compile(r"[A-Za-z_]\w*")


def parse_arm(text: str, known: dict[str, Callable]) -> Arm:
    """`REWARD[:KEY=VALUE,...]` as an Arm; `known`, the reward registry (rewards.REWARDS). A reward
    setting must be one the reward declares and a number; a dotted key is passed to grpo.py as
    written (its config schema checks it)."""
    reward, colon, rest = text.partition(":")
    if reward not in known:
        raise ArmError(f"arm {text!r}: unknown reward {reward!r} (known: {', '.join(known)})")
    if colon and not rest:
        raise ArmError(f"arm {text!r}: nothing after ':' (expected KEY=VALUE[,KEY=VALUE...])")
    params, overrides = {}, []
    for item in rest.split(",") if rest else []:
        key, eq, value = item.partition("=")
        if not eq or not value or not all(_NAME.fullmatch(p) for p in key.split(".")):
            raise ArmError(f"arm {text!r}: {item!r} is not KEY=VALUE")
        if key in params or any(o.partition("=")[0] == key for o in overrides):
            raise ArmError(f"arm {text!r}: {key} is set twice")
        if "." in key:
            overrides.append(item)
            continue
        if key not in known[reward].defaults:
            settings = ", ".join(known[reward].defaults) or "none"
            raise ArmError(f"arm {text!r}: reward {reward} has no setting {key} (its: {settings})")
        try:
            params[key] = float(value)
        except ValueError:
            raise ArmError(f"arm {text!r}: {key}={value} is not a number") from None
    if any(o.partition("=")[0].split(".")[0] == "reward" for o in overrides):
        raise ArmError(f"arm {text!r}: the reward is the arm's name and its plain settings")
    return Arm(text, reward, params, tuple(overrides))


def parse_arms(texts: list[str], known: dict[str, Callable]) -> list[Arm]:
    arms = [parse_arm(t, known) for t in texts]
    folders = [a.folder for a in arms]
    if len(set(folders)) != len(folders):
        raise ArmError(f"arms {', '.join(texts)}: an arm is given twice")
    return arms


def reward_overrides(arm: Arm, config_reward: str) -> list[str]:
    """grpo.py's settings for the arm's reward: its name, its settings (on the config's own when
    the arm names the config's reward, else on the reward's defaults), then the arm's other keys."""
    reset = [] if arm.reward == config_reward else ["reward.params={}"]
    params = [f"reward.params.{k}={v!r}" for k, v in arm.params.items()]
    return [f"reward.name={arm.reward}", *reset, *params, *arm.overrides]


# ----------------------------------------------------------------------------- statistics

# the columns of an arm's eval.json and of the tables: (key, title, scale, digits, unit)
METRICS = (
    ("accuracy", "accuracy", 100, 1, "%"),
    ("invalid", "invalid answers", 100, 1, "%"),
    ("verified", "verified quotes", 100, 1, "%"),
    ("reasoning_tokens", "reasoning tokens", 1, 1, ""),
    ("reward", "reward", 1, 3, ""),
)
PART_FORMAT = (1, 3, "")
SFT_ROW = "SFT (every arm's start)"  # the seed's SFT model, evaluated as the arms are
# the seeds a paired test is reported from: with n seeds the exact two-sided Wilcoxon test cannot
# fall below p = 2 / 2^n (0.25 at 3 seeds, 0.031 at 6): the table says so
MIN_TEST_SEEDS = 3


def paired(values: list[float | None], first: list[float | None]) -> dict:
    """An arm's per-seed values against the first arm's on the same seeds: the differences, their
    mean ± sample SD (evaluate.mean_sd) and, with at least MIN_TEST_SEEDS seeds, the Wilcoxon
    signed-rank test (evaluate.wilcoxon: exact, two-sided, zero differences dropped)."""
    from evaluate import mean_sd, wilcoxon

    if None in values or None in first:
        return {"differences": None, "mean": None, "sd": None, "wilcoxon": None}
    d = [a - b for a, b in zip(values, first, strict=True)]
    stats = mean_sd(d)
    test = wilcoxon(values, first) if len(d) >= MIN_TEST_SEEDS else None
    return {"differences": d, "mean": stats["mean"], "sd": stats["sd"], "wilcoxon": test}


def summarize(evals: dict[str, dict[int, dict]], arms: list[str], seeds: list[int]) -> dict:
    """results.json's numbers from the eval.json files (evals[row][seed], a row an arm's label or
    another model scored alike, SFT_ROW): per row the mean ± SD over the seeds of every metric and
    yardstick part, and per arm after the first its paired differences to the first."""
    from evaluate import mean_sd

    parts = list(evals[arms[0]][seeds[0]]["parts"])

    def series(arm: str, key: str) -> list[float | None]:
        return [evals[arm][s]["parts"][key] if key in parts else evals[arm][s][key] for s in seeds]

    keys = [m[0] for m in METRICS] + parts
    return {
        "arms": arms,
        "seeds": seeds,
        "parts": parts,
        "yardstick": evals[arms[0]][seeds[0]]["yardstick"],
        "n_heldout": evals[arms[0]][seeds[0]]["n"],
        "means": {row: {k: mean_sd(series(row, k)) for k in keys} for row in evals},
        "differences": {
            a: {k: paired(series(a, k), series(arms[0], k)) for k in keys} for a in arms[1:]
        },
    }


def _fmt(value: float | None, scale: float, digits: int, unit: str, sign: bool = False) -> str:
    if value is None:
        return "—"
    return f"{scale * value:{'+' if sign else ''}.{digits}f}{unit}"


def _mean_cell(stat: dict, scale: float, digits: int, unit: str) -> str:
    sd = "" if stat["sd"] is None else f" ± {_fmt(stat['sd'], scale, digits, '')}"
    return "—" if stat["mean"] is None else f"{_fmt(stat['mean'], scale, digits, '')}{sd}{unit}"


def _difference_cell(stat: dict, scale: float, digits: int, unit: str) -> str:
    if stat["differences"] is None:
        return "—"
    seeds = ", ".join(_fmt(d, scale, digits, "", sign=True) for d in stat["differences"])
    test = "" if stat["wilcoxon"] is None else f", p {stat['wilcoxon']['p']:.2f}"
    return f"{_fmt(stat['mean'], scale, digits, unit, sign=True)} ({seeds}){test}"


def results_markdown(results: dict) -> str:
    """results.md: the arms' means ± SD, then each later arm's per-seed differences to the first
    (percentage points for rates) with the paired test."""
    arms, seeds, parts = results["arms"], results["seeds"], results["parts"]
    formats = [(k, t, s, d, u) for k, t, s, d, u in METRICS] + [(p, p, *PART_FORMAT) for p in parts]
    yardstick = results["yardstick"]
    settings = ", ".join(f"{k} {v:g}" for k, v in yardstick["params"].items())
    lines = [
        f"{results['n_heldout']} held-out {results['task']} examples per seed, seeds "
        f"{' '.join(map(str, seeds))}; mean ± SD over the seeds. reward: every arm scored with "
        f"the first arm's, {yardstick['name']}" + (f" ({settings})" if settings else "") + ".",
        "",
        "| arm | " + " | ".join(t for _, t, *_ in formats) + " |",
        "|---" * (len(formats) + 1) + "|",
    ]
    lines += [
        f"| {a} | "
        + " | ".join(_mean_cell(results["means"][a][k], s, d, u) for k, _, s, d, u in formats)
        + " |"
        for a in results["means"]
    ]
    if len(arms) > 1:
        shown = formats[: len(METRICS)]
        floor = 2 / 2 ** len(seeds)
        test = (
            f"Wilcoxon signed-rank test (exact, two-sided; with {len(seeds)} seeds no p falls "
            f"below {floor:.2g})"
            if len(seeds) >= MIN_TEST_SEEDS
            else f"no paired test below {MIN_TEST_SEEDS} seeds"
        )
        points = " (points for rates)" if any(u == "%" for *_, u in shown) else ""
        lines += [
            "",
            f"Difference to {arms[0]}{points}: the mean, then each seed's "
            f"({', '.join(map(str, seeds))}); {test}.",
            "",
            "| arm | " + " | ".join(t for _, t, *_ in shown) + " |",
            "|---" * (len(shown) + 1) + "|",
        ]
        lines += [
            f"| {a} | "
            + " | ".join(
                _difference_cell(results["differences"][a][k], s, d, u.replace("%", ""))
                for k, _, s, d, u in shown
            )
            + " |"
            for a in arms[1:]
        ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the toy tasks


@dataclass(frozen=True)
class Toy:
    """A toy task an ablation runs on: its data spec (a dataclass with `seed`, `train`, `heldout`,
    `vocab_size` and `model`, as demo.DemoData), its data maker (demo.prepare's `make`) and the
    configs of its two stages."""

    spec: type
    make: Callable
    sft_config: str
    grpo_config: str


TASKS = ("toy_emotion", "toy_tom")


def toy(task: str) -> Toy:
    """The Toy of a name of TASKS."""
    if task == "toy_emotion":
        import demo

        return Toy(demo.DemoData, demo.toy_data, "configs/demo_sft.yaml", "configs/demo_grpo.yaml")
    from tools import toy_tom

    return Toy(
        toy_tom.TomData, toy_tom.tom_data, "configs/demo_sft.yaml", "configs/toy_tom_grpo.yaml"
    )


@dataclass(frozen=True)
class Preset:
    task: str
    arms: tuple[str, ...]


# What docs/ablations.md measures. clue: CLUE against Accuracy-Only RL (Table 3: R = c, filtering
# off as in configs/clue_accuracy_only.yaml), group filtering off, and lambda_iu at 0, 0.25 and 1
# (0.5 is the first arm's). social_r1: Table 2's rows, each a switch of social_r1 at 0.
PRESETS = {
    "clue": Preset(
        "toy_emotion",
        (
            "clue",
            "accuracy_only:filtering.enabled=false",
            "clue:filtering.enabled=false",
            "clue:lambda_iu=0",
            "clue:lambda_iu=0.25",
            "clue:lambda_iu=1",
        ),
    ),
    "social_r1": Preset(
        "toy_tom",
        (
            "social_r1",
            "social_r1:use_struct=0",
            "social_r1:use_content=0",
            "social_r1:use_len=0",
            "social_r1:use_struct=0,use_content=0",
        ),
    ),
}


# ----------------------------------------------------------------------------- the plan


class Refused(RuntimeError):
    """A setting that differs from the one a finished run in the output folder used."""


def resolved(cfg) -> dict:
    """A loaded config as JSON values, without the judge's address (a free port per run)."""
    values = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    values.get("judge", {}).pop("base_url", None)
    return values


def changes(old, new, prefix: str = "") -> list[str]:
    """`key: old -> new` for every leaf where two JSON values differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            line
            for key in dict.fromkeys([*old, *new])
            for line in changes(old.get(key), new.get(key), f"{prefix}{key}.")
        ]
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} -> {new!r}"]


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


@dataclass
class Plan:
    """What an ablation runs, every config resolved and every earlier result checked before
    anything runs."""

    out: Path
    task: str
    toy: Toy
    arms: list[Arm]
    seeds: list[int]
    specs: dict[int, object]  # seed -> the toy's data spec
    sft: dict[int, list[str]]  # seed -> sft.py's settings
    grpo: dict[tuple[int, str], list[str]]  # (seed, arm label) -> grpo.py's settings
    sft_configs: dict[int, dict]  # resolved, as sft.json records them
    grpo_configs: dict[tuple[int, str], dict]  # resolved, as eval.json records them
    yardstick: object  # the first arm's rewards.RewardSpec
    judge: object  # the first arm's http_client.JudgeConfig (its base_url: the ablation's server)
    settings: dict  # what results.json records of the command

    def seed_dir(self, seed: int) -> Path:
        return self.out / f"seed{seed}"

    def arm_dir(self, seed: int, arm: Arm) -> Path:
        return self.seed_dir(seed) / arm.folder

    def sft_trained(self, seed: int) -> bool:
        return read_json(self.seed_dir(seed) / "sft.json") is not None

    def eval_path(self, seed: int, arm: Arm | None) -> Path:
        """The eval.json of an arm's run, or (None) of the seed's SFT model."""
        if arm is None:
            return self.seed_dir(seed) / "sft_eval.json"
        return self.arm_dir(seed, arm) / "eval.json"

    def done(self, seed: int, arm: Arm | None) -> bool:
        return self.eval_path(seed, arm).is_file()

    def refusals(self) -> list[str]:
        """Every finished run whose recorded settings differ from this plan's."""
        lines = []
        for seed in self.seeds:
            manifest = self.seed_dir(seed) / "demo.json"
            lines += [
                f"{manifest}: {c}"
                for c in changes(read_json(manifest), dataclasses.asdict(self.specs[seed]))
                if manifest.is_file()
            ]
            record = self.seed_dir(seed) / "sft.json"
            if record.is_file():
                lines += [
                    f"{record}: {c}" for c in changes(read_json(record), self.sft_configs[seed])
                ]
            for arm in [None, *self.arms]:
                path = self.eval_path(seed, arm)
                done = read_json(path)
                if done is not None:
                    config = (
                        self.sft_configs[seed]
                        if arm is None
                        else self.grpo_configs[seed, arm.label]
                    )
                    now = {"config": config, "yardstick": dataclasses.asdict(self.yardstick)}
                    was = {key: done.get(key) for key in now}
                    lines += [f"{path}: {c}" for c in changes(was, now)]
        return lines


def make_plan(
    out: Path,
    task: str,
    arms: list[Arm],
    seeds: list[int],
    sizes: dict,
    sft_settings: list[str],
    grpo_settings: list[str],
) -> Plan:
    """Resolve the configs of every stage (a bad setting raises ConfigError or ArmError, naming
    the arm) with the paths relative to `out`, where the stages run."""
    import demo
    from config import ConfigError, load_config
    from grpo import GRPOConfig
    from sft import SFTConfig

    spec = toy(task)
    sft, grpo, sft_configs, grpo_configs = {}, {}, {}, {}
    first = None
    for seed in seeds:
        paths = demo.stage_settings(Path(f"seed{seed}"), seed)
        sft[seed] = paths["sft"] + sft_settings
        sft_configs[seed] = resolved(load_config(REPO / spec.sft_config, sft[seed], SFTConfig))
        base = load_config(REPO / spec.grpo_config, paths["grpo"], GRPOConfig)
        for arm in arms:
            where = [f"output_dir=seed{seed}/{arm.folder}/grpo"]
            grpo[seed, arm.label] = (
                paths["grpo"] + grpo_settings + reward_overrides(arm, base.reward.name) + where
            )
            try:
                cfg = load_config(REPO / spec.grpo_config, grpo[seed, arm.label], GRPOConfig)
            except ConfigError as e:
                raise ArmError(f"arm {arm.label!r}: {e}") from None
            grpo_configs[seed, arm.label] = resolved(cfg)
            first = first or cfg
    return Plan(
        out,
        task,
        spec,
        arms,
        seeds,
        {s: spec.spec(seed=s, **sizes) for s in seeds},
        sft,
        grpo,
        sft_configs,
        grpo_configs,
        first.reward,
        first.judge,
        {"task": task, "arms": [a.label for a in arms], "seeds": seeds, **sizes}
        | {"sft": sft_settings, "grpo": grpo_settings},
    )


# ----------------------------------------------------------------------------- running it


@dataclass
class Job:
    """One run: a seed's SFT (`arm` None), or an arm's GRPO run and its evaluation."""

    seed: int
    arm: Arm | None
    number: int  # 1.. among this invocation's runs
    started: float | None = None
    fraction: float = 0.0  # of its training steps done, from its progress lines

    @property
    def kind(self) -> str:
        return "sft" if self.arm is None else "arm"


_STEP = re.compile(r"^step (\d+)/(\d+) ")


class Progress:
    """The prefix of every line an ablation prints: the seed, the arm, the run's number and the ETA
    of the whole ablation, from the runs done (their mean time per kind) and the steps of those
    under way, shared among the `workers`."""

    def __init__(self, jobs: list[Job], workers: int):
        self.jobs, self.workers, self.lock = jobs, workers, threading.Lock()
        self.durations: dict[str, list[float]] = {"sft": [], "arm": []}
        self.left = set(range(len(jobs)))

    def estimate(self, kind: str, now: float) -> float | None:
        """A run's time: the mean of the runs of its kind done, else the projection of one under
        way (its time so far over its share of steps done); None before either exists."""
        if self.durations[kind]:
            return sum(self.durations[kind]) / len(self.durations[kind])
        running = [j for j in self.jobs if j.kind == kind and j.started and j.fraction > 0]
        return max((now - j.started) / j.fraction for j in running) if running else None

    def eta(self) -> str:
        now, left = time.perf_counter(), 0.0
        for job in (self.jobs[i] for i in self.left):
            whole = self.estimate(job.kind, now)
            if whole is None:
                return "?"
            left += max(0.0, whole - (now - job.started if job.started else 0.0))
        return str(datetime.timedelta(seconds=round(left / self.workers)))

    def print(self, job: Job, text: str) -> None:
        with self.lock:
            if m := _STEP.match(text):
                job.fraction = int(m.group(1)) / int(m.group(2))
            what = "SFT" if job.arm is None else job.arm.label
            print(
                f"[seed {job.seed} | {what} | run {job.number} of {len(self.jobs)} | ablation "
                f"ETA {self.eta()}] {text}",
                flush=True,
            )

    def finished(self, job: Job) -> None:
        with self.lock:
            self.durations[job.kind].append(time.perf_counter() - job.started)
            self.left.discard(job.number - 1)


class RunFailed(RuntimeError):
    pass


def run_stage(command: list[str], cwd: Path, log: Path, job: Job, progress: Progress) -> None:
    """Run a stage's command in `cwd`, its output into `log` and, each line prefixed, onto the
    console; RunFailed when it fails."""
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ python " + " ".join(command[1:]) + "\n")
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in process.stdout:
            f.write(line)
            progress.print(job, line.rstrip("\n"))
        code = process.wait()
    if code != 0:
        raise RunFailed(f"{Path(command[1]).name} exited with status {code}: see {log}")


def evaluate_run(
    plan: Plan, seed: int, arm: Arm | None, config: dict, judge, seconds: dict
) -> dict:
    """The held-out scores of an arm's GRPO model or (arm None) the seed's SFT model, from their
    merged/ folders (demo.evaluate_checkpoint with the yardstick), written to the completions file
    beside the eval.json (Plan.eval_path) and, last, to the eval.json, which is returned: the
    arm's label (SFT_ROW), the means, the yardstick, the run's resolved `config` and the `seconds`
    it took."""
    import demo
    from config import atomic_write_text
    from dataset import load_jsonl

    heldout = load_jsonl(plan.seed_dir(seed) / "data" / "heldout.jsonl")
    start = time.perf_counter()
    path = plan.eval_path(seed, arm)
    run = plan.seed_dir(seed) / "sft" if arm is None else path.parent / "grpo"
    means, records = demo.evaluate_checkpoint(run / "merged", heldout, plan.yardstick, judge, seed)
    atomic_write_text(
        path.with_name(path.name.replace("eval.json", "completions.jsonl")),
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
    )
    parts = {}
    for name in records[0]["parts"]:
        values = [r["parts"][name] for r in records]
        parts[name] = None if None in values else sum(values) / len(values)
    summary = {
        "arm": SFT_ROW if arm is None else arm.label,
        "seed": seed,
        "task": plan.task,
        "n": len(records),
        **{key: means[key] for key in ("accuracy", "invalid", "verified", "reward")},
        "reasoning_tokens": sum(r["reasoning_tokens"] for r in records) / len(records),
        "parts": parts,
        "yardstick": dataclasses.asdict(plan.yardstick),
        "config": config,
        "seconds": seconds | {"eval": round(time.perf_counter() - start, 1)},
    }
    atomic_write_text(path, json.dumps(summary, indent=1) + "\n")
    return summary


def run_plan(plan: Plan, workers: int) -> None:
    """Run every SFT and arm not done yet, `workers` at a time, against one local rules judge; a
    failed run stops those not started (the finished ones are kept: a rerun continues)."""
    import demo
    from config import atomic_write_text
    from judge_server import JudgeServer, rules_backend

    for seed in plan.seeds:
        demo.prepare(plan.seed_dir(seed), plan.specs[seed], plan.toy.make)
    jobs = [Job(s, a, 0) for a in [None, *plan.arms] for s in plan.seeds if not plan.done(s, a)]
    for number, job in enumerate(jobs, 1):
        job.number = number
    done = len(plan.seeds) * (len(plan.arms) + 1) - len(jobs)
    if done:
        print(f"{done} runs done earlier are kept (their eval.json files in {plan.out})")
    if not jobs:
        return
    progress, failed, sft_runs = Progress(jobs, workers), [], {}
    with JudgeServer(rules_backend).start() as server:
        judge = dataclasses.replace(plan.judge, base_url=server.url)
        print(f"judge: the rules backend at {server.url} (a lexical stand-in)", flush=True)

        def run(job: Job) -> None:
            if job.arm is not None and job.seed in sft_runs:
                sft_runs[job.seed].exception()  # its SFT first
            if failed:
                with progress.lock:
                    progress.left.discard(job.number - 1)
                return
            job.started = time.perf_counter()
            seed_dir = plan.seed_dir(job.seed)
            try:
                if job.arm is None:
                    if not plan.sft_trained(job.seed):
                        shutil.rmtree(seed_dir / "sft", ignore_errors=True)
                        run_stage(
                            [sys.executable, str(REPO / "sft.py"), str(REPO / plan.toy.sft_config)]
                            + plan.sft[job.seed],
                            plan.out,
                            seed_dir / "sft.log",
                            job,
                            progress,
                        )
                        atomic_write_text(
                            seed_dir / "sft.json", json.dumps(plan.sft_configs[job.seed], indent=1)
                        )
                    config = plan.sft_configs[job.seed]
                else:
                    folder = plan.arm_dir(job.seed, job.arm)
                    shutil.rmtree(folder, ignore_errors=True)
                    folder.mkdir(parents=True)
                    run_stage(
                        [sys.executable, str(REPO / "grpo.py"), str(REPO / plan.toy.grpo_config)]
                        + plan.grpo[job.seed, job.arm.label]
                        + [f"judge.base_url={server.url}"],
                        plan.out,
                        folder / "log.txt",
                        job,
                        progress,
                    )
                    config = plan.grpo_configs[job.seed, job.arm.label]
                stage = "sft" if job.arm is None else "grpo"
                trained = {stage: round(time.perf_counter() - job.started, 1)}
                summary = evaluate_run(plan, job.seed, job.arm, config, judge, trained)
                progress.print(
                    job,
                    "held out: "
                    + ", ".join(
                        f"{title} {_fmt(summary[key], s, d, u)}" for key, title, s, d, u in METRICS
                    ),
                )
            except Exception as e:
                failed.append(f"seed {job.seed}, {job.arm.label if job.arm else 'SFT'}: {e}")
                raise
            finally:
                progress.finished(job)

        with ThreadPoolExecutor(workers) as pool:
            futures: list[Future] = []
            for job in jobs:  # every SFT is submitted before the arms that wait for it
                futures.append(pool.submit(run, job))
                if job.arm is None:
                    sft_runs[job.seed] = futures[-1]
            for future in futures:
                future.exception()
    if failed:
        raise RunFailed("; ".join(failed))


# ----------------------------------------------------------------------------- the outputs


def training_curves(plan: Plan, arm: Arm, key: str) -> tuple[list, list, list, list] | None:
    """(updates, mean, lowest, highest) over the seeds of a metrics.jsonl value of the arm's runs,
    at the updates every seed logged it; None when none did."""
    from config import read_metrics

    by_seed = []
    for seed in plan.seeds:
        records = read_metrics(plan.arm_dir(seed, arm) / "grpo" / "metrics.jsonl")
        by_seed.append({r["step"]: r[key] for r in records if r.get(key) is not None})
    steps = sorted(set.intersection(*(set(s) for s in by_seed)))
    if not steps:
        return None
    values = [[s[step] for s in by_seed] for step in steps]
    means = [sum(v) / len(v) for v in values]
    return steps, means, [min(v) for v in values], [max(v) for v in values]


# the training panels of the figure: (metrics.jsonl key, title)
CURVES = (
    ("reward", "training reward (each arm's own)"),
    ("completions/quoting", "rollouts that quote"),
    ("completions/mean_length", "rollout length (tokens)"),
)


def plot(plan: Plan, results: dict, path: Path) -> None:
    """ablation.png: per arm, the mean over seeds of its GRPO runs' reward, quoting share and
    length per update (the band: the seeds' lowest to highest), and its held-out end point,
    accuracy against verified quotes (mean ± SD bars). Needs matplotlib
    (tools.plots.PlotUnavailable without it)."""
    from tools.plots import pyplot, save_png

    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.6))
    for i, arm in enumerate(plan.arms):
        color, label = f"C{i % 10}", f"{i + 1}. {arm.label}"
        for ax, (key, title) in zip(axes.flat, CURVES):
            curve = training_curves(plan, arm, key)
            if curve is not None:
                steps, mean, low, high = curve
                ax.plot(steps, mean, color=color, lw=1.2, label=label)
                ax.fill_between(steps, low, high, color=color, alpha=0.12)
            ax.set(title=title, xlabel="GRPO update")
        means = results["means"][arm.label]
        x, y = means["verified"], means["accuracy"]
        axes[1, 1].errorbar(
            100 * x["mean"],
            100 * y["mean"],
            xerr=None if x["sd"] is None else 100 * x["sd"],
            yerr=None if y["sd"] is None else 100 * y["sd"],
            fmt="o",
            color=color,
            capsize=3,
            label=label,
        )
        axes[1, 1].annotate(
            str(i + 1),
            (100 * x["mean"], 100 * y["mean"]),
            xytext=(4, 4),
            textcoords="offset points",
        )
    start = results["means"][SFT_ROW]
    axes[1, 1].plot(
        100 * start["verified"]["mean"], 100 * start["accuracy"]["mean"], "kx", label=SFT_ROW
    )
    axes[1, 1].legend(fontsize=7)
    axes[1, 1].set(
        title=f"held out ({len(plan.seeds)} seeds, mean ± SD)",
        xlabel="verified quotes (%)",
        ylabel="accuracy (%)",
    )
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path, 120)


def cpu_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (platform's otherwise)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_results(plan: Plan, seconds: float) -> dict:
    """results.json, results.md and ablation.png from the arms' eval.json files."""
    import platform

    import torch

    from config import atomic_write_text
    from tools.plots import PlotUnavailable

    evals = {
        SFT_ROW if a is None else a.label: {s: read_json(plan.eval_path(s, a)) for s in plan.seeds}
        for a in [None, *plan.arms]
    }
    results = {"task": plan.task} | summarize(evals, [a.label for a in plan.arms], plan.seeds)
    results |= {
        "settings": plan.settings,
        "run_seconds": {row: {s: evals[row][s]["seconds"] for s in plan.seeds} for row in evals},
        "seconds": round(seconds, 1),
        "machine": {
            "cpu": cpu_name(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads_per_run": os.environ.get("OMP_NUM_THREADS"),
        },
        "date": datetime.date.today().isoformat(),
    }
    table = results_markdown(results)
    atomic_write_text(plan.out / "results.md", table + "\n")
    atomic_write_text(plan.out / "results.json", json.dumps(results, indent=1) + "\n")
    try:
        plot(plan, results, plan.out / "ablation.png")
        figure = f", {plan.out / 'ablation.png'}"
    except PlotUnavailable as e:
        figure = f" (no figure: {e})"
    print(f"\n{table}\n\nwritten: {plan.out / 'results.md'}, {plan.out / 'results.json'}{figure}")
    return results


# ----------------------------------------------------------------------------- command line

MARKER = ".ablate-output"  # written first into --out, to know the folder again


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.ablate",
        description="An ablation on a CPU toy task: SFT once per seed, one GRPO run per arm.",
    )
    parser.add_argument(
        "arms",
        nargs="*",
        metavar="ARM",
        help="REWARD[:KEY=VALUE,...]: a reward setting (no dot) or a grpo.py setting (dotted); "
        "after a preset's arms",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a measured set of arms")
    parser.add_argument("--task", choices=TASKS, help="default: the preset's, or toy_emotion")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], metavar="SEED")
    parser.add_argument("--out", help="output folder (default: runs/ablate-<preset or task>)")
    parser.add_argument("--train", type=int, help="training examples per seed (the toy's default)")
    parser.add_argument("--heldout", type=int, help="held-out examples per seed")
    parser.add_argument(
        "--sft", action="append", default=[], metavar="KEY=VALUE", help="a setting for sft.py"
    )
    parser.add_argument(
        "--grpo",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for every arm's grpo.py run",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs at a time, one thread each (default 1)"
    )
    args = parser.parse_args(argv)
    preset = PRESETS.get(args.preset)
    if preset and args.task and args.task != preset.task:
        parser.error(f"--preset {args.preset} runs on {preset.task}, not --task {args.task}")
    task = args.task or (preset.task if preset else "toy_emotion")
    texts = [*(preset.arms if preset else ()), *args.arms]
    if not texts:
        parser.error("name at least one arm, or a --preset")
    if len(set(args.seeds)) != len(args.seeds) or args.jobs < 1:
        parser.error("--seeds: each seed once; --jobs: at least 1")
    sizes = {k: getattr(args, k) for k in ("train", "heldout") if getattr(args, k) is not None}
    if any(v < 1 for v in sizes.values()):
        parser.error("--train and --heldout: at least 1 example")
    out = Path(args.out or f"runs/ablate-{args.preset or task}").resolve()
    import demo

    if problem := demo.out_folder_problem(out, MARKER, "tools.ablate"):
        parser.error(f"--out {out}: {problem}; choose another folder")
    # one thread per process, as in the demo (README, the demo), set before torch is imported
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import rewards
    from config import ConfigError

    try:
        arms = parse_arms(texts, rewards.REWARDS)
        plan = make_plan(out, task, arms, args.seeds, sizes, args.sft, args.grpo)
    except (ArmError, ConfigError) as e:
        print(f"tools.ablate: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    refused = plan.refusals()
    if refused:
        print(
            "tools.ablate: finished runs in the output folder used other settings, which are not "
            "mixed in (use another --out, or remove those runs to run them again):\n  "
            + "\n  ".join(refused),
            file=sys.stderr,
        )
        raise SystemExit(2)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / MARKER).is_file():
        (out / MARKER).write_text("written by tools/ablate.py\n", encoding="utf-8")
    start = time.perf_counter()
    try:
        run_plan(plan, args.jobs)
    except RunFailed as e:
        print(f"tools.ablate: {e} (the runs finished are kept: rerun to continue)", file=sys.stderr)
        raise SystemExit(1) from None
    elapsed = time.perf_counter() - start
    write_results(plan, elapsed)
    print(f"ablation done in {elapsed / 60:.1f} min ({args.jobs} run(s) at a time)")


if __name__ == "__main__":
    main()
