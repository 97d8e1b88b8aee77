"""A full-parameter run's checkpoint as a Hugging Face checkpoint folder, for evaluate.py, vLLM or
transformers to load (a finished run writes its whole model itself: `model/`, `best/`):

    python -m tools.export_checkpoint RUN/ckpt-30 OUT

A full run's `ckpt-<step>/` holds its trained weights as torch.distributed.checkpoint shards
(`dcp/`), not a model folder. The run's config.yaml beside it names the base: `model.path`,
`model.dtype` and `model.sft_adapter` (grpo.py and the runs built on it), or `model` and `dtype`
(sft.py). The base is loaded whole on the CPU, the SFT adapter merged in as the trainer merged it,
every trained tensor of the checkpoint read in at whatever number of ranks wrote it, rounded to the
base's dtype, and the model written as the trainer's own export writes it. One process, no GPU: a
model of N parameters needs host memory for it in the base's dtype plus its largest tensor in
float32."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import HuggingFaceStorageReader

from checkpoint import atomic_folder, checkpoint_problem
from config import read_text
from data import EVIDENCE_CLOSE, EVIDENCE_OPEN
from model import (
    Qwen,
    add_special_tokens,
    load_adapter,
    merge_lora,
    open_safetensors,
    save_merged,
    train_token_rows,
)
from tokenizer import CheckpointError, load_tokenizer, read_json


def run_base(config_path: Path) -> tuple[str, str | None, str | None]:
    """(base path, dtype, SFT adapter) from a run's config.yaml."""
    try:
        raw = yaml.safe_load(read_text(config_path, CheckpointError))
    except FileNotFoundError:
        raise CheckpointError(
            f"{config_path}: file not found (the run writes its config.yaml beside its "
            "checkpoints; it names the base)"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}" if mark else ""
        raise CheckpointError(f"{config_path}{at}: not valid YAML (cut short?)") from None
    raw = raw if isinstance(raw, dict) else {}
    model = raw.get("model")
    if isinstance(model, dict):
        base, dtype, sft_adapter = (model.get(k) for k in ("path", "dtype", "sft_adapter"))
    else:
        base, dtype, sft_adapter = model, raw.get("dtype"), None
    if not (isinstance(base, str) and base):
        raise CheckpointError(f"{config_path}: field 'model': no base model named")
    if not all(v is None or isinstance(v, str) for v in (dtype, sft_adapter)):
        raise CheckpointError(f"{config_path}: field 'model': dtype and sft_adapter not strings")
    return base, dtype, sft_adapter


def _trained_names(shards: Path) -> list[str]:
    """The names of the trained tensors in a checkpoint's `dcp/`, each shard file opened first (one
    that is missing, cut or not safetensors is named)."""
    files = sorted(shards.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{shards}: no shards (*.safetensors)")
    for file in files:
        with open_safetensors(file):
            pass
    saved = HuggingFaceStorageReader(os.fspath(shards)).read_metadata().state_dict_metadata
    return [k.removeprefix("model.") for k in saved if k.startswith("model.")]


def export_checkpoint(checkpoint, out) -> Path:
    """Write `checkpoint` (a full run's ckpt-<step> folder) to `out` as a Hugging Face checkpoint
    folder, staged beside it and moved into place whole; returns `out`. Everything is read and
    checked before anything is written: a LoRA run's checkpoint, one not whole (a file missing or
    cut), an unreadable config.yaml or shard, tensors the base does not have, or an `out` that is
    not an empty or new folder raise CheckpointError naming the file."""
    checkpoint, out = Path(checkpoint), Path(out)
    if problem := checkpoint_problem(checkpoint):
        raise CheckpointError(f"{checkpoint}: not a whole checkpoint ({problem})")
    state = checkpoint / "state.json"
    if read_json(state).get("finetune", "lora") != "full":
        raise CheckpointError(
            f"{state}: field 'finetune': a LoRA run's checkpoint is an adapter folder already; "
            f"evaluate it with checkpoint= its base and adapter={checkpoint}"
        )
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise CheckpointError(f"{out}: exists and is not an empty folder; give a new folder")
    if out.resolve().is_relative_to(checkpoint.resolve()):
        raise CheckpointError(f"{out}: inside the checkpoint {checkpoint}; give a folder outside")
    base, dtype, sft_adapter = run_base(checkpoint.parent / "config.yaml")
    names = _trained_names(checkpoint / "dcp")
    tok = load_tokenizer(base)
    model = Qwen.from_pretrained(base, dtype=dtype)
    if sft_adapter:  # as the trainer built its policy: the SFT run's rows, its adapter merged
        add_special_tokens(model, tok, [EVIDENCE_OPEN, EVIDENCE_CLOSE])
        merge_lora(load_adapter(model, sft_adapter))
    if "embed_rows" in names:  # sft.py's CLUE objective trained the evidence tags' rows
        train_token_rows(model, add_special_tokens(model, tok, [EVIDENCE_OPEN, EVIDENCE_CLOSE]))
    params = dict(model.named_parameters())
    unknown = [n for n in names if n not in params]
    if unknown or not names:
        raise CheckpointError(
            f"{checkpoint / 'dcp'}: tensors {unknown[:3] or 'none'} are not parameters of the "
            f"base {base}; was this checkpoint written by a run of another base?"
        )
    with torch.no_grad(), warnings.catch_warnings():
        # DCP's note that it reads in one process, as this tool means to
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        for name in names:  # one float32 tensor at a time
            trained = {f"model.{name}": torch.empty(params[name].shape, dtype=torch.float32)}
            dcp.load(
                trained, storage_reader=HuggingFaceStorageReader(os.fspath(checkpoint / "dcp"))
            )
            params[name].copy_(trained[f"model.{name}"].to(params[name].dtype))
    with atomic_folder(out) as staging:
        save_merged(model, tok, staging)
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    try:
        out = export_checkpoint(*argv)
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"exported {argv[0]} -> {out}")


if __name__ == "__main__":
    main()
