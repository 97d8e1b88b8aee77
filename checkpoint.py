"""Checkpoints with exact resume, for LoRA and full-parameter runs alike, and the run's finished
model.

A checkpoint is a folder `ckpt-<step>` inside the run's output_dir, written under a temporary name
and renamed when complete; a re-save of a step moves the old folder aside and deletes it only once
the new one is in place (`publish_folder`). state.json lists every other file with its size, and a
resume skips, with a line saying so, a `ckpt-*` whose files are not all there (`checkpoint_problem`:
a folder cut by hand, a copy stopped short, an older version's kill mid-delete):

    adapter_config.json,      model.save_adapter (LoRA and token rows, PEFT format)      (LoRA)
      adapter_model.safetensors
    optimizer.safetensors     AdamW state, one tensor per `<parameter index>.<name>`     (LoRA)
    dcp/                      each rank's shards of the weights and AdamW state (full: save_sharded)
    rng-rank<r>.safetensors   rank r's torch (and CUDA) generator state; its Python state as
                              metadata
    state.json                step, world size, global batch, finetune mode, optimizer
                              hyperparameters, the trainer's own state, the folder's files

Only safetensors and JSON are written or read: nothing is unpickled on resume.

A full run's `dcp/` is written by torch.distributed.checkpoint through its safetensors storage
(every rank its own file of shards, each tensor's offsets in the file's JSON header: no pickle is
written or read), holding `model.<name>` for every trainable parameter and `optim.<name>.<moment>`
for AdamW's state; the optimizer's hyperparameters go to state.json.

A checkpoint resumes at any world size (docs/resume-and-faults.md#world-size-and-mode):
- the data position is global: the trainers count updates (GRPO also its curriculum cursor) and
  draw an update's examples without regard to the ranks, then deal them out; so a resume at another
  world size needs only the same global batch (examples per update), checked here;
- the weights and AdamW's state are whole tensors to DCP, which reads each rank's pieces by offset
  whatever number of ranks wrote them (a LoRA run's are replicated, rank 0's file);
- the RNG: at the world size that wrote it, each rank gets its own saved state back (exact
  resume); at another, rank r seeds its torch (CUDA included) and Python generators with s + r, s
  the first 63-bit draw from rank 0's saved torch state (`resharded_seed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from config import atomic_write_text, excerpt, print0, read_metrics, resolved_config_text
from distributed import Ranks, barrier, broadcast_parameters, is_distributed
from fsdp import export_full, export_trained, is_sharded
from model import Qwen, atomic_write, load_adapter, save_adapter, save_merged
from tokenizer import CheckpointError, read_json

_CKPT = "ckpt-"


def checkpoint_path(output_dir, step: int) -> Path:
    return Path(output_dir) / f"{_CKPT}{step:06d}"


def checkpoint_problem(folder) -> str | None:
    """Why `folder` is not a whole checkpoint, or None: its state.json must be a JSON object and
    every file it lists (`files`: {path: bytes}; checkpoints written before the list: none) there,
    at its size."""
    folder = Path(folder)
    try:
        files = read_json(folder / "state.json").get("files", {})
    except (OSError, CheckpointError) as e:
        return str(e)
    for name, size in files.items() if isinstance(files, dict) else ():
        found = folder / name
        if not found.is_file() or found.stat().st_size != size:
            return f"{found}: {'missing' if not found.is_file() else 'cut short'}"
    return None


def latest_checkpoint(output_dir) -> Path | None:
    """The whole checkpoint with the highest step in `output_dir`, or None; a newer one that is
    not whole (`checkpoint_problem`) is skipped with a line saying so."""
    found = [
        p
        for p in Path(output_dir).glob(f"{_CKPT}*")
        if p.is_dir() and p.name[len(_CKPT) :].isdigit()
    ]
    for path in sorted(found, key=lambda p: int(p.name[len(_CKPT) :]), reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        print0(f"resume: {path} is not a whole checkpoint ({problem}); skipped")
    return None


def _rng_file(folder: Path, rank: int) -> Path:
    return folder / f"rng-rank{rank}.safetensors"


def _save_rng(folder: Path, rank: int) -> None:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.cuda.get_rng_state()
    python = random.getstate()
    metadata = {"python": json.dumps([python[0], list(python[1]), python[2]])}
    atomic_write(_rng_file(folder, rank), tensors, metadata)


def resharded_seed(folder: Path, rank: int) -> int:
    """Rank `rank`'s seed on a resume at another world size: s + rank, s the first 63-bit draw
    from rank 0's saved torch generator state (a saved stream is no rank's own any more; this one
    depends on the run's seed and how far it had got)."""
    with safe_open(_rng_file(folder, 0), framework="pt") as f:
        generator = torch.Generator().set_state(f.get_tensor("torch"))
    return int(torch.randint(2**63 - 1, (), generator=generator)) + rank


