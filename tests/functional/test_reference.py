"""The reference backend against a dense single-process computation in float64, for P = 1, 2, 4
gloo ranks: forward, every gradient, routing edge cases, determinism and gradcheck."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_mok import MoKConfig
from megatron_mok.functional import mok_moe
from megatron_mok.reference import build_schedule, dense_moe

from tests.cases import make_case
from tests.distributed import run_ranks

# (seed, tokens per rank, hidden, ffn, experts per rank, top-k, routing, tile rows)
CASES_P1 = [
    (1, [13], 16, 8, 4, 2, "uniform", 4),
    (2, [9], 8, 4, 8, 8, "uniform", 8),
    (3, [11], 8, 6, 6, 1, "hot", 4),
    (4, [10], 8, 4, 9, 3, "empty", 4),
    (5, [7], 8, 4, 3, 4, "duplicates", 4),
    (6, [12], 8, 4, 5, 3, "unused", 4),
    (7, [0], 8, 4, 3, 2, "uniform", 4),
]
CASES_P2 = [
    (11, [13, 13], 16, 8, 3, 2, "uniform", 4),
    (12, [7, 19], 8, 4, 4, 8, "uniform", 8),   # uneven T, top-8
    (13, [10, 5], 8, 6, 2, 1, "hot", 4),       # top-1, one hot expert
    (14, [9, 9], 8, 4, 6, 3, "empty", 4),
    (15, [6, 0], 8, 4, 3, 2, "unused", 4),     # a rank without tokens
    (16, [8, 11], 8, 4, 4, 3, "zipf", 64),     # T far below the tile height
]
CASES_P4 = [
    (21, [6, 9, 3, 8], 8, 4, 2, 2, "uniform", 4),
    (22, [5, 5, 5, 5], 8, 4, 3, 8, "duplicates", 4),
    (23, [7, 2, 6, 4], 8, 6, 3, 3, "hot", 8),
]


def _dense_oracle(case):
    """Forward and gradients of every rank's tokens in float64, with plain autograd."""
    xs = [t.clone().requires_grad_() for t in case.x]
    ws = [t.clone().requires_grad_() for t in case.weights]
    fc1 = case.fc1_all.clone().requires_grad_()
    fc2 = case.fc2_all.clone().requires_grad_()
    ys = [dense_moe(x, ids, w, fc1, fc2) for x, ids, w in zip(xs, case.ids, ws)]
    loss = sum((y * dy).sum() for y, dy in zip(ys, case.dy))
    if loss.requires_grad:  # False only when no rank has a token
        loss.backward()
    grad = lambda t: t.grad if t.grad is not None else torch.zeros_like(t)
    return ([y.detach() for y in ys], [grad(x) for x in xs], [grad(w) for w in ws],
            grad(fc1), grad(fc2))


def _check_case(rank, world, spec, group):
    seed, tokens, hidden, ffn, experts, topk, routing, tile = spec
    case = make_case(seed, tokens, hidden, ffn, experts, topk, routing)
    y_ref, gx_ref, gw_ref, g1_ref, g2_ref = _dense_oracle(case)
    L = experts

    def run():
        x = case.x[rank].clone().requires_grad_()
        w = case.weights[rank].clone().requires_grad_()
        fc1 = case.local_fc1(rank).clone().requires_grad_()
        fc2 = case.local_fc2(rank).clone().requires_grad_()
        y = mok_moe(x, case.ids[rank], w, fc1, fc2, ep_group=group, backend="reference",
                    config=MoKConfig(tile_rows=tile))
        (y * case.dy[rank]).sum().backward()
        return y.detach(), x.grad, w.grad, fc1.grad, fc2.grad

    first = run()
    y, gx, gw, g1, g2 = first
    tol = dict(rtol=1e-9, atol=1e-11)
    where = f"rank {rank}/{world}, case seed {seed} ({routing})"
    assert torch.isfinite(y).all(), where
    torch.testing.assert_close(y, y_ref[rank], **tol, msg=lambda m: f"y, {where}: {m}")
    torch.testing.assert_close(gx, gx_ref[rank], **tol, msg=lambda m: f"dx, {where}: {m}")
    torch.testing.assert_close(gw, gw_ref[rank], **tol, msg=lambda m: f"dw, {where}: {m}")
    torch.testing.assert_close(g1, g1_ref[rank * L:(rank + 1) * L], **tol, msg=lambda m: f"dfc1, {where}: {m}")
    torch.testing.assert_close(g2, g2_ref[rank * L:(rank + 1) * L], **tol, msg=lambda m: f"dfc2, {where}: {m}")
    # Bitwise determinism: a second run gives identical bytes.
    second = run()
    for a, b, name in zip(first, second, ("y", "dx", "dw", "dfc1", "dfc2")):
        assert torch.equal(a, b), f"{name} differs between two runs, {where}"


def _worker_cases(rank, world, cases):
    for spec in cases:
        _check_case(rank, world, spec, dist.group.WORLD)


@pytest.mark.parametrize("spec", CASES_P1, ids=lambda s: f"seed{s[0]}-{s[6]}-k{s[5]}")
def test_reference_p1_matches_dense(spec):
    _check_case(0, 1, spec, None)


