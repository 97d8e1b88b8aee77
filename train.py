"""What the trainers share, and nothing else: AdamW parameter groups, the learning-rate schedules,
the split of packed micro-batches, the gradient all-reduce and clipping, the LoRA settings, a clean
stop on Ctrl-C / SIGTERM, and the rank-0 progress line. The processes and their collectives are
distributed.py's, sharding fsdp.py's, checkpoints checkpoint.py's."""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from config import ConfigError, bounded, print0
from distributed import all_reduce_sum, is_distributed
from fsdp import clip_sharded
from model import LORA_TARGETS, Qwen, lora_modules

# -------------------------------------------------------------------------- optimizer and schedules


def trainable_groups(model: Qwen) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(LoRA factors, trainable token rows) of the model, in a fixed order; without LoRA (a
    full-parameter run) every trainable parameter but the rows takes the LoRA factors' place."""
    rows = [] if model.embed_rows is None else [model.embed_rows]
    if model.head_rows is not None and model.head_rows is not model.embed_rows:
        rows.append(model.head_rows)
    rows = [p for p in rows if p.requires_grad]
    if not lora_modules(model):
        return [
            p for p in model.parameters() if p.requires_grad and all(p is not r for r in rows)
        ], rows
    return [
        p for m in lora_modules(model).values() for p in (m.lora_A, m.lora_B) if p.requires_grad
    ], rows


def build_optimizer(
    model: Qwen,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    row_lr_scale: float = 1.0,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters: the LoRA factors at `lr` with weight decay, the token
    rows (the `<evidence>` rows in SFT) at `row_lr_scale` x `lr` without it. Each group keeps its
    `lr_scale`, which `set_lr` applies. On CUDA the step is torch's fused kernel (one launch per
    group, DTensor shards included); elsewhere torch's default."""
    lora, rows = trainable_groups(model)
    groups = [{"params": lora, "weight_decay": weight_decay, "lr_scale": 1.0}]
    if rows:
        groups.append({"params": rows, "weight_decay": 0.0, "lr_scale": row_lr_scale})
    on_cuda = all(p.device.type == "cuda" for p in [*lora, *rows])
    return torch.optim.AdamW(
        groups, lr=lr, betas=tuple(betas), weight_decay=weight_decay, fused=on_cuda or None
    )


def sync_gradients(params: list[torch.nn.Parameter]) -> None:
    """Sum the gradients of the trainable parameters over the ranks, in one flat all-reduce. The
    trainers normalize each loss by counts taken over the whole update on all ranks, so the sum is
    the gradient of the global loss. The frozen base never has gradients and is never sent; sharded
    parameters (a full-parameter run) had theirs reduce-scattered by FSDP in backward."""
    params = [p for p in params if not isinstance(p, DTensor)]
    if not is_distributed() or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm of `params` to `max_norm` (fsdp.clip_sharded for sharded
    gradients); returns the norm before clipping."""
    if any(isinstance(p, DTensor) for p in params):
        return clip_sharded(params, max_norm)
    return torch.nn.utils.clip_grad_norm_(params, max_norm).item()


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def token_budget_parts(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of sequences of `lengths` split into packed micro-batches of at most `max_tokens`
    tokens (verl's dynamic batch size): longest first, each part taking the next ones while they
    fit, a sequence longer than the budget alone. Consecutive in that order, a part holds similar
    lengths (Qwen3.5's recurrence pads them when no flash-linear-attention kernel runs it:
    model.delta_rule_packed)."""
    parts: list[list[int]] = []
    size = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if parts and size + lengths[i] <= max_tokens:
            parts[-1].append(i)
            size += lengths[i]
        else:
            parts.append([i])
            size = lengths[i]
    return parts


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"]


def linear_warmup_decay(
    step: int,
    total_steps: int,
    peak: float,
    warmup_fraction: float = 0.01,
    warmup_steps: int | None = None,
) -> float:
    """The SFT schedule (CLUE A.1): the LR of optimizer step `step` (0-based) rises linearly to
    `peak` over the first `warmup_fraction` of the steps, or the first `warmup_steps` when given
    (at least one), reaching it at the last warm-up step, then decays linearly, reaching 0 at step
    `total_steps`."""
    warmup = max(
        1, math.ceil(warmup_fraction * total_steps) if warmup_steps is None else warmup_steps
    )
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * max(0.0, (total_steps - step) / max(1, total_steps - warmup))


