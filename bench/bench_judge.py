"""Benchmark: IU_G judge calls through `http_client.chat_many` against the local server
(`python judge_server.py --backend rules`, started here as a subprocess on 127.0.0.1) with injected
latency. Baselines measured in the same run: the same requests sent one at a time; the ideal is
ceil(n / concurrency) rounds of the injected latency. A second server also fails a share of the
requests with HTTP 503: every result must still come back, through retries, which are counted.

    python bench/bench_judge.py [--n 64] [--latency 0.2] [--concurrency 32] [--fail-rate 0.3]
"""

import argparse
import logging
import math
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import http_client  # noqa: E402
import judge  # noqa: E402
from data import Example, Turn  # noqa: E402

LINES = [
    "Are you coming to the launch tonight?",
    "I promised my sister I'd help her move.",
    "You said that last week too.",
    "I know, I'm sorry, the truck fell through.",
    "Fine. I'll tell the team you're busy again.",
    "Please don't put it like that.",
]


def iu_calls(n: int, cfg: http_client.JudgeConfig) -> tuple[list[http_client.JudgeCall], list[int]]:
    """n IU_G requests over growing prefixes of one exchange, with 2 to 5 reasoning blocks each."""
    calls, sizes = [], []
    for i in range(n):
        turns = [Turn("Mia" if k % 2 == 0 else "Leo", text) for k, text in enumerate(LINES)]
        example = Example(
            id=f"bench-{i}",
            task="meld_emotion",
            turns=turns,
            target=len(turns) - 1 - i % 2,
            labels=["sadness"],
        )
        blocks = [
            (
                f"Leo answers <evidence>{LINES[k]}</evidence>, and reason {i}-{k} weighs what it "
                f"changes."
            )
            for k in range(2 + i % 4)
        ]
        calls.append(judge.iu_request(example, blocks, cfg))
        sizes.append(len(blocks))
    return calls, sizes


def start_server(*flags: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "judge_server.py"),
            "--backend",
            "rules",
            "--port",
            "0",
            *flags,
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    url = re.search(r"http://127\.0\.0\.1:\d+/v1", process.stdout.readline()).group(0)
    return process, url


def run(url: str, n: int, concurrency: int, **settings):
    cfg = http_client.JudgeConfig(base_url=url, concurrency=concurrency, **settings)
    calls, sizes = iu_calls(n, cfg)
    start = time.perf_counter()
    texts, stats = http_client.chat_many(calls, cfg)
    wall = time.perf_counter() - start
    parsed = sum(
        t is not None and judge.parse_iu_verdicts(t, k) is not None for t, k in zip(texts, sizes)
    )
    return wall, texts, stats, parsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--fail-rate", type=float, default=0.3)
    args = parser.parse_args()
    # each retry is logged; the totals are printed below
    logging.getLogger("judge").setLevel(logging.ERROR)
    rounds = math.ceil(args.n / args.concurrency)
    ideal, sequential_ideal = rounds * args.latency, args.n * args.latency

    process, url = start_server("--latency", str(args.latency))
    try:
        seq_wall, _, _, seq_parsed = run(url, args.n, 1, retries=0)
        wall, _, stats, parsed = run(url, args.n, args.concurrency, retries=0)
    finally:
        process.terminate()
        process.wait()
    print(
        f"{args.n} IU_G requests, {args.latency * 1000:.0f} ms injected latency, rules backend in "
        f"a subprocess"
    )
    rows = [
        (
            "one at a time (measured)",
            seq_wall,
            f"{args.n} x {args.latency:g} s = {sequential_ideal:.2f} s",
        ),
        (
            f"concurrency {args.concurrency} (measured)",
            wall,
            f"{seq_wall / wall:.1f}x faster than one at a time",
        ),
        (
            f"ideal: {rounds} rounds x {args.latency:g} s",
            ideal,
            f"measured / ideal = {wall / ideal:.2f} "
            f"(target <= 1.5: {'met' if wall <= 1.5 * ideal else 'MISSED'})",
        ),
    ]
    for label, seconds, note in rows:
        print(f"  {label:<30s} {seconds:6.2f} s   {note}")
    print(
        f"  parsed verdict lists: {seq_parsed}/{args.n} and {parsed}/{args.n}; latency mean "
        f"{stats['latency_mean_s'] * 1000:.0f} ms, max {stats['latency_max_s'] * 1000:.0f} ms"
    )

    process, url = start_server(
        "--latency", str(args.latency), "--fail-rate", str(args.fail_rate), "--seed", "0"
    )
    try:
        wall, texts, stats, parsed = run(url, args.n, args.concurrency, retries=8, backoff=0.05)
    finally:
        process.terminate()
        process.wait()
    returned = sum(t is not None for t in texts)
    print(
        f"with {args.fail_rate:.0%} of requests answered HTTP 503 (retries=8, backoff 0.05 s "
        f"doubling, jittered):"
    )
    print(
        f"  results returned {returned}/{args.n}, parsed {parsed}/{args.n}, retries "
        f"{stats['retries']}, failures {stats['failures']}, wall {wall:.2f} s ({wall / ideal:.2f} "
        f"x the no-failure ideal)"
    )


if __name__ == "__main__":
    main()
