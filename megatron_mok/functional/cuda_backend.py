"""The ``cuda`` backend: MoK's communication as separate kernels, the expert FFN through
grouped GEMMs on the expert-grouped, tile-padded layout. No host synchronisation anywhere in
forward or backward (every row count stays on the device), so a whole step can be captured
in a CUDA graph.

Forward, on every rank (P ranks, L local experts):

1. publish: copy x, topk_ids, topk_weights into this rank's workspace region; barrier;
2. schedule: the table of routes to this rank's experts, from every rank's ids (peer reads);
3. pull dispatch: x rows and router weights from their source ranks, grouped by expert;
4. fc1 (grouped GEMM), SwiGLU times the router weight, fc2 (grouped GEMM);
5. push combine: each output row to its (token, slot) on its home rank; barrier;
6. y[t] = sum over slots j = 0 .. K-1 (fixed order).

The router weight is applied inside the expert (on h, before fc2), as Megatron does; its
gradient comes out of the SwiGLU backward. Backward mirrors the forward: publish dy;
reverse-combine pulls it; fc2 dgrad, SwiGLU backward (d gate, d up, d router weight), fc1
dgrad and the weight gradients; reverse-dispatch pushes dX and d router weight per slot;
the fixed-order slot sum gives dx.

Weight segments (``mok_moe``'s tuple weights: routed experts and a shared expert in tensors of
their own) run each GEMM once per segment on its experts' rows (offsets and counts from the
segment's first expert on), into one output, and give each segment its own weight gradient: no
copy of any weight. That needs MoK's fused Hopper GEMMs; otherwise the segments are
concatenated first (:func:`segmented_gemms_apply`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..config import GPU_TILE_ROWS, MoKConfig
from ..ops import comm as comm_ops
from ..ops import grouped_gemm as mok_gemm
from ..ops import swiglu as swiglu_ops
from .groups import EPGroup, group_size_rank
from .validate import MoEShape
from .workspace import Workspace, get_workspace

SITE_FWD_DISPATCH, SITE_FWD_COMBINE, SITE_BWD_DISPATCH, SITE_BWD_COMBINE = 1, 2, 3, 4


def unsupported_reason(shape: MoEShape, config: MoKConfig) -> str | None:
    """Why the CUDA kernels cannot take this shape, or None."""
    if config.tile_rows not in GPU_TILE_ROWS:
        return f"tile_rows={config.tile_rows}; the GPU backends take {GPU_TILE_ROWS}"
    if shape.hidden % 8:
        return f"hidden size {shape.hidden} is not a multiple of 8 (16-byte row copies)"
    if shape.ffn_hidden % 8:
        return f"expert FFN size {shape.ffn_hidden} is not a multiple of 8 (16-byte vectors)"
    if shape.experts_per_rank * 4 > 48 * 1024:
        return f"{shape.experts_per_rank} experts per rank exceed the schedule kernel's 12288"
    return None


GEMM_ENV = "MOK_GROUPED_GEMM"


def hopper_gemms_apply(shape: MoEShape, tile_rows: int) -> bool:
    """Whether MoK's Hopper grouped GEMMs (csrc/include/mok/grouped_gemm.h) take this shape:
    fc2 and the fc1 data gradient need H % 256 == 0, the weight gradients 2I % 128 == 0,
    H % 256 == 0 and I % 256 == 0; layouts padded to 64 or 128 rows. ``MOK_GROUPED_GEMM=torch``
    in the environment turns them off (for A/B measurements)."""
    if os.environ.get(GEMM_ENV, "mok") == "torch":
        return False
    return tile_rows in GPU_TILE_ROWS and shape.hidden % 256 == 0 and shape.ffn_hidden % 256 == 0


SWIGLU_ENV = "MOK_CUDA_SWIGLU"
SWIGLU_MODES = ("forward", "fused", "separate")
SWIGLU_DEFAULT = "fused"
"""Where the cuda backend runs SwiGLU with MoK's Hopper GEMMs (``MOK_CUDA_SWIGLU``): ``fused``
fuses it into fc1's epilogue and into the fc2 data gradient's; ``forward`` fuses only fc1 and runs
the backward as the plain fc2 data gradient plus the separate SwiGLU-backward kernel (bitwise the
same gradients as ``fused``: tests/test_grouped_gemm.py); ``separate`` fuses neither. The fused
data gradient was measured 1.04-1.42x faster than torch._grouped_mm plus the separate kernel,
and at or below our plain data gradient plus the separate kernel, on one H200
(docs/perf-notes.md, fifth session)."""


def fused_swiglu_apply(shape: MoEShape, tile_rows: int) -> tuple:
    """(forward, backward): whether fc1 runs with the SwiGLU epilogue, and whether the fc2 data
    gradient runs with the SwiGLU-backward epilogue. Both need MoK's Hopper GEMMs
    (:func:`hopper_gemms_apply`)."""
    mode = os.environ.get(SWIGLU_ENV, SWIGLU_DEFAULT)
    if mode not in SWIGLU_MODES:
        raise ValueError(f"{SWIGLU_ENV}={mode!r}: expected one of {', '.join(SWIGLU_MODES)}")
    if mode == "separate" or not hopper_gemms_apply(shape, tile_rows):
        return False, False
    return True, mode == "fused"  # the fused backward's 256-column tiles fit every such I


@dataclass(frozen=True)
class _Call:
    ws: Workspace
    segment_rows: int
    timeout_s: float
    num_experts: int
    comm_blocks: int
    hopper_gemms: bool
    fused_swiglu: tuple = (False, False)  # (forward, backward): fused_swiglu_apply


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm with int32 group end offsets kept on the device."""
    return torch._grouped_mm(a, b, offs=ends)


