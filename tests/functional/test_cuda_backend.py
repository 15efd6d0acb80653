"""The ``cuda`` backend against the fp32 oracle on the GPU: P = 1, P virtual ranks on one GPU,
P = 2 real processes (two GPUs); determinism, CUDA graph capture, the barrier timeout, bad
ids and capacity errors. Skipped with a printed reason without an sm_90 GPU."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from megatron_mok import MegakernelTunables, MoKConfig
from megatron_mok.functional import (LocalEPGroup, MoKCapacityError, MoKMismatchError, MoKRuntimeError,
                                     MoKTimeoutError, check_errors, mok_moe)
from megatron_mok.functional.workspace import release_workspaces

from tests.distributed import run_ranks
from tests.gpu_cases import check_against_oracle, check_graph_replay, check_rank_runs, gpu_case, leaves, run_case

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _collect_failed_groups():
    """A test's virtual group (and its workspaces, failed ones included) goes away with it, so a
    later test's check_errors() sees only its own."""
    yield
    gc.collect()


def _leaves(case, rank):
    return leaves(case, rank)


def _run_ranks(case, ep_groups, config, streams=None):
    """Forward then backward of every rank with the cuda backend (each on its own stream when
    given). Returns per rank (y, dx, dw, d_fc1, d_fc2)."""
    return run_case(case, ep_groups, config, "cuda", streams)


def _check_against_oracle(case, results, label):
    check_against_oracle(case, results, label)


# (seed, tokens per rank, H, I, experts per rank, top-k, routing)
SWEEP_P1 = [
    (1, [1], 1024, 512, 1, 1, "uniform"),
    (2, [1000], 2048, 1024, 8, 2, "uniform"),
    (3, [4096], 7168, 2048, 32, 8, "uniform"),
    (4, [8192], 4096, 1536, 16, 8, "zipf"),
    (5, [3001], 2048, 768, 12, 4, "hot"),
    (6, [777], 1024, 512, 24, 6, "empty"),
    (7, [513], 1024, 256, 192, 8, "uniform"),
    (8, [640], 1024, 512, 8, 3, "unused"),
]


@pytest.mark.parametrize("spec", SWEEP_P1, ids=lambda s: f"T{s[1][0]}-H{s[2]}-L{s[4]}-k{s[5]}-{s[6]}")
def test_cuda_backend_p1_matches_oracle(spec):
    seed, tokens, H, I, L, K, routing = spec
    case = gpu_case(seed, tokens, H, I, L, K, routing)
    config = MoKConfig()
    first = _run_ranks(case, [None], config)
    # Poison the combine slots (and the backward's scalar slots): a slot the kernels forget to
    # write shows up as NaN in the next run's outputs.
    from megatron_mok.functional.workspace import _workspaces

    for ws in _workspaces.values():
        ws.slots.fill_(float("nan"))
        ws.scalars.fill_(float("nan"))
    second = _run_ranks(case, [None], config)
    _check_against_oracle(case, second, f"P=1 {spec}")
    for a, b in zip(first[0], second[0]):
        assert torch.equal(a, b), f"results differ between two runs ({spec})"


@pytest.mark.parametrize("gemms", ["hopper", "torch"])
@pytest.mark.parametrize("spec", [(41, [2000], 2048, 1024, 8, 4, "hot"), (42, [777], 1024, 512, 24, 6, "empty"),
                                  (43, [1500], 4096, 1536, 12, 8, "zipf")],
                         ids=lambda s: f"T{s[1][0]}-H{s[2]}-I{s[3]}-L{s[4]}-{s[6]}")
def test_cuda_backend_gemm_families_match_oracle(spec, gemms, monkeypatch):
    """Both GEMM families (MoK's Hopper GEMMs with SwiGLU in their epilogues, and
    torch._grouped_mm with the separate SwiGLU kernels that shapes MoK's GEMMs refuse run) give
    the oracle's outputs and gradients, bitwise stable."""
    from megatron_mok.functional import expert_ffn
    from megatron_mok.functional.validate import MoEShape

    seed, tokens, H, I, L, K, routing = spec
    shape = MoEShape(tokens=tokens[0], hidden=H, topk=K, experts_per_rank=L, ffn_hidden=I)
    assert expert_ffn.hopper_gemms_apply(shape, 128)
    if gemms == "torch":  # as for a shape the Hopper GEMMs refuse
        monkeypatch.setattr(expert_ffn, "hopper_gemms_apply", lambda shape, tile_rows: False)
    expert_ffn.expert_call.cache_clear()  # the GEMM family is chosen once per (config, shape)
    try:
        case = gpu_case(seed, tokens, H, I, L, K, routing)
        first = _run_ranks(case, [None], MoKConfig())
        second = _run_ranks(case, [None], MoKConfig())
    finally:
        expert_ffn.expert_call.cache_clear()
    _check_against_oracle(case, second, f"{gemms} {spec}")
    for a, b in zip(first[0], second[0]):
        assert torch.equal(a, b), f"{gemms}: results differ between two runs ({spec})"


