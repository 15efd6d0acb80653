"""The plain PyTorch pipeline MoK is measured against: permute tokens by expert,
``all_to_all_single`` (NCCL on GPU, gloo on CPU), ``torch._grouped_mm`` for fc1, SwiGLU,
``torch._grouped_mm`` for fc2, ``all_to_all_single`` back, weighted sum.

It computes the MoK contract (docs/contract.md) with autograd doing the backward. It reads
the split sizes on the host (one device-to-host copy per forward), as NCCL's all_to_all
needs them. ``torch._grouped_mm`` runs in bf16 on sm_90 and in any float dtype on the CPU.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single as _a2a_autograd

Mark = Optional[Callable[[str], None]]
"""Called with a phase name at phase boundaries ("dispatch", "experts", "combine", "end"), to
time the forward's phases (see :mod:`megatron_mok.bench.timing`)."""


def _exclusive_cumsum(t: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(t, 0) - t


def _source_to_expert_order(recv_counts: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder received rows from (source rank, local expert) order into
    (local expert, source rank) order.

    Args:
        recv_counts: int64 [P, L] on the CPU, rows received from rank s for local expert l.

    Returns:
        int64 [R] with R = recv_counts.sum(): entry i is the received row that goes to
        position i of the expert-grouped layout.
    """
    starts = _exclusive_cumsum(recv_counts.reshape(-1)).view_as(recv_counts)
    lengths = recv_counts.t().reshape(-1)
    seg_starts = starts.t().reshape(-1)
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    out_starts = _exclusive_cumsum(lengths)
    shift = torch.repeat_interleave(seg_starts - out_starts, lengths, output_size=total)
    return torch.arange(total, dtype=torch.int64) + shift


def a2a_grouped_mm_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    *,
    ep_group: Optional[dist.ProcessGroup] = None,
    mark: Mark = None,
) -> torch.Tensor:
    """The MoE layer as an all_to_all + grouped GEMM pipeline.

    Args:
        x: [T, H] tokens (bf16 on GPU).
        topk_ids: int64 [T, K] global expert ids, -1 for an unused slot; expert e lives on
            rank e // L as local expert e % L.
        topk_weights: float32 [T, K] router weights.
        fc1_weight: [L, 2I, H] gate rows then up rows; fc2_weight: [L, H, I].
        ep_group: the EP group of P ranks; None for P = 1.
        mark: optional phase marker (called with "dispatch", "experts", "combine", "end").

    Returns:
        y: [T, H] in x's dtype, ``y[t] = sum_j w[t, j] * FFN_{ids[t, j]}(x[t])``;
        differentiable w.r.t. x, topk_weights, fc1_weight and fc2_weight.
    """
    mark = mark or (lambda _name: None)
    mark("dispatch")
    world = 1 if ep_group is None else dist.get_world_size(ep_group)
    tokens, topk = topk_ids.shape
    local_experts = fc1_weight.shape[0]
    num_experts = local_experts * world

    # Permute: routes sorted by global expert id (so by destination rank, then local expert);
    # unused slots (-1) sort last and are cut off.
    flat = topk_ids.reshape(-1)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_experts))
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    if world > 1:
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=ep_group)
        both = torch.stack([counts, recv]).cpu()  # the one host sync
        send_counts, recv_counts = both[0].view(world, local_experts), both[1].view(world, local_experts)
    else:
        send_counts = recv_counts = counts.cpu().view(1, local_experts)
    send_splits = send_counts.sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    n_send = sum(send_splits)
    order = order[:n_send]
    token_of_route = order // topk
    x_send = x[token_of_route]
    if world > 1:
        x_recv = _a2a_autograd(x.new_empty((sum(recv_splits), x.shape[1])), x_send,
                               recv_splits, send_splits, group=ep_group)
        to_expert = _source_to_expert_order(recv_counts).to(x.device)
        x_grouped = x_recv[to_expert]
    else:
        to_expert = None
        x_grouped = x_send
    offsets = torch.cumsum(recv_counts.sum(0), 0).to(device=x.device, dtype=torch.int32)

    mark("experts")
    fc1_out = torch._grouped_mm(x_grouped, fc1_weight.transpose(-2, -1), offs=offsets)
    gate, up = fc1_out.chunk(2, dim=-1)
    hidden = F.silu(gate) * up
    out_grouped = torch._grouped_mm(hidden, fc2_weight.transpose(-2, -1), offs=offsets)

    mark("combine")
    if world > 1:
        back = torch.empty_like(to_expert)
        back[to_expert] = torch.arange(to_expert.numel(), device=to_expert.device)
        out_recv = out_grouped[back]
        out_send = _a2a_autograd(out_grouped.new_empty((n_send, out_grouped.shape[1])), out_recv,
                                 send_splits, recv_splits, group=ep_group)
    else:
        out_send = out_grouped
    route_weights = topk_weights.reshape(-1)[order]
    y = torch.zeros((tokens, x.shape[1]), dtype=torch.float32, device=x.device)
    y = y.index_add(0, token_of_route, out_send.float() * route_weights[:, None].float())
    y = y.to(x.dtype)
    mark("end")
    return y
