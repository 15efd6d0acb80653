"""MoE inputs generated on the GPU at real sizes, and the fp32 oracle of their forward and
gradients (tests/cases.py's grouped_oracle)."""

from __future__ import annotations

import contextlib
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


# ------------------------------------------------------------------------------------------
# Running a backend on every rank of a case, and judging the results.

TOL = 1.5e-2  # bf16 operands and intermediates against an fp32 oracle


def leaves(case: GpuCase, rank: int):
    """Fresh leaf copies (x, router weights, fc1, fc2) of ``rank``'s inputs, requiring grad."""
    leaf = lambda t: t.detach().clone().requires_grad_()
    return (leaf(case.x[rank]), leaf(case.weights[rank]), leaf(case.local(case.fc1_all, rank)),
            leaf(case.local(case.fc2_all, rank)))


def run_case(case: GpuCase, ep_groups, config, backend: str, streams=None, backward: bool = True,
             split: int = 0):
    """Forward, then backward, of every rank of ``case`` with ``backend``, each rank on its own
    stream when ``streams`` is given (virtual ranks), then a synchronisation and
    :func:`megatron_mok.functional.check_errors`. Returns per rank (y, dx, dw, d_fc1, d_fc2);
    the gradients are None without ``backward``. ``split`` > 0 passes each rank's weights as two
    weight segments, its last ``split`` experts in the second (as a fused shared expert is
    passed); d_fc1 and d_fc2 are then the segments' gradients concatenated."""
    from megatron_mok.functional import check_errors

    per_rank = _split_leaves(case, split)
    ys = _forward_ranks(case, per_rank, ep_groups, config, backend, streams)
    if backward:
        _backward_ranks(case, ys, streams)
    torch.cuda.synchronize()
    check_errors()
    return _results(ys, per_rank, backward)


def run_layers(cases: Sequence[GpuCase], ep_groups, config, backend: str, streams=None, split: int = 0):
    """As a model's MoE layers run: the forwards of every case (one layer each, same shapes,
    hence the same workspace) in order on every rank, then their backwards in reverse order, so
    that each backward runs after later calls have rewritten the shared workspace. Returns, per
    case, what :func:`run_case` returns for it."""
    from megatron_mok.functional import check_errors

    leaves_of = [_split_leaves(case, split) for case in cases]
    ys_of = [_forward_ranks(case, per_rank, ep_groups, config, backend, streams)
             for case, per_rank in zip(cases, leaves_of)]
    for case, ys in reversed(list(zip(cases, ys_of))):
        _backward_ranks(case, ys, streams)
    torch.cuda.synchronize()
    check_errors()
    return [_results(ys, per_rank, True) for ys, per_rank in zip(ys_of, leaves_of)]


def _split_leaves(case: GpuCase, split: int):
    """:func:`leaves` of every rank; with ``split`` > 0 the weights as two segments (run_case)."""
    per_rank = [leaves(case, r) for r in range(len(case.x))]
    if split:
        leaf = lambda t: t.detach().clone().requires_grad_()
        per_rank = [(x, w, (leaf(f1[:-split]), leaf(f1[-split:])), (leaf(f2[:-split]), leaf(f2[-split:])))
                    for x, w, f1, f2 in per_rank]
    return per_rank


def _forward_ranks(case: GpuCase, per_rank, ep_groups, config, backend: str, streams):
    from megatron_mok.functional import mok_moe

    ys = []
    main = torch.cuda.current_stream()
    for r in range(len(case.x)):
        if streams:
            streams[r].wait_stream(main)
        with torch.cuda.stream(streams[r]) if streams else contextlib.nullcontext():
            x, w, fc1, fc2 = per_rank[r]
            ys.append(mok_moe(x, case.ids[r], w, fc1, fc2, ep_group=ep_groups[r], config=config, backend=backend))
    return ys


def _backward_ranks(case: GpuCase, ys, streams) -> None:
    for r in range(len(case.x)):
        with torch.cuda.stream(streams[r]) if streams else contextlib.nullcontext():
            ys[r].backward(case.dy[r])


