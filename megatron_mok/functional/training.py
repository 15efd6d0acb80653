"""The training path of the GPU backends: activations kept in a training ring of bounded size,
the rest replayed, and the layer backward walked chunk by chunk.

A forward with grad keeps, for the backward, the activations of the first N rows of the
expert-grouped layout (x, router weight, fc1 pre-activation gate | up), N =
``MoKConfig.training_ring`` rounded to whole row blocks and capped at the layout's rows. The
backward walks the layout in chunks (:func:`chunk_plan`): the kept rows first, then the rows past
N, which it replays: their x rows and router weights are pulled again from their home ranks (the
home rank publishes them a second time, into the workspace's ``rows_x`` and ``scalars``) and fc1
is recomputed, bitwise the forward's (same kernel, same rows, same K order). Every buffer of a
call is sized by N or by one chunk, never by the worst case P * T * K: a hot expert taking every
token costs replay time, not memory.

Results do not depend on N or on the chunk size: row outputs (dX, d router weight, gate | up,
h) are per-row functions, and each weight gradient runs one fp32 accumulator over its expert's
rows in layout order, carried exactly from one chunk to the next through an fp32 buffer of one
expert (``grouped_gemm.weight_grad_rows``).

With MoK's Hopper GEMMs and enough rows per expert (``ExpertCall.push_from_gemm``), fc2 (forward)
and the fc1 data gradient (backward) push their output rows to their (token, slot) rows at home
from their epilogue (``grouped_gemm.fc2_push``, ``fc1_dgrad_push``): neither fc2's output rows nor
the dX rows are written to memory, bitwise the GEMM followed by the push kernel, which runs
otherwise.

Where MoK's Hopper GEMMs do not take the shape (``ExpertCall.hopper_gemms`` false: torch's
grouped GEMMs, which cannot carry a partial sum), the plan is one chunk that keeps every row of
the worst-case layout, as the backends did before the training ring, and the rows are pushed by
the push kernel after the GEMM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..config import MoKConfig, training_chunk_rows
from ..ops import comm as comm_ops
from ..ops import grouped_gemm as mok_gemm
from .expert_ffn import (ExpertCall, expert_backward, expert_forward, fc1_swiglu_segments,
                         fc2_dgrad_swiglu_segments, plain_gemm_segments, segments)
from .main_grad import MainGrads, add_into, placeholders, split_segments
from .validate import MoEShape
from .workspace import Workspace

SITE_BWD_DISPATCH, SITE_BWD_COMBINE = 3, 4

Kept = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""What a forward keeps of one chunk: x bf16 [n, H], router weight fp32 [n], gate | up bf16 [n, 2I]."""


@dataclass(frozen=True)
class Chunk:
    """Rows [row0, row1) of the expert-grouped layout, kept by the forward or replayed."""

    row0: int
    row1: int
    kept: bool

    @property
    def rows(self) -> int:
        return self.row1 - self.row0


def chunk_plan(capacity_rows: int, kept_rows: int, chunk_rows: int) -> Tuple[Chunk, ...]:
    """The chunks of a layout of ``capacity_rows`` rows: [0, min(kept_rows, capacity_rows)) in
    chunks of ``chunk_rows`` (kept), then the rest in chunks of ``chunk_rows`` (replayed).
    Consecutive, in order, none empty, covering [0, capacity_rows) exactly."""
    if chunk_rows <= 0 or kept_rows < 0 or capacity_rows < 0:
        raise ValueError(f"chunk_plan({capacity_rows}, {kept_rows}, {chunk_rows}): sizes must be >= 0, "
                         "chunk_rows > 0")
    kept = min(kept_rows, capacity_rows)
    out: List[Chunk] = []
    for lo, hi, is_kept in ((0, kept, True), (kept, capacity_rows, False)):
        for r in range(lo, hi, chunk_rows):
            out.append(Chunk(r, min(r + chunk_rows, hi), is_kept))
    return tuple(out)


