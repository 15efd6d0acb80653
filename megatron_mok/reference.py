"""The reference implementation of the MoK contract (docs/contract.md): the oracle.

Slow on purpose and written to be read. It follows the same dataflow as the fast backends,
step by step, so that a test can compare any intermediate:

1. all-gather the top-k expert ids of every rank of the EP group;
2. build this rank's schedule table (:func:`build_schedule`): per local expert, the routes
   (source rank, source token, top-k slot) sent to it, in the fixed order (source rank,
   token, slot), each expert's segment padded to the tile height;
3. pull dispatch: copy each scheduled token row out of its source rank into the
   expert-grouped layout (padding rows are zero);
4. the SwiGLU expert FFN per local expert segment;
5. push combine: each expert output row goes to the (token, slot) of its home rank;
6. the weighted sum over the top-k slots, j = 0 .. K-1 in that order.

The backward mirrors it (reverse-combine pulls dY times the router weight, the expert FFN
backward, reverse-dispatch pushes dX per slot, then a fixed-order sum) and is written out, not
left to autograd, so that it documents what the fast backends compute.

"Pull" and "push" across ranks are emulated with all-gathers over ``torch.distributed``
(gloo on CPU, NCCL on GPU): a rank reads a peer's rows out of the gathered copy. Arithmetic
runs in float32 (float64 when the inputs are float64) and results are cast back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = ["Schedule", "build_schedule", "reference_moe", "dense_moe"]

# The cross-rank steps, numbered as the GPU backends' barriers (megatron_mok.functional.faults).
SITE_FWD_DISPATCH, SITE_FWD_COMBINE, SITE_BWD_DISPATCH, SITE_BWD_COMBINE = 1, 2, 3, 4


@dataclass(frozen=True)
class Schedule:
    """The schedule table of one rank (the expert owner).

    Attributes:
        table: int32 [R_pad, 2]. Row i of the expert-grouped layout holds the token of
            ``(src_rank, src_route) = table[i]`` where ``src_route = token * K + slot``
            indexes the source rank's [T, K] top-k arrays; padding rows are (-1, -1).
        expert_counts: int32 [L], routes received by each local expert.
        expert_offsets: int32 [L + 1], first row of each local expert's padded segment;
            ``expert_offsets[L]`` is R_pad, the padded row count.
    """

    table: torch.Tensor
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor

    @property
    def num_rows(self) -> int:
        """R_pad: rows of the expert-grouped layout, padding included."""
        return int(self.expert_offsets[-1])

    def valid_rows(self) -> torch.Tensor:
        """bool [R_pad]: True where the row holds a route, False for padding."""
        return self.table[:, 0] >= 0


def build_schedule(
    ids_per_rank: Sequence[torch.Tensor], rank: int, experts_per_rank: int, tile_rows: int
) -> Schedule:
    """Build the schedule table of ``rank`` from the top-k ids of every rank.

    Args:
        ids_per_rank: P int tensors, ``ids_per_rank[s]`` is [T_s, K], global expert ids of
            source rank s's tokens; -1 marks an unused slot.
        rank: the expert owner whose table is built; it holds experts
            ``rank * experts_per_rank .. (rank + 1) * experts_per_rank - 1``.
        experts_per_rank: L = E / P.
        tile_rows: each expert's segment is padded to a multiple of this.

    Returns:
        The :class:`Schedule`, on the CPU.
    """
    first_expert = rank * experts_per_rank
    src_ranks: List[torch.Tensor] = []
    src_routes: List[torch.Tensor] = []
    local_experts: List[torch.Tensor] = []
    for src, ids in enumerate(ids_per_rank):
        flat = ids.reshape(-1).to(torch.int64).cpu()
        local = flat - first_expert
        mine = (flat >= 0) & (local >= 0) & (local < experts_per_rank)
        routes = torch.nonzero(mine).reshape(-1)  # ascending: token-major, slot-minor
        src_ranks.append(torch.full_like(routes, src))
        src_routes.append(routes)
        local_experts.append(local[routes])
    src_rank = torch.cat(src_ranks) if src_ranks else torch.zeros(0, dtype=torch.int64)
    src_route = torch.cat(src_routes) if src_routes else torch.zeros(0, dtype=torch.int64)
    expert = torch.cat(local_experts) if local_experts else torch.zeros(0, dtype=torch.int64)

    counts = torch.bincount(expert, minlength=experts_per_rank)
    padded = (counts + tile_rows - 1) // tile_rows * tile_rows
    offsets = torch.zeros(experts_per_rank + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(padded, 0)

    table = torch.full((int(offsets[-1]), 2), -1, dtype=torch.int64)
    for e in range(experts_per_rank):
        # The concatenation above is already in (source rank, token, slot) order, and
        # selecting with a mask keeps that order: this is the contract's fixed order.
        sel = expert == e
        n = int(counts[e])
        start = int(offsets[e])
        table[start:start + n, 0] = src_rank[sel]
        table[start:start + n, 1] = src_route[sel]
    return Schedule(
        table=table.to(torch.int32),
        expert_counts=counts.to(torch.int32),
        expert_offsets=offsets.to(torch.int32),
    )


# ----------------------------------------------------------------------------------------------
# Cross-rank data movement, emulated with all-gathers.


def _group_size_rank(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_gather_ragged(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> List[torch.Tensor]:
    """All-gather tensors whose first dimension differs across ranks. Returns P tensors."""
    world, _ = _group_size_rank(group)
    if world == 1:
        return [t]
    n = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    sizes_host = [int(s.item()) for s in sizes]
    n_max = max(sizes_host)
    padded = t.new_zeros((n_max,) + tuple(t.shape[1:]))
    padded[: t.shape[0]] = t
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded.contiguous(), group=group)
    return [g[:s] for g, s in zip(gathered, sizes_host)]


def _pull_rows(schedule: Schedule, rows_per_rank: Sequence[torch.Tensor], topk: int,
               per_route: bool) -> torch.Tensor:
    """Pull: row i of the result is read from the source rank named by ``table[i]``; padding
    rows are zero. ``rows_per_rank[s]`` is [T_s, F] per token (dispatch), or [T_s, K, F] per
    route when ``per_route`` (the reverse-combine pulls dY of one (token, slot))."""
    first = rows_per_rank[0]
    features = first.shape[2:] if per_route else first.shape[1:]
    out = first.new_zeros((schedule.num_rows,) + tuple(features))
    table = schedule.table.to(device=first.device, dtype=torch.int64)
    for src, rows in enumerate(rows_per_rank):
        sel = torch.nonzero(table[:, 0] == src).reshape(-1)
        token, slot = table[sel, 1] // topk, table[sel, 1] % topk
        out[sel] = rows[token, slot] if per_route else rows[token]
    return out


def _push_rows(
    schedules: Sequence[Schedule],
    rows_per_owner: Sequence[torch.Tensor],
    home_rank: int,
    num_tokens: int,
    topk: int,
) -> torch.Tensor:
    """Push: every owner's expert-grouped rows go to the (token, slot) they came from.
    Returns the home rank's slots [T, K, F]; slots that receive nothing are zero. Each
    (token, slot) receives at most one row, so the result does not depend on order."""
    first = rows_per_owner[0]
    slots = first.new_zeros((num_tokens, topk) + tuple(first.shape[1:]))
    for schedule, rows in zip(schedules, rows_per_owner):
        table = schedule.table.to(device=first.device, dtype=torch.int64)
        sel = torch.nonzero(table[:, 0] == home_rank).reshape(-1)
        token, slot = table[sel, 1] // topk, table[sel, 1] % topk
        slots[token, slot] = rows[sel]
    return slots


# ----------------------------------------------------------------------------------------------
# The expert FFN on the expert-grouped layout.


def _expert_segments(schedule: Schedule):
    offsets = schedule.expert_offsets.tolist()
    counts = schedule.expert_counts.tolist()
    for e, count in enumerate(counts):
        yield e, offsets[e], offsets[e] + count


def _ffn_forward(x_disp, fc1, fc2, schedule):
    """SwiGLU per expert segment. Returns (gate pre-activation a, up b, output o)."""
    inter = fc1.shape[1] // 2
    a = x_disp.new_zeros((x_disp.shape[0], inter))
    b = x_disp.new_zeros((x_disp.shape[0], inter))
    o = x_disp.new_zeros((x_disp.shape[0], fc2.shape[1]))
    for e, lo, hi in _expert_segments(schedule):
        if hi == lo:
            continue
        xe = x_disp[lo:hi]
        a[lo:hi] = xe @ fc1[e, :inter].t()
        b[lo:hi] = xe @ fc1[e, inter:].t()
        o[lo:hi] = (F.silu(a[lo:hi]) * b[lo:hi]) @ fc2[e].t()
    return a, b, o


def _ffn_backward(d_o, x_disp, a, b, fc1, fc2, schedule):
    """Backward of :func:`_ffn_forward`. Returns (dx_disp, d_fc1, d_fc2)."""
    inter = fc1.shape[1] // 2
    dx = torch.zeros_like(x_disp)
    d_fc1 = torch.zeros_like(fc1)
    d_fc2 = torch.zeros_like(fc2)
    for e, lo, hi in _expert_segments(schedule):
        if hi == lo:
            continue
        xe, ae, be, doe = x_disp[lo:hi], a[lo:hi], b[lo:hi], d_o[lo:hi]
        sig = torch.sigmoid(ae)
        silu = ae * sig
        h = silu * be
        d_fc2[e] = doe.t() @ h
        dh = doe @ fc2[e]
        da = dh * be * (sig * (1 + ae * (1 - sig)))
        db = dh * silu
        d_fc1[e, :inter] = da.t() @ xe
        d_fc1[e, inter:] = db.t() @ xe
        dx[lo:hi] = da @ fc1[e, :inter] + db @ fc1[e, inter:]
    return dx, d_fc1, d_fc2


def _sum_slots(slots: torch.Tensor, weights: Optional[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
    """Fixed-order (j = 0 .. K-1) sum over top-k slots [T, K, H] -> [T, H]."""
    out = slots.new_zeros((slots.shape[0],) + tuple(slots.shape[2:]))
    for j in range(slots.shape[1]):
        term = slots[:, j]
        if weights is not None:
            term = term * weights[:, j : j + 1]
        out = out + torch.where(valid[:, j : j + 1], term, torch.zeros_like(term))
    return out


# ----------------------------------------------------------------------------------------------
# The autograd function.


class _ReferenceMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, fc1, fc2, group, tile_rows, checkpoint):
        world, rank = _group_size_rank(group)
        topk = topk_ids.shape[1]
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        experts_per_rank = fc1.shape[0]

        ids_per_rank = _all_gather_ragged(topk_ids, group)
        schedules = [build_schedule(ids_per_rank, r, experts_per_rank, tile_rows) for r in range(world)]
        mine = schedules[rank]

        xc = x.to(compute)
        fc1c, fc2c = fc1.to(compute), fc2.to(compute)
        x_disp = _pull_rows(mine, _all_gather_ragged(xc, group), topk, per_route=False)
        a, b, o = _ffn_forward(x_disp, fc1c, fc2c, mine)
        if checkpoint is not None:
            checkpoint(SITE_FWD_COMBINE)
        slots = _push_rows(schedules, _all_gather_ragged(o, group), rank, x.shape[0], topk)
        valid = topk_ids >= 0
        y = _sum_slots(slots, topk_weights.to(compute), valid)

        ctx.save_for_backward(topk_ids, topk_weights, fc1, fc2, x_disp, a, b, slots)
        ctx.schedules = schedules
        ctx.group = group
        ctx.checkpoint = checkpoint
        ctx.x_dtype = x.dtype
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        topk_ids, topk_weights, fc1, fc2, x_disp, a, b, slots = ctx.saved_tensors
        group, schedules = ctx.group, ctx.schedules
        if ctx.checkpoint is not None:
            ctx.checkpoint(SITE_BWD_DISPATCH)
        _, rank = _group_size_rank(group)
        topk = topk_ids.shape[1]
        compute = slots.dtype
        valid = topk_ids >= 0
        dyc = dy.to(compute)

        # Router-weight gradient: <dy[t], slot[t, j]> for used slots.
        d_weights = torch.where(valid, (slots * dyc[:, None, :]).sum(-1), torch.zeros((), dtype=compute))
        # Reverse-combine: the expert owner pulls dY times the router weight for each route.
        d_slots = torch.where(valid[..., None], topk_weights.to(compute)[..., None] * dyc[:, None, :],
                              torch.zeros((), dtype=compute))
        d_o = _pull_rows(schedules[rank], _all_gather_ragged(d_slots, group), topk, per_route=True)
        dx_disp, d_fc1, d_fc2 = _ffn_backward(d_o, x_disp, a, b, fc1.to(compute), fc2.to(compute),
                                               schedules[rank])
        if ctx.checkpoint is not None:
            ctx.checkpoint(SITE_BWD_COMBINE)
        # Reverse-dispatch: push dX per slot back home, then the fixed-order sum.
        dx_slots = _push_rows(schedules, _all_gather_ragged(dx_disp, group), rank, dy.shape[0], topk)
        dx = _sum_slots(dx_slots, None, valid)
        return (
            dx.to(ctx.x_dtype),
            None,
            d_weights.to(topk_weights.dtype),
            d_fc1.to(fc1.dtype),
            d_fc2.to(fc2.dtype),
            None,
            None,
            None,
        )


def reference_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    *,
    ep_group: Optional[dist.ProcessGroup] = None,
    tile_rows: int = 128,
    checkpoint: Optional[Callable[[int], None]] = None,
) -> torch.Tensor:
    """The contract, computed by the reference dataflow. Inputs are assumed validated
    (:func:`megatron_mok.functional.mok_moe` validates them).

    Args:
        x: [T, H] tokens of this rank (bf16, fp16, fp32 or fp64).
        topk_ids: [T, K] int64 global expert ids, -1 for an unused slot.
        topk_weights: [T, K] router weights (fp32, or fp64 with fp64 ``x``).
        fc1_weight: [L, 2I, H], gate rows then up rows of each local expert.
        fc2_weight: [L, H, I].
        ep_group: the expert-parallel process group; None means P = 1.
        tile_rows: padding of each expert segment in the schedule.
        checkpoint: called as ``checkpoint(site)`` before the cross-rank steps after the first:
            the combine (:data:`SITE_FWD_COMBINE`), the backward's start
            (:data:`SITE_BWD_DISPATCH`) and its reverse dispatch (:data:`SITE_BWD_COMBINE`); the
            reference backend meets the other ranks there, with a timeout. The forward's start
            (dispatch) is the caller's.

    Returns:
        y: [T, H] in ``x.dtype``. Differentiable w.r.t. x, topk_weights and both weights.
    """
    return _ReferenceMoE.apply(x, topk_ids, topk_weights, fc1_weight, fc2_weight, ep_group, tile_rows, checkpoint)


def dense_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fc1_all: torch.Tensor,
    fc2_all: torch.Tensor,
) -> torch.Tensor:
    """The contract on one process, with no schedule: every token times each of its experts.

    Args:
        x: [T, H]; topk_ids: [T, K]; topk_weights: [T, K];
        fc1_all: [E, 2I, H] and fc2_all: [E, H, I], the weights of all E experts.

    Returns:
        y: [T, H] in the dtype of ``x``; differentiable through plain autograd.
    """
    inter = fc1_all.shape[1] // 2
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            v = x[t]
            h = F.silu(fc1_all[e, :inter] @ v) * (fc1_all[e, inter:] @ v)
            acc = acc + topk_weights[t, j] * (fc2_all[e] @ h)
        rows.append(acc)
    return torch.stack(rows) if rows else x * 0
