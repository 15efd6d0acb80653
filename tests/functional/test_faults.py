"""Faults across the ranks of an EP group, on the CPU with gloo (reference backend, P = 2 to 4):
every rank ends a call with the right result or with a clear error naming the rank, the place
and what to do; none waits longer than ``MoKConfig.timeout_s`` (plus the store's round trips).

Each test spawns its ranks once (a few seconds) and makes its calls on a fresh process group.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from megatron_mok import MoKConfig
from megatron_mok.functional import (MoKCapacityError, MoKConfigError, MoKInputError, MoKMismatchError, MoKPeerError,
                                     MoKRuntimeError, MoKTimeoutError, BackendUnavailable, check_errors, mok_moe)
from megatron_mok.functional.workspace import release_workspaces
from megatron_mok.reference import dense_moe

from tests.cases import make_case
from tests.distributed import run_ranks

TIMEOUT = 2.0
BOUND = TIMEOUT + 12  # a wait that ends at all ends well within this (the group's own timeout is 180 s)
CONFIG = MoKConfig(timeout_s=TIMEOUT, tile_rows=4)


def _name(r: int) -> str:
    return rf"EP rank {r} \(global rank {r}\)"


def _case(world, tokens=5, seed=1, K=2, H=8, dtype=torch.float32):
    tokens = tokens if isinstance(tokens, list) else [tokens] * world
    return make_case(seed, tokens, H, 4, 2, K, dtype=dtype)


def _call(case, rank, group, config=CONFIG, ids=None, backend="reference", **over):
    args = dict(x=case.x[rank].clone().requires_grad_(), topk_ids=case.ids[rank] if ids is None else ids,
                topk_weights=case.weights[rank].clone().requires_grad_(),
                fc1_weight=case.local_fc1(rank).clone().requires_grad_(),
                fc2_weight=case.local_fc2(rank).clone().requires_grad_())
    args.update(over)
    return mok_moe(**args, ep_group=group, config=config, backend=backend)


def _check_clean_call(case, rank, group):
    """A call after a fault: the oracle's output, so the group is still in step."""
    y = _call(case, rank, group)
    want = dense_moe(case.x[rank], case.ids[rank], case.weights[rank], case.fc1_all, case.fc2_all)
    torch.testing.assert_close(y.detach(), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# Point 2 of issue 35: the timeout on the reference backend.


def _never_calls_worker(rank, world):
    group = dist.new_group(backend="gloo")
    case = _case(world)
    missing = world - 1
    if rank == missing:
        return  # alive (in the test harness's final barrier, on another group), but never makes the call
    start = time.monotonic()
    message = rf"{_name(rank)} waited more than 2 s for {_name(missing)} at the forward dispatch"
    with pytest.raises(MoKTimeoutError, match=message):
        _call(case, rank, group)
    assert time.monotonic() - start < BOUND
    # The group's MoK state stays failed, as a GPU workspace after a timeout: at once, no wait.
    start = time.monotonic()
    with pytest.raises(MoKTimeoutError, match=message):
        _call(case, rank, group)
    with pytest.raises(MoKTimeoutError, match=message):
        check_errors()
    assert time.monotonic() - start < 1.0


def test_a_rank_that_never_calls_is_named_within_the_timeout():
    run_ranks(_never_calls_worker, 3)


def _never_runs_backward_worker(rank, world):
    group = dist.new_group(backend="gloo")
    case = _case(world)
    y = _call(case, rank, group)
    if rank == 1:
        return  # runs the forward, never the backward (and waits in the harness's final barrier)
    start = time.monotonic()
    with pytest.raises(MoKTimeoutError, match=rf"{_name(0)} waited more than 2 s for {_name(1)} at the backward "
                                              r"\(waiting for every rank to publish its output gradients\)"):
        y.backward(case.dy[rank])
    assert time.monotonic() - start < BOUND


def test_a_rank_that_never_runs_the_backward_is_named_within_the_timeout():
    run_ranks(_never_runs_backward_worker, 2)


def _stalled_worker(rank, world):
    group = dist.new_group(backend="gloo")
    case = _case(world)
    start = time.monotonic()
    if rank == 1:
        time.sleep(TIMEOUT + 1.5)  # a host stalled past the timeout, then calling
        with pytest.raises(MoKTimeoutError, match=rf"{_name(1)} reached the forward dispatch .* after {_name(0)} had "
                                                  r"stopped waiting for it there \(MoKConfig.timeout_s = 2 s"):
            _call(case, rank, group)
    else:
        with pytest.raises(MoKTimeoutError, match=rf"{_name(0)} waited more than 2 s for {_name(1)}"):
            _call(case, rank, group)
    assert time.monotonic() - start < BOUND


def test_a_rank_stalled_past_the_timeout_fails_on_both_sides_and_goes_no_further():
    run_ranks(_stalled_worker, 2)


def _no_group_worker(rank, world):
    group = dist.new_group(backend="gloo")
    case = _case(world)
    if rank == 1:  # its own error before MoK knows the group: nobody can be told
        with pytest.raises(MoKInputError, match=r"ep_group='world' \(str\) is not supported"):
            _call(case, rank, "world")
        return  # ... and stays alive (in the harness's final barrier)
    start = time.monotonic()
    with pytest.raises(MoKTimeoutError, match=rf"{_name(0)} waited more than 2 s for {_name(1)}"):
        _call(case, rank, group)
    assert time.monotonic() - start < BOUND


def test_a_rank_whose_error_names_no_group_is_reported_by_the_timeout():
    run_ranks(_no_group_worker, 2)


# ------------------------------------------------------------------------------------------
# Point 1 (c): a rank whose own checks fail makes every rank raise that call.


def _own_check_fails_worker(rank, world):
    group = dist.new_group(backend="gloo")
    case = _case(world)
    _check_clean_call(case, rank, group)
    failing = [  # (rank that fails, its arguments, its error, the kind the others are told)
        (1, dict(topk_ids=case.ids[rank].int()), MoKInputError, "MoKInputError",
         r"topk_ids has dtype torch.int32; it must be torch.int64"),
        (2, dict(config=MoKConfig(timeout_s=TIMEOUT, tile_rows=4, num_experts=7)), MoKConfigError, "MoKConfigError",
         r"num_experts=7 is not divisible by the expert-parallel size 3"),
        (0, dict(backend="cuda"), BackendUnavailable, "BackendUnavailable",
         r"backend='cuda' cannot run: the tensors are on cpu"),
    ]
    for bad_rank, over, own_error, kind, message in failing:
        start = time.monotonic()
        if rank == bad_rank:
            with pytest.raises(own_error, match=message):
                _call(case, rank, group, **over)
        else:
            with pytest.raises(MoKPeerError, match=rf"{_name(bad_rank)} stopped this MoK call with {kind} .*: "
                                                   rf"{message}.*; so every rank of the EP group stops this call\. "
                                                   rf"Fix what {_name(bad_rank)} reported"):
                _call(case, rank, group)
        assert time.monotonic() - start < TIMEOUT, "the other ranks are told at once, not by the timeout"
        _check_clean_call(case, rank, group)  # every rank stopped the same call: still in step
    # Ranks at different steps: rank 0 runs a backward where the others run a forward.
    y = _call(case, rank, group)
    with pytest.raises(MoKMismatchError, match=rf"at different steps: {_name(0)} at the backward .*, {_name(1)} at "
                                               r"the forward dispatch"):
        if rank == 0:
            y.backward(case.dy[rank])
        else:
            _call(case, rank, group)


def test_a_rank_whose_own_checks_fail_makes_every_rank_raise_that_call():
    """Also: ranks at different steps (a backward against a forward) get a clear error."""
    run_ranks(_own_check_fails_worker, 3)


# ------------------------------------------------------------------------------------------
# Point 1 (a, b): the settings, the token capacity and the backend are agreed before any
# collective.


def _mismatch_worker(rank, world):
    group = dist.new_group(backend="gloo")
    odd = rank == world - 1
    cases = [  # (what differs on the last rank, its case, the message)
        ("top-k K", _case(world, K=1 if odd else 2), rf"top-k K: {_name(0)} has 2, .*{_name(world - 1)} has 1"),
        ("dtype", _case(world, dtype=torch.float64 if odd else torch.float32),
         rf"dtype: {_name(0)} has torch.float32, .*{_name(world - 1)} has torch.float64"),
        ("H", _case(world, H=16 if odd else 8), rf"hidden size H: {_name(0)} has 8, .*{_name(world - 1)} has 16"),
    ]
    for what, case, message in cases:
        with pytest.raises(MoKMismatchError, match=message):
            _call(case, rank, group)
        _check_clean_call(_case(world), rank, group)
    # max_tokens_per_rank (the capacity) given on one rank only.
    config = MoKConfig(timeout_s=TIMEOUT, tile_rows=4, max_tokens_per_rank=64 if odd else None)
    with pytest.raises(MoKMismatchError, match=rf"max_tokens_per_rank: {_name(0)} has None, .*{_name(world - 1)} "
                                               "has 64"):
        _call(_case(world), rank, group, config=config)
    _check_clean_call(_case(world), rank, group)
    # The last rank's GPU backend makes its first-call settings exchange (its signature says
    # cuda) where the others run the reference backend: every rank raises, naming the backend.
    from megatron_mok.functional.agreement import agree, call_signature

    with pytest.raises(MoKMismatchError, match=rf"backend: {_name(0)} has reference, .*{_name(world - 1)} has cuda"):
        if odd:
            agree(group, call_signature(CONFIG, 8, 2, 2, 4, torch.float32, "cuda"), timeout_s=TIMEOUT)
        else:
            _call(_case(world), rank, group)
    _check_clean_call(_case(world), rank, group)


def test_ranks_with_different_sizes_dtype_capacity_or_backend_get_the_mismatch_error_p4():
    """Issue 35's reproduction of point 2 (a different H, K or dtype on one rank) ends in the
    mismatch error on every rank, before any gloo collective (no SIGABRT, no connection reset);
    so do a capacity given on one rank only and another backend."""
    run_ranks(_mismatch_worker, 4)


# ------------------------------------------------------------------------------------------
# Point 5: the capacity rule and the bad-id rule of the GPU backends, on the reference backend.


def _capacity_worker(rank, world):
    group = dist.new_group(backend="gloo")
    _check_clean_call(_case(world, tokens=[6, 4]), rank, group)  # the first call: capacity 6 per rank
    big = _case(world, tokens=[5, 8], seed=2)
    message = (rf"this call has 8 tokens on {_name(1)}, but the MoK workspace holds 6 per rank \(agreed at the first "
               r"call\); set MoKConfig.max_tokens_per_rank \(--mok-max-tokens-per-rank\) to the largest token count")
    if rank == 1:
        with pytest.raises(MoKCapacityError, match=message):
            _call(big, rank, group)
    else:
        with pytest.raises(MoKPeerError, match=rf"{_name(1)} stopped this MoK call with MoKCapacityError .*{message}"):
            _call(big, rank, group)
    _check_clean_call(_case(world, tokens=[6, 6], seed=3), rank, group)  # up to the capacity: fine
    # Set by the config (on every rank) at the first call of another shape: above it raises at once.
    config = MoKConfig(timeout_s=TIMEOUT, tile_rows=4, max_tokens_per_rank=4)
    other = _case(world, tokens=[3, 5], H=16)
    if rank == 1:
        with pytest.raises(MoKCapacityError, match=rf"5 tokens on {_name(1)}, but the MoK workspace holds 4"):
            _call(other, rank, group, config=config)
    else:
        with pytest.raises(MoKPeerError, match=r"MoKCapacityError"):
            _call(other, rank, group, config=config)
    _bad_id(rank, world, group)


def test_reference_capacity_and_bad_ids_follow_the_gpu_rules():
    """The capacity is fixed at the first call (or by the config) as on the GPU; a bad id on one
    rank gives NaN on every rank, then the error naming it (backward, check_errors, next call)."""
    run_ranks(_capacity_worker, 2)


def _bad_id(rank, world, group):
    release_workspaces()
    case = _case(world)
    ids = case.ids[rank].clone()
    if rank == 1:
        ids[3, 1] = 99  # E = 4
    y = _call(case, rank, group, ids=ids)
    assert torch.isnan(y).all(), "the call with a bad id returns NaN on every rank"
    message = (rf"topk_ids of {_name(1)} held expert id 99 in an earlier call; ids must lie in \[0, 4\).*NaN on every "
               "rank of the EP group")
    with pytest.raises(MoKRuntimeError, match=message):
        y.backward(case.dy[rank])  # the next MoK call: the backward of that one
    with pytest.raises(MoKRuntimeError, match=message):
        check_errors()
    with pytest.raises(MoKRuntimeError, match=message):
        _call(case, rank, group)
    release_workspaces()  # every rank: a fresh workspace
    _check_clean_call(case, rank, group)


# ------------------------------------------------------------------------------------------
# The GPU backends' host side, on the CPU: what virtual ranks tell each other, and the messages
# of the status word (the device side runs in tests/functional/test_faults_gpu.py).


class _FakeWorkspace:
    def __init__(self):
        self.signals = []

    def signal_failure(self, code, failed_rank):
        self.signals.append((code, failed_rank))


def _fake_virtual_group(P):
    from megatron_mok.functional import LocalEPGroup, LocalEPRank

    group = object.__new__(LocalEPGroup)  # no GPU here: the host bookkeeping only
    group.size, group.signatures, group.calls = P, {}, [0] * P
    group.ranks = [LocalEPRank(group, r) for r in range(P)]
    group.last_shape_key = "shape"
    group.shared_workspaces = {"shape": [_FakeWorkspace() for _ in range(P)]}
    return group


def test_virtual_ranks_tell_each_other_when_one_stops_a_call():
    """Rank 0's call is queued; rank 1's checks fail: it sets its failure word (rank 0 stops at
    its barrier) and marks the call, so rank 2 raises at once, sets its word naming rank 1, and
    queues nothing. The next call of every rank compares normally."""
    from megatron_mok.functional.agreement import agree, call_signature
    from megatron_mok.functional.faults import FAILURE_INPUT, announce_failure

    group = _fake_virtual_group(3)
    signature = call_signature(CONFIG, 8, 2, 2, 4, torch.bfloat16, "cuda")
    agree(group[0], signature)
    err = MoKInputError("topk_ids has dtype torch.int32; it must be torch.int64")
    announce_failure(group[1], err)
    with pytest.raises(MoKPeerError, match=r"EP rank 1 stopped this MoK call with MoKInputError .*: topk_ids has "
                                           r"dtype torch.int32.*so every rank of the EP group stops this call") as info:
        agree(group[2], signature)
    announce_failure(group[2], info.value, failed_rank=info.value.failed_rank, failed_code=info.value.failed_code,
                     compared=True)
    signals = [ws.signals for ws in group.shared_workspaces["shape"]]
    assert signals == [[], [(FAILURE_INPUT, 1)], [(FAILURE_INPUT, 1)]]
    assert group.signatures == {} and group.calls == [1, 1, 1]
    for r in range(3):
        agree(group[r], signature)
    assert group.calls == [2, 2, 2]


def test_a_virtual_rank_with_other_settings_stops_the_call_for_the_ranks_after_it():
    from megatron_mok.functional.agreement import agree, call_signature

    group = _fake_virtual_group(3)
    agree(group[0], call_signature(CONFIG, 8, 2, 2, 4, torch.bfloat16, "cuda"))
    with pytest.raises(MoKMismatchError, match="top-k K: EP rank 0 has 2, EP rank 1 has 3"):
        agree(group[1], call_signature(CONFIG, 8, 3, 2, 4, torch.bfloat16, "cuda"))
    with pytest.raises(MoKPeerError, match="EP rank 1 stopped this MoK call with MoKConfigError"):
        agree(group[2], call_signature(CONFIG, 8, 2, 2, 4, torch.bfloat16, "cuda"))


STATUS_CASES = [  # (status words, error type, message)
    ([4, 0, 1, 1, 0, 0, 0], MoKTimeoutError, r"^MoK: EP rank 0 waited more than 2 s for EP rank 1 at the forward "
                                             r"dispatch .*Outputs of that call are NaN"),
    ([12, 0, 2, 11, 0, 4, 0], MoKPeerError, r"^MoK: EP rank 2 stopped an earlier MoK call with MoKCapacityError .*EP "
                                            r"rank 0 learned it at the forward megakernel combine .* its output of that "
                                            r"call is NaN.*Fix what EP rank 2 reported"),
    ([12, 0, 0, 0, 0, 1, 0], MoKRuntimeError, r"^MoK: EP rank 0 stopped an earlier MoK call with MoKInputError .* before "
                                              r"queueing it"),
    ([1, 99, 0, 0, 0, 0, 1], MoKRuntimeError, r"^MoK: topk_ids of EP rank 1 held expert id 99 in an earlier call; ids "
                                              r"must lie in \[0, 6\)"),
    ([2, 70, 0, 0, 0, 0, 2], MoKRuntimeError, r"^MoK: EP rank 2 published 70 tokens, above the workspace capacity 64"),
]


@pytest.mark.parametrize("words,error,message", STATUS_CASES, ids=[str(c[0][0]) for c in STATUS_CASES])
def test_status_word_messages_name_the_rank_and_the_place(words, error, message):
    from types import SimpleNamespace

    import numpy as np

    from megatron_mok.functional.workspace import Workspace

    fake = SimpleNamespace(_status_host_view=np.array(words + [0], dtype=np.int32), ep_group=None, P=3,
                           experts_per_rank=2, layout=SimpleNamespace(max_tokens=64))
    err = Workspace.recorded_error(fake, TIMEOUT)
    assert type(err) is error and __import__("re").search(message, str(err)), str(err)


def test_check_errors_raises_the_root_cause_with_every_message():
    from megatron_mok.functional.faults import raise_all

    peer = MoKPeerError("MoK: EP rank 0 stopped an earlier MoK call with MoKTimeoutError")
    root = MoKTimeoutError("MoK: EP rank 0 waited more than 1 s for EP rank 1")
    with pytest.raises(MoKTimeoutError, match=r"MoK recorded 2 errors:\n- MoK: EP rank 0 stopped.*\n- MoK: EP rank 0 "
                                              r"waited"):
        raise_all([peer, root])
