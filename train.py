"""What the two trainers share, and nothing else: process setup from torchrun's environment, the
gradient all-reduce of the trainable parameters, AdamW parameter groups, the learning-rate
schedules, gradient clipping, atomic checkpoints with exact resume (the run's logs trimmed to match), a clean stop on
Ctrl-C / SIGTERM, and the rank-0 progress line. Also the FSDP2 machinery of full-parameter runs,
described at the end of this docstring.

A checkpoint is a folder `ckpt-<step>` inside the run's output_dir, written under a temporary name
and renamed when complete (a folder named `ckpt-*` is always whole):

    adapter_config.json, adapter_model.safetensors   model.save_adapter (LoRA and token rows, PEFT format)   (LoRA)
    optimizer.safetensors     AdamW state, one tensor per `<parameter index>.<name>`     (LoRA)
    dcp/                      every rank's shards of the weights and AdamW state          (full: save_sharded)
    rng-rank<r>.safetensors   rank r's torch (and CUDA) generator state; its Python state as metadata
    state.json                step, world size, finetune mode, optimizer hyperparameters, the trainer's own state

Only safetensors and JSON are written or read: nothing is unpickled on resume.

Full-parameter runs (`finetune: full`) on PyTorch's FSDP2: how the model is sharded, how its gradients are
clipped, how a rollout decodes from it, how its state goes to and comes back from a sharded checkpoint, and how the
result leaves as one Hugging Face checkpoint.

The sharded model (`shard_model`), on a 1-D device mesh of every rank (any number of nodes):
- each decoder layer, and the final norm, is one `fully_shard` unit; the root (the whole Qwen) is one more, owning
  no parameter: it ties the units into one FSDP state (one lazy initialization, one end-of-backward callback);
- master weights are float32, sharded along dim 0, and so are their gradients and AdamW's moments; a unit all-gathers
  its weights in the checkpoint dtype for forward and backward (`MixedPrecisionPolicy(param_dtype=<checkpoint dtype>,
  reduce_dtype=float32)`), and its gradients are reduce-scattered in float32 as a sum (divide factor 1): the trainers
  normalize every loss by counts over the whole update on all ranks, as in LoRA mode;
- the input embedding and the lm_head are frozen (CLUE A.2) and stay whole on every rank in the checkpoint dtype
  (`ignored_params` of the root): token_logprobs, HeadLogprobs and generate read the head outside any module forward,
  and tied embeddings are one tensor. Trainable token rows (SFT's `<evidence>` rows) are replicated too, their
  gradients summed by sync_gradients;
- model.py calls the layers and the norm as modules (their FSDP hooks run) but enters through `hidden_states`, not
  the root's forward, so `shard_model` runs one tiny forward through the root to make it the FSDP root.
Qwen3.5's A_log and dt_bias, kept in float32 by model.py, are computed in the checkpoint dtype here (one
param_dtype per unit); their master copies stay float32.

Every rank must run the same sequence of forwards and backwards (each unit's all-gather is a collective): the
trainers give every rank the same number of micro-batches, padding with ones that weigh 0 (`pad_batches`).

A full run's checkpoint (`save_sharded` / `load_sharded`, inside the atomic ckpt-<step> above): `dcp/`, written by
torch.distributed.checkpoint through its safetensors storage (every rank its own file of shards, each tensor's
offsets in the file's JSON header: no pickle is written or read), holding `model.<name>` for every trainable
parameter and `optim.<name>.<moment>` for AdamW's state; the optimizer's hyperparameters go to state.json.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from config import ConfigError, atomic_write_text, print0
from model import (CheckpointError, Qwen, atomic_write, load_adapter, lora_modules, save_adapter, save_merged,
                   train_token_rows)

# ----------------------------------------------------------------------------- processes


@dataclass
class Dist:
    """This process's place in the run: rank, world size and its one device."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str | None = None) -> Dist:
    """Read RANK, WORLD_SIZE and LOCAL_RANK (set by torchrun; a plain run is rank 0 of 1), pick
    this rank's device (`cuda:LOCAL_RANK` when CUDA is available, else the CPU, or `device`) and,
    with several ranks, join the process group: nccl on GPUs, gloo on the CPU."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device or (f"cuda:{local}" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None)
    return Dist(rank, world, dev)


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over the ranks in place (a no-op in a single process); returns it."""
    if _distributed():
        dist.all_reduce(tensor)
    return tensor


