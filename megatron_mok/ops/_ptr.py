"""Small helpers shared by the op modules: raw pointers and streams for ctypes calls."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch


def ptr(t: Optional[torch.Tensor]) -> ctypes.c_void_p:
    """Device (or pinned host) address of ``t``'s first element; NULL for None."""
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


def stream_of(t: torch.Tensor) -> ctypes.c_void_p:
    """The current CUDA stream of ``t``'s device, as a cudaStream_t (the raw handle, without the
    ``torch.cuda.Stream`` object that ``torch.cuda.current_stream`` builds: ~4 us of host time
    per launch)."""
    index = t.device.index
    return ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(torch.cuda.current_device() if index is None else index))


def pointer_table(tensors, device) -> torch.Tensor:
    """int64 [len(tensors)] device tensor of the tensors' addresses (a device array of
    pointers for the kernels)."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64).to(device)
