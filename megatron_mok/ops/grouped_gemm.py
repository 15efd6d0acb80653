"""The Hopper grouped GEMMs of the expert FFN (csrc/src/grouped_gemm_*.cu) as custom ops.

All of them compute on the expert-grouped, tile-padded layout of the schedule table
(docs/contract.md): expert ``l`` owns rows ``[offsets[l], offsets[l+1])``, the first
``counts[l]`` real, the rest padding. ``offsets`` stays on the device (no host sync); the host
only knows ``R``, the row capacity the activations are allocated for. Rows ``>= offsets[L]`` of
every output are left unwritten (whatever the allocator gave).

Shapes (Megatron's layout): x, y, dy, dx bf16 [R, H]; fc1_weight bf16 [L, 2I, H] (gate rows,
then up rows); fc2_weight bf16 [L, H, I]; h bf16 [R, I]; gu bf16 [R, 2I] (the fc1
pre-activation, gate columns then up); router_weight fp32 [R].

Each kernel has a custom op (``mok::gemm_*``, with a fake implementation for torch.compile), a
plain wrapper that validates its arguments first (:class:`GemmArgumentError` names the value and
the rule), and a ``launch_*`` function that writes into given output tensors (for tests and
benchmarks that poison or reuse outputs).
"""

from __future__ import annotations

import ctypes
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ._ptr import ptr, stream_of
from .custom_op import mok_op
from .library import load_library

_i, _i64, _v = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p

MAX_EXPERTS = 1024
"""Local experts one launch takes (per-CTA tables in shared memory)."""




class Variant(NamedTuple):
    """A built kernel variant: the row-block height, the B columns per consumer warpgroup, TMA
    bulk stores through shared memory (else direct stores), clusters of two CTAs sharing B by
    TMA multicast."""

    block_m: int
    wg_n: int
    tma_store: bool
    multicast: bool


def _variants(*rows):
    return frozenset(Variant(*r) for r in rows)


# Built variants per GEMM (csrc/include/mok/grouped_gemm.h), and the default per layout padding
# (tile_rows), chosen from the benchmark (docs/perf-notes.md).
VARIANTS = {
    "fc1": _variants((128, 256, False, False), (64, 256, False, False), (64, 128, False, False),
              (128, 256, True, False), (64, 128, True, False), (128, 256, False, True),
              (128, 256, True, True)),
    "fc2": _variants((128, 256, False, False), (64, 256, False, False), (64, 128, False, False),
              (128, 256, True, False), (64, 128, True, False), (128, 256, True, True)),
    # Always staged (tma_store): the consumers stage bf16 dh and the producer warpgroup's spare
    # warps run the SwiGLU backward from shared memory (SwiGLUBackwardEpilogue).
    "fc2_dgrad_swiglu": _variants((128, 256, True, False), (64, 128, True, False), (128, 256, True, True)),
    "dgrad": _variants((128, 256, False, False), (64, 256, False, False), (128, 256, True, False),
                (64, 128, True, False), (128, 256, True, True)),
}
DEFAULTS = {
    "fc1": {128: Variant(128, 256, True, False), 64: Variant(64, 256, False, False)},
    "fc2": {128: Variant(128, 256, True, False), 64: Variant(64, 128, True, False)},
    "fc2_dgrad_swiglu": {128: Variant(128, 256, True, False), 64: Variant(64, 128, True, False)},
    "dgrad": {128: Variant(128, 256, True, False), 64: Variant(64, 256, False, False)},
}
WGRAD_TMA_STORE = True
"""Default epilogue of the bf16 weight gradients (an fp32 out is stored directly; fp32 accumulation
into ``main_grad`` always goes through the staging buffer, a warp reading and writing whole rows)."""


class GemmArgumentError(ValueError):
    """An argument of a grouped GEMM is outside what the kernels take; the message says which."""


def _lib():
    lib = load_library()
    return lib, {
        "fc1": lib.function("mok_gemm_fc1_swiglu", _i,
                            [_v, _v, _v, _v, _v, _v, _v, _i64, _i, _i, _i, _i, _i, _i, _i, _i, _v]),
        "fc2": lib.function("mok_gemm_fc2", _i, [_v, _v, _v, _v, _i64, _i, _i, _i, _i, _i, _i, _i, _i, _v]),
        "scratch": lib.function("mok_gemm_fc2_dgrad_scratch_floats", _i64, [_i64, _i]),
        "fc2_dgrad_swiglu": lib.function("mok_gemm_fc2_dgrad_swiglu", _i,
                                         [_v] * 10 + [_i64, _i, _i, _i, _i, _i, _i, _v]),
        "fc2_dgrad": lib.function("mok_gemm_fc2_dgrad", _i,
                                  [_v, _v, _v, _v, _i64, _i, _i, _i, _i, _i, _i, _i, _i, _v]),
        "fc1_dgrad": lib.function("mok_gemm_fc1_dgrad", _i,
                                  [_v, _v, _v, _v, _i64, _i, _i, _i, _i, _i, _i, _i, _i, _v]),
        "fc2_push": lib.function("mok_gemm_fc2_push", _i,
                                 [_v, _v, _v, _v, _v, _i64, _i64, _i, _i, _i, _i, _i, _i, _v]),
        "fc1_dgrad_push": lib.function("mok_gemm_fc1_dgrad_push", _i,
                                       [_v, _v, _v, _v, _v, _i64, _v, _i64, _i64, _i, _i, _i, _i, _i, _i, _v]),
        "wgrad": lib.function("mok_gemm_weight_grad", _i,
                              [_v, _v, _v, _v, _v, _v, _i, _i, _i, _i64, _i, _i, _i, _i64, _i64, _v, _v, _i, _v]),
    }


# ---- argument checks -------------------------------------------------------------------------

def _fail(msg: str):
    raise GemmArgumentError(msg)


