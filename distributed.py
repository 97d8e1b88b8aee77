"""The run's processes: this process's place among them from torchrun's environment (`Ranks`), and
the few collectives the trainers use (sums, JSON gathered from every rank, rank 0's values
broadcast). A plain `python` run is rank 0 of 1 and every collective a no-op."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@dataclass
class Ranks:
    """This process's place in the run: rank, world size and its one device."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str | None = None) -> Ranks:
    """Read RANK, WORLD_SIZE and LOCAL_RANK (set by torchrun; a plain run is rank 0 of 1), pick
    this rank's device (`cuda:LOCAL_RANK` when CUDA is available, else the CPU, or `device`) and,
    with several ranks, join the process group: nccl on GPUs, gloo on the CPU."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device or (f"cuda:{local}" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None
        )
    return Ranks(rank, world, dev)


def is_distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over the ranks in place (a no-op in a single process); returns it."""
    if is_distributed():
        dist.all_reduce(tensor)
    return tensor


def gather_json(value, ranks: Ranks) -> list:
    """Every rank's JSON-able `value`, in rank order, on every rank (the bytes travel through sums,
    one rank's row each; nothing is unpickled)."""
    if ranks.world_size == 1:
        return [value]
    raw = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=ranks.device)
    sizes = torch.zeros(ranks.world_size, dtype=torch.long, device=ranks.device)
    sizes[ranks.rank] = raw.numel()
    all_reduce_sum(sizes)
    table = torch.zeros(ranks.world_size, int(sizes.max()), dtype=torch.uint8, device=ranks.device)
    table[ranks.rank, : raw.numel()] = raw
    all_reduce_sum(table)
    return [json.loads(bytes(row[:n].tolist())) for row, n in zip(table.cpu(), sizes.tolist())]


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def broadcast_parameters(params: list[torch.nn.Parameter]) -> None:
    """Give every rank rank 0's values (the random LoRA init), so the replicas start equal (sharded
    parameters of a full-parameter run are left alone: each rank holds its own shard)."""
    if is_distributed():
        for p in params:
            if not isinstance(p, DTensor):
                dist.broadcast(p.data, 0)
