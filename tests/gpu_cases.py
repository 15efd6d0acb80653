"""MoE inputs generated on the GPU at real sizes, and the fp32 oracle of their forward and
gradients (tests/cases.py's grouped_oracle)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

from .cases import grouped_oracle, route


@dataclass
class GpuCase:
    x: List[torch.Tensor]        # bf16 [T_r, H]
    ids: List[torch.Tensor]      # int64 [T_r, K]
    weights: List[torch.Tensor]  # fp32 [T_r, K]
    dy: List[torch.Tensor]       # bf16 [T_r, H]
    fc1_all: torch.Tensor        # bf16 [E, 2I, H]
    fc2_all: torch.Tensor        # bf16 [E, H, I]
    experts_per_rank: int

    def local(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        L = self.experts_per_rank
        return t[rank * L:(rank + 1) * L]


def gpu_case(seed: int, tokens: Sequence[int], hidden: int, ffn: int, experts_per_rank: int, topk: int,
             routing: str = "uniform") -> GpuCase:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    E = len(tokens) * experts_per_rank
    randn = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    return GpuCase(
        x=[randn(t, hidden).bfloat16() for t in tokens],
        ids=[route(cpu_gen, t, E, topk, routing).cuda() for t in tokens],
        weights=[torch.rand(t, topk, generator=gen, device="cuda") for t in tokens],
        dy=[randn(t, hidden).bfloat16() for t in tokens],
        fc1_all=(randn(E, 2 * ffn, hidden) / hidden ** 0.5).bfloat16(),
        fc2_all=(randn(E, hidden, ffn) / ffn ** 0.5).bfloat16(),
        experts_per_rank=experts_per_rank,
    )


def oracle(case: GpuCase):
    """fp32 forward and gradients of every rank from the bf16 inputs (upcast).

    Returns (ys, dxs, dws, d_fc1_all, d_fc2_all) in fp32."""
    leaf = lambda t: t.float().requires_grad_()
    xs, ws = [leaf(t) for t in case.x], [leaf(t) for t in case.weights]
    fc1, fc2 = leaf(case.fc1_all), leaf(case.fc2_all)
    ys = [grouped_oracle(x, ids, w, fc1, fc2) for x, ids, w in zip(xs, case.ids, ws)]
    loss = sum((y * dy.float()).sum() for y, dy in zip(ys, case.dy))
    grads = torch.autograd.grad(loss, [*xs, *ws, fc1, fc2], allow_unused=True, materialize_grads=True)
    P = len(xs)
    return ([y.detach() for y in ys], list(grads[:P]), list(grads[P:2 * P]), grads[2 * P], grads[2 * P + 1])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32 (0 when both are empty); NaN anywhere gives inf."""
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    if b.numel() == 0:
        return 0.0
    denom = b.norm()
    return float((a - b).norm() / denom) if denom > 0 else float((a - b).norm())
