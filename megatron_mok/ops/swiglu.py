"""SwiGLU with the router weight inside (csrc/src/swiglu.cu) as custom ops."""

from __future__ import annotations

import ctypes
from typing import Optional, Tuple

import torch

from ._ptr import ptr, stream_of
from .custom_op import mok_op
from .library import load_library

_i, _v = ctypes.c_int, ctypes.c_void_p


def _lib():
    lib = load_library()
    return lib, {
        "fwd": lib.function("mok_swiglu_forward", _i, [_v, _v, _v, _i, _i, _v, _v]),
        "bwd": lib.function("mok_swiglu_backward", _i, [_v, _v, _v, _v, _i, _i, _v, _v, _v, _v]),
    }


@mok_op("mok::swiglu_forward", mutates_args=())
def swiglu_forward(ab: torch.Tensor, w: Optional[torch.Tensor], offsets: torch.Tensor) -> torch.Tensor:
    """hw = w * silu(a) * b on the rows r < offsets[L].

    Args:
        ab: bf16 [R, 2I], gate pre-activation a in columns [0, I), up b in [I, 2I).
        w: fp32 [R] router weight per row, or None (1).
        offsets: int32 [L + 1]; rows >= offsets[L] are left undefined.

    Returns:
        hw: bf16 [R, I].
    """
    R, two_i = ab.shape
    hw = torch.empty((R, two_i // 2), dtype=torch.bfloat16, device=ab.device)
    lib, fns = _lib()
    lib.check(fns["fwd"](ptr(ab), ptr(w), ptr(offsets), offsets.numel() - 1, two_i // 2, ptr(hw),
                         stream_of(ab)), "mok_swiglu_forward")
    return hw


@swiglu_forward.register_fake
def _(ab, w, offsets):
    return ab.new_empty((ab.shape[0], ab.shape[1] // 2))


@mok_op("mok::swiglu_backward", mutates_args=())
def swiglu_backward(ab: torch.Tensor, w: Optional[torch.Tensor], g: torch.Tensor, offsets: torch.Tensor,
                    want_hw: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`swiglu_forward` given g = dL/d(hw) (bf16 [R, I]).

    Returns:
        d_ab bf16 [R, 2I]; dw fp32 [R] (dL/dw, a fixed-order sum over I; empty if w is None);
        hw bf16 [R, I] recomputed as in the forward (empty unless ``want_hw``).
    """
    R, two_i = ab.shape
    d_ab = torch.empty_like(ab)
    dw = torch.empty((R if w is not None else 0,), dtype=torch.float32, device=ab.device)
    hw = torch.empty((R if want_hw else 0, two_i // 2), dtype=torch.bfloat16, device=ab.device)
    lib, fns = _lib()
    lib.check(fns["bwd"](ptr(ab), ptr(w), ptr(g), ptr(offsets), offsets.numel() - 1, two_i // 2, ptr(d_ab),
                         ptr(dw if w is not None else None), ptr(hw if want_hw else None), stream_of(ab)),
              "mok_swiglu_backward")
    return d_ab, dw, hw


@swiglu_backward.register_fake
def _(ab, w, g, offsets, want_hw):
    R, two_i = ab.shape
    return (torch.empty_like(ab), ab.new_empty((R if w is not None else 0,), dtype=torch.float32),
            ab.new_empty((R if want_hw else 0, two_i // 2)))
