"""Spawning P gloo ranks on the CPU for tests (one process per rank)."""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, backend, args):
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(seconds=180))
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # every rank done before any tears its group down
    finally:
        dist.destroy_process_group()
    # A rank that passed leaves without the interpreter's exit: a gloo rank whose work and
    # teardown had passed can abort at exit ("terminate called without an active exception": a
    # C++ thread still joinable when static objects are destroyed; seen in CI twice).
    # A failure above still raises, and spawn reports it with its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined in one
    process group (the default group; gloo, or nccl with rank r on GPU r). A failure in any
    rank fails the caller with its traceback. ``fn`` must be a module-level function."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(var, "0" if var == "NCCL_NVLS_ENABLE" else "1")
    mp.spawn(_entry, args=(fn, world_size, free_port(), backend, args), nprocs=world_size, join=True)
