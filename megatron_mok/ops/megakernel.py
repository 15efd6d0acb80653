"""The forward megakernel (csrc/include/mok/megakernel.h) as the custom op ``mok::megakernel_forward``.

One call runs, on the current stream, a small kernel that resets the megakernel's counters and
takes the call's epoch, then the persistent kernel: pull dispatch into the ring, fc1 + SwiGLU
and fc2 tile by tile, fc2's epilogue pushing the output rows into their home ranks' slots, the
combine-done exchange and the fixed-order slot sum (docs/megakernel.md). Every size that
depends on the routing stays on the device; the host passes only capacities.

The schedule knobs are arguments of every call (``comm_ctas``, ``num_ctas``, ``minibatch_rows``,
``pairs``, ``group_blocks``: C ``MokMegakernelTunables``); the library reads no environment.
Its defaults (:func:`default_tunables`) and fixed sizes and bounds (:func:`constants`) come from
the library itself, not from copies here.

:func:`check_forward_args` validates everything before any GPU work (:class:`MegakernelArgumentError`
names the value and the rule); :func:`plan_item` and :func:`layout_blocks` expose the kernel's
work plan to the CPU tests and tools.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from typing import List, Optional, Sequence, Tuple

import torch

from ._ptr import stream_of
from .custom_op import mok_op
from .library import load_library

ITEM_KINDS = {1: "fc1", 2: "fc2", 3: "pull", 6: "pull_part"}
"""Work item kinds of the plan (mok/megakernel/plan.cuh, ItemKind) by their number."""
COUNTERS = {0: "x_ready", 1: "h_ready", 2: "fc2_done"}
"""Per-slot counters an item waits on (plan.cuh, SlotCounter) by their number."""
QUEUES = {"compute": 0, "pull": 1, "first_pull": 2}
"""The plan's work queues (plan.cuh, Queue) by name."""
TRACE_FIELDS = ("take", "ready", "start", "done", "meta", "cta")
"""Columns of a trace record (mok/megakernel/trace.cuh): %globaltimer ns when the item was
taken, its input acquired, its work started and its counter released; kind | block << 8 |
col << 40 (kind ``constants().trace_cta_kind``: a CTA's own record, role << 8); the CTA."""

_i, _i64, _v = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p


class MegakernelArgumentError(ValueError):
    """An argument of the megakernel is outside what it takes; the message says which."""


class MegakernelTunablesStruct(ctypes.Structure):
    """Mirror of ``MokMegakernelTunables`` (csrc/include/mok/megakernel.h): int64 fields."""

    _fields_ = [("comm_ctas", _i64), ("num_ctas", _i64), ("minibatch_rows", _i64), ("pairs", _i64),
                ("group_blocks", _i64)]


class MegakernelConstantsStruct(ctypes.Structure):
    """Mirror of ``MokMegakernelConstants`` (csrc/include/mok/megakernel.h): int64 fields."""

    _fields_ = [(name, _i64) for name in (
        "block_rows", "fc1_cols", "fc2_cols", "max_experts", "max_topk", "max_ranks", "first_pull_parts",
        "first_pull_minibatches", "tile_arrivals", "min_group_blocks", "max_group_blocks", "trace_fields",
        "trace_cta_kind", "max_ctas")]


class MegakernelArgs(ctypes.Structure):
    """Mirror of ``MokMegakernelArgs`` (csrc/include/mok/megakernel.h): every field 8 bytes, the
    tunables nested last."""

    _fields_ = [
        ("bases", _v), ("signal_bases", _v),
        ("rows_offset", _i64), ("scalars_offset", _i64), ("slots_offset", _i64),
        ("table", _v), ("offsets", _v), ("counts", _v), ("topk_ids", _v),
        ("fc1_weight", _v), ("fc2_weight", _v),
        ("ring_x", _v), ("ring_h", _v), ("ring_w", _v), ("counters", _v),
        ("y", _v), ("epoch_counter", _v), ("status", _v),
        ("timeout_ns", _i64),
        ("P", _i64), ("rank", _i64), ("L", _i64), ("H", _i64), ("I", _i64), ("K", _i64), ("T", _i64),
        ("ring_rows", _i64),
        ("trace", _v), ("trace_capacity", _i64),
        ("save_x", _v), ("save_w", _v), ("save_gu", _v), ("save_rows", _i64),
        ("fc1_weight2", _v), ("fc2_weight2", _v), ("L1", _i64),
        ("tunables", MegakernelTunablesStruct),
    ]


