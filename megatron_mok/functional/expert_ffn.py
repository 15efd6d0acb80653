"""The expert FFN on the expert-grouped, tile-padded layout, forward and backward, as the GPU
backends run it outside the megakernel: MoK's Hopper GEMMs with SwiGLU fused where the shape
allows (:func:`hopper_gemms_apply`), torch._grouped_mm and separate SwiGLU kernels elsewhere.

Weight segments (``mok_moe``'s tuple weights: routed experts and a shared expert in tensors of
their own) run each GEMM once per segment on its experts' rows (offsets and counts from the
segment's first expert on), into one output, and give each segment its own weight gradient: no
copy of any weight. That needs MoK's fused Hopper GEMMs; otherwise the segments are
concatenated first (:func:`weight_arguments`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..config import GPU_TILE_ROWS, MoKConfig
from ..ops import grouped_gemm as mok_gemm
from ..ops import swiglu as swiglu_ops
from .validate import MoEShape


def hopper_gemms_apply(shape: MoEShape, tile_rows: int) -> bool:
    """Whether MoK's Hopper grouped GEMMs (csrc/include/mok/grouped_gemm.h) take this shape:
    fc2 and the fc1 data gradient need H % 256 == 0, the weight gradients 2I % 128 == 0,
    H % 256 == 0 and I % 256 == 0; layouts padded to 64 or 128 rows. Where they do, SwiGLU runs
    in fc1's epilogue and its backward in the fc2 data gradient's (measured at or above
    torch._grouped_mm plus the separate SwiGLU kernels at every shape, docs/perf-notes.md);
    elsewhere the GEMMs are torch._grouped_mm and SwiGLU runs as separate kernels."""
    return tile_rows in GPU_TILE_ROWS and shape.hidden % 256 == 0 and shape.ffn_hidden % 256 == 0


@dataclass(frozen=True)
class ExpertCall:
    """How one rank runs the expert FFN and its communication for one (config, shape): the
    schedule's segment padding, the timeout, E and the GEMM family. Built once per (config,
    shape) (:func:`expert_call`); it holds no buffer, so caching it keeps nothing alive."""

    segment_rows: int
    timeout_s: float
    num_experts: int
    hopper_gemms: bool  # MoK's Hopper GEMMs with SwiGLU fused (hopper_gemms_apply), else torch's
    push_from_gemm: bool = False  # fc2 / the fc1 data gradient push rows home from their epilogue


PUSH_FROM_GEMM_MIN_ROWS = 384
"""Expected rows per local expert (T * K / L) from which the row GEMMs that end a direction push
their rows home from their epilogue rather than writing them for the push kernel. Measured on one
H200 (Kimi-K2, P = 1, in one process, alternating): at 683 rows per expert the fused push saves
0.12-0.36 ms of the backward and 0.2 ms of the cuda forward; at 170 it costs 0.68 ms and 0.25 ms
(the GEMMs stream their weights from HBM there, and the scattered 512-byte row stores compete
with them). 384 is twice the rows at which these GEMMs turn compute-bound on an H200 (~190)."""


def push_from_gemm_applies(shape: MoEShape, hopper_gemms: bool) -> bool:
    """Whether fc2 and the fc1 data gradient push their rows home from their epilogue
    (:data:`PUSH_FROM_GEMM_MIN_ROWS`); only with MoK's Hopper GEMMs."""
    return hopper_gemms and shape.tokens * shape.topk >= PUSH_FROM_GEMM_MIN_ROWS * shape.experts_per_rank


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm with int32 group end offsets kept on the device."""
    return torch._grouped_mm(a, b, offs=ends)


def _weight_grad(call: ExpertCall, a, b, offsets, counts):
    """[L, M, N] = a[rows of e]^T b[rows of e] per expert, bf16."""
    if call.hopper_gemms:
        return mok_gemm.weight_grad(a, b, offsets, counts, out_dtype=torch.bfloat16)
    return _grouped_mm(a.t(), b, offsets[1:])


# ---- weight segments -------------------------------------------------------------------------
# A second weight segment (a shared expert in parameters of its own) is read where it lies by
# MoK's Hopper GEMMs (one launch per segment, offsets from the segment's first expert on);
# with torch._grouped_mm the segments are concatenated first (weight_arguments).


def segments(weights, offsets, counts):
    """(weight segment, its offsets [L_i + 1], its counts [L_i]) for each segment, in order."""
    out, l0 = [], 0
    for w in weights:
        l1 = l0 + w.shape[0]
        out.append((w, offsets[l0:l1 + 1], counts[l0:l1]))
        l0 = l1
    return out


def fc1_swiglu_segments(call: ExpertCall, x_disp, fc1s, offsets, counts, w_disp):
    """h bf16 [R, I] and gu bf16 [R, 2I], as ``mok_gemm.fc1_swiglu(..., save_preact=True)``
    over the concatenated segments."""
    R, two_i = x_disp.shape[0], fc1s[0].shape[1]
    h, gu = x_disp.new_empty((R, two_i // 2)), x_disp.new_empty((R, two_i))
    for w, offs, cnts in segments(fc1s, offsets, counts):
        v = mok_gemm.check_fc1_swiglu(x_disp, w, offs, cnts, w_disp, call.segment_rows)
        mok_gemm.launch_fc1_swiglu(x_disp, w, offs, cnts, w_disp, h, gu, variant=v)
    return h, gu


def plain_gemm_segments(call: ExpertCall, a, weights, offsets, counts, cols: int, check, launch):
    """out bf16 [R, cols] of a row GEMM without an epilogue of its own (``check`` / ``launch``:
    ``mok_gemm``'s fc2 or fc1-data-gradient pair), one launch per segment into ``out``."""
    out = a.new_empty((a.shape[0], cols))
    for w, offs, _ in segments(weights, offsets, counts):
        launch(a, w, offs, out, variant=check(a, w, offs, call.segment_rows))
    return out


def fc2_dgrad_swiglu_segments(call: ExpertCall, d_out, fc2s, ab, offsets, counts, w_disp, over_ab: bool = False):
    """(d_ab bf16 [R, 2I], d router weight fp32 [R], h bf16 [R, I]), as
    ``mok_gemm.fc2_dgrad_swiglu(..., want_h=True)`` over the concatenated segments; with
    ``over_ab`` d_ab is written over ``ab`` (``mok_gemm.fc2_dgrad_swiglu_``) and returned."""
    R, I = d_out.shape[0], fc2s[0].shape[2]
    d_ab, h = (ab if over_ab else d_out.new_empty((R, 2 * I))), d_out.new_empty((R, I))
    dw = d_out.new_empty((R,), dtype=torch.float32)
    scratch = d_out.new_empty((mok_gemm.dgrad_scratch_floats(R, I),), dtype=torch.float32)
    for w, offs, cnts in segments(fc2s, offsets, counts):
        v = mok_gemm.check_fc2_dgrad_swiglu(d_out, w, ab, offs, cnts, w_disp, call.segment_rows)
        mok_gemm.launch_fc2_dgrad_swiglu(d_out, w, ab, offs, cnts, w_disp, d_ab, h, dw, scratch, variant=v)
    return d_ab, dw, h


def _weight_grad_segments(a, b, weights, offsets, counts):
    """Per segment [L_i, M, N] = a[rows of e]^T b[rows of e], bf16."""
    return [mok_gemm.weight_grad(a, b, offs, cnts, out_dtype=torch.bfloat16) for _, offs, cnts in
            segments(weights, offsets, counts)]


def expert_forward(call: ExpertCall, x_disp, w_disp, fc1, fc2, offsets, counts, fc1_2=None, fc2_2=None):
    """The expert FFN on the expert-grouped layout: (out_rows bf16 [R, H], h bf16 [R, I] =
    w * silu(gate) * up, ab bf16 [R, 2I] = the fc1 pre-activation gate | up) for x_disp bf16
    [R, H] and router weights w_disp fp32 [R]. fc1_2 / fc2_2: the second weight segment or None."""
    if fc1_2 is not None:  # weight segments: MoK's GEMMs read each where it lies
        hw, ab = fc1_swiglu_segments(call, x_disp, (fc1, fc1_2), offsets, counts, w_disp)
        out_rows = plain_gemm_segments(call, hw, (fc2, fc2_2), offsets, counts, fc2.shape[1],
                                        mok_gemm.check_fc2, mok_gemm.launch_fc2)
    elif call.hopper_gemms:
        hw, ab = mok_gemm.fc1_swiglu(x_disp, fc1, offsets, counts, w_disp, tile_rows=call.segment_rows,
                                     save_preact=True)
        out_rows = mok_gemm.fc2(hw, fc2, offsets, tile_rows=call.segment_rows)
    else:
        ab = _grouped_mm(x_disp, fc1.transpose(1, 2), offsets[1:])
        hw = swiglu_ops.swiglu_forward(ab, w_disp, offsets)
        out_rows = _grouped_mm(hw, fc2.transpose(1, 2), offsets[1:])
    return out_rows, hw, ab


def expert_backward(call: ExpertCall, d_out, x_disp, w_disp, ab, fc1, fc2, offsets, counts, fc1_2=None, fc2_2=None):
    """The expert FFN's backward on the expert-grouped layout, for the pulled output gradients
    d_out bf16 [R, H] and the saved x_disp bf16 [R, H], w_disp fp32 [R], ab bf16 [R, 2I].

    Returns:
        (dx_rows bf16 [R, H], d router weight fp32 [R], d_fc1 bf16 [L1, 2I, H],
        d_fc2 bf16 [L1, H, I], d_fc1_2, d_fc2_2 (the second segment's, or None)).
    """
    d_fc1_2 = d_fc2_2 = None
    if fc1_2 is not None:  # weight segments: a gradient per segment
        fc1s, fc2s = (fc1, fc1_2), (fc2, fc2_2)
        d_ab, dw_rows, hw = fc2_dgrad_swiglu_segments(call, d_out, fc2s, ab, offsets, counts, w_disp)
        d_fc2, d_fc2_2 = _weight_grad_segments(d_out, hw, fc2s, offsets, counts)
        d_fc1, d_fc1_2 = _weight_grad_segments(d_ab, x_disp, fc1s, offsets, counts)
        dx_rows = plain_gemm_segments(call, d_ab, fc1s, offsets, counts, fc1.shape[2],
                                       mok_gemm.check_fc1_dgrad, mok_gemm.launch_fc1_dgrad)
        return dx_rows, dw_rows, d_fc1, d_fc2, d_fc1_2, d_fc2_2
    if call.hopper_gemms:
        d_ab, dw_rows, hw = mok_gemm.fc2_dgrad_swiglu(d_out, fc2, ab, offsets, counts, w_disp,
                                                      tile_rows=call.segment_rows, want_h=True)
    else:
        g = _grouped_mm(d_out, fc2, offsets[1:])  # dL/d(hw) [R, I]
        d_ab, dw_rows, hw = swiglu_ops.swiglu_backward(ab, w_disp, g, offsets, True)
    d_fc2 = _weight_grad(call, d_out, hw, offsets, counts)  # [L, H, I]
    d_fc1 = _weight_grad(call, d_ab, x_disp, offsets, counts)  # [L, 2I, H]
    if call.hopper_gemms:
        dx_rows = mok_gemm.fc1_dgrad(d_ab, fc1, offsets, tile_rows=call.segment_rows)
    else:
        dx_rows = _grouped_mm(d_ab, fc1, offsets[1:])
    return dx_rows, dw_rows, d_fc1, d_fc2, d_fc1_2, d_fc2_2


def weight_arguments(fc1s, fc2s, call: ExpertCall):
    """The weight arguments of the autograd functions, (fc1, fc2, fc1_2, fc2_2): the segments
    themselves where MoK's GEMMs read them in place (``call.hopper_gemms``), else one tensor
    each (concatenated, a copy, when there are two segments; fc1_2 = fc2_2 = None)."""
    fc1s = tuple(w.contiguous() for w in fc1s)  # TMA maps need row-major weights
    fc2s = tuple(w.contiguous() for w in fc2s)
    if len(fc1s) == 1:
        return fc1s[0], fc2s[0], None, None
    if call.hopper_gemms:
        return fc1s[0], fc2s[0], fc1s[1], fc2s[1]
    return torch.cat(fc1s), torch.cat(fc2s), None, None


@functools.lru_cache(maxsize=256)
def expert_call(config: MoKConfig, shape: MoEShape, ep_size: int, segment_rows: int) -> ExpertCall:
    """The :class:`ExpertCall` for this config and shape (cached: every layer of a model asks on
    every call)."""
    hopper = hopper_gemms_apply(shape, segment_rows)
    return ExpertCall(segment_rows=segment_rows, timeout_s=float(config.timeout_s),
                      num_experts=ep_size * shape.experts_per_rank, hopper_gemms=hopper,
                      push_from_gemm=push_from_gemm_applies(shape, hopper))
