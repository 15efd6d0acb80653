"""Benchmark routing: top-k expert ids and router weights, uniform or skewed, and the route
counts the floors are computed from.

Every token picks K distinct experts (Megatron's routing map cannot hold a duplicate), so
every backend, Megatron's layers included, runs the same routes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

ROUTINGS = ("uniform", "zipf", "hot")
"""uniform: K distinct experts uniformly at random. zipf: K distinct experts drawn without
replacement with popularity 1 / rank**s over a fixed random order of the experts (the same on
every rank, so the popular experts are spread over the GPUs). hot: a fraction of the tokens
(``hot_fraction``) pick expert 0, the hot expert, in one of their slots; all other picks are
uniform."""

PERMUTATION_SEED = 1234
"""Seed of the expert order that Zipf popularity follows (identical on every rank)."""


class RoutingError(ValueError):
    """Unsupported routing parameters; the message names the value and the rule."""


@dataclass(frozen=True)
class RoutingSpec:
    """How tokens are routed.

    Attributes:
        kind: one of :data:`ROUTINGS`.
        zipf_s: the Zipf exponent s > 0 (``kind == "zipf"``); 0 would be uniform.
        hot_fraction: fraction in (0, 1] of tokens that pick the hot expert (``kind == "hot"``).
    """

    kind: str = "uniform"
    zipf_s: float = 1.2
    hot_fraction: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ROUTINGS:
            raise RoutingError(f"routing {self.kind!r} is not supported; choose one of {ROUTINGS}")
        if not self.zipf_s > 0:
            raise RoutingError(f"--zipf-s {self.zipf_s} must be positive")
        if not 0 < self.hot_fraction <= 1:
            raise RoutingError(f"--hot-fraction {self.hot_fraction} must lie in (0, 1]")

    @property
    def label(self) -> str:
        if self.kind == "zipf":
            return f"zipf(s={self.zipf_s:g})"
        if self.kind == "hot":
            return f"hot(expert 0, {self.hot_fraction:g} of tokens)"
        return "uniform"

    def to_json(self) -> Dict[str, object]:
        out: Dict[str, object] = {"kind": self.kind}
        if self.kind == "zipf":
            out["zipf_s"] = self.zipf_s
        if self.kind == "hot":
            out["hot_fraction"] = self.hot_fraction
        return out


def zipf_popularity(num_experts: int, s: float) -> torch.Tensor:
    """float64 [E] sampling weights: the expert at position i of a fixed random order (seed
    :data:`PERMUTATION_SEED`) gets 1 / (i + 1)**s."""
    gen = torch.Generator().manual_seed(PERMUTATION_SEED)
    order = torch.randperm(num_experts, generator=gen)
    popularity = torch.empty(num_experts, dtype=torch.float64)
    popularity[order] = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** s
    return popularity


def make_routing(spec: RoutingSpec, tokens: int, num_experts: int, topk: int, *,
                 seed: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids and router weights for one rank's tokens.

    Args:
        spec: the routing.
        tokens: T; num_experts: E (the benchmark's expert count); topk: K <= E.
        seed: different per rank, so ranks route differently.
        device: where the tensors are made.

    Returns:
        topk_ids: int64 [T, K], K distinct global expert ids per token.
        topk_weights: float32 [T, K], positive, each row summing to 1.
    """
    if topk > num_experts:
        raise RoutingError(f"top-k={topk} distinct experts cannot be picked from {num_experts}")
    gen = torch.Generator(device=device).manual_seed(seed)
    if spec.kind == "uniform":
        ids = torch.rand(tokens, num_experts, generator=gen, device=device).topk(topk, dim=1).indices
    elif spec.kind == "zipf":
        popularity = zipf_popularity(num_experts, spec.zipf_s).to(device)
        ids = torch.multinomial(popularity.expand(tokens, num_experts), topk, replacement=False,
                                generator=gen)
    else:  # hot
        # K distinct experts among 1..E-1, then expert 0 replaces a random slot for the hot tokens.
        ids = torch.rand(tokens, num_experts - 1, generator=gen, device=device).topk(topk, dim=1).indices + 1
        hot = torch.rand(tokens, generator=gen, device=device) < spec.hot_fraction
        slot = torch.randint(0, topk, (tokens,), generator=gen, device=device)
        rows = torch.nonzero(hot).reshape(-1)
        ids[rows, slot[rows]] = 0
    weights = torch.rand(tokens, topk, generator=gen, device=device, dtype=torch.float32) + 0.1
    weights = weights / weights.sum(dim=1, keepdim=True)
    return ids.to(torch.int64).contiguous(), weights.contiguous()


@dataclass(frozen=True)
class RouteCounts:
    """Routes between the ranks of the EP group.

    Attributes:
        matrix: int64 [P, P] on the CPU; ``matrix[s, d]`` counts routes (token, slot) of rank s
            whose expert lives on rank d.
        expert_load: int64 [E] on the CPU; routes received by each expert over all ranks.
    """

    matrix: torch.Tensor
    expert_load: torch.Tensor

    @property
    def sent(self) -> List[int]:
        """S_r: used routes of rank r's tokens (T_r * K when no slot is -1)."""
        return self.matrix.sum(1).tolist()

    @property
    def received(self) -> List[int]:
        """R_r: routes whose expert lives on rank r, from every rank (rows rank r computes)."""
        return self.matrix.sum(0).tolist()

    @property
    def received_remote(self) -> List[int]:
        """Routes rank r receives from other ranks (dispatch in, combine out over NVLink)."""
        return (self.matrix.sum(0) - self.matrix.diagonal()).tolist()

    @property
    def sent_remote(self) -> List[int]:
        """Routes of rank r's tokens computed on other ranks (dispatch out, combine in)."""
        return (self.matrix.sum(1) - self.matrix.diagonal()).tolist()

    def to_json(self) -> Dict[str, object]:
        load = self.expert_load.to(torch.float64)
        return {
            "matrix": self.matrix.tolist(),
            "sent": self.sent,
            "received": self.received,
            "received_remote": self.received_remote,
            "sent_remote": self.sent_remote,
            "expert_load_max": int(self.expert_load.max()) if self.expert_load.numel() else 0,
            "expert_load_mean": float(load.mean()) if load.numel() else 0.0,
        }


def count_routes(topk_ids: torch.Tensor, experts_per_rank: int, ep_size: int,
                 group: Optional[dist.ProcessGroup] = None) -> RouteCounts:
    """Gather the route counts of every rank (a collective over ``group`` when P > 1).

    Args:
        topk_ids: int64 [T, K] global expert ids of this rank, -1 for an unused slot.
        experts_per_rank: L; expert e lives on rank e // L.
        ep_size: P.
        group: the EP group (None for P = 1).
    """
    num_experts = experts_per_rank * ep_size
    flat = topk_ids.reshape(-1)
    flat = flat[flat >= 0]
    per_expert = torch.bincount(flat, minlength=num_experts).to(torch.int64)
    per_rank = per_expert.view(ep_size, experts_per_rank).sum(1)
    if ep_size == 1:
        return RouteCounts(matrix=per_rank.view(1, 1).cpu(), expert_load=per_expert.cpu())
    rows = [torch.zeros_like(per_rank) for _ in range(ep_size)]
    dist.all_gather(rows, per_rank, group=group)
    dist.all_reduce(per_expert, group=group)
    return RouteCounts(matrix=torch.stack(rows).cpu(), expert_load=per_expert.cpu())