# The expert GEMMs: MoK's Hopper kernels wherever the shape allows (each was measured at or above
# torch._grouped_mm's speed, docs/perf-notes.md, fourth session), torch._grouped_mm otherwise.
# By default fc1 has SwiGLU in its epilogue and the fc2 data gradient the SwiGLU backward in its
# (MOK_CUDA_SWIGLU, above).

def _row_gemm(call: _Call, ours, a, w, offsets, w_is_n_by_k: bool):
    """The row-grouped GEMM out[rows of e] = a[rows of e] @ W_e, with W_e = w[e]^T when w is
    [L, N, K] (``w_is_n_by_k``: fc1's pre-activation, fc2) and w[e] when it is [L, K, N] (the data
    gradients): MoK's kernel ``ours`` (one of ``mok_gemm``'s, which take w as stored) or
    torch._grouped_mm."""
    if call.hopper_gemms:
        return ours(a, w, offsets, tile_rows=call.segment_rows)
    return _grouped_mm(a, w.transpose(1, 2) if w_is_n_by_k else w, offsets[1:])


def _weight_grad(call: _Call, a, b, offsets):
    """[L, M, N] = a[rows of e]^T b[rows of e] per expert, bf16."""
    if call.hopper_gemms:
        return mok_gemm.weight_grad(a, b, offsets, out_dtype=torch.bfloat16)
    return _grouped_mm(a.t(), b, offsets[1:])


# ---- weight segments -------------------------------------------------------------------------

def segmented_gemms_apply(call: _Call) -> bool:
    """Whether the GEMMs can read weight segments where they lie: MoK's Hopper GEMMs with both
    SwiGLU fusions (the launches over a segment are those kernels' ``offsets + l0`` form)."""
    return call.hopper_gemms and call.fused_swiglu == (True, True)


def _segments(weights, offsets, counts):
    """(weight segment, its offsets [L_i + 1], its counts [L_i]) for each segment, in order."""
    out, l0 = [], 0
    for w in weights:
        l1 = l0 + w.shape[0]
        out.append((w, offsets[l0:l1 + 1], counts[l0:l1]))
        l0 = l1
    return out