def _load_rng(folder: Path, rank: int, same_world: bool) -> None:
    """This rank's generators as `save_checkpoint` left them (`same_world`), else seeded with
    `resharded_seed`."""
    if not same_world:
        seed = resharded_seed(folder, rank)
        torch.manual_seed(seed)
        random.seed(seed)
        return
    with safe_open(_rng_file(folder, rank), framework="pt") as f:
        torch.set_rng_state(f.get_tensor("torch"))
        if "cuda" in f.keys() and torch.cuda.is_available():
            torch.cuda.set_rng_state(f.get_tensor("cuda"))
        version, internal, gauss = json.loads(f.metadata()["python"])
    random.setstate((version, tuple(internal), gauss))


def staging_folder(final, clear: bool = True) -> Path:
    """Where the result folder `final` is built before `publish_folder` swaps it in: `.<name>.tmp`
    beside it, never inside it. `clear` empties it first (a killed run may have left one)."""
    staging = Path(final).with_name(f".{Path(final).name}.tmp")
    if clear:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    return staging


def publish_folder(staging: Path, final) -> None:
    """`staging` renamed to `final`. An old `final` is first moved aside to `.<name>.old` and
    deleted once the new one is in place: a kill at any moment leaves each folder whole (the old
    one under one of its names), never a `final` half deleted."""
    final = Path(final)
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(staging, final)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_folder(final):
    """`with atomic_folder(out / "adapter") as tmp: save_adapter(model, tmp)`: the folder appears
    whole or never. A write that fails (a full disk) names the file as it would be in `final`."""
    staging = staging_folder(final)
    try:
        yield staging
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, OSError) and e.filename and Path(e.filename).is_relative_to(staging):
            named = Path(final) / Path(e.filename).relative_to(staging)
            raise OSError(e.errno, e.strerror, str(named)) from None
        raise
    publish_folder(staging, final)