def test_reference_p2_matches_dense():
    run_ranks(_worker_cases, 2, CASES_P2)


def test_reference_p4_matches_dense():
    run_ranks(_worker_cases, 4, CASES_P4)


def test_reference_bf16_within_bf16_tolerance():
    case = make_case(31, [24], 32, 16, 4, 2, "uniform")
    y_ref = _dense_oracle(case)[0][0]
    c16 = case.to(dtype=torch.bfloat16)
    y = mok_moe(c16.x[0], c16.ids[0], case.weights[0].float(), c16.local_fc1(0), c16.local_fc2(0),
                backend="reference")
    assert y.dtype == torch.bfloat16
    err = (y.double() - y_ref).norm() / y_ref.norm()
    assert err < 1e-2, f"relative error {err:.2e} is above bf16 tolerance"


def _gradcheck_worker(rank, world):
    # Same shapes on every rank, so that gradcheck makes the same calls in the same order on
    # each. With P > 1 only x and the router weights are checked: rank r's output depends on
    # the experts of every rank, so a perturbation of one rank's expert weights (made while
    # the other rank perturbs its own) is not a per-rank Jacobian. The expert weight
    # gradients at P > 1 are checked against the dense oracle above.
    case = make_case(41, [3] * world, 4, 3, 2, 2, "uniform")
    group = dist.group.WORLD if world > 1 else None
    x = case.x[rank].clone().requires_grad_()
    w = case.weights[rank].clone().requires_grad_()
    fc1 = case.local_fc1(rank).clone().requires_grad_(world == 1)
    fc2 = case.local_fc2(rank).clone().requires_grad_(world == 1)
    ids = case.ids[rank]
    fn = lambda x_, w_, a_, b_: mok_moe(x_, ids, w_, a_, b_, ep_group=group, backend="reference",
                                        config=MoKConfig(tile_rows=2))
    assert torch.autograd.gradcheck(fn, (x, w, fc1, fc2), eps=1e-6, atol=1e-7)


def test_reference_gradcheck_p1():
    _gradcheck_worker(0, 1)


def test_reference_gradcheck_p2():
    run_ranks(_gradcheck_worker, 2)


def test_schedule_order_and_padding_by_hand():
    # Two ranks, two experts each (E = 4), K = 2, tile 4. Rank 1 owns experts 2 and 3.
    ids0 = torch.tensor([[2, 0], [3, 2], [-1, 3]])
    ids1 = torch.tensor([[1, 2], [2, 3]])
    s = build_schedule([ids0, ids1], rank=1, experts_per_rank=2, tile_rows=4)
    assert s.expert_counts.tolist() == [4, 3]
    assert s.expert_offsets.tolist() == [0, 4, 8]
    # Expert 2: (rank 0, token 0, slot 0), (0, 1, 1), (1, 0, 1), (1, 1, 0) -> routes t*K+j.
    # Expert 3: (0, 1, 0), (0, 2, 1), (1, 1, 1), then one padding row.
    assert s.table.tolist() == [[0, 0], [0, 3], [1, 1], [1, 2],
                                [0, 2], [0, 5], [1, 3], [-1, -1]]


def test_schedule_empty_expert_has_no_rows():
    ids = torch.tensor([[0], [0], [2]])
    s = build_schedule([ids], rank=0, experts_per_rank=3, tile_rows=2)
    assert s.expert_counts.tolist() == [2, 0, 1]
    assert s.expert_offsets.tolist() == [0, 2, 2, 4]


def test_multi_process_rank_check_passes_the_oracle_and_fails_a_wrong_or_unstable_run():
    """check_rank_runs (the multi-GPU tests' verdict) on a small CPU case: the reference
    backend's results pass; a perturbed gradient and a run that differs from the first fail."""
    from tests.cases import route
    from tests.gpu_cases import GpuCase, check_rank_runs

    g = torch.Generator().manual_seed(7)
    T, H, I, E, K = 12, 16, 8, 4, 2
    case = GpuCase(x=[torch.randn(T, H, generator=g).bfloat16()], ids=[route(g, T, E, K, "uniform")],
                   weights=[torch.rand(T, K, generator=g)], dy=[torch.randn(T, H, generator=g).bfloat16()],
                   fc1_all=(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16(),
                   fc2_all=(torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16(), experts_per_rank=E)
    leaf = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    x, w, fc1, fc2 = leaf(case.x[0]), leaf(case.weights[0]), leaf(case.fc1_all), leaf(case.fc2_all)
    y = mok_moe(x, case.ids[0], w, fc1, fc2, backend="reference")
    y.backward(case.dy[0])
    run = (y.detach(), x.grad, w.grad, fc1.grad, fc2.grad)
    check_rank_runs(case, 0, [run, run], "reference")
    wrong = run[:3] + (run[3] * 1.5,) + run[4:]
    with pytest.raises(AssertionError, match="d_fc1 relative error"):
        check_rank_runs(case, 0, [wrong], "perturbed")
    unstable = run[:4] + (run[4] + 1e-3,)
    with pytest.raises(AssertionError, match="d_fc2 differs in run 1"):
        check_rank_runs(case, 0, [run, unstable], "unstable")
