"""The backward megakernel's compute launch (``mok_megakernel_backward_compute``,
csrc/include/mok/megakernel.h): the fc2 data gradient with the SwiGLU backward, both weight
gradients and the fc1 data gradient with dX and the router-weight gradient pushed home, in one
persistent launch on the dY rows already pulled into the expert-grouped layout.

Bitwise the unfused chain (:func:`~megatron_mok.ops.grouped_gemm.fc2_dgrad_swiglu_`, two
:func:`~megatron_mok.ops.grouped_gemm.weight_grad_rows` with counts, then
:func:`~megatron_mok.ops.grouped_gemm.launch_fc1_dgrad_push`): every tile is the standalone
kernel's tile with its K loop (tests/kernels/test_backward_compute.py).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from ._ptr import ptr, stream_of
from .grouped_gemm import GemmArgumentError
from .library import load_library

_i, _i64, _v = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p

_FIELDS = ["dy", "x", "gu", "router_weights", "h", "partials", "fc1_weight", "fc2_weight", "d_fc1", "d_fc2",
           "offsets", "counts", "table", "bases", "slots_offset", "scalars_offset", "counters", "counter_words",
           "status", "timeout_ns", "rank", "rows", "L", "H", "I", "num_ctas", "trace", "trace_capacity"]
_POINTERS = {"dy", "x", "gu", "router_weights", "h", "partials", "fc1_weight", "fc2_weight", "d_fc1", "d_fc2",
             "offsets", "counts", "table", "bases", "counters", "status", "trace"}


class BackwardComputeArgs(ctypes.Structure):
    """``MokBackwardComputeArgs``: every field 8 bytes."""

    _fields_ = [(name, _v if name in _POINTERS else _i64) for name in _FIELDS]


_fns = None


def _lib():
    global _fns
    lib = load_library()
    if _fns is None:
        _fns = {
            "words": lib.function("mok_megakernel_backward_compute_counter_words", _i64, [_i64, _i, _i, _i]),
            "run": lib.function("mok_megakernel_backward_compute", _i, [ctypes.POINTER(BackwardComputeArgs), _v]),
        }
    return lib, _fns


def applies(hidden: int, ffn_hidden: int, tile_rows: int, segments: int, main_grad: bool) -> bool:
    """Whether the compute launch takes this backward: H and I multiples of 256, 128-row segments,
    one weight segment (no fused shared expert) and bf16 weight gradients (no ``main_grad``)."""
    return hidden % 256 == 0 and ffn_hidden % 256 == 0 and tile_rows == 128 and segments == 1 and not main_grad


def counter_words(rows: int, L: int, hidden: int, ffn_hidden: int) -> int:
    """int32 words of the launch's counter buffer for a layout of ``rows`` rows."""
    _, fns = _lib()
    words = int(fns["words"](int(rows), int(L), int(hidden), int(ffn_hidden)))
    if words < 0:
        raise GemmArgumentError(f"the backward compute launch does not take rows={rows}, L={L}, H={hidden}, "
                                f"I={ffn_hidden} (rows a multiple of 128, 1 <= L <= 1024, H and I multiples of 256)")
    return words


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(shape) or not t.is_contiguous():
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise GemmArgumentError(f"{name} must be a contiguous {dtype} tensor of shape {tuple(shape)}, got {got}")


