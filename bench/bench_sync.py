"""What a full-parameter run's weight sync to vLLM moves per update, today's path against the
trained-only one (vllm_engine.sync_weights: the first sync sends the whole checkpoint, every later
one fsdp.export_trained's), on the CPU in one process (FSDP2 on one gloo rank):

    python bench/bench_sync.py                  # a Qwen3-shaped model: vocab 32768, hidden 256
    python bench/bench_sync.py --layers 2       # smaller

Per sync, in bytes: `gathered`, the full tensors the all-gathers assemble (every sharded weight:
float32 masters before, the model dtype now, the shard cast first); `written`, the folder's files
(the server reads the same again); `moved`, the three together. Seconds: the export alone (gather
and write; the server's reload is not timed here), best of --repeats. The same byte arithmetic for
Qwen3-8B and Qwen3.5-9B (bench/gpu.py's shapes, counted on the meta device, bf16). The issue's
target: moved bytes at least halved."""

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import instruments as INSTR
from common import markdown_table, qwen3_shape, verdict  # noqa: E402
from gpu import SHAPES  # noqa: E402
from instruments import free_port  # noqa: E402

import checkpoint as CK  # noqa: E402
import distributed as D  # noqa: E402
import fsdp as FS  # noqa: E402
import model as M  # noqa: E402
from tokenizer import QwenTokenizer  # noqa: E402

GOAL = 2.0  # issue 49: the bytes a sync moves, at least halved


def sync_bytes(model: M.Qwen, dtype_bytes: int = 2) -> dict[str, tuple[int, int]]:
    """(before, after) bytes per sync of a model whose weights are stored in a 2-byte dtype: the
    embedding and lm_head are frozen and whole on every rank; the rest is sharded float32."""
    frozen = {id(model.model.embed_tokens.weight), id(model.head_weight())}
    sharded = sum(p.numel() for p in model.parameters() if id(p) not in frozen)
    every = sum(p.numel() for p in model.parameters())
    gathered = (sharded * 4, sharded * dtype_bytes)
    written = (every * dtype_bytes, sharded * dtype_bytes)
    return {
        "gathered": gathered,
        "written": written,
        "moved": tuple(g + 2 * w for g, w in zip(gathered, written)),
    }


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def measured(args) -> tuple[list, float]:
    """One rank's policy, sharded, exported both ways into a temporary folder: table rows and the
    moved-bytes ratio."""
    INSTR.gloo_rank(0, free_port(), world_size=1)
    ranks = D.setup_distributed("cpu")
    shape = qwen3_shape(args.vocab, args.hidden, args.layers, tied=False)
    torch.manual_seed(0)
    model = M.Qwen(M.QwenConfig.from_dict(shape)).to(torch.bfloat16)
    counted = sync_bytes(model)
    FS.shard_model(model, ranks.device)
    tok = QwenTokenizer.__new__(QwenTokenizer)
    tok.save = lambda folder: None  # no tokenizer files: the weights alone are compared
    rows, written = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, trained_only in (("today: whole checkpoint", False), ("trained only", True)):
            folder, best = Path(tmp) / label.split(":")[0], float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                CK.save_model(model, tok, folder, ranks, trained_only=trained_only)
                best = min(best, time.perf_counter() - start)
            written[trained_only] = folder_bytes(folder)
            shutil.rmtree(folder)
            rows.append((label, trained_only, best))
    table = []
    for label, after, seconds in rows:
        gathered = counted["gathered"][after]
        moved = gathered + 2 * written[after]
        table.append([label, mb(gathered), mb(written[after]), mb(moved), f"{seconds:.3f}"])
    ratio = (counted["gathered"][0] + 2 * written[False]) / (
        counted["gathered"][1] + 2 * written[True]
    )
    torch.distributed.destroy_process_group()
    return table, ratio


def mb(n: int) -> str:
    return f"{n / 1e6:,.1f}"


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    table, ratio = measured(args)
    print(
        f"### One sync of a Qwen3-shaped model (vocab {args.vocab}, hidden {args.hidden}, "
        f"{args.layers} layers, bf16) on the CPU, measured\n"
    )
    print(markdown_table(["path", "gathered MB", "written MB", "moved MB", "export s"], table))
    print()
    verdict("sync bytes moved, today / trained only (measured)", ratio, GOAL)
    print("\n### The same arithmetic for the papers' models (bf16, embedding and lm_head frozen)\n")
    rows, ratios = [], {}
    for name in ("qwen3-8b", "qwen3.5-9b"):
        with torch.device("meta"):
            model = M.Qwen(M.QwenConfig.from_dict(SHAPES[name]))
        counted = sync_bytes(model)
        for label, after in (("today", 0), ("trained only", 1)):
            rows.append([name, label, *(f"{counted[k][after] / 1e9:.2f}" for k in counted)])
        ratios[name] = counted["moved"][0] / counted["moved"][1]
    print(markdown_table(["model", "path", "gathered GB", "written GB", "moved GB"], rows))
    print()
    for name, r in ratios.items():
        verdict(f"sync bytes moved, today / trained only ({name}, arithmetic)", r, GOAL)


if __name__ == "__main__":
    main()
