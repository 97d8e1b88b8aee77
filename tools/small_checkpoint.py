"""A small random checkpoint for running the pipeline on your own data on a CPU, without a download:
a byte-level BPE tokenizer trained on your examples' prompts (with Qwen's chat tokens) and the
demo's small Qwen3 (about 0.7M parameters plus the embedding) with seeded random weights, both from
demo.py (`train_tokenizer`, `init_model`). It learns what SFT and GRPO teach it and nothing else:
a model to watch the pipeline work on, not one to report.

    python -m tools.small_checkpoint data/meld_train.jsonl checkpoints/small-meld [--vocab 4096]

The examples are all read first; the folder is built beside `out` and moved into place whole.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from checkpoint import atomic_folder
from data import DataError, get_task
from dataset import load_jsonl
from demo import CHATML, ModelSize, init_model, train_tokenizer

# from the byte alphabet and the chat tokens, which every vocabulary holds, to above every Qwen and
# Llama vocabulary (Qwen's 151,936), far below what the BPE trainer cannot allocate (10**12: abort)
VOCAB_RANGE = (256 + len(CHATML), 1 << 18)


def vocab_size(text: str) -> int:
    """argparse's type for --vocab: a size in VOCAB_RANGE."""
    low, high = VOCAB_RANGE
    try:
        size = int(text)
    except ValueError:
        size = -1
    if not low <= size <= high:
        raise argparse.ArgumentTypeError(f"a vocabulary size from {low} to {high:,}, not {text}")
    return size


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.small_checkpoint", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("examples", nargs="+", help="JSONL examples (data.py's schema)")
    parser.add_argument("out", help="the checkpoint folder to write (new, or an empty folder)")
    parser.add_argument("--vocab", type=vocab_size, default=4096, help="the BPE's target size")
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        if out.exists() and not (out.is_dir() and not any(out.iterdir())):
            raise DataError(f"{out}: exists and is not an empty folder; give a new folder")
        texts = []
        for path in args.examples:
            examples = load_jsonl(path)
            if not examples:
                raise DataError(f"{path}: no examples")
            texts += [m["content"] for e in examples for m in get_task(e.task).messages(e)]
        with atomic_folder(out) as staging:
            vocab = train_tokenizer(texts, staging, args.vocab)
            init_model(staging, ModelSize(), vocab, args.seed)
    except (DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"small checkpoint: {len(texts)} prompts, vocabulary {vocab} -> {out}")


if __name__ == "__main__":
    main()