def _lib():
    lib = load_library()
    return lib, {
        "args_bytes": lib.function("mok_megakernel_args_bytes", _i64, []),
        "tunables_bytes": lib.function("mok_megakernel_tunables_bytes", _i64, []),
        "constants_bytes": lib.function("mok_megakernel_constants_bytes", _i64, []),
        "default_tunables": lib.function("mok_megakernel_default_tunables", _i,
                                         [ctypes.POINTER(MegakernelTunablesStruct)]),
        "constants": lib.function("mok_megakernel_constants", _i, [ctypes.POINTER(MegakernelConstantsStruct)]),
        "counter_words": lib.function("mok_megakernel_counter_words", _i64, [_i]),
        "plan_item": lib.function("mok_megakernel_plan_item", _i, [_i, _i, _i, _i, _i, _i, _i, _i, _i, _v]),
        "layout_blocks": lib.function("mok_megakernel_layout_blocks", _i, [_v, _i, _v, _i64]),
        "launch_shape": lib.function("mok_megakernel_launch_shape", _i, [_i64, _i64, _i64, _v]),
        "forward": lib.function("mok_megakernel_forward", _i, [ctypes.POINTER(MegakernelArgs), _v]),
    }


def _check_struct(fns, name: str, struct) -> None:
    size = int(fns[f"{name}_bytes"]())
    if size != ctypes.sizeof(struct):
        raise RuntimeError(f"the library's Mok{struct.__name__.replace('Struct', '')} is {size} bytes, "
                           f"this module's mirror {ctypes.sizeof(struct)}: rebuild the library")


@dataclasses.dataclass(frozen=True)
class MegakernelConstants:
    """The kernel's fixed sizes and bounds (C ``MokMegakernelConstants``), all ints."""

    block_rows: int              # rows of a row block: the schedule's tile_rows and the GEMM tile's height
    fc1_cols: int                # h columns of an fc1 tile: I must be a multiple
    fc2_cols: int                # output columns of an fc2 tile: H must be a multiple
    max_experts: int             # bound on the local experts L of a launch
    max_topk: int                # bound on top-k
    max_ranks: int               # bound on the EP size P
    first_pull_parts: int        # parts of a first block's pull (block_rows / parts rows each)
    first_pull_minibatches: int  # minibatches whose blocks every CTA pulls in parts when it starts
    tile_arrivals: int           # counter arrivals per GEMM tile (one per consumer warpgroup)
    min_group_blocks: int        # bounds of group_blocks (which must also be even)
    max_group_blocks: int
    trace_fields: int            # int64 words of a trace record (len(TRACE_FIELDS))
    trace_cta_kind: int          # the kind in a CTA's own trace record
    max_ctas: int                # bound on the CTAs of a launch (one trace record each)


@functools.lru_cache(maxsize=None)
def constants() -> MegakernelConstants:
    """The library's :class:`MegakernelConstants` (read once; loads the library, no GPU)."""
    lib, fns = _lib()
    for name, struct in (("args", MegakernelArgs), ("tunables", MegakernelTunablesStruct),
                         ("constants", MegakernelConstantsStruct)):
        _check_struct(fns, name, struct)
    out = MegakernelConstantsStruct()
    lib.check(fns["constants"](ctypes.byref(out)), "mok_megakernel_constants")
    c = MegakernelConstants(**{name: int(getattr(out, name)) for name, _ in MegakernelConstantsStruct._fields_})
    if c.trace_fields != len(TRACE_FIELDS):
        raise RuntimeError(f"the library's trace records have {c.trace_fields} fields, TRACE_FIELDS names "
                           f"{len(TRACE_FIELDS)}: rebuild the library")
    return c