def backward_compute(dy: torch.Tensor, x: torch.Tensor, gu: torch.Tensor, router_weights: torch.Tensor,
                     fc1_weight: torch.Tensor, fc2_weight: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor,
                     table: torch.Tensor, bases: torch.Tensor, slots_offset: int, scalars_offset: int,
                     status: torch.Tensor, timeout_s: float, rank: int, num_ctas: int = 0,
                     d_fc1: Optional[torch.Tensor] = None, d_fc2: Optional[torch.Tensor] = None,
                     trace: Optional[torch.Tensor] = None):
    """Run the compute launch on the current stream.

    Args:
        dy: bf16 [R, H], the pulled output gradients in the expert-grouped layout (R a multiple
            of 128). x: bf16 [R, H] and router_weights fp32 [R], the kept forward inputs.
        gu: bf16 [R, 2I], the kept fc1 pre-activation; overwritten by its gradient.
        fc1_weight: bf16 [L, 2I, H]; fc2_weight: bf16 [L, H, I].
        offsets: int32 [L + 1] (multiples of 128); counts: int32 [L] real rows per expert.
        table: int32 [R, 2], the schedule rows of the layout rows; bases: int64 [P], every rank's
            workspace region; slots_offset / scalars_offset: byte offsets of the bf16 slots and
            the fp32 scalar slots there, which receive dX and the router-weight gradient.
        status: int32 status word of the workspace; timeout_s: the deadline of every wait.
        d_fc1, d_fc2: bf16 outputs [L, 2I, H], [L, H, I], or None to allocate them.
        trace: optional int64 [N, 6] timeline records (``MokBackwardComputeArgs::trace``;
            tools/perf/backward_timeline.py reads them), or None.

    Returns:
        (d_fc1 bf16 [L, 2I, H], d_fc2 bf16 [L, H, I]).
    """
    R, H = dy.shape
    L, two_i, _ = fc1_weight.shape
    I = two_i // 2
    dev = dy.device
    _check("dy", dy, torch.bfloat16, (R, H))
    _check("x", x, torch.bfloat16, (R, H))
    _check("gu", gu, torch.bfloat16, (R, 2 * I))
    _check("router_weights", router_weights, torch.float32, (R,))
    _check("fc1_weight", fc1_weight, torch.bfloat16, (L, 2 * I, H))
    _check("fc2_weight", fc2_weight, torch.bfloat16, (L, H, I))
    _check("offsets", offsets, torch.int32, (L + 1,))
    _check("counts", counts, torch.int32, (L,))
    _check("table", table, torch.int32, (R, 2))
    if R % 128:
        raise GemmArgumentError(f"the layout's rows R = {R} must be a multiple of 128 (segments padded to 128)")
    if not applies(H, I, 128, 1, False):
        raise GemmArgumentError(f"the backward compute launch needs H and I multiples of 256, got H={H}, I={I}")
    d_fc1 = torch.empty_like(fc1_weight) if d_fc1 is None else d_fc1
    d_fc2 = torch.empty_like(fc2_weight) if d_fc2 is None else d_fc2
    _check("d_fc1", d_fc1, torch.bfloat16, (L, 2 * I, H))
    _check("d_fc2", d_fc2, torch.bfloat16, (L, H, I))
    if trace is not None and (trace.dtype != torch.int64 or trace.dim() != 2 or trace.shape[1] != 6
                              or trace.shape[0] < 1 or not trace.is_contiguous()):
        raise GemmArgumentError(f"trace must be a contiguous int64 tensor [N, 6], got "
                                f"{trace.dtype} {tuple(trace.shape)}")
    words = counter_words(R, L, H, I)
    counters = torch.empty(words, dtype=torch.int32, device=dev)
    h = torch.empty((R, I), dtype=torch.bfloat16, device=dev)
    partials = torch.empty((I // 256, R), dtype=torch.float32, device=dev)
    args = BackwardComputeArgs(
        dy=ptr(dy), x=ptr(x), gu=ptr(gu), router_weights=ptr(router_weights), h=ptr(h), partials=ptr(partials),
        fc1_weight=ptr(fc1_weight), fc2_weight=ptr(fc2_weight), d_fc1=ptr(d_fc1), d_fc2=ptr(d_fc2),
        offsets=ptr(offsets), counts=ptr(counts), table=ptr(table), bases=ptr(bases),
        slots_offset=int(slots_offset), scalars_offset=int(scalars_offset), counters=ptr(counters),
        counter_words=words, status=ptr(status), timeout_ns=max(1, int(timeout_s * 1e9)), rank=int(rank), rows=R,
        L=L, H=H, I=I, num_ctas=int(num_ctas), trace=None if trace is None else ptr(trace),
        trace_capacity=0 if trace is None else trace.shape[0])
    lib, fns = _lib()
    lib.check(fns["run"](ctypes.byref(args), stream_of(dy)), "mok_megakernel_backward_compute")
    return d_fc1, d_fc2
