"""Communication kernels (csrc/src/comm.cu) as custom ops: pull, push, slot sum, barrier; and
the status mirror (csrc/src/common.cu).

Peer memory is passed as ``bases``: an int64 [P] device tensor of the addresses of every
rank's copy of a symmetric buffer, plus a byte offset into it (the buffer layout is the same
on every rank). Row counts are read on the device from the schedule's ``offsets``.
"""

from __future__ import annotations

import ctypes
from typing import Optional, Tuple

import torch

from ._ptr import ptr, stream_of
from .custom_op import mok_op
from .library import load_library

_i, _l, _v = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p


def _lib():
    lib = load_library()
    return lib, {
        "pull": lib.function("mok_pull_rows", _i, [_v, _l, _i, _l, _v, _v, _i, _i, _i, _v, _v, _i, _v]),
        "push": lib.function("mok_push_rows", _i, [_v, _l, _l, _v, _v, _i, _i, _i, _v, _v, _i, _v]),
        "sum": lib.function("mok_sum_slots", _i, [_v, _v, _i, _i, _i, _i, _v, _v, _v, _v, _v]),
        "barrier": lib.function("mok_barrier", _i, [_v, _i, _i, _v, _l, _i, _v, _v]),
        "signal_failure": lib.function("mok_signal_failure", _i, [_v, _i, _i, _i, _i, _v, _v]),
        "mirror": lib.function("mok_mirror_status", _i, [_v, _v, _v]),
    }