@functools.lru_cache(maxsize=None)
def _default_tunables() -> Tuple[bool, int]:
    lib, fns = _lib()
    out = MegakernelTunablesStruct()
    lib.check(fns["default_tunables"](ctypes.byref(out)), "mok_megakernel_default_tunables")
    return bool(out.pairs), int(out.group_blocks)


def default_tunables() -> dict:
    """The library's defaults of the tunables a caller may leave unset: ``{"pairs": bool,
    "group_blocks": int}`` (``mok_megakernel_default_tunables``; comm_ctas, num_ctas and
    minibatch_rows have no library default: the caller chooses them from the shape)."""
    pairs, group_blocks = _default_tunables()
    return {"pairs": pairs, "group_blocks": group_blocks}


def trace_records(table_rows: int, hidden: int, ffn_hidden: int) -> int:
    """Trace records that hold every item of a launch whose schedule table has ``table_rows``
    rows (the row capacity), plus one per CTA and one per first-pull part."""
    c = constants()
    blocks = table_rows // c.block_rows
    # Compute records: one per tile, in pair mode one per CTA of a pair tile (at most twice
    # the tiles, when every minibatch ends on an odd block).
    return blocks * (2 * (ffn_hidden // c.fc1_cols + hidden // c.fc2_cols) + 1 + c.first_pull_parts) + c.max_ctas


def counter_words(ring_rows: int) -> int:
    """int32 words of the counter buffer for a ring of ``ring_rows`` rows."""
    _, fns = _lib()
    return int(fns["counter_words"](ring_rows // constants().block_rows))


def plan_item(queue: str, index: int, n_blocks: int, mb_blocks: int, slots: int, n1: int, n2: int,
              pairs: bool = False, group_blocks: int = 8) -> Tuple[str, int, int, str, int, int]:
    """Item ``index`` of the ``queue`` ("compute", "pull" or "first_pull") of the kernel's work
    plan for ``n_blocks`` row blocks, ``mb_blocks`` blocks per minibatch, ``slots`` ring slots,
    ``n1`` fc1 and ``n2`` fc2 column blocks. ``pairs``: the plan of a launch in clusters of two,
    whose compute items are pair tiles (the row block returned is the pair's first; the second
    is the next block when it lies in the same minibatch, see :func:`pair_partner`);
    ``group_blocks``: row blocks of a group (even, ``constants().min_group_blocks`` to
    ``max_group_blocks``).

    Returns (kind, row block, column block (the part, for "pull_part"), counter waited on, its
    slot, target value; a target <= 0 means no wait). Raises :class:`MegakernelArgumentError`
    for an index past the queue's end or bad sizes.
    """
    lib, fns = _lib()
    out = (ctypes.c_int32 * 6)()
    code = fns["plan_item"](QUEUES[queue], index, n_blocks, mb_blocks, slots, n1, n2, 1 if pairs else 0,
                            group_blocks, out)
    if code != 0:
        raise MegakernelArgumentError(f"plan_item({queue!r}, {index}) for n_blocks={n_blocks}, "
                                      f"mb_blocks={mb_blocks}, slots={slots}, n1={n1}, n2={n2}, pairs={pairs}, "
                                      f"group_blocks={group_blocks}: "
                                      f"{lib._dll.mok_error_string(code).decode()}")
    kind, block, col, counter, slot, target = list(out)
    return ITEM_KINDS[kind], block, col, COUNTERS[counter], slot, target


def layout_blocks(counts: Sequence[int]) -> List[int]:
    """The layout row block each block of the kernel's queues stands for, for a rank whose local
    experts received ``counts`` rows (int per expert): a list of ``sum(ceil(c / block_rows))``
    ints, each expert's blocks from the front and the back in turn (plan.cuh, block order)."""
    lib, fns = _lib()
    block_rows = constants().block_rows
    n_blocks = sum((int(c) + block_rows - 1) // block_rows for c in counts)
    cnt = (ctypes.c_int32 * max(len(counts), 1))(*[int(c) for c in counts])
    out = (ctypes.c_int32 * max(n_blocks, 1))()
    code = fns["layout_blocks"](cnt, len(counts), out, n_blocks)
    if code != 0:
        raise MegakernelArgumentError(f"layout_blocks for {len(counts)} experts: "
                                      f"{lib._dll.mok_error_string(code).decode()}")
    return list(out)[:n_blocks]


def pair_partner(block: int, n_blocks: int, mb_blocks: int) -> Optional[int]:
    """The second row block of the pair tile whose first block is ``block`` (pair mode), or
    None when ``block`` is the odd last block of its minibatch (mok/megakernel/plan.cuh)."""
    end = min((block // mb_blocks + 1) * mb_blocks, n_blocks)
    return block + 1 if block + 1 < end else None


def launch_shape(comm_ctas: int, num_ctas: int = 0, pairs: bool = True) -> Tuple[int, bool]:
    """(CTAs, pair mode) of the launch the forward makes on the current CUDA device for
    ``comm_ctas`` comm CTAs, ``num_ctas`` CTAs (0: one per SM) and ``pairs`` asked for. Pair mode
    runs clusters of two CTAs that share each weight tile (docs/megakernel.md); it needs an even
    grid and comm CTA count and every CTA resident as a cluster, else the launch runs single
    CTAs."""
    lib, fns = _lib()
    out = (ctypes.c_int64 * 2)()
    code = fns["launch_shape"](comm_ctas, num_ctas, 1 if pairs else 0, out)
    if code != 0:
        raise MegakernelArgumentError(f"launch_shape(comm_ctas={comm_ctas}, num_ctas={num_ctas}): "
                                      f"{lib._dll.mok_error_string(code).decode()}")
    return int(out[0]), bool(out[1])


# ---- argument checks -------------------------------------------------------------------------

def _fail(msg: str):
    raise MegakernelArgumentError(msg)


def _tensor(name, t, dtype, ndim=None, numel=None, shape=None, device=None):
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        _fail(f"{name} must be {dtype}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        _fail(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        _fail(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if numel is not None and t.numel() != numel:
        _fail(f"{name} must have {numel} elements, got {t.numel()}")
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")
    if device is not None and t.device != device:
        _fail(f"{name} is on {t.device}, the other operands on {device}")


def check_forward_args(bases, signal_bases, table, offsets, counts, topk_ids, fc1_weight, fc2_weight,
                       ring_x, ring_h, ring_w, counters, epoch_counter, status, *, rank: int,
                       minibatch_rows: int, comm_ctas: int, num_ctas: int, timeout_ns: int,
                       fc1_weight2=None, fc2_weight2=None, group_blocks: int = 8) -> None:
    """Validate :func:`megakernel_forward`'s arguments (shapes, dtypes, the tunables' rules: the
    library's own checks, before any GPU work). ``table``, ``offsets`` and ``counts`` may be None
    (checked later, when the schedule exists).

    Raises:
        MegakernelArgumentError: naming the value and the rule.
    """
    c = constants()
    _tensor("fc1_weight", fc1_weight, torch.bfloat16, 3)
    dev = fc1_weight.device
    L, two_i, H = fc1_weight.shape
    I = two_i // 2
    _tensor("fc2_weight", fc2_weight, torch.bfloat16, shape=(L, H, I), device=dev)
    if (fc1_weight2 is None) != (fc2_weight2 is None):
        _fail("fc1_weight2 and fc2_weight2 go together (the second weight segment): got only "
              + ("fc1_weight2" if fc2_weight2 is None else "fc2_weight2"))
    if fc1_weight2 is not None:
        _tensor("fc1_weight2", fc1_weight2, torch.bfloat16, 3, device=dev)
        L2 = fc1_weight2.shape[0]
        _tensor("fc1_weight2", fc1_weight2, torch.bfloat16, shape=(L2, two_i, H))
        _tensor("fc2_weight2", fc2_weight2, torch.bfloat16, shape=(L2, H, I), device=dev)
        if L2 < 1:
            _fail("fc1_weight2 holds no experts; pass None for no second segment")
        L += L2
    if not 1 <= L <= c.max_experts:
        _fail(f"L = {L} local experts is outside [1, {c.max_experts}]")
    if H % c.fc2_cols:
        _fail(f"H = {H} must be a multiple of {c.fc2_cols} (the fc2 tile's columns)")
    if two_i % 2 or I % c.fc1_cols:
        _fail(f"I = {two_i / 2:g} must be a multiple of {c.fc1_cols} (the fc1 tile's h columns)")
    _tensor("bases", bases, torch.int64, 1, device=dev)
    P = bases.numel()
    if not 1 <= P <= c.max_ranks:
        _fail(f"P = {P} ranks is outside [1, {c.max_ranks}]")
    _tensor("signal_bases", signal_bases, torch.int64, numel=P, device=dev)
    if not 0 <= rank < P:
        _fail(f"rank = {rank} is outside [0, P = {P})")
    if table is not None:
        _tensor("table", table, torch.int32, 2, device=dev)
        if table.shape[1] != 2:
            _fail(f"table must be [R_cap, 2], got {tuple(table.shape)}")
        if table.device.type == "cuda" and not torch.compiler.is_compiling() and table.data_ptr() % 8:
            _fail("table must be 8-byte aligned (fc2's epilogue reads its rows as int2)")
    if offsets is not None:
        _tensor("offsets", offsets, torch.int32, numel=L + 1, device=dev)
    if counts is not None:
        _tensor("counts", counts, torch.int32, numel=L, device=dev)
    _tensor("topk_ids", topk_ids, torch.int64, 2, device=dev)
    if not 1 <= topk_ids.shape[1] <= c.max_topk:
        _fail(f"top-k = {topk_ids.shape[1]} is outside [1, {c.max_topk}]")
    R = ring_x.shape[0] if isinstance(ring_x, torch.Tensor) and ring_x.dim() == 2 else -1
    _tensor("ring_x", ring_x, torch.bfloat16, shape=(R, H), device=dev)
    _tensor("ring_h", ring_h, torch.bfloat16, shape=(R, I), device=dev)
    _tensor("ring_w", ring_w, torch.float32, shape=(R,), device=dev)
    if minibatch_rows <= 0 or minibatch_rows % c.block_rows:
        _fail(f"minibatch_rows = {minibatch_rows} must be a positive multiple of {c.block_rows}")
    if R % minibatch_rows or R < 2 * minibatch_rows:
        _fail(f"ring_rows = {R} must be a multiple of minibatch_rows = {minibatch_rows} and at least "
              f"two minibatches ({2 * minibatch_rows}): a pull waits for the fc2 tiles of the block "
              "one ring earlier, which the compute queue must reach before that pull's fc1")
    _tensor("counters", counters, torch.int32, numel=counter_words(R), device=dev)
    _tensor("epoch_counter", epoch_counter, torch.int64, numel=1, device=dev)
    _tensor("status", status, torch.int32, numel=8, device=dev)
    if comm_ctas < 2:
        _fail(f"comm_ctas = {comm_ctas} must be at least 2 (the CTAs that pull rows)")
    if num_ctas < 0 or (num_ctas and num_ctas <= comm_ctas):
        _fail(f"num_ctas = {num_ctas} must be 0 (every SM) or above comm_ctas = {comm_ctas}")
    if timeout_ns <= 0:
        _fail(f"timeout_ns = {timeout_ns} must be positive")
    if (isinstance(group_blocks, bool) or not isinstance(group_blocks, int) or group_blocks % 2
            or not c.min_group_blocks <= group_blocks <= c.max_group_blocks):
        _fail(f"group_blocks = {group_blocks!r} must be an even number from {c.min_group_blocks} to "
              f"{c.max_group_blocks} (the row blocks of a column sweep)")


def check_save_args(save_x, save_w, save_gu, table, fc1_weight) -> None:
    """Validate the training copies of :func:`megakernel_forward`: all three or none; bf16
    ``save_x`` [N, H], fp32 ``save_w`` [N] and bf16 ``save_gu`` [N, 2I] for one row count N
    (the kept prefix of the layout, ``save_x.shape[0]``), N a multiple of
    ``constants().block_rows`` or N = R_cap (``table.shape[0]``: every row of the layout).

    Raises:
        MegakernelArgumentError: naming the tensor and the rule.
    """
    given = [t is not None for t in (save_x, save_w, save_gu)]
    if not any(given):
        return
    if not all(given):
        _fail("save_x, save_w and save_gu go together (the training copies): got "
              + ", ".join(n for n, g in zip(("save_x", "save_w", "save_gu"), given) if g) + " only")
    L, two_i, H = fc1_weight.shape
    dev = fc1_weight.device
    N = save_x.shape[0] if isinstance(save_x, torch.Tensor) and save_x.dim() == 2 else -1
    _tensor("save_x", save_x, torch.bfloat16, shape=(N, H), device=dev)
    _tensor("save_w", save_w, torch.float32, shape=(N,), device=dev)
    _tensor("save_gu", save_gu, torch.bfloat16, shape=(N, two_i), device=dev)
    block_rows = constants().block_rows
    if N % block_rows and N != table.shape[0]:
        _fail(f"the training copies' {N} rows must be a multiple of {block_rows} (a row block is kept "
              f"whole or not at all) or the table's R_cap = {table.shape[0]} rows (every row)")


# ---- the op ----------------------------------------------------------------------------------

@mok_op("mok::megakernel_forward", mutates_args="unknown")
def megakernel_forward(bases: torch.Tensor, signal_bases: torch.Tensor, rows_offset: int, scalars_offset: int,
                       slots_offset: int, table: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor,
                       topk_ids: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor,
                       ring_x: torch.Tensor, ring_h: torch.Tensor, ring_w: torch.Tensor, counters: torch.Tensor,
                       epoch_counter: torch.Tensor, status: torch.Tensor, rank: int, minibatch_rows: int,
                       comm_ctas: int, num_ctas: int, timeout_ns: int,
                       trace: Optional[torch.Tensor], save_x: Optional[torch.Tensor],
                       save_w: Optional[torch.Tensor], save_gu: Optional[torch.Tensor],
                       fc1_weight2: Optional[torch.Tensor], fc2_weight2: Optional[torch.Tensor],
                       pairs: bool = True, group_blocks: int = 8) -> torch.Tensor:
    """One MoE layer forward in one persistent launch (after the schedule kernel).

    Args:
        bases: int64 [P] device addresses of every rank's workspace region; rows_offset,
            scalars_offset, slots_offset: byte offsets of the published bf16 tokens [T_cap, H],
            fp32 router weights [T_cap, K] and bf16 combine slots [T_cap, K, H] in a region.
        signal_bases: int64 [P] device addresses of every rank's uint64 [P] flag array.
        table: int32 [R_cap, 2], offsets: int32 [L + 1], counts: int32 [L]: the schedule.
        topk_ids: int64 [T, K] this rank's ids (which slots the sum adds).
        fc1_weight: bf16 [L1, 2I, H]; fc2_weight: bf16 [L1, H, I]: the local experts' weights, or
            the first L1 of them when a second segment follows.
        ring_x: bf16 [ring_rows, H]; ring_h: bf16 [ring_rows, I]; ring_w: fp32 [ring_rows];
        counters: int32 [counter_words(ring_rows)]: the ring and its counters (overwritten).
        epoch_counter: int64 [1], the workspace's barrier counter (advanced by one).
        status: int32 [8], the workspace's status word (timeouts are recorded there).
        rank: this rank. timeout_ns: deadline of every wait.
        minibatch_rows: rows per minibatch, a positive multiple of ``constants().block_rows``
            that divides ring_rows at least twice.
        comm_ctas: CTAs that pull every first-block part the compute CTAs leave, then compute
            too; at least 2. num_ctas: CTAs of the launch (0: one per SM), else above comm_ctas.
        trace: None, or an int64 [N, 6] timeline (:data:`TRACE_FIELDS` per record; records past N
            are not written); see :func:`trace_records` for the size that holds every record.
        save_x, save_w, save_gu: None, or (for training) bf16 [N, H], fp32 [N] and bf16 [N, 2I]:
            the pulled rows, their router weights and the fc1 pre-activation (what the cuda
            backend's backward reads) of layout rows 0 .. N - 1 (expert-grouped, padding rows
            zero), overwritten; rows of the layout at or past N are not written anywhere in them
            (the ring still gets every row). N is a multiple of ``constants().block_rows``, or
            R_cap = table rows (every row; the layout ends at most there). N = 0 saves nothing.
        fc1_weight2, fc2_weight2: None, or bf16 [L2, 2I, H] and [L2, H, I]: local experts
            L1 .. L1 + L2 - 1 (a shared expert kept in its own parameters, no copy). The schedule
            then covers L = L1 + L2 experts.
        pairs: run in clusters of two CTAs that share each weight tile when the grid allows
            (:func:`launch_shape`); the results are bitwise the same either way.
        group_blocks: row blocks of a minibatch's column sweep (the CTAs that run together share
            the weight tile in L2): even, ``constants().min_group_blocks`` to
            ``max_group_blocks``; the results are bitwise the same for every value.

    Every rank of an EP group must pass the same minibatch_rows, comm_ctas, num_ctas, pairs and
    group_blocks (:func:`default_tunables` gives the library's defaults).

    Returns:
        y: bf16 [T, H], the weighted sum over the top-k slots (NaN if a status flag is set).
    """
    check_forward_args(bases, signal_bases, table, offsets, counts, topk_ids, fc1_weight, fc2_weight, ring_x,
                       ring_h, ring_w, counters, epoch_counter, status, rank=rank, minibatch_rows=minibatch_rows,
                       comm_ctas=comm_ctas, num_ctas=num_ctas, timeout_ns=timeout_ns,
                       fc1_weight2=fc1_weight2, fc2_weight2=fc2_weight2, group_blocks=group_blocks)
    if trace is not None:
        _tensor("trace", trace, torch.int64, 2, device=fc1_weight.device)
        if trace.shape[1] != len(TRACE_FIELDS):
            _fail(f"trace must be [N, {len(TRACE_FIELDS)}], got {tuple(trace.shape)}")
    check_save_args(save_x, save_w, save_gu, table, fc1_weight)
    return launch_forward(bases, signal_bases, rows_offset, scalars_offset, slots_offset, table, offsets, counts,
                          topk_ids, fc1_weight, fc2_weight, ring_x, ring_h, ring_w, counters, epoch_counter, status,
                          rank, minibatch_rows, comm_ctas, num_ctas, timeout_ns, trace, save_x, save_w, save_gu,
                          fc1_weight2, fc2_weight2, pairs, group_blocks)


def launch_forward(bases, signal_bases, rows_offset, scalars_offset, slots_offset, table, offsets, counts, topk_ids,
                   fc1_weight, fc2_weight, ring_x, ring_h, ring_w, counters, epoch_counter, status, rank,
                   minibatch_rows, comm_ctas, num_ctas, timeout_ns, trace, save_x, save_w, save_gu, fc1_weight2,
                   fc2_weight2, pairs=True, group_blocks=8) -> torch.Tensor:
    """:func:`megakernel_forward` without the Python argument checks, for callers that checked
    them already (the megakernel backend checks its workspace, ring and weights once per shape and
    builds the schedule and the training copies itself); the C side still checks every size before
    it queues anything. Same arguments and result."""
    T, K = topk_ids.shape
    # The C side keeps whole row blocks: N = R_cap, not a multiple of 128, keeps the same rows
    # rounded down (the layout's end, a multiple of 128, is at most R_cap).
    save_rows = 0
    if save_x is not None:
        block_rows = constants().block_rows
        save_rows = save_x.shape[0] // block_rows * block_rows
    if save_rows == 0:  # nothing to keep: no copies (an empty tensor may have a null address)
        save_x = save_w = save_gu = None
    L1, two_i, H = fc1_weight.shape
    L = L1 + (fc1_weight2.shape[0] if fc1_weight2 is not None else 0)
    y = torch.empty((T, H), dtype=torch.bfloat16, device=fc1_weight.device)
    args = MegakernelArgs(
        bases=bases.data_ptr(), signal_bases=signal_bases.data_ptr(), rows_offset=rows_offset,
        scalars_offset=scalars_offset, slots_offset=slots_offset, table=table.data_ptr(),
        offsets=offsets.data_ptr(), counts=counts.data_ptr(), topk_ids=topk_ids.data_ptr() if T else 0,
        fc1_weight=fc1_weight.data_ptr(), fc2_weight=fc2_weight.data_ptr(), ring_x=ring_x.data_ptr(),
        ring_h=ring_h.data_ptr(), ring_w=ring_w.data_ptr(), counters=counters.data_ptr(),
        y=y.data_ptr() if T else 0, epoch_counter=epoch_counter.data_ptr(), status=status.data_ptr(),
        timeout_ns=timeout_ns, P=bases.numel(), rank=rank, L=L, H=H, I=two_i // 2, K=K, T=T,
        ring_rows=ring_x.shape[0],
        trace=trace.data_ptr() if trace is not None else 0, trace_capacity=trace.shape[0] if trace is not None else 0,
        save_x=save_x.data_ptr() if save_x is not None else 0, save_w=save_w.data_ptr() if save_w is not None else 0,
        save_gu=save_gu.data_ptr() if save_gu is not None else 0, save_rows=save_rows,
        fc1_weight2=fc1_weight2.data_ptr() if fc1_weight2 is not None else 0,
        fc2_weight2=fc2_weight2.data_ptr() if fc2_weight2 is not None else 0, L1=L1,
        tunables=MegakernelTunablesStruct(comm_ctas=comm_ctas, num_ctas=num_ctas, minibatch_rows=minibatch_rows,
                                          pairs=1 if pairs else 0, group_blocks=group_blocks))
    lib, fns = _lib()
    lib.check(fns["forward"](ctypes.byref(args), stream_of(y)), "mok_megakernel_forward")
    return y


@megakernel_forward.register_fake
def _(bases, signal_bases, rows_offset, scalars_offset, slots_offset, table, offsets, counts, topk_ids,
      fc1_weight, fc2_weight, ring_x, ring_h, ring_w, counters, epoch_counter, status, rank, minibatch_rows,
      comm_ctas, num_ctas, timeout_ns, trace, save_x, save_w, save_gu, fc1_weight2, fc2_weight2, pairs=True,
      group_blocks=8):
    return fc1_weight.new_empty((topk_ids.shape[0], fc1_weight.shape[2]))
