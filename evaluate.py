"""Evaluation as the CLUE paper reports it (sections 4-5, Appendix B): weighted and macro F1 over
sampled completions (mean and sample SD), in-domain and out-of-domain averages, relative gains,
invalid answers, reasoning tokens, cause identification, evidence alignment F1 with a Wilcoxon test,
the Table-1 Markdown, the human evaluation (tools/annotate.py); its figures (4-5) are drawn by
tools/plots.py.

    python evaluate.py config.yaml [key=value ...]      # a checkpoint in-process, or an endpoint
    python evaluate.py compare A/eval.json B/eval.json ... [--out DIR]

An evaluation writes into `output_dir`: config.yaml (resolved), completions.jsonl (one line per
completion, appended as they come: rerunning the same command resumes), causes.jsonl (cause-judge
verdicts), eval.json (every number) and table.md; with `report: accuracy`
(configs/eval_benchmarks.yaml: the multiple-choice social-reasoning benchmarks) table.md is one
accuracy row per set instead (a `kind: eqbench3` set: the judge's rubric score, played and judged by
dialogue/eqbench3.py into roleplay.jsonl and rubric.jsonl).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import itertools
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from config import (
    ConfigError,
    atomic_write_text,
    excerpt,
    load_config,
    open_log,
    parse_cli,
    print0,
    read_log,
    redact_secrets,
    save_resolved_config,
)
from data import (
    DataError,
    Example,
    count_tokens,
    f1_scores,
    get_task,
    parse_answer,
    split_completion,
    visible_turns,
)
from dataset import load_jsonl
from http_client import STAND_IN, JudgeCall, JudgeConfig, JudgeError, chat_many, request_fields
from judge import cause_request, parse_cause_verdict
from sampling import SamplingConfig, endpoint_config, sample_completions
from tokenizer import CheckpointError, load_tokenizer
from verifier import extract_quotes, locate_quote, verify_quote

COMPLETIONS, CAUSES, EVAL_JSON, TABLE = (
    "completions.jsonl",
    "causes.jsonl",
    "eval.json",
    "table.md",
)

# ----------------------------------------------------------------------------- config


@dataclass
class EvalSet:
    """One evaluation set: a column of the tables."""

    name: str
    path: str  # JSONL examples (data.py schema), or a scenario file for kind eqbench3
    # the average it enters; None for neither (MMLU, ECF)
    domain: Literal["in", "out"] | None = None
    task: str | None = None  # keep only this task's examples (needed when the file holds several)
    # also judge cause identification (paper 5.1) where examples have meta["causes"]
    causes: bool = False
    # examples: scored by their answers; another kind: scored by the extension whose entry point
    # names it (dialogue/eqbench3.py: eqbench3, EQ-Bench 3's role-plays judged on a rubric)
    kind: str = "examples"
    # the values of the set's breakdown field (BREAKDOWN_FIELDS) whose accuracies its table cell
    # averages, each weighted equally, as Social-R1's appendix tables make a benchmark's Overall;
    # null: the cell is the share of items right
    categories: list[str] | None = None
    # questions sharing meta["group"] are one item, right only when all are (EmoBench's own rule);
    # false: each question counts alone (Social-R1's Table 10 counts two per EmoBench EU item)
    grouped: bool = True


@dataclass
class EvalConfig:
    """An evaluation: a checkpoint (+ adapter) run in-process with model.generate, or an
    endpoint."""

    output_dir: str
    sets: list[EvalSet]
    # the model's name in tables and figures (default: output_dir's folder name)
    name: str | None = None
    checkpoint: str | None = None  # Hugging Face checkpoint folder
    adapter: str | None = None  # LoRA adapter folder, merged into the checkpoint before sampling
    # An OpenAI-compatible server (vLLM serving the merged model or the adapter, a hosted API): its
    # temperature, top_p, top_k and enable_thinking are replaced by `sampling`; serve it without a
    # reasoning parser and keep special tokens (sampling: {skip_special_tokens: false} for vLLM).
    endpoint: JudgeConfig | None = None
    # counts reasoning tokens; default: the adapter's if it has one, else checkpoint's
    tokenizer: str | None = None
    device: str | None = None  # default: cuda when available, else cpu
    dtype: str | None = None  # default: bfloat16 on a GPU, float32 on the CPU
    batch_size: int = 32  # completions per generate call (in-process)
    n_samples: int = 3  # sampled completions per instance (paper: three, from one seed)
    seed: int = 0
    # one greedy completion (paper 4.6)
    greedy_tasks: list[str] = field(default_factory=lambda: ["mmlu"])
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # the cause judge (paper 5.1) and the rubric judge of eqbench3 sets
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    # eval.json of the reference model: relative gains, its point in Figure 4
    baseline: str | None = None
    # what table.md holds: the CLUE paper's F1 tables, or one accuracy row per set (the
    # multiple-choice benchmarks of Social-R1's table)
    report: Literal["f1", "accuracy"] = "f1"


class EvalError(RuntimeError):
    """A failure the user can fix (a model, a server, a file): reported as one line."""


@dataclass(frozen=True)
class JudgedKind:
    """A kind of set scored not by its answers but by a judge, as an extension defines it
    (dialogue/eqbench3.py): `check(cfg, set)`, before anything is written, raises ConfigError or
    DataError for a set it cannot score (its file read); `entries(cfg, sets, out, loaded)` plays
    and scores the sets with `loaded`, load_sampler's (model, tokenizer) (an endpoint's model:
    None), returning their eval.json entries, each
    with its `kind`, `n_items`, `decoding`, `rubric_score` (0-1, mean ± SD over the runs) and
    `unscored` (per run), and writing its journals into `out`."""

    check: Callable[[EvalConfig, EvalSet], None]
    entries: Callable[[EvalConfig, list[EvalSet], Path], dict]


def check_config(cfg: EvalConfig, judged: dict[str, JudgedKind]) -> None:
    if (cfg.checkpoint is None) == (cfg.endpoint is None):
        raise ConfigError("give exactly one of 'checkpoint' (in-process) and 'endpoint' (a server)")
    if cfg.adapter and not cfg.checkpoint:
        raise ConfigError(
            "'adapter' needs 'checkpoint' (a served adapter is named by endpoint.model)"
        )
    names = [s.name for s in cfg.sets]
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"'sets' needs at least one set and distinct names, got {excerpt(names)}")
    if cfg.n_samples < 1 or cfg.batch_size < 1:
        raise ConfigError("'n_samples' and 'batch_size' must be at least 1")
    for s in cfg.sets:
        if s.kind != "examples" and s.kind not in judged:
            raise ConfigError(
                f"set '{s.name}': evaluate.py scores kind examples, not {excerpt(s.kind)}: a "
                "judged kind is scored through its extension's entry point (docs/benchmarks.md)"
            )
        if s.kind != "examples":
            judged[s.kind].check(cfg, s)
    for task in [*cfg.greedy_tasks, *(s.task for s in cfg.sets if s.task)]:
        get_task(task)


def decoding_for(cfg: EvalConfig, task: str) -> tuple[SamplingConfig, int]:
    """(sampling settings, completions per instance) for a task: greedy tasks get one greedy
    completion."""
    if task in cfg.greedy_tasks:
        return dataclasses.replace(cfg.sampling, temperature=0.0), 1
    return cfg.sampling, cfg.n_samples


# ----------------------------------------------------------------------------- metrics


def mean_sd(values: list[float | None]) -> dict:
    """{"mean", "sd", "runs"} over runs; sd is the sample standard deviation (n - 1 in the
    denominator), None for a single run. Mean and sd are None when any run has no value."""
    if not values or any(v is None for v in values):
        return {"mean": None, "sd": None, "runs": list(values)}
    mean = sum(values) / len(values)
    sd = (
        math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        if len(values) > 1
        else None
    )
    return {"mean": mean, "sd": sd, "runs": list(values)}


def item_key(example: Example, grouped: bool = True) -> str:
    """The item an example belongs to: its meta["group"] when `grouped` (EmoBench's emotion and
    cause questions are one item), else the example itself."""
    return example.meta.get("group", example.id) if grouped else example.id


def group_accuracy(
    examples: list[Example],
    pred: list[list[str] | None],
    catch_all: str | None = None,
    grouped: bool = True,
) -> float | None:
    """The share of items (item_key) answered right, an item counting only when all of its
    examples are right; an invalid answer is wrong. Targets whose gold is the catch-all are not
    scored (as in f1_scores). None when no target is scored."""
    items: dict[str, bool] = {}
    for example, answer in zip(examples, pred, strict=True):
        if catch_all is None or example.labels != [catch_all]:
            key = item_key(example, grouped)
            items[key] = items.get(key, True) and set(answer or ()) == set(example.labels)
    return sum(items.values()) / len(items) if items else None


# The meta fields (prepare/convert.py) that hold a benchmark's per-ability or per-subset breakdown
# in its paper's appendix tables: ToMBench's ability, SimpleToM's subset, EmoBench's and
# TactfulToM's category, MotiveBench's source, Hi-ToM's order; a set is broken down by the first of
# them its items carry.
BREAKDOWN_FIELDS = ("ability", "subset", "category", "source", "order")


def breakdown_field(examples: list[Example]) -> str | None:
    """The first of BREAKDOWN_FIELDS some example carries, None when none does."""
    return next(
        (f for f in BREAKDOWN_FIELDS if any(e.meta.get(f) is not None for e in examples)), None
    )


def breakdown(
    examples: list[Example], completions: list[list[str]], grouped: bool = True
) -> dict | None:
    """{"field", "values": {value: mean_sd of the runs' group accuracies | {"n_items"}}}: the set's
    group accuracy within each value of its breakdown field (items without it: "(none)"), run r
    being the r-th completion of every example; None when no item carries a BREAKDOWN_FIELDS
    field. The examples must share one task."""
    field = breakdown_field(examples)
    if field is None:
        return None
    catch_all = get_task(examples[0].task).catch_all
    by_value: dict[str, list[int]] = {}
    for i, e in enumerate(examples):
        value = e.meta.get(field)
        by_value.setdefault("(none)" if value is None else str(value), []).append(i)
    values = {}
    for value, rows in sorted(by_value.items()):
        part = [examples[i] for i in rows]
        accuracies = [
            group_accuracy(
                part,
                [parse_answer(completions[i][r], examples[i]) for i in rows],
                catch_all,
                grouped,
            )
            for r in range(min(len(completions[i]) for i in rows))
        ]
        items = len({item_key(e, grouped) for e in part})
        values[value] = mean_sd(accuracies) | {"n_items": items}
    return {"field": field, "values": values}


def category_accuracy(parts: dict, categories: list[str]) -> dict:
    """mean_sd over runs of the mean of `categories`' accuracies in a breakdown's `parts`, each
    category weighted equally whatever its size (Social-R1's Overall in Tables 4 and 6-11)."""
    runs = [parts["values"][c]["runs"] for c in categories]
    return mean_sd([None if None in column else sum(column) / len(column) for column in zip(*runs)])


def check_categories(s: EvalSet, examples: list[Example]) -> None:
    """A set's `categories` must be values of its breakdown field: checked before any sampling."""
    if not s.categories:
        return
    field = breakdown_field(examples)
    found = {str(e.meta.get(field)) for e in examples} if field else set()
    if len(set(s.categories)) != len(s.categories):
        raise ConfigError(f"set '{s.name}': categories: {excerpt(s.categories)} repeat a value")
    missing = [c for c in s.categories if c not in found]
    if missing:
        where = f"{field!r}, whose values are {excerpt(sorted(found))}" if field else "none"
        raise ConfigError(
            f"set '{s.name}': categories: {excerpt(missing)} not found in {s.path} (its breakdown "
            f"field: {where})"
        )


def score_runs(
    examples: list[Example], completions: list[list[str]], grouped: bool = True
) -> list[dict]:
    """f1_scores for each sampled run (run r = the r-th completion of every example), with the run's
    invalid-answer rate over all its completions and its group accuracy. The examples must share
    one task."""
    tasks = {e.task for e in examples}
    if len(tasks) != 1:
        raise ValueError(f"score_runs: examples of one task expected, got {sorted(tasks)}")
    spec = get_task(tasks.pop())
    runs = []
    for r in range(min(len(c) for c in completions)):
        pred = [parse_answer(c[r], e) for e, c in zip(examples, completions)]
        scores = f1_scores([e.labels for e in examples], pred, list(spec.labels), spec.catch_all)
        runs.append(
            scores
            | {
                "invalid": sum(p is None for p in pred) / len(pred),
                "group_accuracy": group_accuracy(examples, pred, spec.catch_all, grouped),
            }
            | grounding([c[r] for c in completions], examples)
        )
    return runs


def grounding(completions: list[str], examples: list[Example]) -> dict:
    """{"quoting": the share of completions whose reasoning quotes (<evidence> tags), "verified":
    the share of their quotations the verifier finds in the conversation (None when none quotes)}:
    whether grounding happens at all, which a format term of 1.0 cannot tell (no tags, f = 1)."""
    quotes = [
        [verify_quote(q, [t.text for t in visible_turns(e)]) for q in extract_quotes(reasoning)]
        for e, reasoning in zip(examples, (split_completion(c)[0] for c in completions))
    ]
    found = [v for q in quotes for v in q]
    return {
        "quoting": sum(bool(q) for q in quotes) / len(quotes),
        "verified": sum(found) / len(found) if found else None,
    }


def baselines(examples: list[Example]) -> dict:
    """Weighted and macro F1 of two answers that read nothing, on the same scored targets: always
    the most frequent gold label (`majority`; the first in the task's order among equals), and a
    label drawn uniformly from the task's labels for every target (`uniform`, its expected counts:
    TP_c = g_c / L, FP_c = (n - g_c) / L, FN_c = g_c (1 - 1 / L) for a label of gold count g_c
    among n targets and L labels, the catch-all excluded, as f1_scores counts)."""
    spec = get_task(examples[0].task)
    labels = [label for label in spec.labels if label != spec.catch_all]
    gold = [e.labels for e in examples if spec.catch_all is None or e.labels != [spec.catch_all]]
    counts = {label: sum(label in g for g in gold) for label in labels}
    majority = max(labels, key=lambda label: counts[label])  # max keeps the first of equals
    best = f1_scores(gold, [[majority]] * len(gold), labels, spec.catch_all)
    n, size = len(gold), len(labels)
    f1 = {c: (2 * g / size) / (n / size + g) if n else 0.0 for c, g in counts.items()}
    support = sum(counts.values())
    return {
        "majority": {"label": majority, "weighted": best["weighted"], "macro": best["macro"]},
        "uniform": {
            "weighted": sum(f1[c] * counts[c] for c in labels) / support if support else None,
            "macro": sum(f1.values()) / len(f1) if n else None,
        },
    }


def task_scores(examples: list[Example], completions: list[list[str]]) -> dict[str, dict]:
    """{task: {"weighted", "macro", "invalid", "n"}}: per task, weighted and macro F1 and the
    invalid-answer rate averaged over the sampled runs; n counts the scored targets.
    `completions[i]` holds the sampled completions of `examples[i]`. SFT checkpoint selection reads
    the mean macro F1 over tasks (paper A.1)."""
    if len(examples) != len(completions):
        raise ValueError(
            f"task_scores: {len(examples)} examples but {len(completions)} lists of completions"
        )
    scores = {}
    for task in dict.fromkeys(e.task for e in examples):
        rows = [i for i, e in enumerate(examples) if e.task == task]
        runs = score_runs([examples[i] for i in rows], [completions[i] for i in rows])
        scores[task] = {
            key: mean_sd([run[key] for run in runs])["mean"]
            for key in ("weighted", "macro", "invalid")
        }
        scores[task]["n"] = runs[0]["n"]
    return scores


EXACT_MAX_N = 50  # the Wilcoxon test is exact up to this many non-zero differences, normal above


def wilcoxon(x: list[float], y: list[float]) -> dict:
    """Two-sided Wilcoxon signed-rank test on paired scores. Zero differences are dropped
    (Wilcoxon's convention); tied |differences| share their average rank. With n <= EXACT_MAX_N
    non-zero differences the p-value is exact: the null distribution of T+ (the sum of positive
    ranks) over all 2^n sign patterns of the actual ranks, p = min(1, 2 min(P(T+ <= t), P(T+ >=
    t))). Above that, the normal approximation with the tie-corrected variance n(n+1)(2n+1)/24 -
    sum(t^3 - t)/48, without continuity correction. Returns {"statistic": min(T+, T-), "p", "n",
    "method"}."""
    d = [round(a - b, 12) for a, b in zip(x, y, strict=True)]
    d = [v for v in d if v != 0]
    n = len(d)
    order = sorted(range(n), key=lambda i: abs(d[i]))
    # doubled average ranks (integers); the size of each group of tied |d|
    ranks2, ties = [0] * n, []
    for _, tied in itertools.groupby(enumerate(order), key=lambda pair: abs(d[pair[1]])):
        # (rank - 1, index) pairs: the group shares the mean of its first and last rank
        tied = list(tied)
        for _, i in tied:
            ranks2[i] = tied[0][0] + tied[-1][0] + 2
        ties.append(len(tied))
    t2 = sum(r for r, v in zip(ranks2, d) if v > 0)
    statistic = min(t2, n * (n + 1) - t2) / 2
    if n <= EXACT_MAX_N:
        counts = [1] + [0] * (n * (n + 1))  # counts[s]: sign patterns whose doubled T+ is s
        for r in ranks2:
            counts = [c + (counts[s - r] if s >= r else 0) for s, c in enumerate(counts)]
        below, above = sum(counts[: t2 + 1]), sum(counts[t2:])
        p = min(1.0, 2 * min(below, above) / 2**n)
        return {"statistic": statistic, "p": p, "n": n, "method": "exact"}
    var = n * (n + 1) * (2 * n + 1) / 24 - sum(t**3 - t for t in ties) / 48
    z = (t2 / 2 - n * (n + 1) / 4) / math.sqrt(var)
    return {
        "statistic": statistic,
        "p": math.erfc(abs(z) / math.sqrt(2)),
        "n": n,
        "method": "normal",
    }


_QUOTED = re.compile(r'"([^"\n]+)"|“([^”\n]+)”|‘([^’\n]+)’|「([^」\n]+)」|『([^』\n]+)』')


def quoted_spans(text: str) -> list[str]:
    """Quotations in any style (paper 5.2 accepts every model's own): <evidence> spans, and text in
    double quotes, curly quotes or CJK corner brackets. Straight single quotes are mostly
    apostrophes."""
    return extract_quotes(text) + [next(g for g in m.groups() if g) for m in _QUOTED.finditer(text)]


def matched_lines(completion: str, example: Example) -> set[int]:
    """The visible turns (0-based) that the quotations of a completion's reasoning match
    (verifier)."""
    texts = [t.text for t in visible_turns(example)]
    return {
        i
        for quote in quoted_spans(split_completion(completion)[0])
        for i in locate_quote(quote, texts)
    }


def alignment_f1(matched: set[int], selected: set[int]) -> float | None:
    """Evidence alignment F1 = 2 |M & S| / (|M| + |S|) between the lines a completion's quotations
    match (M) and the lines an annotator selected (S); None when nothing was selected (not
    scored)."""
    return 2 * len(matched & selected) / (len(matched) + len(selected)) if selected else None


def cause_turns(example: Example) -> list[int]:
    """The annotated cause turns before the target (paper 5.1); [] when the target does not count:
    a neutral gold label, or no earlier cause (ECF also annotates the target as its own cause)."""
    if example.target is None or any(label.casefold() == "neutral" for label in example.labels):
        return []
    causes = example.meta.get("causes") or []
    return sorted(
        {
            c["turn"]
            for c in causes
            if isinstance(c, dict)
            and isinstance(c.get("turn"), int)
            and 0 <= c["turn"] < example.target
        }
    )


def cause_identified(verdicts: list[bool | None], answer: list[str] | None) -> bool | None:
    """Whether some earlier cause is used in the reasoning: True on any YES; False when every
    verdict is NO or the answer is invalid (no predicted emotion to explain); None (unknown) when a
    verdict is missing."""
    if answer is None or any(v is True for v in verdicts):
        return answer is not None
    return None if None in verdicts else False


# ----------------------------------------------------------------------------- sampling


class CompletionProgress:
    """A console line per update: completions done, rate and ETA."""

    def __init__(self, label: str, total: int, done: int):
        self.label, self.total, self.done, self.new, self.start = (
            label,
            total,
            done,
            0,
            time.perf_counter(),
        )

    def update(self, count: int) -> None:
        self.done, self.new = self.done + count, self.new + count
        rate = self.new / max(time.perf_counter() - self.start, 1e-9)
        eta = datetime.timedelta(seconds=round((self.total - self.done) / rate)) if rate else "?"
        print0(f"{self.label}: {self.done}/{self.total} completions | {rate:.2f}/s | ETA {eta}")


# ----------------------------------------------------------------------------- the evaluation run


def load_set(s: EvalSet) -> list[Example]:
    examples = [e for e in load_jsonl(s.path) if s.task is None or e.task == s.task]
    tasks = sorted({e.task for e in examples})
    if len(tasks) != 1:
        raise ConfigError(
            f"set '{s.name}': {s.path} holds "
            f"{'tasks ' + ', '.join(tasks) if tasks else 'no examples'}"
            f"{'' if s.task is None else ' of task ' + s.task}; give one 'task' per set"
        )
    return examples


def _sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def model_identity(cfg: EvalConfig) -> dict:
    """What was evaluated: the endpoint, or the checkpoint and adapter folders with file hashes."""
    if cfg.endpoint is not None:
        return {"endpoint": cfg.endpoint.base_url, "model": cfg.endpoint.model}
    identity = {
        "checkpoint": str(Path(cfg.checkpoint).resolve()),
        "config_sha256": _sha256(Path(cfg.checkpoint) / "config.json"),
    }
    *sft, adapter = adapter_chain(cfg) or [None]
    if sft:
        identity |= {
            "sft_adapter": str(Path(sft[0]).resolve()),
            "sft_adapter_sha256": _sha256(Path(sft[0]) / "adapter_model.safetensors"),
        }
    if adapter:
        identity |= {
            "adapter": str(Path(adapter).resolve()),
            "adapter_sha256": _sha256(Path(adapter) / "adapter_model.safetensors"),
        }
    return identity


def _generation_identity(cfg: EvalConfig) -> dict:
    endpoint = None if cfg.endpoint is None else (cfg.endpoint.base_url, cfg.endpoint.model)
    return {
        "checkpoint": cfg.checkpoint,
        "adapter": cfg.adapter,
        "endpoint": endpoint,
        "sampling": dataclasses.asdict(cfg.sampling),
        "seed": cfg.seed,
        "n_samples": cfg.n_samples,
        "greedy_tasks": cfg.greedy_tasks,
    }


def endpoint_unsent(endpoint: JudgeConfig | None, sampling: SamplingConfig) -> list[str]:
    """The decoding settings a served model was not sent (its kind's API refuses them); none
    in-process."""
    if endpoint is None:
        return []
    served = endpoint_config(endpoint, sampling)
    return request_fields(served.kind, served.requested(sampling.max_new_tokens))[1]


def check_resume(cfg: EvalConfig, out: Path) -> None:
    """Refuse to mix completions of another model or decoding into an output_dir (one holding no
    completion is not refused)."""
    if not (out / "config.yaml").exists() or not read_completions(out / COMPLETIONS):
        return
    old, new = (
        _generation_identity(load_config(out / "config.yaml", [], EvalConfig)),
        _generation_identity(cfg),
    )
    changed = [key for key in new if old[key] != new[key]]
    if changed:
        raise ConfigError(
            f"{out}: holds completions made with other {', '.join(changed)}; use a new output_dir"
        )


def adapter_chain(cfg: EvalConfig) -> list[str]:
    """The adapters merged into `checkpoint`, in order: `adapter`, preceded by the SFT adapter it
    was trained on when its lineage (checkpoint.LINEAGE, written by grpo.py) names one, as grpo.py
    merged it into the base before RL. An adapter whose lineage names another base than
    `checkpoint` raises EvalError, with the command that evaluates the trained model."""
    from checkpoint import read_lineage  # torch: not for `compare` and `plot`

    if not cfg.adapter:
        return []
    try:
        lineage = read_lineage(cfg.adapter)
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    if lineage is None:
        return [cfg.adapter]
    sft = lineage["sft_adapter"]
    if Path(cfg.checkpoint).resolve() != Path(lineage["base"]):
        run = Path(cfg.adapter).resolve().parent
        raise EvalError(
            f"adapter {cfg.adapter} was trained on {lineage['base']}"
            + (f" with the SFT adapter {sft} merged in" if sft else "")
            + f", not on checkpoint {cfg.checkpoint}: evaluate it with checkpoint="
            f"{lineage['base']} adapter={cfg.adapter}"
            + (" (the SFT adapter is merged first)" if sft else "")
            + f", or checkpoint={run / 'merged'} adapter=null where the run saved one"
        )
    return [sft, cfg.adapter] if sft else [cfg.adapter]


def unknown_lineage(cfg: EvalConfig) -> str | None:
    """The line to print when nothing says what `adapter` was trained on: no lineage.json beside it
    and no base_model_name_or_path in its adapter_config.json (grpo.py writes none over an SFT
    adapter, which it merged into the base first); None otherwise."""
    from checkpoint import LINEAGE, read_lineage

    config = Path(cfg.adapter or "") / "adapter_config.json"
    if not cfg.adapter or read_lineage(cfg.adapter) is not None or not config.is_file():
        return None
    try:
        named = json.loads(config.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (UnicodeDecodeError, ValueError, AttributeError):
        return None  # load_adapter names the broken file
    if named:
        return None
    return (
        f"adapter {cfg.adapter}: no {LINEAGE} and no base_model_name_or_path in its "
        f"adapter_config.json, so what it was trained on is unknown: evaluated on checkpoint "
        f"{cfg.checkpoint} as given (a GRPO adapter trained over an SFT adapter needs that one "
        f"merged first: keep the {LINEAGE} its run wrote beside it)"
    )


def tokenizer_path(cfg: EvalConfig) -> str | None:
    """`tokenizer`, else the last adapter of the chain that holds a tokenizer, else the
    checkpoint's."""
    holding = [a for a in adapter_chain(cfg) if (Path(a) / "tokenizer.json").is_file()]
    return cfg.tokenizer or (holding[-1] if holding else cfg.checkpoint)


def load_model(cfg: EvalConfig):
    """(model, tokenizer) for in-process sampling: the checkpoint with the adapter chain merged
    in."""
    import torch

    import model as qwen

    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = cfg.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    try:
        net = qwen.Qwen.from_pretrained(cfg.checkpoint, dtype, device)
        for adapter in adapter_chain(cfg):
            qwen.merge_lora(qwen.load_adapter(net, adapter))
        tok = load_tokenizer(tokenizer_path(cfg))
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    if len(tok) > net.config.vocab_size:
        raise EvalError(
            f"{tokenizer_path(cfg)}: {len(tok)} tokens, more than the model's "
            f"{net.config.vocab_size} rows"
        )
    return net, tok


def missing_samples(
    cfg: EvalConfig, s: EvalSet, examples: list[Example], done: dict
) -> list[tuple[Example, int]]:
    """The (example, sample) pairs of set `s` that `done` (keyed (set, id, sample)) lacks."""
    n = decoding_for(cfg, examples[0].task)[1]
    return [(e, r) for e in examples for r in range(n) if (s.name, e.id, r) not in done]


def load_sampler(cfg: EvalConfig) -> tuple:
    """(model, tokenizer) that sampling needs, loaded before anything is written (a missing
    checkpoint, adapter or tokenizer stops the run with nothing in output_dir): in-process the
    merged chain (load_model); for an endpoint no model, and `tokenizer` when given."""
    if cfg.endpoint is None:
        return load_model(cfg)
    try:
        return None, load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    except CheckpointError as e:
        raise EvalError(str(e)) from None


def generate_missing(
    cfg: EvalConfig, sets: dict[str, list[Example]], done: dict, path: Path, model, tok
) -> None:
    """Sample every completion not yet in `done` (keyed (set, id, sample)) with `model` and `tok`
    (load_sampler's), appending each batch to `path` as it finishes."""
    with open_log(path) as f:
        for s in cfg.sets:
            examples = sets[s.name]
            sampling, n = decoding_for(cfg, examples[0].task)
            missing = missing_samples(cfg, s, examples, done)
            if not missing:
                continue
            progress = CompletionProgress(
                s.name, len(examples) * n, len(examples) * n - len(missing)
            )

            def write(
                completed: list[tuple[tuple[Example, int], str]], s=s, progress=progress
            ) -> None:
                lines = []
                for (example, r), text in completed:
                    if (s.name, example.id, r) in done:  # a sample kept from an earlier, torn batch
                        continue
                    record = {
                        "set": s.name,
                        "id": example.id,
                        "task": example.task,
                        "sample": r,
                        "completion": text,
                        "answer": parse_answer(text, example),
                        "reasoning_tokens": None
                        if tok is None
                        else count_tokens(split_completion(text)[0], tok),
                    }
                    done[(s.name, example.id, r)] = record
                    lines.append(json.dumps(record, ensure_ascii=False) + "\n")
                f.write("".join(lines))
                f.flush()
                progress.update(len(lines))

            if cfg.endpoint is None:
                pending = [
                    e for e in examples if any((s.name, e.id, r) not in done for r in range(n))
                ]
                sample_completions(
                    model,
                    tok,
                    [get_task(e.task).messages(e) for e in pending],
                    [e.id for e in pending],
                    sampling,
                    n,
                    cfg.seed,
                    cfg.batch_size,
                    lambda batch, texts: write(
                        [
                            ((pending[i], r), text)
                            for i, row in zip(batch, texts)
                            for r, text in enumerate(row)
                        ]
                    ),
                )
            else:
                _sample_endpoint(cfg, sampling, missing, write)


def _sample_endpoint(
    cfg: EvalConfig, sampling: SamplingConfig, units: list[tuple[Example, int]], write
) -> None:
    endpoint = endpoint_config(cfg.endpoint, sampling)
    if line := endpoint.not_sent():
        print0(f"endpoint: {line}")
    failed, reasons = 0, []
    step = max(1, endpoint.concurrency) * 4
    for start in range(0, len(units), step):
        chunk = units[start : start + step]
        calls = [JudgeCall(get_task(e.task).messages(e), sampling.max_new_tokens) for e, _ in chunk]
        texts, stats = chat_many(calls, endpoint)
        write([(unit, text) for unit, text in zip(chunk, texts) if text is not None])
        failed, reasons = failed + stats["failures"], reasons + list(stats["errors"].values())
    if failed:
        raise JudgeError(
            f"{failed} requests to {cfg.endpoint.base_url} failed (first: {reasons[0]}); "
            "rerun the same command to resume"
        )


def judge_causes(cfg: EvalConfig, sets: dict[str, list[Example]], done: dict, path: Path) -> dict:
    """Cause-judge verdicts {(set, id, sample, turn): bool | None} for every eligible target of the
    sets with `causes` and a valid answer, asking only what `path` does not hold yet."""
    verdicts = {
        (r["set"], r["id"], r["sample"], r["turn"]): r["verdict"] for r in read_log(path, EvalError)
    }
    asks = []
    for s in (s for s in cfg.sets if s.causes):
        for example in sets[s.name]:
            for r in range(decoding_for(cfg, example.task)[1]):
                record = done[(s.name, example.id, r)]
                for turn in cause_turns(example) if record["answer"] is not None else []:
                    if (s.name, example.id, r, turn) not in verdicts:
                        reasoning = split_completion(record["completion"])[0]
                        asks.append(
                            (
                                (s.name, example.id, r, turn),
                                cause_request(
                                    example, reasoning, ", ".join(record["answer"]), turn
                                ),
                            )
                        )
    if asks:
        print0(f"cause judge: {len(asks)} calls to {cfg.judge.base_url}")
        texts, _ = chat_many([call for _, call in asks], cfg.judge)
        with open_log(path) as f:
            for (key, _), text in zip(asks, texts):
                verdicts[key] = None if text is None else parse_cause_verdict(text)
                if verdicts[key] is not None:  # a missing verdict is asked again on the next run
                    f.write(
                        json.dumps(
                            dict(zip(("set", "id", "sample", "turn"), key), verdict=verdicts[key])
                        )
                        + "\n"
                    )
    return verdicts


def _domain_average(entries: list[dict], key: str) -> dict:
    """Each set weighted equally: per run when every set has the same runs, else over the set
    means."""
    runs = [e[key]["runs"] for e in entries]
    if len({len(r) for r in runs}) == 1:
        return mean_sd([None if None in col else sum(col) / len(col) for col in zip(*runs)])
    means = [e[key]["mean"] for e in entries]
    return {"mean": None if None in means else sum(means) / len(means), "sd": None, "runs": None}


AVERAGED = ("weighted_f1", "macro_f1", "invalid", "reasoning_tokens", "quoting", "verified")
DOMAINS = {"in": "In-domain", "out": "Out-of-domain"}


def summarize(
    cfg: EvalConfig, sets: dict[str, list[Example]], done: dict, verdicts: dict, name: str
) -> dict:
    entries = {}
    for s in cfg.sets:
        examples = sets[s.name]
        sampling, n = decoding_for(cfg, examples[0].task)
        records = [[done[(s.name, e.id, r)] for r in range(n)] for e in examples]
        completions = [[rec["completion"] for rec in recs] for recs in records]
        runs = score_runs(examples, completions, s.grouped)
        tokens = [[recs[r]["reasoning_tokens"] for recs in records] for r in range(n)]
        for run, counts in zip(runs, tokens):
            run["reasoning_tokens"] = None if None in counts else sum(counts) / len(counts)
        entry = {
            "task": examples[0].task,
            "domain": s.domain,
            "n_examples": len(examples),
            "n_scored": runs[0]["n"],
            "n_items": len({item_key(e, s.grouped) for e in examples}),
            "decoding": dataclasses.asdict(sampling)
            | {"n_samples": n}
            | ({"not_sent": unsent} if (unsent := endpoint_unsent(cfg.endpoint, sampling)) else {}),
        }
        entry |= {
            name: mean_sd([run[key] for run in runs])
            for name, key in (
                ("weighted_f1", "weighted"),
                ("macro_f1", "macro"),
                ("accuracy", "accuracy"),
                ("group_accuracy", "group_accuracy"),
                ("invalid", "invalid"),
                ("reasoning_tokens", "reasoning_tokens"),
                ("quoting", "quoting"),
                ("verified", "verified"),
            )
        } | {"runs": runs, "baselines": baselines(examples), "examples": examples_digest(examples)}
        if (cfg.report == "accuracy" or s.categories) and (
            parts := breakdown(examples, completions, s.grouped)
        ):
            entry["breakdown"] = parts
        if s.categories:
            entry["categories"] = list(s.categories)
            entry["category_accuracy"] = category_accuracy(parts, s.categories)
        if s.causes:
            targets = [(e, turns) for e in examples if (turns := cause_turns(e))]
            found = [
                [
                    cause_identified(
                        [verdicts.get((s.name, e.id, r, t)) for t in turns],
                        done[(s.name, e.id, r)]["answer"],
                    )
                    for e, turns in targets
                ]
                for r in range(n)
            ]
            entry["causes"] = {
                "n_targets": len(targets),
                "n_pairs": sum(len(t) for _, t in targets),
                "unknown": [run.count(None) for run in found],
            }
            entry["cause_rate"] = mean_sd(
                [
                    sum(v is True for v in run) / (len(run) - run.count(None))
                    if len(run) > run.count(None)
                    else None
                    for run in found
                ]
            )
        entries[s.name] = entry
    averages = {}
    for domain in ("in", "out"):
        names = [n for n, e in entries.items() if e["domain"] == domain]
        if names:
            averages[domain] = {
                k: _domain_average([entries[n] for n in names], k) for k in AVERAGED
            } | {"sets": names}
    return {"name": name, "model": model_identity(cfg), "sets": entries, "averages": averages}


# a relative gain on a base below this (weighted F1, 0-1) is not shown: +350% of 2 points says less
# than the 7 points it is
GAIN_FLOOR = 0.10


def _gain(ours: float | None, base: float | None) -> float | None:
    return None if ours is None or not base else 100 * (ours - base) / base


def examples_digest(examples: list[Example]) -> str:
    """A fingerprint of a held-out set: its examples' ids, tasks and gold labels, in order."""
    rows = [(e.id, e.task, e.labels) for e in examples]
    return hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode()).hexdigest()[:16]


def relative_gains(summary: dict, base: dict) -> dict:
    """Relative gains in percent, 100 (F1 - F1_base) / F1_base, of mean weighted F1 per set and
    domain."""
    return {
        "name": base["name"],
        "sets": {
            n: _gain(e["weighted_f1"]["mean"], base["sets"][n]["weighted_f1"]["mean"])
            for n, e in summary["sets"].items()
            if n in base["sets"] and "weighted_f1" in e
        },
        "averages": {
            d: _gain(a["weighted_f1"]["mean"], base["averages"][d]["weighted_f1"]["mean"])
            for d, a in summary["averages"].items()
            if d in base["averages"]
        },
    }


def load_eval(path) -> dict:
    try:
        summary = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise EvalError(f"{path}: not a readable eval.json ({e})") from None
    if not (isinstance(summary, dict) and isinstance(summary.get("name"), str)):
        raise EvalError(f"{path}: not an eval.json of evaluate.py (no 'name')")
    return summary


def read_completions(path) -> list[dict]:
    """The records of a completions.jsonl (read_log); EvalError naming the line of a record that
    is not one of `generate_missing`'s."""
    records = read_log(path, EvalError)
    for number, r in enumerate(records, 1):
        if not (
            isinstance(r, dict)
            and all(isinstance(r.get(key), str) for key in ("set", "id", "completion"))
            and type(r.get("sample")) is int
            and (r.get("reasoning_tokens") is None or type(r["reasoning_tokens"]) is int)
        ):
            raise EvalError(
                f"{path}:{number}: not a completion record {{set, id, sample, completion, "
                f"reasoning_tokens}} of evaluate.py"
            )
    return records


def evaluate(cfg: EvalConfig, judged: dict[str, JudgedKind] | None = None) -> dict:
    """Run the evaluation of `cfg` (resuming from its output_dir) and write every output; returns
    eval.json. `judged`: the kinds of judge-scored sets an extension scores (JudgedKind)."""
    judged = judged or {}
    # inputs first: the config, the sets (a judged kind's files too), the baseline, the journal
    # and the model are read and checked before output_dir gets its first file
    check_config(cfg, judged)
    adapter_chain(cfg)
    if note := unknown_lineage(cfg):
        print0(note)
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"'output_dir': {out} is a file; name a folder")
    check_resume(cfg, out)
    # the sets scored by their answers; the judge-scored ones are run apart, by their kind
    answered = dataclasses.replace(cfg, sets=[s for s in cfg.sets if s.kind == "examples"])
    sets = {s.name: load_set(s) for s in answered.sets}
    for s in answered.sets:
        check_categories(s, sets[s.name])
    baseline = load_eval(cfg.baseline) if cfg.baseline else None
    by_id = {(name, e.id): e for name, examples in sets.items() for e in examples}
    done = {
        (r["set"], r["id"], r["sample"]): r
        | {"answer": parse_answer(r["completion"], by_id[r["set"], r["id"]])}
        for r in read_completions(out / COMPLETIONS)
        if (r["set"], r["id"]) in by_id
    }
    sampling = len(answered.sets) < len(cfg.sets) or any(
        missing_samples(answered, s, sets[s.name], done) for s in answered.sets
    )
    loaded = load_sampler(cfg) if sampling else (None, None)
    save_resolved_config(cfg, out)
    if cfg.endpoint is not None and not cfg.tokenizer:
        print0("no 'tokenizer' for the endpoint: reasoning tokens are not counted")
    generate_missing(answered, sets, done, out / COMPLETIONS, *loaded)
    verdicts = judge_causes(answered, sets, done, out / CAUSES)
    summary = summarize(answered, sets, done, verdicts, cfg.name or out.resolve().name)
    entries = dict(summary["sets"])
    for kind, scorer in judged.items():
        mine = [s for s in cfg.sets if s.kind == kind]
        entries |= scorer.entries(cfg, mine, out, loaded) if mine else {}
    summary["sets"] = {s.name: entries[s.name] for s in cfg.sets}
    if baseline is not None:
        summary["baseline"] = {"path": cfg.baseline} | relative_gains(summary, baseline)
    summary["config"] = redact_secrets(dataclasses.asdict(cfg))
    atomic_write_text(
        out / EVAL_JSON, json.dumps(summary, indent=1, ensure_ascii=False, allow_nan=False) + "\n"
    )
    evals = [baseline, summary] if baseline else [summary]
    tables = accuracy_table(evals) if cfg.report == "accuracy" else markdown_tables(evals)
    atomic_write_text(out / TABLE, tables)
    print0(tables)
    return summary


# ----------------------------------------------------------------------------- tables


def _cell(stat: dict | None, scale: float, digits: int) -> str:
    if not stat or stat["mean"] is None:
        return "–"
    sd = "" if stat.get("sd") is None else f" ± {stat['sd'] * scale:.{digits}f}"
    return f"{stat['mean'] * scale:.{digits}f}{sd}"


def _columns(evals: list[dict]) -> list[tuple[str, str | None]]:
    """(kind, set or domain) columns in Table 1's order: in-domain sets and their average,
    out-of-domain sets and their average, then the sets of neither domain."""
    # every set, in first-seen order
    domains = {n: s["domain"] for e in evals for n, s in e["sets"].items()}
    columns = []
    for d in ("in", "out"):
        members = [("set", n) for n, domain in domains.items() if domain == d]
        columns += members + ([("avg", d)] if members else [])
    return columns + [("set", n) for n, domain in domains.items() if domain is None]


def _stat(e: dict, kind: str, key: str, metric: str) -> dict | None:
    return (e["sets"] if kind == "set" else e["averages"]).get(key, {}).get(metric)


def _baseline_cell(evals: list[dict], kind: str, key: str, base: str, average: str) -> str:
    """A baseline's F1 (percent) in a column: a set's, or its domain's sets' mean."""
    sets = {n: s for e in evals for n, s in e["sets"].items()}
    names = [key] if kind == "set" else [n for n, s in sets.items() if s.get("domain") == key]
    values = [sets[n].get("baselines", {}).get(base, {}).get(average) for n in names]
    return "–" if not values or None in values else f"{100 * sum(values) / len(values):.2f}"


def _table(
    evals: list[dict],
    metric: str,
    title: str,
    scale: float = 100,
    digits: int = 2,
    differences: bool = True,
) -> str:
    columns = [c for c in _columns(evals) if any(_stat(e, *c, metric) for e in evals)]
    heads = [key if kind == "set" else f"{DOMAINS[key]} avg" for kind, key in columns]
    lines = [
        f"### {title}",
        "",
        "| Model | " + " | ".join(heads) + " |",
        "|---" * (len(heads) + 1) + "|",
    ]
    first = evals[0]
    for e in evals:
        cells = [_cell(_stat(e, *c, metric), scale, digits) for c in columns]
        lines.append(f"| {e['name']} | " + " | ".join(cells) + " |")
        if e is not first and differences:
            pairs = [(_stat(e, *c, metric), _stat(first, *c, metric)) for c in columns]
            diffs = [
                f"{(a['mean'] - b['mean']) * scale:+.{digits}f}"
                if a and b and None not in (a["mean"], b["mean"])
                else "–"
                for a, b in pairs
            ]
            lines.append(f"| Δ vs {first['name']} | " + " | ".join(diffs) + " |")
    average = {"weighted_f1": "weighted", "macro_f1": "macro"}.get(metric)
    for base, label in (("majority", "majority label"), ("uniform", "uniform random")):
        if average:
            cells = [_baseline_cell(evals, *c, base, average) for c in columns]
            lines.append(f"| *{label} (baseline)* | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown_tables(evals: list[dict], differences: bool = True) -> str:
    """Tables in the layout of the paper's Table 1 (one row per model, mean ± SD over sampled runs,
    sets grouped by domain with their averages), with each later model's difference to the first
    (`differences`), the grounding the completions show, and the baselines' F1."""
    runs = sorted({e["sets"][n]["decoding"]["n_samples"] for e in evals for n in e["sets"]})
    tables = [
        ("weighted_f1", f"Weighted F1 (%), mean ± sample SD over {'/'.join(map(str, runs))} runs"),
        ("macro_f1", "Macro F1 (%)"),
        ("reasoning_tokens", "Mean reasoning tokens per completion", 1, 0),
        ("invalid", "Invalid answers (%)"),
        ("quoting", "Completions that quote their evidence (%)"),
        ("verified", "Quotations the verifier finds in the conversation (%)"),
    ]
    if any("cause_rate" in s for e in evals for s in e["sets"].values()):
        tables.append(
            (
                "cause_rate",
                "Cause identification (%): targets whose annotated earlier cause the reasoning "
                "uses",
            )
        )
    parts = [_table(evals, *t, differences=differences) for t in tables]
    for e in evals[1:] if differences else []:
        shown = []
        for d in DOMAINS:
            ours, base = (_stat(x, "avg", d, "weighted_f1") for x in (e, evals[0]))
            if not ours or not base or None in (ours["mean"], base["mean"]):
                continue
            points = 100 * (ours["mean"] - base["mean"])
            relative = (
                f"{_gain(ours['mean'], base['mean']):+.1f}%"
                if base["mean"] >= GAIN_FLOOR
                else f"no relative gain on a base under {100 * GAIN_FLOOR:.0f} points"
            )
            shown.append(f"{DOMAINS[d]} {points:+.2f} points ({relative})")
        if shown:
            parts.append(
                f"Gain of {e['name']} over {evals[0]['name']} in average weighted F1: "
                f"{', '.join(shown)}\n"
            )
    parts.append(
        "Baselines read nothing: the majority label answers every target with the set's most "
        "frequent gold label, uniform random draws each answer from the task's labels (expected "
        "counts).\n"
    )
    return "\n".join(parts)


def benchmark_score(entry: dict) -> dict | None:
    """A benchmark's score: the mean of its categories' accuracies where the set names categories
    (as its paper makes the cell), else its group accuracy."""
    return entry.get("category_accuracy", entry.get("group_accuracy"))


def _benchmark_cell(entry: dict) -> str:
    """A benchmark row's cell: its benchmark_score in percent with, beside it, the share of items
    right where that differs and the invalid-answer rate; or a judge-scored set's rubric score
    (0-100) with its unscored transcripts."""
    if "rubric_score" in entry:
        score, unscored = _cell(entry.get("rubric_score"), 100, 2), entry["unscored"]
        transcripts = entry["n_items"] * len(unscored)
        return score if score == "–" else f"{score} ({sum(unscored)} of {transcripts} unscored)"
    score, invalid = _cell(benchmark_score(entry), 100, 2), entry.get("invalid")
    if score == "–":
        return score
    notes = []
    items = entry.get("group_accuracy") or {}
    if "category_accuracy" in entry and items.get("mean") is not None:
        if f"{100 * items['mean']:.2f}" != score.split(" ")[0]:
            notes.append(f"items {100 * items['mean']:.2f}")
    if invalid and invalid["mean"] is not None:
        notes.append(f"{100 * invalid['mean']:.1f}% invalid")
    return f"{score} ({'; '.join(notes)})" if notes else score


def accuracy_table(evals: list[dict]) -> str:
    """The benchmark table (`report: accuracy`): one row per set, its items (a group of questions
    counts once; a judge-scored set's items are its scenarios), then a column per model with the
    set's benchmark_score in percent (a judge-scored set: its 0-100 rubric score), mean ± sample SD
    over the sampled runs, the share of items right (where the score is a category mean) and the
    invalid-answer rate (unscored transcripts) beside it, and a last row averaging the accuracy
    rows, each weighted equally (Social-R1's Overall); below it, a table per set whose items carry
    a breakdown field."""
    sets = list(dict.fromkeys(n for e in evals for n in e["sets"]))
    judged = [n for n in sets if any(e["sets"].get(n, {}).get("kind") for e in evals)]
    runs = sorted({e["sets"][n]["decoding"]["n_samples"] for e in evals for n in e["sets"]})
    lines = [
        f"### Accuracy (%), mean ± sample SD over {'/'.join(map(str, runs))} runs",
        "",
        "| Benchmark | Items | " + " | ".join(e["name"] for e in evals) + " |",
        "|---" * (len(evals) + 2) + "|",
    ]
    for name in sets:
        items = next(e["sets"][name].get("n_items", "–") for e in evals if name in e["sets"])
        cells = [_benchmark_cell(e["sets"].get(name, {})) for e in evals]
        lines.append(f"| {name} | {items} | " + " | ".join(cells) + " |")
    averages = []
    for e in evals:
        means = [
            (benchmark_score(e["sets"].get(n, {})) or {}).get("mean")
            for n in sets
            if n not in judged
        ]
        averages.append(
            "–" if None in means or not means else f"{100 * sum(means) / len(means):.2f}"
        )
    lines.append(f"| Average | | {' | '.join(averages)} |")
    notes = []
    by_category = {}
    for e in evals:
        for n, entry in e["sets"].items():
            if "categories" in entry:
                left = set(entry["breakdown"]["values"]) - set(entry["categories"])
                by_category.setdefault(n, (entry["breakdown"]["field"], set()))[1].update(left)
    if by_category:
        notes.append(
            f"{', '.join(by_category)}: the mean of the accuracies of the set's categories, each "
            "weighted equally, as the paper's appendix tables make the cell; the share of items "
            "right beside it where that differs."
        )
        notes += [
            f"{n}: items whose {field} is {', '.join(sorted(left))} are in the share of items, not "
            "in the categories' mean."
            for n, (field, left) in by_category.items()
            if left
        ]
    if judged:
        notes.append(
            f"{', '.join(judged)}: the judge's rubric score (0-100) over the role-play scenarios, "
            "not an accuracy, and not in the average."
        )
        stand_in = [
            e["name"]
            for e in evals
            if any(e["sets"].get(n, {}).get("judge") == STAND_IN for n in judged)
        ]
        if stand_in:
            lines[0] += (
                f" (rubric scores of {', '.join(stand_in)}: the rules stand-in, not a judge)"
            )
    lines += [line for note in notes for line in ("", note)]
    for name in sets:
        lines += _breakdown_table(name, evals)
    return "\n".join(lines) + "\n"


def _breakdown_table(name: str, evals: list[dict]) -> list[str]:
    """A set's breakdown under the benchmark table (its paper's appendix table): a row per value of
    its breakdown field, the group accuracy per model; no lines when no model's entry has one."""
    parts = [e["sets"].get(name, {}).get("breakdown") for e in evals]
    found = [p for p in parts if p]
    if not found:
        return []
    field = found[0]["field"]
    lines = [
        "",
        f"#### {name} by {field}",
        "",
        f"| {field} | Items | " + " | ".join(e["name"] for e in evals) + " |",
        "|---" * (len(evals) + 2) + "|",
    ]
    for value in sorted({v for p in found for v in p["values"]}):
        items = next(p["values"][value]["n_items"] for p in found if value in p["values"])
        cells = [_cell((p or {}).get("values", {}).get(value), 100, 2) for p in parts]
        lines.append(f"| {value} | {items} | " + " | ".join(cells) + " |")
    return lines


# ----------------------------------------------------------------------------- command line


def incomparable(evals: list[dict], paths: list[Path]) -> str | None:
    """Why later evaluations cannot be set against the first, or None: no set in common, or a set
    of the same name with another task or other examples (eval.json's `examples` fingerprint)."""
    first = evals[0]["sets"]
    for e, path in zip(evals[1:], paths[1:]):
        common = [n for n in e["sets"] if n in first]
        if not common:
            return f"{paths[0]} and {path} have no set in common"
        for name in common:
            a, b = first[name], e["sets"][name]
            if a.get("task") and b.get("task") and a["task"] != b["task"]:
                return f"set '{name}' is task {a['task']} in {paths[0]}, {b['task']} in {path}"
            if a.get("examples") and b.get("examples") and a["examples"] != b["examples"]:
                return (
                    f"set '{name}' holds other examples in {paths[0]} ({a['n_examples']}) than "
                    f"in {path} ({b['n_examples']})"
                )
    return None


def _compare(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="evaluate.py compare",
        description="Side-by-side tables of evaluations, "
        "with each model's difference to the first.",
    )
    parser.add_argument("evals", nargs="+", help="eval.json files (or the folders holding them)")
    parser.add_argument("--out", help="also write table.md into this folder")
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="evaluations of different tasks or held-out sets in one table, without differences",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace those files where --out holds them"
    )
    args = parser.parse_args(argv[1:])
    paths = [Path(p) / EVAL_JSON if Path(p).is_dir() else Path(p) for p in args.evals]
    evals = [load_eval(p) for p in paths]
    if not args.side_by_side and (problem := incomparable(evals, paths)):
        raise EvalError(f"compare: {problem}; --side-by-side shows them without differences")
    # benchmark evaluations (report: accuracy) side by side as the benchmark table
    accuracy = all(e.get("config", {}).get("report") == "accuracy" for e in evals)
    out = Path(args.out) if args.out else None
    if out is not None:
        if out.exists() and not out.is_dir():
            parser.error(f"--out {out} is a file; name the folder to write into")
        if (out / TABLE).exists() and not args.overwrite:
            parser.error(
                f"{out / TABLE} exists (an evaluation's own, or yours); pass --overwrite to "
                "replace it, or choose another --out"
            )
    tables = (
        accuracy_table(evals)
        if accuracy
        else markdown_tables(evals, differences=not args.side_by_side)
    )
    print(tables)
    if out is not None:
        atomic_write_text(out / TABLE, tables)


# Subcommands by name, each given the whole argv
COMMANDS: dict[str, Callable[[list[str]], None]] = {"compare": _compare}


def main(argv: list[str] | None = None, judged: dict[str, JudgedKind] | None = None) -> None:
    """`python evaluate.py config.yaml [key=value ...]`, or `compare`; an extension with
    judged sets of its own kind runs its evaluations through here (`judged`)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in COMMANDS:
            return COMMANDS[argv[0]](argv)
        evaluate(parse_cli(EvalConfig, argv), judged)
    except ConfigError as e:
        print(f"config error: {argv[0]}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (DataError, EvalError, JudgeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
