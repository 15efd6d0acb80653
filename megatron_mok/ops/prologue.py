"""The forward dispatch prologue (csrc/src/prologue.cu) as the custom op ``mok::dispatch_prologue``:
publish this rank's tokens, expert ids and router weights into its workspace region, the dispatch
barrier, and the schedule kernel, queued by one host call (one C call instead of six torch ops and
ctypes calls: the host time of a layer is what a GPU with nothing else queued waits for before the
layer's first GEMM or the megakernel)."""

from __future__ import annotations

import ctypes

import torch

from ._ptr import stream_of
from .custom_op import mok_op
from .library import load_library

_v, _i64 = ctypes.c_void_p, ctypes.c_int64


class PrologueArgs(ctypes.Structure):
    """Mirror of ``MokPrologueArgs`` (csrc/include/mok/prologue.h): every field 8 bytes."""

    _fields_ = [
        ("x", _v), ("topk_ids", _v), ("topk_weights", _v), ("T", _i64), ("H", _i64), ("K", _i64),
        ("region", _v), ("rows_offset", _i64), ("ids_offset", _i64), ("scalars_offset", _i64),
        ("ntok_offset", _i64),
        ("signal_bases", _v), ("counter", _v), ("timeout_ns", _i64), ("site", _i64), ("status", _v),
        ("ids_ptrs", _v), ("ntok_ptrs", _v), ("P", _i64), ("rank", _i64), ("max_tokens", _i64), ("L", _i64),
        ("tile_rows", _i64),
        ("table", _v), ("counts", _v), ("offsets", _v), ("scratch", _v),
    ]


def _fns():
    lib = load_library()
    return lib, lib.function("mok_dispatch_prologue", ctypes.c_int, [ctypes.POINTER(PrologueArgs), _v])


def args_bytes() -> int:
    """sizeof(MokPrologueArgs) as the library was built (a layout check for the tests)."""
    return int(load_library().function("mok_prologue_args_bytes", _i64, [])())


@mok_op("mok::dispatch_prologue", mutates_args="unknown")
def dispatch_prologue(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, region: torch.Tensor,
                      rows_offset: int, ids_offset: int, scalars_offset: int, ntok_offset: int,
                      signal_bases: torch.Tensor, counter: torch.Tensor, timeout_ns: int, site: int,
                      status: torch.Tensor, ids_ptrs: torch.Tensor, ntok_ptrs: torch.Tensor, rank: int,
                      max_tokens: int, experts_per_rank: int, tile_rows: int, table: torch.Tensor,
                      counts: torch.Tensor, offsets: torch.Tensor, scratch: torch.Tensor) -> None:
    """Queue the prologue of a forward on the current stream (no host sync).

    Args:
        x: bf16 [T, H], topk_ids: int64 [T, K], topk_weights: fp32 [T, K], contiguous: this rank's
            call, copied to ``region`` at the byte offsets ``rows_offset``, ``ids_offset``,
            ``scalars_offset``, with T as int32 at ``ntok_offset``.
        region: uint8, this rank's workspace region (workspace.SymmetricLayout).
        signal_bases: int64 [P] device addresses of every rank's uint64 [P] flags; counter: int64
            [1] barrier epoch; timeout_ns, site: as ``mok::barrier`` (no barrier for P = 1).
        status: int32 [8] status word.
        ids_ptrs, ntok_ptrs: int64 [P] device addresses of every rank's published ids and T.
        rank, max_tokens, experts_per_rank, tile_rows: as ``mok::build_schedule``.
        table: int32 [table_rows, 2], counts: int32 [L], offsets: int32 [L + 1] (out); scratch:
            int32 [scratch_ints].

    The arguments are the workspace's and the validated call's (the backends build them), so only
    the C side checks them (MOK_ERR_INVALID_ARGUMENT before anything is queued).
    """
    T, K = topk_ids.shape
    args = PrologueArgs(
        x=x.data_ptr() if T else 0, topk_ids=topk_ids.data_ptr() if T else 0,
        topk_weights=topk_weights.data_ptr() if T else 0, T=T, H=x.shape[1], K=K, region=region.data_ptr(),
        rows_offset=rows_offset, ids_offset=ids_offset, scalars_offset=scalars_offset, ntok_offset=ntok_offset,
        signal_bases=signal_bases.data_ptr(), counter=counter.data_ptr(), timeout_ns=timeout_ns, site=site,
        status=status.data_ptr(), ids_ptrs=ids_ptrs.data_ptr(), ntok_ptrs=ntok_ptrs.data_ptr(),
        P=ids_ptrs.numel(), rank=rank, max_tokens=max_tokens, L=experts_per_rank, tile_rows=tile_rows,
        table=table.data_ptr(), counts=counts.data_ptr(), offsets=offsets.data_ptr(), scratch=scratch.data_ptr())
    lib, fn = _fns()
    lib.check(fn(ctypes.byref(args), stream_of(table)), "mok_dispatch_prologue")


@dispatch_prologue.register_fake
def _(x, topk_ids, topk_weights, region, rows_offset, ids_offset, scalars_offset, ntok_offset, signal_bases,
      counter, timeout_ns, site, status, ids_ptrs, ntok_ptrs, rank, max_tokens, experts_per_rank, tile_rows, table,
      counts, offsets, scratch):
    return None
