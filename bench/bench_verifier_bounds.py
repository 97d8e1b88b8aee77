"""Worst cases of the quotation verifier: hostile quotations against 10,000-turn conversations, each
timed against the baseline of indexing that conversation once (normalizing and tokenizing every
turn, which any call on a new conversation pays), with the process's peak memory at the end.

The conversations: "natural" draws words of a made-up vocabulary by Zipf's law (as words occur in
real conversation), "repetitive" is one laugh repeated. Every quotation is absent, so each search
runs to its end: before the work bounds of verifier.py, the worst of them ran for minutes or until
the process ran out of memory. tests/test_hostile.py runs this script under a 512 MiB limit.

    python bench/bench_verifier_bounds.py [--turns 10000] [--json]
"""

import argparse
import json
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import verifier  # noqa: E402


def conversations(turns: int) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (utterances, hostile quotations that do not occur in them)."""
    rng = random.Random(0)
    vocabulary = [
        a + b + c
        for a in "bdfgklmnprstvz"
        for b in "aeiou"
        for c in ["", "n", "ra", "lo", "mi", "sen"]
    ]
    weights = [1 / (rank + 1) for rank in range(len(vocabulary))]
    natural = [
        " ".join(rng.choices(vocabulary, weights, k=rng.randint(3, 15))) for _ in range(turns)
    ]
    common, rare = vocabulary[:30], "zzzzzzzzzz"
    return {
        "natural": (
            natural,
            [
                " ".join(rng.choices(common, k=100)),  # the commonest words, in no real order
                " ".join([vocabulary[0]] * 99 + [rare]),  # one word repeated
                " ... ".join([" ".join(vocabulary[:2])] * 2000),  # thousands of fragments
                " ... ".join(" ".join(rng.choices(common, k=12)) for _ in range(8)),
                " ... ".join(
                    f"{word} {rare}" for word in common[:8]
                ),  # fragments a typo away from many places
                " ".join(rng.choices(vocabulary, weights, k=1000)),  # 1,000 words
            ],
        ),
        "repetitive": (
            ["haha " * 8] * turns,
            [
                " ".join(["haha"] * 99 + ["no"]),
                " ".join(["hahaha"] * 98 + ["hahahx", "hahaha"]),
                " ... ".join([" ".join(["haha"] * 11 + ["no"])] * 8),
            ],
        ),
    }


def peak_rss_kib() -> int:
    """This process's peak resident set (VmHWM). Not ru_maxrss: Linux keeps that across exec, so a
    bench started from a large process (pytest) would report the parent's peak."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10_000)
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a table"
    )
    args = parser.parse_args()
    report, cases = {}, conversations(args.turns)
    for name, (conversation, quotes) in cases.items():
        verifier._conversation.cache_clear()
        start = time.perf_counter()
        verifier.verify_quote("warm up", conversation)  # indexes the conversation
        index = report[f"{name} index"] = time.perf_counter() - start
        for k, quote in enumerate(quotes):
            start = time.perf_counter()
            if verifier.verify_quote(quote, conversation):
                raise SystemExit(f"{name} {k}: a quotation that is not there verified")
            report[f"{name} {k}"] = time.perf_counter() - start
            if not args.json:
                print(
                    f"{name:10} case {k}: {report[f'{name} {k}'] * 1e3:7.1f} ms, "
                    f"{report[f'{name} {k}'] / index:.3f} x indexing the conversation "
                    f"({index * 1e3:.0f} ms)"
                )
    # past the work bound an exact copy still matches
    present = " ... ".join(["haha haha haha"] * 8)
    report["exact fragments in repetitive"] = verifier.verify_quote(present, cases["repetitive"][0])
    report["peak_rss_mb"] = peak_rss_kib() / 1024
    print(json.dumps(report) if args.json else f"peak memory {report['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()
