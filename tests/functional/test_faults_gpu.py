"""Faults on the GPU backends with virtual ranks (``LocalEPGroup``) on one sm_90 GPU, both backends
where they apply: a rank that never calls, never runs the backward, or is stalled on the host past
the timeout; capacity exceeded on one rank only; a bad id on one rank; a rank whose own checks
fail; NaN in one token or one expert's weights, then a clean call; the smallest ring under the
worst skew; double backward. Each ends in the documented error naming the rank (docs/contract.md,
"Errors") or in the oracle's result; every wait has a small ``timeout_s``, so none hangs.

Skipped with a printed reason without an sm_90 GPU.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

from megatron_mok import MoKConfig
from megatron_mok.functional import (LocalEPGroup, MoKCapacityError, MoKInputError, MoKPeerError, MoKRuntimeError,
                                     MoKTimeoutError, check_errors, mok_moe)
from megatron_mok.functional.workspace import release_workspaces

from tests.gpu_cases import TOL, check_against_oracle, gpu_case, leaves, oracle, rel_err, run_case

pytestmark = pytest.mark.gpu

BACKENDS = ["cuda", "megakernel"]
TIMEOUT = 1.0
H, I, L, K = 1024, 512, 2, 2


@pytest.fixture(autouse=True)
def _fresh_workspaces():
    """Every test starts and ends without workspaces: a failed one (they stay failed) must not be
    seen by a later test's check_errors()."""
    release_workspaces()
    yield
    gc.collect()
    release_workspaces()
    gc.collect()


def _config(tokens, **over):
    return MoKConfig(max_tokens_per_rank=tokens, timeout_s=TIMEOUT, **over)


def _forward(group, case, rank, config, backend, ids=None):
    """Queue rank ``rank``'s forward on its stream; returns (y, its leaves)."""
    x, w, fc1, fc2 = leaves(case, rank)
    stream = group.streams[rank]
    stream.wait_stream(torch.cuda.current_stream())  # the inputs were made on the default stream
    with torch.cuda.stream(stream):
        y = mok_moe(x, case.ids[rank] if ids is None else ids, w, fc1, fc2, ep_group=group[rank], config=config,
                    backend=backend)
    return y, (x, w, fc1, fc2)


def _nan(t):
    return bool(torch.isnan(t.float()).all())


# ------------------------------------------------------------------------------------------
# Missing, late and stalled ranks.


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_virtual_rank_that_never_calls_is_named(backend):
    group = LocalEPGroup(3)
    case = gpu_case(201, [128, 128, 128], H, I, L, K)
    config = _config(128)
    y0, _ = _forward(group, case, 0, config, backend)
    y1, _ = _forward(group, case, 1, config, backend)  # rank 2 never makes the call
    torch.cuda.synchronize()
    with pytest.raises(MoKTimeoutError, match=r"EP rank 0 waited more than 1 s for EP rank 2 at the forward dispatch"):
        check_errors(group[0])
    # Rank 1 timed out on its own, or learned first that rank 0 had: either names the rank.
    with pytest.raises(MoKRuntimeError, match=r"EP rank 1 waited more than 1 s for EP rank 2|EP rank 0 stopped an "
                                              r"earlier MoK call with MoKTimeoutError"):
        check_errors(group[1])
    assert _nan(y0) and _nan(y1)
    with pytest.raises(MoKTimeoutError, match=r"EP rank 0 waited more than 1 s for EP rank 2"):
        _forward(group, case, 0, config, backend)  # the next call raises before queueing anything


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_virtual_rank_that_never_runs_the_backward_is_named(backend):
    group = LocalEPGroup(2)
    case = gpu_case(202, [128, 128], H, I, L, K)
    config = _config(128)
    y0, (x0, w0, _, _) = _forward(group, case, 0, config, backend)
    _forward(group, case, 1, config, backend)
    with torch.cuda.stream(group.streams[0]):
        y0.backward(case.dy[0])  # rank 1 never runs its backward
    torch.cuda.synchronize()
    with pytest.raises(MoKTimeoutError, match=r"EP rank 0 waited more than 1 s for EP rank 1 at the backward "
                                              r"\(waiting for every rank to publish its output gradients\)"):
        check_errors(group[0])
    assert not _nan(y0), "the forward was complete"
    assert _nan(x0.grad) and _nan(w0.grad), "the failed backward's input gradients are NaN"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_stalled_on_the_host_past_the_timeout(backend):
    group = LocalEPGroup(2)
    case = gpu_case(203, [128, 128], H, I, L, K)
    config = _config(128)
    y0, _ = _forward(group, case, 0, config, backend)
    time.sleep(2 * TIMEOUT + 0.5)  # rank 0 gives up waiting on the device meanwhile
    y1, _ = _forward(group, case, 1, config, backend)
    torch.cuda.synchronize()
    with pytest.raises(MoKTimeoutError, match=r"EP rank 0 waited more than 1 s for EP rank 1 at the forward dispatch"):
        check_errors(group[0])
    with pytest.raises(MoKPeerError, match=r"EP rank 0 stopped an earlier MoK call with MoKTimeoutError .*EP rank "
                                           r"1 learned it at the forward dispatch .* its output of that call is NaN"):
        check_errors(group[1])
    assert _nan(y0) and _nan(y1)