def gather_json(value, ranks: Dist) -> list:
    """Every rank's JSON-able `value`, in rank order, on every rank (the bytes travel through sums,
    one rank's row each; nothing is unpickled)."""
    if ranks.world_size == 1:
        return [value]
    raw = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=ranks.device)
    sizes = torch.zeros(ranks.world_size, dtype=torch.long, device=ranks.device)
    sizes[ranks.rank] = raw.numel()
    all_reduce_sum(sizes)
    table = torch.zeros(ranks.world_size, int(sizes.max()), dtype=torch.uint8, device=ranks.device)
    table[ranks.rank, :raw.numel()] = raw
    all_reduce_sum(table)
    return [json.loads(bytes(row[:n].tolist())) for row, n in zip(table.cpu(), sizes.tolist())]


def barrier() -> None:
    if _distributed():
        dist.barrier()


def broadcast_parameters(params: list[torch.nn.Parameter]) -> None:
    """Give every rank rank 0's values (the random LoRA init), so the replicas start equal (sharded parameters of a
    full-parameter run are left alone: each rank holds its own shard)."""
    if _distributed():
        for p in params:
            if not isinstance(p, DTensor):
                dist.broadcast(p.data, 0)


def sync_gradients(params: list[torch.nn.Parameter]) -> None:
    """Sum the gradients of the trainable parameters over the ranks, in one flat all-reduce. The
    trainers normalize each loss by counts taken over the whole update on all ranks, so the sum is
    the gradient of the global loss. The frozen base never has gradients and is never sent; sharded parameters (a
    full-parameter run) had theirs reduce-scattered by FSDP in backward."""
    params = [p for p in params if not isinstance(p, DTensor)]
    if not _distributed() or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


# ----------------------------------------------------------------------------- optimizer and schedules


def trainable_groups(model: Qwen) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(LoRA factors, trainable token rows) of the model, in a fixed order; without LoRA (a full-parameter run) every
    trainable parameter but the rows takes the LoRA factors' place."""
    rows = [] if model.embed_rows is None else [model.embed_rows]
    if model.head_rows is not None and model.head_rows is not model.embed_rows:
        rows.append(model.head_rows)
    rows = [p for p in rows if p.requires_grad]
    if not lora_modules(model):
        return [p for p in model.parameters() if p.requires_grad and all(p is not r for r in rows)], rows
    return [p for m in lora_modules(model).values() for p in (m.lora_A, m.lora_B) if p.requires_grad], rows


