"""MoE inputs for tests: global data for P ranks with chosen routing, from a seed.

Every rank builds the same case from the same seed and takes its share, so no data has to
be sent between test processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

ROUTINGS = ("uniform", "hot", "empty", "duplicates", "unused", "zipf")


@dataclass
class MoECase:
    """x[r]: [T_r, H]; ids[r]: [T_r, K] int64; weights[r]: [T_r, K]; fc1_all: [E, 2I, H];
    fc2_all: [E, H, I]; dy[r]: [T_r, H] an upstream gradient."""

    x: List[torch.Tensor]
    ids: List[torch.Tensor]
    weights: List[torch.Tensor]
    dy: List[torch.Tensor]
    fc1_all: torch.Tensor
    fc2_all: torch.Tensor
    experts_per_rank: int

    def local_fc1(self, rank: int) -> torch.Tensor:
        L = self.experts_per_rank
        return self.fc1_all[rank * L:(rank + 1) * L]

    def local_fc2(self, rank: int) -> torch.Tensor:
        L = self.experts_per_rank
        return self.fc2_all[rank * L:(rank + 1) * L]

    def to(self, device=None, dtype=None) -> "MoECase":
        f = lambda t: t.to(device=device, dtype=dtype)
        d = lambda t: t.to(device=device)
        return MoECase([f(t) for t in self.x], [d(t) for t in self.ids],
                       [d(t) for t in self.weights], [f(t) for t in self.dy],
                       f(self.fc1_all), f(self.fc2_all), self.experts_per_rank)


def route(gen: torch.Generator, tokens: int, num_experts: int, topk: int, routing: str) -> torch.Tensor:
    """[tokens, topk] int64 expert ids for one rank.

    uniform: K distinct experts per token, uniformly; hot: expert 0 in every token's slot 0,
    the rest distinct; empty: only every third expert is ever chosen (the rest get nothing;
    needs E >= 3K); duplicates: with replacement (a token may pick an expert twice);
    unused: uniform with about a quarter of the slots -1; zipf: distinct, skewed by a Zipf(1.2)
    popularity.
    """
    E = num_experts
    if tokens == 0:
        return torch.zeros((0, topk), dtype=torch.int64)
    if routing == "uniform":
        return torch.rand(tokens, E, generator=gen).argsort(dim=1)[:, :topk]
    if routing == "hot":
        rest = torch.rand(tokens, E - 1, generator=gen).argsort(dim=1)[:, : topk - 1] + 1
        return torch.cat([torch.zeros(tokens, 1, dtype=torch.int64), rest], dim=1)
    if routing == "empty":
        allowed = torch.arange(0, E, 3)
        assert allowed.numel() >= topk, "empty routing needs E >= 3K"
        pick = torch.rand(tokens, allowed.numel(), generator=gen).argsort(dim=1)[:, :topk]
        return allowed[pick]
    if routing == "duplicates":
        return torch.randint(0, E, (tokens, topk), generator=gen)
    if routing == "unused":
        ids = torch.rand(tokens, E, generator=gen).argsort(dim=1)[:, :topk]
        drop = torch.rand(tokens, topk, generator=gen) < 0.25
        return torch.where(drop, torch.full_like(ids, -1), ids)
    if routing == "zipf":
        popularity = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
        return torch.multinomial(popularity.expand(tokens, E), topk, replacement=False, generator=gen)
    raise ValueError(f"unknown routing {routing}")


def make_case(seed: int, tokens_per_rank: Sequence[int], hidden: int, ffn: int,
              experts_per_rank: int, topk: int, routing: str = "uniform",
              dtype: torch.dtype = torch.float64) -> MoECase:
    """Global inputs for len(tokens_per_rank) ranks (on the CPU). Weights are scaled so that
    activations stay O(1) at any size."""
    gen = torch.Generator().manual_seed(seed)
    P = len(tokens_per_rank)
    E = P * experts_per_rank
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    x = [randn(t, hidden) for t in tokens_per_rank]
    ids = [route(gen, t, E, topk, routing) for t in tokens_per_rank]
    weights = [torch.rand(t, topk, generator=gen, dtype=torch.float64) for t in tokens_per_rank]
    dy = [randn(t, hidden) for t in tokens_per_rank]
    fc1 = randn(E, 2 * ffn, hidden) / hidden ** 0.5
    fc2 = randn(E, hidden, ffn) / ffn ** 0.5
    w_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return MoECase([t.to(dtype) for t in x], ids, [w.to(w_dtype) for w in weights],
                   [t.to(dtype) for t in dy], fc1.to(dtype), fc2.to(dtype), experts_per_rank)


def grouped_oracle(x, ids, weights, fc1_all, fc2_all):
    """The contract computed per expert over a batch of tokens, with plain autograd: fast
    enough on a GPU for real sizes. Takes leaf tensors of any float dtype (use float32 or
    float64); returns y [T, H]. Summation order is not fixed: an oracle, not a backend."""
    T, K = ids.shape
    inter = fc1_all.shape[1] // 2
    y = torch.zeros(T, x.shape[1], dtype=x.dtype, device=x.device)
    flat = ids.reshape(-1)
    for e in torch.unique(flat[flat >= 0]).tolist():
        routes = torch.nonzero(flat == e).reshape(-1)
        tok, slot = routes // K, routes % K
        v = x[tok]
        h = torch.nn.functional.silu(v @ fc1_all[e, :inter].t()) * (v @ fc1_all[e, inter:].t())
        out = (h @ fc2_all[e].t()) * weights[tok, slot][:, None]
        y = y.index_add(0, tok, out)
    return y