def save_checkpoint(
    output_dir,
    step: int,
    model: Qwen,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    global_batch: int,
    keep: int | None = None,
    write_extra=None,
) -> Path:
    """Write `ckpt-<step>` atomically; every rank must call it (each saves its own RNG state), rank
    0 writes the rest. `trainer_state` is the trainer's JSON-able state (its data position,
    counters); `global_batch` the examples one update takes over all ranks (what a resume at
    another world size must keep); `write_extra(folder)`, on rank 0, adds the trainer's own weights
    (the reward model's value head). With `keep`, only the newest `keep` checkpoints are left.
    Returns the checkpoint's path."""
    final = checkpoint_path(output_dir, step)
    rank = dist.get_rank() if is_distributed() else 0
    tmp = staging_folder(final, clear=rank == 0)
    barrier()
    _save_rng(tmp, rank)
    full = is_sharded(model)
    groups = save_sharded(tmp, model, optimizer) if full else None  # every rank writes its shards
    barrier()
    if rank == 0:
        state = None if full else optimizer.state_dict()
        if not full:
            save_adapter(model, tmp)
            tensors = {
                f"{i}.{name}": t.detach().cpu().contiguous()
                for i, s in state["state"].items()
                for name, t in s.items()
            }
            atomic_write(tmp / "optimizer.safetensors", tensors)
        if write_extra is not None:
            write_extra(tmp)
        files = {
            p.relative_to(tmp).as_posix(): p.stat().st_size
            for p in sorted(tmp.rglob("*"))
            if p.is_file()
        }
        meta = {
            "step": step,
            "world_size": dist.get_world_size() if is_distributed() else 1,
            "global_batch": global_batch,
            "finetune": "full" if full else "lora",
            "param_groups": groups or state["param_groups"],
            "trainer": trainer_state,
            "files": files,
        }
        atomic_write_text(tmp / "state.json", json.dumps(meta, indent=1) + "\n")
        publish_folder(tmp, final)
        if keep is not None:
            older = sorted(
                p for p in Path(output_dir).glob(f"{_CKPT}*") if p.is_dir() and p != final
            )
            for stale in older[: max(0, len(older) - (keep - 1))]:
                shutil.rmtree(stale, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(path, model: Qwen, global_batch: int) -> dict:
    """Check that a checkpoint fits this run (the same `finetune` mode; at another number of ranks,
    the same `global_batch`), load its adapter and token rows into `model` (LoRA: before the
    optimizer is built, the rows become new parameters) and this rank's RNG state (`_load_rng`).
    Returns its state.json; pass it to `restore_optimizer` once the optimizer exists (a
    full-parameter run's weights come back there, with the optimizer's state)."""
    path = Path(path)
    meta = json.loads((path / "state.json").read_text(encoding="utf-8"))
    world = dist.get_world_size() if is_distributed() else 1
    mode, written = ("full" if is_sharded(model) else "lora"), meta.get("finetune", "lora")
    if written != mode:
        raise CheckpointError(
            f"{path / 'state.json'}: field 'finetune': the checkpoint is of a {written} run, this "
            f"run is {mode}; resume it with finetune: {written} (or start afresh with resume: none)"
        )
    saved = meta.get("global_batch")  # None: written before checkpoints recorded it
    if meta["world_size"] != world and saved != global_batch:
        saved = saved or "an unrecorded number of"
        raise CheckpointError(
            f"{path}: written by {meta['world_size']} rank(s) at {saved} examples per update, "
            f"this run has {world} rank(s) at {global_batch}; a resume at "
            f"another world size needs the same examples per update (SFT: rows_per_update; "
            f"GRPO: rollout.prompts_per_update), or start afresh with resume=none"
        )
    if mode == "lora":
        load_adapter(model, path)
    _load_rng(path, dist.get_rank() if is_distributed() else 0, meta["world_size"] == world)
    return meta


def restore_optimizer(
    path, optimizer: torch.optim.Optimizer, meta: dict, model: Qwen | None = None
) -> None:
    """Load AdamW's state and hyperparameters saved by `save_checkpoint` (and, for a sharded
    `model`, its weights)."""
    if model is not None and is_sharded(model):
        load_sharded(Path(path), model, optimizer, meta["param_groups"])
        return
    state: dict[int, dict[str, torch.Tensor]] = {}
    with safe_open(Path(path) / "optimizer.safetensors", framework="pt") as f:
        for key in f.keys():
            index, name = key.split(".", 1)
            state.setdefault(int(index), {})[name] = f.get_tensor(key)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def resume(output_dir, model: Qwen, make_optimizer, global_batch: int, enabled: bool = True):
    """The run's optimizer and where it continues from, the one resume path of every trainer and
    both modes: with `enabled`, the newest checkpoint in `output_dir` is loaded (LoRA and token rows
    before the optimizer is built, then AdamW's state; a full-parameter run's shards with it, at any
    world size; this rank's RNG), if it was written at this run's `global_batch` or world size.
    Returns (optimizer, its state.json, its path); with none, a fresh optimizer whose trainable
    values are rank 0's on every rank, None, None."""
    path = latest_checkpoint(output_dir) if enabled else None
    if path is None:
        optimizer = make_optimizer()
        broadcast_parameters([p for group in optimizer.param_groups for p in group["params"]])
        return optimizer, None, None
    meta = load_checkpoint(path, model, global_batch)
    optimizer = make_optimizer()
    restore_optimizer(path, optimizer, meta, model)
    return optimizer, meta, path


_OPTIONS = StateDictOptions(strict=False)


def _state(model: Qwen, optimizer: torch.optim.Optimizer) -> tuple[dict, dict, list]:
    """(trainable model tensors, AdamW tensors, param_groups with parameter names) through
    get_state_dict."""
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    tensors = {f"model.{n}": t for n, t in model_state.items() if n in trainable}
    moments = {f"optim.{n}.{k}": t for n, s in optim_state["state"].items() for k, t in s.items()}
    return tensors, moments, optim_state["param_groups"]


def save_sharded(folder, model: Qwen, optimizer: torch.optim.Optimizer) -> list[dict]:
    """Every rank writes its shards of the trainable weights and of AdamW's state to folder/dcp (a
    collective); returns the param_groups (JSON-able) for state.json."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter  # full runs only

    tensors, moments, groups = _state(model, optimizer)
    writer = HuggingFaceStorageWriter(os.fspath(folder / "dcp"), save_distributed=True)
    dcp.save(tensors | moments, storage_writer=writer)
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]


def load_sharded(
    folder, model: Qwen, optimizer: torch.optim.Optimizer, param_groups: list[dict]
) -> None:
    """Load what `save_sharded` wrote into `model` and `optimizer` (a collective). The shards may
    have been written by another number of ranks: DCP reads each tensor's pieces by offset, and
    set_state_dict hands each rank its shards."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader  # full runs only

    # AdamW's state initialized at zero, filled below
    tensors, moments, _ = _state(model, optimizer)
    dcp.load(tensors | moments, storage_reader=HuggingFaceStorageReader(os.fspath(folder / "dcp")))
    state: dict[str, dict] = {}
    for key, t in moments.items():
        name, moment = key.removeprefix("optim.").rsplit(".", 1)
        state.setdefault(name, {})[moment] = t
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in param_groups]
    weights = {k.removeprefix("model."): t for k, t in tensors.items()}
    set_state_dict(
        model,
        optimizer,
        model_state_dict=weights,
        optim_state_dict={"state": state, "param_groups": groups},
        options=_OPTIONS,
    )