def build_optimizer(model: Qwen, lr: float, weight_decay: float, betas: tuple[float, float],
                    row_lr_scale: float = 1.0) -> torch.optim.AdamW:
    """AdamW over the trainable parameters: the LoRA factors at `lr` with weight decay, the token
    rows (the `<evidence>` rows in SFT) at `row_lr_scale` x `lr` without it. Each group keeps its
    `lr_scale`, which `set_lr` applies."""
    lora, rows = trainable_groups(model)
    groups = [{"params": lora, "weight_decay": weight_decay, "lr_scale": 1.0}]
    if rows:
        groups.append({"params": rows, "weight_decay": 0.0, "lr_scale": row_lr_scale})
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), weight_decay=weight_decay)


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm of `params` to `max_norm` X
    sharded gradients); returns the norm before clipping."""
    if any(isinstance(p, DTensor) for p in params):
        return _clip_sharded(params, max_norm)
    return torch.nn.utils.clip_grad_norm_(params, max_norm).item()


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"]


def linear_warmup_decay(step: int, total_steps: int, peak: float, warmup_fraction: float = 0.01,
                        warmup_steps: int | None = None) -> float:
    """The SFT schedule (CLUE A.1): the LR of optimizer step `step` (0-based) rises linearly to
    `peak` over the first `warmup_fraction` of the steps, or the first `warmup_steps` when given
    (at least one), reaching it at the last warm-up step, then decays linearly, reaching 0 at step
    `total_steps`."""
    warmup = max(1, math.ceil(warmup_fraction * total_steps) if warmup_steps is None else warmup_steps)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * max(0.0, (total_steps - step) / max(1, total_steps - warmup))


def warmup_hold_cosine(update: int, peak: float, floor: float, warmup: int, hold_until: int, total: int) -> float:
    """The RL schedule (CLUE A.2) at `update`, counted from 1 as the paper counts (1..total): update 1
    runs at `floor`, and the rate rises linearly over `warmup` updates to `peak` at update warmup + 1
    (warmup = 0: update 1 runs at the peak); it holds through update `hold_until`, then a cosine takes it
    back to `floor` at update `total`, the last one that runs (507 is the first below the peak)."""
    if update <= warmup:
        return floor + (peak - floor) * (update - 1) / warmup
    if update <= hold_until:
        return peak
    progress = min(1.0, (update - hold_until) / max(1, total - hold_until))
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- full-parameter runs (FSDP2)

ROWS = ("row_ids", "embed_rows", "head_rows")


def device_mesh(device: torch.device) -> DeviceMesh:
    """The 1-D mesh of all ranks. A plain (non-torchrun) run joins a process group of its own first, so one process
    trains through the same sharded code as many."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("shard",))


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def units(model: Qwen) -> list[FSDPModule]:
    """The FSDP units of a sharded model: the layers, the final norm, then the root."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)][::-1]


def frozen_whole(model: Qwen) -> set[torch.nn.Parameter]:
    """Parameters every rank keeps whole: the frozen embedding and lm_head, and the trainable token rows."""
    found = [model.model.embed_tokens.weight, model.head_weight(), model.embed_rows, model.head_rows]
    return {p for p in found if p is not None}


def shard_model(model: Qwen, device: torch.device, like: Qwen | None = None) -> Qwen:
    """Shard `model` (loaded in its checkpoint dtype, token rows already added) as the module docstring says, in
    place; returns it. With `like` (GRPO's reference of the sharded policy `like`, equal to it at the start): every
    weight frozen in the checkpoint dtype, the embedding and lm_head those of `like` (one copy on a rank, not two)."""
    compute, trainable = model.dtype, like is None
    if like is not None:
        model.model.embed_tokens.weight = like.model.embed_tokens.weight
        if model.lm_head is not None:
            model.lm_head.weight = like.lm_head.weight
    whole = frozen_whole(model)
    model.model.embed_tokens.weight.requires_grad_(False)
    model.head_weight().requires_grad_(False)
    model.source_dtypes = {n: p.dtype for n, p in model.named_parameters() if p not in whole}
    mesh = device_mesh(device)
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for module in [*model.model.layers, model.model.norm]:
        if trainable:
            module.float()
        module.requires_grad_(trainable)
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=whole)
    for unit in units(model):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    with torch.no_grad():
        model(torch.zeros((1, 1), dtype=torch.long, device=device))  # the root's forward makes it the FSDP root
    return model


def pad_batches(model: Qwen, batches: list, idle) -> list:
    """For a sharded `model`, `batches` plus as many `idle` micro-batches (tensors that weigh nothing in the loss) as
    the busiest rank has more: every rank must run the same forwards and backwards. Else `batches` unchanged."""
    if not is_sharded(model):
        return batches
    count = torch.tensor([len(batches)], device=model.device)
    if dist.get_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return batches + [idle] * (int(count.item()) - len(batches))


@contextlib.contextmanager
def gathered(model: Qwen):
    """Every unit's weights all-gathered once (in the compute dtype) and kept through the block, so decoding runs no
    collective per token; resharded on exit, before training. A no-op for an unsharded model."""
    if not is_sharded(model):
        yield model
        return
    for unit in units(model):
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units(model):
            unit.reshard()
            unit.set_reshard_after_forward(unit is not model, recurse=False)


class CollectiveCounter:
    """Counts the collectives this process issues while active (torch.distributed's functions wrapped): the
    measure behind "a rollout under `gathered` runs none" (tests, bench/bench_fsdp.py)."""

    NAMES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
             "all_gather", "all_reduce", "reduce_scatter", "broadcast", "all_to_all", "barrier")

    def __init__(self):
        self.count, self._saved = 0, {}

    def __enter__(self):
        for name in self.NAMES:
            if hasattr(dist, name):
                self._saved[name] = original = getattr(dist, name)
                setattr(dist, name, self._counted(original))
        return self

    def _counted(self, original):
        def call(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)
        return call

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)


def _clip_sharded(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Scale the gradients of `params` so their global L2 norm is at most `max_norm` (as clip_grad_norm_, whose
    coefficient this is); returns the norm before clipping. Sharded gradients (DTensors) count every shard once,
    replicated ones once."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    local = [g for g in grads if not isinstance(g, DTensor)]
    total = torch.zeros((), dtype=torch.float32, device=(sharded or local)[0].device)
    if sharded:
        total += torch.nn.utils.get_total_norm(sharded).full_tensor().float() ** 2
    if local:
        total += torch.nn.utils.get_total_norm(local).float() ** 2
    norm = total.sqrt().item()
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


_OPTIONS = StateDictOptions(strict=False)


def _state(model: Qwen, optimizer: torch.optim.Optimizer) -> tuple[dict, dict, list]:
    """(trainable model tensors, AdamW tensors, param_groups with parameter names) through get_state_dict."""
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    tensors = {f"model.{n}": t for n, t in model_state.items() if n in trainable}
    moments = {f"optim.{n}.{k}": t for n, s in optim_state["state"].items() for k, t in s.items()}
    return tensors, moments, optim_state["param_groups"]


def save_sharded(folder, model: Qwen, optimizer: torch.optim.Optimizer) -> list[dict]:
    """Every rank writes its shards of the trainable weights and of AdamW's state to folder/dcp (a collective);
    returns the param_groups (JSON-able) for state.json."""
    tensors, moments, groups = _state(model, optimizer)
    writer = HuggingFaceStorageWriter(os.fspath(folder / "dcp"), save_distributed=True)
    dcp.save(tensors | moments, storage_writer=writer)
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]


def load_sharded(folder, model: Qwen, optimizer: torch.optim.Optimizer, param_groups: list[dict]) -> None:
    """Load what `save_sharded` wrote into `model` and `optimizer` (a collective). The shards may have been written
    by another number of ranks: DCP reads each tensor's pieces by offset."""
    tensors, moments, _ = _state(model, optimizer)  # AdamW's state initialized at zero, filled below
    dcp.load(tensors | moments, storage_reader=HuggingFaceStorageReader(os.fspath(folder / "dcp")))
    state: dict[str, dict] = {}
    for key, t in moments.items():
        name, moment = key.removeprefix("optim.").rsplit(".", 1)
        state.setdefault(name, {})[moment] = t
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in param_groups]
    weights = {k.removeprefix("model."): t for k, t in tensors.items()}
    set_state_dict(model, optimizer, model_state_dict=weights,
                   optim_state_dict={"state": state, "param_groups": groups}, options=_OPTIONS)


def export_full(model: Qwen, tok, out_dir) -> None:
    """Write a sharded model as one Hugging Face checkpoint (model.save_merged's format: safetensors shards + index,
    config, tokenizer; trainable token rows folded in) in the dtypes it was loaded with. A collective: the tensors are
    gathered one at a time; rank 0 keeps each on the CPU (one full copy at most), the other ranks keep none."""
    main = dist.get_rank() == 0
    state, rows = {}, {}
    for name, t in model.state_dict().items():
        if t is None:
            continue
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if main:
            (rows if name in ROWS else state)[name] = full.detach().to("cpu", model.source_dtypes.get(name, full.dtype))
        del full
    if main:
        with torch.device("meta"):
            plain = Qwen(model.config)
        plain.load_state_dict(state, assign=True)
        plain.source = getattr(model, "source", None)
        if rows:
            train_token_rows(plain, rows["row_ids"].tolist())
            with torch.no_grad():
                plain.embed_rows.copy_(rows["embed_rows"])
                if plain.head_rows is not plain.embed_rows:
                    plain.head_rows.copy_(rows["head_rows"])
        save_merged(plain, tok, out_dir)
    dist.barrier()


def save_model(model: Qwen, tok, folder, ranks: Dist, base_model_name_or_path: str | None = None,
               with_tokenizer: bool = False) -> None:
    """The trained model in `folder`, replaced whole (every rank calls it): a LoRA run's adapter and token rows
    (model.save_adapter, by rank 0; `with_tokenizer`: the tokenizer beside them), or a full-parameter run's whole
    Hugging Face checkpoint (export_full). Built in `staging_folder`, swapped in by `publish_folder`."""
    tmp = staging_folder(folder, clear=ranks.main)
    barrier()
    if is_sharded(model):
        export_full(model, tok, tmp)
    elif ranks.main:
        save_adapter(model, tmp, base_model_name_or_path)
        if with_tokenizer:
            tok.save(tmp)
    if ranks.main:
        publish_folder(tmp, folder)


# ----------------------------------------------------------------------------- checkpoints

_CKPT = "ckpt-"


def checkpoint_path(output_dir, step: int) -> Path:
    return Path(output_dir) / f"{_CKPT}{step:06d}"


def latest_checkpoint(output_dir) -> Path | None:
    """The complete checkpoint with the highest step in `output_dir`, or None."""
    found = [p for p in Path(output_dir).glob(f"{_CKPT}*") if p.is_dir() and p.name[len(_CKPT):].isdigit()]
    return max(found, key=lambda p: int(p.name[len(_CKPT):]), default=None)


def _rng_file(folder: Path, rank: int) -> Path:
    return folder / f"rng-rank{rank}.safetensors"


def _save_rng(folder: Path, rank: int) -> None:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.cuda.get_rng_state()
    python = random.getstate()
    metadata = {"python": json.dumps([python[0], list(python[1]), python[2]])}
    atomic_write(_rng_file(folder, rank), tensors, metadata)


def _load_rng(folder: Path, rank: int) -> None:
    with safe_open(_rng_file(folder, rank), framework="pt") as f:
        torch.set_rng_state(f.get_tensor("torch"))
        if "cuda" in f.keys() and torch.cuda.is_available():
            torch.cuda.set_rng_state(f.get_tensor("cuda"))
        version, internal, gauss = json.loads(f.metadata()["python"])
    random.setstate((version, tuple(internal), gauss))


def staging_folder(final, clear: bool = True) -> Path:
    """Where the result folder `final` is built before `publish_folder` swaps it in: `.<name>.tmp` beside it,
    never inside it. `clear` empties it first (a killed run may have left one)."""
    staging = Path(final).with_name(f".{Path(final).name}.tmp")
    if clear:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    return staging


def publish_folder(staging: Path, final) -> None:
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)


