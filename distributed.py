"""The run's processes: this process's place among them from torchrun's environment (`Ranks`), and
the few collectives the trainers use (sums, JSON gathered from every rank, rank 0's values
broadcast). A plain `python` run is rank 0 of 1 and every collective a no-op.

Importing it checks the torch version first (`require_torch`): the trainers import it before
anything that needs a newer torch, so an older one ends in one line."""

from __future__ import annotations

import atexit
import json
import os
import secrets
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from config import ConfigError, bounded, excerpt, print0

# the oldest torch with every API the trainers use: HuggingFaceStorageWriter's save_distributed
# (checkpoint.save_sharded) is the newest of them (docs/fsdp.md#the-torch-minimum)
TORCH_MINIMUM = (2, 9)


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as "2.13.0+cpu" or "2.9.0a0+git1234"."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def require_torch() -> None:
    """Exit with one line (status 2) on a torch older than TORCH_MINIMUM."""
    if torch_release(torch.__version__) < TORCH_MINIMUM:
        need = ".".join(map(str, TORCH_MINIMUM))
        print(
            f"error: torch {torch.__version__} is older than {need}, the oldest this project runs "
            f"on (pip install 'torch>={need}')",
            file=sys.stderr,
        )
        raise SystemExit(2)


require_torch()

import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

# a CPU rank's most threads: above any one machine's cores (torch takes up to 2**31 - 1, then
# starts that many)
MAX_CPU_THREADS = 1024


@dataclass
class DistributedSettings:
    """The process group's settings (the `distributed` section of every trainer's config)."""

    # how long a collective waits for the slowest rank before the run is aborted: long enough for
    # one update's rollouts, judge calls and resampling on the slowest rank, and for a checkpoint
    timeout_s: float = bounded(3600.0, gt=0)
    # a full-parameter run's copies of the sharded weights (FSDP2's hybrid sharding, fsdp.py): the
    # ranks form a replicas x (world size / replicas) mesh, each weight sharded within a row of
    # consecutive ranks (one node) and replicated across rows; 1: sharded over every rank
    replicas: int = bounded(1, ge=1)
    # a CPU run's threads per rank (torch.set_num_threads); 0: OMP_NUM_THREADS when it is set,
    # else this machine's usable cores divided by the ranks on it (LOCAL_WORLD_SIZE), so that the
    # ranks do not oversubscribe the cores (on a machine other jobs share, 1 is often fastest)
    cpu_threads: int = bounded(0, ge=0, le=MAX_CPU_THREADS)


@dataclass
class Ranks:
    """This process's place in the run: rank, world size and its one device."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or taskset limits)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_threads(settings: DistributedSettings) -> int:
    """A CPU rank's thread count: the setting, else OMP_NUM_THREADS, else its share of the cores."""
    if settings.cpu_threads:
        return settings.cpu_threads
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        threads = int(os.environ["OMP_NUM_THREADS"])
        if threads > MAX_CPU_THREADS:
            raise ConfigError(
                f"the environment variable OMP_NUM_THREADS: at most {MAX_CPU_THREADS} threads, "
                f"got {excerpt(os.environ['OMP_NUM_THREADS'])}"
            )
        return max(1, threads)
    return max(1, usable_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def setup_distributed(
    device: str | None = None,
    settings: DistributedSettings | None = None,
    output_dir: str | os.PathLike | None = None,
) -> Ranks:
    """Read RANK, WORLD_SIZE and LOCAL_RANK (set by torchrun; a plain run is rank 0 of 1), pick
    this rank's device (`cuda:LOCAL_RANK` when CUDA is available, else the CPU, or `device`; on the
    CPU, its thread count: `cpu_threads`) and, with several ranks, join the process group (nccl on
    GPUs, gloo on the CPU) with the settings' timeout. `settings.replicas` must divide the world
    size (a ConfigError before any process group forms). With `output_dir`, every rank then checks
    that it is one folder shared by all ranks (`check_shared_folder`)."""
    settings = settings or DistributedSettings()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device or (f"cuda:{local}" if torch.cuda.is_available() else "cpu"))
    if world % settings.replicas:
        raise ConfigError(
            f"distributed.replicas: {settings.replicas} does not divide the world size {world} "
            f"(replicas x ranks per replica must equal the number of ranks)"
        )
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        threads, before = cpu_threads(settings), torch.get_num_threads()
        torch.set_num_threads(threads)
        if threads != before:  # said only when it changes torch's own choice
            print0(f"cpu: {threads} thread(s) per rank, not {before} (distributed.cpu_threads)")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if dev.type == "cuda" else "gloo",
            device_id=dev if dev.type == "cuda" else None,
            timeout=timedelta(seconds=settings.timeout_s),
        )
        # torch's own advice: a group left to the interpreter's teardown can abort the process
        # after its work is done ("terminate called without an active exception")
        atexit.register(_destroy_process_group)
    ranks = Ranks(rank, world, dev)
    if output_dir is not None:
        check_shared_folder(Path(output_dir), ranks)
    return ranks


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def check_shared_folder(folder: Path, ranks: Ranks) -> None:
    """Every rank of a multi-rank run writes its checkpoint shards into `folder` and rank 0 renames
    the whole: rank 0 writes a random token there, every rank reads it back; ConfigError (on every
    rank, naming those that did not see it) unless all did."""
    if ranks.world_size == 1:
        return
    probe = folder / ".shared-folder-probe"
    token = secrets.token_hex(8) if ranks.main else None
    if ranks.main:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text(token, encoding="utf-8")
    token = gather_json(token, ranks)[0]
    try:
        seen = probe.read_text(encoding="utf-8") == token
    except OSError:
        seen = False
    blind = [r for r, ok in enumerate(gather_json(seen, ranks)) if not ok]
    if ranks.main:
        probe.unlink()
    if blind:
        raise ConfigError(
            f"output_dir {folder}: rank(s) {blind} do not see rank 0's files there; every rank "
            f"(every node) needs the same shared folder (a network file system)"
        )


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