@dataclasses.dataclass
class ModelCard:
    """What a trained model's README.md says about how it was made."""

    base_model: str
    method: str  # the objective and its paper, e.g. "GRPO with the CLUE reward (CLUE, section 3)"
    data_files: list[str]
    config: object  # the run's resolved config (secrets removed when written)
    metrics_file: Path  # the run's metrics.jsonl: each key's last logged value, the final metrics
    sft_adapter: str | None = None  # the adapter merged into the base before training
    trained: list[str] = dataclasses.field(default_factory=list)  # what the run trained, lines

    def text(self) -> str:
        final = {}  # a training step's record and a selection's hold different keys
        for record in read_metrics(self.metrics_file) if self.metrics_file.is_file() else []:
            final |= record
        data = "\n".join(f"- `{f}`: sha256 `{file_sha256(f)}`" for f in self.data_files)
        numbers = "\n".join(
            f"| {k} | {v:.6g} |" for k, v in final.items() if isinstance(v, (int, float))
        )
        stands_on = (
            f"- stands on: the SFT adapter `{self.sft_adapter}`, merged into the base first\n"
            if self.sft_adapter
            else ""
        )
        trained = "".join(f"- {line}\n" for line in self.trained)
        return (
            f"# Model card\n\n- base model: `{self.base_model}`\n{stands_on}"
            f"- method: {self.method}\n\n"
            + (f"## What was trained\n\n{trained}\n" if trained else "")
            + f"## Data\n\n{data}\n\n## Final metrics (metrics.jsonl, each key's last value)\n\n"
            f"| metric | value |\n|---|---|\n{numbers}\n\n"
            f"## Resolved config\n\n```yaml\n{resolved_config_text(self.config)}```\n"
        )


LINEAGE = "lineage.json"  # beside a LoRA adapter: the base and the SFT adapter it was trained on


