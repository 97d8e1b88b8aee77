"""Benchmark the quotation verifier on one GRPO batch: 64 completions x 8 quotations against a
200-turn conversation cut from MELD, on one core, against a naive baseline in the same run.

Each completion quotes 5 exact spans (1-20 words, some across two turns), 1 span with a typo,
1 elided span ("A ... B") and 1 quotation from another conversation (which must fail). The naive
baseline is a plain semi-global edit-distance scan of every quotation over the whole conversation
text (pure Python, like ours), accepting at most one edit per 10 characters; it is timed on the
first --baseline-completions completions and its per-quotation time scaled to the batch.

    python bench/bench_verifier.py [--data ../shared/data] [--baseline-completions 4]
"""

import argparse
import csv
import os
import random
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import verifier  # noqa: E402


def load_meld(data: Path) -> list[list[str]]:
    dialogues = defaultdict(list)
    with open(data / "meld" / "train_sent_emo.csv", encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            dialogues[row["Dialogue_ID"]].append(row["Utterance"])
    return list(dialogues.values())


def words_span(rng, text, most):
    words = text.split()
    n = rng.randint(1, min(most, len(words)))
    start = rng.randrange(len(words) - n + 1)
    return words[start : start + n]


def typo(rng, words):
    long = [i for i, w in enumerate(words) if len(w) >= 5 and w.isalpha()]
    if long:
        i = rng.choice(long)
        w = words[i]
        j = rng.randrange(1, len(w) - 2)
        words = words[:i] + [w[:j] + w[j + 1] + w[j] + w[j + 2 :]] + words[i + 1 :]
    return " ".join(words)


def make_batch(rng, conversation, other, n_completions):
    batch = []
    for _ in range(n_completions):
        quotes = []
        for _ in range(5):
            i = rng.randrange(len(conversation) - 1)
            text = conversation[i] + (" " + conversation[i + 1] if rng.random() < 0.2 else "")
            quotes.append(" ".join(words_span(rng, text, 20)))
        long_turns = [t for t in conversation if len(t.split()) >= 12]
        quotes.append(typo(rng, words_span(rng, rng.choice(long_turns), 20)))
        words = rng.choice(long_turns).split()
        quotes.append(" ".join(words[:4]) + " ... " + " ".join(words[-4:]))
        quotes.append(" ".join(words_span(rng, rng.choice(other), 20)))
        batch.append(quotes)
    return batch


def naive_normalize(text):
    return " ".join(re.sub(r"[^\w\s']", " ", text.lower().replace("\u2019", "'")).split())


def naive_verify(quote, conversation_text):
    """Sellers' semi-global edit distance of the quote against the whole conversation string."""
    q = naive_normalize(quote)
    if not q:
        return False
    previous = [0] * (len(conversation_text) + 1)
    for i, qc in enumerate(q, 1):
        row = [i] + [0] * len(conversation_text)
        for j, tc in enumerate(conversation_text, 1):
            row[j] = min(previous[j] + 1, row[j - 1] + 1, previous[j - 1] + (qc != tc))
        previous = row
    return min(previous) <= len(q) // 10


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data",
        type=Path,
        default=Path(
            os.environ.get("CLUE_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data")
        ),
    )
    parser.add_argument("--completions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--baseline-completions", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    rng = random.Random(args.seed)
    dialogues = load_meld(args.data)
    conversation = [u for d in dialogues[:120] for u in d][: args.turns]
    other = [u for d in dialogues[-200:] for u in d]
    batch = make_batch(rng, conversation, other, args.completions)
    n_quotes = sum(map(len, batch))
    print(
        f"conversation: {len(conversation)} turns, {sum(map(len, conversation))} characters; "
        f"batch: {args.completions} completions, {n_quotes} quotations"
    )

    verifier._conversation.cache_clear()
    start = time.perf_counter()
    ours = [[verifier.verify_quote(q, conversation) for q in quotes] for quotes in batch]
    ours_s = time.perf_counter() - start
    by_kind = [sum(c[k] for c in ours) for k in range(8)]
    print(
        f"ours:  {ours_s * 1000:.1f} ms for the batch (conversation indexing included), "
        f"{ours_s / n_quotes * 1e6:.0f} us/quotation"
    )
    print(
        f"       verified per slot (of {args.completions}): exact x5 {by_kind[:5]}, typo "
        f"{by_kind[5]}, elided {by_kind[6]}, other conversation {by_kind[7]}"
    )

    conversation_text = naive_normalize(" ".join(conversation))
    subset = [q for quotes in batch[: args.baseline_completions] for q in quotes]
    start = time.perf_counter()
    naive = [naive_verify(q, conversation_text) for q in subset]
    naive_s = time.perf_counter() - start
    naive_batch_s = naive_s / len(subset) * n_quotes
    print(
        f"naive: {naive_s:.2f} s for {len(subset)} quotations, {naive_s / len(subset) * 1e3:.0f} "
        f"ms/quotation, {naive_batch_s:.1f} s scaled to the batch ({sum(naive)}/{len(subset)} "
        f"verified)"
    )
    print(f"speed-up: {naive_batch_s / ours_s:.0f}x")


if __name__ == "__main__":
    main()
