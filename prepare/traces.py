"""CLUE's training traces (A.1, C.3): sample reasoning traces of the base model for gold examples,
have a teacher refine each toward the gold labels, and keep the refinements that reach them with
verified quotes: the rows sft.py trains on (its `clue` objective).

    python -m prepare.traces config.yaml [key=value ...]   # examples -> sampled traces -> teacher
                                                             -> out

The traces come from `sampler` (an OpenAI-compatible endpoint serving the base model) or, without
one, from the base checkpoint `model` through model.py. Every endpoint answer, sampled trace and
refinement alike, is journaled as it arrives in `journal` (teacher.py): a rerun of the same command
asks only for what failed or was never asked. Written: `out`, one row per kept refinement (the
example, its prompt and the refined completion, sft.py's second row shape), and `conflicts`, the
teacher's reference-conflict records (for review, never for training).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import judge_server
from config import ConfigError, atomic_write_text, bounded, check_output_file, parse_cli, print0
from data import (
    THINK_END,
    THINK_START,
    DataError,
    Example,
    get_task,
    parse_answer,
    split_completion,
    visible_turns,
)
from dataset import example_to_json, load_jsonl
from distributed import setup_distributed
from http_client import JudgeCall, JudgeConfig, JudgeError, probe
from judge import DATA_NOTICE, chat_messages, section, strict_json_object
from model import Qwen
from sampling import sample_completions, sampling_from
from teacher import ask_journaled, load_journal, raw_text, request_key, write_rows
from tokenizer import CheckpointError, load_tokenizer
from verifier import EVIDENCE_CLOSE, EVIDENCE_OPEN, extract_quotes, format_score, verify_quote

# ----------------------------------------------------------------------------- config


@dataclass
class PrepareConfig:
    """`python -m prepare.traces`: sample traces from the base model, refine them toward the gold
    labels with a teacher, and write the accepted ones to `out` (the `data` of sft.py's config)."""

    examples: str  # gold examples (data.py's JSONL)
    out: str  # the SFT rows written (sft.py's `data`)
    # the base checkpoint sampled through model.py when there is no `sampler`
    model: str | None = None
    conflicts: str | None = None  # reference-conflict records; default: <out>.conflicts.jsonl
    journal: str | None = None  # endpoint answers so far; default: <out>.journal.jsonl
    samples: int = 1  # traces sampled per example
    # an OpenAI-compatible endpoint serving the base model; None: model.py
    sampler: JudgeConfig | None = None
    temperature: float = 1.0  # sampling of the traces (also sent to the endpoint)
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 8192
    batch_size: int = 8  # prompts sampled together (model.py only)
    # the chat format's thinking switch; None: the checkpoint's default
    enable_thinking: bool | None = None
    seed: int = 42  # model.py's sampling
    dtype: str | None = None  # model.py: None: bfloat16 on GPU, float32 on the CPU
    device: str | None = None  # model.py: None: cuda:LOCAL_RANK when available, else the CPU
    # the refiner (its own sampling settings)
    teacher: JudgeConfig = field(default_factory=JudgeConfig)
    # the refiner's new tokens per trace: a refinement copies the trace back with its evidence (a
    # local teacher at a few tokens/s takes minutes a call: lower it, or raise its timeout)
    refine_max_tokens: int = bounded(8192, ge=1)

    def __post_init__(self):
        if self.sampler is None and self.model is None:
            raise ConfigError(
                "model: the traces need a base checkpoint to sample, or a `sampler` endpoint"
            )


# ----------------------------------------------------------------- trace refinement (CLUE A.1, C.3)

_REFINEMENT_SYSTEM = f"""You refine one reasoning trace written for a social-language \
classification task, so that it becomes a training example
that reaches the supplied reference labels honestly, or you report that the labels cannot be \
supported.

You receive:
- <id> and <task_name>: identifiers to copy unchanged.
- <source_messages>: as JSON, the complete messages the trace answered: the task instructions, the \
label definitions,
  the conversation and the turn to analyze. They are the only source; use nothing else.
- <original_completion>: the trace to refine.
- <labels>: the reference labels the refined trace must end with. They say where the trace must \
arrive; they are not
  evidence about the conversation.
{DATA_NOTICE}

How to refine:
- Edit the original; do not write your own explanation from scratch. Keep its sound sentences word \
for word and in their
  order, in its language, with its paragraphs, valid quotations and useful comparisons. Add what \
is missing beside the
  passage that needs it.
- Where the original commits to a wrong inference or label, keep that commitment as written, then \
add right after it a
  correction that reads like someone rereading the exchange: point to the exact inference, check \
it against the
  conversation and the label definitions, and say what changes and why. Do not soften the original \
commitment after the
  fact. Everything after the correction, and the answer, follows the corrected understanding.
- Establish each reference label on its own terms, from evidence that meets its definition; \
rejecting another label does
  not establish it.
- Fill the gaps that matter: who the speakers are to each other, the recent thread leading into \
the target, time gaps
  that bear on continuity, the cause of the target speaker's state, and what a cue such as \
punctuation, an interjection
  or a repetition does in this sequence.
- Fix mechanical faults (a misquoted span, a wrong speaker for a quote, broken tags) locally, \
without staging a
  self-correction. Remove or rebuild a passage that loops or makes no sense. Rewrite from scratch \
only when nothing
  coherent survives.
- If the original is already sound and reaches the labels, leave its reasoning unchanged.
- Never mention reference labels, that labels were given, an editor, or the editing itself in the \
trace.

Evidence:
- Every <evidence>...</evidence> span is non-empty and copies an exact, contiguous piece of a \
single turn of the
  conversation: no paraphrase, translation, added ellipsis, joined fragments, or text from the \
instructions,
  definitions, speaker names or time markers. Tags are balanced and never nested.
- Keep no invented quotation anywhere, not even in a rejected line of thought. New concrete claims \
about the
  conversation need exact evidence.

When the labels cannot be supported: if the conversation and the definitions do not support the \
reference labels, do not
force them and do not substitute another label. Return a conflict record instead; it goes to \
review, not to training.

Output exactly one JSON object and nothing else (no code fence, no commentary), in one of two forms.
A refined trace:
{{"id": "<copied>", "task": "<copied>",
 "completion": "<think>\\n<the full refined reasoning>\\n</think>\\n\\nAnswer: <labels>"}}
The completion holds exactly one <think> and one </think>; after </think> comes only the line \
"Answer: " followed by
exactly the reference labels as spelled in <labels>, separated by a comma and a space.
A conflict record:
{{"id": "<copied>", "task": "<copied>", "status": "reference_conflict", "reference_labels": \
["<each label as given>"],
 "reason": "<the specific defining condition the conversation does not meet, or the conflict in \
the source>",
 "source_evidence": ["<exact relevant span of a turn>"],
 "supported_alternative_labels": ["<a label of the task the conversation does support>"]}}
Where no span is relevant or no alternative is supported, leave that list empty; never invent \
one."""

_LABEL_LEAK_RE = re.compile(
    r"ground[ -]truth|gold label|reference label|supplied label|given label", re.IGNORECASE
)


@dataclass
class RefinedTrace:
    """A refined SFT example: the original prompt messages and the refined assistant completion."""

    id: str
    task: str
    prompt: list[dict[str, str]]
    completion: str


@dataclass
class ReferenceConflict:
    """An audit record: the reference labels could not be supported. Never a training example."""

    id: str
    task: str
    reference_labels: list[str]
    reason: str
    source_evidence: list[str]
    supported_alternative_labels: list[str]


def refinement_request(
    example: Example, prompt_messages: list[dict[str, str]], completion: str, max_tokens: int
) -> JudgeCall:
    """The trace-refinement call for one sampled `completion` to `prompt_messages` (the task prompt
    it answered), toward the gold `example.labels`. The paper has the refiner copy the prompt back;
    we keep it on our side, so a copying slip cannot corrupt a training row."""
    messages = chat_messages(
        _REFINEMENT_SYSTEM,
        section("id", example.id),
        section("task_name", example.task),
        section("source_messages", json.dumps(prompt_messages, ensure_ascii=False, indent=1)),
        section("original_completion", completion),
        section("labels", json.dumps(example.labels, ensure_ascii=False)),
    )
    return JudgeCall(messages, max_tokens)


def _exact_quotes(spans: list, example: Example) -> bool:
    """Every span is a string that the verifier finds, without typographical edits, in one visible
    turn."""
    texts = [t.text for t in visible_turns(example)]
    return all(
        isinstance(s, str) and any(verify_quote(s, text, exact=True) for text in texts)
        for s in spans
    )


def _distinct_strings(value) -> bool:
    return (
        isinstance(value, list)
        and all(isinstance(x, str) for x in value)
        and len(set(value)) == len(value)
    )


def _same_label_set(labels, gold: list[str]) -> bool:
    return _distinct_strings(labels) and set(labels) == set(gold)


def _refined_completion_ok(completion: str, example: Example) -> bool:
    """One think block whose evidence tags are balanced and unnested around exact quotations, with
    no mention of reference labels, then only the line `Answer: <gold labels>` in canonical
    spelling."""
    completion = completion.strip()
    reasoning, answer = split_completion(completion)
    labels = parse_answer(completion, example)
    return (
        completion.startswith(THINK_START)
        and completion.count(THINK_START) == 1
        and completion.count(THINK_END) == 1
        and labels is not None
        and set(labels) == set(example.labels)
        and answer.strip() == "Answer: " + ", ".join(labels)
        and bool(reasoning)
        and not _LABEL_LEAK_RE.search(reasoning)
        and format_score(reasoning) == 1.0
        and _exact_quotes(extract_quotes(reasoning), example)
    )


def parse_refinement(
    text: str, example: Example, prompt_messages: list[dict[str, str]]
) -> RefinedTrace | ReferenceConflict | None:
    """A refined trace, a conflict record, or None for any answer that is neither exactly: wrong
    id or task, an answer line that is not exactly the gold labels, an evidence span that is not an
    exact quotation of a turn, a conflict whose reference labels are not the gold ones or whose
    alternatives are not labels of the task."""
    record = strict_json_object(text)
    if record is None or record.get("id") != example.id or record.get("task") != example.task:
        return None
    if set(record) == {"id", "task", "completion"}:
        completion = record["completion"]
        if not isinstance(completion, str) or not _refined_completion_ok(completion, example):
            return None
        return RefinedTrace(example.id, example.task, prompt_messages, completion.strip())
    conflict_keys = {
        "id",
        "task",
        "status",
        "reference_labels",
        "reason",
        "source_evidence",
        "supported_alternative_labels",
    }
    if set(record) != conflict_keys or record["status"] != "reference_conflict":
        return None
    reason, evidence, alternatives = (
        record["reason"],
        record["source_evidence"],
        record["supported_alternative_labels"],
    )
    valid = (
        _same_label_set(record["reference_labels"], example.labels)
        and isinstance(reason, str)
        and reason.strip()
        and isinstance(evidence, list)
        and _exact_quotes(evidence, example)
        and _distinct_strings(alternatives)
        and all(
            a in get_task(example.task).labels and a not in example.labels for a in alternatives
        )
    )
    if not valid:
        return None
    return ReferenceConflict(
        example.id,
        example.task,
        list(record["reference_labels"]),
        reason.strip(),
        list(evidence),
        list(alternatives),
    )


# what the teacher refines when it is asked once before the model loads (sample_traces)
_STAND_IN_TRACE = "The last turn reads differently in the light of the turns before it."


def sample_traces(
    cfg: PrepareConfig,
    examples: list[Example],
    prompts: list[list[dict]],
    journal: Path,
    done: dict,
) -> list[str | None]:
    """(`cfg.samples` traces per example (`prompts` holds each example's prompt that many times), in
    that order, None where the endpoint failed; the failed calls' reasons). model.py samples with
    `cfg.seed`, after the teacher has answered one stand-in refinement (http_client.probe); an
    endpoint's answers are journaled."""
    if cfg.sampler is None:
        stand_in = f"{_STAND_IN_TRACE}\n{THINK_END}\nAnswer: {', '.join(examples[0].labels)}"
        stand_in_call = refinement_request(examples[0], prompts[0], stand_in, cfg.refine_max_tokens)
        probe(stand_in_call, cfg.teacher, "teacher")
        device = setup_distributed(cfg.device).device
        dtype = cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32")
        tok, model = load_tokenizer(cfg.model), Qwen.from_pretrained(cfg.model, dtype, device)
        per_example = sample_completions(
            model,
            tok,
            prompts[:: cfg.samples],
            [e.id for e in examples],
            sampling_from(cfg, cfg.enable_thinking),
            n=cfg.samples,
            seed=cfg.seed,
            batch_size=cfg.batch_size,
        )
        return [t for texts in per_example for t in texts], []
    sampler = dataclasses.replace(
        cfg.sampler,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k or None,
        enable_thinking=cfg.enable_thinking is not False,
    )
    calls = [JudgeCall(m, cfg.max_new_tokens) for m in prompts]
    keys = [
        request_key("trace", f"{e.id}/{k % cfg.samples}", sampler, c)
        for k, (e, c) in enumerate(zip((e for e in examples for _ in range(cfg.samples)), calls))
    ]
    asked = ask_journaled(
        [(k, c, raw_text) for k, c in zip(keys, calls)], sampler, journal, done, "sampler"
    )
    return [done.get(k) for k in keys], asked["errors"]


def prepare(cfg: PrepareConfig) -> dict[str, int]:
    """Build SFT rows the paper's way (A.1): sample traces of the base model for the gold examples,
    have the teacher refine each toward the gold labels (C.3), keep the refinements that answer the
    gold labels with verified quotes, and write them to `cfg.out` (example + prompt + completion),
    the conflict records beside them. Returns the counts it prints."""
    check_output_file(cfg.out, "out", {"examples": cfg.examples})
    examples = load_jsonl(cfg.examples)
    if not examples:
        raise DataError(f"{cfg.examples}: no examples (the file is empty)")
    journal = Path(cfg.journal or str(Path(cfg.out).with_suffix(".journal.jsonl")))
    done = load_journal(journal)
    owners = [e for e in examples for _ in range(cfg.samples)]
    prompts = [get_task(e.task).messages(e) for e in owners]
    traces, errors = sample_traces(cfg, examples, prompts, journal, done)
    todo = [(e, m, t) for e, m, t in zip(owners, prompts, traces) if t is not None]
    calls = [refinement_request(e, m, t, cfg.refine_max_tokens) for e, m, t in todo]
    keys = [request_key("refine", e.id, cfg.teacher, c) for (e, _, _), c in zip(todo, calls)]
    asked = ask_journaled(
        [(k, c, raw_text) for k, c in zip(keys, calls)], cfg.teacher, journal, done
    )
    errors += asked["errors"]
    answers = [done.get(k) for k in keys]
    rows, conflicts = [], []
    for (example, messages, _), answer in zip(todo, answers):
        parsed = None if answer is None else parse_refinement(answer, example, messages)
        if isinstance(parsed, RefinedTrace):
            rows.append(
                example_to_json(example)
                | {"prompt": parsed.prompt, "completion": parsed.completion}
            )
        elif isinstance(parsed, ReferenceConflict):
            conflicts.append(dataclasses.asdict(parsed))
    conflicts_path = cfg.conflicts or str(Path(cfg.out).with_suffix(".conflicts.jsonl"))
    counts = {
        "sampled": len(todo),
        "sampler_failures": len(prompts) - len(todo),
        "kept": len(rows),
        "conflicts": len(conflicts),
        "teacher_failures": answers.count(None),
        "rejected": len(todo) - len(rows) - len(conflicts) - answers.count(None),
    }
    print0(
        f"prepare: {counts['sampled']} traces ({counts['sampler_failures']} sampler failures); "
        f"teacher: {counts['kept']} kept -> {cfg.out}, {counts['conflicts']} conflicts -> "
        f"{conflicts_path}, {counts['rejected']} rejected (malformed, wrong labels or unverified "
        f"quotes), {counts['teacher_failures']} teacher failures"
    )
    atomic_write_text(
        conflicts_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in conflicts)
    )
    write_rows(cfg.out, [json.dumps(r, ensure_ascii=False) + "\n" for r in rows], errors, journal)
    return counts