def read_lineage(folder) -> dict | None:
    """{"base", "sft_adapter"} (absolute paths; sft_adapter None when none was merged) of an adapter
    a run of ours wrote, or None for an adapter without the record (PEFT's, an SFT run's)."""
    path = Path(folder) / LINEAGE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError):
        record = None
    if not (isinstance(record, dict) and set(record) == {"base", "sft_adapter"}):
        raise CheckpointError(f"{path}: not a lineage record {{base, sft_adapter}}")
    for key, value in record.items():
        if not ((isinstance(value, str) and value) or (key == "sft_adapter" and value is None)):
            expected = "a path" + (" or null" if key == "sft_adapter" else "")
            raise CheckpointError(
                f"{path}: field '{key}': expects {expected}, got {excerpt(value)}"
            )
    return record


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_model(
    model: Qwen,
    tok,
    folder,
    ranks: Ranks,
    base_model_name_or_path: str | None = None,
    with_tokenizer: bool = False,
    card: ModelCard | None = None,
    lineage: dict | None = None,
    trained_only: bool = False,
) -> None:
    """The trained model in `folder`, replaced whole (every rank calls it): a LoRA run's adapter and
    token rows (model.save_adapter, by rank 0; `with_tokenizer`: the tokenizer beside them), or a
    full-parameter run's whole Hugging Face checkpoint (export_full; `trained_only`: only the
    weights training changes, export_trained). Built in `staging_folder`, swapped in by
    `publish_folder`; with `card`, its README.md beside them; with `lineage` (a LoRA run's {"base",
    "sft_adapter"}), LINEAGE beside the adapter."""
    tmp = staging_folder(folder, clear=ranks.main)
    barrier()
    if is_sharded(model):
        (export_trained if trained_only else export_full)(model, tok, tmp)
    elif ranks.main:
        save_adapter(model, tmp, base_model_name_or_path)
        if lineage is not None:
            (tmp / LINEAGE).write_text(json.dumps(lineage, indent=2) + "\n", encoding="utf-8")
        if with_tokenizer:
            tok.save(tmp)
    if ranks.main:
        if card is not None:
            (tmp / "README.md").write_text(card.text(), encoding="utf-8")
        publish_folder(tmp, folder)


def save_final(
    model: Qwen,
    tok,
    folder,
    ranks: Ranks,
    card: ModelCard,
    merged=None,
    lineage: bool = False,
    with_tokenizer: bool = False,
    saved: bool = False,
) -> None:
    """A run's finished model (every rank calls it): `folder` replaced whole by save_model, with
    `card` as its README.md and, for a LoRA adapter, the base PEFT loads it on (the card's, unless
    an SFT adapter was merged into it first: that base is not on disk); `lineage`: the base and the
    SFT adapter beside it (LINEAGE); `with_tokenizer`: the tokenizer too; `saved`: `folder` holds
    the run's model already (an SFT run's best checkpoint). With `merged` a folder, rank 0 then
    writes there the full checkpoint with `folder`'s adapter folded in (model.save_merged)."""
    if not saved:
        record = {
            "base": str(Path(card.base_model).resolve()),
            "sft_adapter": card.sft_adapter and str(Path(card.sft_adapter).resolve()),
        }
        save_model(
            model,
            tok,
            folder,
            ranks,
            base_model_name_or_path=None if card.sft_adapter else card.base_model,
            with_tokenizer=with_tokenizer,
            card=card,
            lineage=record if lineage else None,
        )
    if merged is not None and ranks.main:
        with atomic_folder(merged) as tmp:
            save_merged(load_adapter(model, folder), tok, tmp)


def trim_log(path, last_step: int, ranks: Ranks) -> None:
    """On rank 0, drop a JSONL log's records of steps after `last_step` (a resumed run logs them
    again; a fresh run keeps none) and a last line torn by a kill. Lines end at "\n" only: a
    record's text may hold U+2028 or U+0085, line breaks to str.splitlines."""
    path = Path(path)
    if not ranks.main or not path.is_file():
        return
    # after the last "\n": nothing, or a torn line
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line) if line.strip() else {"step": 0}
            step = record["step"]
        except (ValueError, TypeError, KeyError):
            step = None
        if not isinstance(step, int):
            raise CheckpointError(
                f"{path}:{number}: not a record of a run's log (a JSON object with an integer "
                f"'step'): move the file away, or choose another output_dir"
            )
        if line.strip() and step <= last_step:
            kept.append(line + "\n")
    atomic_write_text(path, "".join(kept))
