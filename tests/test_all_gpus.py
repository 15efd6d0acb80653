"""Both GPU backends with one process per GPU on every GPU of the machine (EP = P = the GPU
count, at least 2): outputs and gradients against the fp32 oracle, bitwise determinism, CUDA
graph replay, and a barrier timeout that names the rank that never came. The cases scale with
P, so the same command validates 2, 4 or 8 GPUs (issue 6):

    python -m pytest -m gpun tests/test_all_gpus.py

Skipped with a printed reason with fewer than two sm_90 GPUs."""

from __future__ import annotations

import time

import pytest
import torch

from megatron_mok import MoKConfig
from megatron_mok.functional import MoKTimeoutError, check_errors, mok_moe

from .distributed import run_ranks
from .gpu_cases import check_rank_runs, gpu_case, leaves

pytestmark = pytest.mark.gpun

BACKENDS = ["cuda", "megakernel"]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def sweep(P: int):
    """(seed, tokens per rank, H, I, experts per rank, top-k, routing) for P ranks: the real
    Kimi-K2 layer shape with uniform routing; Zipf routing with uneven token counts; one hot
    expert with a rank that has a single token; empty experts; top-1."""
    uneven = [3000 - 997 * (r % 3) for r in range(P)]
    return [
        (181, [4096] * P, 7168, 2048, 6, 8, "uniform"),
        (182, uneven, 2048, 1024, 16, 4, "zipf"),
        (183, [777] * (P - 1) + [1], 1024, 512, 3, 2, "hot"),
        (184, [512 + r for r in range(P)], 1024, 512, 12, 8, "empty"),
        (185, [256] * P, 1024, 512, 2, 1, "uniform"),
    ]


def _config(backend: str) -> MoKConfig:
    # The megakernel with a small ring, so the hot expert's rows wrap it many times.
    if backend == "megakernel":
        return MoKConfig(max_tokens_per_rank=4096, timeout_s=30.0, minibatch_rows=256, ring_rows=512)
    return MoKConfig(max_tokens_per_rank=4096, timeout_s=30.0)


def _oracle_worker(rank, world, backend):
    import torch.distributed as dist

    for spec in sweep(world):
        seed, tokens, H, I, L, K, routing = spec
        case = gpu_case(seed, tokens, H, I, L, K, routing)
        runs = []
        for _ in range(2):
            x, w, fc1, fc2 = leaves(case, rank)
            y = mok_moe(x, case.ids[rank], w, fc1, fc2, ep_group=dist.group.WORLD, config=_config(backend),
                        backend=backend)
            y.backward(case.dy[rank])
            torch.cuda.synchronize()
            check_errors()
            runs.append((y.detach(), x.grad, w.grad, fc1.grad, fc2.grad))
        check_rank_runs(case, rank, runs, f"{backend} P={world} {spec}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_gpus_match_the_oracle_and_are_bitwise_stable(backend):
    run_ranks(_oracle_worker, _gpus(), backend, backend="nccl")


def _graph_worker(rank, world, backend):
    """Capture one forward + backward per rank in a CUDA graph, replay it on new inputs and
    routing, and compare with eager calls bit for bit (every rank does the same, in step)."""
    import torch.distributed as dist

    group, config = dist.group.WORLD, _config(backend)
    H, I, L, K, T = 2048, 1024, 4, 4, 1024
    case = gpu_case(191, [T] * world, H, I, L, K)
    x, w, fc1, fc2 = leaves(case, rank)
    ids, dy = case.ids[rank].clone(), case.dy[rank].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the workspace, the library, the ring
        for _ in range(2):
            mok_moe(x, ids, w, fc1, fc2, ep_group=group, config=config, backend=backend).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for t in (x, w, fc1, fc2):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = mok_moe(x, ids, w, fc1, fc2, ep_group=group, config=config, backend=backend)
        y_static.backward(dy)
    static = [y_static, x.grad, w.grad, fc1.grad, fc2.grad]
    for seed in (192, 193):
        new = gpu_case(seed, [T] * world, H, I, L, K, "zipf")
        nx, nw, n1, n2 = leaves(new, rank)
        with torch.no_grad():
            x.copy_(nx); w.copy_(nw); fc1.copy_(n1); fc2.copy_(n2)
            ids.copy_(new.ids[rank]); dy.copy_(new.dy[rank])
        graph.replay()
        torch.cuda.synchronize()
        check_errors()
        y = mok_moe(nx, new.ids[rank], nw, n1, n2, ep_group=group, config=config, backend=backend)
        y.backward(new.dy[rank])
        torch.cuda.synchronize()
        check_errors()
        for name, got, want in zip(("y", "dx", "dw", "d_fc1", "d_fc2"), static, (y, nx.grad, nw.grad, n1.grad,
                                                                                 n2.grad)):
            assert not torch.isnan(got.float()).any(), f"{backend} P={world} rank {rank}: {name} NaN after replay"
            assert torch.equal(got, want), f"{backend} P={world} rank {rank} seed {seed}: replayed {name} differs"


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_gpus_cuda_graph_replays_with_new_inputs(backend):
    run_ranks(_graph_worker, _gpus(), backend, backend="nccl")


def _timeout_worker(rank, world, backend):
    """Every rank makes one call together; then the last rank skips a call and each other rank
    must get a timeout error that names it, and NaN outputs, instead of hanging."""
    import torch.distributed as dist

    case = gpu_case(195, [128] * world, 1024, 512, 2, 2)
    config = MoKConfig(timeout_s=2.0)
    x, w, fc1, fc2 = leaves(case, rank)
    mok_moe(x, case.ids[rank], w, fc1, fc2, ep_group=dist.group.WORLD, config=config, backend=backend)
    torch.cuda.synchronize()
    check_errors()
    missing = world - 1
    if rank != missing:
        start = time.monotonic()
        y = mok_moe(x, case.ids[rank], w, fc1, fc2, ep_group=dist.group.WORLD, config=config, backend=backend)
        with pytest.raises(MoKTimeoutError, match=rf"for EP rank {missing}\b"):
            check_errors()
        assert time.monotonic() - start < 2.0 + 10, "the timeout took too long to surface"
        assert torch.isnan(y.float()).all(), "a call that timed out must not return numbers"
    else:
        time.sleep(8.0)  # skip the call; stay alive until the others have timed out


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_gpus_barrier_timeout_names_the_missing_rank(backend):
    run_ranks(_timeout_worker, _gpus(), backend, backend="nccl")