def _check_matrix(name: str, t: torch.Tensor, dtype: torch.dtype, ndim: int, device, align: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        _fail(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        _fail(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        _fail(f"{name} is on {t.device}, the other operands on {device}")
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")
    if align and t.device.type == "cuda" and not torch.compiler.is_compiling() and t.data_ptr() % 16:
        _fail(f"{name} must start 16-byte aligned (address {t.data_ptr():#x})")


def _check_layout(offsets: torch.Tensor, counts: Optional[torch.Tensor], L: int, device) -> None:
    _check_matrix("offsets", offsets, torch.int32, 1, device, align=False)
    if offsets.numel() != L + 1:
        _fail(f"offsets must have L + 1 = {L + 1} entries, got {offsets.numel()}")
    if counts is not None:
        _check_matrix("counts", counts, torch.int32, 1, device, align=False)
        if counts.numel() != L:
            _fail(f"counts must have L = {L} entries, got {counts.numel()}")
    if not 1 <= L <= MAX_EXPERTS:
        _fail(f"L = {L} local experts is outside [1, {MAX_EXPERTS}]")


def variant(kernel: str, tile_rows: int, block_m: Optional[int] = None, wg_n: Optional[int] = None,
            tma_store: Optional[bool] = None, multicast: Optional[bool] = None) -> Variant:
    """The variant to launch ``kernel`` ("fc1", "fc2", "fc2_dgrad_swiglu" or "dgrad") with on a
    layout padded to ``tile_rows``: the default of :data:`DEFAULTS`, with the arguments that are
    not None replacing its fields (a block_m other than the default's starts from wg_n 256,
    direct stores, no multicast, or where that is not built from the default of the layout
    padded to block_m)."""
    if tile_rows not in (64, 128):
        _fail(f"tile_rows = {tile_rows}: the grouped GEMMs take layouts padded to 64 or 128 rows")
    v = DEFAULTS[kernel][tile_rows]
    if block_m is not None and block_m != v.block_m:
        v = Variant(block_m, 256, False, False)
        if v not in VARIANTS[kernel] and block_m in DEFAULTS[kernel]:
            v = DEFAULTS[kernel][block_m]
    v = Variant(v.block_m, v.wg_n if wg_n is None else wg_n, v.tma_store if tma_store is None else bool(tma_store),
                v.multicast if multicast is None else bool(multicast))
    if v.block_m not in (64, 128) or tile_rows % v.block_m:
        _fail(f"block_m = {v.block_m} must be 64 or 128 and divide tile_rows = {tile_rows}")
    if v not in VARIANTS[kernel]:
        _fail(f"{kernel}: {v} is not built; built: {sorted(VARIANTS[kernel])}")
    return v


def _check_multiple(what: str, value: int, mult: int, why: str) -> None:
    if value % mult:
        _fail(f"{what} = {value} must be a multiple of {mult} ({why})")


def _router_weight(rw: Optional[torch.Tensor], R: int, device) -> None:
    if rw is not None:
        _check_matrix("router_weight", rw, torch.float32, 1, device, align=False)
        if rw.numel() != R:
            _fail(f"router_weight must have one entry per row (R = {R}), got {rw.numel()}")


def check_fc1_swiglu(x, fc1_weight, offsets, counts, router_weight, tile_rows, block_m=None, wg_n=None,
                     tma_store=None, multicast=None) -> Variant:
    """Validate :func:`fc1_swiglu`'s arguments; returns the variant to launch."""
    _check_matrix("x", x, torch.bfloat16, 2, None)
    _check_matrix("fc1_weight", fc1_weight, torch.bfloat16, 3, x.device)
    R, H = x.shape
    L, two_i, H1 = fc1_weight.shape
    if H1 != H or two_i % 2:
        _fail(f"fc1_weight must be [L, 2I, H={H}], got {tuple(fc1_weight.shape)}")
    _check_layout(offsets, counts, L, x.device)
    _router_weight(router_weight, R, x.device)
    v = variant("fc1", tile_rows, block_m, wg_n, tma_store, multicast)
    _check_multiple("H", H, 64, "the K step of the kernels")
    _check_multiple("I", two_i // 2, v.wg_n * 64 // v.block_m, f"h columns of a {v.block_m}-row tile")
    return v


def check_fc2(h, fc2_weight, offsets, tile_rows, block_m=None, wg_n=None, tma_store=None,
              multicast=None, names=("h", "fc2_weight", "I", "H")) -> Variant:
    """Validate :func:`fc2`'s arguments (``names``: how errors call A, the weight, K and N;
    :func:`fc1_preact` passes its own); returns the variant to launch."""
    a_name, w_name, k_name, n_name = names
    _check_matrix(a_name, h, torch.bfloat16, 2, None)
    _check_matrix(w_name, fc2_weight, torch.bfloat16, 3, h.device)
    R, I = h.shape
    L, H, I1 = fc2_weight.shape
    if I1 != I:
        _fail(f"{w_name} must be [L, {n_name}, {k_name}={I}], got {tuple(fc2_weight.shape)}")
    _check_layout(offsets, None, L, h.device)
    v = variant("fc2", tile_rows, block_m, wg_n, tma_store, multicast)
    _check_multiple(k_name, I, 64, "the K step of the kernels")
    _check_multiple(n_name, H, v.wg_n * 128 // v.block_m, f"columns of a {v.block_m}-row tile")
    return v


def check_fc2_dgrad_swiglu(dy, fc2_weight, gu, offsets, counts, router_weight, tile_rows,
                           block_m=None, multicast=None) -> Variant:
    """Validate :func:`fc2_dgrad_swiglu`'s arguments; returns the variant to launch."""
    _check_matrix("dy", dy, torch.bfloat16, 2, None)
    _check_matrix("fc2_weight", fc2_weight, torch.bfloat16, 3, dy.device)
    _check_matrix("gu", gu, torch.bfloat16, 2, dy.device)
    R, H = dy.shape
    L, H1, I = fc2_weight.shape
    if H1 != H:
        _fail(f"fc2_weight must be [L, H={H}, I], got {tuple(fc2_weight.shape)}")
    if tuple(gu.shape) != (R, 2 * I):
        _fail(f"gu must be [R={R}, 2I={2 * I}], got {tuple(gu.shape)}")
    _check_layout(offsets, counts, L, dy.device)
    _router_weight(router_weight, R, dy.device)
    v = variant("fc2_dgrad_swiglu", tile_rows, block_m, multicast=multicast)
    _check_multiple("H", H, 64, "the K step of the kernels")
    _check_multiple("I", I, 256, f"columns of a {v.block_m}-row tile")
    return v


def check_fc2_dgrad(dy, fc2_weight, offsets, tile_rows, block_m=None, wg_n=None, tma_store=None,
                    multicast=None) -> Variant:
    """Validate :func:`fc2_dgrad`'s arguments; returns the variant to launch."""
    _check_matrix("dy", dy, torch.bfloat16, 2, None)
    _check_matrix("fc2_weight", fc2_weight, torch.bfloat16, 3, dy.device)
    H = dy.shape[1]
    L, H1, I = fc2_weight.shape
    if H1 != H:
        _fail(f"fc2_weight must be [L, H={H}, I], got {tuple(fc2_weight.shape)}")
    _check_layout(offsets, None, L, dy.device)
    v = variant("dgrad", tile_rows, block_m, wg_n, tma_store, multicast)
    _check_multiple("H", H, 64, "the K step of the kernels")
    _check_multiple("I", I, v.wg_n * 128 // v.block_m, f"columns of a {v.block_m}-row tile")
    return v


def check_fc1_dgrad(dgu, fc1_weight, offsets, tile_rows, block_m=None, wg_n=None, tma_store=None,
                    multicast=None) -> Variant:
    """Validate :func:`fc1_dgrad`'s arguments; returns the variant to launch."""
    _check_matrix("dgu", dgu, torch.bfloat16, 2, None)
    _check_matrix("fc1_weight", fc1_weight, torch.bfloat16, 3, dgu.device)
    R, two_i = dgu.shape
    L, two_i1, H = fc1_weight.shape
    if two_i1 != two_i:
        _fail(f"fc1_weight must be [L, 2I={two_i}, H], got {tuple(fc1_weight.shape)}")
    _check_layout(offsets, None, L, dgu.device)
    v = variant("dgrad", tile_rows, block_m, wg_n, tma_store, multicast)
    _check_multiple("2I", two_i, 64, "the K step of the kernels")
    _check_multiple("H", H, v.wg_n * 128 // v.block_m, f"columns of a {v.block_m}-row tile")
    return v


def check_weight_grad(a, b, offsets, out=None, counts=None) -> None:
    """Validate :func:`weight_grad`'s arguments."""
    _check_matrix("a", a, torch.bfloat16, 2, None)
    _check_matrix("b", b, torch.bfloat16, 2, a.device)
    if a.shape[0] != b.shape[0]:
        _fail(f"a and b must have the same rows, got {tuple(a.shape)} and {tuple(b.shape)}")
    L = offsets.numel() - 1
    _check_layout(offsets, counts, L, a.device)
    M, N = a.shape[1], b.shape[1]
    _check_multiple("M (columns of a)", M, 128, "the weight-gradient tile height")
    _check_multiple("N (columns of b)", N, 256, "the weight-gradient tile width")
    if out is not None:
        if out.dtype not in (torch.float32, torch.bfloat16):
            _fail(f"the weight-gradient output must be fp32 or bf16, got {out.dtype}")
        _check_matrix("out", out, out.dtype, 3, a.device)
        if tuple(out.shape) != (L, M, N):
            _fail(f"the weight-gradient output must be [L={L}, M={M}, N={N}], got {tuple(out.shape)}")


def check_expert_outputs(outs, L: int, M: int, N: int, device) -> None:
    """Validate the per-expert fp32 outputs of :func:`weight_grad_into`: a list or tuple of L
    contiguous fp32 [M, N] tensors on ``device``, each 16-byte aligned, none overlapping another."""
    if not isinstance(outs, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in outs):
        _fail(f"the per-expert outputs must be a list or tuple of tensors, got {type(outs).__name__}")
    if len(outs) != L:
        _fail(f"{len(outs)} per-expert outputs for L = {L} experts")
    for e, t in enumerate(outs):
        if t.dtype != torch.float32 or tuple(t.shape) != (M, N):
            _fail(f"per-expert output {e} must be fp32 [{M}, {N}] (a main_grad), got {t.dtype} {tuple(t.shape)}")
        if t.device != device:
            _fail(f"per-expert output {e} is on {t.device}, the operands on {device}")
        if not t.is_contiguous() or t.data_ptr() % 16:
            _fail(f"per-expert output {e} must be contiguous and 16-byte aligned")
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in outs)
    if any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
        _fail("per-expert outputs overlap: each expert needs its own fp32 [M, N]")


WGRAD_ROW_BLOCK = 64
"""Rows of a weight-gradient K block: the ranges of :func:`weight_grad_rows` start (and, but for
the last, end) at multiples of it."""


def _overlap(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.device != y.device or x.numel() == 0 or y.numel() == 0:
        return False
    a, b = x.data_ptr(), y.data_ptr()
    return a < b + y.numel() * y.element_size() and b < a + x.numel() * x.element_size()


def check_weight_grad_rows(a, b, offsets, out, row0, row1, carry_in, carry_out, accumulate=False,
                           tma_store=None, counts=None) -> None:
    """Validate :func:`weight_grad_rows`'s arguments (before any GPU work); ``out`` may also be
    the per-expert outputs of :func:`weight_grad_into` (a list or tuple, accumulated)."""
    per_expert = isinstance(out, (list, tuple))
    if not per_expert and not isinstance(out, torch.Tensor):
        _fail(f"out must be the [L, M, N] fp32 or bf16 tensor to write into, got {type(out).__name__}")
    check_weight_grad(a, b, offsets, None if per_expert else out, counts)
    R, M = a.shape
    N = b.shape[1]
    if per_expert:
        check_expert_outputs(out, offsets.numel() - 1, M, N, a.device)
        if not accumulate or tma_store:
            _fail("per-expert outputs are accumulated into (fp32 main_grad), without tma_store")
    elif accumulate and out.dtype != torch.float32:
        _fail(f"accumulating weight gradients needs an fp32 out (main_grad), got {out.dtype}")
    if not per_expert and tma_store and out.dtype != torch.bfloat16:
        _fail(f"tma_store writes a bf16 out, got {out.dtype}")
    for name, v in (("row0", row0), ("row1", row1)):
        if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)):
            _fail(f"{name} must be an int, got {type(v).__name__}")
    blk = WGRAD_ROW_BLOCK
    if row0 < 0 or row0 % blk:
        _fail(f"row0 = {row0} must be a non-negative multiple of {blk} (the K block of the weight gradients)")
    if row0 + R >= 2 ** 31 - 1:
        _fail(f"row0 + R = {row0 + R} rows: the layout's rows must stay below 2^31 - 1")
    if row1 != row0 + R:
        if row1 % blk or not row0 < row1 <= row0 + R:
            _fail(f"row1 = {row1} must be a multiple of {blk} in ({row0}, row0 + R = {row0 + R}] (a and b hold "
                  f"the R = {R} rows from row0 on), or exactly row0 + R (all of them)")
    for name, c in (("carry_in", carry_in), ("carry_out", carry_out)):
        if c is None:
            continue
        _check_matrix(name, c, torch.float32, 2, a.device)
        if tuple(c.shape) != (M, N):
            _fail(f"{name} must be fp32 [M={M}, N={N}] (one expert's partial sum), got {tuple(c.shape)}")
    if row0 > 0 and carry_in is None:
        _fail(f"carry_in is needed when row0 = {row0} > 0 (the partial sum of the expert whose rows began "
              "in the previous range)")
    if carry_in is not None and carry_out is not None:
        if carry_in is carry_out or (not torch.compiler.is_compiling() and _overlap(carry_in, carry_out)):
            _fail("carry_in and carry_out must not overlap (alternate two buffers between ranges)")
    if not torch.compiler.is_compiling():
        for name, c in (("carry_in", carry_in), ("carry_out", carry_out)):
            if c is not None and any(_overlap(c, o) for o in (out if per_expert else (out,))):
                _fail(f"{name} must not overlap out")


# ---- launchers (write into given outputs) ----------------------------------------------------

def _vargs(v: Variant):
    return int(v.block_m), int(v.wg_n), int(bool(v.tma_store)), int(bool(v.multicast))


def launch_fc1_swiglu(x, fc1_weight, offsets, counts, router_weight, h, gu, *, variant: Variant,
                      num_ctas: int = 0) -> None:
    """Run fc1 + SwiGLU into ``h`` (bf16 [R, I]) and, if not None, ``gu`` (bf16 [R, 2I])."""
    lib, fns = _lib()
    R, H = x.shape
    L, two_i, _ = fc1_weight.shape
    code = fns["fc1"](ptr(x), ptr(fc1_weight), ptr(offsets), ptr(counts), ptr(router_weight), ptr(h),
                      ptr(gu), R, L, H, two_i // 2, *_vargs(variant), num_ctas, stream_of(x))
    lib.check(code, "mok_gemm_fc1_swiglu")


def launch_fc2(h, fc2_weight, offsets, y, *, variant: Variant, num_ctas: int = 0) -> None:
    """Run fc2 into ``y`` (bf16 [R, H])."""
    lib, fns = _lib()
    R, I = h.shape
    L, H, _ = fc2_weight.shape
    code = fns["fc2"](ptr(h), ptr(fc2_weight), ptr(offsets), ptr(y), R, L, H, I, *_vargs(variant), num_ctas,
                      stream_of(h))
    lib.check(code, "mok_gemm_fc2")


def dgrad_scratch_floats(rows: int, inter: int) -> int:
    """fp32 elements of the scratch :func:`launch_fc2_dgrad_swiglu` needs with a router weight."""
    _, fns = _lib()
    return int(fns["scratch"](rows, inter))


def launch_fc2_dgrad_swiglu(dy, fc2_weight, gu, offsets, counts, router_weight, dgu, h_out,
                            d_router_weight, scratch, *, variant: Variant, num_ctas: int = 0) -> None:
    """Run the fc2 data gradient + SwiGLU backward into ``dgu`` (bf16 [R, 2I]), ``h_out`` (bf16
    [R, I] or None) and ``d_router_weight`` (fp32 [R], with ``scratch`` fp32
    [dgrad_scratch_floats(R, I)], both None without a router weight)."""
    lib, fns = _lib()
    R, H = dy.shape
    L, _, I = fc2_weight.shape
    code = fns["fc2_dgrad_swiglu"](ptr(dy), ptr(fc2_weight), ptr(gu), ptr(offsets), ptr(counts),
                                   ptr(router_weight), ptr(dgu), ptr(h_out), ptr(d_router_weight), ptr(scratch),
                                   R, L, H, I, int(variant.block_m), int(bool(variant.multicast)), num_ctas,
                                   stream_of(dy))
    lib.check(code, "mok_gemm_fc2_dgrad_swiglu")


def launch_fc2_dgrad(dy, fc2_weight, offsets, dh, *, variant: Variant, num_ctas: int = 0) -> None:
    """Run the plain fc2 data gradient dh = dy D_e into ``dh`` (bf16 [R, I])."""
    lib, fns = _lib()
    R, H = dy.shape
    L, _, I = fc2_weight.shape
    code = fns["fc2_dgrad"](ptr(dy), ptr(fc2_weight), ptr(offsets), ptr(dh), R, L, H, I, *_vargs(variant),
                            num_ctas, stream_of(dy))
    lib.check(code, "mok_gemm_fc2_dgrad")


def launch_fc1_dgrad(dgu, fc1_weight, offsets, dx, *, variant: Variant, num_ctas: int = 0) -> None:
    """Run the fc1 data gradient into ``dx`` (bf16 [R, H])."""
    lib, fns = _lib()
    R, two_i = dgu.shape
    L, _, H = fc1_weight.shape
    code = fns["fc1_dgrad"](ptr(dgu), ptr(fc1_weight), ptr(offsets), ptr(dx), R, L, H, two_i // 2,
                            *_vargs(variant), num_ctas, stream_of(dgu))
    lib.check(code, "mok_gemm_fc1_dgrad")


def launch_weight_grad(a, b, offsets, out, *, counts: Optional[torch.Tensor] = None, accumulate: bool = False,
                       tma_store: Optional[bool] = None, num_ctas: int = 0, row0: int = 0,
                       row1: Optional[int] = None, carry_in: Optional[torch.Tensor] = None,
                       carry_out: Optional[torch.Tensor] = None, out_table: Optional[torch.Tensor] = None) -> None:
    """out[e] (+)= a_e^T b_e over expert e's rows; ``out`` fp32 or bf16 [L, M, N].
    ``counts`` int32 [L] (or None): the real rows per expert, whose 64-row blocks of padding past
    the last real row the K loop skips. ``tma_store`` (bf16 out only) defaults to
    :data:`WGRAD_TMA_STORE` for bf16. ``row0``, ``row1`` (None: row0 + R), ``carry_in``,
    ``carry_out``: a range of the layout's rows, as in :func:`weight_grad_rows` (a, b [R, .] hold
    rows row0 .. row0 + R - 1). ``out_table`` (accumulate only; ``out`` is then None): int64 [L]
    device addresses of the experts' fp32 [M, N] outputs (:func:`expert_table`)."""
    lib, fns = _lib()
    R, M = a.shape
    N = b.shape[1]
    L = offsets.numel() - 1
    out_bf16 = out is not None and out.dtype == torch.bfloat16
    if out_bf16 and accumulate:
        _fail("accumulating weight gradients needs an fp32 output (main_grad)")
    tma = (out_bf16 and WGRAD_TMA_STORE) if tma_store is None else bool(tma_store)
    code = fns["wgrad"](ptr(a), ptr(b), ptr(offsets), ptr(counts), ptr(out), ptr(out_table), int(out_bf16),
                        int(accumulate), int(tma), R, L, M, N, int(row0), int(row0 + R if row1 is None else row1),
                        ptr(carry_in), ptr(carry_out), num_ctas, stream_of(a))
    lib.check(code, "mok_gemm_weight_grad")


_TABLES: Dict[Tuple[torch.device, Tuple[int, ...]], torch.Tensor] = {}
_TABLES_MAX = 4096


def expert_table(outs: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 [L] on the outputs' device: the address of each expert's output (for
    ``mok_gemm_weight_grad``'s ``out_table``). Cached by the addresses, so a training loop that
    accumulates into the same ``main_grad`` buffers every step copies the table to the device once
    (and a CUDA graph captures no host-to-device copy)."""
    key = (outs[0].device, tuple(t.data_ptr() for t in outs))
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= _TABLES_MAX:
            _TABLES.clear()
        table = torch.tensor(key[1], dtype=torch.int64).to(outs[0].device)
        _TABLES[key] = table
    return table


# ---- custom ops ------------------------------------------------------------------------------
# The variant travels as four ints (block_m, wg_n, tma_store, multicast).

@mok_op("mok::gemm_fc1_swiglu", mutates_args=())
def gemm_fc1_swiglu_op(x: torch.Tensor, fc1_weight: torch.Tensor, offsets: torch.Tensor,
                       counts: torch.Tensor, router_weight: Optional[torch.Tensor], variant: List[int],
                       save_preact: bool, num_ctas: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """h = silu(x G^T) * (x U^T) [* router_weight] per expert; see :func:`fc1_swiglu`.

    Returns h bf16 [R, I] and gu bf16 [R, 2I] (the pre-activation; [0, 2I] unless save_preact).
    """
    R = x.shape[0]
    two_i = fc1_weight.shape[1]
    h = x.new_empty((R, two_i // 2))
    gu = x.new_empty((R if save_preact else 0, two_i))
    launch_fc1_swiglu(x, fc1_weight, offsets, counts, router_weight, h, gu if save_preact else None,
                      variant=Variant(*variant), num_ctas=num_ctas)
    return h, gu


@gemm_fc1_swiglu_op.register_fake
def _(x, fc1_weight, offsets, counts, router_weight, variant, save_preact, num_ctas):
    R, two_i = x.shape[0], fc1_weight.shape[1]
    return x.new_empty((R, two_i // 2)), x.new_empty((R if save_preact else 0, two_i))


@mok_op("mok::gemm_fc2", mutates_args=())
def gemm_fc2_op(h: torch.Tensor, fc2_weight: torch.Tensor, offsets: torch.Tensor, variant: List[int],
                num_ctas: int) -> torch.Tensor:
    """y = h D^T per expert (bf16 [R, H]); see :func:`fc2`."""
    y = h.new_empty((h.shape[0], fc2_weight.shape[1]))
    launch_fc2(h, fc2_weight, offsets, y, variant=Variant(*variant), num_ctas=num_ctas)
    return y


@gemm_fc2_op.register_fake
def _(h, fc2_weight, offsets, variant, num_ctas):
    return h.new_empty((h.shape[0], fc2_weight.shape[1]))


def _fc2_dgrad_swiglu_into(dy, fc2_weight, gu, offsets, counts, router_weight, dgu, variant: List[int], want_h: bool,
                           num_ctas: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fc2 data gradient + SwiGLU backward into ``dgu`` (bf16 [R, 2I]: a new buffer, or ``gu``
    itself). Returns d_router_weight fp32 [R] ([0] without router_weight) and h bf16 [R, I]
    ([0, I] unless want_h)."""
    R, I = dy.shape[0], fc2_weight.shape[2]
    h = dy.new_empty((R if want_h else 0, I))
    weighted = router_weight is not None
    dw = dy.new_empty((R if weighted else 0,), dtype=torch.float32)
    scratch = dy.new_empty((dgrad_scratch_floats(R, I) if weighted else 0,), dtype=torch.float32)
    launch_fc2_dgrad_swiglu(dy, fc2_weight, gu, offsets, counts, router_weight, dgu, h if want_h else None,
                            dw if weighted else None, scratch if weighted else None, variant=Variant(*variant),
                            num_ctas=num_ctas)
    return dw, h


@mok_op("mok::gemm_fc2_dgrad_swiglu", mutates_args=())
def gemm_fc2_dgrad_swiglu_op(dy: torch.Tensor, fc2_weight: torch.Tensor, gu: torch.Tensor, offsets: torch.Tensor,
                             counts: torch.Tensor, router_weight: Optional[torch.Tensor], variant: List[int],
                             want_h: bool, num_ctas: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fc2 data gradient fused with the SwiGLU backward; see :func:`fc2_dgrad_swiglu`.

    Returns dgu bf16 [R, 2I]; d_router_weight fp32 [R] ([0] without router_weight); h bf16
    [R, I] recomputed ([0, I] unless want_h).
    """
    dgu = dy.new_empty((dy.shape[0], 2 * fc2_weight.shape[2]))
    dw, h = _fc2_dgrad_swiglu_into(dy, fc2_weight, gu, offsets, counts, router_weight, dgu, variant, want_h, num_ctas)
    return dgu, dw, h


@gemm_fc2_dgrad_swiglu_op.register_fake
def _(dy, fc2_weight, gu, offsets, counts, router_weight, variant, want_h, num_ctas):
    R, I = dy.shape[0], fc2_weight.shape[2]
    return (dy.new_empty((R, 2 * I)), dy.new_empty((R if router_weight is not None else 0,), dtype=torch.float32),
            dy.new_empty((R if want_h else 0, I)))


@mok_op("mok::gemm_fc2_dgrad_swiglu_", mutates_args=("gu",))
def gemm_fc2_dgrad_swiglu_inplace_op(dy: torch.Tensor, fc2_weight: torch.Tensor, gu: torch.Tensor,
                                     offsets: torch.Tensor, counts: torch.Tensor,
                                     router_weight: Optional[torch.Tensor], variant: List[int], want_h: bool,
                                     num_ctas: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`gemm_fc2_dgrad_swiglu_op` writing dgu over gu; see :func:`fc2_dgrad_swiglu_`.

    Returns d_router_weight fp32 [R] ([0] without router_weight) and h bf16 [R, I] ([0, I]
    unless want_h).
    """
    return _fc2_dgrad_swiglu_into(dy, fc2_weight, gu, offsets, counts, router_weight, gu, variant, want_h, num_ctas)


@gemm_fc2_dgrad_swiglu_inplace_op.register_fake
def _(dy, fc2_weight, gu, offsets, counts, router_weight, variant, want_h, num_ctas):
    R, I = dy.shape[0], fc2_weight.shape[2]
    return (dy.new_empty((R if router_weight is not None else 0,), dtype=torch.float32),
            dy.new_empty((R if want_h else 0, I)))


@mok_op("mok::gemm_fc2_dgrad", mutates_args=())
def gemm_fc2_dgrad_op(dy: torch.Tensor, fc2_weight: torch.Tensor, offsets: torch.Tensor, variant: List[int],
                      num_ctas: int) -> torch.Tensor:
    """dh = dy D per expert (bf16 [R, I]); see :func:`fc2_dgrad`."""
    dh = dy.new_empty((dy.shape[0], fc2_weight.shape[2]))
    launch_fc2_dgrad(dy, fc2_weight, offsets, dh, variant=Variant(*variant), num_ctas=num_ctas)
    return dh


@gemm_fc2_dgrad_op.register_fake
def _(dy, fc2_weight, offsets, variant, num_ctas):
    return dy.new_empty((dy.shape[0], fc2_weight.shape[2]))


@mok_op("mok::gemm_fc1_dgrad", mutates_args=())
def gemm_fc1_dgrad_op(dgu: torch.Tensor, fc1_weight: torch.Tensor, offsets: torch.Tensor, variant: List[int],
                      num_ctas: int) -> torch.Tensor:
    """dx = dgu W1 per expert (bf16 [R, H]); see :func:`fc1_dgrad`."""
    dx = dgu.new_empty((dgu.shape[0], fc1_weight.shape[2]))
    launch_fc1_dgrad(dgu, fc1_weight, offsets, dx, variant=Variant(*variant), num_ctas=num_ctas)
    return dx


@gemm_fc1_dgrad_op.register_fake
def _(dgu, fc1_weight, offsets, variant, num_ctas):
    return dgu.new_empty((dgu.shape[0], fc1_weight.shape[2]))


@mok_op("mok::gemm_weight_grad", mutates_args=())
def gemm_weight_grad_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype,
                        tma_store: bool, num_ctas: int, counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out[e] = a_e^T b_e per expert ([L, M, N] in ``out_dtype``, fp32 or bf16)."""
    out = a.new_empty((offsets.shape[0] - 1, a.shape[1], b.shape[1]), dtype=out_dtype)
    launch_weight_grad(a, b, offsets, out, counts=counts, accumulate=False,
                       tma_store=tma_store and out_dtype == torch.bfloat16, num_ctas=num_ctas)
    return out


@gemm_weight_grad_op.register_fake
def _(a, b, offsets, out_dtype, tma_store, num_ctas, counts=None):
    return a.new_empty((offsets.shape[0] - 1, a.shape[1], b.shape[1]), dtype=out_dtype)


@mok_op("mok::gemm_weight_grad_accumulate", mutates_args=("main_grad",))
def gemm_weight_grad_accumulate_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                                   main_grad: torch.Tensor, num_ctas: int,
                                   counts: Optional[torch.Tensor] = None) -> None:
    """main_grad[e] += a_e^T b_e per expert (fp32 [L, M, N], e.g. Megatron's main_grad)."""
    launch_weight_grad(a, b, offsets, main_grad, counts=counts, accumulate=True, num_ctas=num_ctas)


@gemm_weight_grad_accumulate_op.register_fake
def _(a, b, offsets, main_grad, num_ctas, counts=None) -> None:
    return None


@mok_op("mok::gemm_weight_grad_rows", mutates_args=("out", "carry_out"))
def gemm_weight_grad_rows_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                             row0: int, row1: int, carry_in: Optional[torch.Tensor],
                             carry_out: Optional[torch.Tensor], accumulate: bool, tma_store: bool,
                             num_ctas: int, counts: Optional[torch.Tensor] = None) -> None:
    """The weight gradients over the layout rows [row0, row1) into ``out`` (and ``carry_out``);
    see :func:`weight_grad_rows`."""
    launch_weight_grad(a, b, offsets, out, counts=counts, accumulate=accumulate, tma_store=tma_store,
                       num_ctas=num_ctas, row0=row0, row1=row1, carry_in=carry_in, carry_out=carry_out)


@mok_op("mok::gemm_weight_grad_into", mutates_args=("outs", "carry_out"))
def gemm_weight_grad_into_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, outs: List[torch.Tensor],
                             row0: int, row1: int, carry_in: Optional[torch.Tensor],
                             carry_out: Optional[torch.Tensor], num_ctas: int,
                             counts: Optional[torch.Tensor] = None) -> None:
    """outs[e] += a_e^T b_e (fp32 per-expert tensors, through their address table) over the
    layout rows [row0, row1); see :func:`weight_grad_into`."""
    launch_weight_grad(a, b, offsets, None, counts=counts, accumulate=True, tma_store=False, num_ctas=num_ctas,
                       row0=row0, row1=row1, carry_in=carry_in, carry_out=carry_out, out_table=expert_table(outs))


@gemm_weight_grad_into_op.register_fake
def _(a, b, offsets, outs, row0, row1, carry_in, carry_out, num_ctas, counts=None) -> None:
    return None


@gemm_weight_grad_rows_op.register_fake
def _(a, b, offsets, out, row0, row1, carry_in, carry_out, accumulate, tma_store, num_ctas, counts=None) -> None:
    return None


# ---- plain wrappers --------------------------------------------------------------------------

def fc1_swiglu(x: torch.Tensor, fc1_weight: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor,
               router_weight: Optional[torch.Tensor] = None, *, tile_rows: int = 128, save_preact: bool = False,
               block_m: Optional[int] = None, wg_n: Optional[int] = None, tma_store: Optional[bool] = None,
               multicast: Optional[bool] = None,
               num_ctas: int = 0) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """fc1 of every local expert with the SwiGLU epilogue fused.

    h[r] = silu(x[r] G_e^T) * (x[r] U_e^T) [* router_weight[r]] for the rows r of expert e;
    padding rows of h (and gu) are 0.

    Args:
        x: bf16 [R, H], expert-grouped rows. fc1_weight: bf16 [L, 2I, H] (gate rows, then up).
        offsets: int32 [L + 1] on the device, multiples of ``tile_rows``. counts: int32 [L].
        router_weight: fp32 [R] or None (apply the router weight here instead of in combine).
        tile_rows: the padding of the layout (64 or 128). save_preact: also return gu.
        block_m, wg_n, tma_store, multicast: the kernel variant (:class:`Variant`); None takes
        :data:`DEFAULTS` for ``tile_rows``. num_ctas: persistent CTAs, 0 = as many as fit.

    Returns:
        (h bf16 [R, I], gu bf16 [R, 2I] = [x G^T | x U^T] or None).
    """
    v = check_fc1_swiglu(x, fc1_weight, offsets, counts, router_weight, tile_rows, block_m, wg_n, tma_store,
                         multicast)
    h, gu = gemm_fc1_swiglu_op(x, fc1_weight, offsets, counts, router_weight, list(_vargs(v)), save_preact,
                               num_ctas)
    return h, (gu if save_preact else None)


def fc2(h: torch.Tensor, fc2_weight: torch.Tensor, offsets: torch.Tensor, *, tile_rows: int = 128,
        block_m: Optional[int] = None, wg_n: Optional[int] = None, tma_store: Optional[bool] = None,
        multicast: Optional[bool] = None, num_ctas: int = 0) -> torch.Tensor:
    """fc2 of every local expert: y[r] = h[r] D_e^T.

    Args:
        h: bf16 [R, I]. fc2_weight: bf16 [L, H, I]. offsets: int32 [L + 1] on the device.
        tile_rows, block_m, wg_n, tma_store, multicast, num_ctas: as in :func:`fc1_swiglu`.

    Returns:
        y bf16 [R, H] (padding rows hold h's padding rows times D_e: zeros for fc1's h).
    """
    v = check_fc2(h, fc2_weight, offsets, tile_rows, block_m, wg_n, tma_store, multicast)
    return gemm_fc2_op(h, fc2_weight, offsets, list(_vargs(v)), num_ctas)


def fc1_preact(x: torch.Tensor, fc1_weight: torch.Tensor, offsets: torch.Tensor, *, tile_rows: int = 128,
               block_m: Optional[int] = None, wg_n: Optional[int] = None, tma_store: Optional[bool] = None,
               multicast: Optional[bool] = None, num_ctas: int = 0) -> torch.Tensor:
    """fc1 without its activation: gu[r] = x[r] W1_e^T, for a SwiGLU run separately.

    The same plain row GEMM as :func:`fc2` (fc1_weight [L, 2I, H] is its [L, N, K] weight). No
    backend runs it (the fused :func:`fc1_swiglu`, which applies SwiGLU as well, measured faster,
    docs/perf-notes.md); it is the tests' check that :func:`fc1_swiglu`'s saved gu is bitwise
    the plain GEMM's.

    Args:
        x: bf16 [R, H]. fc1_weight: bf16 [L, 2I, H]. offsets, tile_rows, block_m, wg_n, tma_store,
        multicast, num_ctas: as in :func:`fc1_swiglu` (variants: those of ``fc2``).

    Returns:
        gu bf16 [R, 2I] (gate columns, then up columns); padding rows are x's padding rows times W1.
    """
    v = check_fc2(x, fc1_weight, offsets, tile_rows, block_m, wg_n, tma_store, multicast,
                  names=("x", "fc1_weight", "H", "2I"))
    return gemm_fc2_op(x, fc1_weight, offsets, list(_vargs(v)), num_ctas)


def fc2_dgrad_swiglu(dy: torch.Tensor, fc2_weight: torch.Tensor, gu: torch.Tensor, offsets: torch.Tensor,
                     counts: torch.Tensor, router_weight: Optional[torch.Tensor] = None, *, tile_rows: int = 128,
                     want_h: bool = False, block_m: Optional[int] = None, multicast: Optional[bool] = None,
                     num_ctas: int = 0) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Data gradient of fc2 fused with the SwiGLU backward.

    With dh = dy D_e rounded to bf16, (g, u) = gu[r] and w = router_weight[r] (1 when None):
    dgu[r] = [w dh u silu'(g) | w dh silu(g)]; d_router_weight[r] = sum_i dh silu(g) u. Bitwise
    what :func:`fc2_dgrad` (same tile) followed by ``swiglu_ops.swiglu_backward`` gives, on the
    real rows; the SwiGLU part runs in the producer warpgroup's spare warps, overlapped with the
    next tile's K loop (docs/gemm.md).

    Args:
        dy: bf16 [R, H], gradient of fc2's output rows. fc2_weight: bf16 [L, H, I].
        gu: bf16 [R, 2I], fc1's pre-activation (``fc1_swiglu(..., save_preact=True)``).
        offsets, counts, router_weight, tile_rows, block_m, multicast, num_ctas: as in
        :func:`fc1_swiglu` (tiles of 256 columns: wg_n 256 at block_m 128, 128 at 64).
        want_h: also return h = w silu(g) u recomputed (the operand of fc2's weight gradient).

    Returns:
        (dgu bf16 [R, 2I], d_router_weight fp32 [R] or None, h bf16 [R, I] or None); padding
        rows are 0.
    """
    v = check_fc2_dgrad_swiglu(dy, fc2_weight, gu, offsets, counts, router_weight, tile_rows, block_m, multicast)
    dgu, dw, h = gemm_fc2_dgrad_swiglu_op(dy, fc2_weight, gu, offsets, counts, router_weight, list(_vargs(v)),
                                          want_h, num_ctas)
    return dgu, (dw if router_weight is not None else None), (h if want_h else None)


def fc2_dgrad_swiglu_(dy: torch.Tensor, fc2_weight: torch.Tensor, gu: torch.Tensor, offsets: torch.Tensor,
                      counts: torch.Tensor, router_weight: Optional[torch.Tensor] = None, *, tile_rows: int = 128,
                      want_h: bool = False, block_m: Optional[int] = None, multicast: Optional[bool] = None,
                      num_ctas: int = 0) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """:func:`fc2_dgrad_swiglu` with dgu written over ``gu`` (bitwise the same values): the
    backward then holds no second [R, 2I] buffer. Each element of gu is read, by the one thread
    that computes it, before its gradient is written there.

    Returns:
        (d_router_weight fp32 [R] or None, h bf16 [R, I] or None); ``gu`` holds dgu.
    """
    v = check_fc2_dgrad_swiglu(dy, fc2_weight, gu, offsets, counts, router_weight, tile_rows, block_m, multicast)
    dw, h = gemm_fc2_dgrad_swiglu_inplace_op(dy, fc2_weight, gu, offsets, counts, router_weight, list(_vargs(v)),
                                             want_h, num_ctas)
    return (dw if router_weight is not None else None), (h if want_h else None)


def fc2_dgrad(dy: torch.Tensor, fc2_weight: torch.Tensor, offsets: torch.Tensor, *, tile_rows: int = 128,
              block_m: Optional[int] = None, wg_n: Optional[int] = None, tma_store: Optional[bool] = None,
              multicast: Optional[bool] = None, num_ctas: int = 0) -> torch.Tensor:
    """Plain data gradient of fc2: dh[r] = dy[r] D_e (for a SwiGLU backward run separately).

    Args:
        dy: bf16 [R, H]. fc2_weight: bf16 [L, H, I]. offsets, tile_rows, block_m, wg_n,
        tma_store, multicast, num_ctas: as in :func:`fc1_swiglu`.

    Returns:
        dh bf16 [R, I].
    """
    v = check_fc2_dgrad(dy, fc2_weight, offsets, tile_rows, block_m, wg_n, tma_store, multicast)
    return gemm_fc2_dgrad_op(dy, fc2_weight, offsets, list(_vargs(v)), num_ctas)


def fc1_dgrad(dgu: torch.Tensor, fc1_weight: torch.Tensor, offsets: torch.Tensor, *, tile_rows: int = 128,
              block_m: Optional[int] = None, wg_n: Optional[int] = None, tma_store: Optional[bool] = None,
              multicast: Optional[bool] = None, num_ctas: int = 0) -> torch.Tensor:
    """Data gradient of fc1: dx[r] = dgu[r] W1_e with W1_e = fc1_weight[e] as [2I, H].

    Args:
        dgu: bf16 [R, 2I]. fc1_weight: bf16 [L, 2I, H]. offsets, tile_rows, block_m, wg_n,
        tma_store, multicast, num_ctas: as in :func:`fc1_swiglu`.

    Returns:
        dx bf16 [R, H].
    """
    v = check_fc1_dgrad(dgu, fc1_weight, offsets, tile_rows, block_m, wg_n, tma_store, multicast)
    return gemm_fc1_dgrad_op(dgu, fc1_weight, offsets, list(_vargs(v)), num_ctas)


def weight_grad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, counts: Optional[torch.Tensor] = None, *,
                out_dtype: torch.dtype = torch.float32, main_grad: Optional[torch.Tensor] = None,
                tma_store: Optional[bool] = None, num_ctas: int = 0) -> torch.Tensor:
    """Weight gradient of every local expert: out[e] = a[rows of e]^T b[rows of e].

    fc1: ``weight_grad(dgu, x, offsets)`` -> [L, 2I, H]; fc2: ``weight_grad(dy, h, offsets)``
    -> [L, H, I]. Deterministic (no atomics, fixed order).

    Args:
        a: bf16 [R, M]. b: bf16 [R, N]. offsets: int32 [L + 1] on the device, multiples of 64.
        counts: int32 [L] on the device, the real rows of each expert (rows past them in its
            segment are zeros): the K loop skips the 64-row blocks of padding past the last real
            row (at ~170 rows per expert in 128-row segments, a quarter of them). None: every row.
        out_dtype: fp32 or bf16 for a new output. main_grad: fp32 [L, M, N] to accumulate into
        (Megatron's ``main_grad``); it is returned. tma_store: staged TMA stores for a bf16
        output (default :data:`WGRAD_TMA_STORE`). num_ctas: 0 = one per SM.

    Returns:
        [L, M, N]: ``main_grad`` (accumulated) or a new tensor in ``out_dtype``.
    """
    if main_grad is not None:
        if main_grad.dtype != torch.float32:
            _fail(f"main_grad must be fp32 to accumulate into, got {main_grad.dtype}")
        check_weight_grad(a, b, offsets, main_grad, counts)
        gemm_weight_grad_accumulate_op(a, b, offsets, main_grad, num_ctas, counts)
        return main_grad
    if out_dtype not in (torch.float32, torch.bfloat16):
        _fail(f"out_dtype must be fp32 or bf16, got {out_dtype}")
    check_weight_grad(a, b, offsets, None, counts)
    tma = WGRAD_TMA_STORE if tma_store is None else bool(tma_store)
    return gemm_weight_grad_op(a, b, offsets, out_dtype, tma, num_ctas, counts)


def weight_grad_rows(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, *, row0: int,
                     row1: int, carry_in: Optional[torch.Tensor], carry_out: Optional[torch.Tensor],
                     counts: Optional[torch.Tensor] = None, accumulate: bool = False,
                     tma_store: Optional[bool] = None, num_ctas: int = 0) -> None:
    """The weight gradients of :func:`weight_grad` over one range [row0, row1) of the layout's
    rows, for a caller that walks the layout in chunks and holds one chunk's rows at a time.

    Expert e with segment [g0, g1) = [offsets[e], offsets[e+1]) takes part when g0 < row1 and
    g1 > row0 (an empty one when row0 <= g0 <= row1); its K loop runs over its rows inside the
    range, in the 64-row blocks and the order of the whole-layout call. Its accumulator starts
    from ``carry_in`` when g0 < row0, and goes to ``carry_out`` instead of ``out`` when g1 > row1
    and ``carry_out`` is given; otherwise ``out[e]`` is written (bf16 or fp32) or accumulated
    into, as :func:`weight_grad` does. Experts without a part are not touched. Calling range by
    range over consecutive ranges, each call's ``carry_out`` the next call's ``carry_in`` (two
    buffers, alternated), gives ``out`` bitwise equal to one call over the whole layout.

    Args:
        a: bf16 [R, M], b: bf16 [R, N]: layout rows row0 .. row0 + R - 1 (row r of the layout is
            row r - row0 of a and b). offsets: int32 [L + 1] on the device, the whole layout's
            (multiples of 64). counts: int32 [L], the whole layout's real rows per expert, or
            None: as in :func:`weight_grad` (the carries still follow the segments).
        out: [L, M, N], bf16 or fp32 (fp32 with ``accumulate``: out += ..., main_grad).
        row0: a multiple of 64. row1: a multiple of 64 in (row0, row0 + R], or exactly row0 + R
            (every row a and b hold; any R, the form of the last range).
        carry_in: fp32 [M, N], the partial sum the previous range carried out; needed when
            row0 > 0 (read only when an expert's segment spans row0).
        carry_out: fp32 [M, N] receiving the partial sum of the expert whose segment goes on
            past row1; None for the last range (row1 at or past offsets[L]). Must not overlap
            ``carry_in``.
        accumulate: add into the fp32 ``out``. tma_store: staged TMA stores for a bf16 ``out``
            (default :data:`WGRAD_TMA_STORE`). num_ctas: 0 = one per SM.
    """
    check_weight_grad_rows(a, b, offsets, out, row0, row1, carry_in, carry_out, accumulate, tma_store, counts)
    tma = out.dtype == torch.bfloat16 and (WGRAD_TMA_STORE if tma_store is None else bool(tma_store))
    gemm_weight_grad_rows_op(a, b, offsets, out, row0, row1, carry_in, carry_out, bool(accumulate), tma, num_ctas,
                             counts)


def weight_grad_into(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, outs: Sequence[torch.Tensor], *,
                     counts: Optional[torch.Tensor] = None, row0: int = 0, row1: Optional[int] = None,
                     carry_in: Optional[torch.Tensor] = None, carry_out: Optional[torch.Tensor] = None,
                     num_ctas: int = 0) -> None:
    """Gradient-accumulation fusion: ``outs[e] += a[rows of e]^T b[rows of e]`` in fp32, for
    per-expert outputs that lie anywhere (Megatron's ``main_grad`` of each expert parameter, which
    its gradient buffer need not place one after the other). Bitwise what
    :func:`weight_grad_rows` with ``accumulate=True`` gives into an [L, M, N] tensor holding the
    same values.

    Args:
        a: bf16 [R, M], b: bf16 [R, N]: layout rows row0 .. row0 + R - 1.
        offsets: int32 [L + 1] (the whole layout's). counts: int32 [L] or None, as in
            :func:`weight_grad`.
        outs: L contiguous fp32 [M, N] tensors, 16-byte aligned, pairwise disjoint; accumulated into.
        row0, row1 (None: row0 + R), carry_in, carry_out: a range of the layout's rows and its
            carries, as in :func:`weight_grad_rows`.
        num_ctas: 0 = one per SM.
    """
    row1 = row0 + a.shape[0] if row1 is None else row1
    if not isinstance(outs, (list, tuple)):
        _fail(f"the per-expert outputs must be a list or tuple of tensors, got {type(outs).__name__}")
    outs = list(outs)
    check_weight_grad_rows(a, b, offsets, outs, row0, row1, carry_in, carry_out, True, None, counts)
    gemm_weight_grad_into_op(a, b, offsets, outs, row0, row1, carry_in, carry_out, num_ctas, counts)


# ---- row GEMMs that push their output rows home ----------------------------------------------
# fc2 (forward) and the fc1 data gradient (backward) of the unfused path, whose epilogue stores
# each output row straight into its (token, slot) row of the home rank's slots (peer memory
# through the workspace's bases) instead of into [R, H]: bitwise the plain GEMM followed by
# ``comm.push_rows`` (csrc/include/mok/grouped_gemm.h, mok/gemm/push.cuh).

PUSH_VARIANTS = {kernel: frozenset(v for v in VARIANTS[kernel] if not v.tma_store and not v.multicast)
                 for kernel in ("fc2", "dgrad")}
"""Built variants of :func:`fc2_push` ("fc2") and :func:`fc1_dgrad_push` ("dgrad"): the direct-store,
single-CTA variants of the unfused kernels (a TMA store cannot scatter rows to computed addresses)."""


def push_variant(kernel: str, tile_rows: int, block_m: Optional[int] = None, wg_n: Optional[int] = None) -> Variant:
    """The variant of the pushing ``kernel`` ("fc2" or "dgrad") on a layout padded to
    ``tile_rows``: the unfused kernel's (:func:`variant`, so the same tile and K loop, hence the
    same bits) with direct stores and no clusters."""
    return variant(kernel, tile_rows, block_m, wg_n, tma_store=False, multicast=False)


def _check_offset(name: str, value, multiple: int, why: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        _fail(f"{name} must be an int (a byte offset into every rank's workspace region), got {type(value).__name__}")
    if value < 0 or value % multiple:
        _fail(f"{name} = {value} must be a non-negative multiple of {multiple} ({why})")


def check_push(table, bases, slots_offset, R: int, device, row_scalars=None, scalars_offset=0) -> None:
    """Validate the push arguments of :func:`fc2_push` / :func:`fc1_dgrad_push` for a layout of
    ``R`` rows on ``device``."""
    _check_matrix("table", table, torch.int32, 2, device, align=False)
    if tuple(table.shape) != (R, 2):
        _fail(f"table must be int32 [R={R}, 2] (the schedule rows of the GEMM's layout rows: a chunk's slice "
              f"for a chunk), got {tuple(table.shape)}")
    if table.device.type == "cuda" and not torch.compiler.is_compiling() and table.data_ptr() % 8:
        _fail(f"table must start 8-byte aligned (address {table.data_ptr():#x}; its rows are read as int2)")
    _check_matrix("bases", bases, torch.int64, 1, device, align=False)
    if bases.numel() < 1:
        _fail("bases must hold the workspace address of every rank (int64 [P], P >= 1), got none")
    _check_offset("slots_offset", slots_offset, 16, "the slots are written in 16-byte vectors")
    if row_scalars is not None:
        _check_matrix("row_scalars", row_scalars, torch.float32, 1, device, align=False)
        if row_scalars.numel() != R:
            _fail(f"row_scalars must have one entry per row (R = {R}), got {row_scalars.numel()}")
        _check_offset("scalars_offset", scalars_offset, 4, "fp32 scalar slots")


def check_fc2_push(h, fc2_weight, offsets, table, bases, slots_offset, tile_rows, block_m=None,
                   wg_n=None) -> Variant:
    """Validate :func:`fc2_push`'s arguments (before any GPU work); returns the variant
    (:func:`push_variant`)."""
    v = check_fc2(h, fc2_weight, offsets, tile_rows, block_m, wg_n, tma_store=False, multicast=False)
    check_push(table, bases, slots_offset, h.shape[0], h.device)
    return v


def check_fc1_dgrad_push(dgu, fc1_weight, offsets, table, bases, slots_offset, row_scalars, scalars_offset,
                         tile_rows, block_m=None, wg_n=None) -> Variant:
    """Validate :func:`fc1_dgrad_push`'s arguments (before any GPU work); returns the variant."""
    v = check_fc1_dgrad(dgu, fc1_weight, offsets, tile_rows, block_m, wg_n, tma_store=False, multicast=False)
    check_push(table, bases, slots_offset, dgu.shape[0], dgu.device, row_scalars, scalars_offset)
    return v


def launch_fc2_push(h, fc2_weight, offsets, table, bases, slots_offset: int, *, variant: Variant,
                    num_ctas: int = 0) -> None:
    """Run fc2 with its rows pushed home (``variant``: a :data:`PUSH_VARIANTS` entry)."""
    lib, fns = _lib()
    R, I = h.shape
    L, H, _ = fc2_weight.shape
    code = fns["fc2_push"](ptr(h), ptr(fc2_weight), ptr(offsets), ptr(table), ptr(bases), int(slots_offset), R, L,
                           H, I, int(variant.block_m), int(variant.wg_n), num_ctas, stream_of(h))
    lib.check(code, "mok_gemm_fc2_push")


def launch_fc1_dgrad_push(dgu, fc1_weight, offsets, table, bases, slots_offset: int, row_scalars,
                          scalars_offset: int, *, variant: Variant, num_ctas: int = 0) -> None:
    """Run the fc1 data gradient with its rows (and ``row_scalars``, if not None) pushed home."""
    lib, fns = _lib()
    R, two_i = dgu.shape
    L, _, H = fc1_weight.shape
    code = fns["fc1_dgrad_push"](ptr(dgu), ptr(fc1_weight), ptr(offsets), ptr(table), ptr(bases), int(slots_offset),
                                 ptr(row_scalars), int(scalars_offset), R, L, H, two_i // 2, int(variant.block_m),
                                 int(variant.wg_n), num_ctas, stream_of(dgu))
    lib.check(code, "mok_gemm_fc1_dgrad_push")


# Writes through raw peer addresses: torch cannot see what they mutate ("unknown"), as comm.push_rows.
@mok_op("mok::gemm_fc2_push", mutates_args="unknown")
def gemm_fc2_push_op(h: torch.Tensor, fc2_weight: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor,
                     bases: torch.Tensor, slots_offset: int, variant: List[int], num_ctas: int) -> None:
    """fc2 with its rows pushed home; see :func:`fc2_push`."""
    launch_fc2_push(h, fc2_weight, offsets, table, bases, slots_offset, variant=Variant(*variant), num_ctas=num_ctas)


@gemm_fc2_push_op.register_fake
def _(h, fc2_weight, offsets, table, bases, slots_offset, variant, num_ctas) -> None:
    return None


@mok_op("mok::gemm_fc1_dgrad_push", mutates_args="unknown")
def gemm_fc1_dgrad_push_op(dgu: torch.Tensor, fc1_weight: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor,
                           bases: torch.Tensor, slots_offset: int, row_scalars: Optional[torch.Tensor],
                           scalars_offset: int, variant: List[int], num_ctas: int) -> None:
    """The fc1 data gradient with its rows pushed home; see :func:`fc1_dgrad_push`."""
    launch_fc1_dgrad_push(dgu, fc1_weight, offsets, table, bases, slots_offset, row_scalars, scalars_offset,
                          variant=Variant(*variant), num_ctas=num_ctas)


@gemm_fc1_dgrad_push_op.register_fake
def _(dgu, fc1_weight, offsets, table, bases, slots_offset, row_scalars, scalars_offset, variant, num_ctas) -> None:
    return None


def fc2_push(h: torch.Tensor, fc2_weight: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor,
             bases: torch.Tensor, slots_offset: int, *, tile_rows: int = 128, block_m: Optional[int] = None,
             wg_n: Optional[int] = None, num_ctas: int = 0) -> None:
    """fc2 of every local expert, y[r] = h[r] D_e^T, each row pushed to its (token, slot) row on
    its home rank instead of returned: bitwise :func:`fc2` then ``comm.push_rows(bases,
    slots_offset, 0, table, offsets, K, y, None, 0)``.

    Args:
        h: bf16 [R, I]. fc2_weight: bf16 [L, H, I] (a weight segment: offsets and its experts'
            rows from its first expert on). offsets: int32 [L + 1] on the device, multiples of
            ``tile_rows``.
        table: int32 [R, 2], the schedule rows of the layout rows (source rank or -1 for padding,
            token * K + slot); for a chunk of the layout, the chunk's slice with chunk-relative
            offsets (``functional.training.chunk_layout``).
        bases: int64 [P] device addresses of every rank's workspace region. slots_offset: byte
            offset of the bf16 slots [T_cap, K, H] in a region (a multiple of 16).
        tile_rows, block_m, wg_n, num_ctas: as in :func:`fc2` (:func:`push_variant`: direct
            stores, no multicast).
    """
    v = check_fc2_push(h, fc2_weight, offsets, table, bases, slots_offset, tile_rows, block_m, wg_n)
    gemm_fc2_push_op(h, fc2_weight, offsets, table, bases, int(slots_offset), list(_vargs(v)), num_ctas)


def fc1_dgrad_push(dgu: torch.Tensor, fc1_weight: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor,
                   bases: torch.Tensor, slots_offset: int, row_scalars: Optional[torch.Tensor] = None,
                   scalars_offset: int = 0, *, tile_rows: int = 128, block_m: Optional[int] = None,
                   wg_n: Optional[int] = None, num_ctas: int = 0) -> None:
    """The fc1 data gradient, dx[r] = dgu[r] W1_e, each row pushed to its (token, slot) row on its
    home rank, and with ``row_scalars`` each row's fp32 value (the router-weight gradient) to its
    scalar slot: bitwise :func:`fc1_dgrad` then ``comm.push_rows(bases, slots_offset,
    scalars_offset, table, offsets, K, dx, row_scalars, 0)``.

    Args:
        dgu: bf16 [R, 2I]. fc1_weight: bf16 [L, 2I, H]. offsets, table, bases, slots_offset: as
            in :func:`fc2_push`. row_scalars: fp32 [R] or None. scalars_offset: byte offset of
            the fp32 scalar slots [T_cap, K] in a region (a multiple of 4; with row_scalars).
        tile_rows, block_m, wg_n, num_ctas: as in :func:`fc1_dgrad` (direct stores, no multicast).
    """
    v = check_fc1_dgrad_push(dgu, fc1_weight, offsets, table, bases, slots_offset, row_scalars, scalars_offset,
                             tile_rows, block_m, wg_n)
    gemm_fc1_dgrad_push_op(dgu, fc1_weight, offsets, table, bases, int(slots_offset), row_scalars,
                           int(scalars_offset), list(_vargs(v)), num_ctas)