SWEEP_VIRTUAL = [
    (11, [3000, 1234], 2048, 1024, 4, 4, "uniform"),
    (12, [4096, 4096], 7168, 2048, 6, 8, "zipf"),
    (13, [1, 700], 1024, 512, 3, 2, "hot"),
    (14, [513, 0, 999, 64], 1024, 512, 6, 8, "empty"),
    (15, [300, 301, 302, 303], 1024, 256, 2, 1, "uniform"),
]


@pytest.mark.parametrize("spec", SWEEP_VIRTUAL, ids=lambda s: f"P{len(s[1])}-H{s[2]}-L{s[4]}-k{s[5]}-{s[6]}")
def test_cuda_backend_virtual_ranks_match_oracle(spec):
    seed, tokens, H, I, L, K, routing = spec
    case = gpu_case(seed, tokens, H, I, L, K, routing)
    group = LocalEPGroup(len(tokens))
    config = MoKConfig(max_tokens_per_rank=max(tokens), timeout_s=20.0)
    first = _run_ranks(case, group.ranks, config, group.streams)
    second = _run_ranks(case, group.ranks, config, group.streams)
    _check_against_oracle(case, second, f"virtual {spec}")
    for r in range(len(tokens)):
        for a, b in zip(first[r], second[r]):
            assert torch.equal(a, b), f"rank {r} results differ between two runs ({spec})"


def test_cuda_backend_cuda_graph_replays_with_new_inputs():
    check_graph_replay("cuda", MoKConfig(), seeds=(21, 22, 23))


def test_barrier_timeout_names_the_missing_rank():
    group = LocalEPGroup(2)
    case = gpu_case(31, [256, 256], 1024, 512, 2, 2)
    timeout = 1.0
    config = MoKConfig(max_tokens_per_rank=256, timeout_s=timeout)
    x, w, fc1, fc2 = _leaves(case, 0)
    start = time.monotonic()
    with torch.cuda.stream(group.streams[0]):  # rank 1 never makes the call
        y = mok_moe(x, case.ids[0], w, fc1, fc2, ep_group=group[0], config=config, backend="cuda")
    with pytest.raises(MoKTimeoutError, match=r"EP rank 0 waited more than 1 s for EP rank 1"):
        check_errors()
    elapsed = time.monotonic() - start
    assert elapsed < timeout + 10, f"the timeout took {elapsed:.1f} s to surface"
    assert torch.isnan(y.float()).all(), "a call that timed out must not return numbers"
    del y, group
    gc.collect()  # the failed workspace goes with its group; later check_errors() stay clean


def test_bad_expert_id_is_reported_and_output_is_nan():
    release_workspaces()
    case = gpu_case(41, [64], 1024, 512, 4, 2)
    ids = case.ids[0].clone()
    ids[5, 1] = 99  # E = 4
    x, w, fc1, fc2 = _leaves(case, 0)
    y = mok_moe(x, ids, w, fc1, fc2, backend="cuda")
    torch.cuda.synchronize()
    assert torch.isnan(y.float()).all()
    with pytest.raises(MoKRuntimeError, match="expert id 99"):
        mok_moe(x, case.ids[0], w, fc1, fc2, backend="cuda")
    release_workspaces()


@pytest.mark.parametrize("backend", ["cuda", "megakernel"])
def test_virtual_ranks_with_different_tunables_get_the_mismatch_error(backend):
    """A virtual rank whose settings differ from an earlier rank's raises the mismatch error
    before it queues anything and tells the earlier rank, already queued, through its failure
    word: that rank's output is NaN and its next check names the rank. Nothing waits for the
    timeout."""
    from megatron_mok.functional import MoKPeerError

    group = LocalEPGroup(2)
    case = gpu_case(52, [256, 256], 1024, 512, 2, 2)
    base = dict(max_tokens_per_rank=256, timeout_s=10.0)  # a timeout would give MoKTimeoutError, not these
    configs = [MoKConfig(**base), MoKConfig(**base, megakernel=MegakernelTunables(group_blocks=16))]
    for rank in range(2):
        x, w, fc1, fc2 = _leaves(case, rank)
        with torch.cuda.stream(group.streams[rank]):
            if rank == 0:
                y0 = mok_moe(x, case.ids[0], w, fc1, fc2, ep_group=group[0], config=configs[0], backend=backend)
            else:
                with pytest.raises(MoKMismatchError,
                                   match=r"megakernel.group_blocks: EP rank 0 has None, EP rank 1 has 16"):
                    mok_moe(x, case.ids[1], w, fc1, fc2, ep_group=group[1], config=configs[1], backend=backend)
    with pytest.raises(MoKPeerError, match=r"EP rank 1 stopped an earlier MoK call with MoKConfigError .*EP rank "
                                           r"0 learned it at the forward dispatch .* its output of that call is NaN"):
        check_errors(group[0])
    with pytest.raises(MoKRuntimeError, match=r"EP rank 1 stopped an earlier MoK call with MoKConfigError .*before "
                                              r"queueing it"):
        check_errors(group[1])
    assert torch.isnan(y0.float()).all()
    del y0, group
    gc.collect()


