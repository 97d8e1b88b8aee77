"""distributed.py's start-up: the torch minimum, the process group's timeout, the shared output
folder."""

import json
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp
from helpers import REPO, gloo_rank
from instruments import end_rank, free_port

import distributed as D
from config import ConfigError


@pytest.mark.parametrize(
    "version, release",
    [("2.13.0+cpu", (2, 13)), ("2.9.0a0+git1234", (2, 9)), ("2.10.1", (2, 10)), ("3.0", (3, 0))],
)
def test_torch_release_reads_major_and_minor(version, release):
    assert D.torch_release(version) == release


@pytest.mark.parametrize("script", ["sft", "grpo", "reward_models.content_rm"])
def test_a_trainer_on_an_older_torch_stops_with_one_line(script):
    code = f"import torch; torch.__version__ = '2.8.1'; import {script}"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "error: torch 2.8.1 is older than 2.9, the oldest this project runs on "
        "(pip install 'torch>=2.9')"
    ]


def _timeout_worker(rank, port, out):
    gloo_rank(rank, port)
    D.setup_distributed("cpu", D.DistributedSettings(timeout_s=2.0))
    if rank == 1:
        time.sleep(8)  # a rank far slower than the timeout
    start = time.monotonic()
    try:
        D.barrier()
        outcome = "met"
    except RuntimeError as e:
        outcome = f"error: {e}"
    out.joinpath(f"rank{rank}.txt").write_text(f"{time.monotonic() - start:.1f} {outcome}")


@pytest.mark.slow
def test_the_timeout_reaches_the_process_group(tmp_path):
    """Rank 0 waits at a barrier for rank 1, which comes 8 s late: with timeout_s 2 the barrier
    fails on rank 0 after about 2 s (gloo's own default would wait 30 minutes)."""
    mp.spawn(_timeout_worker, args=(free_port(), tmp_path), nprocs=2)
    waited, outcome = (tmp_path / "rank0.txt").read_text().split(" ", 1)
    assert outcome.startswith("error") and 1.5 <= float(waited) < 6, (waited, outcome)


def _mesh_timeout_worker(rank, port, out):
    import fsdp

    gloo_rank(rank, port, world_size=4)
    D.setup_distributed("cpu", D.DistributedSettings(timeout_s=2.0, replicas=2))
    mesh = fsdp.device_mesh(torch.device("cpu"), replicas=2, timeout_s=2.0)
    timeouts = [
        mesh.get_group(name)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for name in ("replicate", "shard")
    ]
    out.joinpath(f"rank{rank}.txt").write_text(json.dumps(timeouts))
    end_rank()


@pytest.mark.slow
def test_the_timeout_reaches_the_meshs_own_process_groups(tmp_path):
    """distributed.replicas 2 on 4 ranks: the 2-D mesh's row and column groups, which torch creates
    with its own default (30 minutes for gloo), wait distributed.timeout_s like the world's."""
    mp.spawn(_mesh_timeout_worker, args=(free_port(), tmp_path), nprocs=4)
    for rank in range(4):
        assert json.loads((tmp_path / f"rank{rank}.txt").read_text()) == [2.0, 2.0], rank


def _shared_worker(rank, port, out):
    gloo_rank(rank, port)
    ranks = D.setup_distributed("cpu", output_dir=out / "shared")  # shared: passes
    try:
        D.check_shared_folder(out / f"node{rank}", ranks)  # one folder per rank: not shared
        found = "passed"
    except ConfigError as e:
        found = str(e)
    out.joinpath(f"rank{rank}.txt").write_text(found)
    end_rank()


@pytest.mark.slow
def test_every_rank_stops_with_one_line_when_output_dir_is_not_one_shared_folder(tmp_path):
    mp.spawn(_shared_worker, args=(free_port(), tmp_path), nprocs=2)
    for rank in range(2):
        found = (tmp_path / f"rank{rank}.txt").read_text()
        assert found == (
            f"output_dir {tmp_path / f'node{rank}'}: rank(s) [1] do not see rank 0's files "
            "there; every rank (every node) needs the same shared folder (a network file system)"
        ), found
    assert list((tmp_path / "shared").iterdir()) == []  # the probe is gone


@pytest.mark.parametrize(
    "env, setting, threads",
    [
        ({}, 0, 2),  # one rank on a 2-core machine: both cores
        ({"LOCAL_WORLD_SIZE": "2"}, 0, 1),  # two ranks on 2 cores: one each, as torchrun advises
        ({"LOCAL_WORLD_SIZE": "4"}, 0, 1),  # never fewer than one
        ({"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "2"}, 0, 2),  # the user's variable wins
        ({"OMP_NUM_THREADS": "2"}, 1, 1),  # and the setting wins over both
    ],
)
def test_a_cpu_run_picks_threads_that_do_not_oversubscribe(
    monkeypatch, capsys, env, setting, threads
):
    """Said in one line only where the count differs from torch's own (2 here)."""
    for name in ("LOCAL_WORLD_SIZE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(D, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        D.setup_distributed("cpu", D.DistributedSettings(cpu_threads=setting))
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    said = "" if threads == 2 else "cpu: 1 thread(s) per rank, not 2 (distributed.cpu_threads)\n"
    assert capsys.readouterr().out == said
