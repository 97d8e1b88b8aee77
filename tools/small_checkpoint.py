"""A small random checkpoint for running the pipeline on your own data on a CPU, without a download:
a byte-level BPE tokenizer trained on your examples' prompts (with Qwen's chat tokens) and the
demo's small Qwen3 (about 0.7M parameters plus the embedding) with seeded random weights, both from
demo.py (`train_tokenizer`, `init_model`). It learns what SFT and GRPO teach it and nothing else:
a model to watch the pipeline work on, not one to report.

    python -m tools.small_checkpoint data/meld_train.jsonl checkpoints/small-meld [--vocab 4096]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from data import get_task
from dataset import load_jsonl
from demo import ModelSize, init_model, train_tokenizer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.small_checkpoint", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("examples", nargs="+", help="JSONL examples (data.py's schema)")
    parser.add_argument("out", help="the checkpoint folder to write")
    parser.add_argument("--vocab", type=int, default=4096, help="the BPE's target size")
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        parser.error(f"{out} exists and is not empty; give a new folder")
    texts = [
        m["content"]
        for path in args.examples
        for e in load_jsonl(path)
        for m in get_task(e.task).messages(e)
    ]
    vocab = train_tokenizer(texts, out, args.vocab)
    init_model(out, ModelSize(), vocab, args.seed)
    print(f"small checkpoint: {len(texts)} prompts, vocabulary {vocab} -> {out}")


if __name__ == "__main__":
    main()
