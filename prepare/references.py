"""Social-R1's reference SIP analyses: the yardstick the prompted R_content judge scores a rollout
against (rewards.py's social_r1 reads it from `meta.reference`). A teacher writes one per gold
example, shown the gold option and bound to reach it; the examples whose reference passes
`judge.parse_sip_reference` are written for grpo.py.

    python -m prepare.references config.yaml [key=value ...]   # examples -> teacher -> out
                                                                 (grpo.py's train_data)

Every answer is journaled as it arrives in `<out stem>.references.jsonl` (teacher.py): a rerun of
the same command asks only for what failed or was never asked.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import data
import dataset
import http_client
import judge
from config import ConfigError, check_output_file, parse_cli, print0
from teacher import ask_journaled, load_journal, raw_text, request_key, write_rows


@dataclass
class ReferenceSettings:
    """`python -m prepare.references config.yaml`: write `out` (the first file of grpo.py's
    `train_data`) from `examples` with each example's reference SIP analysis in `meta.reference`,
    through a teacher endpoint."""

    examples: str  # gold examples without references (e.g. prepare/convert.py tombench)
    out: str  # the examples with references (grpo.py's train_data[0])
    # its own endpoint and sampling
    teacher: http_client.JudgeConfig = field(default_factory=http_client.JudgeConfig)


def add_references(
    examples: list[data.Example], teacher: http_client.JudgeConfig, journal
) -> tuple[list[data.Example], dict[str, int]]:
    """Ask `teacher` for every example's reference analysis (teacher.ask_journaled: concurrent, each
    answer kept in the journal as it arrives, so a rerun asks only for what failed or was never
    asked). Returns the examples whose answer judge.parse_sip_reference accepts, with it in
    `meta.reference`, and the counts (calls, reused, failures, rejected, written)."""
    calls = [judge.sip_reference_request(e) for e in examples]
    keys = [request_key("reference", e.id, teacher, c) for e, c in zip(examples, calls)]
    done = load_journal(journal)
    asked = ask_journaled([(k, c, raw_text) for k, c in zip(keys, calls)], teacher, journal, done)
    texts = [done.get(k) for k in keys]
    found = [
        None if t is None else judge.parse_sip_reference(t, e) for e, t in zip(examples, texts)
    ]
    kept = [
        dataclasses.replace(e, meta=e.meta | {"reference": r})
        for e, r in zip(examples, found)
        if r is not None
    ]
    rejected = sum(t is not None and r is None for t, r in zip(texts, found))
    return kept, {
        "calls": asked["asked"],
        "reused": len(examples) - asked["asked"],
        "failures": asked["failures"],
        "rejected": rejected,
        "written": len(kept),
        "errors": asked["errors"],
    }


def prepare(cfg: ReferenceSettings) -> dict[str, int]:
    """`out` from `examples`, with references; returns (and prints) the counts."""
    out = Path(cfg.out)
    check_output_file(out, "out", {"examples": cfg.examples})
    examples = dataset.load_jsonl(cfg.examples)
    journal = out.with_suffix(".references.jsonl")
    kept, n = add_references(examples, cfg.teacher, journal)
    print0(
        f"prepare: {len(kept)} of {len(examples)} examples with a reference -> {out} "
        f"({n['calls']} asked, {n['reused']} logged, {n['failures']} failed, {n['rejected']} "
        f"rejected)"
    )
    lines = [json.dumps(dataset.example_to_json(e), ensure_ascii=False) + "\n" for e in kept]
    write_rows(out, lines, n["errors"], journal)
    return n


def main(argv=None) -> None:
    cfg = parse_cli(ReferenceSettings, argv)
    try:
        prepare(cfg)
    except (ConfigError, data.DataError, http_client.JudgeError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
