"""What a benchmark ran on and how it was started, for the JSON files and docs/benchmarks.md;
and the process-group setup shared by the benchmarks."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from importlib import metadata
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off (the shared H200 hosts do not allow it); set unless the caller set
them."""


def set_safe_env(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Set :data:`SAFE_ENV` in ``env`` (default ``os.environ``) where not already set."""
    env = os.environ if env is None else env
    for key, value in SAFE_ENV.items():
        env.setdefault(key, value)
    return env


def utc_now() -> str:
    """The current time, ISO 8601 in UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info(world_size: int, device: torch.device) -> Dict[str, object]:
    """Host, accelerator and software versions.

    Returns:
        {"description": one line, "hostname", "gpu" (name or None), "gpus_used", "torch",
        "cuda", "nccl", "megatron_core", "python"}.
    """
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError, TypeError):
            nccl = None
    where = f"{world_size} x {gpu}" if gpu else f"{world_size} CPU process(es) ({platform.processor() or platform.machine()})"
    return {
        "description": f"{where}, torch {torch.__version__}, megatron-core {_version('megatron-core')}",
        "hostname": socket.gethostname(),
        "gpu": gpu,
        "gpus_used": world_size if gpu else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "megatron_core": _version("megatron-core"),
        "python": platform.python_version(),
    }


def command_line(subcommand: str, argv: Sequence[str]) -> str:
    """How this benchmark was started, as a shell command (torchrun's process count
    included when it was launched by torchrun)."""
    args = shlex.join([subcommand, *argv])
    world = os.environ.get("WORLD_SIZE")
    if world is not None and "LOCAL_RANK" in os.environ:
        return f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', world)} -m megatron_mok.bench {args}"
    return f"{os.path.basename(sys.executable)} -m megatron_mok.bench {args}"


@dataclass
class Dist:
    """This process's place in the benchmark: EP group (the default group, None for one
    process), rank, world size and device."""

    group: Optional[dist.ProcessGroup]
    rank: int
    world: int
    device: torch.device


def device_type(device_kind: str) -> str:
    """"cuda" or "cpu" for ``--device`` auto/cuda/cpu (auto: CUDA when torch sees a GPU)."""
    if device_kind not in ("auto", "cuda", "cpu"):
        raise ValueError(f"--device {device_kind!r} must be auto, cuda or cpu")
    if device_kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device_kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    return device_kind


def init_distributed(device_kind: str, timeout_s: float) -> Dist:
    """Join the process group torchrun set up (NCCL on GPUs, gloo on the CPU), or run as one
    process when not started by torchrun.

    Args:
        device_kind: "auto" (CUDA when available), "cuda" or "cpu".
        timeout_s: how long a collective may wait for a peer before failing.
    """
    use_cuda = device_type(device_kind) == "cuda"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world == 1:
        return Dist(group=None, rank=0, world=1, device=device)
    if not dist.is_initialized():
        kwargs = {"device_id": device} if use_cuda else {}
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s), **kwargs)
    return Dist(group=dist.group.WORLD, rank=dist.get_rank(), world=dist.get_world_size(), device=device)