def _fc1_swiglu_segments(call: _Call, x_disp, fc1s, offsets, counts, w_disp):
    """h bf16 [R, I] and gu bf16 [R, 2I], as ``mok_gemm.fc1_swiglu(..., save_preact=True)``
    over the concatenated segments."""
    R, two_i = x_disp.shape[0], fc1s[0].shape[1]
    h, gu = x_disp.new_empty((R, two_i // 2)), x_disp.new_empty((R, two_i))
    for w, offs, cnts in _segments(fc1s, offsets, counts):
        v = mok_gemm.check_fc1_swiglu(x_disp, w, offs, cnts, w_disp, call.segment_rows)
        mok_gemm.launch_fc1_swiglu(x_disp, w, offs, cnts, w_disp, h, gu, variant=v)
    return h, gu


def _plain_gemm_segments(call: _Call, a, weights, offsets, counts, cols: int, check, launch):
    """out bf16 [R, cols] of a row GEMM without an epilogue of its own (``check`` / ``launch``:
    ``mok_gemm``'s fc2 or fc1-data-gradient pair), one launch per segment into ``out``."""
    out = a.new_empty((a.shape[0], cols))
    for w, offs, _ in _segments(weights, offsets, counts):
        launch(a, w, offs, out, variant=check(a, w, offs, call.segment_rows))
    return out


def _fc2_dgrad_swiglu_segments(call: _Call, d_out, fc2s, ab, offsets, counts, w_disp):
    """(d_ab bf16 [R, 2I], d router weight fp32 [R], h bf16 [R, I]), as
    ``mok_gemm.fc2_dgrad_swiglu(..., want_h=True)`` over the concatenated segments."""
    R, I = d_out.shape[0], fc2s[0].shape[2]
    d_ab, h = d_out.new_empty((R, 2 * I)), d_out.new_empty((R, I))
    dw = d_out.new_empty((R,), dtype=torch.float32)
    scratch = d_out.new_empty((mok_gemm.dgrad_scratch_floats(R, I),), dtype=torch.float32)
    for w, offs, cnts in _segments(fc2s, offsets, counts):
        v = mok_gemm.check_fc2_dgrad_swiglu(d_out, w, ab, offs, cnts, w_disp, call.segment_rows)
        mok_gemm.launch_fc2_dgrad_swiglu(d_out, w, ab, offs, cnts, w_disp, d_ab, h, dw, scratch, variant=v)
    return d_ab, dw, h


def _weight_grad_segments(a, b, weights, offsets, counts):
    """Per segment [L_i, M, N] = a[rows of e]^T b[rows of e], bf16."""
    return [mok_gemm.weight_grad(a, b, offs, out_dtype=torch.bfloat16) for _, offs, _ in
            _segments(weights, offsets, counts)]


class _CudaMoE(torch.autograd.Function):
    """fc1_2 / fc2_2: None, or the second weight segment (local experts L1 ..), read in place."""

    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, fc1, fc2, call: _Call, fc1_2=None, fc2_2=None):
        ws = call.ws
        ws.raise_if_failed(call.timeout_s)
        T, K = topk_ids.shape
        H = x.shape[1]
        table, counts, offsets, capacity = ws.dispatch(x, topk_ids, topk_weights, SITE_FWD_DISPATCH, call.timeout_s,
                                                       call.segment_rows)
        x_disp, w_disp = comm_ops.pull_rows(ws.bases, ws.layout.rows, True, ws.layout.scalars, table, offsets,
                                            K, capacity, H, True, call.comm_blocks)
        if fc1_2 is not None:  # weight segments (segmented_gemms_apply holds)
            hw, ab = _fc1_swiglu_segments(call, x_disp, (fc1, fc1_2), offsets, counts, w_disp)
            out_rows = _plain_gemm_segments(call, hw, (fc2, fc2_2), offsets, counts, fc2.shape[1],
                                            mok_gemm.check_fc2, mok_gemm.launch_fc2)
        else:
            if call.fused_swiglu[0]:
                hw, ab = mok_gemm.fc1_swiglu(x_disp, fc1, offsets, counts, w_disp, tile_rows=call.segment_rows,
                                             save_preact=True)          # [R, I], [R, 2I]
            else:
                ab = _row_gemm(call, mok_gemm.fc1_preact, x_disp, fc1, offsets, True)  # [R, 2I]
                hw = swiglu_ops.swiglu_forward(ab, w_disp, offsets)     # [R, I]
            out_rows = _row_gemm(call, mok_gemm.fc2, hw, fc2, offsets, True)       # [R, H]
        comm_ops.push_rows(ws.bases, ws.layout.slots, 0, table, offsets, K, out_rows, None, call.comm_blocks)
        ws.barrier(SITE_FWD_COMBINE, call.timeout_s)
        y, _ = comm_ops.sum_slots(ws.slots[:T], topk_ids, call.num_experts, None, ws.status)
        # The workspace is shared by every layer: keep what the backward needs outside it.
        ctx.save_for_backward(topk_ids, fc1, fc2, table, offsets, x_disp, w_disp, ab, counts, fc1_2, fc2_2)
        ws.mirror_status()
        ctx.call = call
        ctx.tokens = T
        return y

    @staticmethod
    def backward(ctx, dy):
        topk_ids, fc1, fc2, table, offsets, x_disp, w_disp, ab, counts, fc1_2, fc2_2 = ctx.saved_tensors
        call: _Call = ctx.call
        ws = call.ws
        ws.raise_if_failed(call.timeout_s)
        T, K, H = ctx.tokens, ws.layout.topk, ws.layout.hidden
        capacity = table.shape[0]
        ws.publish_rows(dy.to(torch.bfloat16).contiguous())
        ws.barrier(SITE_BWD_DISPATCH, call.timeout_s)
        d_out, _ = comm_ops.pull_rows(ws.bases, ws.layout.rows, True, 0, table, offsets, K, capacity, H,
                                      False, call.comm_blocks)
        d_fc1_2 = d_fc2_2 = None
        if fc1_2 is not None:  # weight segments: a gradient per segment
            fc1s, fc2s = (fc1, fc1_2), (fc2, fc2_2)
            d_ab, dw_rows, hw = _fc2_dgrad_swiglu_segments(call, d_out, fc2s, ab, offsets, counts, w_disp)
            d_fc2, d_fc2_2 = _weight_grad_segments(d_out, hw, fc2s, offsets, counts)
            d_fc1, d_fc1_2 = _weight_grad_segments(d_ab, x_disp, fc1s, offsets, counts)
            dx_rows = _plain_gemm_segments(call, d_ab, fc1s, offsets, counts, fc1.shape[2],
                                           mok_gemm.check_fc1_dgrad, mok_gemm.launch_fc1_dgrad)
        else:
            if call.fused_swiglu[1]:
                d_ab, dw_rows, hw = mok_gemm.fc2_dgrad_swiglu(d_out, fc2, ab, offsets, counts, w_disp,
                                                              tile_rows=call.segment_rows, want_h=True)
            else:
                g = _row_gemm(call, mok_gemm.fc2_dgrad, d_out, fc2, offsets, False)  # dL/d(hw) [R, I]
                d_ab, dw_rows, hw = swiglu_ops.swiglu_backward(ab, w_disp, g, offsets, True)
            d_fc2 = _weight_grad(call, d_out, hw, offsets)                          # [L, H, I]
            d_fc1 = _weight_grad(call, d_ab, x_disp, offsets)                       # [L, 2I, H]
            dx_rows = _row_gemm(call, mok_gemm.fc1_dgrad, d_ab, fc1, offsets, False)  # [R, H]
        comm_ops.push_rows(ws.bases, ws.layout.slots, ws.layout.scalars, table, offsets, K, dx_rows, dw_rows,
                           call.comm_blocks)
        ws.barrier(SITE_BWD_COMBINE, call.timeout_s)
        dx, dw = comm_ops.sum_slots(ws.slots[:T], topk_ids, call.num_experts, ws.scalars[:T], ws.status)
        ws.mirror_status()
        return dx, None, dw, d_fc1, d_fc2, None, d_fc1_2, d_fc2_2


def weight_arguments(fc1s, fc2s, call: _Call):
    """The weight arguments of the autograd functions, (fc1, fc2, fc1_2, fc2_2): the segments
    themselves where the GEMMs read segments (:func:`segmented_gemms_apply`), else one tensor
    each (concatenated, a copy, when there are two segments; fc1_2 = fc2_2 = None)."""
    fc1s = tuple(w.contiguous() for w in fc1s)  # TMA maps need row-major weights
    fc2s = tuple(w.contiguous() for w in fc2s)
    if len(fc1s) == 1:
        return fc1s[0], fc2s[0], None, None
    if segmented_gemms_apply(call):
        return fc1s[0], fc2s[0], fc1s[1], fc2s[1]
    return torch.cat(fc1s), torch.cat(fc2s), None, None


def cuda_moe(x, topk_ids, topk_weights, fc1_weight, fc2_weight, *, ep_group: EPGroup, config: MoKConfig,
             shape: MoEShape) -> torch.Tensor:
    """The ``cuda`` backend of :func:`megatron_mok.functional.mok_moe` (validated inputs).

    Args: as ``mok_moe``: x bf16 [T, H]; topk_ids int64 [T, K]; topk_weights fp32 [T, K];
        fc1_weight: tuple of bf16 [L_i, 2I, H] weight segments; fc2_weight: tuple of bf16
        [L_i, H, I] (sum L_i = L).

    Returns:
        y bf16 [T, H].
    """
    P, _ = group_size_rank(ep_group)
    ws = get_workspace(ep_group, x.device, tokens=shape.tokens, hidden=shape.hidden, topk=shape.topk,
                       experts_per_rank=shape.experts_per_rank, config=config)
    ws.timeout_s = float(config.timeout_s)
    # Segments padded to the GEMM tile: torch._grouped_mm tiles each group in 128-row blocks
    # anyway, and measured no faster with 8-row segments (docs/perf-notes.md, 2026-11-29).
    call = _Call(ws=ws, segment_rows=config.tile_rows, timeout_s=float(config.timeout_s),
                 num_experts=P * shape.experts_per_rank, comm_blocks=0,
                 hopper_gemms=hopper_gemms_apply(shape, config.tile_rows),
                 fused_swiglu=fused_swiglu_apply(shape, config.tile_rows))
    fc1, fc2, fc1_2, fc2_2 = weight_arguments(fc1_weight, fc2_weight, call)
    return _CudaMoE.apply(x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous(), fc1, fc2, call,
                          fc1_2, fc2_2)
