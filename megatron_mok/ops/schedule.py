"""The schedule builder (csrc/src/schedule.cu) as the custom op ``mok::build_schedule``."""

from __future__ import annotations

import ctypes
from typing import List, Sequence

import torch

from ._ptr import pointer_table, ptr, stream_of
from .custom_op import mok_op
from .library import load_library

STATUS_WORDS = 8
_c_int, _c_void = ctypes.c_int, ctypes.c_void_p


def table_rows(P: int, max_tokens: int, K: int, L: int, tile_rows: int) -> int:
    """Rows of the worst-case schedule table: P * max_tokens * K + L * (tile_rows - 1)."""
    fn = load_library().function("mok_schedule_table_rows", ctypes.c_int64, [_c_int] * 5)
    return int(fn(P, max_tokens, K, L, tile_rows))


def scratch_ints(P: int, max_tokens: int, K: int, L: int) -> int:
    """int32 elements of scratch memory the builder needs."""
    fn = load_library().function("mok_schedule_scratch_ints", ctypes.c_int64, [_c_int] * 4)
    return int(fn(P, max_tokens, K, L))


def _fn():
    lib = load_library()
    fn = lib.function("mok_build_schedule", _c_int,
                      [_c_void, _c_void, _c_int, _c_int, _c_int, _c_int, _c_int, _c_int,
                       _c_void, _c_void, _c_void, _c_void, _c_void, _c_void])
    return lib, fn


@mok_op("mok::build_schedule", mutates_args=("table", "counts", "offsets", "scratch", "status"))
def build_schedule_op(
    ids_ptrs: torch.Tensor,
    ntok_ptrs: torch.Tensor,
    max_tokens: int,
    topk: int,
    rank: int,
    experts_per_rank: int,
    tile_rows: int,
    table: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    scratch: torch.Tensor,
    status: torch.Tensor,
) -> None:
    """Build the schedule table of ``rank`` on the current stream (no host sync).

    Args:
        ids_ptrs: int64 [P] on the device, addresses of each rank's int64 [T_s, K] ids.
        ntok_ptrs: int64 [P] on the device, addresses of each rank's int32 T_s.
        max_tokens: capacity per rank (T_s above it is flagged in ``status``).
        topk: K. rank: the expert owner. experts_per_rank: L. tile_rows: segment padding.
        table: int32 [table_rows(...), 2] out. counts: int32 [L] out. offsets: int32 [L+1] out.
        scratch: int32 [scratch_ints(...)]. status: int32 [8], device-accessible (pinned ok).
    """
    lib, fn = _fn()
    P = ids_ptrs.numel()
    code = fn(ptr(ids_ptrs), ptr(ntok_ptrs), P, max_tokens, topk, rank, experts_per_rank, tile_rows,
              ptr(table), ptr(counts), ptr(offsets), ptr(scratch), ptr(status), stream_of(table))
    lib.check(code, "mok_build_schedule")


@build_schedule_op.register_fake
def _(ids_ptrs, ntok_ptrs, max_tokens, topk, rank, experts_per_rank, tile_rows, table, counts,
      offsets, scratch, status) -> None:
    return None


def build_schedule_cuda(ids_per_rank: Sequence[torch.Tensor], rank: int, experts_per_rank: int,
                        tile_rows: int) -> List[torch.Tensor]:
    """Run the schedule kernel over P local id tensors (P virtual ranks on one GPU).

    Args:
        ids_per_rank: P int64 [T_s, K] CUDA tensors on one device.
        rank, experts_per_rank, tile_rows: as in :func:`megatron_mok.reference.build_schedule`.

    Returns:
        [table int32 [capacity, 2], counts int32 [L], offsets int32 [L + 1], status int32 [8]];
        only the first ``offsets[L]`` rows of ``table`` are defined.
    """
    device = ids_per_rank[0].device
    P, K = len(ids_per_rank), ids_per_rank[0].shape[1]
    L = experts_per_rank
    max_tokens = max(int(ids.shape[0]) for ids in ids_per_rank)
    ids = [i.contiguous() for i in ids_per_rank]
    ntok = [torch.tensor([i.shape[0]], dtype=torch.int32, device=device) for i in ids]
    table = torch.empty((table_rows(P, max_tokens, K, L, tile_rows), 2), dtype=torch.int32, device=device)
    counts = torch.empty(L, dtype=torch.int32, device=device)
    offsets = torch.empty(L + 1, dtype=torch.int32, device=device)
    scratch = torch.empty(max(1, scratch_ints(P, max_tokens, K, L)), dtype=torch.int32, device=device)
    status = torch.zeros(STATUS_WORDS, dtype=torch.int32, device=device)
    build_schedule_op(pointer_table(ids, device), pointer_table(ntok, device), max_tokens, K, rank, L,
                      tile_rows, table, counts, offsets, scratch, status)
    return [table, counts, offsets, status]