@contextlib.contextmanager
def atomic_folder(final):
    """`with atomic_folder(out / "adapter") as tmp: save_adapter(model, tmp)`: the folder appears whole or never."""
    staging = staging_folder(final)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_folder(staging, final)


def save_checkpoint(output_dir, step: int, model: Qwen, optimizer: torch.optim.Optimizer, trainer_state: dict,
                    keep: int | None = None, write_extra=None) -> Path:
    """Write `ckpt-<step>` atomically; every rank must call it (each saves its own RNG state), rank 0
    writes the rest. `trainer_state` is the trainer's JSON-able state (its data position, counters);
    `write_extra(folder)`, on rank 0, adds the trainer's own weights (the reward model's value head).
    With `keep`, only the newest `keep` checkpoints are left. Returns the checkpoint's path."""
    final = checkpoint_path(output_dir, step)
    rank = dist.get_rank() if _distributed() else 0
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
            tensors = {f"{i}.{name}": t.detach().cpu().contiguous() for i, s in state["state"].items()
                       for name, t in s.items()}
            atomic_write(tmp / "optimizer.safetensors", tensors)
        if write_extra is not None:
            write_extra(tmp)
        meta = {"step": step, "world_size": dist.get_world_size() if _distributed() else 1,
                "finetune": "full" if full else "lora", "param_groups": groups or state["param_groups"],
                "trainer": trainer_state}
        atomic_write_text(tmp / "state.json", json.dumps(meta, indent=1) + "\n")
        publish_folder(tmp, final)
        if keep is not None:
            older = sorted(p for p in Path(output_dir).glob(f"{_CKPT}*") if p.is_dir() and p != final)
            for stale in older[:max(0, len(older) - (keep - 1))]:
                shutil.rmtree(stale, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(path, model: Qwen) -> dict:
    """Check that a checkpoint fits this run (the same number of ranks, the same `finetune` mode), load its adapter and
    token rows into `model` (LoRA: before the optimizer is built, the rows become new parameters) and this rank's RNG
    state. Returns its state.json; pass it to `restore_optimizer` once the optimizer exists (a full-parameter run's
    weights come back there, with the optimizer's state)."""
    path = Path(path)
    meta = json.loads((path / "state.json").read_text(encoding="utf-8"))
    world = dist.get_world_size() if _distributed() else 1
    mode, written = ("full" if is_sharded(model) else "lora"), meta.get("finetune", "lora")
    if written != mode:
        raise CheckpointError(f"{path / 'state.json'}: field 'finetune': the checkpoint is of a {written} run, this "
                              f"run is {mode}; resume it with finetune: {written} (or start afresh with resume: none)")
    if meta["world_size"] != world:
        raise CheckpointError(f"{path}: written by {meta['world_size']} rank(s), this run has {world}; exact resume "
                              f"needs the same number (or start afresh with resume=none)")
    if mode == "lora":
        load_adapter(model, path)
    _load_rng(path, dist.get_rank() if _distributed() else 0)
    return meta


def restore_optimizer(path, optimizer: torch.optim.Optimizer, meta: dict, model: Qwen | None = None) -> None:
    """Load AdamW's state and hyperparameters saved by `save_checkpoint` (and, for a sharded `model`, its weights)."""
    if model is not None and is_sharded(model):
        load_sharded(Path(path), model, optimizer, meta["param_groups"])
        return
    state: dict[int, dict[str, torch.Tensor]] = {}
    with safe_open(Path(path) / "optimizer.safetensors", framework="pt") as f:
        for key in f.keys():
            index, name = key.split(".", 1)
            state.setdefault(int(index), {})[name] = f.get_tensor(key)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def finetune_settings(finetune: str, lora, save_merged: bool, defaults):
    """A trainer config's `lora` section as the run uses it: `defaults` when a LoRA run leaves it out, None in a
    full-parameter run, which takes no LoRA-only key (a ConfigError naming the key, for config.py to place)."""
    if finetune == "lora":
        return defaults if lora is None else lora
    for key, given in (("lora", lora is not None), ("save_merged", save_merged)):
        if given:
            raise ConfigError(f"{key}: a LoRA-only setting, but finetune is full (remove it, or set finetune: lora)")
    return None


def trim_log(path, last_step: int, ranks: Dist) -> None:
    """On rank 0, drop a JSONL log's records of steps after `last_step` (a resumed run logs them again; a fresh run
    keeps none) and a last line torn by a kill. Lines end at "\n" only: a record's text may hold U+2028 or U+0085,
    line breaks to str.splitlines."""
    path = Path(path)
    if not ranks.main or not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]  # after the last "\n": nothing, or a torn line
    kept = [line + "\n" for line in lines if line.strip() and json.loads(line)["step"] <= last_step]
    atomic_write_text(path, "".join(kept))


