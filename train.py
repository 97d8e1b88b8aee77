"""What the two trainers share, and nothing else: process setup from torchrun's environment, the
gradient all-reduce of the trainable parameters, AdamW parameter groups, the learning-rate
schedules, atomic checkpoints with exact resume (the run's logs trimmed to match), a clean stop on
Ctrl-C / SIGTERM, and the rank-0 progress line.

A checkpoint is a folder `ckpt-<step>` inside the run's output_dir, written under a temporary name
and renamed when complete (a folder named `ckpt-*` is always whole):

    adapter_config.json, adapter_model.safetensors, token_rows.safetensors   model.save_adapter
    optimizer.safetensors     AdamW state, one tensor per `<parameter index>.<name>`
    rng-rank<r>.safetensors   rank r's torch (and CUDA) generator state; its Python state as metadata
    state.json                step, world size, optimizer hyperparameters, the trainer's own state

Only safetensors and JSON are written or read: nothing is unpickled on resume.
"""

from __future__ import annotations

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
from safetensors import safe_open
from safetensors.torch import save_file

from config import atomic_write_text, print0
from model import Qwen, load_adapter, lora_modules, save_adapter

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


def barrier() -> None:
    if _distributed():
        dist.barrier()


def broadcast_parameters(params: list[torch.nn.Parameter]) -> None:
    """Give every rank rank 0's values (the random LoRA init), so the replicas start equal."""
    if _distributed():
        for p in params:
            dist.broadcast(p.data, 0)


def sync_gradients(params: list[torch.nn.Parameter]) -> None:
    """Sum the gradients of the trainable parameters over the ranks, in one flat all-reduce. The
    trainers normalize each loss by counts taken over the whole update on all ranks, so the sum is
    the gradient of the global loss. The frozen base never has gradients and is never sent."""
    if not _distributed():
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
    """(LoRA factors, trainable token rows) of the model, in a fixed order."""
    lora = [p for m in lora_modules(model).values() for p in (m.lora_A, m.lora_B) if p.requires_grad]
    rows = [] if model.embed_rows is None else [model.embed_rows]
    if model.head_rows is not None and model.head_rows is not model.embed_rows:
        rows.append(model.head_rows)
    return lora, [p for p in rows if p.requires_grad]


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


def warmup_hold_cosine(step: int, peak: float, floor: float, warmup: int, hold_until: int, total: int) -> float:
    """The RL schedule (CLUE A.2): from `floor` at update 0 linearly to `peak` at update `warmup`,
    constant through update `hold_until`, then a cosine back to `floor` at update `total`."""
    if step < warmup:
        return floor + (peak - floor) * step / warmup
    if step <= hold_until:
        return peak
    progress = min(1.0, (step - hold_until) / max(1, total - hold_until))
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


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
    save_file(tensors, str(_rng_file(folder, rank)), metadata=metadata)


def _load_rng(folder: Path, rank: int) -> None:
    with safe_open(_rng_file(folder, rank), framework="pt") as f:
        torch.set_rng_state(f.get_tensor("torch"))
        if "cuda" in f.keys() and torch.cuda.is_available():
            torch.cuda.set_rng_state(f.get_tensor("cuda"))
        version, internal, gauss = json.loads(f.metadata()["python"])
    random.setstate((version, tuple(internal), gauss))


def save_checkpoint(output_dir, step: int, model: Qwen, optimizer: torch.optim.Optimizer, trainer_state: dict,
                    keep: int | None = None) -> Path:
    """Write `ckpt-<step>` atomically; every rank must call it (each saves its own RNG state), rank 0
    writes the rest. `trainer_state` is the trainer's JSON-able state (its data position, counters).
    With `keep`, only the newest `keep` checkpoints are left. Returns the checkpoint's path."""
    final = checkpoint_path(output_dir, step)
    tmp = final.with_name(f".{final.name}.tmp")
    rank = dist.get_rank() if _distributed() else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    _save_rng(tmp, rank)
    barrier()
    if rank == 0:
        save_adapter(model, tmp)
        state = optimizer.state_dict()
        tensors = {f"{i}.{name}": t.detach().cpu().contiguous() for i, s in state["state"].items()
                   for name, t in s.items()}
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        meta = {"step": step, "world_size": dist.get_world_size() if _distributed() else 1,
                "param_groups": state["param_groups"], "trainer": trainer_state}
        atomic_write_text(tmp / "state.json", json.dumps(meta, indent=1) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if keep is not None:
            older = sorted(p for p in Path(output_dir).glob(f"{_CKPT}*") if p.is_dir() and p != final)
            for stale in older[:max(0, len(older) - (keep - 1))]:
                shutil.rmtree(stale, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(path, model: Qwen) -> dict:
    """Load a checkpoint's adapter and token rows into `model` (before the optimizer is built: the
    rows become new parameters) and this rank's RNG state. Returns its state.json; pass it to
    `restore_optimizer` once the optimizer exists."""
    path = Path(path)
    meta = json.loads((path / "state.json").read_text(encoding="utf-8"))
    world = dist.get_world_size() if _distributed() else 1
    if meta["world_size"] != world:
        raise ValueError(f"{path}: written by {meta['world_size']} rank(s), this run has {world}; exact resume "
                         f"needs the same number (or start afresh with resume=none)")
    load_adapter(model, path)
    _load_rng(path, dist.get_rank() if _distributed() else 0)
    return meta


def restore_optimizer(path, optimizer: torch.optim.Optimizer, meta: dict) -> None:
    """Load AdamW's state and hyperparameters saved by `save_checkpoint`."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    with safe_open(Path(path) / "optimizer.safetensors", framework="pt") as f:
        for key in f.keys():
            index, name = key.split(".", 1)
            state.setdefault(int(index), {})[name] = f.get_tensor(key)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


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