def _results(ys, per_rank, backward: bool):
    def grad(t):
        if isinstance(t, tuple):
            return torch.cat([s.grad for s in t]) if backward else None
        return t.grad
    return [(ys[r].detach(),) + tuple(grad(t) for t in per_rank[r]) for r in range(len(ys))]


def check_against_oracle(case: GpuCase, results, label: str, with_grads: bool = True) -> None:
    """Assert every rank's (y, dx, dw, d_fc1, d_fc2) is within :data:`TOL` of the fp32 oracle."""
    ys, dxs, dws, d1, d2 = oracle(case)
    for r, (y, dx, dw, g1, g2) in enumerate(results):
        where = f"{label}, rank {r}"
        assert y.dtype == torch.bfloat16 and y.shape == ys[r].shape, where
        pairs = [("y", y, ys[r])]
        if with_grads:
            pairs += [("dx", dx, dxs[r]), ("dw", dw, dws[r]), ("d_fc1", g1, case.local(d1, r)),
                      ("d_fc2", g2, case.local(d2, r))]
        for name, got, want in pairs:
            err = rel_err(got, want)
            assert err < TOL, f"{where}: {name} relative error {err:.3e} (tolerance {TOL})"


def check_rank_runs(case: GpuCase, rank: int, runs, label: str) -> None:
    """One process of a multi-process test: ``runs`` are this rank's (y, dx, dw, d_fc1, d_fc2)
    from repeated calls; the first must be within :data:`TOL` of the fp32 oracle and every
    later one bitwise equal to it."""
    ys, dxs, dws, d1, d2 = oracle(case)
    want = (ys[rank], dxs[rank], dws[rank], case.local(d1, rank), case.local(d2, rank))
    names = ("y", "dx", "dw", "d_fc1", "d_fc2")
    for name, got, ref in zip(names, runs[0], want):
        err = rel_err(got, ref)
        assert err < TOL, f"{label} rank {rank}: {name} relative error {err:.3e}"
    for i, other in enumerate(runs[1:], 1):
        for name, a, b in zip(names, runs[0], other):
            assert torch.equal(a, b), f"{label} rank {rank}: {name} differs in run {i}"


def assert_equal_runs(a, b, label: str) -> None:
    """Assert two results of :func:`run_case` are bitwise identical."""
    for r, (ra, rb) in enumerate(zip(a, b)):
        for name, x, y in zip(("y", "dx", "dw", "d_fc1", "d_fc2"), ra, rb):
            if x is None and y is None:
                continue
            assert torch.equal(x, y), f"{label}: rank {r} {name} differs"


def check_graph_replay(backend: str, config, seeds) -> None:
    """Capture a whole forward + backward of ``backend`` (P = 1) in a CUDA graph, replay it on
    new inputs and routing (one case per seed after the first), and assert it matches eager
    bit for bit: proof that the backend makes no host synchronisation."""
    from megatron_mok.functional import mok_moe

    H, I, L, K, T = 2048, 1024, 8, 4, 1536
    case = gpu_case(seeds[0], [T], H, I, L, K)
    x, w, fc1, fc2 = leaves(case, 0)
    ids, dy = case.ids[0].clone(), case.dy[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up creates the workspace and loads the library
        for _ in range(2):
            mok_moe(x, ids, w, fc1, fc2, config=config, backend=backend).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    for t in (x, w, fc1, fc2):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = mok_moe(x, ids, w, fc1, fc2, config=config, backend=backend)
        y_static.backward(dy)
    grads_static = [x.grad, w.grad, fc1.grad, fc2.grad]
    for seed in seeds[1:]:  # new inputs and new routing, same shapes
        new = gpu_case(seed, [T], H, I, L, K, "zipf")
        with torch.no_grad():
            x.copy_(new.x[0]); w.copy_(new.weights[0]); ids.copy_(new.ids[0]); dy.copy_(new.dy[0])
            fc1.copy_(new.fc1_all); fc2.copy_(new.fc2_all)
        graph.replay()
        torch.cuda.synchronize()
        eager = run_case(new, [None], config, backend)[0]
        assert torch.equal(y_static, eager[0]), "graph replay output differs from eager"
        for got, want, name in zip(grads_static, eager[1:], ("dx", "dw", "d_fc1", "d_fc2")):
            assert torch.equal(got, want), f"graph replay {name} differs from eager"
