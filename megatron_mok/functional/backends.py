"""Which backend runs a ``mok_moe`` call, and running it.

``auto`` takes the ``megakernel`` whenever it supports the call (shape, tile rows, an sm_90 GPU
with the MoK library loaded), for training and inference alike; else ``cuda`` when it can run,
else ``reference``. The two GPU backends give bitwise the same outputs and gradients (the
megakernel's backward is the cuda backend's). A backend named explicitly that cannot run raises
:class:`BackendUnavailable` with the reason; ``auto`` logs one line with the reason when it does
not take the megakernel or falls back from a GPU backend.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from ..config import MoKConfig
from .groups import LocalEPRank, group_size_rank
from .validate import MoEShape, check_expert_ids_on_host, weight_segments

log = logging.getLogger("megatron_mok")


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run this call here; the message says why."""


@functools.lru_cache(maxsize=None)
def _gpu_backend_blocker(device_index: int) -> Optional[str]:
    """Why the CUDA backends cannot run on this device, or None when they can."""
    major, minor = torch.cuda.get_device_capability(device_index)
    if (major, minor) != (9, 0):
        return (f"the MoK kernels are built for sm_90a (H100/H200); device {device_index} is "
                f"sm_{major}{minor}")
    from ..ops.library import LibraryUnavailable, load_library

    try:
        load_library()
    except LibraryUnavailable as err:
        return str(err)
    return None


def gpu_backend_blocker(x: torch.Tensor) -> Optional[str]:
    """None when the CUDA backends can run on ``x``'s device, else the reason they cannot."""
    if not x.is_cuda:
        return f"the tensors are on {x.device}, and the CUDA backends need a CUDA device"
    if x.dtype != torch.bfloat16:
        return f"the CUDA backends take bf16 tokens and weights; x is {x.dtype}"
    return _gpu_backend_blocker(x.device.index if x.device.index is not None else torch.cuda.current_device())


def cuda_blocker(x: torch.Tensor, shape: MoEShape, config: MoKConfig) -> Optional[str]:
    """None when the ``cuda`` backend takes this call, else why it does not."""
    reason = gpu_backend_blocker(x)
    if reason is not None:
        return reason
    from .cuda_backend import unsupported_reason

    return unsupported_reason(shape, config)


def megakernel_blocker(x: torch.Tensor, shape: MoEShape, config: MoKConfig, ep_size: int) -> Optional[str]:
    """None when the forward megakernel takes this call, else why it does not."""
    reason = gpu_backend_blocker(x)
    if reason is not None:
        return reason
    return _megakernel_shape_blocker(shape, config, ep_size)


@functools.lru_cache(maxsize=256)
def _megakernel_shape_blocker(shape: MoEShape, config: MoKConfig, ep_size: int) -> Optional[str]:
    # Cached: every layer asks the same question on every call (it reads no device state).
    try:
        from . import megakernel_backend
    except ImportError:
        return "the megakernel backend is not part of this build"
    return megakernel_backend.unsupported_reason(shape, config, ep_size)


def select_backend(requested: str, x: torch.Tensor, shape: MoEShape, config: MoKConfig, ep_size: int) -> str:
    """Resolve ``requested`` ("auto" or a backend name) to the backend that runs the call."""
    if requested == "reference":
        return "reference"
    if requested == "cuda":
        reason = cuda_blocker(x, shape, config)
        if reason is not None:
            raise BackendUnavailable(f"backend='cuda' cannot run: {reason}")
        return "cuda"
    if requested == "megakernel":
        reason = megakernel_blocker(x, shape, config, ep_size)
        if reason is not None:
            raise BackendUnavailable(f"backend='megakernel' cannot run: {reason}")
        return "megakernel"
    # auto
    if not x.is_cuda:
        return "reference"
    reason = megakernel_blocker(x, shape, config, ep_size)
    if reason is None:
        return "megakernel"
    cuda_reason = cuda_blocker(x, shape, config)
    if cuda_reason is None:
        _log_once(f"megatron-mok: auto uses the cuda backend, not the megakernel: {reason}")
        return "cuda"
    _log_once(f"megatron-mok: CUDA backends not used, falling back to the reference backend: {cuda_reason}")
    return "reference"


@functools.lru_cache(maxsize=64)
def _log_once(message: str) -> None:
    log.warning(message)


def run_backend(name, x, topk_ids, topk_weights, fc1_weight, fc2_weight, *, ep_group, config, shape):
    """Run backend ``name`` on validated inputs (weights: tensors or tuples of weight segments;
    the reference backend concatenates segments, the GPU backends read them where they lie)."""
    ep_size, _ = group_size_rank(ep_group)
    fc1s, fc2s = weight_segments("fc1_weight", fc1_weight), weight_segments("fc2_weight", fc2_weight)
    if name == "reference":
        from ..reference import reference_moe

        if isinstance(ep_group, LocalEPRank):
            raise BackendUnavailable(
                "the reference backend exchanges data with torch.distributed collectives; "
                "virtual ranks (LocalEPGroup) run only the GPU backends")
        check_expert_ids_on_host(topk_ids, shape.experts_per_rank * ep_size)
        fc1, fc2 = (fc1s[0], fc2s[0]) if len(fc1s) == 1 else (torch.cat(fc1s), torch.cat(fc2s))
        return reference_moe(x, topk_ids, topk_weights, fc1, fc2, ep_group=ep_group, tile_rows=config.tile_rows)
    if name == "cuda":
        from .cuda_backend import cuda_moe

        return cuda_moe(x, topk_ids, topk_weights, fc1s, fc2s, ep_group=ep_group, config=config, shape=shape)
    if name == "megakernel":
        from .megakernel_backend import megakernel_moe

        return megakernel_moe(x, topk_ids, topk_weights, fc1s, fc2s, ep_group=ep_group, config=config,
                              shape=shape)
    raise AssertionError(f"unknown backend {name}")
