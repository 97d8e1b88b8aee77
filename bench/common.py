"""What the benchmarks share: Markdown tables, the verdict line bench/run_all.sh collects,
alternating timings and an operator profile of our side. Never imported by the project."""

import time

import torch


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def qwen3_shape(vocab: int, hidden: int, layers: int, tied: bool) -> dict:
    """The benchmarks' Qwen3-shaped model as Hugging Face config fields: 4 heads (2 KV) of
    hidden / 4, an FFN of 3 x hidden."""
    return dict(
        model_type="qwen3",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        rope_theta=1e6,
        tie_word_embeddings=tied,
    )


def verdict(name: str, ratio: float, goal: float) -> bool:
    """Print `target: NAME RATIOx (goal >= GOALx): met|MISSED`, the line bench/run_all.sh collects;
    True if met."""
    met = ratio >= goal
    print(f"target: {name} {ratio:.2f}x (goal >= {goal:g}x): {'met' if met else 'MISSED'}")
    return met


def best_times(fns, repeats: int):
    """Best wall time and last output of each function; the calls alternate, so that load from other
    processes on a shared machine falls on every side alike. The first round is a warm-up, and is
    timed only when repeats is 0."""
    best, outs = [float("inf")] * len(fns), [None] * len(fns)
    for r in range(repeats + 1):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            outs[i] = fn()
            if r > 0 or repeats == 0:
                best[i] = min(best[i], time.perf_counter() - start)
    return best, outs


def profile_table(fn, title: str, rows: int = 12) -> None:
    """Print the operators that took the most self CPU time in one call of fn, as a Markdown
    table."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    print(
        f"\nProfile of {title} (torch.profiler, self CPU time; {total / 1e6:.2f} s under the "
        f"profiler):\n"
    )
    print(
        markdown_table(
            ["operator", "self ms", "share", "calls"],
            [
                [
                    e.key[:60],
                    f"{e.self_cpu_time_total / 1e3:.1f}",
                    f"{e.self_cpu_time_total / total:.1%}",
                    e.count,
                ]
                for e in events[:rows]
            ],
        )
    )


def threads(n: int | None) -> int:
    """Set torch's CPU threads (None: keep the default) and return the count in use."""
    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()