# ------------------------------------------------------------------------------------------
# A rank that stops a call before queueing it.


@pytest.mark.parametrize("backend", BACKENDS)
def test_capacity_exceeded_on_one_rank_only(backend):
    group = LocalEPGroup(2)
    case = gpu_case(204, [64, 96], H, I, L, K)
    config = _config(64)
    y0, _ = _forward(group, case, 0, config, backend)
    with pytest.raises(MoKCapacityError, match=r"this call has 96 tokens on EP rank 1, but the MoK workspace holds "
                                               r"64 per rank .*set MoKConfig.max_tokens_per_rank"):
        _forward(group, case, 1, config, backend)
    torch.cuda.synchronize()
    with pytest.raises(MoKPeerError, match=r"EP rank 1 stopped an earlier MoK call with MoKCapacityError .*EP rank 0 "
                                           r"learned it at the forward dispatch .* its output of that call is NaN"):
        check_errors(group[0])
    with pytest.raises(MoKRuntimeError, match=r"EP rank 1 stopped an earlier MoK call with MoKCapacityError"):
        check_errors(group[1])
    assert _nan(y0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_whose_own_checks_fail_stops_every_rank(backend):
    """Rank 0 is queued, rank 1's arguments fail the checks, rank 2 (issued after) raises at once
    naming rank 1 and queues nothing; rank 0's output is NaN and its check names rank 1."""
    group = LocalEPGroup(3)
    case = gpu_case(205, [128, 128, 128], H, I, L, K)
    config = _config(128)
    y0, _ = _forward(group, case, 0, config, backend)
    with pytest.raises(MoKInputError, match=r"topk_ids has dtype torch.int32; it must be torch.int64"):
        _forward(group, case, 1, config, backend, ids=case.ids[1].int())
    with pytest.raises(MoKPeerError, match=r"EP rank 1 stopped this MoK call with MoKInputError .*topk_ids has dtype "
                                           r"torch.int32.*; so every rank of the EP group stops this call"):
        _forward(group, case, 2, config, backend)
    torch.cuda.synchronize()
    with pytest.raises(MoKPeerError, match=r"EP rank 1 stopped an earlier MoK call with MoKInputError"):
        check_errors(group[0])
    assert _nan(y0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bad_id_on_one_rank_gives_nan_on_every_rank_then_the_error_naming_it(backend):
    group = LocalEPGroup(2)
    case = gpu_case(206, [128, 128], H, I, L, K)
    config = _config(128)
    ids = case.ids[1].clone()
    ids[7, 1] = 99  # E = 4
    y0, _ = _forward(group, case, 0, config, backend)
    y1, _ = _forward(group, case, 1, config, backend, ids=ids)
    torch.cuda.synchronize()
    assert _nan(y0) and _nan(y1), "every rank's output of that call is NaN"
    for r in range(2):
        with pytest.raises(MoKRuntimeError, match=r"topk_ids of EP rank 1 held expert id 99 in an earlier call; ids "
                                                  r"must lie in \[0, 4\)"):
            check_errors(group[r])
    with pytest.raises(MoKRuntimeError, match=r"topk_ids of EP rank 1 held expert id 99"):
        _forward(group, case, 0, config, backend)  # the next call raises before queueing anything


# ------------------------------------------------------------------------------------------
# Right results after non-finite data, and under the worst skew.


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["token", "expert"])
def test_nan_in_one_token_or_one_expert_then_a_clean_call(backend, where):
    """NaN data is no fault: it stays in the rows it belongs to, and the next call (the same
    workspace, ring and slots) gives the oracle's outputs and every gradient, no stale NaN."""
    group = LocalEPGroup(2)
    case = gpu_case(207, [256, 256], H, I, L, K)
    config = _config(256)
    poisoned = gpu_case(207, [256, 256], H, I, L, K)
    if where == "token":
        poisoned.x[0][5] = float("nan")
    else:
        poisoned.fc1_all[1] = float("nan")  # expert 1, rank 0's second
    first = run_case(poisoned, group.ranks, config, backend, group.streams)
    y0 = first[0][0].float()
    want = oracle(poisoned)[0][0]
    bad_rows = torch.isnan(want).any(dim=1)
    assert bad_rows.any() and not bad_rows.all()
    assert torch.equal(torch.isnan(y0).any(dim=1), bad_rows), "NaN exactly in the rows the oracle has them"
    assert rel_err(y0[~bad_rows], want[~bad_rows]) < TOL
    check_against_oracle(case, run_case(case, group.ranks, config, backend, group.streams),
                         f"{backend}: the clean call after NaN in one {where}")


def _every_route_to_expert_zero(case):
    for ids in case.ids:
        ids.zero_()  # every slot of every token of every rank (duplicates when K > 1)
    return case


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topk", [1, 2])
def test_the_smallest_ring_under_the_worst_skew(backend, topk):
    """One hot expert takes every route of every rank, through a ring of two minibatches (the
    smallest): the oracle's results, the same bits twice."""
    group = LocalEPGroup(2)
    case = _every_route_to_expert_zero(gpu_case(208, [1500, 1500], H, I, L, topk))
    config = MoKConfig(max_tokens_per_rank=1500, timeout_s=20.0, comm_sms_forward=2, minibatch_rows=128,
                       ring_rows=256)
    first = run_case(case, group.ranks, config, backend, group.streams)
    second = run_case(case, group.ranks, config, backend, group.streams)
    check_against_oracle(case, first, f"{backend}: every route to expert 0, top-{topk}")
    for r in range(2):
        for name, a, b in zip(("y", "dx", "dw", "d_fc1", "d_fc2"), first[r], second[r]):
            assert torch.equal(a, b), f"{backend}: rank {r} {name} differs between two runs"


# ------------------------------------------------------------------------------------------
# Double backward, and LocalEPGroup's own errors.


@pytest.mark.parametrize("backend", BACKENDS)
def test_double_backward_is_refused(backend):
    case = gpu_case(209, [64], H, I, L, K)
    x, w, fc1, fc2 = leaves(case, 0)
    y = mok_moe(x, case.ids[0], w, fc1, fc2, backend=backend)
    (g,) = torch.autograd.grad((y.float() ** 2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.float().sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_backward_through_one_forward_is_refused(backend):
    """The first backward writes d gate|up over the kept gate|up; a second one (retain_graph)
    raises instead of reading it, and the first one's gradients are those of a fresh forward."""
    case = gpu_case(210, [64], H, I, L, K)
    x, w, fc1, fc2 = leaves(case, 0)
    y = mok_moe(x, case.ids[0], w, fc1, fc2, backend=backend)
    loss = (y.float() ** 2).sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    with pytest.raises(RuntimeError, match="second backward through the same forward"):
        loss.backward()
    x.grad = None
    (mok_moe(x, case.ids[0], w, fc1, fc2, backend=backend).float() ** 2).sum().backward()
    assert torch.equal(x.grad, first)


def test_local_ep_group_rank_out_of_range_is_a_clear_error():
    group = LocalEPGroup(2)
    with pytest.raises(IndexError, match=r"LocalEPGroup has 2 ranks \(0 to 1\); rank 2 is not one"):
        group[2]
    with pytest.raises(MoKInputError, match=r"ep_group is a LocalEPGroup of 2 virtual ranks; pass one rank of it"):
        case = gpu_case(210, [8, 8], H, I, L, K)
        mok_moe(*leaves(case, 0)[:1], case.ids[0], *leaves(case, 0)[1:], ep_group=group)


# ------------------------------------------------------------------------------------------
# Two processes on two GPUs (nvidia-h200-x2): a rank whose own checks fail, at the group's first
# call (the settings exchange on the host tells the other at once) and at a later call (the
# failure word over NVLink: NaN, then the error).


def _p2_own_check_worker(rank, world, backend):
    import torch.distributed as dist

    group = dist.group.WORLD
    case = gpu_case(211, [128, 128], H, I, L, K)
    config = MoKConfig(timeout_s=5.0)

    def call(bad):
        x, w, fc1, fc2 = leaves(case, rank)
        ids = case.ids[rank].int() if bad else case.ids[rank]
        return mok_moe(x, ids, w, fc1, fc2, ep_group=group, config=config, backend=backend)

    own = r"topk_ids has dtype torch.int32; it must be torch.int64"
    if rank == 1:
        with pytest.raises(MoKInputError, match=own):
            call(bad=True)
    else:
        with pytest.raises(MoKPeerError, match=r"EP rank 1 \(global rank 1\) stopped this MoK call with MoKInputError "
                                               rf".*{own}"):
            call(bad=False)
    y = call(bad=False)  # together: the settings, the workspace
    torch.cuda.synchronize()
    check_errors()
    assert torch.isfinite(y.float()).all()
    if rank == 1:
        with pytest.raises(MoKInputError, match=own):
            call(bad=True)
        torch.cuda.synchronize()
        with pytest.raises(MoKRuntimeError, match=r"EP rank 1 \(global rank 1\) stopped an earlier MoK call with "
                                                  r"MoKInputError .*before queueing it"):
            check_errors()
    else:
        y = call(bad=False)
        torch.cuda.synchronize()
        assert _nan(y)
        with pytest.raises(MoKPeerError, match=r"EP rank 1 \(global rank 1\) stopped an earlier MoK call with "
                                               r"MoKInputError .*EP rank 0 \(global rank 0\) learned it at the "
                                               r"forward dispatch .* its output of that call is NaN"):
            check_errors()


@pytest.mark.gpu2
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_gpus_a_rank_whose_own_checks_fail_stops_the_other(backend):
    from tests.distributed import run_ranks

    run_ranks(_p2_own_check_worker, 2, backend, backend="nccl")