# ----------------------------------------------------------------------------- command line


# ----------------------------------------------------------------------------- offline teacher


def rule_refinement(messages: list[dict[str, str]], params: dict) -> str:
    """A RULE STAND-IN for the refiner, for offline runs on a CPU; it understands nothing. Asked the
    refinement prompt, it returns a trace that quotes, in evidence tags, the turn to analyze (the
    text after the speaker's name on the last line of data.py's task prompt) and ends with the
    reference labels; any other prompt goes to judge_server's rules backend (IU_G, cause, ...)."""
    if not messages or messages[0]["content"] != _REFINEMENT_SYSTEM:
        return judge_server.rules_backend(messages, params)
    found = {
        m.group(1): m.group(3) for m in judge_server.SECTION_RE.finditer(messages[-1]["content"])
    }
    last = json.loads(found["source_messages"])[-1]["content"].strip().splitlines()[-1]
    quote = last.split(": ", 1)[-1]
    reasoning = f"The turn to analyze reads {EVIDENCE_OPEN}{quote}{EVIDENCE_CLOSE}."
    labels = ", ".join(json.loads(found["labels"]))
    completion = f"{THINK_START}\n{reasoning}\n{THINK_END}\n\nAnswer: {labels}"
    record = {"id": found["id"], "task": found["task_name"], "completion": completion}
    return json.dumps(record, ensure_ascii=False)


def main(argv=None) -> None:
    """`python -m prepare.traces config.yaml [key=value ...]`, or `python -m prepare.traces
    serve-rules [--port N]`: a local server whose refiner is the rule stand-in above (and whose
    other answers are the rules backend's), for an offline stage 1 on a CPU."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve-rules"]:
        backends = {"refine_rules": lambda args: rule_refinement}
        return judge_server.main(
            ["--backend", "refine_rules", *argv[1:]], backends, without_model=("refine_rules",)
        )
    cfg = parse_cli(PrepareConfig, argv)
    try:
        prepare(cfg)
    except (DataError, ConfigError, CheckpointError, JudgeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