@mok_op("mok::pull_rows", mutates_args="unknown")
def pull_rows(bases: torch.Tensor, src_offset: int, per_token: bool, scalar_offset: int,
              table: torch.Tensor, offsets: torch.Tensor, topk: int, capacity_rows: int,
              hidden: int, with_scalars: bool, num_blocks: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pull rows from peers into the expert-grouped layout.

    Args:
        bases: int64 [P] device addresses of each rank's symmetric buffer.
        src_offset: byte offset of the bf16 source rows ([T_cap, H] per token when
            ``per_token``, else [T_cap * K, H] per route) in each buffer.
        per_token: rows are indexed by token (dispatch) or by route (token * K + slot).
        scalar_offset: byte offset of an fp32 [T_cap, K] per-route array pulled alongside
            (the router weight) when ``with_scalars``.
        table: int32 [capacity_rows, 2] schedule; offsets: int32 [L + 1].
        topk: K. capacity_rows: R_cap. hidden: H (a multiple of 8).
        num_blocks: grid size (0: four per SM).

    Returns:
        rows bf16 [R_cap, H] (rows >= offsets[L] undefined, padding rows zero) and scalars
        fp32 [R_cap] (empty when not ``with_scalars``).
    """
    rows = torch.empty((capacity_rows, hidden), dtype=torch.bfloat16, device=table.device)
    scalars = torch.empty((capacity_rows if with_scalars else 0,), dtype=torch.float32, device=table.device)
    lib, fns = _lib()
    code = fns["pull"](ptr(bases), src_offset, int(per_token), scalar_offset, ptr(table), ptr(offsets),
                       offsets.numel() - 1, topk, hidden, ptr(rows), ptr(scalars if with_scalars else None),
                       num_blocks, stream_of(table))
    lib.check(code, "mok_pull_rows")
    return rows, scalars


@pull_rows.register_fake
def _(bases, src_offset, per_token, scalar_offset, table, offsets, topk, capacity_rows, hidden,
      with_scalars, num_blocks):
    return (table.new_empty((capacity_rows, hidden), dtype=torch.bfloat16),
            table.new_empty((capacity_rows if with_scalars else 0,), dtype=torch.float32))


@mok_op("mok::push_rows", mutates_args="unknown")
def push_rows(bases: torch.Tensor, dst_offset: int, scalar_offset: int, table: torch.Tensor,
              offsets: torch.Tensor, topk: int, rows: torch.Tensor, scalars: Optional[torch.Tensor],
              num_blocks: int) -> None:
    """Push each scheduled row (and optional fp32 scalar) to its (token, slot) on its home rank.

    Args:
        bases: int64 [P] device addresses; dst_offset: byte offset of the bf16 [T_cap, K, H]
            slots; scalar_offset: byte offset of the fp32 [T_cap, K] scalar slots.
        table: int32 [R_cap, 2]; offsets: int32 [L + 1]; topk: K.
        rows: bf16 [R_cap, H], contiguous; scalars: fp32 [R_cap] or None.
    """
    lib, fns = _lib()
    code = fns["push"](ptr(bases), dst_offset, scalar_offset, ptr(table), ptr(offsets),
                       offsets.numel() - 1, topk, rows.shape[1], ptr(rows), ptr(scalars), num_blocks,
                       stream_of(rows))
    lib.check(code, "mok_push_rows")


@push_rows.register_fake
def _(bases, dst_offset, scalar_offset, table, offsets, topk, rows, scalars, num_blocks):
    return None


@mok_op("mok::sum_slots", mutates_args="unknown")
def sum_slots(slots: torch.Tensor, ids: torch.Tensor, num_experts: int,
              scalar_slots: Optional[torch.Tensor], status: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fixed-order sum over the top-k slots of this rank's tokens.

    Args:
        slots: bf16 [T, K, H] (a view of the symmetric slot buffer).
        ids: int64 [T, K]; slots whose id is outside [0, num_experts) are skipped.
        num_experts: E. scalar_slots: fp32 [T, K] or None (copied out, masked the same way).
        status: int32 [8] status word; when any flag is set the outputs are NaN.

    Returns:
        out bf16 [T, H] = sum_j slots[t, j] (j ascending), and fp32 [T, K] masked scalars
        (empty when ``scalar_slots`` is None).
    """
    T, K, H = slots.shape
    out = torch.empty((T, H), dtype=torch.bfloat16, device=slots.device)
    scalars_out = torch.empty((T, K) if scalar_slots is not None else (0,), dtype=torch.float32,
                              device=slots.device)
    lib, fns = _lib()
    code = fns["sum"](ptr(slots), ptr(ids), T, K, H, num_experts, ptr(out), ptr(scalar_slots),
                      ptr(scalars_out if scalar_slots is not None else None), ptr(status), stream_of(slots))
    lib.check(code, "mok_sum_slots")
    return out, scalars_out


@sum_slots.register_fake
def _(slots, ids, num_experts, scalar_slots, status):
    T, K, H = slots.shape
    return (slots.new_empty((T, H)),
            slots.new_empty((T, K) if scalar_slots is not None else (0,), dtype=torch.float32))


@mok_op("mok::barrier", mutates_args="unknown")
def barrier(signal_bases: torch.Tensor, rank: int, counter: torch.Tensor, timeout_ns: int, site: int,
            status: torch.Tensor) -> None:
    """Device-side barrier of the P ranks whose signal arrays are ``signal_bases`` (int64
    [P] device addresses of uint64 [P] arrays). ``counter``: uint64-sized int64 [1] epoch
    counter of this rank. A peer missing for ``timeout_ns`` is recorded in ``status``."""
    lib, fns = _lib()
    code = fns["barrier"](ptr(signal_bases), rank, signal_bases.numel(), ptr(counter), timeout_ns, site,
                          ptr(status), stream_of(counter))
    lib.check(code, "mok_barrier")


@barrier.register_fake
def _(signal_bases, rank, counter, timeout_ns, site, status):
    return None


def signal_failure(signal_bases: torch.Tensor, rank: int, code: int, failed_rank: int, status: torch.Tensor) -> None:
    """Queue on ``status``'s current stream the kernel that tells every peer that this rank
    stops (``mok_signal_failure``, csrc/include/mok/comm.h): it sets this rank's failure word
    (``code``, ``failed_rank``) in every peer's signal array and records the stop in ``status``.
    Not a custom op: it runs only outside compiled code, when a call is stopped on the host."""
    lib, fns = _lib()
    code_ = fns["signal_failure"](ptr(signal_bases), rank, signal_bases.numel(), code, failed_rank, ptr(status),
                                  stream_of(status))
    lib.check(code_, "mok_signal_failure")


def host_device_pointer(pinned: torch.Tensor) -> int:
    """The device address of pinned host tensor ``pinned`` for the current device, or 0 when
    that memory is not mapped there (the caller then copies with the copy engine)."""
    lib = load_library()
    fn = lib.function("mok_host_device_pointer", _i, [_v, ctypes.POINTER(_v)])
    out = _v()
    return int(out.value or 0) if fn(pinned.data_ptr(), ctypes.byref(out)) == 0 else 0


def mirror_status(status: torch.Tensor, host_mapped: int) -> None:
    """Queue on ``status``'s current stream a kernel that stores the int32 [8] status word into
    the pinned host memory at device address ``host_mapped`` (:func:`host_device_pointer`)."""
    lib, fns = _lib()
    lib.check(fns["mirror"](ptr(status), host_mapped, stream_of(status)), "mok_mirror_status")
