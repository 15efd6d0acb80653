"""What a backend of :func:`megatron_mok.functional.mok_moe` is: a name, why it cannot run a
given call (or None), and running it. The ordered registry is in ``backends.py``."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Protocol, Tuple

import torch

from ..config import MoKConfig
from .groups import EPGroup
from .validate import MoEShape


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run this call here; the message says why."""


@dataclass(frozen=True)
class CallSpec:
    """Everything a backend needs to decide whether it takes a call, read off the validated
    arguments (no tensor values): the sizes, the tunables, the EP group (P ranks), and the
    device and dtype of the tokens."""

    shape: MoEShape
    config: MoKConfig
    ep_group: EPGroup
    ep_size: int
    device: torch.device
    dtype: torch.dtype


class Backend(Protocol):
    """One way of computing the contract (docs/contract.md)."""

    name: str

    def unavailable_reason(self, spec: CallSpec) -> Optional[str]:
        """None when this backend runs the call here, else why not (one clause, read by users)."""

    def run(self, spec: CallSpec, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            fc1s: Tuple[torch.Tensor, ...], fc2s: Tuple[torch.Tensor, ...], main_grads=None) -> torch.Tensor:
        """y [T, H] in x's dtype for validated inputs: x [T, H], topk_ids int64 [T, K],
        topk_weights fp32 [T, K], fc1s / fc2s the weight segments ([L_i, 2I, H] / [L_i, H, I]);
        ``main_grads`` (``main_grad.MainGrads`` or None): per-expert fp32 buffers the weight
        gradients are accumulated into, the weights then getting placeholders."""


@functools.lru_cache(maxsize=None)
def _device_unavailable_reason(device_index: int) -> Optional[str]:
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


def gpu_unavailable_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """None when MoK's CUDA kernels can run on bf16 tensors of ``device``, else why not: the
    device is not a CUDA device, the dtype is not bf16, the GPU is not sm_90, or the library
    cannot be loaded (the reason it gives)."""
    if device.type != "cuda":
        return f"the tensors are on {device}, and the CUDA backends need a CUDA device"
    if dtype != torch.bfloat16:
        return f"the CUDA backends take bf16 tokens and weights; x is {dtype}"
    return _device_unavailable_reason(device.index if device.index is not None else torch.cuda.current_device())