def chunk_layout(offsets: torch.Tensor, counts: torch.Tensor, row0: int, row1: int
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The layout as chunk [row0, row1) sees it, for the row kernels (pull, push, row GEMMs) on
    the chunk's rows: (offsets int32 [L + 1], real-row counts int32 [L]) relative to row0,
    clamped to the chunk, from the layout's int32 ``offsets`` [L + 1] and ``counts`` [L]."""
    n = row1 - row0
    offs = (offsets - row0).clamp_(0, n)
    ends = (offsets[:-1] + counts - row0).clamp_(0, n)
    return offs.to(torch.int32), (ends - offs[:-1]).clamp_(min=0).to(torch.int32)


@functools.lru_cache(maxsize=256)
def _plan(capacity_rows: int, tile_rows: int, kept_rows: int, chunk_rows: int) -> Tuple[Chunk, ...]:
    # Rows past the last whole tile of the table hold no segment (every segment is padded to
    # tile_rows), so the plan stops there: every chunk is whole tiles.
    return chunk_plan(capacity_rows // tile_rows * tile_rows, kept_rows, chunk_rows)


def training_plan(config: MoKConfig, shape: MoEShape, capacity_rows: int, tile_rows: int,
                  hopper_gemms: bool) -> Tuple[Chunk, ...]:
    """The chunks of one call's layout (``capacity_rows`` = the schedule table's rows, padded to
    ``tile_rows``): the training ring's rows kept, the rest replayed, in chunks of
    :func:`training_chunk_rows`. Without MoK's Hopper GEMMs: one kept chunk of every row."""
    if not hopper_gemms:
        return (Chunk(0, capacity_rows, True),)
    ring = config.training_ring(tokens=shape.tokens, topk=shape.topk, experts_per_rank=shape.experts_per_rank)
    return _plan(capacity_rows, tile_rows, ring, training_chunk_rows(ring, tile_rows))


def kept_rows(plan: Sequence[Chunk]) -> int:
    """Rows a forward with this plan keeps (the end of its last kept chunk)."""
    return max((c.row1 for c in plan if c.kept), default=0)


def split_kept(plan: Sequence[Chunk], x: torch.Tensor, w: torch.Tensor, gu: torch.Tensor) -> List[Kept]:
    """The kept chunks' views of one forward's kept rows (x [N, H], w [N], gu [N, 2I])."""
    return [(x[c.row0:c.row1], w[c.row0:c.row1], gu[c.row0:c.row1]) for c in plan if c.kept]


# ---- the row GEMMs of the Hopper path ---------------------------------------------------------

def _fc1(call: ExpertCall, x, w, fc1s, offsets, counts) -> Tuple[torch.Tensor, torch.Tensor]:
    """(h bf16 [n, I], gate | up bf16 [n, 2I]) of fc1 + SwiGLU with MoK's Hopper GEMMs, one launch
    per weight segment. The forward and the backward's replay both run it, so a replayed
    pre-activation is bitwise the forward's (the same kernel on the same rows)."""
    if len(fc1s) > 1:
        return fc1_swiglu_segments(call, x, fc1s, offsets, counts, w)
    return mok_gemm.fc1_swiglu(x, fc1s[0], offsets, counts, w, tile_rows=call.segment_rows, save_preact=True)


def _replay_preact(call, x, w, fc1s, offsets, counts) -> torch.Tensor:
    """gate | up bf16 [n, 2I] of replayed rows: fc1 as the forward ran it."""
    return _fc1(call, x, w, fc1s, offsets, counts)[1]


def _push_rows_from_gemm(ws: Workspace, call: ExpertCall, fc2: bool, a, weights, offsets, counts, table,
                         row_scalars=None) -> None:
    """A row GEMM of one chunk whose epilogue pushes its output rows home: fc2 (``fc2``; a = h
    bf16 [n, I]) or the fc1 data gradient (a = d gate|up bf16 [n, 2I], with ``row_scalars`` fp32
    [n], the router-weight gradient, pushed into the scalar slots too). ``table`` int32 [n, 2]:
    the chunk's schedule rows; ``offsets`` / ``counts``: its chunk-relative layout. One launch per
    weight segment (each pushes its experts' rows), every segment checked before the first
    launch. Bitwise the GEMM into [n, H] followed by ``comm_ops.push_rows`` over the chunk.

    Memory ordering: the epilogue's stores into the peers' slots are plain stores, as the push
    kernel's were, and the same guarantee carries them: the rank's next step is the
    ``ws.barrier`` that follows in the stream (SITE_FWD_COMBINE, SITE_BWD_COMBINE), whose
    fence.acq_rel.sys and st.release.sys run after this kernel has completed (stream order) and
    are cumulative over every earlier kernel's stores, peer stores included; a peer acquires the
    barrier flag before its slot sum reads the slots (P = 1: no barrier, the slot sum runs later
    in the same stream). Virtual ranks are ordered the same way, each by its own stream."""
    slots, scalars = ws.layout.slots, ws.layout.scalars
    checked = []
    for w, offs, _ in segments(weights, offsets, counts):
        if fc2:
            v = mok_gemm.check_fc2_push(a, w, offs, table, ws.bases, slots, call.segment_rows)
        else:
            v = mok_gemm.check_fc1_dgrad_push(a, w, offs, table, ws.bases, slots, row_scalars, scalars,
                                              call.segment_rows)
        checked.append((w, offs, [int(f) for f in v]))
    for w, offs, v in checked:
        if fc2:
            mok_gemm.gemm_fc2_push_op(a, w, offs, table, ws.bases, slots, v, 0)
        else:
            mok_gemm.gemm_fc1_dgrad_push_op(a, w, offs, table, ws.bases, slots, row_scalars, scalars, v, 0)


def _rows_home(ws: Workspace, call: ExpertCall, fc2: bool, a, weights, offsets, counts, table,
               row_scalars=None) -> None:
    """fc2's output rows or the dX rows (and ``row_scalars``) of one chunk to their (token, slot)
    rows at home, with MoK's Hopper GEMMs: from the GEMM's epilogue where
    ``call.push_from_gemm`` (:func:`_push_rows_from_gemm`), else the GEMM into [n, H] rows and the
    push kernel (``expert_ffn.PUSH_FROM_GEMM_MIN_ROWS`` says when each is faster). Bitwise the
    same either way. Arguments as :func:`_push_rows_from_gemm`."""
    if call.push_from_gemm:
        _push_rows_from_gemm(ws, call, fc2, a, weights, offsets, counts, table, row_scalars)
        return
    if fc2:
        rows = plain_gemm_segments(call, a, weights, offsets, counts, weights[0].shape[1], mok_gemm.check_fc2,
                                   mok_gemm.launch_fc2)
    else:
        rows = plain_gemm_segments(call, a, weights, offsets, counts, weights[0].shape[2], mok_gemm.check_fc1_dgrad,
                                   mok_gemm.launch_fc1_dgrad)
    comm_ops.push_rows(ws.bases, ws.layout.slots, 0 if fc2 else ws.layout.scalars, table, offsets, ws.layout.topk,
                       rows, row_scalars, 0)


# ---- forward (the cuda backend's; the megakernel keeps rows in its own launch) ------------------

def cuda_forward(ws: Workspace, call: ExpertCall, plan: Sequence[Chunk], table: torch.Tensor, offsets: torch.Tensor,
                 counts: torch.Tensor, fc1, fc2, fc1_2, fc2_2, keep: bool) -> List[Kept]:
    """The ``cuda`` backend's expert stage, chunk by chunk, after the dispatch prologue: pull the
    chunk's x rows and router weights, the expert FFN, and each output row to its (token, slot)
    on its home rank: with MoK's Hopper GEMMs fc1 + SwiGLU, then fc2 and its rows home
    (:func:`_rows_home`: from fc2's epilogue where that is faster, no [n, H] output rows); with torch's GEMMs
    ``expert_ffn.expert_forward`` then the push kernel. Returns what the kept chunks keep when
    ``keep`` (a forward with grad), else nothing."""
    K, H = ws.layout.topk, ws.layout.hidden
    fc1s = (fc1,) if fc1_2 is None else (fc1, fc1_2)
    fc2s = (fc2,) if fc2_2 is None else (fc2, fc2_2)
    kept: List[Kept] = []
    for c in plan:
        tab = table[c.row0:c.row1]
        offs, cnts = (offsets, counts) if len(plan) == 1 else chunk_layout(offsets, counts, c.row0, c.row1)
        x_c, w_c = comm_ops.pull_rows(ws.bases, ws.layout.rows, True, ws.layout.scalars, tab, offs, K, c.rows, H,
                                      True, 0)
        if call.hopper_gemms:
            h, gu = _fc1(call, x_c, w_c, fc1s, offs, cnts)
            _rows_home(ws, call, True, h, fc2s, offs, cnts, tab)
            del h
        else:
            out_rows, _, gu = expert_forward(call, x_c, w_c, fc1, fc2, offs, cnts, fc1_2, fc2_2)
            comm_ops.push_rows(ws.bases, ws.layout.slots, 0, tab, offs, K, out_rows, None, 0)
        if keep and c.kept:
            kept.append((x_c, w_c, gu))
    return kept


# ---- backward ---------------------------------------------------------------------------------

class _WeightGrads:
    """The weight gradients of one backward, written chunk by chunk: bf16, one tensor per weight
    segment; or, with ``main_grads``, accumulated in fp32 into the per-expert buffers (the
    segments then get placeholders, main_grad.py). With several chunks, two fp32 carry buffers of
    one expert per matrix, used in turn (a chunk reads the carry its predecessor wrote and writes
    the other)."""

    def __init__(self, fc1s, fc2s, chunks: int, main_grads: Optional[MainGrads] = None):
        self.fc1s, self.fc2s = fc1s, fc2s
        self.into = None
        if main_grads is None:
            self.d_fc1 = [torch.empty_like(w) for w in fc1s]  # [L_i, 2I, H]
            self.d_fc2 = [torch.empty_like(w) for w in fc2s]  # [L_i, H, I]
        else:
            self.into = (split_segments(main_grads[0], fc1s), split_segments(main_grads[1], fc2s))
        self.chunks = chunks
        self.carry1 = self.carry2 = None
        if chunks > 1:
            f32 = dict(dtype=torch.float32, device=fc1s[0].device)
            self.carry1 = [torch.empty(fc1s[0].shape[1:], **f32) for _ in range(2)]
            self.carry2 = [torch.empty(fc2s[0].shape[1:], **f32) for _ in range(2)]

    def add(self, i: int, c: Chunk, offsets: torch.Tensor, counts: torch.Tensor, fc1: bool, a, b) -> None:
        """Chunk i's share of d fc1[e] += a^T b (a = d gate|up, b = x) when ``fc1``, else of
        d fc2[e] += a^T b (a = dY, b = h), over its rows (chunk-row operands), finishing every
        expert whose rows end in the chunk. ``offsets`` int32 [L + 1] and ``counts`` int32 [L]: the
        whole layout's."""
        bufs = self.carry1 if fc1 else self.carry2
        c_in = c_out = None
        if bufs is not None:
            c_in = bufs[(i - 1) % 2] if i > 0 else None
            c_out = bufs[i % 2] if i < self.chunks - 1 else None
        for s, (_, offs, cnts) in enumerate(segments(self.fc1s, offsets, counts)):
            if self.into is not None:
                mok_gemm.weight_grad_into(a, b, offs, self.into[0 if fc1 else 1][s], counts=cnts, row0=c.row0,
                                          row1=c.row1, carry_in=c_in, carry_out=c_out)
            else:
                mok_gemm.weight_grad_rows(a, b, offs, (self.d_fc1 if fc1 else self.d_fc2)[s], row0=c.row0,
                                          row1=c.row1, carry_in=c_in, carry_out=c_out, counts=cnts)

    def results(self):
        """(d fc1 per segment, d fc2 per segment): the gradients, or placeholders."""
        if self.into is not None:
            return placeholders(self.fc1s), placeholders(self.fc2s)
        return self.d_fc1, self.d_fc2


def consume_kept(ctx) -> None:
    """Marks the autograd context's kept activations as taken by its backward, which, with MoK's
    Hopper GEMMs (``ctx.call``), writes the gradient of the fc1 pre-activation over the kept one:
    a second backward through the same forward (``retain_graph=True``) then raises instead of
    reading it."""
    if not ctx.call.hopper_gemms:
        return
    if getattr(ctx, "mok_kept_consumed", False):
        raise RuntimeError("mok_moe: a second backward through the same forward (retain_graph=True) is not "
                           "supported: the first backward wrote the gradient of the fc1 pre-activation over the "
                           "activations the forward kept; run the forward again")
    ctx.mok_kept_consumed = True


def moe_backward(ws: Workspace, call: ExpertCall, plan: Sequence[Chunk], kept: Sequence[Kept], dy: torch.Tensor,
                 x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, table: torch.Tensor,
                 offsets: torch.Tensor, counts: torch.Tensor, fc1, fc2, fc1_2=None, fc2_2=None,
                 main_grads: Optional[MainGrads] = None):
    """The layer backward of both GPU backends, on workspace ``ws``: publish dy bf16 [T, H] (and,
    when the plan replays rows, x bf16 [T, H] and topk_weights fp32 [T, K] again); then chunk by
    chunk, pull the chunk's dy rows (reverse combine), take its kept activations (``kept``, one
    entry per kept chunk) or replay them, run the fc2 data gradient with the SwiGLU backward, the
    two weight gradients and the fc1 data gradient, and push dX and the router-weight gradient to
    each route's (token, slot) on its home rank (reverse dispatch); finally sum the K slots of
    each token in a fixed order. With ``main_grads`` the weight gradients are accumulated into
    them in fp32 and the weight gradients returned are placeholders (main_grad.py).

    Returns:
        (dx bf16 [T, H], d topk_weights fp32 [T, K], d_fc1 bf16 [L1, 2I, H], d_fc2 bf16 [L1, H, I],
        d_fc1_2, d_fc2_2: the second weight segment's, or None).
    """
    ws.raise_if_failed(call.timeout_s)
    T = topk_ids.shape[0]
    K, H = ws.layout.topk, ws.layout.hidden
    ws.publish_rows(dy.to(torch.bfloat16).contiguous())
    replays = any(not c.kept for c in plan)
    if replays:
        ws.publish_replay(x, topk_weights)
    ws.barrier(SITE_BWD_DISPATCH, call.timeout_s)
    fc1s = (fc1,) if fc1_2 is None else (fc1, fc1_2)
    fc2s = (fc2,) if fc2_2 is None else (fc2, fc2_2)
    if not call.hopper_gemms:  # one kept chunk (training_plan): torch's GEMMs on the whole layout
        (c,), ((x_disp, w_disp, gu),) = plan, kept
        d_out, _ = comm_ops.pull_rows(ws.bases, ws.layout.rows, True, 0, table, offsets, K, c.rows, H, False, 0)
        dx_rows, dw_rows, d_fc1, d_fc2, d_fc1_2, d_fc2_2 = expert_backward(call, d_out, x_disp, w_disp, gu, fc1, fc2,
                                                                          offsets, counts, fc1_2, fc2_2)
        if main_grads is not None:  # torch's GEMMs gave bf16 gradients (one segment): DDP's add, here;
            add_into(main_grads[0], d_fc1)  # the gradients then go back as the placeholders
            add_into(main_grads[1], d_fc2)
        comm_ops.push_rows(ws.bases, ws.layout.slots, ws.layout.scalars, table, offsets, K, dx_rows, dw_rows, 0)
    else:
        grads = _WeightGrads(fc1s, fc2s, len(plan), main_grads)
        kept_iter = iter(kept)
        for i, c in enumerate(plan):
            tab = table[c.row0:c.row1]
            offs, cnts = (offsets, counts) if len(plan) == 1 else chunk_layout(offsets, counts, c.row0, c.row1)
            d_out, _ = comm_ops.pull_rows(ws.bases, ws.layout.rows, True, 0, tab, offs, K, c.rows, H, False, 0)
            if c.kept:
                x_c, w_c, gu_c = next(kept_iter)
            else:
                x_c, w_c = comm_ops.pull_rows(ws.bases, ws.layout.rows_x, True, ws.layout.scalars, tab, offs, K,
                                              c.rows, H, True, 0)
                gu_c = _replay_preact(call, x_c, w_c, fc1s, offs, cnts)
            # Each operand is dropped once its last reader is queued, and d gate|up is written over the
            # chunk's gate|up (read only here; a second backward is refused, consume_kept): what the
            # chunk allocates is dY and h, then the dX rows (none where they go home from the GEMM's
            # epilogue).
            if len(fc2s) > 1:
                d_gu, dw_rows, h = fc2_dgrad_swiglu_segments(call, d_out, fc2s, gu_c, offs, cnts, w_c, over_ab=True)
            else:
                dw_rows, h = mok_gemm.fc2_dgrad_swiglu_(d_out, fc2, gu_c, offs, cnts, w_c,
                                                        tile_rows=call.segment_rows, want_h=True)
                d_gu = gu_c
            del gu_c, w_c
            grads.add(i, c, offsets, counts, False, d_out, h)
            del d_out, h
            grads.add(i, c, offsets, counts, True, d_gu, x_c)
            del x_c
            # dX rows and the router-weight gradient go home from the fc1 data gradient's epilogue
            # (reverse dispatch): the dX rows are never written to [n, H].
            _rows_home(ws, call, False, d_gu, fc1s, offs, cnts, tab, dw_rows)
            del d_gu, dw_rows
        g1, g2 = grads.results()
        d_fc1, d_fc2 = g1[0], g2[0]
        d_fc1_2 = g1[1] if fc1_2 is not None else None
        d_fc2_2 = g2[1] if fc2_2 is not None else None
    ws.barrier(SITE_BWD_COMBINE, call.timeout_s)
    dx, dw = comm_ops.sum_slots(ws.slots[:T], topk_ids, call.num_experts, ws.scalars[:T], ws.status)
    ws.mirror_status()
    return dx, dw, d_fc1, d_fc2, d_fc1_2, d_fc2_2