@dataclass
class LoraSettings:  # not in the papers: the common r 16 / alpha 32 on every projection
    rank: int = bounded(16, ge=1)
    alpha: int = bounded(32, gt=0)
    dropout: float = bounded(0.0, ge=0, le=0.99)
    targets: tuple[str, ...] = LORA_TARGETS
    # the side path's precision: float32 (PEFT's), or the model dtype in one fused product
    # (model.Linear), the float32 factors staying what AdamW trains
    compute: Literal["float32", "model"] = "float32"


def check_compile(key: str, finetune: str, micro_batch_tokens: int | None) -> None:
    """A trainer config's `compile` (model.Qwen.compile_layers) where it does what it says: a
    ConfigError naming `key`, for config.py to place, in a full-parameter run (a sharded layer's
    FSDP hooks would not run in its compiled forward) or with packed batches (each micro-batch's
    lengths would compile anew)."""
    for problem, present in (
        ("a LoRA-only setting, but finetune is full", finetune == "full"),
        ("not with packed batches (micro_batch_tokens)", micro_batch_tokens is not None),
    ):
        if present:
            raise ConfigError(f"{key}: {problem} (remove it)")


def finetune_settings(finetune: str, lora, save_merged: bool, defaults):
    """A trainer config's `lora` section as the run uses it: `defaults` when a LoRA run leaves it
    out, None in a full-parameter run, which takes no LoRA-only key (a ConfigError naming the key,
    for config.py to place)."""
    if finetune == "lora":
        return defaults if lora is None else lora
    for key, given in (("lora", lora is not None), ("save_merged", save_merged)):
        if given:
            raise ConfigError(
                f"{key}: a LoRA-only setting, but finetune is full (remove it, or set finetune: "
                f"lora)"
            )
    return None


# ---------------------------------------------------------------------------- stopping and progress


class StopRequest:
    """Ctrl-C or SIGTERM asks the run to stop instead of killing it: the trainer checks
    `requested()` after each step, saves a checkpoint and exits. A second Ctrl-C interrupts at once.
    Under torchrun the flag is agreed over all ranks, so they stop after the same step."""

    def __init__(self):
        self.flag = False
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.flag and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.flag = True
        print0(
            f"\n{signal.Signals(signum).name}: stopping after this step (a checkpoint will be "
            f"saved)"
        )

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
    """One console line per logged step on rank 0: step, the given values, tokens/s and the ETA.
    The ETA counts from the end of the first logged step, whose time (the first batch's warm-up,
    a compile) says little about the rest."""

    def __init__(self, total_steps: int, first_step: int = 0):
        self.total, self.first, self.start = total_steps, first_step, time.perf_counter()
        self.tokens = 0
        self.warm: tuple[int, float] | None = None  # (steps done, elapsed) at the first line

    def log(self, step: int, tokens: int, **values: float) -> dict:
        """Print the line for `step` (0-based, done), counting `tokens` processed since the last
        call; returns {"tokens_per_s": ..., "elapsed_s": ...} for the metrics."""
        self.tokens += tokens
        elapsed = time.perf_counter() - self.start
        done = step + 1 - self.first
        since_done, since_elapsed = self.warm or (0, 0.0)
        per_step = (elapsed - since_elapsed) / max(1, done - since_done)
        self.warm = self.warm or (done, elapsed)
        eta = per_step * (self.total - step - 1)
        shown = " | ".join(f"{k} {v:.4g}" for k, v in values.items())
        speed = self.tokens / max(elapsed, 1e-9)
        print0(
            f"step {step + 1}/{self.total} | {shown} | {speed:,.0f} tok/s | ETA {_duration(eta)}"
        )
        return {"tokens_per_s": speed, "elapsed_s": elapsed}