def test_capacity_is_checked_before_gpu_work():
    group = LocalEPGroup(2)
    case = gpu_case(51, [64, 64], 1024, 512, 2, 2)
    x, w, fc1, fc2 = _leaves(case, 0)
    with pytest.raises(MoKCapacityError, match="max_tokens_per_rank"):
        mok_moe(x, case.ids[0], w, fc1, fc2, ep_group=group[0], config=MoKConfig(max_tokens_per_rank=32),
                backend="cuda")
    del group
    gc.collect()


# ------------------------------------------------------------------------------------------
# Two processes on two GPUs (nvidia-h200-x2): the real peer-memory path.

SWEEP_P2 = [
    (61, [4096, 4096], 7168, 2048, 6, 8, "uniform"),
    (62, [3000, 1234], 2048, 1024, 16, 4, "zipf"),
    (63, [777, 1], 1024, 512, 3, 1, "hot"),
    (64, [512, 513], 1024, 512, 12, 8, "empty"),
]


def _p2_worker(rank, world, specs):
    import torch.distributed as dist

    group = dist.group.WORLD
    for spec in specs:
        seed, tokens, H, I, L, K, routing = spec
        case = gpu_case(seed, tokens, H, I, L, K, routing)
        leaves = _leaves(case, rank)
        runs = []
        for _ in range(2):
            x, w, fc1, fc2 = (t.detach().clone().requires_grad_() for t in leaves)
            y = mok_moe(x, case.ids[rank], w, fc1, fc2, ep_group=group, backend="cuda")
            y.backward(case.dy[rank])
            torch.cuda.synchronize()
            runs.append((y.detach(), x.grad, w.grad, fc1.grad, fc2.grad))
        check_rank_runs(case, rank, runs, f"P=2 {spec}")


@pytest.mark.gpu2
def test_cuda_backend_two_gpus_match_oracle():
    run_ranks(_p2_worker, 2, SWEEP_P2, backend="nccl")


def _p2_timeout_worker(rank, world):
    case = gpu_case(71, [128, 128], 1024, 512, 2, 2)
    import torch.distributed as dist

    config = MoKConfig(timeout_s=2.0)
    x, w, fc1, fc2 = _leaves(case, rank)
    # A first call together creates the workspace (collective).
    mok_moe(x, case.ids[rank], w, fc1, fc2, ep_group=dist.group.WORLD, config=config, backend="cuda")
    torch.cuda.synchronize()
    if rank == 0:
        start = time.monotonic()
        y = mok_moe(x, case.ids[rank], w, fc1, fc2, ep_group=dist.group.WORLD, config=config, backend="cuda")
        with pytest.raises(MoKTimeoutError, match=r"for EP rank 1 \(global rank 1\)"):
            check_errors()
        assert time.monotonic() - start < 2.0 + 10
        assert torch.isnan(y.float()).all()
    else:
        time.sleep(6.0)  # skip the call; stay alive until rank 0 has timed out


@pytest.mark.gpu2
def test_barrier_timeout_two_gpus_names_the_missing_rank():
    run_ranks(_p2_timeout_worker, 2, backend="nccl")


def _p2_mismatch_worker(rank, world, backend):
    import torch.distributed as dist

    case = gpu_case(72, [128, 128], 1024, 512, 2, 2)
    x, w, fc1, fc2 = _leaves(case, rank)
    config = MoKConfig(timeout_s=5.0, megakernel=MegakernelTunables(group_blocks=8 if rank == 0 else 16))
    with pytest.raises(MoKMismatchError, match=r"megakernel.group_blocks: EP rank 0 \(global rank 0\) has 8, "
                                               r"EP rank 1 \(global rank 1\) has 16"):
        mok_moe(x, case.ids[rank], w, fc1, fc2, ep_group=dist.group.WORLD, config=config, backend=backend)
    torch.cuda.synchronize()
    check_errors()  # nothing was launched: no timeout recorded anywhere


@pytest.mark.gpu2
@pytest.mark.parametrize("backend", ["cuda", "megakernel"])
def test_two_gpus_with_different_tunables_get_the_mismatch_error_on_both(backend):
    run_ranks(_p2_mismatch_worker, 2, backend, backend="nccl")