# ----------------------------------------------------------------------------- stopping and progress


class StopRequest:
    """Ctrl-C or SIGTERM asks the run to stop instead of killing it: the trainer checks `requested()`
    after each step, saves a checkpoint and exits. A second Ctrl-C interrupts at once. Under
    torchrun the flag is agreed over all ranks, so they stop after the same step."""

    def __init__(self):
        self.flag = False
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.flag and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.flag = True
        print0(f"\n{signal.Signals(signum).name}: stopping after this step (a checkpoint will be saved)")

    def __enter__(self) -> StopRequest:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def requested(self, device: torch.device) -> bool:
        return bool(all_reduce_sum(torch.tensor([float(self.flag)], device=device)).item())


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Progress:
    """One console line per logged step on rank 0: step, the given values, tokens/s and the ETA."""

    def __init__(self, total_steps: int, first_step: int = 0):
        self.total, self.first, self.start = total_steps, first_step, time.perf_counter()
        self.tokens = 0

    def log(self, step: int, tokens: int, **values: float) -> dict:
        """Print the line for `step` (0-based, done), counting `tokens` processed since the last
        call; returns {"tokens_per_s": ..., "elapsed_s": ...} for the metrics."""
        self.tokens += tokens
        elapsed = time.perf_counter() - self.start
        done = step + 1 - self.first
        eta = elapsed / max(1, done) * (self.total - step - 1)
        shown = " | ".join(f"{k} {v:.4g}" for k, v in values.items())
        speed = self.tokens / max(elapsed, 1e-9)
        print0(f"step {step + 1}/{self.total} | {shown} | {speed:,.0f} tok/s | ETA {_duration(eta)}")
        return {"tokens_per_s": speed, "elapsed_s": elapsed}
