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

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import HuggingFaceStorageReader

from data import EVIDENCE_CLOSE, EVIDENCE_OPEN
from model import Qwen, add_special_tokens, load_adapter, merge_lora, save_merged
from tokenizer import CheckpointError, load_tokenizer


def run_base(config_path: Path) -> tuple[str, str | None, str | None]:
    """(base path, dtype, SFT adapter) from a run's config.yaml."""
    raw = yaml.safe_load(config_path.read_text(encoding="utf-8")) or {}
    model = raw.get("model")
    if isinstance(model, dict) and model.get("path"):
        return model["path"], model.get("dtype"), model.get("sft_adapter")
    if isinstance(model, str):
        return model, raw.get("dtype"), None
    raise CheckpointError(f"{config_path}: field 'model': no base model named")


def export_checkpoint(checkpoint, out) -> Path:
    """Write `checkpoint` (a full run's ckpt-<step> folder) to `out` as a Hugging Face checkpoint
    folder; returns `out`. A LoRA run's checkpoint, or one whose tensors the base does not have,
    raises CheckpointError naming the file."""
    checkpoint, out = Path(checkpoint), Path(out)
    state = checkpoint / "state.json"
    if not state.is_file():
        raise CheckpointError(f"{checkpoint}: not a checkpoint (no state.json)")
    if json.loads(state.read_text(encoding="utf-8")).get("finetune", "lora") != "full":
        raise CheckpointError(
            f"{state}: field 'finetune': a LoRA run's checkpoint is an adapter folder already; "
            f"evaluate it with checkpoint= its base and adapter={checkpoint}"
        )
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: exists and is not empty; give a new folder")
    base, dtype, sft_adapter = run_base(checkpoint.parent / "config.yaml")
    tok = load_tokenizer(base)
    model = Qwen.from_pretrained(base, dtype=dtype)
    if sft_adapter:  # as the trainer built its policy: the SFT run's rows, its adapter merged
        add_special_tokens(model, tok, [EVIDENCE_OPEN, EVIDENCE_CLOSE])
        merge_lora(load_adapter(model, sft_adapter))
    reader = HuggingFaceStorageReader(os.fspath(checkpoint / "dcp"))
    saved = reader.read_metadata().state_dict_metadata
    params = dict(model.named_parameters())
    names = [k.removeprefix("model.") for k in saved if k.startswith("model.")]
    unknown = [n for n in names if n not in params]
    if unknown or not names:
        raise CheckpointError(
            f"{checkpoint / 'dcp'}: tensors {unknown[:3] or 'none'} are not parameters of the "
            f"base {base}; was this checkpoint written by a run of another base?"
        )
    with torch.no_grad():
        for name in names:  # one float32 tensor at a time
            trained = {f"model.{name}": torch.empty(params[name].shape, dtype=torch.float32)}
            dcp.load(
                trained, storage_reader=HuggingFaceStorageReader(os.fspath(checkpoint / "dcp"))
            )
            params[name].copy_(trained[f"model.{name}"].to(params[name].dtype))
    save_merged(model, tok, out)
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
